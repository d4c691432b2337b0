"""`--report-to` (issue 32, part 3): the training loop's trackers (Accelerate) and the post-training commands' (TRL).

What is checked, each against what the run itself wrote:
- TensorBoard: the scalars read back with TensorBoard's own `EventAccumulator` are `metrics.jsonl` exactly (keys,
  steps, values to float32), for a run interrupted after a checkpoint, killed after logging past its checkpoint
  and resumed: every step once, the resumed values, in both.
- wandb (offline, WANDB_DIR in tmp) and trackio (local database in tmp): one run, read back from wandb's offline
  `.wandb` file and trackio's SQLite database, holds the same steps and values and the run's config.
- `report_to` values: unknown names and a missing package are refused before anything trains.
- Post-training: a tiny SFT run with report_to tensorboard has TRL's logged loss at its logged steps
  (the trainer's `log_history`) in its event file under output_dir/runs.
No test reaches the network: WANDB_MODE=offline, HF_HUB_OFFLINE=1, trackio without a Space or server.
"""

import json
import logging
import shutil
import sqlite3
import struct
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from family_contract import build_tiny

from hf_latentlm.families import build_model
from hf_latentlm.training.config import TrainConfig, parse_report_to
from hf_latentlm.training.loop import TRACKER_DIR, TRACKER_PROJECT, TRACKER_RUNS, train

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1", "WANDB_DISABLE_GIT": "true"}


def tiny_config(output_dir, **overrides) -> TrainConfig:
    values = dict(family="ar", preset="tiny", output_dir=str(output_dir), max_steps=6, batch_size=2, seq_len=64,
                  eval_every=2, eval_batches=1, save_every=2, keep_checkpoints=0, log_every=1, progress_bar=False,
                  seed=3, report_to="tensorboard")
    values.update(overrides)
    return TrainConfig(**values)


def run(cfg, tokenizer, rows):
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.family, cfg.preset, tokenizer)
    return train(cfg, model=model, tokenizer=tokenizer, train_rows=rows[:64], val_rows=rows[64:66])


def jsonl_scalars(output_dir) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {key: {step: value}}; a step logged twice fails here."""
    scalars: dict[str, dict[int, float]] = {}
    for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        for key, value in record.items():
            assert step not in scalars.setdefault(key, {}), f"{key} logged twice at step {step}"
            scalars[key][step] = value
    return scalars


def tensorboard_scalars(folder, tags: list[str] | None = None) -> dict[str, dict[int, float]]:
    """The scalars (`tags`, default all) TensorBoard shows for the run in `folder` (its event files, orphaned steps
    purged as TensorBoard purges them), as {tag: {step: value}}; a step shown twice fails here."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {}
    for tag in tags or events.Tags()["scalars"]:
        steps = [event.step for event in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag}: steps {steps} shown twice"
        scalars[tag] = {event.step: event.value for event in events.Scalars(tag)}
    return scalars


def assert_same_scalars(logged: dict, expected: dict):
    assert sorted(logged) == sorted(expected)
    for key, values in expected.items():
        assert sorted(logged[key]) == sorted(values), key
        for step, value in values.items():  # TensorBoard and trackers keep float32
            assert logged[key][step] == pytest.approx(value, rel=1e-6, abs=1e-6), (key, step)


