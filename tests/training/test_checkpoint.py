"""A damaged checkpoint on resume: refused with the file named, and `resume="previous"` as the asked-for fallback."""

import json
import shutil

import pytest
import torch

from hf_latentlm.families import build_model
from hf_latentlm.training.checkpoint import DamagedCheckpoint, checkpoint_folders, resume_checkpoint
from hf_latentlm.training.loop import TrainConfig, train


def config(folder, **overrides) -> TrainConfig:
    values = dict(family="ar", preset="tiny", output_dir=str(folder), max_steps=3, batch_size=2, seq_len=64,
                  eval_every=0, save_every=1, keep_checkpoints=0, log_every=1, progress_bar=False, seed=1)
    return TrainConfig(**{**values, **overrides})


def run(cfg, tokenizer, rows):
    torch.manual_seed(0)
    model = build_model("ar", "tiny", tokenizer)
    train(cfg, model=model, tokenizer=tokenizer, train_rows=rows[:32])
    return model


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tokenizer, tiny_rows):
    """A run stopped after step 2 (checkpoints 1 and 2), and the weights of the same run done in one go."""
    root = tmp_path_factory.mktemp("checkpoints")
    run(config(root / "stopped", stop_at_step=2), tokenizer, tiny_rows)
    straight = run(config(root / "straight"), tokenizer, tiny_rows)
    return root / "stopped", {k: v.clone() for k, v in straight.state_dict().items()}


def truncate(path):
    path.write_bytes(path.read_bytes()[:50])


DAMAGE = {
    "optimizer truncated": ("optimizer.safetensors", truncate),
    "optimizer missing": ("optimizer.safetensors", lambda p: p.unlink()),
    "weights truncated": ("model.safetensors", truncate),
    "weights missing": ("model.safetensors", lambda p: p.unlink()),
    "rng truncated": ("rng_rank0.safetensors", truncate),
    "rng missing": ("rng_rank0.safetensors", lambda p: p.unlink()),
    "trainer_state not JSON": ("trainer_state.json", lambda p: p.write_text('{"step": 2, "sched')),
    "scheduler state missing": ("trainer_state.json", lambda p: p.write_text(json.dumps(
        {k: v for k, v in json.loads(p.read_text()).items() if k != "scheduler"}))),
}


def damaged(stopped, tmp_path, case):
    folder = tmp_path / "run"
    shutil.copytree(stopped[0], folder)
    name, damage = DAMAGE[case]
    damage(checkpoint_folders(folder)[-1] / name)
    return folder, name


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_latest_checkpoint_is_refused_naming_the_file_and_the_fallback(stopped, tmp_path, tokenizer,
                                                                                 tiny_rows, case):
    folder, name = damaged(stopped, tmp_path, case)
    with pytest.raises(DamagedCheckpoint) as refused:
        run(config(folder, resume=True), tokenizer, tiny_rows)
    message = str(refused.value)
    assert f"checkpoint {folder / 'checkpoint-0000002'} is damaged: {name}" in message, message
    assert "to continue from checkpoint-0000001, the complete checkpoint before it, rerun with --resume previous" \
        in message
    assert refused.value.file == name and "\n" not in message
    assert not (folder / "model.safetensors").exists(), "a refused resume trained nothing"


def test_resume_previous_falls_back_to_the_complete_checkpoint_before_and_ends_as_the_straight_run(
        stopped, tmp_path, tokenizer, tiny_rows, capsys):
    folder, _ = damaged(stopped, tmp_path, "optimizer truncated")
    model = run(config(folder, resume="previous"), tokenizer, tiny_rows)
    assert f"resumed from {folder / 'checkpoint-0000001'} at step 1" in capsys.readouterr().out
    for name, value in stopped[1].items():
        torch.testing.assert_close(model.state_dict()[name], value, atol=1e-6, rtol=0, msg=name)


def test_no_earlier_checkpoint_to_fall_back_to_is_said(stopped, tmp_path, tokenizer, tiny_rows):
    folder, _ = damaged(stopped, tmp_path, "optimizer truncated")
    shutil.rmtree(folder / "checkpoint-0000001")
    with pytest.raises(DamagedCheckpoint, match="optimizer.safetensors .*; no earlier complete checkpoint"):
        run(config(folder, resume=True), tokenizer, tiny_rows)
    with pytest.raises(FileNotFoundError, match="--resume previous: no complete checkpoint before"):
        resume_checkpoint(folder, "previous")


def test_previous_skips_an_incomplete_checkpoint_and_latest_takes_the_newest_folder(tmp_path):
    for step, state in ((1, "{}"), (2, "{not json"), (3, "{}")):
        (tmp_path / f"checkpoint-{step:07d}").mkdir()
        (tmp_path / f"checkpoint-{step:07d}" / "trainer_state.json").write_text(state)
    assert resume_checkpoint(tmp_path, "latest").name == "checkpoint-0000003"
    assert resume_checkpoint(tmp_path, "previous").name == "checkpoint-0000001"


def test_a_bad_resume_value_is_named(tmp_path):
    with pytest.raises(ValueError, match="resume must be False, True, 'latest' or 'previous'"):
        config(tmp_path, resume="newest").resolved()
