# Copyright 2025 The hf-latentlm authors. Licensed under the Apache License, Version 2.0.
"""Discrete auxiliaries of the Parallel Language Model (PLM): Voronoi/Laguerre cells and the quantile baseline.

This file is copied into Hub checkpoints by `save_pretrained`, so it imports only `torch`.

An auxiliary `u` is one of `N` fixed random unit vectors `e_u` (the "bank"). At every position `i` the bank is
partitioned into disjoint cells, one per likely next token, so that the cell of token `v` holds (close to)
`N * q(v | x_<i)` auxiliaries. The encoder then describes the observed token `x_i` by an auxiliary drawn uniformly
from its cell, and the decoder recovers `x_i = f(u_i; q_i)` by looking up the owner of `u_i`.

Voronoi / Laguerre cells (PLM paper, Eq. 10 and App. 11):

    f(u; q_i) = argmax_{v in T_i} e_v . e_u + w_{i,v}

with `T_i` the `M` most likely tokens, `e_v` the UNNORMALISED LM-head row of token `v`, and offsets `w_{i,v}` fitted
per position so that the cell of `v` holds `n_{i,v}` auxiliaries (integer capacities from largest-remainder
rounding of the renormalised top-M probabilities). Auxiliaries are sampled, never differentiated, so everything
here runs under `torch.no_grad()`.

Quantile cells (the PTP baseline): the bank is the `N` equal buckets of [0, 1) and token `v` owns the buckets whose
midpoint lies in its CDF interval, vocabulary order.

Everything is vectorised over positions; the only Python loops are over rounds, sweeps and chunks of positions.
Ties are always broken towards the lowest index (candidate rank, token id or auxiliary index), so results are
deterministic given the inputs and do not depend on how positions are batched or chunked.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


# ----------------------------------------------------------------------------------------------------------------
# Constants of the offset fit (see `fit_laguerre_offsets`). All temperatures are in units of the per-position score
# scale `sigma` (std of e_v . e_u over the bank and the candidates), so the fit does not care whether LM-head rows
# have norm 0.1 or 10.
# ----------------------------------------------------------------------------------------------------------------
TAU_START = 1.0  # first sweep: softer than the score spread, so the init offsets already give the right loads
TAU_END = 0.005  # last sweep: far below the typical gap between an auxiliary's two best cells -> soft ~ hard
RELAXATION = 1.5  # over-relaxation of the Sinkhorn step (1 = plain Sinkhorn); speeds up the annealed fit
MAX_STEP = 4.0  # clip of one update, in units of the current tau: log(n / l) explodes when a cell is empty
ZERO_CAPACITY_OFFSET = -1.0e4  # in units of sigma: candidates with capacity 0 can never win an auxiliary


class VoronoiAssignment(NamedTuple):
    """Result of `voronoi_owners` for a batch of `P` positions with `N` auxiliaries and `M` candidates.

    owners:          [P, N] long, token id owning each auxiliary (always a candidate with positive capacity).
    candidates:      [P, M] long, token ids of the top-M tokens, by probability (ties: lower token id first).
    capacities:      [P, M] long, target cell sizes n_{i,v}; each row sums to N.
    total_variation: [P] float, TV between fitted cell masses (|cell| / N) and the targets n / N.
    """

    owners: torch.Tensor
    candidates: torch.Tensor
    capacities: torch.Tensor
    total_variation: torch.Tensor


def sample_auxiliary_bank(num_auxiliaries: int, dim: int, seed: int) -> torch.Tensor:
    """`[N, d]` float32 unit vectors, uniform on the sphere S^{d-1}, from a private seeded generator.

    A normalised standard Gaussian is uniform on the sphere. The private `torch.Generator` keeps the bank a pure
    function of `seed` (the global RNG is neither read nor advanced), so a checkpoint can rebuild it exactly.
    """
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    bank = torch.randn(num_auxiliaries, dim, generator=generator, dtype=torch.float64)
    bank = bank / bank.norm(dim=-1, keepdim=True)
    return bank.float()


@torch.no_grad()
def top_candidates(logits: torch.Tensor, top_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-M token ids `[P, M]` (descending logit, ties: lower token id first) and their renormalised probs.

    `torch.topk` does not promise which of several equal values it returns, so the selection and the order are
    taken from a stable sort (ties keep vocabulary order). Renormalising over the top M is the same as a softmax
    over the M selected logits.
    """
    logits = logits.float()
    candidates = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_m]
    probs = torch.softmax(logits.gather(1, candidates), dim=-1)
    return candidates, probs