def test_tensorboard_scalars_are_metrics_jsonl_across_an_interruption_and_a_killed_resume(tmp_path, tokenizer,
                                                                                          tiny_rows, caplog):
    output = tmp_path / "run"
    run(tiny_config(output, stop_at_step=4), tokenizer, tiny_rows)
    # A process killed after logging steps 3-4 but before checkpoint 4 was complete: the latest complete
    # checkpoint is 2; metrics.jsonl and the event file both hold steps 3 and 4 already.
    interrupted = jsonl_scalars(output)
    assert sorted(interrupted["loss"]) == [1, 2, 3, 4]
    shutil.rmtree(output / "checkpoint-0000004")
    # The crash also left the log's tail damaged: a block of NUL bytes and a record torn mid-write.
    with open(output / "metrics.jsonl", "a") as f:
        f.write("\0" * 24 + '\n{"step": 5, "lo')
    with caplog.at_level(logging.WARNING, logger="hf_latentlm.training.loop"):
        run(tiny_config(output, resume=True), tokenizer, tiny_rows)
    warnings = [r.getMessage() for r in caplog.records if "metrics.jsonl" in r.getMessage()]
    assert warnings == [f"{output / 'metrics.jsonl'}: skipped 2 line(s) that are not a metrics record (a record "
                        f"torn by a crash?)"]
    assert not list(output.glob(".metrics.jsonl.tmp-*")), "the rewrite's temporary file was replaced into place"

    board = output / TRACKER_DIR / TRACKER_PROJECT
    assert len(list(board.glob("events.out.tfevents.*"))) == 2, "the resumed run appends to the same folder"
    expected = jsonl_scalars(output)
    assert sorted(expected["loss"]) == [1, 2, 3, 4, 5, 6] and sorted(expected["val_loss"]) == [2, 4, 6]
    assert set(expected) == {"loss", "lr", "grad_norm", "tokens_per_s", "tokens", "val_loss"}
    assert_same_scalars(tensorboard_scalars(board), expected)
    # The test has teeth: steps 3-4 were logged twice (TensorBoard shows the resumed run's, as metrics.jsonl keeps
    # them); their throughput differs between the two processes, so a stale value would fail above.
    assert expected["tokens_per_s"][3] != interrupted["tokens_per_s"][3]
    # The run's config is its hyperparameters (Accelerate's hparams.yml beside the events), flattened.
    import yaml

    hparams = yaml.safe_load(next(board.glob("*/hparams.yml")).read_text())
    assert hparams["family"] == "ar" and hparams["max_steps"] == 6 and hparams["report_to"] == '["tensorboard"]'


def wandb_records(path: Path) -> list:
    """The records of a wandb offline `run-<id>.wandb` file: a 7-byte header, then LevelDB-log framed protobuf
    `Record`s (32 KiB blocks; each chunk a 7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST), as wandb's
    Go core writes them and `wandb sync` reads them."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending, records = path.read_bytes(), 32768, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(output_dir, run_id: str) -> tuple[dict, dict, list]:
    """What the wandb offline runs `run_id` in `output_dir/runs/wandb` hold, in the order they ran: the logged scalars
    {key: {step: value}} (a step logged twice fails here), the config, and each file's run record."""
    logged, config, started = {}, {}, []
    folder = Path(output_dir) / TRACKER_DIR / "wandb"

    def start_order(path):  # offline-run-<start second>-<id>, then -<id>-1, -2... for more starts in that second
        second, _, number = path.parent.name.removeprefix("offline-run-").partition(f"-{run_id}")
        return second, int(number.lstrip("-") or 0)

    for path in sorted(folder.glob(f"offline-run-*/run-{run_id}.wandb"), key=start_order):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                started.append(record.run)
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):  # wandb's own _step, _timestamp, _runtime
                        assert record.history.step.num not in logged.setdefault(key, {}), (key, record.history.step)
                        logged[key][record.history.step.num] = json.loads(item.value_json)
    return logged, config, started


def trackio_run(trackio_dir, name: str) -> tuple[dict, list, dict]:
    """The trackio run `name` of project TRACKER_PROJECT in its local SQLite database: logged scalars
    {key: {step: value}} (a step logged twice fails here), the run ids it holds under that name, its config."""
    with sqlite3.connect(Path(trackio_dir) / f"{TRACKER_PROJECT}.db") as db:
        rows = db.execute("SELECT run_id, step, metrics FROM metrics WHERE run_name = ?", (name,)).fetchall()
        configs = db.execute("SELECT config FROM configs WHERE run_name = ?", (name,)).fetchall()
    logged = {}
    for _, step, metrics in rows:
        for key, value in json.loads(metrics).items():
            assert step not in logged.setdefault(key, {}), (key, step)
            logged[key][step] = value
    return logged, sorted({run_id for run_id, _, _ in rows}), json.loads(configs[0][0])


