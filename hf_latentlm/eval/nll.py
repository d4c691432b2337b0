"""Token-level negative log-likelihood and perplexity, for models that define a likelihood."""

from __future__ import annotations

import math

import torch

from ..modeling.sampling import model_mode
from .sampling import model_device


def has_likelihood(model) -> bool:
    """AR models (and PLM's encoder) expose per-token logits; CALM-style samplers do not. A config that says
    `has_token_likelihood` is taken at its word; otherwise an output embedding (an LM head) means logits."""
    declared = getattr(model.config, "has_token_likelihood", None)
    if declared is not None:
        return bool(declared)
    return hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None


@torch.no_grad()
def evaluate_nll(model, rows: torch.Tensor, batch_size: int = 16) -> dict:
    """Mean NLL (nats/token) and perplexity over packed rows [N, T], each row scored on its own
    (T − 1 predicted tokens per row), token-weighted."""
    if rows.dim() != 2 or rows.shape[0] == 0:
        raise ValueError(f"rows must be a non-empty [N, T] tensor, got shape {tuple(rows.shape)}")
    device = model_device(model)
    total, count = 0.0, 0
    with model_mode(model, False):
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size].to(device)
            logits = model(input_ids=batch).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                    reduction="sum")
            total += nll.item()
            count += batch[:, 1:].numel()
    mean = total / count
    return {"nll": mean, "perplexity": math.exp(mean), "num_tokens": count}
