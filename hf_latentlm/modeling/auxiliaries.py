# Copyright 2025 The hf-latentlm authors. Licensed under the Apache License, Version 2.0.
"""Discrete auxiliaries of the Parallel Language Model (PLM): Voronoi/Laguerre cells and the quantile baseline.

This file is copied into Hub checkpoints by `save_pretrained`, so it imports only `torch`.

An auxiliary `u` is one of `N` fixed random unit vectors `e_u` (the "bank"). At every position `i` the bank is
partitioned into cells, one per likely next token, the cell of token `v` holding (close to) `N * q(v | x_<i)`
auxiliaries. The encoder describes the observed token `x_i` by an auxiliary drawn uniformly from its cell, and the
decoder recovers `x_i = f(u_i; q_i)` as the owner of `u_i`.

Voronoi / Laguerre cells (PLM paper, Eq. 10 and App. 11):

    f(u; q_i) = argmax_{v in T_i}  e_v . e_u + w_{i,v}

with `T_i` the `M` most likely tokens, `e_v` the UNNORMALISED LM-head row of token `v`, and offsets `w_{i,v}` fitted
per position so that the cell of `v` holds `n_{i,v}` auxiliaries (largest-remainder rounding of the renormalised
top-M probabilities; they sum to `N`). Training fits the offsets iteratively (`voronoi_owners`: most cells end
exact); decoding samples from the exact cells (`exact_voronoi_owners`: the one optimal assignment).

Quantile cells (the PTP baseline): token `v` owns the buckets b/N whose midpoint lies in its CDF interval.

Everything runs under `torch.no_grad()`, vectorised over positions. Ties go to the lowest index (candidate rank,
token id, auxiliary index) and every step is computed per position, so results do not depend on batching or chunking.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


# Offset-fit constants (`fit_laguerre_offsets`). Temperatures are in units of the per-position score scale `sigma`
# (RMS over the candidates of the std of e_v . e_u over the bank), so the fit is the same whatever the norm of the
# LM-head rows. Chosen with scripts/experiments/time_voronoi.py on LM-head-like inputs: the defaults stay within the
# paper's TV bound at a fraction of the cost of its 2 rounds x 12 sweeps x shortlist 8.
DEFAULT_ROUNDS = 4  # shortlist selections: one full selection, then 3 cheap refreshes (`_refresh_shortlist`)
DEFAULT_SWEEPS = 5  # Sinkhorn updates per round
CHUNK_ELEMENTS = 32 * 128 * 512  # default chunk budget of `voronoi_owners` in scores (8 MB of float32)
MIN_CHUNK = 32
DEFAULT_SHORTLIST = 6  # candidates per auxiliary in the soft assignment
DECODING_SWEEPS = 16  # dense updates of `exact_voronoi_owners`: enough that few exact moves are left to make
TAU_START = 0.05  # first sweep: soft enough to move many boundaries at once, sharp enough that a shortlist of 6 holds
#                   essentially all the soft mass
TAU_END = 1e-3  # last sweep: far below the typical score gap at a cell boundary, so soft loads ~ hard cell sizes
MAX_STEP = 4.0  # clip of one update in units of the current tau: log(n / load) explodes for an (almost) empty cell
MOMENTUM = 0.3  # heavy-ball over-relaxation: add 0.3 x the previous update (no momentum converges slower, 0.6 diverges)
CLOSED_OFFSET = -1.0e4  # offset of zero-capacity candidates, in units of sigma: they can never win an auxiliary
LOG_FLOOR = -80.0  # softmax logits are clamped here before exp: exp(-80) is still a normal float32, and denormal
#                    results make torch's CPU exp far slower


class VoronoiAssignment(NamedTuple):
    """Result of `voronoi_owners` for `P` positions, `N` auxiliaries and `M` candidates.

    owners:          [P, N] long, token id owning each auxiliary (always a candidate with positive capacity).
    candidates:      [P, M] long, token ids of the top-M tokens by probability (ties: lower token id first).
    capacities:      [P, M] long, target cell sizes n_{i,v} of the candidates; each row sums to N.
    total_variation: [P] float, TV between the fitted cell masses |cell_v| / N and the targets n_v / N.
    """

    owners: torch.Tensor
    candidates: torch.Tensor
    capacities: torch.Tensor
    total_variation: torch.Tensor


class TokenScores(NamedTuple):
    """Scores of every token against every auxiliary, precomputed once per LM-head weight version (`token_scores`).

    scores: [V, N] float32, e_v . e_u for every token v and auxiliary u.
    mean:   [V] float32, mean of each token's scores over the bank.
    std:    [V] float32, std of each token's scores over the bank.
    """

    scores: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


@torch.no_grad()
def token_scores(output_embeddings: torch.Tensor, bank: torch.Tensor) -> TokenScores:
    """`TokenScores` of the LM-head rows `output_embeddings` [V, d] (unnormalised) against the bank [N, d].

    Pass the result to `voronoi_owners(..., scores=...)` to skip the [V, d] x [d, N] product on every call (decode
    time); the owners are bit-identical to those computed without it.
    """
    scores = output_embeddings.detach().float() @ bank.detach().float().to(output_embeddings.device).T
    return TokenScores(scores, scores.mean(dim=1), scores.std(dim=1))


def sample_auxiliary_bank(num_auxiliaries: int, dim: int, seed: int) -> torch.Tensor:
    """`[N, d]` float32 unit vectors, uniform on the sphere S^{d-1}, from a private seeded generator.

    A normalised standard Gaussian is uniform on the sphere. The private `torch.Generator` makes the bank a pure
    function of `seed` (the global RNG is neither read nor advanced), so a checkpoint can rebuild it exactly.
    """
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    bank = torch.randn(num_auxiliaries, dim, generator=generator, dtype=torch.float64)
    return (bank / bank.norm(dim=-1, keepdim=True)).float()


@torch.no_grad()
def top_candidates(logits: torch.Tensor, top_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-M token ids `[P, M]` (descending logit, equal logits: lower token id first) and their renormalised probs.

    `torch.topk` picks the set (a full stable sort of the vocabulary costs far more); the selected ids are then put
    in a canonical order: sorted by id, then stably by descending logit. Only an exact tie AT the M-th logit is left
    to topk (deterministic for a given input, but not necessarily the lowest id). Renormalising the top-M
    probabilities is the same as a softmax over the M selected logits.
    """
    logits = logits.float()
    top_m = min(top_m, logits.shape[-1])
    candidates = torch.topk(logits, top_m, dim=-1).indices.sort(dim=-1).values
    order = torch.sort(logits.gather(1, candidates), dim=-1, descending=True, stable=True).indices
    candidates = candidates.gather(1, order)
    return candidates, torch.softmax(logits.gather(1, candidates), dim=-1)


