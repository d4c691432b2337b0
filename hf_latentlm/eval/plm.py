"""Measurements only a PLM has: reconstructed tokens R and tokens per model call."""

from __future__ import annotations

import statistics

import torch


@torch.no_grad()
def reconstruction(model, rows: torch.Tensor, batch_size: int = 16) -> dict:
    """Mean R, encoder NLL and decoder NLL of the PLM objective on validation rows (block phase 0)."""
    model.eval()
    parts = {"reconstructed_tokens": [], "encoder_nll": [], "decoder_nll": [], "mask_auxiliary_fraction": [],
             "auxiliary_tv": []}
    for start in range(0, len(rows), batch_size):
        out = model(input_ids=rows[start:start + batch_size], labels=rows[start:start + batch_size])
        for key in parts:
            value = getattr(out, key)
            if value is not None:
                parts[key].append(float(value))
    return {k: statistics.fmean(v) for k, v in parts.items() if v}


@torch.no_grad()
def tokens_per_call(model, prompts: torch.Tensor, new_tokens: int, seed: int = 0, **kwargs) -> float:
    torch.manual_seed(seed)
    out = model.generate(prompts, max_new_tokens=new_tokens, eos_token_id=None, return_dict_in_generate=True, **kwargs)
    return float(out.num_new_tokens.sum() / out.model_calls.sum())


@torch.no_grad()
def sampler_total_variation(model, rows: torch.Tensor, batch_size: int = 8) -> dict:
    """What the Voronoi sampler's truncation costs: the mean over positions of TV(sampler, q), where the sampler's
    next-token law is |cell(v)| / N_aux (a uniform auxiliary picks a cell) and q is the encoder's full softmax; and
    of the fit's own TV (cell sizes against the integer capacities, paper App. 12: < 0.3%)."""
    model.eval()
    sampler, fit = [], []
    for start in range(0, len(rows), batch_size):
        logits = model(input_ids=rows[start:start + batch_size]).logits[:, :-1].float()
        logits = logits.reshape(-1, logits.shape[-1])
        owners, fit_tv = model.auxiliary_owners(logits)
        cells = torch.zeros_like(logits).scatter_add_(1, owners, torch.ones_like(owners, dtype=logits.dtype))
        law = cells / owners.shape[1]
        sampler.append(0.5 * (law - logits.softmax(-1)).abs().sum(-1))
        fit.append(fit_tv)
    return {"sampler_vs_softmax_tv": float(torch.cat(sampler).mean()), "fit_tv": float(torch.cat(fit).mean())}

