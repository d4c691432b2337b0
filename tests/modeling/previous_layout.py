"""Tiny seeded models of every family, built through the public modeling API only (the same in every layout of the
package), and what they compute for fixed inputs. `tests/modeling/test_block_latent_compat.py` runs this file as a
script with an older copy of the package on PYTHONPATH, to save checkpoints and outputs the way that layout did:

    python previous_layout.py OUT_DIR EXPECTED_PACKAGE_DIR

and imports it to compute the same outputs with the current code."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

VOCAB = 64
BACKBONE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=1)
FAMILIES = ("cola", "aurora", "calm", "plm")


def randomize_zero_weights(model) -> None:
    """Zero-initialised output maps (adaLN modulations, velocity and energy heads) made random, so that outputs
    depend on every weight."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0.0, 0.1)


def build(family: str):
    """A fresh tiny model of `family` (seeded, so every call builds the same weights)."""
    from hf_latentlm import modeling as m

    torch.manual_seed(0)
    if family == "cola":
        vae = m.ColaTextVAE(m.ColaVAEConfig(**BACKBONE, latent_size=8, vae_block_size=2))
        torch.manual_seed(1)
        model = m.ColaForCausalLM.from_vae(vae, **BACKBONE, block_size=4, num_ode_steps=3, ode_solver="heun")
    elif family == "aurora":
        autoencoder = m.AuroraAutoencoder(m.AuroraAutoencoderConfig(**BACKBONE))
        with torch.no_grad():
            autoencoder.encoder.query.normal_()
            autoencoder.decoder.query.normal_()
        torch.manual_seed(1)
        model = m.AuroraForCausalLM.from_autoencoder(autoencoder, **BACKBONE, block_size=4, noisy_input_rank=8,
                                                     consistency_steps=4, num_ode_steps=3)
        model.estimate_latent_statistics(rows(8, 12, seed=5))
    elif family == "calm":
        autoencoder = m.CALMAutoencoder(m.CALMAutoencoderConfig(vocab_size=VOCAB, chunk_size=2, latent_size=8,
                                                                hidden_size=32, intermediate_size=64))
        torch.manual_seed(1)
        model = m.CALMForCausalLM.from_autoencoder(autoencoder, **BACKBONE, chunk_size=2, noise_size=8,
                                                   num_model_samples=2, num_target_samples=4)
    else:
        model = m.PLMForCausalLM(m.PLMConfig(**BACKBONE, block_size=4, k_pred=4, num_auxiliaries=16,
                                             auxiliary_top_m=8))
    randomize_zero_weights(model)
    return model


def rows(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def outputs(model) -> dict[str, torch.Tensor]:
    """What `model` computes for fixed inputs: the forward's main output (eval), the seeded generate() tokens of a
    left-padded batch and its network calls, and the training loss of a seeded step (train mode)."""
    ids = rows(2, 8, seed=1)
    model.eval()
    out = model(input_ids=ids)
    main = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    options = {model.row_seeds_option: [3, 4]}
    if hasattr(model.config, "decode_temperature"):  # a block-latent read-out: sampled, so every logit counts
        options["temperature"] = 0.7
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=7, eos_token_id=None,
                               return_dict_in_generate=True, **options)
    calls = generated.calls_by_network or {"model": generated.model_calls}
    model.train()
    torch.manual_seed(11)
    with torch.enable_grad():
        loss = model(input_ids=rows(2, 8, seed=2), labels=rows(2, 8, seed=2)).loss.detach()
    model.eval()
    return {"main": main, "tokens": generated.sequences, "loss": loss, **{f"calls/{k}": v for k, v in calls.items()}}


def main(out_dir: str, expected_package: str) -> None:
    import hf_latentlm

    loaded_from = Path(hf_latentlm.__file__).resolve().parent
    assert loaded_from == Path(expected_package).resolve(), f"hf_latentlm imported from {loaded_from}"
    for family in FAMILIES:
        model = build(family)
        folder = Path(out_dir) / family
        model.save_pretrained(folder)
        torch.save(outputs(model), folder / "outputs.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