@torch.no_grad()
def ranked_candidates(logits: torch.Tensor, top_m: int, num_auxiliaries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-M candidates `[P, M]` (`top_candidates`) and their capacities `[P, M]` (`largest_remainder_capacities`):
    what `voronoi_owners` starts from, for a caller that also needs them (e.g. to skip rows whose fit is trivial)
    and passes them on as `ranked`. Capacities are non-increasing along the candidates, so `(capacities > 0).sum(1)`
    counts the open cells; `voronoi_owners` needs no iterative fit where that is at most 2."""
    candidates, probs = top_candidates(logits, top_m)
    return candidates, largest_remainder_capacities(probs, num_auxiliaries)


@torch.no_grad()
def largest_remainder_capacities(probs: torch.Tensor, total: int) -> torch.Tensor:
    """Integer capacities `[P, M]` summing exactly to `total` per row (largest-remainder / Hamilton rounding).

    Rows are renormalised; every entry first gets floor(total * q), then each unit still missing goes to one of the
    entries with the largest fractional remainders (ties: lower column index first). Computed in float64 so that
    exact ties (e.g. q = 1/4 with total = 510) stay exact.
    """
    q = probs.double().clamp(min=0)
    q = q / q.sum(dim=-1, keepdim=True)
    exact = q * total
    base = exact.floor()
    missing = (total - base.sum(dim=-1, keepdim=True)).clamp(min=0)  # [P, 1]; < M
    # Rank of each entry by remainder, descending; the stable sort keeps lower indices first among equal remainders.
    order = torch.sort(exact - base, dim=-1, descending=True, stable=True).indices
    ranks = torch.arange(q.shape[-1], device=q.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, ranks)
    return (base + (rank < missing).double()).long()


@torch.no_grad()
def fit_laguerre_offsets(
    scores: torch.Tensor,
    capacities: torch.Tensor,
    rounds: int = DEFAULT_ROUNDS,
    sweeps: int = DEFAULT_SWEEPS,
    shortlist: int = DEFAULT_SHORTLIST,
    *,
    score_mean: torch.Tensor | None = None,
    score_std: torch.Tensor | None = None,
) -> torch.Tensor:
    """Offsets `w [P, M]` such that `argmax_v scores[p, u, v] + w[p, v]` puts ~`capacities[p, v]` auxiliaries in v.

    scores:     [P, N, M] float, e_v . e_u of the M candidates of each position. Fastest as the transposed view of a
                contiguous [P, M, N] tensor (what `voronoi_owners` passes): the fit works in that layout so that
                reductions over candidates are vectorised over auxiliaries.
    capacities: [P, M] long, rows summing to N. Zero-capacity candidates get a large negative offset.
    score_mean, score_std: optional [P, M] mean and std of each candidate's scores over the bank. `voronoi_owners`
                passes them from per-token statistics computed once for the vocabulary (cheaper, and identical
                however positions are batched); otherwise they are computed from `scores`.

    The offsets are the dual variables of the balanced assignment problem (maximise the total score subject to the
    capacities), fitted by annealed Sinkhorn in the log domain. At temperature tau

        pi(v | u) = softmax_v((s_uv + w_v) / tau),   l_v = sum_u pi(v | u),   w_v += tau * (log n_v - log l_v),

    raising underfilled and lowering overfilled cells. Details (constants at the top of the file):
      * Scale: sigma = RMS over open candidates of the per-candidate std of s_uv over the bank.
      * Init: w_v = -(mean_v + std_v * Phi^-1(1 - n_v / N)), where a Gaussian approximation of candidate v's scores
        would put n_v auxiliaries above the others' typical level.
      * Schedule: tau decreases geometrically from TAU_START * sigma to TAU_END * sigma over all rounds * sweeps
        updates (one continuous schedule; rounds only mark shortlist refreshes).
      * Over-relaxation: each step is scaled per cell by l_v / sum_u pi(v|u)(1 - pi(v|u)) >= 1 (a diagonal Newton
        step: at small tau only boundary auxiliaries respond to w_v, so the plain step is far too short), plus
        heavy-ball momentum (MOMENTUM x the previous step).
      * Clipping: each step is clipped to +-MAX_STEP * tau, since log(n / l) explodes for (almost) empty cells.
      * Reachable targets: a cell's load cannot exceed the number m_v of shortlists it appears in, so the target is
        min(n_v, m_v - 1/2); uncapped, a cell missing from almost all shortlists is pushed up at every sweep with no
        feedback and then swallows a large part of the bank.
      * Shortlists: each auxiliary's soft assignment looks only at its `shortlist` best candidates (by s_uv + w_v),
        selected in the first round (`_top_candidates_per_auxiliary`) and refreshed at every later one
        (`_refresh_shortlist`), so that they follow the offsets.
      * Early exit: rows whose hard cells hold their capacities exactly leave the fit at the start of a later round.
    The caller takes the final hard argmax over all M candidates.
    """
    scores = scores.transpose(1, 2).float()  # [P, M, N]: contiguous when the caller passed a transposed view
    num_pos, num_cand, num_aux = scores.shape
    shortlist = max(min(shortlist, num_cand), 1)

    if score_mean is None or score_std is None:
        score_mean, score_std = scores.mean(dim=2), scores.std(dim=2)
    offsets, sigma = _starting_offsets(capacities, score_mean, score_std, num_aux)
    log_capacity = torch.log(capacities.float().clamp(min=1e-30))

    total_updates = max(rounds * sweeps, 1)
    decay = (TAU_END / TAU_START) ** (1.0 / max(total_updates - 1, 1))
    # 1 / tau and tau of every update, split once into per-update [P, 1, (1)] tensors: at decode sizes every op of
    # a sweep counts, indexing included
    inv_tau = (1.0 / (TAU_START * sigma)) * torch.tensor(
        [decay**-k for k in range(total_updates)], dtype=torch.float32, device=sigma.device
    )  # [P, updates]
    inv_taus = inv_tau.t().contiguous()[:, :, None, None].unbind(0)
    taus = (1.0 / inv_tau).t().contiguous()[:, :, None].unbind(0)
    zeros = torch.zeros_like(offsets)  # scatter_add's out-of-place start: one op per load instead of two
    is_closed = capacities <= 0
    previous = torch.zeros_like(offsets)
    update_index = 0
    adjusted, work = torch.empty_like(scores), torch.empty_like(scores)  # dense scratch buffers of the refreshes
    short_idx = None
    fitted, rows = offsets, None  # once rows have left the fit: their final offsets, and the rows still fitted
    for _ in range(rounds):
        torch.add(scores, offsets[:, :, None], out=adjusted)
        if short_idx is None:
            short_idx = _top_candidates_per_auxiliary(adjusted, shortlist, work)
        else:
            # A row whose hard cells hold its capacities exactly is already the balanced assignment, which further
            # sweeps would only reproduce: its offsets are final and it can leave the fit. Rows leave once at least a
            # quarter of them are done: leaving copies the [P, M, N] scores, which a few finished rows do not repay.
            # Not under torch.compile: which rows leave is data-dependent (a graph break); the full schedule gives the
            # same owners.
            if not torch.compiler.is_compiling():
                done = _rows_holding_capacities(adjusted, capacities, work)
                finished = int(done.sum())
                if finished == done.shape[0]:
                    break
                if 4 * finished >= done.shape[0]:
                    if rows is None:
                        fitted, rows = torch.empty_like(offsets), torch.arange(num_pos, device=offsets.device)
                    fitted[rows[done]] = offsets[done]
                    keep = (~done).nonzero().squeeze(1)
                    rows = rows[keep]
                    scores, offsets, capacities, log_capacity, is_closed, previous, zeros, short_idx, adjusted = (
                        t.index_select(0, keep) for t in (scores, offsets, capacities, log_capacity, is_closed,
                                                          previous, zeros, short_idx, adjusted))
                    inv_taus = tuple(t.index_select(0, keep) for t in inv_taus)
                    taus = tuple(t.index_select(0, keep) for t in taus)
                    work = torch.empty_like(scores)
            short_idx = _refresh_shortlist(adjusted, short_idx, work)
        short_scores = scores.gather(1, short_idx)  # [P, K, N]
        flat_idx = short_idx.view(short_idx.shape[0], -1)
        members = torch.zeros_like(offsets).scatter_add_(1, flat_idx, torch.ones_like(flat_idx, dtype=offsets.dtype))
        target = torch.minimum(log_capacity, torch.log((members - 0.5).clamp(min=1e-30)))
        # Each sweep is a fixed number of torch ops whatever P: at decode sizes (a few positions) that is the cost.
        for _ in range(sweeps):
            # pi(v | u) = softmax over the shortlist (dim 1), in place: clamped before exp (see LOG_FLOOR)
            logits = torch.add(short_scores, offsets.gather(1, flat_idx).view_as(short_scores))
            logits = logits.mul_(inv_taus[update_index])
            logits.sub_(logits.amax(dim=1, keepdim=True)).clamp_(min=LOG_FLOOR).exp_()
            soft = logits.div_(logits.sum(dim=1, keepdim=True)).view_as(flat_idx)
            load = zeros.scatter_add(1, flat_idx, soft)
            squares = zeros.scatter_add(1, flat_idx, soft.square_())
            # relaxation l / sum_u pi (1 - pi) = l / (l - sum_u pi^2) >= 1 (1 for an empty cell)
            relaxation = torch.div(load, torch.sub(load, squares).clamp_(min=1e-12)).clamp_(min=1.0)
            step = relaxation.mul_(target - load.clamp_(min=1e-30).log_()).clamp_(-MAX_STEP, MAX_STEP)
            step = step.mul_(taus[update_index]).add_(previous, alpha=MOMENTUM).masked_fill_(is_closed, 0.0)
            offsets = offsets + step
            previous = step
            update_index += 1
    if rows is None:
        return offsets
    fitted[rows] = offsets
    return fitted


def _starting_offsets(capacities: torch.Tensor, score_mean: torch.Tensor, score_std: torch.Tensor, num_aux: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both fits' start: offsets `[P, M]` from capacity shares and score scale (CLOSED_OFFSET sigma for closed
    candidates) and the score scale sigma `[P, 1]` (see `fit_laguerre_offsets`)."""
    is_open = capacities > 0
    # sigma in float64: a tiny [P, M] reduction, kept exact so that it is bit-identical however positions are batched
    # (a last-bit difference in tau could flip a near-tie at the end).
    variance = score_std.double().square() * is_open
    sigma = (variance.sum(1, keepdim=True) / is_open.sum(1, keepdim=True)).sqrt().float().clamp(min=1e-12)  # [P, 1]
    share = (capacities.float() / num_aux).clamp(0.5 / num_aux, 1 - 0.5 / num_aux)
    init = -(score_mean.float() + score_std.float() * torch.special.ndtri(1 - share))
    return torch.where(is_open, init, CLOSED_OFFSET * sigma), sigma


def _rows_holding_capacities(adjusted: torch.Tensor, capacities: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """`[P]` bool: True where the hard cells of `adjusted` [P, M, N] (scores + offsets) hold exactly `capacities`
    [P, M]. Such cells are the optimal balanced assignment of that row (for any other assignment with these cell
    sizes the sum of scores + offsets is no larger, and the offsets add the same total), so a fit that reaches exact
    cells later ends with the same owners. Overwrites `work`."""
    local = _max_and_first_index(adjusted, work)[1]
    cell_sizes = torch.zeros_like(capacities).scatter_add_(1, local, torch.ones_like(local))
    return (cell_sizes == capacities).all(dim=1)


def _refresh_shortlist(adjusted: torch.Tensor, short_idx: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """Swap the best candidate outside each auxiliary's shortlist in for its worst member, if it now scores higher.

    adjusted [P, M, N] (scores + offsets; overwritten), short_idx [P, K, N], work: float buffer like `adjusted`
    -> new short_idx. A few dense passes instead of a fresh selection; it keeps every auxiliary's current winner in
    its shortlist.
    """
    member = adjusted.gather(1, short_idx).neg_()
    neg_worst, worst_slot = _max_and_first_index(member, member)  # [P, N]
    outsider, outsider_idx = _max_and_first_index(adjusted.scatter_(1, short_idx, float("-inf")), work)
    slot_idx = short_idx.gather(1, worst_slot[:, None])
    new_idx = torch.where((outsider + neg_worst > 0)[:, None], outsider_idx[:, None], slot_idx)
    return short_idx.scatter_(1, worst_slot[:, None], new_idx)


def _top_candidates_per_auxiliary(adjusted: torch.Tensor, k: int, work: torch.Tensor) -> torch.Tensor:
    """Indices `[P, k, N]` of the k largest `adjusted [P, M, N]` over dim 1 per auxiliary (ties: lowest index first).

    Overwrites `adjusted` and the float buffer `work`. Each pick is `_max_and_first_index`, then the picked entry is
    set to -inf; `torch.topk` over a non-innermost dimension is far slower on CPU.
    """
    picks = []
    for j in range(k):
        index = _max_and_first_index(adjusted, work)[1]
        picks.append(index)
        if j < k - 1:
            adjusted.scatter_(1, index[:, None], float("-inf"))
    return torch.stack(picks, dim=1)


def _max_and_first_index(values: torch.Tensor, work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`values.max(dim=1)` for [P, M, N] float: max [P, N] and the lowest index among equal maxima, long [P, N].

    Three vectorised passes (amax, compare into the float buffer `work`, which may be `values` itself, and a
    weighted amax) instead of torch's max-with-indices over a non-innermost dimension, which is not vectorised on
    CPU. The weights M - m are exact small integers in float32.
    """
    width = values.shape[1]
    best = values.amax(dim=1, keepdim=True)
    weights = torch.arange(width, 0, -1, dtype=values.dtype, device=values.device)[None, :, None]  # M - m
    hit = torch.ge(values, best, out=work).mul_(weights)
    return best[:, 0], (width - hit.amax(dim=1)).long()


@torch.no_grad()
def voronoi_owners(
    logits: torch.Tensor,
    output_embeddings: torch.Tensor,
    bank: torch.Tensor,
    top_m: int,
    rounds: int = DEFAULT_ROUNDS,
    sweeps: int = DEFAULT_SWEEPS,
    shortlist: int = DEFAULT_SHORTLIST,
    chunk_size: int | None = None,
    *,
    scores: TokenScores | None = None,
    ranked: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> VoronoiAssignment:
    """Laguerre-cell owners of every auxiliary at every position (PLM Eq. 10).

    logits:            [P, V] encoder logits of q(. | x_<i) (any float dtype).
    output_embeddings: [V, d] LM-head weight; its rows e_v are the cell sites, NOT normalised.
    bank:              [N, d] auxiliary unit vectors (`sample_auxiliary_bank`).
    top_m:             number M of candidate tokens per position.
    chunk_size:        positions fitted at once (a chunk's scores take chunk_size * N * M floats). Default: as many
                       as keep a chunk near CHUNK_ELEMENTS scores (at least MIN_CHUNK), so that large fits stay in
                       cache and small ones do not pay every sweep's ops for a handful of positions.
    scores:            optional `token_scores(output_embeddings, bank)`, e.g. cached per LM-head weight version; the
                       result is identical, without the [V, d] x [d, N] product.
    ranked:            optional `ranked_candidates(logits, top_m, N)` of these rows, when the caller has them.

    The owners of a position depend only on that position's logits (not on batching or chunking).
    """
    num_pos = logits.shape[0]
    num_aux = bank.shape[0]
    candidates, capacities = ranked_candidates(logits, top_m, num_aux) if ranked is None else ranked
    if scores is None:
        scores = token_scores(output_embeddings, bank)
    all_scores, token_mean, token_std = scores

    owners = torch.empty(num_pos, num_aux, dtype=torch.long, device=logits.device)
    total_variation = torch.empty(num_pos, dtype=torch.float32, device=logits.device)
    # Capacities are non-increasing along the candidate order, so zero-capacity candidates form a suffix that can
    # never win. Positions are fitted in chunks of similar numbers of open candidates (peaked positions have few),
    # and each chunk drops the columns closed at all of its positions; the owners are unchanged because those
    # candidates are excluded anyway.
    open_count = (capacities > 0).sum(dim=1)
    compiling = torch.compiler.is_compiling()
    order = None if compiling else torch.sort(open_count, stable=True).indices
    widths = None if compiling else open_count[order].tolist()  # non-decreasing
    start = 0
    if widths is not None:
        # Positions with one or two open candidates need no iterative fit (low-entropy text, e.g. counting or
        # copying, is mostly such positions at decode): one candidate owns the whole bank, and two split it exactly.
        start = sum(w <= 1 for w in widths)  # widths are sorted: the rows of width 1 come first
        end = sum(w <= 2 for w in widths)
        owners[order[:start]] = candidates[order[:start], :1]
        rows = order[start:end]
        if end > start:
            owners[rows] = _two_cell_owners(all_scores, candidates[rows], capacities[rows])
        total_variation[order[:end]] = 0.0
        start = end
    while start < num_pos:
        if order is None:
            # Under torch.compile keep every column and the batch order: the trimmed width is data-dependent (a graph
            # break), and the owners do not change (closed columns get CLOSED_OFFSET and never take an auxiliary).
            width = capacities.shape[1]
            end = min(num_pos, start + (chunk_size or max(MIN_CHUNK, CHUNK_ELEMENTS // (width * num_aux))))
            rows = torch.arange(start, end, device=logits.device)
        else:
            end = min(num_pos, start + (chunk_size or MIN_CHUNK))
            if chunk_size is None:  # grow while the chunk's [C, width, N] scores stay within the budget
                while end < num_pos and (end + 1 - start) * widths[end] * num_aux <= CHUNK_ELEMENTS:
                    end += 1
            rows = order[start:end]
            width = widths[end - 1]
        start = end
        cand, caps = candidates[rows, :width], capacities[rows, :width]
        chunk_scores = all_scores.index_select(0, cand.reshape(-1)).view(cand.shape[0], width, num_aux)  # [C, M, N]
        offsets = fit_laguerre_offsets(
            chunk_scores.transpose(1, 2),
            caps,
            rounds=rounds,
            sweeps=sweeps,
            shortlist=shortlist,
            score_mean=token_mean[cand],
            score_std=token_std[cand],
        )
        # Final hard assignment over ALL candidates, first maximum (lowest candidate rank) like argmax.
        local = _max_and_first_index(chunk_scores.add_(offsets[:, :, None]), chunk_scores)[1]  # [C, N]
        owners[rows] = cand.gather(1, local)
        cell_sizes = torch.zeros_like(caps).scatter_add_(1, local, torch.ones_like(local))
        total_variation[rows] = 0.5 * (cell_sizes - caps).abs().sum(dim=-1).float() / num_aux
    if order is None:
        # Same owners as the eager path for two-candidate positions (no data-dependent shapes: computed for every
        # position, kept where exactly two candidates are open).
        two = (open_count == 2)[:, None]
        owners = torch.where(two, _two_cell_owners(all_scores, candidates, capacities), owners)
        total_variation = torch.where(two[:, 0], torch.zeros_like(total_variation), total_variation)
    return VoronoiAssignment(owners, candidates, capacities, total_variation)


def _two_cell_owners(all_scores: torch.Tensor, candidates: torch.Tensor, capacities: torch.Tensor) -> torch.Tensor:
    """Exact Laguerre cells of the first two of `candidates` [P, M] (`capacities` [P, M]): the owner token `[P, N]` of
    every auxiliary.

    With two sites the balanced assignment is a threshold on d_u = s_u0 - s_u1: candidate 0 takes the n_0
    auxiliaries with the largest d_u (any other split can swap a pair and gain), which are the cells of the offset
    w_0 - w_1 = -(a value between the n_0-th and (n_0+1)-th largest d_u). Ties in d_u go to the lower bank index.
    So the cell masses are exactly the capacities, where the iterative fit only approaches them.
    """
    diff = all_scores[candidates[:, 0]] - all_scores[candidates[:, 1]]  # [P, N]
    ranking = torch.argsort(diff, dim=1, descending=True, stable=True)
    rank = torch.empty_like(ranking).scatter_(1, ranking, torch.arange(diff.shape[1], device=diff.device)
                                              .expand_as(ranking).contiguous())
    return candidates[:, :2].gather(1, (rank >= capacities[:, :1]).long())


@torch.no_grad()
def exact_voronoi_owners(
    logits: torch.Tensor,
    bank: torch.Tensor,
    top_m: int,
    scores: TokenScores,
    sweeps: int = DECODING_SWEEPS,
    *,
    ranked: tuple[torch.Tensor, torch.Tensor] | None = None,
    fit: Callable[..., torch.Tensor] | None = None,
) -> VoronoiAssignment:
    """The Laguerre cells of `voronoi_owners` holding their capacities exactly: decoding's sampler.

    Same inputs as `voronoi_owners` (the token `scores` required). Every cell holds exactly n_v auxiliaries, so the
    owner of a uniform auxiliary follows the rounded top-M distribution exactly (`total_variation` is 0). The cells
    are the balanced assignment maximising the total score (Eq. 10 with exact capacities), unique for generic scores,
    so wherever `voronoi_owners` ends with exact cells the owners are the same. Two steps, both cheap at decode sizes:
    `fit_dense_offsets` (dense Sinkhorn sweeps, which leave cells a few auxiliaries off) and `hold_capacities`
    (successive shortest paths to the exact assignment). Positions with at most two open candidates take the exact
    shortcuts of `voronoi_owners`. `fit`: what computes the offsets instead of `fit_dense_offsets` (same arguments
    and result), e.g. a compiled fit; the owners do not depend on it.
    """
    num_pos, num_aux = logits.shape[0], bank.shape[0]
    candidates, capacities = ranked_candidates(logits, top_m, num_aux) if ranked is None else ranked
    all_scores, token_mean, token_std = scores
    owners = candidates[:, :1].expand(num_pos, num_aux).clone()  # one open candidate: it owns the whole bank
    open_count = (capacities > 0).sum(dim=1)
    two = (open_count == 2).nonzero().squeeze(1)
    if two.numel():
        owners[two] = _two_cell_owners(all_scores, candidates[two], capacities[two])
    rows = (open_count > 2).nonzero().squeeze(1)
    if rows.numel():
        # Every candidate column, closed ones too (they never take an auxiliary): at decode sizes the op count is the
        # cost, not the width.
        cand, caps = candidates[rows], capacities[rows]
        chunk_scores = all_scores.index_select(0, cand.reshape(-1)).view(*cand.shape, num_aux)
        offsets = (fit or fit_dense_offsets)(chunk_scores, caps, token_mean[cand], token_std[cand], sweeps)
        owners[rows] = cand.gather(1, hold_capacities(chunk_scores, offsets, caps))
    return VoronoiAssignment(owners, candidates, capacities, torch.zeros(num_pos, device=logits.device))


@torch.no_grad()
def fit_dense_offsets(scores: torch.Tensor, capacities: torch.Tensor, score_mean: torch.Tensor,
                      score_std: torch.Tensor, sweeps: int = DECODING_SWEEPS) -> torch.Tensor:
    """Offsets `[P, M]` from `sweeps` annealed Sinkhorn updates over all candidates (no shortlists).

    scores [P, M, N] (e_v . e_u, candidates by rank), capacities [P, M] (zero: closed), score_mean / score_std
    [P, M] over the bank. The update, initialisation, schedule (TAU_START -> TAU_END sigma over the sweeps),
    over-relaxation, clip and momentum are those of `fit_laguerre_offsets`; the soft assignment is a softmax over
    every candidate instead of a shortlist, which at decode sizes (a few positions, M <= 128) is fewer ops.
    """
    offsets, sigma = _starting_offsets(capacities, score_mean, score_std, scores.shape[2])
    offsets = offsets[:, :, None]  # [P, M, 1] throughout the loop
    capacity = capacities.float()[:, :, None]
    decay = (TAU_END / TAU_START) ** (1.0 / max(sweeps - 1, 1))
    taus = (TAU_START * sigma) * torch.tensor([decay**k for k in range(sweeps)], device=sigma.device)  # [P, sweeps]
    taus = taus.t().contiguous()[:, :, None, None]
    schedule = zip((1.0 / taus).unbind(0), taus.unbind(0))  # (1 / tau, tau) of each update, [P, 1, 1] each
    is_closed = None if bool((capacities > 0).all()) else (capacities <= 0)[:, :, None]
    previous = torch.zeros_like(offsets)
    # a fixed number of ops per update: at decode sizes their count is the cost
    for inv_tau, tau in schedule:
        soft = torch.softmax(torch.add(scores, offsets).mul_(inv_tau), dim=1)  # pi(v | u) [P, M, N]
        load = soft.sum(dim=2, keepdim=True)
        squares = soft.square_().sum(dim=2, keepdim=True)
        relaxation = torch.div(load, torch.sub(load, squares).clamp_(min=1e-12)).clamp_(min=1.0)
        # log(n / l): +inf for an empty open cell, which the clip turns into the largest step
        step = relaxation.mul_(torch.div(capacity, load).log_()).clamp_(-MAX_STEP, MAX_STEP)
        step = step.mul_(tau).add_(previous, alpha=MOMENTUM)
        if is_closed is not None:
            step = step.masked_fill_(is_closed, 0.0)  # 0 / 0 there
        offsets = offsets + step
        previous = step
    return offsets[:, :, 0]


@torch.no_grad()
def hold_capacities(scores: torch.Tensor, offsets: torch.Tensor, capacities: torch.Tensor) -> torch.Tensor:
    """Local owners `[P, N]` (candidate index) of the balanced assignment: every candidate v holds exactly
    capacities[p, v] auxiliaries and the total score is the largest such (for generic scores, the one assignment
    whose cells are Laguerre cells of some offsets).

    scores [P, M, N], offsets [P, M] (any; a near fit needs few moves), capacities [P, M] summing to N per row.
    Starts from the cells of `offsets` (each auxiliary at its best candidate, which is optimal for those cell sizes)
    and moves one auxiliary at a time by successive shortest paths, in float64: moving auxiliary u from its cell a
    to b costs its reduced score r = (s_ua + w_a) - (s_ub + w_b) >= 0; the cheapest path from any overfull cell to
    an underfull one (Bellman-Ford over the [M, M] matrix of cheapest single moves) is taken, one auxiliary per
    edge, and the offsets are lowered by (D - min(dist_v, D)) so that the path's moves cost 0 and every reduced
    score stays >= 0 (D: the path's length, dist_v: each cell's distance). The assignment stays optimal for its cell
    sizes and reaches the capacities after as many moves as the cells had surplus auxiliaries.
    """
    num_pos, num_cand, num_aux = scores.shape
    if not bool((capacities.sum(dim=1) == num_aux).all()):
        raise ValueError(f"hold_capacities: every row's capacities must sum to the {num_aux} auxiliaries of the bank")
    adjusted = scores.double() + offsets.double()[:, :, None]  # [P, M, N], s_uv + w_v
    owner = _max_and_first_index(adjusted, torch.empty_like(adjusted))[1]  # [P, N]
    inf = float("inf")
    for _ in range(num_aux + 1):  # each pass moves one surplus auxiliary of every row that has one
        counts = torch.zeros_like(capacities).scatter_add_(1, owner, torch.ones_like(owner))
        rows = ((counts > capacities).any(dim=1)).nonzero().squeeze(1)
        if rows.numel() == 0:
            return owner
        if rows.numel() == num_pos:  # every row: work on the tensors themselves (decoding's usual single row)
            adj, own, surplus = adjusted, owner, counts - capacities
        else:
            adj, own, surplus = adjusted[rows], owner[rows], counts[rows] - capacities[rows]
        reduced = (adj.gather(1, own[:, None, :]) - adj).clamp_(min=0.0)  # [R, M(to), N]
        # cheapest single move from cell a to cell b: [R, M(from), M(to)]
        moves = torch.full((rows.shape[0], num_cand, num_cand), inf, dtype=adj.dtype, device=adj.device)
        moves.scatter_reduce_(1, own[:, :, None].expand(-1, -1, num_cand), reduced.transpose(1, 2), "amin")
        dist = torch.where(surplus > 0, 0.0, inf).to(adj.dtype)  # [R, M]
        parent = torch.full((rows.shape[0], num_cand), -1, dtype=torch.long, device=adj.device)
        underfull = surplus < 0
        # Bellman-Ford (costs >= 0: every pass only shortens paths), stopped once no cell nearer than the nearest
        # underfull one improved: later passes could only find paths at least that long, and the cells that far
        # keep their offsets (min(dist, D) = D), so the path found is a shortest one and the offsets are those of
        # running it out.
        while True:
            through, via = (dist[:, :, None] + moves).min(dim=1)
            shorter = through < dist
            dist, parent = torch.where(shorter, through, dist), torch.where(shorter, via, parent)
            length = torch.where(underfull, dist, inf).min(dim=1, keepdim=True)
            if not bool((shorter & (through < length.values)).any()):
                break
        adj += (dist.clamp(max=length.values) - length.values)[:, :, None]
        cell, row_index = length.indices[:, 0], torch.arange(rows.shape[0], device=adj.device)
        for _ in range(num_cand):  # back along the path: each edge moves the auxiliary of its cheapest move
            source = parent[row_index, cell]
            moving = source >= 0
            if not bool(moving.any()):
                break
            aux = torch.where(own == source[:, None], reduced[row_index, cell], inf).argmin(dim=1)
            own[row_index, aux] = torch.where(moving, cell, own[row_index, aux])
            cell = torch.where(moving, source, cell)
        if rows.numel() < num_pos:
            adjusted[rows], owner[rows] = adj, own
    raise RuntimeError("hold_capacities: the cells still miss their capacities after one move per auxiliary "
                       "(non-finite scores or offsets?)")


@torch.no_grad()
def quantile_owners(logits: torch.Tensor, num_auxiliaries: int) -> torch.Tensor:
    """Quantile-bucket owners `[P, N]` (the PTP baseline).

    Bucket b covers [b/N, (b+1)/N). Token v owns bucket b iff the bucket MIDPOINT (b + 1/2)/N lies in v's CDF
    interval [F(v-1), F(v)), tokens in vocabulary order. So every bucket has exactly one owner, zero-probability
    tokens (empty intervals) own nothing, and |cell(v)| differs from N * q(v) by less than 1.
    """
    cdf = torch.softmax(logits.float(), dim=-1).cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]  # exactly 1 at the end despite round-off
    midpoints = (torch.arange(num_auxiliaries, device=cdf.device, dtype=cdf.dtype) + 0.5) / num_auxiliaries
    # The number of CDF values <= midpoint is the index of the token whose interval contains it.
    owners = torch.searchsorted(cdf, midpoints.expand(cdf.shape[0], -1).contiguous(), right=True)
    return owners.clamp(max=logits.shape[-1] - 1)


@torch.no_grad()
def draw_auxiliary_in_cell(
    owners: torch.Tensor,
    targets: torch.Tensor,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """Index `[P]` of an auxiliary drawn uniformly from the cell of `targets`, or -1 where the target owns none.

    One uniform number per position: r = floor(U * |cell|) selects the r-th member of the cell in bank order (found
    with a cumulative count), exactly uniform over the cell. -1 marks targets outside the top M or with capacity 0;
    the decoder reads the mask auxiliary there. `uniform` [P] in [0, 1) gives the numbers U instead of drawing them
    from `generator` (default: the global RNG), e.g. `fixed_uniforms` for a deterministic evaluation.
    """
    in_cell = owners == targets[:, None]  # [P, N]
    cell_size = in_cell.sum(dim=-1)
    if uniform is None:
        uniform = torch.rand(owners.shape[0], generator=generator, device=owners.device)
    rank = torch.minimum((uniform * cell_size).long(), (cell_size - 1).clamp(min=0))  # 0-based rank in the cell
    hit = in_cell & (in_cell.cumsum(dim=-1) == (rank + 1)[:, None])  # exactly one True per non-empty row
    index = hit.long().argmax(dim=-1)
    return torch.where(cell_size > 0, index, torch.full_like(index, -1))


def fixed_uniforms(count: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`[count]` float32 numbers in [0, 1): the golden-ratio (Weyl) sequence frac((j + 1/2) / phi), j = 0..count-1.

    A fixed stand-in for `count` uniform draws where the result must not depend on any RNG (PLM's eval-mode
    auxiliaries): evenly spread over [0, 1) for every count, and built from tensor ops only, so it compiles (a
    seeded `torch.Generator` cannot be created inside a `torch.compile`d function). Integer arithmetic in units of
    2^-24 keeps it exact in float32 on every device and for any count (float `j / phi` loses the fraction for large j).
    """
    scale = 1 << 24
    step = round(scale * (5**0.5 - 1) / 2)
    j = torch.arange(count, device=device, dtype=torch.long)
    return ((j * step + step // 2) % scale).float() / scale


@torch.no_grad()
def decode_auxiliary(owners: torch.Tensor, aux_index: torch.Tensor) -> torch.Tensor:
    """Token `[P]` owning auxiliary `aux_index` at each position, f(u; q); -1 where `aux_index` is -1 (mask)."""
    token = owners.gather(1, aux_index.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(aux_index >= 0, token, torch.full_like(token, -1))


class VoronoiSampler:
    """The auxiliary cells of one PLM, for training and decoding alike, with the settings of its config (read at every
    call). The sites are passed in: the LM-head weight [V, d] and the bank [N, d], saved with the model's weights.
    "quantile" auxiliaries use the quantile buckets; "none" has no cells (owners None: the mask auxiliary everywhere).

    The token scores e_v . e_u are cached here, keyed by the identity and in-place version of both sites: recomputed
    once per optimizer step in training and once per model in decoding instead of once per fit."""

    def __init__(self, config):
        self.config = config
        self._scores_key, self._scores = None, None

    def token_scores(self, head: torch.Tensor, bank: torch.Tensor) -> TokenScores:
        """`token_scores(head, bank)`, cached while neither tensor changes."""
        if torch.compiler.is_compiling():  # no Python-side cache inside a graph
            return token_scores(head, bank)
        key = (head.data_ptr(), head._version, head.device, head.dtype, bank.data_ptr(), bank._version)
        if key != self._scores_key:
            self._scores_key, self._scores = key, token_scores(head, bank)
        return self._scores

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`ranked_candidates` of the rows of `logits` [P, V] for Voronoi cells (None for other types)."""
        cfg = self.config
        if cfg.auxiliary_type != "voronoi":
            return None
        return ranked_candidates(logits, cfg.auxiliary_top_m, cfg.num_auxiliaries)

    def training_cells(self, logits: torch.Tensor, head: torch.Tensor, bank: torch.Tensor,
                       observed: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Training's cells: the owner token of every auxiliary for each row of `logits` [P, V] -> ([P, N], TV [P]).

        Voronoi: the iterative fit (`voronoi_owners`). observed [P]: the token each row describes; only rows where it
        has a cell (an open top-M candidate) are fitted, since elsewhere the decoder reads the mask auxiliary whatever
        the cells are. The others get owner -1 (no cell is drawn there) and the TV is that of the fitted rows. A row's
        cells depend only on its own logits, so the fitted rows are those of fitting every row. Under torch.compile
        every row is fitted (which ones need it is data-dependent: a graph break)."""
        cfg = self.config
        logits = logits.detach().float()
        if cfg.auxiliary_type == "quantile":
            return quantile_owners(logits, cfg.num_auxiliaries), None
        if cfg.auxiliary_type != "voronoi":
            return None, None
        ranked = self.candidates(logits)
        if observed is None or torch.compiler.is_compiling():
            fit = self._fit(logits, head, bank, ranked)
            return fit.owners, fit.total_variation
        candidates, capacities = ranked
        rows = ((candidates == observed[:, None]) & (capacities > 0)).any(dim=1).nonzero().squeeze(1)
        fit = self._fit(logits[rows], head, bank, (candidates[rows], capacities[rows]))
        owners = fit.owners.new_full((logits.shape[0], fit.owners.shape[1]), -1)
        owners[rows] = fit.owners
        return owners, fit.total_variation

    def _fit(self, logits, head, bank, ranked) -> VoronoiAssignment:
        cfg = self.config
        return voronoi_owners(logits, head, bank, cfg.auxiliary_top_m, rounds=cfg.sinkhorn_rounds,
                              sweeps=cfg.sinkhorn_sweeps, shortlist=cfg.sinkhorn_shortlist,
                              scores=self.token_scores(head, bank), ranked=ranked)

    def decoding_cells(self, logits: torch.Tensor, head: torch.Tensor, bank: torch.Tensor,
                       ranked: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Decoding's cells: the owner token of every auxiliary [P, N] for each row of `logits` [P, V].

        Voronoi: the exact cells (`exact_voronoi_owners`), so a token drawn through a uniform auxiliary follows the
        rounded top-M q exactly. Other types: `training_cells`. `ranked`: the rows' `candidates`, when the caller
        computed them already."""
        cfg = self.config
        if cfg.auxiliary_type != "voronoi":
            return self.training_cells(logits, head, bank)[0]
        return exact_voronoi_owners(logits.detach().float(), bank, cfg.auxiliary_top_m, self.token_scores(head, bank),
                                    ranked=ranked, fit=self.fit_decoding_offsets).owners

    def fit_decoding_offsets(self, scores: torch.Tensor, capacities: torch.Tensor, score_mean: torch.Tensor,
                             score_std: torch.Tensor, sweeps: int) -> torch.Tensor:
        """The offsets `decoding_cells` starts its exact moves from: eager, the dense sweeps (`fit_dense_offsets`, the
        fewest ops); compiled (the model lists this method in `compiled_methods`), training's iterative fit, whose
        static schedule compiles into fewer, fused kernels and ends nearer the exact cells. Either way the moves end
        at the same exact cells."""
        if not torch.compiler.is_compiling():
            return fit_dense_offsets(scores, capacities, score_mean, score_std, sweeps)
        cfg = self.config
        return fit_laguerre_offsets(scores.transpose(1, 2), capacities, rounds=cfg.sinkhorn_rounds,
                                    sweeps=cfg.sinkhorn_sweeps, shortlist=cfg.sinkhorn_shortlist,
                                    score_mean=score_mean, score_std=score_std)
