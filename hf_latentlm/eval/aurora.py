"""Measurements of a trained AURORA-LM query autoencoder on held-out text."""

from __future__ import annotations

import torch

from ..loading import load_model_and_tokenizer
from .harness import split_stream


@torch.no_grad()
def autoencoder_accuracy(model, stream: torch.Tensor, num_tokens: int = 20000, row_length: int = 256) -> dict:
    """Token accuracy of an `AuroraAutoencoder` (eval mode: no dropout) reconstructing the first `num_tokens` of
    `stream`, cut into rows of `row_length`."""
    rows = stream[: (min(num_tokens, stream.numel()) // row_length) * row_length].view(-1, row_length)
    if rows.numel() == 0:
        raise ValueError(f"need at least {row_length} tokens, got {stream.numel()}")
    model.eval()
    correct = sum(model.reconstruction_accuracy(rows[i:i + 16]) * rows[i:i + 16].numel()
                  for i in range(0, len(rows), 16))
    return {"num_tokens": rows.numel(), "accuracy": correct / rows.numel()}


def autoencoder_report(folder: str, num_tokens: int = 20000) -> str:
    """One line on a trained AURORA autoencoder: reconstruction accuracy on the validation split."""
    model, tokenizer = load_model_and_tokenizer(folder, language_model=False)
    r = autoencoder_accuracy(model, split_stream(tokenizer, "validation"), num_tokens)
    return (f"autoencoder on {r['num_tokens']} validation tokens: reconstruction accuracy {r['accuracy']:.4%} "
            f"(keep ratio {model.config.keep_ratio:g}, D = {model.config.latent_size})")
