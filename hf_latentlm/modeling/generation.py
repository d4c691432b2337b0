# Copyright 2025 The hf-latentlm authors. Licensed under the Apache License, Version 2.0.
"""The `generate()` every multi-token family shares, in the spirit of diffusers' schedulers: the skeleton owns
the transformers-style arguments (lengths, EOS, padding, left-padded `attention_mask`, streamer, output class) and
the loop; a family supplies a typed options dataclass, a prefill that returns its decoding state, and a `step`
that turns the state into the next candidate tokens.

Copied into Hub checkpoints, so torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from transformers import (CompileConfig, GenerationConfig, GenerationMixin, RepetitionPenaltyLogitsProcessor,
                          StoppingCriteriaList)
from transformers.cache_utils import DynamicCache
from transformers.utils import ModelOutput

from .layers import block_causal_layout

# transformers' fallback when neither `max_new_tokens` nor `max_length` is set anywhere.
DEFAULT_MAX_LENGTH = 20

# Options of transformers' generate() that these loops accept without acting on them: they concern outputs the
# loops do not produce (scores, logits) or the cache, which is always used.
HARMLESS_HF_OPTIONS = frozenset({"use_cache", "bos_token_id", "output_scores", "output_logits"})
# Options of transformers' generate() that `resolve_generation_request` reads.
REQUEST_OPTIONS = frozenset({"num_beams", "eos_token_id", "pad_token_id", "max_length", "min_new_tokens"})
# Sampling fields of a GenerationConfig that a family's options honour or refuse (`GenerationOptions`); a call's own
# values win over the generation config's, as in transformers.
SAMPLING_OPTIONS = ("do_sample", "temperature", "top_k", "top_p")
# GenerationConfig fields only some families' options carry: filled from the generation config for those only.
FAMILY_GENERATION_CONFIG_OPTIONS = ("repetition_penalty",)


@dataclass
class GenerateOutput(ModelOutput):
    """What `generate(..., return_dict_in_generate=True)` returns for every multi-token family.

    sequences: [B, T + new] prompt and new tokens; rows that stopped early are padded with `pad_token_id`.
    model_calls: [B] network evaluations made while the row was unfinished, prompt prefill included.
    num_new_tokens: [B] tokens generated per row (up to and including EOS).
    calls_by_network: for families with several networks (Cola DLM: the DiT, the VAE encoder and decoder), network
        name -> [B] evaluations of that network, which sum to `model_calls`; None for single-network families.
    """

    sequences: torch.LongTensor | None = None
    model_calls: torch.LongTensor | None = None
    num_new_tokens: torch.LongTensor | None = None
    calls_by_network: dict[str, torch.LongTensor] | None = None


@dataclass
class GenerationRequest:
    """The resolved transformers-wide arguments of one `generate()` call."""

    attention_mask: torch.Tensor  # [B, T], left padding, last column all ones
    max_new_tokens: int
    min_new_tokens: int  # EOS does not stop a row before this many new tokens
    eos_ids: torch.Tensor  # [E] ids that stop a row (empty: never stop)
    pad_token_id: int
    prompt_lengths: torch.Tensor  # [B] real (unpadded) tokens per row


@dataclass
class GenerationOptions:
    """Base of each family's own `generate()` options (a dataclass of documented fields, popped from the call by
    name). It carries transformers' sampling options, which a family honours or refuses by name in `resolved`, and
    names the family (for messages) and its per-row seed option (one RNG seed per row, so that a row gives the same
    tokens alone or in any batch)."""

    family: ClassVar[str] = "this model"
    row_seeds_option: ClassVar[str | None] = None

    do_sample: bool = True
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def resolved(self, config, batch_size: int) -> "GenerationOptions":
        """A copy with defaults filled from `config` and every value checked (ValueError naming the option)."""
        raise NotImplementedError

    @classmethod
    def sampling_defaults(cls, config) -> dict:
        """What the family does when no sampling option is given, as GenerationConfig fields. Loaded models carry
        them in their generation config, so that callers that fill unset fields with their own defaults (the
        text-generation pipeline's temperature 0.7) leave the family's decoding alone."""
        return {"do_sample": True}


@dataclass
class BlockLatentGenerationOptions(GenerationOptions):
    """Options every block-latent family (Cola DLM, AURORA-LM) shares: `num_inference_steps` (default
    config.num_inference_steps) ODE steps per block, `timestep_shift` (default 1.0, the uniform grid; > 1 spends more
    steps at high noise), `temperature` of the decoder's read-out (default config.decode_temperature; 0 or
    do_sample=False takes the most likely token) and `noise_seeds` (one per row). top_k / top_p are refused unless
    0 / 1.0.
    repetition_penalty (default 1.0: none): before each block is read out, the logit s of every token the decoder
        has read out earlier in this call (the prompt excluded; a prompt's re-decoded partial block included)
        becomes s·p if s < 0, else s/p, as the official Cola DLM inference does.
    block_seed_offset (default None: a row's generator runs on from block to block): when set, block n of this call
        (n = 0, 1, ...) starts from noise drawn by a fresh generator seeded `noise_seeds[b] + n·block_seed_offset`,
        the official Cola DLM inference's per-sample seeding (offset 10,000,000; its seed of sample `id` is
        base + 1000·id)."""

    row_seeds_option: ClassVar[str] = "noise_seeds"

    num_inference_steps: int | None = None
    timestep_shift: float | None = None
    noise_seeds: list[int] | None = None
    repetition_penalty: float | None = None
    block_seed_offset: int | None = None

    def resolved_block_options(self, config, batch_size: int) -> dict:
        """The shared fields resolved and checked (ValueError naming the option), for `dataclasses.replace`."""
        refuse_token_filters(self.family, "the read-out is greedy or plain sampling; use temperature", self.top_k,
                             self.top_p)
        steps = config.num_inference_steps if self.num_inference_steps is None else self.num_inference_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"num_inference_steps must be a positive int, got {steps!r}")
        shift = 1.0 if self.timestep_shift is None else float(self.timestep_shift)
        if not shift > 0:
            raise ValueError(f"timestep_shift must be > 0, got {shift}")
        temperature = config.decode_temperature if self.temperature is None else float(self.temperature)
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 for the {self.family} read-out, got {temperature}")
        penalty = 1.0 if self.repetition_penalty is None else float(self.repetition_penalty)
        if not penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {penalty}")
        offset = self.block_seed_offset
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int) or offset < 0):
            raise ValueError(f"block_seed_offset must be a non-negative int, got {offset!r}")
        return {"num_inference_steps": steps, "timestep_shift": shift,
                "temperature": temperature if self.do_sample else 0.0,
                "noise_seeds": row_seeds(self.noise_seeds, batch_size, "noise_seeds"),
                "repetition_penalty": penalty}

    @classmethod
    def sampling_defaults(cls, config) -> dict:
        return {"do_sample": True, "temperature": float(config.decode_temperature)}


class DecodingStep(NamedTuple):
    """What a family's `_decoding_step` returns: candidate tokens [B, W], how many of each row's leading candidates
    count ([B]; None: all W), and how many network evaluations the step made for each unfinished row (an int, or
    network name -> count for a family with several networks)."""

    tokens: torch.Tensor
    counts: torch.Tensor | None = None
    model_calls: int | dict[str, int] = 1


class DenoisedBlock(NamedTuple):
    """What a block-latent family's `_denoise_block` returns: the block's clean latents [B, Q, D] and how many prior
    evaluations solving it took."""

    latents: torch.Tensor
    prior_calls: int


class CallTally:
    """Per-row network evaluations, counted only while a row is unfinished, by network name when a family names
    them (a plain int count is filed under "model")."""

    def __init__(self, batch: int, device):
        self.batch, self.device, self.by_network = batch, device, {}

    def add(self, calls: int | dict[str, int], active: torch.Tensor | None = None) -> None:
        for name, count in (calls if isinstance(calls, dict) else {"model": calls}).items():
            total = self.by_network.setdefault(name, torch.zeros(self.batch, dtype=torch.long, device=self.device))
            total += count if active is None else count * active.long()

    def total(self) -> torch.Tensor:
        return sum(self.by_network.values(), torch.zeros(self.batch, dtype=torch.long, device=self.device))

    def named(self) -> dict[str, torch.Tensor] | None:
        return None if set(self.by_network) <= {"model"} else dict(self.by_network)


@dataclass
class BlockAlignedPrompts:
    """Left-padded prompts laid out for a block-latent family (one latent per token, blocks of Q counted from each
    row's first real token): rows are left-padded by whole blocks so that every row's current (first generated)
    block sits in the same columns. `input_ids` / `real` [B, W]: the layout and its real columns, W =
    history_blocks·Q + the longest partial block; `complete_blocks` [B]: the row's complete prompt blocks (its clean
    history); `known_length` [B]: its tokens in the partial last block (the known part of the first block)."""

    input_ids: torch.Tensor
    real: torch.Tensor
    complete_blocks: torch.Tensor
    known_length: torch.Tensor
    history_blocks: int


def block_aligned_prompts(input_ids: torch.Tensor, request: GenerationRequest, block_size: int) -> BlockAlignedPrompts:
    lengths = request.prompt_lengths
    complete, known_len = lengths // block_size, lengths % block_size
    history_blocks = int(complete.max())
    width = history_blocks * block_size + int(known_len.max())
    # Row b's real tokens start at column (history_blocks - complete_b)·Q of the aligned layout.
    start = (history_blocks - complete) * block_size
    column = torch.arange(width, device=input_ids.device)
    real = (column[None] >= start[:, None]) & (column[None] < (start + lengths)[:, None])
    source = (input_ids.shape[1] - lengths)[:, None] + column[None] - start[:, None]
    aligned = torch.where(real, input_ids.gather(1, source.clamp(0, input_ids.shape[1] - 1)),
                          torch.full_like(source, request.pad_token_id))
    return BlockAlignedPrompts(aligned, real, complete, known_len, history_blocks)


def check_prompt(input_ids: torch.Tensor | None) -> None:
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty [batch, length] tensor (empty batch or empty prompt)")


def pop_options(options_class: type, kwargs: dict) -> Any:
    """An `options_class` dataclass built from the entries of `kwargs` named after its fields (removed from kwargs)."""
    names = [f.name for f in dataclasses.fields(options_class)]
    return options_class(**{name: kwargs.pop(name) for name in names if name in kwargs})


def reject_unknown_options(kwargs: dict, family: str) -> None:
    """Call after every honoured option was popped: drop the harmless ones and name the rest."""
    unknown = sorted(name for name in kwargs if name not in HARMLESS_HF_OPTIONS)
    if unknown:
        raise ValueError(f"unsupported generation option(s) for {family}: {unknown}")


def refuse_token_filters(family: str, reason: str, top_k: int | None, top_p: float | None) -> None:
    """top-k / top-p need token probabilities a family may not have; their no-op values (0 / 1.0) pass."""
    if top_k not in (None, 0):
        raise ValueError(f"top_k is not supported by {family} generate ({reason})")
    if top_p not in (None, 1.0):
        raise ValueError(f"top_p is not supported by {family} generate ({reason})")


def row_seeds(seeds: list[int] | None, batch: int, name: str) -> list[int]:
    """One RNG seed per row, so a row's random draws do not depend on the rest of the batch. Default: drawn from
    the global torch RNG (`torch.manual_seed` makes a call repeatable)."""
    if seeds is None:
        return torch.randint(0, 2**62, (batch,)).tolist()
    if len(seeds) != batch:
        raise ValueError(f"{name} has {len(seeds)} entries for a batch of {batch}")
    return [int(s) for s in seeds]


def penalize_repetitions(logits: torch.Tensor, previous: torch.Tensor, penalty: float) -> torch.Tensor:
    """[B, Q, V] logits with the logit s of each token in `previous` [B, n] made s·penalty if s < 0, else
    s/penalty, at every one of the Q positions: transformers' `RepetitionPenaltyLogitsProcessor` on each."""
    batch, block, vocab = logits.shape
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    return processor(previous.repeat_interleave(block, dim=0), logits.reshape(batch * block, vocab)).view(logits.shape)


def read_out_tokens(logits: torch.Tensor, generators: list[torch.Generator], temperature: float) -> torch.Tensor:
    """[B, Q, V] logits of a latent family's decoder -> [B, Q] tokens: argmax at temperature 0, else a draw per row
    from that row's own generator (so a row reads out the same tokens alone or in any batch)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1).cpu()
    draws = [torch.multinomial(probs[b], 1, generator=g)[:, 0] for b, g in enumerate(generators)]
    return torch.stack(draws).to(logits.device)


def resolve_generation_request(family: str, config, generation_config, input_ids: torch.Tensor,
                               attention_mask: torch.Tensor | None, max_new_tokens: int | None, kwargs: dict,
                               streamer=None) -> GenerationRequest:
    """Resolve the transformers-wide options in `kwargs` (`REQUEST_OPTIONS`: `eos_token_id`, `pad_token_id`,
    `max_length`, `min_new_tokens`, `num_beams`; read, not removed) with defaults from `generation_config` then
    `config`, as transformers does, and raise a ValueError naming any problem: beam search, no room for a token, mask
    shape, right padding, prompt + new tokens over `max_position_embeddings`, a streamer with more than one row."""
    gen = generation_config
    if kwargs.get("num_beams", gen.num_beams or 1) > 1:
        raise ValueError(f"num_beams > 1 is not supported by {family}: its tokens are sampled several per call, "
                         f"there are no per-token beams to search")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer supports batch size 1 only")
    eos = kwargs["eos_token_id"] if "eos_token_id" in kwargs else gen.eos_token_id  # None: never stop
    eos_ids = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), dtype=torch.long,
                           device=input_ids.device)
    pad = kwargs.get("pad_token_id")
    if pad is None:
        pad = gen.pad_token_id if gen.pad_token_id is not None else (config.pad_token_id or 0)
    max_length = kwargs.get("max_length")
    if max_new_tokens is None:
        max_new_tokens = gen.max_new_tokens
    if max_new_tokens is None:
        # Like transformers: `max_length` counts the prompt, and 20 is the default when nothing is set.
        max_length = max_length if max_length is not None else (gen.max_length or DEFAULT_MAX_LENGTH)
        max_new_tokens = max_length - input_ids.shape[1]
        if max_new_tokens < 1:
            raise ValueError(f"max_length ({max_length}) leaves no room after the {input_ids.shape[1]}-token prompt; "
                             f"pass max_new_tokens")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    min_new_tokens = kwargs.get("min_new_tokens")
    if min_new_tokens is None:
        min_new_tokens = gen.min_new_tokens or 0
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    if not bool(attention_mask[:, -1].all()):
        raise ValueError(f"{family} generate needs left padding: the last column of attention_mask must be all ones")
    lengths = attention_mask.long().sum(1)
    if int(lengths.max()) + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt ({int(lengths.max())} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    return GenerationRequest(attention_mask, max_new_tokens, int(min_new_tokens), eos_ids, int(pad), lengths)


@functools.lru_cache(maxsize=None)
def compile_entry_point(cls: type, name: str):
    """`cls.<name>` behind a function with a code object of its own, made once per (class, method).

    torch.compile keeps its graphs, at most `recompile_limit` of them, on the code object of the function it is
    given, and every forward behind the same decorator (`head_forward`, transformers' `deprecate_kwarg`) shares that
    decorator's code object: all networks would share one limit (and silently run eager past it). Behind its own
    code object each method's graphs are counted apart, and one class's graphs serve every model of that class."""
    method = getattr(cls, name)

    def entry_point(module, *args, **kwargs):
        return method(module, *args, **kwargs)

    entry_point.__code__ = entry_point.__code__.replace(co_name=f"{cls.__name__}_{name}")
    return entry_point


@contextmanager
def compiled(methods: list[tuple[torch.nn.Module, str]], compile_config: CompileConfig | None):
    """While active, each `module.<name>` of `methods` runs `torch.compile`d with the settings of `compile_config`
    (None: nothing changes), through `compile_entry_point`; nothing is stored on the model. Afterwards the modules run
    their class's methods again."""
    if compile_config is None:
        yield
        return
    if not isinstance(compile_config, CompileConfig):
        raise TypeError(f"compile_config must be a transformers.CompileConfig, got {type(compile_config).__name__}")
    settings = compile_config.to_dict()
    for module, name in methods:
        function = torch.compile(compile_entry_point(type(module), name), **settings)
        setattr(module, name, functools.partial(function, module))  # an instance attribute shadows the method
    # A network called with several argument sets (a DiT's clean pass and its denoising steps), each static then
    # dynamic, can pass the default 8 graphs of its own.
    limit = max(torch._dynamo.config.recompile_limit, 32)
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):
            yield
    finally:
        for module, name in methods:
            delattr(module, name)


class NewTokens:
    """Per-row output buffer: `commit` takes each call's candidate tokens and keeps, per unfinished row, those
    that fit in `max_new_tokens`, up to and including a first EOS (once `min_new_tokens` are out)."""

    def __init__(self, request: GenerationRequest, batch: int, device, streamer=None):
        self.request, self.streamer = request, streamer
        self.tokens = torch.full((batch, request.max_new_tokens), request.pad_token_id, dtype=torch.long,
                                 device=device)
        self.count = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)

    def commit(self, candidates: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """candidates [B, W]; valid [B]: how many leading candidates count (default: all W)."""
        width = candidates.shape[1]
        slot = torch.arange(width, device=candidates.device)[None]
        room = self.request.max_new_tokens - self.count
        fits = slot < (room if valid is None else torch.minimum(valid, room))[:, None]
        is_eos = (torch.isin(candidates, self.request.eos_ids) & fits
                  & (self.count[:, None] + slot >= self.request.min_new_tokens))
        stop_at = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, width)
        keep = fits & (slot < stop_at[:, None]) & ~self.finished[:, None]
        rows, cols = keep.nonzero(as_tuple=True)
        self.tokens[rows, self.count[rows] + cols] = candidates[rows, cols]
        if self.streamer is not None and keep.any():
            self.streamer.put(candidates[0][keep[0]].cpu())
        self.count += keep.sum(1)
        self.finished |= (is_eos & keep).any(1) | (self.count >= self.request.max_new_tokens)

    def stop(self, rows: torch.Tensor) -> None:
        """Finish the rows flagged in `rows` [B] bool (a stopping criterion's verdict): nothing more is committed."""
        self.finished |= rows.to(self.finished.device, torch.bool)

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T + longest row's new tokens]; rows that stopped earlier are padded."""
        return torch.cat([input_ids, self.tokens[:, : int(self.count.max())]], dim=1)


