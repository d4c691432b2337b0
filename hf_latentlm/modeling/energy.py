# Copyright 2025 The hf-latentlm authors. Licensed under the Apache License, Version 2.0.
"""Likelihood-free pieces for implicit samplers (CALM, paper 000): the energy loss, and temperature sampling
for a model that can only be drawn from.

Small, separately tested functions; no model state. Copied into Hub checkpoints, so torch only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def energy_loss(samples: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Monte-Carlo energy loss (negative energy score, α = 1) per step, paper Eq. 10.

    samples [P, N, l]: N ≥ 2 model draws per step; targets [P, M, l]: M draws of the target.
        loss_p = 2/(N·M) Σ_n Σ_m ‖t_m − s_n‖  −  1/(N(N−1)) Σ_{n≠k} ‖s_n − s_k‖
    Returns (loss [P], fidelity [P], diversity [P]) with loss = fidelity − diversity, vectorised over samples.
    """
    if samples.dim() != 3 or targets.dim() != 3 or samples.shape[0] != targets.shape[0] \
            or samples.shape[2] != targets.shape[2]:
        raise ValueError(f"energy_loss expects samples [P, N, l] and targets [P, M, l], got {tuple(samples.shape)} "
                         f"and {tuple(targets.shape)}")
    n = samples.shape[1]
    if n < 2:
        raise ValueError(f"energy_loss needs at least 2 model samples per step, got {n}")
    fidelity = 2 * torch.cdist(samples, targets.to(samples.dtype)).mean(dim=(1, 2))
    # Squared distances, then sqrt only off the diagonal: sqrt'(0) is infinite, and cdist's own guard for it
    # differs between backends. The diagonal is masked with `where` (1.0 under the sqrt, weight 0 after it), not
    # dropped by boolean indexing, which torch.compile cannot trace without a graph break.
    sq = (samples[:, :, None, :] - samples[:, None, :, :]).pow(2).sum(-1)  # [P, N, N]
    off = ~torch.eye(n, dtype=torch.bool, device=samples.device)
    distance = torch.where(off, sq.clamp(min=1e-12), 1.0).sqrt()
    diversity = torch.where(off, distance, 0.0).sum(dim=(1, 2)) / (n * (n - 1))
    return fidelity - diversity, fidelity, diversity


def chunk_keys(chunks: torch.Tensor) -> torch.Tensor:
    """chunks [B, S, K] (token ids >= 0) -> LongTensor [B·S]: one key per (row, chunk) pair, equal keys = the same
    row and the same chunk.

    The pair is ranked one token column at a time with 1-D `torch.unique` (a sort), so the keys stay below B·S·V and
    nothing is S × S: pools of hundreds of draws for thousands of rows stay cheap."""
    batch, size, k = chunks.shape
    key = torch.arange(batch, device=chunks.device).repeat_interleave(size)
    for column in chunks.reshape(batch * size, k).long().unbind(-1):
        _, key = torch.unique(key * (int(column.max()) + 1) + column, return_inverse=True)
    return key


def chunk_counts(chunks: torch.Tensor) -> torch.Tensor:
    """chunks [B, S, K] -> LongTensor [B, S]: how many draws of the same row decoded to draw s's chunk."""
    key = chunk_keys(chunks)
    return torch.bincount(key)[key].view(chunks.shape[:2])


def first_draws(chunks: torch.Tensor) -> torch.Tensor:
    """chunks [B, S, K] -> bool [B, S]: draw s is the first of its row to decode to its chunk."""
    key = chunk_keys(chunks)
    position = torch.arange(key.numel(), device=key.device)
    first = torch.full((int(key.max()) + 1,), key.numel(), device=key.device).scatter_reduce(0, key, position, "amin")
    return (first[key] == position).view(chunks.shape[:2])


def inverse_temperature(temperature: float, tolerance: float = 1e-9) -> float:
    """r = 1/T for T in (0, 1], snapped to the nearest integer when within `tolerance` (1/0.25 is 4, and an
    integer r must not pick up rounding noise), or a ValueError naming T."""
    if not 0 < temperature <= 1:
        raise ValueError(f"temperature must be in (0, 1], got {temperature}")
    r = 1.0 / temperature
    return float(round(r)) if abs(r - round(r)) <= tolerance else r


