import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_latentlm.families import build_model
from hf_latentlm.training.checkpoint import latest_checkpoint, list_checkpoints
from hf_latentlm.training.loop import TrainConfig, lr_multiplier, sample_indices, train

WORKER = Path(__file__).with_name("ddp_worker.py")


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    values = dict(family="ar", preset="tiny", output_dir=str(tmp_path), max_steps=8, batch_size=4, seq_len=64,
                  eval_every=4, eval_batches=2, save_every=4, log_every=1, progress_bar=False, seed=3)
    values.update(overrides)
    return TrainConfig(**values)


def run(cfg, tokenizer, rows):
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.family, cfg.preset, tokenizer)
    metrics = train(cfg, model=model, tokenizer=tokenizer, train_rows=rows[:200], val_rows=rows[200:240])
    return model, metrics


def test_exact_resume_matches_uninterrupted_run(tmp_path, tokenizer, tiny_rows):
    straight_model, straight = run(tiny_config(tmp_path / "a"), tokenizer, tiny_rows)
    _, first_half = run(tiny_config(tmp_path / "b", stop_at_step=4), tokenizer, tiny_rows)
    assert first_half["step"] == 4
    assert not (tmp_path / "b" / "model.safetensors").exists(), "an interrupted run must not write the final model"
    resumed_model, resumed = run(tiny_config(tmp_path / "b", resume=True), tokenizer, tiny_rows)
    assert resumed["step"] == 8
    assert abs(resumed["loss"] - straight["loss"]) < 1e-5
    assert abs(resumed["val_loss"] - straight["val_loss"]) < 1e-5
    for (name, a), (_, b) in zip(straight_model.state_dict().items(), resumed_model.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    # A resumed run keeps one metrics log: steps 1-4 from the first half, 5-8 from the resume.
    steps = [json.loads(l)["step"] for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps == list(range(1, 9))


def test_training_reduces_loss_and_writes_self_sufficient_folder(tmp_path, tokenizer, tiny_rows):
    _, metrics = run(tiny_config(tmp_path, max_steps=30, eval_every=30, save_every=10, keep_checkpoints=2),
                     tokenizer, tiny_rows)
    log = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < losses[0] - 1.0
    assert all(r["tokens_per_s"] > 0 for r in log if "loss" in r)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-0000020", "checkpoint-0000030"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    for folder in (tmp_path, latest_checkpoint(tmp_path)):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    ckpt = latest_checkpoint(tmp_path)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 30 and state["data_position"] == 30 * 4
    assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob("*.pt")), "no pickle files"


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, tokenizer, tiny_rows):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run(tiny_config(tmp_path, resume=True), tokenizer, tiny_rows)


@pytest.mark.parametrize("field,value,match", [
    ("max_steps", 0, "max_steps"), ("learning_rate", -1.0, "learning_rate"), ("schedule", "linear", "schedule"),
    ("warmup_steps", 100, "warmup_steps"), ("preset", "huge", "preset"), ("seq_len", 100000, "seq_len"),
    ("stop_at_step", 9, "stop_at_step"),
])
def test_bad_config_values_are_named(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(tmp_path, **{field: value}).resolved()


def test_schedules_warm_up_then_decay_to_floor(tmp_path):
    cos = tiny_config(tmp_path, max_steps=100, warmup_steps=10, min_lr_ratio=0.1).resolved()
    values = [lr_multiplier(s, cos) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[9:], values[10:]))
    assert values[-1] == pytest.approx(0.1, abs=1e-3)
    wsd = tiny_config(tmp_path, max_steps=100, warmup_steps=10, schedule="wsd", decay_fraction=0.2).resolved()
    values = [lr_multiplier(s, wsd) for s in range(100)]
    assert values[10:80] == [1.0] * 70 and values[-1] == pytest.approx(0.1)


def test_data_order_covers_each_row_once_per_epoch_across_ranks(tmp_path):
    cfg = tiny_config(tmp_path, batch_size=3, grad_accum=2).resolved()
    num_rows, world = 24, 2  # one epoch = 2 optimizer steps of 12 rows
    seen = torch.cat([sample_indices(step, micro, rank, world, cfg, num_rows)
                      for step in range(2) for micro in range(2) for rank in range(world)])
    assert sorted(seen.tolist()) == list(range(num_rows))
    next_epoch = torch.cat([sample_indices(2, m, r, world, cfg, num_rows) for m in range(2) for r in range(world)])
    assert next_epoch.unique().numel() == 12


def test_two_process_data_parallel_matches_single_process(tmp_path, tokenizer, tiny_rows):
    """torchrun with 2 CPU processes: both ranks end with identical parameters, equal to one process
    training on the union of their batches (DDP averages gradients over the global batch)."""
    rows_file = tmp_path / "rows.pt"
    torch.save(tiny_rows[:64].clone(), rows_file)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
           str(WORKER), str(tmp_path / "ddp"), str(rows_file), "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0 = load_file(tmp_path / "ddp" / "rank0.safetensors")
    rank1 = load_file(tmp_path / "ddp" / "rank1.safetensors")
    single = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "single"), str(rows_file), "4"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    reference = load_file(tmp_path / "single" / "rank0.safetensors")
    initial = build_model("ar", "tiny", tokenizer)
    for name, value in rank0.items():
        torch.testing.assert_close(value, rank1[name], atol=0, rtol=0, msg=f"ranks differ at {name}")
        torch.testing.assert_close(value, reference[name], atol=2e-5, rtol=1e-4, msg=f"DDP != single at {name}")
    moved = max((rank0[n] - p).abs().max().item() for n, p in initial.state_dict().items() if n in rank0)
    assert moved > 1e-3