@pytest.fixture
def offline_trackers(tmp_path, monkeypatch):
    """wandb offline and trackio local, both writing under tmp_path; the trackio folder (which trackio reads from
    TRACKIO_DIR once, at import) is also set on its modules in case an earlier test imported it."""
    for key, value in {**OFFLINE, "WANDB_CONSOLE": "off", "TRACKIO_DIR": str(tmp_path / "trackio")}.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_API_KEY", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(key, raising=False)
    import trackio.sqlite_storage
    import trackio.utils

    for module in (trackio.utils, trackio.sqlite_storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    return tmp_path / "trackio"


def only_steps(scalars: dict, keep) -> dict:
    """`scalars` ({key: {step: value}}) at the steps for which `keep(step)` holds; keys left without steps dropped."""
    kept = {key: {step: value for step, value in values.items() if keep(step)} for key, values in scalars.items()}
    return {key: values for key, values in kept.items() if values}


def test_wandb_offline_and_trackio_local_get_the_metrics_and_config_and_continue_on_resume(
        tmp_path, tokenizer, tiny_rows, offline_trackers):
    output = tmp_path / "run"
    options = dict(max_steps=4, eval_every=2, save_every=2, report_to="wandb,trackio")
    run(tiny_config(output, stop_at_step=2, **options), tokenizer, tiny_rows)
    runs = json.loads((output / TRACKER_DIR / TRACKER_RUNS).read_text())
    # Another experiment whose output folder has the same name, started in the same trackio project before the
    # first resumes: each run gets a name of its own, so the resume cannot attach to the other's run.
    other = tmp_path / "other" / "run"
    run(tiny_config(other, max_steps=1, eval_every=1, save_every=1, report_to="trackio"), tokenizer, tiny_rows)
    other_runs = json.loads((other / TRACKER_DIR / TRACKER_RUNS).read_text())
    assert runs["name"] == runs["trackio"] == runs["experiment"] and runs["experiment"].startswith("run-")
    assert other_runs["trackio"].startswith("run-") and other_runs["trackio"] != runs["trackio"]

    # A resume with nothing logged past its checkpoint continues both runs.
    run(tiny_config(output, resume=True, stop_at_step=3, **options), tokenizer, tiny_rows)
    assert json.loads((output / TRACKER_DIR / TRACKER_RUNS).read_text()) == runs, "the resume continued both runs"
    # A process killed after logging step 3 but before checkpoint 3 was complete: the resume from checkpoint 2
    # repeats step 3, which neither tracker can take back, so it continues in new runs.
    interrupted = jsonl_scalars(output)
    shutil.rmtree(output / "checkpoint-0000003")
    run(tiny_config(output, resume=True, **options), tokenizer, tiny_rows)
    continued = json.loads((output / TRACKER_DIR / TRACKER_RUNS).read_text())
    assert continued["experiment"] == runs["experiment"]
    assert continued["name"] == continued["trackio"] == runs["experiment"] + "-from-step-2"
    assert continued["wandb"] != runs["wandb"]
    expected = jsonl_scalars(output)
    assert sorted(expected["loss"]) == [1, 2, 3, 4] and sorted(expected["val_loss"]) == [2, 4]
    assert expected["tokens_per_s"][3] != interrupted["tokens_per_s"][3]  # step 3's values are the resumed ones
    up_to_2, after_2 = only_steps(expected, lambda step: step <= 2), only_steps(expected, lambda step: step > 2)

    logged, config, started = wandb_history(output, runs["wandb"])
    assert len(started) == 2, "one offline file per process, both of run id " + runs["wandb"]
    assert all(r.project == TRACKER_PROJECT and r.display_name == runs["name"] for r in started)
    assert sorted(logged["loss"]) == [1, 2, 3]  # step 3: the killed process's, left in the first run
    assert_same_scalars(only_steps(logged, lambda step: step <= 2), up_to_2)
    assert config["preset"] == "tiny" and config["max_steps"] == 4 and config["seq_len"] == 64
    logged, config, started = wandb_history(output, continued["wandb"])
    assert [r.display_name for r in started] == [continued["name"]]
    assert_same_scalars(logged, after_2)
    assert config["max_steps"] == 4

    logged, run_ids, config = trackio_run(offline_trackers, runs["trackio"])
    assert len(run_ids) == 1, "the first resumed process logged into the same trackio run"
    assert sorted(logged["loss"]) == [1, 2, 3]
    assert_same_scalars(only_steps(logged, lambda step: step <= 2), up_to_2)
    assert config["preset"] == "tiny" and config["report_to"] == '["wandb", "trackio"]'
    logged, run_ids, config = trackio_run(offline_trackers, continued["trackio"])
    assert len(run_ids) == 1
    assert_same_scalars(logged, after_2)
    logged, run_ids, _ = trackio_run(offline_trackers, other_runs["trackio"])
    assert len(run_ids) == 1
    assert_same_scalars(logged, jsonl_scalars(other))


def test_report_to_values(monkeypatch):
    assert parse_report_to("none") == [] and parse_report_to(None) == [] and parse_report_to([]) == []
    assert parse_report_to("tensorboard, wandb") == ["tensorboard", "wandb"] == parse_report_to(["tensorboard",
                                                                                                 "wandb"])
    assert parse_report_to("all") == ["tensorboard", "wandb", "trackio"]  # all three are installed for the suite
    with pytest.raises(ValueError, match=r"unknown tracker\(s\) 'tensorbord'; choose from none, all, tensorboard, "
                                         r"wandb, trackio"):
        TrainConfig(preset="tiny", report_to="tensorbord").resolved()
    with pytest.raises(ValueError, match="'none' and 'all' stand alone"):
        parse_report_to("none,wandb")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ImportError, match=r"report_to wandb: the package wandb is not installed; pip install "
                                          r"'hf-latentlm\[track\]'"):
        TrainConfig(preset="tiny", report_to="wandb").resolved()
    assert parse_report_to("all") == ["tensorboard", "trackio"]  # "all": the installed ones, as TrainingArguments


