"""Measurements of a trained Cola DLM text VAE on held-out text: reconstruction and its robustness to noise."""

from __future__ import annotations

import torch

from ..loading import load_model_and_tokenizer
from .harness import split_stream

#: Noise levels t of the robustness curve: the decoder reads z_t = (1 − t)·z + t·ε (paper 004, §4.3).
NOISE_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5)


@torch.no_grad()
def vae_measurements(model, stream: torch.Tensor, num_tokens: int = 20000, row_length: int = 256,
                     noise_levels: tuple[float, ...] = NOISE_LEVELS, seed: int = 0) -> dict:
    """Token accuracy of a `ColaTextVAE` on the first `num_tokens` of `stream` (cut into rows of `row_length`):
    decoding the posterior mean, a sampled z, and z_t for each noise level; plus the logSNR and the token count."""
    rows = stream[: (min(num_tokens, stream.numel()) // row_length) * row_length].view(-1, row_length)
    if rows.numel() == 0:
        raise ValueError(f"need at least {row_length} tokens, got {stream.numel()}")
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    parts = [model.reconstruction_accuracy(rows[i:i + 16], noise_levels, generator) for i in range(0, len(rows), 16)]
    weights = [min(16, len(rows) - i) for i in range(0, len(rows), 16)]

    def average(values):
        return sum(v * w for v, w in zip(values, weights)) / sum(weights)

    return {"num_tokens": rows.numel(), "logsnr": parts[0]["logsnr"],
            "accuracy_mean": average([p["accuracy_mean"] for p in parts]),
            "accuracy_sampled": average([p["accuracy_sampled"] for p in parts]),
            "accuracy_vs_noise": {t: average([p["accuracy_vs_noise"][t] for p in parts]) for t in noise_levels}}


def vae_report(folder: str, num_tokens: int = 20000) -> str:
    """Lines on a trained Cola VAE, on the validation split: accuracy from μ and from sampled z, and versus noise."""
    model, tokenizer = load_model_and_tokenizer(folder, language_model=False)
    r = vae_measurements(model, split_stream(tokenizer, "validation"), num_tokens)
    curve = ", ".join(f"t={t:g}: {a:.2%}" for t, a in r["accuracy_vs_noise"].items())
    return (f"VAE on {r['num_tokens']} validation tokens: accuracy {r['accuracy_mean']:.4%} (mean), "
            f"{r['accuracy_sampled']:.4%} (sampled z), logSNR {r['logsnr']:.2f}\n"
            f"accuracy of z_t = (1-t)z + t*noise: {curve}")