@torch.no_grad()
def largest_remainder_capacities(probs: torch.Tensor, total: int) -> torch.Tensor:
    """Integer capacities `[P, M]` summing exactly to `total` per row (largest-remainder / Hamilton rounding).

    Rows are renormalised; every entry first gets floor(total * q), then the units still missing go one each to
    the entries with the largest fractional remainders (ties: lower column index first). Computed in float64 so
    that exact ties (e.g. q = 1/4 with total = 510) stay exact.
    """
    q = probs.double().clamp(min=0)
    q = q / q.sum(dim=-1, keepdim=True)
    exact = q * total
    base = exact.floor()
    remainder = exact - base
    missing = (total - base.sum(dim=-1, keepdim=True)).clamp(min=0)  # [P, 1], < M
    # Rank of each entry by remainder, descending; the stable sort keeps lower indices first among equal remainders.
    order = torch.sort(remainder, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(q.shape[-1], device=q.device).expand_as(order))
    return (base + (rank < missing).double()).long()


@torch.no_grad()
def fit_laguerre_offsets(
    scores: torch.Tensor,
    capacities: torch.Tensor,
    rounds: int = 2,
    sweeps: int = 12,
    shortlist: int = 8,
    *,
    tau_start: float = TAU_START,
    tau_end: float = TAU_END,
    relaxation: float = RELAXATION,
    max_step: float = MAX_STEP,
    init_scale: float | None = None,
    newton: bool = False,
) -> torch.Tensor:
    """Offsets `w [P, M]` such that `argmax_v scores[p, u, v] + w[p, v]` puts ~`capacities[p, v]` auxiliaries in v.

    scores:     [P, N, M] float, e_v . e_u for the M candidates of each position.
    capacities: [P, M] long, rows summing to N.

    The offsets are the dual variables of the balanced assignment problem (maximise the total score subject to the
    capacities), found by annealed Sinkhorn in the log domain. At temperature tau

        pi(v | u) = softmax_v((s_uv + w_v) / tau),   l_v = sum_u pi(v | u),   w_v += tau * (log n_v - log l_v),

    which raises underfilled and lowers overfilled cells. Details:
      * Scale: sigma = std of the scores of the position; every temperature is a multiple of sigma.
      * Init: w_v = tau_0 * log(n_v / N). At tau_0 >= the score spread the softmax is dominated by the offsets, so
        the initial loads are already ~n_v and the annealing starts near its fixed point.
      * Schedule: tau decreases geometrically from tau_start * sigma to tau_end * sigma over all rounds * sweeps
        updates (one continuous schedule; rounds only mark shortlist refreshes).
      * Steps are over-relaxed (x `relaxation`) and clipped to `max_step * tau`: an empty cell has log l = -inf.
      * Zero-capacity candidates get a large negative offset and are never updated, so they never win.
      * Shortlists: the soft assignment of each auxiliary only looks at its `shortlist` best candidates under the
        current offsets (cells far down the ranking get ~0 mass anyway); they are refreshed at each round.
    The caller takes the final hard argmax over all M candidates.
    """
    num_pos, num_aux, num_cand = scores.shape
    scores = scores.float()
    shortlist = min(shortlist, num_cand)
    open_cell = capacities > 0
    log_capacity = torch.log(capacities.clamp(min=1).float())

    sigma = scores.std(dim=(1, 2)).clamp(min=1e-6)[:, None]  # [P, 1]
    total_updates = max(rounds * sweeps, 1)
    decay = (tau_end / tau_start) ** (1.0 / max(total_updates - 1, 1))

    closed = ZERO_CAPACITY_OFFSET * sigma
    init_scale = tau_start if init_scale is None else init_scale
    offsets = torch.where(open_cell, init_scale * sigma * (log_capacity - math.log(num_aux)), closed)

    step = 0
    for _ in range(rounds):
        # Shortlist: the `shortlist` best candidates of each auxiliary under the current offsets.
        short_idx = torch.topk(scores + offsets[:, None, :], shortlist, dim=-1).indices  # [P, N, K]
        short_scores = scores.gather(-1, short_idx)
        flat_idx = short_idx.view(num_pos, -1)
        for _ in range(sweeps):
            tau = tau_start * decay**step * sigma  # [P, 1]
            step += 1
            short_offsets = offsets.gather(1, flat_idx).view_as(short_scores)
            soft = torch.softmax((short_scores + short_offsets) / tau[:, :, None], dim=-1)
            load = torch.zeros_like(offsets).scatter_add_(1, flat_idx, soft.view(num_pos, -1))
            update = relaxation * (log_capacity - torch.log(load.clamp(min=1e-30)))
            if newton:
                curv = torch.zeros_like(offsets).scatter_add_(1, flat_idx, (soft * (1 - soft)).view(num_pos, -1))
                update = update * load / curv.clamp(min=1e-6)
            update = update.clamp(-max_step, max_step) * tau
            offsets = torch.where(open_cell, offsets + update, closed)
    return offsets


