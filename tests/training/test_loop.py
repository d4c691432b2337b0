import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from hf_latentlm.families import FAMILIES, build_model
from hf_latentlm.training import loop
from hf_latentlm.training.checkpoint import DamagedCheckpoint, latest_checkpoint, list_checkpoints
from hf_latentlm.training.loop import TrainConfig, lr_multiplier, sample_indices, train

WORKER = Path(__file__).with_name("ddp_worker.py")
# ddp_worker.py with the model sharded by FSDP2 as configs/accelerate/fsdp.yaml shards it (2 CPU processes, gloo).
FSDP_WORKER = Path(__file__).with_name("fsdp_worker.py")
WORKERS = pytest.mark.parametrize("worker", [WORKER, FSDP_WORKER], ids=["ddp", "fsdp"])


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    values = dict(family="ar", preset="tiny", output_dir=str(tmp_path), max_steps=8, batch_size=4, seq_len=64,
                  eval_every=4, eval_batches=2, save_every=4, log_every=1, progress_bar=False, seed=3)
    values.update(overrides)
    return TrainConfig(**values)


def run(cfg, tokenizer, rows, on_step=None, dtype=None):
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.family, cfg.preset, tokenizer, **cfg.components)
    if dtype is not None:
        model.to(dtype)
    metrics = train(cfg, model=model, tokenizer=tokenizer, train_rows=rows[:200], val_rows=rows[200:240],
                    on_step=on_step)
    return model, metrics


def component_folders(family: str, tokenizer, root: Path) -> dict[str, str]:
    """Every component `family` needs (registry: name -> producing family), built untrained at `tiny` with a
    fixed seed and saved under `root`: name -> folder, as `TrainConfig.components` takes them."""
    folders = {}
    for name, source in FAMILIES[family].components.items():
        folder = root / f"{family}-{name}"
        if not folder.exists():
            inner = component_folders(source, tokenizer, root)
            torch.manual_seed(0)
            build_model(source, "tiny", tokenizer, **inner).save_pretrained(folder)
        folders[name] = str(folder)
    return folders