class MultiTokenGenerationMixin(GenerationMixin):
    """`generate()` for families that emit several tokens per network call.

    A family sets `generation_options_class` (its `GenerationOptions` dataclass: its own `generate()` options, each
    documented there, with a `resolved(config, batch_size)` that fills defaults from the config and validates) and
    implements:
    - `_start_decoding(input_ids, request, options) -> (state, prefill_calls)`: encode the prompt and return the
      family's typed decoding state and how many network calls that took (an int, or network name -> count);
    - `_decoding_step(state, new_tokens) -> DecodingStep`: advance the state by one step; `new_tokens` (read
      only) tells how many tokens each row has and which rows are finished.
    """

    generation_options_class: type[GenerationOptions] = GenerationOptions

    @property
    def generation_family(self) -> str:
        return self.generation_options_class.family

    @property
    def row_seeds_option(self) -> str | None:
        """The `generate()` option holding one RNG seed per row."""
        return self.generation_options_class.row_seeds_option

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                 generation_config=None, streamer=None, max_new_tokens: int | None = None,
                 return_dict_in_generate: bool | None = None, **kwargs):
        """Sample continuations of left-padded prompts `input_ids` [B, T].

        Honours the transformers options `max_new_tokens` / `max_length` (default: the generation config's, else
        a total length of 20), `min_new_tokens`, `eos_token_id` (None: never stop), `pad_token_id`,
        `attention_mask` (left padding), `streamer` (batch 1), `stopping_criteria` (a `StoppingCriteriaList`, asked
        after every step as `criteria(sequences, None, num_new_tokens=counts)`: `sequences` [B, T + longest row's
        new tokens], shorter rows padded, `counts` [B] each row's new tokens; a row it flags is finished, so a
        step's tokens past the stop are kept, as a one-token step would have kept them) and
        `return_dict_in_generate` (a `GenerateOutput` with model calls per row) and `compile_config` (a
        `transformers.CompileConfig`, default the generation config's: every network the decoding runs,
        `compiled_methods()`, is `torch.compile`d with it for the call; the same tokens as without), plus the
        family's own options (its `generation_options_class`; `do_sample`, `temperature`, `top_k`, `top_p` default
        to the generation config's). Any other option is refused by name.
        """
        check_prompt(input_ids)
        gen = generation_config if generation_config is not None else self.generation_config
        request = resolve_generation_request(self.generation_family, self.config, gen, input_ids, attention_mask,
                                             max_new_tokens, kwargs, streamer)
        stopping_criteria = kwargs.pop("stopping_criteria", None)
        compile_config = kwargs.pop("compile_config", getattr(gen, "compile_config", None))
        if isinstance(stopping_criteria, (list, tuple)):  # transformers takes a plain list too
            stopping_criteria = StoppingCriteriaList(stopping_criteria)
        option_fields = {field.name for field in dataclasses.fields(self.generation_options_class)}
        for name in SAMPLING_OPTIONS + FAMILY_GENERATION_CONFIG_OPTIONS:
            if name not in kwargs and getattr(gen, name, None) is not None:
                if name in option_fields:
                    kwargs[name] = getattr(gen, name)
                elif getattr(gen, name) != getattr(GenerationConfig(), name):
                    raise ValueError(f"generation_config.{name} = {getattr(gen, name)} is not supported by "
                                     f"{self.generation_family} generate; set it to its default")
        options = pop_options(self.generation_options_class, kwargs)
        reject_unknown_options({name: kwargs[name] for name in kwargs if name not in REQUEST_OPTIONS},
                               self.generation_family)
        options = options.resolved(self.config, input_ids.shape[0])

        with compiled(self.compiled_methods(), compile_config):
            state, prefill_calls = self._start_decoding(input_ids, request, options)
            if streamer is not None:
                streamer.put(input_ids.cpu())
            new = NewTokens(request, input_ids.shape[0], input_ids.device, streamer)
            calls = CallTally(input_ids.shape[0], input_ids.device)
            calls.add(prefill_calls)
            while not new.done:
                step = self._decoding_step(state, new)
                calls.add(step.model_calls, ~new.finished)
                new.commit(step.tokens, step.counts)
                if stopping_criteria is not None:
                    new.stop(stopping_criteria(new.sequences(input_ids), None, num_new_tokens=new.count))
        if streamer is not None:
            streamer.end()

        sequences = new.sequences(input_ids)
        if return_dict_in_generate if return_dict_in_generate is not None else gen.return_dict_in_generate:
            return GenerateOutput(sequences=sequences, model_calls=calls.total(), num_new_tokens=new.count,
                                  calls_by_network=calls.named())
        return sequences

    def adjust_generation_fn(self, *args, **kwargs):
        """After `from_pretrained` loads the generation config: fill the sampling fields it leaves unset with the
        family's own defaults (`GenerationOptions.sampling_defaults`)."""
        super().adjust_generation_fn(*args, **kwargs)
        for name, value in self.generation_options_class.sampling_defaults(self.config).items():
            if getattr(self.generation_config, name, None) is None:
                setattr(self.generation_config, name, value)

    def compiled_methods(self) -> list[tuple[torch.nn.Module, str]]:
        """The (module, method name) pairs that `generate(compile_config=...)` compiles: the forward of every network
        the decoding runs (`counted_modules()`); a family adds the methods outside them that run every step."""
        return [(module, "forward") for module in self.counted_modules()]

    def _start_decoding(self, input_ids: torch.Tensor, request: GenerationRequest, options) -> tuple[Any, int]:
        raise NotImplementedError

    def _decoding_step(self, state, new_tokens: NewTokens) -> DecodingStep:
        raise NotImplementedError


