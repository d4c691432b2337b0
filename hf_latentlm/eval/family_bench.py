"""The families' own measurements of `hf-latentlm bench --extras`, `measure(model, baseline, stream) -> dict`; each
family's registry entry names its function (`FamilySpec.bench_measurements`) and its extra decodings
(`FamilySpec.bench_decodings`). This module never imports the registry (it is imported from it, on read)."""

from __future__ import annotations

import torch

from .components import autoencoder_accuracy, vae_measurements
from .harness import nll_rows
from .sampling import evaluation_windows, sample_continuations


def plm_measurements(model, baseline, stream: torch.Tensor) -> dict:
    """R and the NLLs of the PLM objective on 64 validation rows, and what the Voronoi sampler's truncation costs
    (total variation to the full softmax) on 16."""
    from .plm import reconstruction, sampler_total_variation

    rows = nll_rows(stream)
    return {"validation": reconstruction(model, rows[:64]), "sampler": sampler_total_variation(model, rows[:16])}


@torch.no_grad()
def calm_measurements(model, baseline, stream: torch.Tensor, contexts: int = 1000, flops_context: int = 256) -> dict:
    """The frozen autoencoder's token accuracy (posterior mean and a sampled z) on the validation split; how often
    two draws of one chunk agree (what the exact temperature sampler waits for); FLOPs per token of the model and
    of the baseline (`eval.flops`)."""
    from .flops import inference_flops_per_token, training_flops_per_token

    k = model.config.chunk_size
    accuracy = model.autoencoder.reconstruction_accuracy(stream[: stream.numel() // k * k][None],
                                                         generator=torch.Generator().manual_seed(0))
    windows, _ = evaluation_windows(stream, contexts, 128, k)
    draws = sample_continuations(model, torch.cat([windows, windows]), k, seed=0)
    agree = (draws[:len(windows)] == draws[len(windows):]).all(1).float().mean().item()
    flops = {name: {"inference": inference_flops_per_token(m, flops_context)["per_token"],
                    "training": training_flops_per_token(m, flops_context)["per_token"]}
             for name, m in (("model", model), ("baseline", baseline))}
    return {"autoencoder": accuracy, "two_draws_agree_per_chunk": agree, "flops_per_token": flops}


def cola_measurements(model, baseline, stream: torch.Tensor) -> dict:
    """Token accuracy of the jointly trained VAE inside Cola (posterior mean, sampled z, noised z_t)."""
    return {"vae": vae_measurements(model.model.vae, stream)}


def aurora_measurements(model, baseline, stream: torch.Tensor) -> dict:
    """Reconstruction accuracy of the frozen autoencoder inside AURORA."""
    return {"autoencoder": autoencoder_accuracy(model.model.autoencoder, stream)}
