"""Cola DLM through the shared Accelerate loop (hf_latentlm/training/loop.py), on tiny rows of 13 tokens (a partial
VAE block and a partial DiT block at the end of every row): exact resume with the VAE at half the DiT's learning rate,
and a 2-process CPU DDP run. The generic every-family resume test (test_loop.py) checks only the final loss; this one
compares every logged loss part of every step."""

import shutil
from pathlib import Path

import latent_fixtures as lf
import pytest
import torch
from safetensors.torch import load_file

from hf_latentlm.training import loop
from hf_latentlm.training.loop import TrainConfig, train

ROW_LENGTH = 13

vae_folder = lf.component_folder_fixture("cola-vae")
short_rows = lf.short_rows_fixture(ROW_LENGTH)


def cola_config(out, vae_folder, **overrides) -> TrainConfig:
    return lf.tiny_train_config("cola", out, ROW_LENGTH, {"vae": vae_folder}, {"vae_learning_rate_ratio": 0.5},
                                **overrides)


def loss_parts(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("tokens_per_s",)}


def test_cola_resumes_exactly(tmp_path, tokenizer, short_rows, vae_folder, monkeypatch):
    straight = train(cola_config(tmp_path / "a", vae_folder), tokenizer=tokenizer, train_rows=short_rows)
    first = train(cola_config(tmp_path / "b", vae_folder, stop_at_step=2), tokenizer=tokenizer, train_rows=short_rows)
    assert first["step"] == 2 and not (tmp_path / "b" / "model.safetensors").exists()
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed = train(cola_config(tmp_path / "b", vae_folder, resume=True), tokenizer=tokenizer, train_rows=short_rows)
    assert resumed["step"] == straight["step"] == 4

    # Every step's loss and loss parts (flow matching, VAE, reconstruction, KL, masked, reference KL, logSNR, lr and
    # gradient norm), steps 1-2 from the first half and 3-4 from the resumed run.
    a, b = lf.logged_steps(tmp_path / "a"), lf.logged_steps(tmp_path / "b")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    expected_parts = {"loss", "flow_matching_loss", "vae_loss", "reconstruction_nll", "kl", "mask_nll",
                      "reference_kl", "logsnr", "lr", "grad_norm"}
    for ra, rb in zip(a, b):
        assert expected_parts <= set(ra) and set(loss_parts(ra)) == set(loss_parts(rb))
        for key, value in loss_parts(ra).items():
            assert rb[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (ra["step"], key)
    assert a[-1]["reference_kl"] > 0, "the jointly trained VAE moves away from its reference"

    final_a, final_b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(final_a) == set(final_b) and any(k.startswith("reference_encoder.") for k in final_a)
    for name, value in final_a.items():
        torch.testing.assert_close(final_b[name], value, atol=1e-6, rtol=0, msg=name)
    # The reference encoder is the frozen stage-1 encoder: still the saved VAE's encoder after training.
    vae = load_file(Path(vae_folder) / "model.safetensors")
    for name, value in vae.items():
        if name.startswith("encoder."):
            assert torch.equal(final_a["reference_" + name], value), name

    # The comparison can fail: the same resume without restoring the RNG (times, noise, dropouts) is another run.
    monkeypatch.setattr(loop, "load_rank_rng", lambda checkpoint, rank: None)
    train(cola_config(tmp_path / "c", vae_folder, resume=True), tokenizer=tokenizer, train_rows=short_rows)
    unrestored = load_file(tmp_path / "c" / "model.safetensors")
    assert max((unrestored[n] - v).abs().max().item() for n, v in final_a.items()) > 1e-5


def test_cola_trains_with_two_process_ddp(tmp_path, tokenizer, short_rows, vae_folder):
    """torchrun, 2 CPU processes, 2 steps: DDP keeps both ranks' weights identical (the VAE's included, trained
    jointly), the DiT and the VAE move, the reference encoder does not."""
    ranks, initial = lf.two_process_ddp(tmp_path, short_rows, tokenizer, "cola", "vae", vae_folder)

    def moved(prefix):
        return max((ranks[0][n] - v).abs().max().item() for n, v in initial.items() if n.startswith(prefix))

    assert moved("model.layers.") > 1e-4 and moved("model.vae.") > 1e-4 and moved("velocity_head.") > 1e-4
    assert moved("reference_encoder.") == 0
