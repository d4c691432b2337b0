"""Brier-n and BrierLM: likelihood-free quality from two samples per position.

For a context with true continuation y and two independent model samples x¹, x², the unbiased estimate of the Brier
score of the n-token outcome is

    1{x¹₁..ₙ = y₁..ₙ} + 1{x²₁..ₙ = y₁..ₙ} − 1{x¹₁..ₙ = x²₁..ₙ}

averaged over positions (Brier-n); BrierLM = 100 × geometric mean of Brier-1..4 and BrierLM-2 = 100 × √(Brier-1 ·
Brier-2), the headline at small scale where Brier-3/4 vanish into noise. Each value comes with a percentile-bootstrap
95% interval over positions.
"""

from __future__ import annotations

import torch

from .sampling import evaluation_windows, sample_continuations

MAX_N = 4


def brier_terms(sample_a: torch.Tensor, sample_b: torch.Tensor, target: torch.Tensor, max_n: int = MAX_N) -> torch.Tensor:
    """Per-position unbiased Brier estimates [P, max_n] from two samples and the truth ([P, ≥max_n])."""
    a_hit = (sample_a[:, :max_n] == target[:, :max_n]).long().cumprod(dim=1)
    b_hit = (sample_b[:, :max_n] == target[:, :max_n]).long().cumprod(dim=1)
    agree = (sample_a[:, :max_n] == sample_b[:, :max_n]).long().cumprod(dim=1)
    return (a_hit + b_hit - agree).double()


def _geometric_score(means: torch.Tensor) -> torch.Tensor:
    """100 × geometric mean along the last dim; 0 where any factor is ≤ 0 (score undefined)."""
    positive = (means > 0).all(dim=-1)
    logs = torch.log(means.clamp(min=1e-300)).mean(dim=-1)
    return torch.where(positive, 100 * torch.exp(logs), torch.zeros_like(logs))


def interval_entry(value: torch.Tensor, boots: torch.Tensor) -> dict:
    """A point value with the 95% percentile interval of its bootstrap replicates `boots`."""
    lo, hi = torch.quantile(boots, torch.tensor([0.025, 0.975], dtype=boots.dtype)).tolist()
    return {"value": float(value), "ci_low": lo, "ci_high": hi, "interval_contains_zero": lo <= 0.0 <= hi}


def summarize_brier(terms: torch.Tensor, num_bootstrap: int = 1000, seed: int = 0) -> dict:
    """Brier-1..n, BrierLM and BrierLM-2 with 95% bootstrap intervals from per-position terms."""
    num_positions, max_n = terms.shape
    if num_positions == 0:
        raise ValueError("no positions to score")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(num_positions, (num_bootstrap, num_positions), generator=gen)
    boot_means = terms[idx].mean(dim=1)  # [num_bootstrap, max_n]
    means = terms.mean(dim=0)
    result = {f"brier_{n + 1}": interval_entry(means[n], boot_means[:, n]) for n in range(max_n)}
    result["brierlm_2"] = interval_entry(_geometric_score(means[:2]), _geometric_score(boot_means[:, :2]))
    if max_n >= 4:
        result["brierlm"] = interval_entry(_geometric_score(means[:4]), _geometric_score(boot_means[:, :4]))
    result["num_positions"] = num_positions
    return result


def batch_starts(total: int, batch_size: int, progress: bool, desc: str):
    """range(0, total, batch_size), shown as a progress bar named `desc` when `progress`."""
    starts = range(0, total, batch_size)
    if progress:
        from tqdm.auto import tqdm
        starts = tqdm(starts, desc=desc, dynamic_ncols=True)
    return starts


def paired_draws(model, contexts: torch.Tensor, batch_size: int = 64, seed: int = 0, progress: bool = False,
                 generate_kwargs: dict | None = None):
    """Yields (start, draws_a, draws_b): two independent MAX_N-token samples for each context of the batch that
    starts at row `start`. Each batch is sampled twice in one call ([contexts; contexts]). `generate_kwargs`:
    extra `generate()` options (e.g. a temperature), merged over the unbiased-sampling defaults."""
    for i, start in enumerate(batch_starts(len(contexts), batch_size, progress, "brier")):
        ctx = contexts[start:start + batch_size]
        draws = sample_continuations(model, torch.cat([ctx, ctx]), MAX_N, seed=seed * 1_000_003 + i,
                                     generate_kwargs=generate_kwargs)
        yield start, draws[:len(ctx)], draws[len(ctx):]


def brier_position_terms(model, stream: torch.Tensor, num_positions: int = 20000, context_len: int = 128,
                         batch_size: int = 64, seed: int = 0, progress: bool = False,
                         generate_kwargs: dict | None = None) -> torch.Tensor:
    """Per-position Brier terms [P, MAX_N] of `model` over evenly spaced windows of a token stream."""
    contexts, targets = evaluation_windows(stream, num_positions, context_len, MAX_N)
    return torch.cat([brier_terms(a, b, targets[start:start + len(a)])
                      for start, a, b in paired_draws(model, contexts, batch_size, seed, progress, generate_kwargs)])


def evaluate_brier(model, stream: torch.Tensor, num_positions: int = 20000, context_len: int = 128,
                   batch_size: int = 64, seed: int = 0, num_bootstrap: int = 1000, progress: bool = False,
                   generate_kwargs: dict | None = None) -> dict:
    """Brier-1..4, BrierLM, BrierLM-2 of `model` over evenly spaced windows of a token stream
    (`brier_position_terms`, summarised with bootstrap intervals)."""
    terms = brier_position_terms(model, stream, num_positions, context_len, batch_size, seed, progress,
                                 generate_kwargs)
    result = summarize_brier(terms, num_bootstrap=num_bootstrap, seed=seed)
    result["context_len"] = context_len
    return result


def headline(result: dict) -> str:
    """One line: BrierLM-2 with its interval, and Brier-1..4."""
    b2 = result["brierlm_2"]
    parts = [f"BrierLM-2 {b2['value']:.2f} [{b2['ci_low']:.2f}, {b2['ci_high']:.2f}]"]
    for n in range(1, MAX_N + 1):
        e = result.get(f"brier_{n}")
        if e:
            flag = " (≈0)" if e["interval_contains_zero"] else ""
            parts.append(f"Brier-{n} {e['value']:.4f}{flag}")
    return ", ".join(parts)


__all__ = ["brier_terms", "paired_draws", "brier_position_terms", "summarize_brier", "evaluate_brier", "headline"]
