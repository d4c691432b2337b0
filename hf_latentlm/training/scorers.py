"""Response scores for preference optimisation: one protocol, one scorer per family (the registry's
`response_scorer`; `post_training.scorer_for(model)` reads it).

DPO compares a policy and a frozen reference through a per-response score. An autoregressive model's is the
(length-normalised) log-likelihood of the response (`TokenLikelihoodScorer`). A multi-token family has no tractable
likelihood, so it scores a response with its own training terms, restricted to the response, under random draws
made once per preference pair and then held fixed (paper 002, §3.3 and App. 16.2 for PLM; our extension for CALM,
Cola DLM and AURORA-LM, whose papers define no DPO score):

    ResponseScore.loss_sum = Σ over the response's terms of the per-term loss,  num_terms = #terms,
    score = −loss_sum / num_terms,  δ = score(policy) − score(reference),  DPO: −log σ(γ·(δ⁺ − δ⁻)).

Each scorer's docstring says what one term is. As in Diffusion-DPO, the two candidates of a pair share their draws
(common random numbers); unlike it, the draws are frozen for the whole run, so the reference is scored once.

Draws depend only on (seed, pair key, term index): not on the batch, the padding, the epoch or the model. They come
in pages of `PAGE` terms, each from a generator seeded with the sha256 of (seed, pair key, stream, page), never
Python's salted `hash`. Draw tensors are [B, n, ...] with n the term index; padding along dim 1 uses
`draw_pad_values`. Two draws come from the reference model, so they are stored rather than redrawn: PLM's
auxiliaries (its Voronoi cells) and Cola's `latents`.

Rows come as TRL's preference batches give them: `input_ids` [B, T] = prompt + response (+ terminal EOS),
`attention_mask` (1 = real token, right padding), `completion_mask` (1 = response token, one run ending at the row's
last real token). `score` receives the trainer's model as wrapped (DDP and/or PEFT) and runs through the wrapper's
forward with a `scoring_pass` (`modeling_backbone.runs_scoring_pass`), so DDP's gradient hooks and PEFT's adapter
hooks fire.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..modeling.auxiliaries import draw_auxiliary_in_cell
from ..modeling.flow import make_time_sampler
from ..modeling.layers import token_nll
from ..modeling.modeling_backbone import is_right_padded

#: Seed of the frozen auxiliary draws (paper App. 16.2: "its auxiliaries are sampled once with seed 5678").
DRAW_SEED = 5678

#: Terms per generator page: the draw of term i comes from page i // PAGE, so it does not depend on the row's length.
PAGE = 16

ALIGNMENTS = ("repaint", "eos_fill")


@dataclass
class TokenStats:
    """Per-row statistics [B] of a model's next-token predictions over the response targets, detached: `count`
    targets predicted, `correct` of them the most likely token, `entropy_sum` Σ entropy (nats) of the predictive
    distributions, `logit_sum` Σ mean-over-vocabulary logit. What TRL's trainers log as `mean_token_accuracy`,
    `entropy` and `logits/*`."""

    count: torch.Tensor
    correct: torch.Tensor
    entropy_sum: torch.Tensor
    logit_sum: torch.Tensor

    @staticmethod
    @torch.no_grad()
    def of(logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor) -> "TokenStats":
        """From next-token logits [B, T, V] whose position t predicts targets[:, t] [B, T], over `scored` [B, T]."""
        logits = logits.detach().float()
        log_probs = torch.log_softmax(logits, -1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        weight = scored.to(logits.dtype)
        return TokenStats(count=weight.sum(1), correct=((logits.argmax(-1) == targets) * weight).sum(1),
                          entropy_sum=(entropy * weight).sum(1), logit_sum=(logits.mean(-1) * weight).sum(1))

    def put(self, rows: torch.Tensor, part: "TokenStats") -> "TokenStats":
        """These statistics with rows `rows` replaced by `part`'s (out of place)."""
        return TokenStats(*(mine.index_put((rows,), theirs) for mine, theirs in
                            zip(dataclasses.astuple(self), dataclasses.astuple(part))))


