# Copyright 2025 The hf-latentlm authors. Licensed under the Apache License, Version 2.0.
"""Likelihood-free pieces for implicit samplers (CALM, paper 000): the energy loss, and temperature sampling
for a model that can only be drawn from.

Small, separately tested functions; no model state. Copied into Hub checkpoints, so torch only.
"""

from __future__ import annotations

import math

import torch


def energy_loss(samples: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Monte-Carlo energy loss (negative energy score, α = 1) per step, paper Eq. 10.

    samples [P, N, l]: N ≥ 2 model draws per step; targets [P, M, l]: M draws of the target.
        loss_p = 2/(N·M) Σ_n Σ_m ‖t_m − s_n‖  −  1/(N(N−1)) Σ_{n≠k} ‖s_n − s_k‖
    Returns (loss [P], fidelity [P], diversity [P]) with loss = fidelity − diversity. Pairwise distances come
    from `torch.cdist` (no Python loop over samples); a distance is never differentiated at 0 because the
    diagonal n = k is dropped before the square root.
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


def chunk_agreement(chunks: torch.Tensor) -> torch.Tensor:
    """chunks [B, S, K] token chunks -> bool [B, S, S]: sample i and j decoded to the same K tokens."""
    return (chunks[:, :, None, :] == chunks[:, None, :, :]).all(-1)


def log_binomial(count: torch.Tensor, n: float) -> torch.Tensor:
    """log C(count, n) for real n ≥ 1 via log-Gamma; −inf where count < n (fewer than n agreeing draws)."""
    count = count.double()
    value = torch.lgamma(count + 1) - math.lgamma(n + 1) - torch.lgamma((count - n).clamp(min=0) + 1)
    return torch.where(count >= n, value, torch.full_like(value, -math.inf))


def pool_temperature_choice(chunks: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    """Approximate temperature-T sampling from a pool of draws: pick a pool index per row.

    chunks [B, S, K]: the decoded chunks of S draws per row; uniforms [B] in [0, 1): the row's random number.
    Each DISTINCT chunk with `count` copies in the pool gets weight C(count, n), n = 1/T (the number of
    n-subsets of the pool that agree on it), i.e. each copy gets C(count, n) / count. With T = 1 this is a plain
    uniform pick from the pool. When no chunk occurs n times (all weights 0), the most frequent chunk is taken,
    which is also the T -> 0 limit ("greedy"). `temperature=0` asks for that limit directly.
    Returns LongTensor [B] of pool indices. Vectorised over rows and draws.
    """
    if chunks.dim() != 3 or uniforms.shape != chunks.shape[:1]:
        raise ValueError(f"expected chunks [B, S, K] and uniforms [B], got {tuple(chunks.shape)} and "
                         f"{tuple(uniforms.shape)}")
    counts = chunk_agreement(chunks).sum(-1)  # [B, S] copies of each draw's chunk
    most_frequent = counts.argmax(-1)
    if temperature == 0:
        return most_frequent
    log_w = log_binomial(counts, 1.0 / temperature) - counts.double().log()
    usable = torch.isfinite(log_w).any(-1)
    probs = torch.softmax(torch.where(usable[:, None], log_w, torch.zeros_like(log_w)), dim=-1)
    cdf = probs.cumsum(-1)
    picked = torch.searchsorted(cdf, uniforms.double()[:, None].to(cdf.device) * cdf[:, -1:]).squeeze(-1)
    picked = picked.clamp(max=chunks.shape[1] - 1)
    return torch.where(usable, picked, most_frequent)


def exact_temperature_choice(chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact temperature 1/n by rejection: chunks [B, A, n, K] are A attempts of n independent draws per row.

    An attempt is accepted when its n draws decode to the same chunk; the first accepted attempt is taken, so the
    result has probability ∝ p(chunk)^n. Returns (accepted [B] bool, chosen [B, K]: the agreed chunk of the first
    accepted attempt, arbitrary where nothing was accepted).
    """
    agree = (chunks == chunks[:, :, :1]).all(-1).all(-1)  # [B, A]
    accepted = agree.any(-1)
    first = agree.long().argmax(-1)
    chosen = chunks[torch.arange(chunks.shape[0], device=chunks.device), first, 0]
    return accepted, chosen


def exact_temperature_n(temperature: float, tolerance: float = 1e-6) -> int:
    """n with T = 1/n, or a ValueError naming T when it is not of that form."""
    if not 0 < temperature <= 1:
        raise ValueError(f"temperature must be in (0, 1], got {temperature}")
    n = round(1.0 / temperature)
    if abs(1.0 / n - temperature) > tolerance:
        raise ValueError(f"the exact temperature sampler needs T = 1/n for an integer n, got T = {temperature}; "
                         f"use temperature_sampler='pool' for other temperatures")
    return n


__all__ = ["energy_loss", "chunk_agreement", "log_binomial", "pool_temperature_choice", "exact_temperature_choice",
           "exact_temperature_n"]