def test_cli_refuses_a_bad_tracker_before_training(tmp_path, run_cli):
    code, _, err = run_cli("train", "--preset", "tiny", "--output-dir", str(tmp_path / "x"), "--report-to", "mlflow")
    assert code == 2 and "unknown tracker(s) 'mlflow'" in err
    assert not (tmp_path / "x").exists()
    code, _, err = run_cli("sft", "--model", str(tmp_path), "--output-dir", str(tmp_path / "y"),
                           "--report-to", "tensorboard,bogus")
    assert code == 2 and "unknown tracker(s) 'bogus'" in err


def test_sft_report_to_tensorboard_logs_trls_loss_at_its_steps(tmp_path, tokenizer):
    from hf_latentlm.recipes import run_sft
    from hf_latentlm.training.checkpoint import save_tokenizer

    folder = tmp_path / "model"
    build_tiny("ar", tokenizer).save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    rows = [{"prompt": f"User: line {i}\nAssistant:", "completion": f" answer {i}<|endoftext|>"} for i in range(6)]
    output = tmp_path / "sft"
    run_sft(folder, output, dataset=Dataset.from_list(rows), max_steps=3, batch_size=2, logging_steps=1,
            report_to="tensorboard")
    history = json.loads((output / "post_training_log.json").read_text())
    losses = {entry["step"]: entry["loss"] for entry in history if "loss" in entry}
    assert sorted(losses) == [1, 2, 3]
    (board,) = {path.parent for path in (output / "runs").glob("*/events.out.tfevents.*")}
    # TensorBoardCallback's "train/" prefix; the Trainer's closing summary logs "train/epoch" at the last step again.
    logged = tensorboard_scalars(board, ["train/loss"])["train/loss"]
    assert sorted(logged) == [1, 2, 3]
    for step, loss in losses.items():
        assert logged[step] == pytest.approx(loss, rel=1e-6)