@dataclass
class ResponseScore:
    """Per-row response score parts. loss_sum [B]: summed per-term losses (negative log-likelihoods) over the
    response; num_terms [B]: how many terms were summed. tokens: the next-token prediction statistics of the response
    targets, for a score that has next-token logits (PLM's encoder, `TokenLikelihoodScorer`), else None."""

    loss_sum: torch.Tensor
    num_terms: torch.Tensor
    tokens: TokenStats | None = None

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
        (CALM's posterior samples, many floats per chunk, would be far too large as dataset columns). Optional;
        a scorer without it has its draws stored.
    reference_draws: with `draws_from_keys`, the names of the draws that DO come from the reference model's outputs
        (Cola: `latents`, the reference VAE's z0). The trainer stores those as columns and, at every step, redraws
        only the others, with `keyed_draws(config, input_ids, attention_mask, completion_mask, pair_keys)` (which a
        scorer with `reference_draws` provides; `draws` without the reference's part). Optional; default none.
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
        loss_sum, num_terms, tokens = model(
            scoring_pass=self._score_rows, input_ids=input_ids, attention_mask=attention_mask,
            completion_mask=completion_mask, aux_grid=draws["aux"], phase=draws["phase"])
        return ResponseScore(loss_sum=loss_sum, num_terms=num_terms, tokens=tokens)

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
        """The forward run by `score`: rows grouped by phase, one `decoder_objective` per group. Also the encoder's
        next-token statistics over the response targets (`TokenStats`)."""
        config = core.config
        batch, length = input_ids.shape
        enc_labels, dec_labels = self.response_labels(core, input_ids, attention_mask, completion_mask)
        loss_sum = torch.zeros(batch, device=input_ids.device)
        num_terms = torch.zeros(batch, device=input_ids.device)
        tokens = TokenStats(*(torch.zeros(batch, device=input_ids.device) for _ in range(4)))
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
            enc_nll = token_nll(out.logits[:, :-1], enc_target)
            # Decoder: the rows decoder_objective scores (labelled real targets of a block up to its first EOS
            # target), restricted to the response body.
            dec_target = dec_labels[rows][:, dec_pos]
            dec_valid = ((dec_target != -100) & mask.bool()[:, dec_pos]
                         & core.decoder_row_valid(ids, dec_pos, dec_start))
            dec_nll = token_nll(out.decoder_logits, dec_target)
            group_sum = (enc_nll * enc_valid).sum(1) + (dec_nll * dec_valid).sum(1)
            group_terms = (enc_valid.sum(1) + dec_valid.sum(1)).to(num_terms.dtype)
            parts.append((rows, group_sum, group_terms))
            tokens = tokens.put(rows, TokenStats.of(out.logits[:, :-1], enc_target, enc_valid))
        # Assembled out of place, so that autograd sees each group's sums once.
        for rows, group_sum, group_terms in parts:
            loss_sum = loss_sum.index_put((rows,), group_sum)
            num_terms = num_terms.index_put((rows,), group_terms)
        return loss_sum, num_terms, tokens


# ---------------------------------------------------------------------------------------------------------------------
# Token likelihood (any family with next-token logits and no scorer of its own)
# ---------------------------------------------------------------------------------------------------------------------

class TokenLikelihoodScorer:
    """s(x) = Σ_t log p(x_t | x_<t) over the response tokens (the terminal end-of-text included) / their number:
    the AR baseline's DPO score (TRL's `sigmoid_norm`), for a family whose `forward` returns next-token `logits`.
    Nothing random, so no draws."""

    draw_pad_values: ClassVar[dict[str, float | int]] = {}
    draws_from_keys: ClassVar[bool] = False

    def draws(self, reference_model, input_ids, attention_mask, completion_mask, pair_keys):
        check_keys(pair_keys, input_ids.shape[0])
        return {}

    def score(self, model, input_ids, attention_mask, completion_mask, draws) -> ResponseScore:
        check_right_padded(attention_mask)
        first_completion_index(completion_mask)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
        target = input_ids[:, 1:]
        scored = (completion_mask[:, 1:].bool() & attention_mask[:, 1:].bool())
        nll = token_nll(logits, target)
        return ResponseScore(loss_sum=(nll * scored).sum(1), num_terms=scored.sum(1).to(nll.dtype),
                             tokens=TokenStats.of(logits, target, scored))


# ---------------------------------------------------------------------------------------------------------------------
# Helpers of the latent scorers
# ---------------------------------------------------------------------------------------------------------------------

def paged_draws(seed: int, key: Any, stream: str, count: int, page: Callable[[torch.Generator], torch.Tensor]) -> \
        torch.Tensor:
    """The first `count` draws of stream `stream` of pair `key`: [count, ...], page p (terms p·PAGE ..) drawn by
    `page(generator)` -> [PAGE, ...] from a generator seeded by (seed, key, stream, p)."""
    pages = [page(row_generator(seed, key, stream, p)) for p in range(max(1, -(-count // PAGE)))]
    return torch.cat(pages)[:count]


def stack_padded(rows: list[torch.Tensor], device) -> torch.Tensor:
    """[B, max n, ...] from rows [n_b, ...], zero-padded along dim 1."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0.0).to(device)


def take(draw: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """draw [B, n, ...] gathered at index [B, J] (along dim 1), 0 where not `valid` [B, J] (or index >= n)."""
    n = draw.shape[1]
    inside = valid & (index < n) & (index >= 0)
    flat = index.clamp(0, max(n - 1, 0))
    gathered = draw[torch.arange(draw.shape[0], device=draw.device)[:, None], flat.to(draw.device)]
    mask = inside.to(draw.device).reshape(*inside.shape, *([1] * (draw.dim() - 2)))
    return torch.where(mask, gathered, torch.zeros((), dtype=draw.dtype, device=draw.device))


@dataclass
class SplitRow:
    prompt: torch.Tensor  # [P] ids
    response: torch.Tensor  # [R] ids


def split_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
               min_prompt: int = 0) -> list[SplitRow]:
    """Each row's (prompt, response) ids from its real tokens in order; ValueError naming the row if the response is
    empty, not one run at the end of the real tokens, or the prompt is shorter than `min_prompt`."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape or completion_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids, attention_mask and completion_mask must all be [B, T], got "
                         f"{tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, {tuple(completion_mask.shape)}")
    rows = []
    for b in range(input_ids.shape[0]):
        real = attention_mask[b].bool()
        ids, completion = input_ids[b][real], completion_mask[b][real].bool()
        r = int(completion.sum())
        if r == 0:
            raise ValueError(f"row {b} has no response token (completion_mask is 0 on its real tokens)")
        if not bool(completion[ids.numel() - r:].all()):
            raise ValueError(f"row {b}: the response (completion_mask) must be one run at the end of the row's real "
                             f"tokens")
        if ids.numel() - r < min_prompt:
            raise ValueError(f"row {b}: a prompt of at least {min_prompt} token(s) is needed, got {ids.numel() - r}")
        rows.append(SplitRow(ids[: ids.numel() - r], ids[ids.numel() - r:]))
    return rows


def fill_token_id(config) -> int:
    """EOS (the document separator), else the pad token, else 0: what `generate()` fills prompts with."""
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def check_keys(pair_keys: Sequence, batch: int) -> None:
    if len(pair_keys) != batch:
        raise ValueError(f"{len(pair_keys)} pair keys for {batch} rows")


def check_draws(draws: dict, names: Sequence[str], scorer: str) -> None:
    for name in names:
        if name not in draws:
            raise ValueError(f"{scorer} needs the draw {name!r} (from {scorer}.draws)")


# ---------------------------------------------------------------------------------------------------------------------
# CALM
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class CALMLayout:
    """Rows laid out for CALM scoring: `input_ids` / `attention_mask` [B, C·K], each row [pad chunks][EOS left-fill]
    [prompt][response][EOS right-fill], left-padded by whole chunks (attention 0, as are the fills);
    `response_chunks` [B]: its response's chunks, the last ones of the row."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_chunks: torch.Tensor


class CALMResponseScorer:
    """CALM's DPO response score: one term per response chunk of K tokens, the energy loss (paper 000, Eq. 10) of
    that chunk's latent predicted from the chunk before it, under fixed head noise and fixed posterior samples
    (N, M: the config's `num_model_samples` / `num_target_samples` unless given); ⌈R / K⌉ terms.

    Alignment as `generate()`'s: the prompt is left-filled with EOS (attention 0) to a multiple of K, so the response
    starts on a chunk boundary, and its last chunk is right-filled with EOS to K tokens. The prompt needs at least
    one token (its last chunk's hidden state predicts the first response chunk).

    Draws: `model_noise` [B, C, N, d_noise] uniform in [−0.5, 0.5] (the energy head's input for the N samples of
    response chunk c), `target_noise` [B, C, M, l] standard normal (the M posterior samples μ + σ·ε of its target).
    """

    draw_pad_values: ClassVar[dict[str, float]] = {"model_noise": 0.0, "target_noise": 0.0}
    draws_from_keys: ClassVar[bool] = True  # seeded per pair: redrawn at every step, never stored

    def __init__(self, seed: int = DRAW_SEED, num_model_samples: int | None = None,
                 num_target_samples: int | None = None):
        if num_model_samples is not None and num_model_samples < 2:
            raise ValueError(f"num_model_samples must be at least 2 (the energy loss's diversity term), got "
                             f"{num_model_samples}")
        if num_target_samples is not None and num_target_samples < 1:
            raise ValueError(f"num_target_samples must be at least 1, got {num_target_samples}")
        self.seed, self.num_model_samples, self.num_target_samples = seed, num_model_samples, num_target_samples

    def samples(self, config) -> tuple[int, int]:
        n = config.num_model_samples if self.num_model_samples is None else self.num_model_samples
        m = config.num_target_samples if self.num_target_samples is None else self.num_target_samples
        return n, m

    @staticmethod
    def layout(config, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               completion_mask: torch.Tensor) -> CALMLayout:
        """The chunk-aligned rows (see `CALMLayout`); the fill token is `generate()`'s (EOS, else pad)."""
        K, fill = config.chunk_size, fill_token_id(config)
        rows = split_rows(input_ids, attention_mask, completion_mask, min_prompt=1)
        built = []
        for row in rows:
            left, right = (-row.prompt.numel()) % K, (-row.response.numel()) % K
            ids = torch.cat([row.prompt.new_full((left,), fill), row.prompt, row.response,
                             row.prompt.new_full((right,), fill)])
            mask = torch.cat([torch.zeros(left, dtype=torch.long), torch.ones(row.prompt.numel() + row.response.numel(),
                                                                               dtype=torch.long),
                              torch.zeros(right, dtype=torch.long)]).to(ids.device)
            built.append((ids, mask, -(-row.response.numel() // K)))
        width = max(ids.numel() for ids, _, _ in built)
        ids_out = input_ids.new_full((len(built), width), fill)
        mask_out = torch.zeros(len(built), width, dtype=torch.long, device=input_ids.device)
        for b, (ids, mask, _) in enumerate(built):
            ids_out[b, width - ids.numel():], mask_out[b, width - ids.numel():] = ids, mask
        chunks = torch.tensor([c for _, _, c in built], device=input_ids.device)
        return CALMLayout(ids_out, mask_out, chunks)

    @torch.no_grad()
    def draws(self, reference_model, input_ids, attention_mask, completion_mask, pair_keys) -> dict[str, torch.Tensor]:
        check_keys(pair_keys, input_ids.shape[0])
        config = core_model(reference_model).config
        n, m = self.samples(config)
        layout = self.layout(config, input_ids, attention_mask, completion_mask)
        model_noise, target_noise = [], []
        for b, count in enumerate(layout.response_chunks.tolist()):
            model_noise.append(paged_draws(self.seed, pair_keys[b], "calm-head-noise", count, lambda g: torch.rand(
                PAGE, n, config.noise_size, generator=g) - 0.5))
            target_noise.append(paged_draws(self.seed, pair_keys[b], "calm-posterior", count, lambda g: torch.randn(
                PAGE, m, config.latent_size, generator=g)))
        return {"model_noise": stack_padded(model_noise, input_ids.device),
                "target_noise": stack_padded(target_noise, input_ids.device)}

    def score(self, model, input_ids, attention_mask, completion_mask, draws) -> ResponseScore:
        check_draws(draws, ("model_noise", "target_noise"), "CALMResponseScorer")
        loss_sum, num_terms = model(scoring_pass=self._score_rows, input_ids=input_ids, attention_mask=attention_mask,
                                    completion_mask=completion_mask, model_noise=draws["model_noise"],
                                    target_noise=draws["target_noise"])
        return ResponseScore(loss_sum=loss_sum, num_terms=num_terms)

    def _score_rows(self, core, input_ids=None, attention_mask=None, completion_mask=None, model_noise=None,
                    target_noise=None, **_wrapper_kwargs):
        config = core.config
        K = config.chunk_size
        layout = self.layout(config, input_ids, attention_mask, completion_mask)
        ids, mask, counts = layout.input_ids, layout.attention_mask, layout.response_chunks
        # Step i's hidden state (chunks 0..i read) predicts chunk i + 1; the response's chunks are the last ones.
        hidden = core.model(input_ids=ids[:, :-K], attention_mask=mask[:, :-K]).last_hidden_state
        targets = ids[:, K:].view(ids.shape[0], -1, K)
        last = int(counts.max())
        hidden, targets = hidden[:, -last:], targets[:, -last:]
        index = torch.arange(last, device=ids.device)[None] - (last - counts[:, None])  # response chunk of each step
        scored = index >= 0
        loss, _, _ = core.energy_terms(hidden, targets, take(target_noise, index, scored).to(hidden.device),
                                       take(model_noise, index, scored).to(hidden.device))
        loss_sum = torch.where(scored.to(loss.device), loss, 0.0).sum(1)
        return loss_sum, counts.to(loss_sum)


# ---------------------------------------------------------------------------------------------------------------------
# Cola DLM and AURORA-LM: block flow matching
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class BlockLayout:
    """Rows laid out for a block-latent score: `input_ids` / `attention_mask` [B, W], each row [EOS fill (eos_fill
    alignment only, attended)][prompt][response], right-padded (blocks counted from column 0 = the row's first
    token); `response_start` [B] column of the first response token; `response_length` [B]; `row_length` [B]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start: torch.Tensor
    response_length: torch.Tensor
    row_length: torch.Tensor

    def response_blocks(self, block_size: int) -> torch.Tensor:
        """[B] number of blocks touching the response."""
        first = self.response_start // block_size
        last = (self.response_start + self.response_length - 1) // block_size
        return last - first + 1

    def response_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(j [B, W]: each column's index in the response, in_response [B, W] bool)."""
        column = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)[None]
        j = column - self.response_start[:, None]
        return j, (j >= 0) & (j < self.response_length[:, None])


class BlockFlowResponseScorer:
    """Shared by Cola and AURORA: one term per response latent position (R terms), with the layout, the draws
    (`times` [B, nb]: one per response block; `noise` [B, R, D]: ε per response position) and the per-position times
    and noise of a layout. Subclasses say what the latents and the per-position error are. History is always
    visible (no history dropout).

    alignment: "repaint" (default) counts blocks of Q from the row's first real token, as `generate()` does; a prompt
    that ends mid-block makes that block the response's first, its prompt positions clean at time 0 and unscored.
    "eos_fill" left-fills the prompt with (−P mod Q) attended EOS tokens (a document boundary, as in the packed
    training stream), so the response starts on a block boundary."""

    draw_pad_values: ClassVar[dict[str, float]] = {"times": 0.0, "noise": 0.0}
    draws_from_keys: ClassVar[bool] = True  # seeded per pair: redrawn at every step, never stored
    reference_draws: tuple[str, ...] = ()  # ... except these, made by the reference model (stored)
    family: ClassVar[str] = ""
    draw_names: tuple[str, ...] = ("times", "noise")

    def __init__(self, seed: int = DRAW_SEED, alignment: str = "repaint"):
        if alignment not in ALIGNMENTS:
            raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
        self.seed, self.alignment = seed, alignment

    def layout(self, config, input_ids, attention_mask, completion_mask) -> BlockLayout:
        Q, fill = config.block_size, fill_token_id(config)
        rows = split_rows(input_ids, attention_mask, completion_mask)
        built = []
        for row in rows:
            left = (-row.prompt.numel()) % Q if self.alignment == "eos_fill" else 0
            built.append(torch.cat([row.prompt.new_full((left,), fill), row.prompt, row.response]))
        lengths = torch.tensor([ids.numel() for ids in built], device=input_ids.device)
        width = int(lengths.max())
        ids_out = input_ids.new_full((len(built), width), fill)
        for b, ids in enumerate(built):
            ids_out[b, : ids.numel()] = ids
        mask_out = (torch.arange(width, device=input_ids.device)[None] < lengths[:, None]).long()
        response_length = torch.tensor([row.response.numel() for row in rows], device=input_ids.device)
        return BlockLayout(ids_out, mask_out, lengths - response_length, response_length, lengths)

    def extra_draws(self, config, layout: BlockLayout, pair_keys) -> dict[str, torch.Tensor]:
        """More draws seeded by the pair keys (none here)."""
        return {}

    def model_draws(self, reference_model, layout: BlockLayout, pair_keys) -> dict[str, torch.Tensor]:
        """The draws the reference model makes (`reference_draws`; none here)."""
        return {}

    @torch.no_grad()
    def draws(self, reference_model, input_ids, attention_mask, completion_mask, pair_keys) -> dict[str, torch.Tensor]:
        config = core_model(reference_model).config
        out = self.keyed_draws(config, input_ids, attention_mask, completion_mask, pair_keys)
        layout = self.layout(config, input_ids, attention_mask, completion_mask)
        out.update(self.model_draws(reference_model, layout, pair_keys))
        return out

    @torch.no_grad()
    def keyed_draws(self, config, input_ids, attention_mask, completion_mask, pair_keys) -> dict[str, torch.Tensor]:
        """The draws seeded by the pair keys alone: `times`, `noise` and the subclass's `extra_draws`."""
        check_keys(pair_keys, input_ids.shape[0])
        layout = self.layout(config, input_ids, attention_mask, completion_mask)
        sampler = make_time_sampler(config.time_sampler, **config.time_sampler_kwargs())
        blocks = layout.response_blocks(config.block_size).tolist()
        times, noise = [], []
        for b, length in enumerate(layout.response_length.tolist()):
            times.append(paged_draws(self.seed, pair_keys[b], f"{self.family}-time", blocks[b],
                                     lambda g: sampler.sample((PAGE,), generator=g, device="cpu").float()))
            noise.append(paged_draws(self.seed, pair_keys[b], f"{self.family}-noise", length,
                                     lambda g: torch.randn(PAGE, config.latent_size, generator=g)))
        out = {"times": stack_padded(times, input_ids.device), "noise": stack_padded(noise, input_ids.device)}
        out.update(self.extra_draws(config, layout, pair_keys))
        return out

    def conditions(self, config, layout: BlockLayout, times: torch.Tensor, noise: torch.Tensor):
        """Per-position (times [B, W], noise [B, W, D], in_response [B, W]) of `layout`: a response position gets
        its block's time and its own ε; every other position time 0 and ε = 0 (clean)."""
        Q = config.block_size
        j, in_response = layout.response_positions()
        column = torch.arange(layout.input_ids.shape[1], device=j.device)[None]
        block = column // Q - (layout.response_start // Q)[:, None]
        return take(times, block, in_response), take(noise, j, in_response), in_response

    def score(self, model, input_ids, attention_mask, completion_mask, draws) -> ResponseScore:
        name = type(self).__name__
        check_draws(draws, self.draw_names, name)
        loss_sum, num_terms = model(scoring_pass=self._score_rows, input_ids=input_ids, attention_mask=attention_mask,
                                    completion_mask=completion_mask, **{key: draws[key] for key in self.draw_names})
        return ResponseScore(loss_sum=loss_sum, num_terms=num_terms)

    def _score_rows(self, core, input_ids=None, attention_mask=None, completion_mask=None, **kwargs):
        config = core.config
        layout = self.layout(config, input_ids, attention_mask, completion_mask)
        draws = {key: kwargs[key] for key in self.draw_names}
        times, noise, in_response = self.conditions(config, layout, draws["times"], draws["noise"])
        error = self.position_errors(core, layout, times, noise, draws)
        loss_sum = torch.where(in_response.to(error.device), error, 0.0).sum(1)
        return loss_sum, layout.response_length.to(loss_sum)

    def position_errors(self, core, layout: BlockLayout, times, noise, draws) -> torch.Tensor:
        raise NotImplementedError


class ColaResponseScorer(BlockFlowResponseScorer):
    """Cola DLM's DPO response score: Σ over the response's latent positions of the flow-matching error at fixed
    (t per response block, ε per position) and fixed clean latents z0: mean_c (v̂ − (ε − z0))² per position. Only
    the flow-matching term: the VAE's terms, which anchor it in joint training, are not part of the score.

    latents (`str`, "reference"): where z0 comes from.
    * "reference" (default): the reference VAE's posterior sample μ_ref + σ_ref·ξ (fixed ξ), made in `draws` (with
      the reference) and returned as the draw `latents` [B, L, d_z] (z0 of every layout column from the row's first
      token; `reference_draws`, so the trainer stores it). `score` reads z0 from it, a constant: the policy is scored
      on the reference's latents and its VAE gets no gradient, whatever `trains_vae` says; only the prior trains.
    * "policy": the ablation without an anchor: z0 = μ + σ·ξ from the SCORED model's own VAE, with gradient iff the VAE
      trains (`trains_vae`), so DPO can move the latents; the draw is ξ itself, `latent_noise` [B, L, d_z], seeded by
      the pair key (nothing stored).
    """

    LATENT_SOURCES: ClassVar[tuple[str, ...]] = ("reference", "policy")
    draw_pad_values: ClassVar[dict[str, float]] = {"times": 0.0, "noise": 0.0, "latent_noise": 0.0, "latents": 0.0}
    family: ClassVar[str] = "cola"

    def __init__(self, seed: int = DRAW_SEED, alignment: str = "repaint", latents: str = "reference"):
        super().__init__(seed, alignment)
        if latents not in self.LATENT_SOURCES:
            raise ValueError(f"latents must be one of {self.LATENT_SOURCES}, got {latents!r}")
        self.latents = latents
        self.reference_draws = ("latents",) if latents == "reference" else ()
        self.draw_names = ("times", "noise", "latents" if latents == "reference" else "latent_noise")

    def posterior_noise(self, config, layout: BlockLayout, pair_keys) -> torch.Tensor:
        """ξ [B, L, d_z] of every row position from its first token, seeded by the pair key."""
        rows = [paged_draws(self.seed, pair_keys[b], "cola-posterior", length,
                            lambda g: torch.randn(PAGE, config.latent_size, generator=g))
                for b, length in enumerate(layout.row_length.tolist())]
        return stack_padded(rows, layout.input_ids.device)

    def extra_draws(self, config, layout: BlockLayout, pair_keys) -> dict[str, torch.Tensor]:
        return {} if self.latents == "reference" else {"latent_noise": self.posterior_noise(config, layout, pair_keys)}

    def model_draws(self, reference_model, layout, pair_keys) -> dict[str, torch.Tensor]:
        if self.latents != "reference":
            return {}
        xi = self.posterior_noise(core_model(reference_model).config, layout, pair_keys)
        # Through the wrapped model's forward (PEFT: the adapters as the caller set them, disabled for the reference).
        z0 = reference_model(scoring_pass=self._posterior_latents, input_ids=layout.input_ids,
                             attention_mask=layout.attention_mask, latent_noise=xi)
        return {"latents": z0.float()}

    @staticmethod
    def _posterior_latents(core, input_ids=None, attention_mask=None, latent_noise=None, grad: bool = False,
                           **_wrapper_kwargs) -> torch.Tensor:
        """z0 = μ + σ·ξ [B, W, d_z] of `core`'s VAE at every column of the layout rows (ξ taken per real column)."""
        vae = core.model.vae
        column = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        xi = take(latent_noise, column, attention_mask.bool())
        with torch.set_grad_enabled(grad):
            mean = vae.encoder(input_ids, attention_mask)
            return vae.sample_latents(mean, xi.to(mean))

    def position_errors(self, core, layout: BlockLayout, times, noise, draws) -> torch.Tensor:
        ids, mask = layout.input_ids, layout.attention_mask
        if self.latents == "reference":
            column = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
            z0 = take(draws["latents"], column, mask.bool()).to(ids.device, torch.float32)
        else:  # z0 as in the joint objective: the posterior sample, with gradient only when the VAE trains
            z0 = self._posterior_latents(core, ids, mask, draws["latent_noise"],
                                         grad=torch.is_grad_enabled() and core.config.trains_vae)
        return core.flow_matching_error(z0, times.to(z0.device), noise.to(z0), None, mask)


class AuroraResponseScorer(BlockFlowResponseScorer):
    """AURORA-LM's DPO response score: Σ over the response's latent positions of the plain denoising error at fixed
    (σ per response block, ε per position), one denoiser pass with a zero self-conditioning draft, no consistency
    term: mean_c (ẑ − z)² per position (divided by σ² when `loss_space="velocity"`), z the frozen encoder's
    standardised latent. The model must have its latent statistics (both models standardise with them)."""

    family: ClassVar[str] = "aurora"

    def position_errors(self, core, layout: BlockLayout, times, noise, draws) -> torch.Tensor:
        autoencoder = core.model.autoencoder
        if not bool(autoencoder.has_latent_statistics):
            raise ValueError("this AURORA model has no latent statistics: call `estimate_latent_statistics(rows)` "
                             "(the training loop's `prepare_training` does) before scoring responses")
        with torch.no_grad():
            z = autoencoder.standardize(autoencoder.encode(layout.input_ids, layout.attention_mask))
        return core.denoising_terms(z, times.to(z.device), noise.to(z), None, layout.attention_mask)


__all__ = ["ALIGNMENTS", "AuroraResponseScorer", "BlockFlowResponseScorer", "BlockLayout", "CALMLayout",
           "CALMResponseScorer", "ColaResponseScorer", "PAGE", "TokenStats", "paged_draws", "split_rows"]
