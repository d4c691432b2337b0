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
