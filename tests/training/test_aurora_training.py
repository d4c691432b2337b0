"""AURORA-LM through the shared Accelerate loop (hf_latentlm/training/loop.py), on tiny rows of 14 tokens (a partial
denoiser block at the end of every row): exact resume of everything the denoiser carries between steps (the EMA copy,
the step count that ramps λ_ct, the latent statistics of the first batch), and a 2-process CPU DDP run."""

import shutil
from pathlib import Path

import latent_fixtures as lf
import pytest
import torch
from safetensors.torch import load_file

from hf_latentlm.training import loop
from hf_latentlm.training.loop import TrainConfig, train

ROW_LENGTH = 14

autoencoder_folder = lf.component_folder_fixture("aurora-ae")
short_rows = lf.short_rows_fixture(ROW_LENGTH)


def aurora_config(out, autoencoder_folder, **overrides) -> TrainConfig:
    # consistency_warmup_steps 3: λ_ct is still ramping at the resume point (step 2) and capped after it.
    return lf.tiny_train_config("aurora", out, ROW_LENGTH, {"autoencoder": autoencoder_folder},
                                {"consistency_warmup_steps": 3}, **overrides)


def test_aurora_resumes_exactly(tmp_path, tokenizer, short_rows, autoencoder_folder, monkeypatch):
    straight = train(aurora_config(tmp_path / "a", autoencoder_folder), tokenizer=tokenizer, train_rows=short_rows)
    first = train(aurora_config(tmp_path / "b", autoencoder_folder, stop_at_step=2), tokenizer=tokenizer,
                  train_rows=short_rows)
    assert first["step"] == 2
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed = train(aurora_config(tmp_path / "b", autoencoder_folder, resume=True), tokenizer=tokenizer,
                    train_rows=short_rows)
    assert resumed["step"] == straight["step"] == 4

    a, b = lf.logged_steps(tmp_path / "a"), lf.logged_steps(tmp_path / "b")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert {"loss", "denoising_loss", "consistency_loss", "consistency_weight", "grad_norm"} <= set(ra)
        for key, value in ra.items():
            if key != "tokens_per_s":
                assert rb[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (ra["step"], key)
    # λ_ct ramps over 3 optimizer steps: the forward of step k runs after k − 1 of them.
    assert [r["consistency_weight"] for r in a] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])

    final_a, final_b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(final_a) == set(final_b)
    for name, value in final_a.items():
        torch.testing.assert_close(final_b[name], value, atol=1e-6, rtol=0, msg=name)
    assert final_a["optimizer_steps"].item() == 4
    assert final_a["model.autoencoder.has_latent_statistics"].item()
    # The EMA copy moved away from where the denoiser started, and lags behind where it is now.
    ema = {n.removeprefix("ema_denoiser."): v for n, v in final_a.items() if n.startswith("ema_denoiser.")}
    online = {n.removeprefix("model.denoiser."): v for n, v in final_a.items() if n.startswith("model.denoiser.")}
    assert set(ema) == set(online)
    assert max((ema[n] - online[n]).abs().max().item() for n in ema) > 1e-6
    # The frozen autoencoder's weights are those of its folder (only its statistics buffers were set).
    saved = load_file(Path(autoencoder_folder) / "model.safetensors")
    for name, value in saved.items():
        if not name.startswith(("latent_", "has_latent")):
            assert torch.equal(final_a["model.autoencoder." + name], value), name

    # The comparison can fail: the same resume without restoring the RNG (times, noise, drafts) is another run.
    monkeypatch.setattr(loop, "load_rank_rng", lambda checkpoint, rank: None)
    train(aurora_config(tmp_path / "c", autoencoder_folder, resume=True), tokenizer=tokenizer, train_rows=short_rows)
    unrestored = load_file(tmp_path / "c" / "model.safetensors")
    assert max((unrestored[n] - v).abs().max().item() for n, v in final_a.items() if v.is_floating_point()) > 1e-5


def test_aurora_trains_with_two_process_ddp(tmp_path, tokenizer, short_rows, autoencoder_folder):
    """torchrun, 2 CPU processes, 2 steps: both ranks end with identical weights, EMA copy and latent statistics; the
    denoiser and its EMA move, the frozen autoencoder's weights do not."""
    ranks, initial = lf.two_process_ddp(tmp_path, short_rows, tokenizer, "aurora", "autoencoder", autoencoder_folder)

    def moved(prefix):
        return max((ranks[0][n].float() - v.float()).abs().max().item() for n, v in initial.items()
                   if n.startswith(prefix))

    assert moved("model.denoiser.layers.") > 1e-4 and moved("ema_denoiser.") > 1e-6
    assert moved("model.autoencoder.encoder.") == 0 and moved("model.autoencoder.decoder.") == 0
    assert ranks[0]["optimizer_steps"].item() == 2
