"""A request's sampling fields turned into `generate()` options, validated before the request is queued.

Two kinds of model, told apart by `row_seeds_option` (never by family name):
- a model whose `generate()` has per-row seeds (every multi-token family): the request's fields become the family's
  own options, resolved as its `generate()` resolves them (`GenerationOptions.resolved`), so what the family refuses
  comes back as a 400 with the family's own message; rows with equal resolved options share a batch;
- a model on transformers' `generate()` (the AR baseline): `modeling.sampling.RowSampler` draws each row from its
  own `torch.Generator` at its own temperature and top-p as the greedy pick, so any rows can share a batch and
  each gets the tokens it would get alone.

A field the request leaves out is not passed to a multi-token family, whose generation config carries its own
defaults; the AR model follows OpenAI (temperature 1, top_p 1) unless its generation config samples otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..modeling.generation import GenerationOptions
from .protocol import invalid

# The sampling fields every family's options class carries (the base class's), filled from the generation config
# when a call leaves them out, as the family's generate() does.
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationOptions))
MAX_SEED = 2**63  # torch.Generator.manual_seed takes any int below it (and >= 0 here)


@dataclass(frozen=True)
class RowSampling:
    """How one row samples.

    options: the `generate()` options its batch passes (a multi-token family's own options; empty for the AR path).
    batch_key: rows with equal keys may share one `generate()` call.
    seed: the row's RNG seed (the family's per-row seed, or `RowSampler`'s generator).
    temperature / top_p: the row's own, applied by `RowSampler` (None for a family with per-row seeds).
    """

    options: dict
    batch_key: tuple
    seed: int
    temperature: float | None = None
    top_p: float | None = None

    @property
    def per_row_sampler(self) -> bool:
        return self.temperature is not None


def resolve_sampling(model, temperature: float | None, top_p: float | None, seed: int, extra: dict) -> RowSampling:
    """The `RowSampling` of a request, or an `OpenAIError` 400 naming what is wrong: OpenAI's ranges
    (temperature in [0, 2], top_p in (0, 1], seed in [0, 2^63)), an unknown field, or what the family refuses."""
    if temperature is not None and not 0 <= temperature <= 2:
        raise invalid(f"temperature must be between 0 and 2, got {temperature}", param="temperature")
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if not 0 <= seed < MAX_SEED:
        raise invalid(f"seed must be in [0, 2^63), got {seed}", param="seed")
    if getattr(model, "row_seeds_option", None) is None:
        return resolve_per_row_sampler(model, temperature, top_p, seed, extra)
    return resolve_family_options(model, temperature, top_p, seed, extra)


def resolve_per_row_sampler(model, temperature, top_p, seed, extra) -> RowSampling:
    if extra:
        name = sorted(extra)[0]
        raise invalid(f"Unrecognized request argument supplied: {name} (this model takes OpenAI's sampling fields "
                      f"only: temperature, top_p, seed, stop, max_tokens)", param=name)
    gen = model.generation_config
    samples = bool(gen.do_sample)  # transformers' default config is greedy: then OpenAI's defaults apply
    if temperature is None:
        temperature = gen.temperature if samples and gen.temperature is not None else 1.0
    if top_p is None:
        top_p = gen.top_p if samples and gen.top_p is not None else 1.0
    return RowSampling({}, ("per-row sampler",), seed, float(temperature), float(top_p))


def resolve_family_options(model, temperature, top_p, seed, extra) -> RowSampling:
    options_class = model.generation_options_class
    fields = [f.name for f in dataclasses.fields(options_class)]
    seeds_option = model.row_seeds_option
    requested = {}
    if temperature == 0:
        requested["do_sample"] = False  # OpenAI's temperature 0 is greedy decoding, transformers' do_sample=False
    elif temperature is not None:
        requested["temperature"] = temperature
    if top_p is not None:
        requested["top_p"] = top_p
    for name, value in extra.items():
        if name == seeds_option:
            raise invalid(f"{name} is set by the server from the request's seed; send seed instead", param=name)
        if name not in fields:
            own = ", ".join(f for f in fields if f not in SAMPLING_FIELDS and f != seeds_option)
            raise invalid(f"Unrecognized request argument supplied: {name} (besides OpenAI's fields this model takes "
                          f"its generate() options: {own})", param=name)
        requested[name] = value
    gen = model.generation_config
    merged = {name: getattr(gen, name) for name in SAMPLING_FIELDS
              if name in fields and getattr(gen, name, None) is not None}
    merged.update(requested)
    try:
        resolved = options_class(**merged, **{seeds_option: [0]}).resolved(model.config, 1)
    except (ValueError, TypeError) as err:
        message = str(err)
        raise invalid(message, param=next((name for name in requested if name in message), None)) from None
    key = tuple((f.name, repr(getattr(resolved, f.name))) for f in dataclasses.fields(resolved)
                if f.name != seeds_option)
    return RowSampling(requested, key, seed)
