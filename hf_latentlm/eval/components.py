"""Measurements of a trained component (CALM's autoencoder, Cola's text VAE, AURORA's query autoencoder) on
held-out text. Each `*_report(model, tokenizer)` is the family's `training_report` in the registry, printed by
`hf-latentlm train` when a component run finishes."""

from __future__ import annotations

import torch

from .harness import split_stream
from .sampling import trained_row_length

#: Noise levels t of Cola's robustness curve: the decoder reads z_t = (1 − t)·z + t·ε (paper 004, §4.3).
NOISE_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5)
#: Rows per reconstruction call.
ROWS_PER_CALL = 16
#: Row length of the reconstruction checks, or the length the component was trained at when that is shorter.
ROW_LENGTH = 256


def checked_row_length(model) -> int:
    """`ROW_LENGTH`, or the component's `config.trained_seq_len` when shorter: a component is measured only at
    positions it was trained at. The reports name the length they used."""
    return trained_row_length(getattr(model, "config", None), ROW_LENGTH)


def reconstruction_rows(stream: torch.Tensor, num_tokens: int, row_length: int) -> torch.Tensor:
    """The first `num_tokens` of `stream` (at most) as whole rows of `row_length`; ValueError when not one fits."""
    rows = stream[: (min(num_tokens, stream.numel()) // row_length) * row_length].view(-1, row_length)
    if rows.numel() == 0:
        raise ValueError(f"need at least {row_length} tokens, got {stream.numel()}")
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# CALM
# ---------------------------------------------------------------------------------------------------------------------

def validation_stream(tokenizer, stream: torch.Tensor | None) -> torch.Tensor:
    """`stream` when given (a generated language's validation ids), else the embedded corpus's validation split."""
    return stream if stream is not None else split_stream(tokenizer, "validation")


def calm_autoencoder_report(model, tokenizer, num_tokens: int = 20000, stream: torch.Tensor | None = None) -> str:
    """One line on a trained CALM autoencoder: token accuracy decoding μ and a sampled z, and the mean σ, on the
    first `num_tokens` tokens of the validation split."""
    model.eval()
    stream = validation_stream(tokenizer, stream)
    k = model.config.chunk_size
    ids = stream[: (min(num_tokens, stream.numel()) // k) * k][None]
    r = model.reconstruction_accuracy(ids, generator=torch.Generator().manual_seed(0))
    return (f"autoencoder on {r['num_tokens']} validation tokens: accuracy {r['mean_accuracy']:.4%} (mean), "
            f"{r['sampled_accuracy']:.4%} (sampled z), mean posterior std {r['posterior_std']:.3f}")


# ---------------------------------------------------------------------------------------------------------------------
# Cola DLM
# ---------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def vae_measurements(model, stream: torch.Tensor, num_tokens: int = 20000, row_length: int | None = None,
                     noise_levels: tuple[float, ...] = NOISE_LEVELS, seed: int = 0) -> dict:
    """Token accuracy of a `ColaTextVAE` on the first `num_tokens` of `stream` (cut into rows of `row_length`):
    decoding the posterior mean, a sampled z, and z_t for each noise level; plus the logSNR, the token count and
    the row length (default `checked_row_length`)."""
    row_length = row_length or checked_row_length(model)
    rows = reconstruction_rows(stream, num_tokens, row_length)
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    batches = rows.split(ROWS_PER_CALL)
    parts = [model.reconstruction_accuracy(batch, noise_levels, generator) for batch in batches]

    def average(values):
        return sum(v * len(batch) for v, batch in zip(values, batches)) / len(rows)

    return {"num_tokens": rows.numel(), "row_length": row_length, "logsnr": parts[0]["logsnr"],
            "accuracy_mean": average([p["accuracy_mean"] for p in parts]),
            "accuracy_sampled": average([p["accuracy_sampled"] for p in parts]),
            "accuracy_vs_noise": {t: average([p["accuracy_vs_noise"][t] for p in parts]) for t in noise_levels}}


def cola_vae_report(model, tokenizer, num_tokens: int = 20000, stream: torch.Tensor | None = None) -> str:
    """Lines on a trained Cola VAE, on the validation split: accuracy from μ and from sampled z, and versus noise."""
    r = vae_measurements(model, validation_stream(tokenizer, stream), num_tokens)
    curve = ", ".join(f"t={t:g}: {a:.2%}" for t, a in r["accuracy_vs_noise"].items())
    return (f"VAE on {r['num_tokens']} validation tokens (rows of {r['row_length']}): accuracy {r['accuracy_mean']:.4%} (mean), "
            f"{r['accuracy_sampled']:.4%} (sampled z), logSNR {r['logsnr']:.2f}\n"
            f"accuracy of z_t = (1-t)z + t*noise: {curve}")


# ---------------------------------------------------------------------------------------------------------------------
# AURORA-LM
# ---------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def autoencoder_accuracy(model, stream: torch.Tensor, num_tokens: int = 20000, row_length: int | None = None) -> dict:
    """Token accuracy of an `AuroraAutoencoder` (eval mode: no dropout) reconstructing the first `num_tokens` of
    `stream`, cut into rows of `row_length` (default `checked_row_length`)."""
    row_length = row_length or checked_row_length(model)
    rows = reconstruction_rows(stream, num_tokens, row_length)
    model.eval()
    correct = sum(model.reconstruction_accuracy(batch) * batch.numel() for batch in rows.split(ROWS_PER_CALL))
    return {"num_tokens": rows.numel(), "row_length": row_length, "accuracy": correct / rows.numel()}


def aurora_autoencoder_report(model, tokenizer, num_tokens: int = 20000, stream: torch.Tensor | None = None) -> str:
    """One line on a trained AURORA autoencoder: reconstruction accuracy on the validation split."""
    r = autoencoder_accuracy(model, validation_stream(tokenizer, stream), num_tokens)
    return (f"autoencoder on {r['num_tokens']} validation tokens (rows of {r['row_length']}): reconstruction accuracy {r['accuracy']:.4%} "
            f"(keep ratio {model.config.keep_ratio:g}, D = {model.config.latent_size})")