@dataclass
class BlockDecodingState:
    """What block-latent decoding carries from one block to the next. Columns of the caches are latent positions (one
    per token), the prompts' complete blocks left-padded by whole blocks so that every row's current block sits in
    the same columns (`block_aligned_prompts`)."""

    prior_cache: DynamicCache  # the prior's keys of the clean history
    decoder_cache: DynamicCache  # the decoder's keys of every latent so far
    key_valid: torch.Tensor  # [B, cached positions] bool: real (not padding) history positions
    block_positions: torch.Tensor  # [B, Q] positions of the current block
    known: torch.Tensor | None  # [B, Q, D] clean latents of the prompt's last, partial block (first block only)
    known_mask: torch.Tensor | None  # [B, Q] bool
    first_new: torch.Tensor  # [B] index in the current block of the row's first new token
    has_history: torch.Tensor  # [B] bool: the row has a complete block before the current one
    pending_block: torch.Tensor | None  # [B, Q, D] latents of the last finished block, not yet in the prior's cache
    generators: list[torch.Generator]  # one per row, seeded from the options' `noise_seeds`
    options: Any
    read_out: torch.Tensor | None = None  # [B, blocks·Q] every token read out so far (for the repetition penalty)


class BlockLatentGenerationMixin(MultiTokenGenerationMixin):
    """`generate()` of families that denoise one block of latents (one latent per token, blocks of
    `config.block_size` counted from each row's first real token) at a time and read each finished block out with
    a decoder (Cola DLM, AURORA-LM). The prompts' complete blocks are the clean history, run once through the prior
    and the decoder into their caches; a prompt that ends mid-block makes that block the first generated one, with
    its known positions held at their clean latents (repaint). Exactly `max_new_tokens` tokens come back unless EOS
    stops a row (inside a block if need be).

    A family implements, besides its options class:
    - `_encode_prompt(input_ids, real) -> [B, W, D]`: the latents the prior sees for the aligned prompts;
    - `_append_to_prior(latents, attention_mask, cache)`: one clean pass of the prior that writes `cache`;
    - `_decode_latents(latents, attention_mask, cache) -> [B, n, V]` logits (writes `cache`);
    - `_denoise_block(state, noise, positions, conditional_mask) -> DenoisedBlock`: solve the block from `noise`
      (the prior reads `state.prior_cache` only) and count the prior's evaluations.
    `network_names` maps the roles "prior", "encoder" and "decoder" to the names `calls_by_network` reports, and
    `counted_modules()` names their modules. `modeling_block_latent.BlockLatentForCausalLM` implements all but
    `_decode_latents`.
    """

    network_names: ClassVar[dict[str, str]] = {"prior": "prior", "encoder": "encoder", "decoder": "decoder"}

    def _start_decoding(self, input_ids, request, options):
        Q, names = self.config.block_size, self.network_names
        batch, device = input_ids.shape[0], input_ids.device
        layout = block_aligned_prompts(input_ids, request, Q)
        latents = self._encode_prompt(layout.input_ids, layout.real)
        calls = {names["encoder"]: 1, names["prior"]: 0, names["decoder"]: 0}
        width = layout.history_blocks * Q
        history, key_valid = latents[:, :width], layout.real[:, :width]
        prior_cache, decoder_cache = DynamicCache(config=self.config), DynamicCache()
        if layout.history_blocks:
            mask = key_valid.long()
            self._append_to_prior(history, mask, prior_cache)
            self._decode_latents(history, mask, decoder_cache)
            calls.update({names["prior"]: 1, names["decoder"]: 1})
        known_len = layout.known_length
        known_mask = torch.arange(Q, device=device)[None] < known_len[:, None]
        known = torch.zeros(batch, Q, latents.shape[-1], device=device, dtype=latents.dtype)
        tail = latents[:, width:]
        known[:, : tail.shape[1]] = tail
        any_known = bool(known_mask.any())
        state = BlockDecodingState(
            prior_cache=prior_cache, decoder_cache=decoder_cache, key_valid=key_valid,
            block_positions=(layout.complete_blocks * Q)[:, None] + torch.arange(Q, device=device)[None],
            known=known if any_known else None, known_mask=known_mask if any_known else None,
            first_new=known_len, has_history=layout.complete_blocks > 0, pending_block=None,
            generators=[torch.Generator().manual_seed(s) for s in options.noise_seeds], options=options)
        return state, calls

    def _decoding_step(self, state: BlockDecodingState, new_tokens) -> DecodingStep:
        Q, names = self.config.block_size, self.network_names
        batch, device = state.block_positions.shape[0], state.block_positions.device
        calls = {names["encoder"]: 0, names["prior"]: 0, names["decoder"]: 0}
        if state.pending_block is not None:
            mask = torch.cat([state.key_valid, state.key_valid.new_ones(batch, Q)], dim=1).long()
            self._append_to_prior(state.pending_block, mask, state.prior_cache)
            state.key_valid = mask.bool()
            state.has_history = torch.ones_like(state.has_history)
            state.block_positions = state.block_positions + Q
            state.known = state.known_mask = None
            state.first_new = torch.zeros_like(state.first_new)
            calls[names["prior"]] += 1

        # The block's mask is the same at every ODE step: built once (the cached history's real positions plus the
        # block itself).
        history_mask = torch.cat([state.key_valid, state.key_valid.new_ones(batch, Q)], dim=1).long()
        positions, conditional_mask = block_causal_layout(history_mask, batch, Q, state.key_valid.shape[1], Q, device)
        options = state.options
        if options.block_seed_offset is None:
            noise_generators = state.generators
        else:
            block_index = 0 if state.read_out is None else state.read_out.shape[1] // Q
            noise_generators = [torch.Generator().manual_seed(seed + block_index * options.block_seed_offset)
                                for seed in options.noise_seeds]
        noise = torch.stack([torch.randn(Q, self.config.latent_size, generator=g) for g in noise_generators])
        block, prior_calls = self._denoise_block(state, noise.to(device), positions, conditional_mask)
        calls[names["prior"]] += prior_calls

        logits = self._decode_latents(block, history_mask, state.decoder_cache).float()
        calls[names["decoder"]] += 1
        if state.read_out is not None and options.repetition_penalty != 1.0:
            logits = penalize_repetitions(logits, state.read_out, options.repetition_penalty)
        tokens = read_out_tokens(logits, state.generators, options.temperature)
        state.read_out = tokens if state.read_out is None else torch.cat([state.read_out, tokens], dim=1)
        state.pending_block = block
        # Row b's new tokens are the block's positions from first_new_b on, moved to the front.
        index = (state.first_new[:, None] + torch.arange(Q, device=device)[None]).clamp(max=Q - 1)
        return DecodingStep(tokens.gather(1, index), counts=Q - state.first_new, model_calls=calls)


__all__ = ["BlockAlignedPrompts", "BlockDecodingState", "BlockLatentGenerationOptions", "BlockLatentGenerationMixin", "DecodingStep", "DenoisedBlock", "GenerateOutput", "GenerationOptions", "GenerationRequest", "MultiTokenGenerationMixin", "NewTokens",
           "HARMLESS_HF_OPTIONS", "REQUEST_OPTIONS", "block_aligned_prompts", "check_prompt", "compile_entry_point", "compiled", "penalize_repetitions", "pop_options", "read_out_tokens", "refuse_token_filters", "reject_unknown_options",
           "resolve_generation_request", "row_seeds"]