def log_binomial(count: torch.Tensor, r: float | torch.Tensor) -> torch.Tensor:
    """log C(count, r) = log Γ(count+1) − log Γ(r+1) − log Γ(count−r+1) for real r ≥ 0 (broadcast with count): the
    number of r-subsets of `count` agreeing draws, extended to real r. −inf where count ≤ r − 1.

    Where count > r − 1 every Gamma argument is positive, so the value is real and finite; for integer r it is
    log math.comb(count, r). For count ≤ r − 1 the extension is 0 at integers and changes sign in between, so such
    counts get no weight, as below r in the integer case."""
    count = count.double()
    r = torch.as_tensor(r, dtype=torch.float64, device=count.device)
    valid = count > r - 1
    value = torch.lgamma(count + 1) - torch.lgamma(r + 1) - torch.lgamma(torch.where(valid, count - r + 1, 1.0))
    return torch.where(valid, value, -math.inf)


def pool_temperature_choice(chunks: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    """Approximate temperature-T sampling from a pool of draws: pick a pool index per row.

    chunks [B, S, K]: the decoded chunks of S draws per row; uniforms [B] in [0, 1): the row's random number.
    Each DISTINCT chunk with `count` copies in the pool gets weight C(count, r), r = 1/T (`log_binomial`, any real
    r): for integer r the number of r-subsets of the pool that agree on it, whose mean is C(S, r)·p^r; for any r it
    grows as count^r / Γ(r+1), so the choice law tends to p^(1/T)/Σ as the pool grows. When no chunk has a positive
    weight (every count ≤ r − 1), r steps down by one until one does (r → r−1 → …; every drawn chunk qualifies once
    r ≤ 2), the reference's cascade n → n−1 → … → 1 for integer r, then the same weighted random pick.
    The pick is the official code's: the distinct chunks in order of first appearance, the first whose cumulative
    weight exceeds u · total; so the same draws and u give the same chunk. With T = 1 this is a plain uniform pick
    from the pool; `temperature=0` takes the most frequent chunk (the T -> 0 limit, "greedy"). Returns LongTensor [B]
    of pool indices. Vectorised over rows and draws.
    """
    if chunks.dim() != 3 or uniforms.shape != chunks.shape[:1]:
        raise ValueError(f"expected chunks [B, S, K] and uniforms [B], got {tuple(chunks.shape)} and "
                         f"{tuple(uniforms.shape)}")
    counts = chunk_counts(chunks)  # [B, S] copies of each draw's chunk
    if temperature == 0:
        return counts.argmax(-1)
    r = inverse_temperature(temperature)
    # Step-down, per row: the smallest k >= 0 with (most frequent count) > r − k − 1.
    steps = (r - counts.max(-1).values.double()).floor().clamp(min=0)  # [B]
    # Each distinct chunk's weight C(count, r') sits on its first draw; later copies weigh 0.
    first = first_draws(chunks)
    log_w = torch.where(first, log_binomial(counts, r - steps[:, None]), -math.inf)
    cdf = torch.softmax(log_w, dim=-1).cumsum(-1)
    target = uniforms.double()[:, None].to(cdf.device) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=chunks.shape[1] - 1)
    # A rounding overshoot can only land on a later copy; step back to a first draw of some chunk.
    return torch.where(first.gather(1, picked[:, None]).squeeze(1), picked,
                       (log_w > -math.inf).long().cumsum(-1).argmax(-1))


