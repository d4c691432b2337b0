"""Response scores for preference optimisation (issue 13): one abstraction, one implementation per family.

DPO compares a policy and a frozen reference through a per-response *score*. For an autoregressive model that is
the (length-normalised) log-likelihood of the response; a multi-token family has no tractable likelihood, so it
scores a response with its own training terms under random quantities that are drawn ONCE and then held fixed
(paper 002, §3.3 and App. 16.2 for PLM):

* `ResponseScore` — the summed per-term losses of each response and the number of terms summed, so
  `normalised() = -loss_sum / num_terms` is a per-term score whatever the response length.
* `ResponseScorer` — the protocol a family implements: `draws(...)` makes the frozen random draws of each row
  (deterministic per preference pair, independent of the batch it is computed in), `score(...)` evaluates a model
  on rows under given draws. `scorer_for(model)` picks the family's scorer by `config.model_type`.
* `PLMResponseScorer` — PLM's score s(x, u) = -(L_enc^r + L_dec^r) / N_terms (App. 16.2).

Calling convention. `score` receives the trainer's model as it is wrapped (DDP and/or PEFT) and must run its
computation through that wrapper's forward, so that DDP's gradient hooks and PEFT's adapter hooks fire. A scorer
that needs more than the plain forward uses `call_as_forward(model, fn, ...)`, which runs `fn(core_model, ...)`
as the forward of the innermost `PreTrainedModel` for the duration of one wrapped call.

Rows are given as TRL's preference batches give them: `input_ids`, `attention_mask` (1 = real token, right padding)
and `completion_mask` (1 = response token, the terminal end-of-text token included).
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ..modeling.auxiliaries import draw_auxiliary_in_cell
from ..modeling.modeling_backbone import is_right_padded

#: Seed of the frozen auxiliary draws (paper App. 16.2: "its auxiliaries are sampled once with seed 5678").
DRAW_SEED = 5678

#: model_type -> class name in `hf_latentlm.training.latent_scores` (written separately; imported lazily).
LATENT_SCORERS = {"calm": "CALMResponseScorer", "cola": "ColaResponseScorer", "aurora": "AuroraResponseScorer"}
LATENT_SCORES_MODULE = "hf_latentlm.training.latent_scores"


@dataclass
class ResponseScore:
    """Per-row response score parts. loss_sum [B]: summed per-term losses (negative log-likelihoods) over the
    response; num_terms [B]: how many terms were summed."""

    loss_sum: torch.Tensor
    num_terms: torch.Tensor

    def normalised(self) -> torch.Tensor:
        """[B] the per-term score -loss_sum / num_terms (0 for a row with no term)."""
        return -self.loss_sum / self.num_terms.clamp(min=1)


@runtime_checkable
class ResponseScorer(Protocol):
    """What a family provides for preference optimisation.

    draws: the frozen random draws of every row, as tensors whose first dimension is the row (e.g. PLM: `aux`
        [B, G] and `phase` [B]). They must depend only on the row's own tokens, its pair key and the reference
        model, never on the other rows of the batch or on the call count, so that precomputing them once serves every
        epoch. `pair_keys[b]` is the stable key of row b's preference pair (`pair_key`), shared by both candidates.
    score: the `ResponseScore` of every row under `draws` (as returned by `draws`, possibly padded along dim 1
        with `draw_pad_values` by a collator).
    draw_pad_values: the value each draw is padded with along dim 1 when rows of different lengths are batched
        (a value the scorer treats as "nothing drawn here"); keys not listed pad with 0.
    draws_from_keys: True when `draws` depends only on the pair keys, the config and the rows' layout (seeded noise,
        not the reference model's outputs): the trainer then redraws them at every step instead of storing them
        (CALM's posterior samples, 100 x 128 floats per chunk, would take gigabytes as dataset columns). Optional;
        a scorer without it has its draws stored.
    """

    draw_pad_values: ClassVar[dict[str, float | int]]
    draws_from_keys: ClassVar[bool]

    def draws(self, reference_model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              completion_mask: torch.Tensor, pair_keys: Sequence[str]) -> dict[str, torch.Tensor]: ...

    def score(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
              draws: dict[str, torch.Tensor]) -> ResponseScore: ...


# ---------------------------------------------------------------------------------------------------------------------
# Helpers shared by every scorer
# ---------------------------------------------------------------------------------------------------------------------

def pair_key(prompt_ids: Sequence[int], chosen_ids: Sequence[int], rejected_ids: Sequence[int]) -> str:
    """H(p, r+, r-): a stable key of one preference pair (sha256 over its token ids; never Python's salted hash)."""
    text = "|".join(",".join(str(int(t)) for t in part) for part in (prompt_ids, chosen_ids, rejected_ids))
    return hashlib.sha256(text.encode()).hexdigest()


def stable_int(*parts: Any) -> int:
    """A non-negative 63-bit integer that depends only on `parts` (their `str`), the same in every process."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def row_generator(*parts: Any) -> torch.Generator:
    """A CPU generator seeded from `parts` (e.g. the draw seed, the pair key and the row's tokens)."""
    return torch.Generator().manual_seed(stable_int(*parts))


def core_model(model):
    """The innermost `PreTrainedModel` of `model`: through DDP (`.module`) and PEFT (`get_base_model()`)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            model = model.get_base_model()
        else:
            return model


def call_as_forward(model, fn: Callable, **inputs):
    """`fn(core, **inputs)` run as the forward of `core = core_model(model)`, called through `model`'s own call chain.

    Going through the wrapper is what makes a custom computation (not the model's `forward`) train correctly: DDP
    prepares its gradient reduction in its forward, PEFT enables adapters (or keeps them disabled inside
    `disable_adapter()`) in its. `fn` also receives what the wrappers add (PEFT passes `labels=None`,
    `return_dict=None`, ...), so it must accept `**kwargs`. The core's previous `forward` (its class method, or an
    instance attribute such as TRL's fused-LM-head patch) is restored afterwards.
    """
    core = core_model(model)
    previous = core.__dict__.get("forward")

    def forward(*args, **kwargs):
        return fn(core, *args, **kwargs)

    core.forward = forward
    try:
        return model(**inputs)
    finally:
        if previous is None:
            del core.forward
        else:
            core.forward = previous


def check_right_padded(attention_mask: torch.Tensor) -> None:
    """ValueError unless every row is real tokens followed by padding (TRL's preference collator pads right)."""
    if not is_right_padded(attention_mask.long()):
        raise ValueError("response scoring needs right-padded rows (attention_mask 1...1 0...0), as TRL's "
                         "DataCollatorForPreference builds them")


def first_completion_index(completion_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's first response token; ValueError if a row has none or starts at index 0."""
    has = completion_mask.bool().any(dim=1)
    if not has.all():
        raise ValueError(f"rows {(~has).nonzero().flatten().tolist()} have no response token (completion_mask is 0)")
    first = completion_mask.long().argmax(dim=1)
    if (first == 0).any():
        raise ValueError("a response must follow a prompt of at least one token (completion_mask[:, 0] is 1)")
    return first


def scorer_for(model) -> ResponseScorer:
    """The response scorer of `model`'s family, by `config.model_type` (through DDP / PEFT wrappers).

    PLM: `PLMResponseScorer`. CALM, Cola, AURORA: the classes of `hf_latentlm.training.latent_scores`, imported on
    first use; NotImplementedError if that module (or the class) does not exist yet. Any other model type: an
    autoregressive model needs no scorer (TRL's own `DPOTrainer` with `loss_type="sigmoid_norm"` is its baseline),
    so NotImplementedError says so.
    """
    config = getattr(core_model(model), "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type == "plm":
        return PLMResponseScorer()
    if model_type in LATENT_SCORERS:
        class_name = LATENT_SCORERS[model_type]
        try:
            module = importlib.import_module(LATENT_SCORES_MODULE)
        except ModuleNotFoundError as err:
            if err.name != LATENT_SCORES_MODULE:
                raise
            raise NotImplementedError(f"no response scorer for the {model_type} family yet: {class_name} belongs in "
                                      f"{LATENT_SCORES_MODULE}, which does not exist") from err
        if not hasattr(module, class_name):
            raise NotImplementedError(f"no response scorer for the {model_type} family yet: {LATENT_SCORES_MODULE} "
                                      f"has no {class_name}")
        return getattr(module, class_name)()
    raise NotImplementedError(
        f"no response scorer for model type {model_type!r}: preference scores exist for plm and "
        f"{', '.join(sorted(LATENT_SCORERS))}; an autoregressive model trains with TRL's own DPOTrainer and "
        f"loss_type='sigmoid_norm' (hf_latentlm.training.post_training.dpo_config(autoregressive=True))")


# ---------------------------------------------------------------------------------------------------------------------
# PLM
# ---------------------------------------------------------------------------------------------------------------------

class PLMResponseScorer:
    """PLM's DPO response score (paper 002, Eq. 12 and App. 16.2):

        s_θ(x, u) = -( L_enc^r(θ; x) + L_dec^r(θ; x, u) ) / N_terms

    L_enc^r: -log q over every response target, the terminal end-of-text token included. L_dec^r: -log p over the
    decoder rows whose target is a response-body token (the response without its terminal end-of-text token), with
    the scored-row rules of `PLMForCausalLM.decoder_objective` (real, labelled targets; a block stops at its first
    end-of-text target, `decoder_row_valid`), under a FIXED block layout and FIXED auxiliaries u. No alignment term.
    N_terms: the number of terms summed (≈ L^r·(1 + K/s)).

    Draws (`draws`), made once with the frozen reference:
    * `phase` [B]: the block phase of the row's pair, from the pair key H: H mod s when s <= K (every target then
      lies in some block); when s > K, the phase that puts the first response target at offset H mod K of its
      decoder block, so it lies inside one (App. 16.2). Both candidates of a pair share it (same key, same prompt).
    * `aux` [B, Z·K]: one auxiliary per cell (block z, offset k) of the grid `block_layout` draws its rows from
      (block z starts at 1 + z·s - phase), flattened z-major; -1 (the mask auxiliary) where the cell's target is
      outside the sequence or the target has no Voronoi cell under the reference encoder (`draw_auxiliary_in_cell`).
      A cell is drawn uniformly from the cell of the OBSERVED target under the reference encoder's distribution at
      that position, with uniforms from a generator seeded by (5678, pair key, the row's tokens). The grid is
      indexed by absolute block id and offset, so the same draws serve any padded length of the row.
    Each row is drawn from its own unpadded tokens in a forward of its own, so the draws do not depend on the batch.
    """

    draw_pad_values: ClassVar[dict[str, int]] = {"aux": -1, "phase": 0}
    draws_from_keys: ClassVar[bool] = False  # u comes from the reference encoder's Voronoi cells

    def __init__(self, seed: int = DRAW_SEED):
        self.seed = seed

    # -- layout --------------------------------------------------------------------------------------------------

    @staticmethod
    def pair_phase(config, key: str, first_target: int) -> int:
        """The block phase of a pair with key `key` whose first response target has index `first_target` (>= 1)."""
        K, s = config.block_size, config.block_stride
        h = stable_int("phase", key)
        if s <= K:
            return h % s
        # Block z covers targets [1 + z·s - phase, 1 + z·s - phase + K): the first target sits at offset
        # (first_target - 1 + phase) mod s of its stride period, which is h mod K < K.
        return (h % K - (first_target - 1)) % s

    @staticmethod
    def grid_cells(config, length: int, phase: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a row of `length` tokens: (target position [Z·K], in range [Z·K]) of every grid cell (z, k)."""
        K, s = config.block_size, config.block_stride
        num_blocks = (length + s - 1) // s + 1  # = PLMForCausalLM.num_layout_blocks(length)
        z = torch.arange(num_blocks)[:, None]
        pos = (1 + z * s - phase + torch.arange(K)).flatten()
        return pos, (pos >= 1) & (pos < length)

    @staticmethod
    def grid_index(config, layout, phase: int) -> torch.Tensor:
        """[D] the grid cell (z·K + k) of every decoder row of `layout` (from `block_layout(length, phase)`)."""
        dec_pos, dec_block, _ = layout
        first = 1 + dec_block * config.block_stride - phase
        return dec_block * config.block_size + (dec_pos - first)

    # -- draws ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def draws(self, reference_model, input_ids, attention_mask, completion_mask, pair_keys):
        check_right_padded(attention_mask)
        if len(pair_keys) != input_ids.shape[0]:
            raise ValueError(f"{len(pair_keys)} pair keys for {input_ids.shape[0]} rows")
        core = core_model(reference_model)
        config = core.config
        first = first_completion_index(completion_mask)
        phases, grids = [], []
        for b in range(input_ids.shape[0]):
            length = int(attention_mask[b].sum())
            ids = input_ids[b, :length]
            phase = self.pair_phase(config, pair_keys[b], int(first[b]))
            pos, inside = self.grid_cells(config, length, phase)
            uniforms = torch.rand(pos.shape[0], generator=row_generator(self.seed, pair_keys[b], ids.tolist()))
            grid = torch.full((pos.shape[0],), -1, dtype=torch.long)
            # The reference encoder's distribution at every position of this row alone (padding-free, so the
            # draws do not depend on the batch), through the wrapped model (PEFT: adapters as the caller set them).
            logits = reference_model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None]).logits
            owners, _ = core.auxiliary_owners(logits[0, :-1])  # [length - 1, N_aux]: owner token per auxiliary
            if owners is not None and inside.any():
                cell_pos = pos[inside].to(ids.device)
                drawn = draw_auxiliary_in_cell(owners[cell_pos - 1], ids[cell_pos],
                                               uniform=uniforms[inside].to(owners.device))
                grid[inside] = drawn.cpu()
            phases.append(phase)
            grids.append(grid)
        aux = torch.nn.utils.rnn.pad_sequence(grids, batch_first=True, padding_value=-1)
        return {"aux": aux.to(input_ids.device), "phase": torch.tensor(phases, device=input_ids.device)}

    # -- score ---------------------------------------------------------------------------------------------------

    def score(self, model, input_ids, attention_mask, completion_mask, draws) -> ResponseScore:
        check_right_padded(attention_mask)
        for key in ("aux", "phase"):
            if key not in draws:
                raise ValueError(f"PLM response scores need the draw {key!r} (from PLMResponseScorer.draws)")
        loss_sum, num_terms = call_as_forward(
            model, self._score_rows, input_ids=input_ids, attention_mask=attention_mask,
            completion_mask=completion_mask, aux_grid=draws["aux"], phase=draws["phase"])
        return ResponseScore(loss_sum=loss_sum, num_terms=num_terms)

    def response_labels(self, core, input_ids, attention_mask, completion_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(encoder labels, decoder labels) [B, T]: the response tokens, -100 elsewhere; the decoder's also -100 at
        each row's terminal end-of-text token (its score covers the response body only)."""
        real = attention_mask.bool()
        enc_labels = input_ids.masked_fill(~(completion_mask.bool() & real), -100)
        eos = core.config.eos_token_id
        last = (real.long().cumsum(1) == real.sum(1, keepdim=True)) & real  # the last real token of each row
        terminal = last & completion_mask.bool() & (input_ids == (eos if eos is not None else -1))
        return enc_labels, enc_labels.masked_fill(terminal, -100)

    def _score_rows(self, core, input_ids=None, attention_mask=None, completion_mask=None, aux_grid=None, phase=None,
                    **_wrapper_kwargs):
        """The forward run by `score`: rows grouped by phase, one `decoder_objective` per group."""
        config = core.config
        batch, length = input_ids.shape
        enc_labels, dec_labels = self.response_labels(core, input_ids, attention_mask, completion_mask)
        loss_sum = torch.zeros(batch, device=input_ids.device)
        num_terms = torch.zeros(batch, device=input_ids.device)
        parts = []
        for value in phase.unique().tolist():
            rows = (phase == value).nonzero().flatten()
            ids, mask = input_ids[rows], attention_mask[rows]
            layout = core.block_layout(length, torch.tensor(value, device=input_ids.device))
            dec_pos, _, dec_start = layout
            cell = self.grid_index(config, layout, value)
            grid = aux_grid[rows]
            aux = grid[:, cell.clamp(max=grid.shape[1] - 1)].masked_fill(cell >= grid.shape[1], -1)
            out = core.decoder_objective(ids, enc_labels[rows], mask, layout, aux=aux, with_alignment=False)
            # Encoder: logits at t-1 score x_t, every labelled response target (terminal EOS included).
            enc_target = enc_labels[rows, 1:]
            enc_valid = enc_target != -100
            enc_nll = F.cross_entropy(out.logits[:, :-1].float().transpose(1, 2), enc_target.clamp(min=0),
                                      reduction="none")
            # Decoder: the rows decoder_objective scores (labelled real targets of a block up to its first EOS
            # target), restricted to the response body.
            dec_target = dec_labels[rows][:, dec_pos]
            dec_valid = ((dec_target != -100) & mask.bool()[:, dec_pos]
                         & core.decoder_row_valid(ids, dec_pos, dec_start))
            dec_nll = F.cross_entropy(out.decoder_logits.float().transpose(1, 2), dec_target.clamp(min=0),
                                      reduction="none")
            group_sum = (enc_nll * enc_valid).sum(1) + (dec_nll * dec_valid).sum(1)
            group_terms = (enc_valid.sum(1) + dec_valid.sum(1)).to(num_terms.dtype)
            parts.append((rows, group_sum, group_terms))
        # Assembled out of place, so that autograd sees each group's sums once.
        for rows, group_sum, group_terms in parts:
            loss_sum = loss_sum.index_put((rows,), group_sum)
            num_terms = num_terms.index_put((rows,), group_terms)
        return loss_sum, num_terms