@torch.no_grad()
def voronoi_owners(
    logits: torch.Tensor,
    output_embeddings: torch.Tensor,
    bank: torch.Tensor,
    top_m: int,
    rounds: int = 2,
    sweeps: int = 12,
    shortlist: int = 8,
    chunk_size: int = 256,
) -> VoronoiAssignment:
    """Laguerre-cell owners of every auxiliary at every position (PLM Eq. 10).

    logits:            [P, V] encoder logits q(. | x_<i) (any float dtype).
    output_embeddings: [V, d] LM-head weight; its rows e_v are the cell sites, NOT normalised.
    bank:              [N, d] auxiliary unit vectors (`sample_auxiliary_bank`).
    top_m:             number M of candidate tokens per position.
    chunk_size:        positions fitted at once; memory ~ chunk_size * N * M floats.

    The owners of a position depend only on that position's logits (chunking and batching do not change them).
    """
    num_pos = logits.shape[0]
    num_aux = bank.shape[0]
    candidates, probs = top_candidates(logits, top_m)
    capacities = largest_remainder_capacities(probs, num_aux)

    # All auxiliary-token scores once, transposed so that gathering a candidate gives one contiguous row of N.
    all_scores = (output_embeddings.float() @ bank.float().T).contiguous()  # [V, N]

    owners = torch.empty(num_pos, num_aux, dtype=torch.long, device=logits.device)
    total_variation = torch.empty(num_pos, dtype=torch.float32, device=logits.device)
    for start in range(0, num_pos, chunk_size):
        cand = candidates[start : start + chunk_size]
        caps = capacities[start : start + chunk_size]
        scores = all_scores[cand].transpose(1, 2)  # [C, N, M] view of a [C, M, N] gather
        offsets = fit_laguerre_offsets(scores, caps, rounds=rounds, sweeps=sweeps, shortlist=shortlist)
        # Final hard assignment over ALL M candidates; argmax returns the first maximum (lowest candidate rank).
        local = torch.argmax(scores + offsets[:, None, :], dim=-1)  # [C, N]
        owners[start : start + chunk_size] = cand.gather(1, local)
        cell_sizes = torch.zeros_like(caps).scatter_add_(1, local, torch.ones_like(local))
        total_variation[start : start + chunk_size] = 0.5 * (cell_sizes - caps).abs().sum(-1).float() / num_aux
    return VoronoiAssignment(owners, candidates, capacities, total_variation)


def mean_total_variation(assignment: VoronoiAssignment) -> float:
    """Mean over positions of the TV between fitted and target cell masses (paper App. 12: < 0.3%)."""
    return float(assignment.total_variation.mean())


@torch.no_grad()
def quantile_owners(logits: torch.Tensor, num_auxiliaries: int) -> torch.Tensor:
    """Quantile-bucket owners `[P, N]` (the PTP baseline).

    Bucket b covers [b/N, (b+1)/N). Token v owns bucket b iff the bucket MIDPOINT (b + 1/2)/N lies in v's CDF
    interval [F(v-1), F(v)), tokens in vocabulary order. So every bucket has exactly one owner, zero-probability
    tokens (empty intervals) own nothing, and |cell(v)| differs from N * q(v) by less than 1.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]  # exact 1 at the end despite float round-off
    midpoints = (torch.arange(num_auxiliaries, device=logits.device, dtype=cdf.dtype) + 0.5) / num_auxiliaries
    # Number of CDF values <= midpoint = index of the token whose interval contains it.
    owners = torch.searchsorted(cdf, midpoints.expand(cdf.shape[0], -1).contiguous(), right=True)
    return owners.clamp(max=logits.shape[-1] - 1)


@torch.no_grad()
def draw_auxiliary_in_cell(
    owners: torch.Tensor, targets: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Index `[P]` of an auxiliary drawn uniformly from the cell of `targets`, or -1 where the target owns none.

    Uses one uniform number per position: r = floor(U * |cell|) picks the r-th member of the cell in bank order
    (found with a cumulative count), which is exactly uniform over the cell. -1 marks positions whose target is
    outside the top M or got capacity 0; the decoder reads the mask auxiliary there.
    """
    in_cell = owners == targets[:, None]  # [P, N]
    cell_size = in_cell.sum(dim=-1)  # [P]
    uniform = torch.rand(owners.shape[0], generator=generator, device=owners.device)
    pick = (uniform * cell_size).long().clamp(max=(cell_size - 1).clamp(min=0))  # 0-based rank inside the cell
    hit = in_cell & (in_cell.cumsum(dim=-1) == (pick + 1)[:, None])  # exactly one True per non-empty row
    index = hit.long().argmax(dim=-1)
    return torch.where(cell_size > 0, index, torch.full_like(index, -1))


@torch.no_grad()
def decode_auxiliary(owners: torch.Tensor, aux_index: torch.Tensor) -> torch.Tensor:
    """Token `[P]` owning auxiliary `aux_index` at each position, f(u; q); -1 where `aux_index` is -1 (mask)."""
    token = owners.gather(1, aux_index.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(aux_index >= 0, token, torch.full_like(token, -1))