class RejectionState(NamedTuple):
    """Where exact temperature sampling stands in each row's stream of draws (see `exact_temperature_scan`).

    candidate [B, K]: the chunk the current attempt is about; agreed [B]: stage-1 draws equal to it so far (0 = no
    attempt under way); trials [B]: stage-2 draws so far; accepted [B]: the row is done and `candidate` is its
    chunk."""

    candidate: torch.Tensor
    agreed: torch.Tensor
    trials: torch.Tensor
    accepted: torch.Tensor

    @classmethod
    def start(cls, batch: int, chunk_size: int, device=None) -> "RejectionState":
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(torch.zeros(batch, chunk_size, dtype=torch.long, device=device), zeros, zeros.clone(),
                   torch.zeros(batch, dtype=torch.bool, device=device))

    def rows(self, index: torch.Tensor) -> "RejectionState":
        return RejectionState(*(part[index] for part in self))

    def with_rows(self, index: torch.Tensor, rows: "RejectionState") -> "RejectionState":
        parts = [part.clone() for part in self]
        for part, new in zip(parts, rows):
            part[index] = new
        return RejectionState(*parts)


def exact_temperature_scan(chunks: torch.Tensor, uniforms: torch.Tensor, temperature: float,
                           state: RejectionState | None = None) -> RejectionState:
    """Exact temperature-T sampling from a sampler that can only be drawn from: the accepted chunk x has probability
    p(x)^(1/T) / Σ_y p(y)^(1/T), for every T in (0, 1]. The scheme of the CALM paper's general-T algorithm
    (integer-part rejection, then a stage for the fractional part; that section is not in the shared paper copy,
    so the law is derived here and tested in tests/modeling/test_energy.py).

    Write 1/T = n + α (n = ⌊1/T⌋, α ∈ [0, 1)). An attempt takes the next draw as its candidate x.
    - Stage 1 (integer part): the next n − 1 draws must equal x, else the attempt is rejected (probability p^n).
    - Stage 2 (fractional part, α > 0; a Bernoulli factory for p^α): for i = 1, 2, …: draw; equal to x -> accept;
      otherwise reject with probability α / i, else go on. It accepts with probability
      p Σ_m q^m (1−α)_m / m! = p · p^(α−1) = p^α (q = 1 − p), after p^(α−1) draws on average.
    A rejected attempt is discarded whole (the draw that failed it never starts the next one) and the next draw
    starts a new attempt.

    chunks [B, D, K]: the next D draws of each row's stream; uniforms [B, D] in [0, 1): one per draw (read only in
    stage 2). `state` carries an attempt across calls (None = fresh rows), so draws can come in rounds and the law
    does not depend on D. Rows already accepted are left as they are. Returns the new state; `candidate` is the
    chunk of the accepted rows. A Python loop over the D draws, vectorised over rows.
    """
    if chunks.dim() != 3 or uniforms.shape != chunks.shape[:2]:
        raise ValueError(f"expected chunks [B, D, K] and uniforms [B, D], got {tuple(chunks.shape)} and "
                         f"{tuple(uniforms.shape)}")
    r = inverse_temperature(temperature)
    n = int(r)
    alpha = r - n
    if state is None:
        state = RejectionState.start(chunks.shape[0], chunks.shape[2], chunks.device)
    candidate, agreed, trials, accepted = state
    for t in range(chunks.shape[1]):
        draw, u = chunks[:, t], uniforms[:, t]
        live = ~accepted
        same = (draw == candidate).all(-1)
        stage1 = live & (agreed < n)
        stage2 = live & (agreed == n)
        # Stage 1: start an attempt, extend it, or reject it.
        candidate = torch.where((stage1 & (agreed == 0))[:, None], draw, candidate)
        agreed = torch.where(stage1, torch.where((agreed == 0) | same, agreed + 1, 0), agreed)
        if alpha == 0:
            accepted = accepted | (stage1 & (agreed == n))
        # Stage 2: the i-th draw (i = trials + 1) accepts on a match, else rejects with probability α / i.
        accepted = accepted | (stage2 & same)
        going_on = stage2 & ~same
        reject = going_on & (u < alpha / (trials + 1))
        trials = torch.where(reject, 0, torch.where(going_on, trials + 1, trials))
        agreed = torch.where(reject, 0, agreed)
    return RejectionState(candidate, agreed, trials, accepted)


__all__ = ["energy_loss", "chunk_counts", "chunk_keys", "first_draws", "inverse_temperature", "log_binomial",
           "pool_temperature_choice", "RejectionState", "exact_temperature_scan"]
