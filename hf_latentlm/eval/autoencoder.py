"""Measurements of a trained latent-family component (the CALM autoencoder) on held-out text."""

from __future__ import annotations

import torch

from ..loading import load_model_and_tokenizer
from .harness import split_stream


def autoencoder_report(folder: str, num_tokens: int = 20000) -> str:
    """One line on a trained CALM autoencoder: token accuracy decoding μ and a sampled z, and the mean σ, on the
    first `num_tokens` tokens of the validation split."""
    model, tokenizer = load_model_and_tokenizer(folder, language_model=False)
    stream = split_stream(tokenizer, "validation")
    k = model.config.chunk_size
    ids = stream[: (min(num_tokens, stream.numel()) // k) * k][None]
    r = model.reconstruction_accuracy(ids, generator=torch.Generator().manual_seed(0))
    return (f"autoencoder on {r['num_tokens']} validation tokens: accuracy {r['mean_accuracy']:.4%} (mean), "
            f"{r['sampled_accuracy']:.4%} (sampled z), mean posterior std {r['posterior_std']:.3f}")