def draws_randomness(family: str, tokenizer, rows, components: dict) -> bool:
    """Whether a training forward of `family` reads the global torch RNG (two seeds, two losses)."""
    torch.manual_seed(0)
    model = build_model(family, "tiny", tokenizer, **components).train()
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        losses.append(model(input_ids=rows[:2], labels=rows[:2]).loss.item())
    return losses[0] != losses[1]


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exact_resume_matches_uninterrupted_run(family, tmp_path, tokenizer, tiny_rows, monkeypatch):
    components = component_folders(family, tokenizer, tmp_path / "components")
    config = lambda out, **kw: tiny_config(out, family=family, components=components, **kw)  # noqa: E731
    straight_model, straight = run(config(tmp_path / "a"), tokenizer, tiny_rows)
    _, first_half = run(config(tmp_path / "b", stop_at_step=4), tokenizer, tiny_rows)
    assert first_half["step"] == 4
    assert not (tmp_path / "b" / "model.safetensors").exists(), "an interrupted run must not write the final model"
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed_model, resumed = run(config(tmp_path / "b", resume=True), tokenizer, tiny_rows)
    assert resumed["step"] == 8
    assert abs(resumed["loss"] - straight["loss"]) < 1e-5
    assert abs(resumed["val_loss"] - straight["val_loss"]) < 1e-5
    for (name, a), (_, b) in zip(straight_model.state_dict().items(), resumed_model.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    # A resumed run keeps one metrics log: steps 1-4 from the first half, 5-8 from the resume.
    steps = [json.loads(l)["step"] for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps == list(range(1, 9))
    if draws_randomness(family, tokenizer, tiny_rows, components):
        # The test has teeth: the same resume without restoring the RNG is another run.
        monkeypatch.setattr(loop, "load_rank_rng", lambda checkpoint, rank: None)
        unrestored_model, _ = run(config(tmp_path / "c", resume=True), tokenizer, tiny_rows)
        assert max_difference(straight_model, unrestored_model) > 1e-4


def test_grad_accum_matches_one_big_batch(tmp_path, tokenizer, tiny_rows, monkeypatch):
    """batch 2 x grad_accum 2 reads the same rows as batch 4 x 1 and, its loss divided by grad_accum, takes the
    same steps. AdamW's update is blind to a constant gradient scale, so the per-step gradient norm is what shows
    an undivided loss (clipping off, as clipping to 1 would hide it too)."""
    big = tiny_config(tmp_path / "big", max_steps=4, eval_every=0, grad_clip=0).resolved()
    accumulated = tiny_config(tmp_path / "acc", max_steps=4, eval_every=0, grad_clip=0, batch_size=2,
                              grad_accum=2).resolved()
    for step in range(4):
        micro_rows = [sample_indices(step, micro, 0, 1, accumulated, 200) for micro in range(2)]
        assert torch.equal(torch.cat(micro_rows), sample_indices(step, 0, 0, 1, big, 200))

    def trained(cfg, losses=None):
        norms = []

        def on_step(step, metrics):
            norms.append(metrics["grad_norm"])
            if losses is not None:
                losses.append(metrics["loss"])

        model, _ = run(cfg, tokenizer, tiny_rows, on_step=on_step, dtype=torch.float64)
        return model, torch.tensor(norms, dtype=torch.float64)

    # In float64, so that the two summation orders agree to ~1e-14 on any machine: in float32 Adam turns their
    # rounding noise on near-zero gradients into ~1e-5 of movement, which varies with BLAS kernels and threads.
    reference_losses, losses = [], []
    reference_model, reference_norms = trained(big, reference_losses)
    model, norms = trained(accumulated, losses)
    torch.testing.assert_close(norms, reference_norms, atol=0, rtol=1e-10)
    # The logged loss is the mean over the micro-batches, as the big batch's (not their sum); the log accumulates it
    # in float32.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), atol=0, rtol=1e-6)
    assert max_difference(model, reference_model) < 1e-10
    # The same comparison catches a loss that is not divided by grad_accum.
    backward = Accelerator.backward
    monkeypatch.setattr(Accelerator, "backward", lambda self, loss, **kw: backward(self, loss * 2, **kw))
    _, undivided_norms = trained(dataclasses.replace(accumulated, output_dir=str(tmp_path / "undivided")))
    assert not torch.allclose(undivided_norms, reference_norms, atol=0, rtol=1e-4)


def test_grad_clip_zero_turns_clipping_off(tmp_path, tokenizer, tiny_rows):
    """grad_clip 0 trains exactly as an unreachable clip threshold does, and still logs the gradient norm."""
    models, metrics = {}, {}
    for clip in (0.0, 1e9):
        models[clip], metrics[clip] = run(tiny_config(tmp_path / str(clip), max_steps=2, eval_every=0, grad_clip=clip),
                                          tokenizer, tiny_rows)
    assert max_difference(models[0.0], models[1e9]) == 0
    assert metrics[0.0]["grad_norm"] == metrics[1e9]["grad_norm"] > 1  # above the default clip of 1
    torch.manual_seed(3)
    assert max_difference(models[0.0], build_model("ar", "tiny", tokenizer)) > 1e-3


def test_loss_leaves_the_device_on_log_steps_only(tmp_path, tokenizer, tiny_rows, monkeypatch):
    """Without on_step, losses are read (one device-to-host copy) on log steps only; with on_step, every step
    and its metrics carry float loss, loss parts, lr and grad_norm."""
    reads = []
    to_floats = loop.to_floats
    monkeypatch.setattr(loop, "to_floats", lambda tensors: reads.append(1) or to_floats(tensors))
    cfg = dict(family="plm", max_steps=6, log_every=4, eval_every=0, save_every=6)
    _, last = run(tiny_config(tmp_path / "quiet", **cfg), tokenizer, tiny_rows)
    assert len(reads) == 2  # steps 4 and 6 (the last)
    logged = [json.loads(l) for l in (tmp_path / "quiet" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [4, 6]
    expected = {"loss", "encoder_nll", "decoder_nll", "lr", "grad_norm"}
    assert expected <= set(last) and all(isinstance(last[k], float) for k in expected)
    seen = {}
    run(tiny_config(tmp_path / "watched", **cfg), tokenizer, tiny_rows, on_step=lambda step, m: seen.update({step: m}))
    assert sorted(seen) == list(range(1, 7))
    assert all(expected <= set(m) and all(isinstance(m[k], float) for k in expected) for m in seen.values())


def test_resume_refuses_another_number_of_processes(tmp_path, tokenizer, tiny_rows):
    run(tiny_config(tmp_path, max_steps=2, stop_at_step=1, eval_every=0), tokenizer, tiny_rows)
    state_file = latest_checkpoint(tmp_path) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["num_processes"] == 1
    state_file.write_text(json.dumps(dict(state, num_processes=2)))
    with pytest.raises(ValueError, match="written by 2 process.*not 1"):
        run(tiny_config(tmp_path, max_steps=2, eval_every=0, resume=True), tokenizer, tiny_rows)


def test_resume_refuses_a_checkpoint_without_this_ranks_rng(tmp_path, tokenizer, tiny_rows):
    run(tiny_config(tmp_path, max_steps=2, stop_at_step=1, eval_every=0), tokenizer, tiny_rows)
    (latest_checkpoint(tmp_path) / "rng_rank0.safetensors").unlink()
    with pytest.raises(DamagedCheckpoint, match=r"rng_rank0.safetensors is missing \(no RNG state for rank 0\)"):
        run(tiny_config(tmp_path, max_steps=2, eval_every=0, resume=True), tokenizer, tiny_rows)


def test_training_reduces_loss_and_writes_self_sufficient_folder(tmp_path, tokenizer, tiny_rows):
    _, metrics = run(tiny_config(tmp_path, max_steps=30, eval_every=30, save_every=10, keep_checkpoints=2),
                     tokenizer, tiny_rows)
    log = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < losses[0] - 1.0
    assert all(r["tokens_per_s"] > 0 for r in log if "loss" in r)
    # Cumulative training tokens: batch 4 rows of seq_len tokens per step (tiny_config), one process.
    cfg = tiny_config(tmp_path)
    assert [r["tokens"] for r in log if "loss" in r] == [r["step"] * cfg.batch_size * cfg.seq_len
                                                          for r in log if "loss" in r]
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
    ("stop_at_step", 9, "stop_at_step"), ("save_every", 0, "save_every"), ("log_every", 0, "log_every"),
    ("eval_every", -1, "eval_every"), ("eval_batches", 0, "eval_batches"), ("keep_checkpoints", -1, "keep_checkpoints"),
    ("grad_clip", -0.5, "grad_clip"),
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


@WORKERS
def test_two_process_data_parallel_matches_single_process(tmp_path, tokenizer, tiny_rows, worker):
    """torchrun with 2 CPU processes: both ranks end with identical parameters, equal to one process
    training on the union of their batches (DDP averages gradients over the global batch; FSDP reduce-scatters
    them). The final model and the checkpoint's optimizer state are whole, as one process writes them, even when
    each rank holds only a shard. Parameters, gradients and optimizer in float64 (transformers computes the loss from
    float32 logits, per token, alike in both): the two sum each gradient in a different order, which in float32 moves
    the parameters by amounts that depend on the machine's kernels."""
    rows_file = tmp_path / "rows.pt"
    torch.save(tiny_rows[:64].clone(), rows_file)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(worker), str(tmp_path / "ddp"), str(rows_file), "2", "--dtype", "float64"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0 = load_file(tmp_path / "ddp" / "rank0.safetensors")
    rank1 = load_file(tmp_path / "ddp" / "rank1.safetensors")
    single = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "single"), str(rows_file), "4", "--dtype",
                             "float64"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    reference = load_file(tmp_path / "single" / "rank0.safetensors")
    initial = build_model("ar", "tiny", tokenizer)
    for name, value in rank0.items():
        torch.testing.assert_close(value, rank1[name], atol=0, rtol=0, msg=f"ranks differ at {name}")
        torch.testing.assert_close(value, reference[name], atol=1e-10, rtol=0, msg=f"DDP != single at {name}")
    moved = max((rank0[n] - p).abs().max().item() for n, p in initial.state_dict().items() if n in rank0)
    assert moved > 1e-3
    final = load_file(tmp_path / "ddp" / "model.safetensors")
    assert final.keys() <= rank0.keys() and "model.embed_tokens.weight" in final
    for name, value in final.items():
        torch.testing.assert_close(value, rank0[name], atol=0, rtol=0, msg=f"saved model != trained model at {name}")
    optimizer = load_file(latest_checkpoint(tmp_path / "ddp") / "optimizer.safetensors")
    single_optimizer = load_file(latest_checkpoint(tmp_path / "single") / "optimizer.safetensors")
    assert optimizer.keys() == single_optimizer.keys()
    for name, value in single_optimizer.items():
        torch.testing.assert_close(optimizer[name], value, atol=1e-12, rtol=1e-8, msg=f"optimizer state {name}")


def test_ranks_draw_different_random_numbers_in_a_fresh_run(tmp_path, tiny_rows):
    """Each rank's steps draw from its own seed (seed + rank) once the model is built: PLM block phases and
    auxiliaries, CALM noise. Checked at the first checkpoint of a 2-process run whose steps draw nothing."""
    rows_file = tmp_path / "rows.pt"
    torch.save(tiny_rows[:16].clone(), rows_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), str(tmp_path / "ddp"), str(rows_file), "2", "--max-steps", "1"]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = latest_checkpoint(tmp_path / "ddp")
    states = [load_file(checkpoint / f"rng_rank{r}.safetensors")["torch"] for r in range(2)]
    assert not torch.equal(*states)
    # The model itself was built from the same seed: both ranks hold the same weights.
    ranks = [load_file(tmp_path / "ddp" / f"rank{r}.safetensors") for r in range(2)]
    assert all(torch.equal(ranks[0][name], ranks[1][name]) for name in ranks[0])


@WORKERS
def test_two_process_run_killed_mid_save_resumes_to_the_uninterrupted_weights(tmp_path, tokenizer, tiny_rows, worker):
    """torchrun with 2 CPU processes (DDP, or FSDP: weights and optimizer state gathered into the checkpoint and
    sharded again on resume), for the first registered family whose training draws randomness (DDP) and AR (FSDP):
    a run checkpointing every 2 steps is SIGKILLed while saving step 4, after its temporary folder is written and
    before the rename (`HF_LATENTLM_KILL_BEFORE_RENAME`); `--resume` continues from checkpoint 2, the last complete
    one, and ends with the same weights as the straight run (1e-5). The worker makes each rank draw a different
    amount after step 1, so the ranks' RNG states differ and each rank must get back its own."""
    family = next(f for f in FAMILIES if draws_randomness(f, tokenizer, tiny_rows,
                                                         component_folders(f, tokenizer, tmp_path / "components")))
    if worker == FSDP_WORKER:
        # FSDP2 on CPU (gloo) trains PLM irreproducibly: 2 of 4 identical straight runs ended 3.2e-3 to 3.5e-3 away
        # from DDP in the root unit's parameters (auxiliary_proj, alignment_proj), the other 2 at 5.6e-6. AR
        # repeated 4 times to within 2.8e-7 of one process; its resume checks the gathered and re-sharded state.
        family = "ar"
    components = component_folders(family, tokenizer, tmp_path / "components")
    rows_file = tmp_path / "rows.pt"
    torch.save(tiny_rows[:64].clone(), rows_file)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def launch(out, *flags, **extra_env):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(worker), str(tmp_path / out), str(rows_file), "2", "--family", family, "--rank-draws",
               "--save-every", "2", *[f"--component={name}={folder}" for name, folder in components.items()], *flags]
        return subprocess.run(cmd, env={**env, **extra_env}, capture_output=True, text=True, timeout=300)

    done = launch("straight")
    assert done.returncode == 0, done.stderr[-3000:]
    killed = launch("resumed", HF_LATENTLM_KILL_BEFORE_RENAME="4")
    assert killed.returncode != 0, killed.stderr[-3000:]
    left = sorted(p.name for p in (tmp_path / "resumed").iterdir())
    assert "checkpoint-0000002" in left and "checkpoint-0000004" not in left, left
    assert any(name.startswith(".tmp-checkpoint-0000004-") for name in left), f"not killed mid-save: {left}"
    checkpoint = latest_checkpoint(tmp_path / "resumed")
    rank_states = [load_file(checkpoint / f"rng_rank{r}.safetensors")["torch"] for r in range(2)]
    assert not torch.equal(*rank_states), "the ranks' RNG states should differ at the checkpoint"
    done = launch("resumed", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoint-0000002'} at step 2" in done.stdout
    assert not [p.name for p in (tmp_path / "resumed").iterdir() if p.name.startswith(".tmp")]
    for rank in range(2):
        straight = load_file(tmp_path / "straight" / f"rank{rank}.safetensors")
        resumed = load_file(tmp_path / "resumed" / f"rank{rank}.safetensors")
        for name, value in straight.items():
            torch.testing.assert_close(resumed[name], value, atol=1e-5, rtol=0, msg=f"rank {rank}: {name}")


def test_the_saved_model_records_the_longest_rows_it_was_trained_at(tmp_path, tokenizer, tiny_rows):
    from hf_latentlm.loading import load_model_and_tokenizer

    first = TrainConfig(family="ar", preset="tiny", output_dir=str(tmp_path / "first"), max_steps=2, batch_size=2,
                        seq_len=48, eval_every=0, save_every=2, progress_bar=False)
    train(first, tokenizer=tokenizer, train_rows=tiny_rows[:8, :48])
    model, _ = load_model_and_tokenizer(str(tmp_path / "first"))
    assert model.config.trained_seq_len == 48
    # Trained further at shorter rows, it has still been trained at every position up to 48.
    train(dataclasses.replace(first, output_dir=str(tmp_path / "second"), seq_len=16), model=model, tokenizer=tokenizer,
          train_rows=tiny_rows[:8, :16])
    assert load_model_and_tokenizer(str(tmp_path / "second"))[0].config.trained_seq_len == 48
    train(dataclasses.replace(first, output_dir=str(tmp_path / "third"), seq_len=64), model=model, tokenizer=tokenizer,
          train_rows=tiny_rows[:8, :64])
    assert load_model_and_tokenizer(str(tmp_path / "third"))[0].config.trained_seq_len == 64


@pytest.mark.parametrize("family,seq_len,message", [
    ("plm", 3, "seq_len 3 is shorter than one block of the plm model (block_size 4)"),
    ("cola-vae", 1, "seq_len 1 is shorter than one block of the cola-vae model (vae_block_size 2)"),
    ("calm-ae", 6, "seq_len 6 must be a multiple of the calm-ae model's chunk_size 4 and at least 4 (1 chunk)"),
    ("plm", 4, None), ("calm-ae", 8, None), ("ar", 3, None),
])
def test_rows_that_cannot_hold_one_block_or_chunk_are_refused(tmp_path, tokenizer, family, seq_len, message):
    cfg = tiny_config(tmp_path, family=family, seq_len=seq_len).resolved()
    if message is None:
        assert loop.build(cfg, None, tokenizer)[0].config.trained_seq_len == seq_len
    else:
        with pytest.raises(ValueError) as refused:
            loop.build(cfg, None, tokenizer)
        assert message in str(refused.value)
