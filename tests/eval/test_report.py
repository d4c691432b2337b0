"""`hf-latentlm report`: one run over tiny models, then its table, JSON and plot checked against each other and
against arithmetic done here."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import shlex
import struct

import pytest
import torch

from hf_latentlm.eval.harness import nll_rows
from hf_latentlm.eval.report import relative_to_baseline, speed_quality_figure
from hf_latentlm.families import build_model
from hf_latentlm.training.loop import TrainConfig, train

pytest.importorskip("matplotlib")

# MAUVE's samples are 64 + 128 tokens: the baseline is trained at rows that hold them.
AR_STEPS, AR_BATCH, AR_SEQ = 3, 2, 192


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer, validation_stream):
    """A tiny AR trained 3 steps by the training loop (checkpoint and metrics.jsonl: a training record) and an
    untrained tiny PLM saved with save_pretrained (no record)."""
    root = tmp_path_factory.mktemp("report")
    train(TrainConfig(family="ar", preset="tiny", output_dir=str(root / "ar"), max_steps=AR_STEPS,
                      batch_size=AR_BATCH, seq_len=AR_SEQ, eval_every=0, save_every=AR_STEPS, log_every=1,
                      progress_bar=False), tokenizer=tokenizer, train_rows=nll_rows(validation_stream, AR_SEQ)[:16])
    torch.manual_seed(0)
    build_model("plm", "tiny", tokenizer).save_pretrained(root / "plm")
    tokenizer.save_pretrained(root / "plm")
    return root


@pytest.fixture(scope="module")
def report_run(folders):
    """`hf-latentlm report` once, in this process; returns (exit status, stdout, output folder, argv)."""
    from hf_latentlm.cli import main

    out = folders / "out"
    argv = ["report", "--model", f"ar={folders / 'ar'}", "--model", f"plm={folders / 'plm'}", "--output", str(out),
            "--num-positions", "24", "--context-len", "16", "--max-new-tokens", "4", "--repeats", "1",
            "--mauve-samples", "10"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(argv)
    return code, stdout.getvalue(), out, argv


def table_rows(markdown: str) -> dict[str, list[str]]:
    """Entry name -> its cells, from the report's one table."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header, rows = lines[0], lines[1:]
    assert header.startswith("| model | decoding |")
    return {cells[0]: cells for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)}


def test_report_writes_a_table_that_matches_its_json(report_run):
    code, stdout, out, argv = report_run
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    assert markdown in stdout
    # The command at the top reruns the same report: every option the run was given, with its value.
    command = re.search(r"```bash\n(.*)\n```", markdown).group(1)
    assert command == report["command"] and command.startswith("hf-latentlm report ")
    for option, value in zip(argv[1::2], argv[2::2]):
        assert f" {option} {shlex.quote(value)}" in command
    # PLM runs at its default decoding and at each registry speed variant; AR at its default only.
    assert list(report["models"]) == ["ar", "plm", "plm (nucleus acceptance)"]
    assert report["models"]["plm (nucleus acceptance)"]["generate_kwargs"] == {"acceptance": "nucleus"}
    assert report["families_not_reported"] == ["aurora", "calm", "cola"]
    assert "Not in this report (no model given): aurora, calm, cola." in markdown
    rows = table_rows(markdown)
    assert list(rows) == list(report["models"])
    for name, cells in rows.items():
        row = report["models"][name]
        b2, rel = row["brier"]["brierlm_2"], row["relative_to_ar"]
        assert cells[1] == row["decoding"]
        assert cells[2] == f"{row['num_parameters'] / 1e6:.2f}M"
        assert float(cells[6]) == pytest.approx(row["speed"]["batch_1"]["tokens_per_s"], abs=0.5)
        assert float(cells[7]) == pytest.approx(row["speed"]["batch_8"]["tokens_per_s"], abs=0.5)
        assert float(cells[8]) == pytest.approx(row["speed"]["batch_1"]["model_calls_per_token"], abs=0.005)
        assert float(cells[9]) == pytest.approx(rel["tokens_per_s_batch_1"], abs=0.005)
        assert float(cells[10]) == pytest.approx(rel["tokens_per_s_batch_8"], abs=0.005)
        assert cells[11].startswith(f"{b2['value']:.2f} [{b2['ci_low']:.2f}, {b2['ci_high']:.2f}]")
        assert float(cells[13]) == pytest.approx(row["mauve"]["mauve"], abs=5e-4)
        assert row["mauve"]["num_model"] == 10 and row["brier"]["num_positions"] == 24
    assert rows["ar"][0:2] == ["ar", "default"] and rows["plm (nucleus acceptance)"][1] == "nucleus acceptance"
    # An untrained tiny AR has BrierLM-2 0, where "×AR" is undefined: the table says so instead of dividing by 0.
    if report["models"]["ar"]["brier"]["brierlm_2"]["value"] == 0:
        assert all(cells[12] == "—" for cells in rows.values())


def test_speed_ratios_divide_by_the_ar_baseline_timed_next_to_each_entry(report_run):
    report = json.loads((report_run[2] / "report.json").read_text())
    ar = report["models"]["ar"]
    for row in report["models"].values():
        for b in (1, 8):
            expected = row["speed"][f"batch_{b}"]["tokens_per_s"] / row["baseline_speed"][f"batch_{b}"]["tokens_per_s"]
            assert row["relative_to_ar"][f"tokens_per_s_batch_{b}"] == pytest.approx(expected, rel=1e-12)
            # The baseline next to each entry is the AR model, at its own decoding, on the same prompts.
            assert row["baseline_speed"][f"batch_{b}"]["batch_size"] == b
            assert row["baseline_speed"][f"batch_{b}"]["model_calls_per_token"] == pytest.approx(1.0)
    assert ar["relative_to_ar"]["tokens_per_s_batch_1"] == pytest.approx(1.0)


def test_training_record_comes_from_the_checkpoint_and_metrics(report_run):
    from hf_latentlm.eval.flops import training_flops_per_token
    from hf_latentlm.loading import load_model_and_tokenizer

    report = json.loads((report_run[2] / "report.json").read_text())
    ar = report["models"]["ar"]["training"]
    tokens = AR_STEPS * AR_BATCH * AR_SEQ
    assert (ar["steps"], ar["tokens"], ar["components"]) == (AR_STEPS, tokens, {})
    # FLOPs: the tokens times one training step's FLOPs per token at the length it was trained at, counted here again.
    per_token = training_flops_per_token(load_model_and_tokenizer(str(report_run[2].parent / "ar"))[0], AR_SEQ)
    assert ar["flops_per_token"] == per_token["per_token"] and ar["train_flops"] == tokens * per_token["per_token"]
    assert ar["flops_over_ar"] == 1.0
    # A folder written by save_pretrained alone holds no record: none is invented.
    plm = report["models"]["plm"]["training"]
    assert (plm["steps"], plm["tokens"], plm["train_flops"], plm["flops_over_ar"]) == (None, None, None, None)
    rows = table_rows((report_run[2] / "report.md").read_text())
    assert rows["ar"][3] == f"{tokens} ({AR_STEPS} steps)" and rows["plm"][3] == "—"
    assert rows["ar"][4] == f"{ar['train_flops']:.3g} (1.00× AR)" and rows["plm"][4] == "—"


def test_training_tokens_come_from_metrics_when_no_checkpoint_is_left(tmp_path):
    from hf_latentlm.eval.report import training_record

    lines = [{"step": 10, "loss": 3.0, "tokens": 10 * 2048}, {"step": 10, "val_loss": 3.1},
             {"step": 20, "loss": 2.5, "tokens": 20 * 2048}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert training_record(tmp_path) == {"steps": 20, "tokens": 40960, "components": None}


def test_a_budget_off_by_more_than_ten_percent_is_flagged_in_the_table():
    from hf_latentlm.eval.report import _flops, budget_ratios

    records = {"ar": {"train_flops": 1e13}, "same": {"train_flops": 1.09e13}, "short": {"train_flops": 0.85e13},
               "long": {"train_flops": 1.2e13}, "unknown": {"train_flops": None}}
    ratios = budget_ratios(records)
    assert ratios == {"ar": 1.0, "same": pytest.approx(1.09), "short": pytest.approx(0.85),
                      "long": pytest.approx(1.2), "unknown": None}
    cells = {name: _flops({**records[name], "flops_over_ar": ratios[name]}) for name in records}
    assert cells["same"] == "1.09e+13 (1.09× AR)" and cells["ar"] == "1e+13 (1.00× AR)"
    assert cells["short"] == "8.5e+12 (0.85× AR) ⚠ not AR's budget"
    assert cells["long"] == "1.2e+13 (1.20× AR) ⚠ not AR's budget" and cells["unknown"] == "—"


def test_png_is_written_with_one_point_per_entry_and_interval(report_run):
    out = report_run[2]
    data = (out / "speed_quality.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 500 and height > 300


def with_brierlm_2(report: dict, values: dict[str, tuple[float, float, float]]) -> dict:
    """A copy of `report` whose entries have the given BrierLM-2 (value, low, high): the tiny models' own are 0."""
    report = copy.deepcopy(report)
    for name, (value, low, high) in values.items():
        report["models"][name]["brier"]["brierlm_2"].update(value=value, ci_low=low, ci_high=high)
    relative_to_baseline(report["models"])
    return report


def test_relative_brierlm_2_and_plotted_points(report_run):
    import matplotlib.pyplot as plt

    measured = json.loads((report_run[2] / "report.json").read_text())
    values = {"ar": (4.0, 2.0, 5.0), "plm": (1.0, 0.5, 3.0), "plm (nucleus acceptance)": (0.0, 0.0, 0.8)}
    report = with_brierlm_2(measured, values)
    for name, (value, low, high) in values.items():
        rel = report["models"][name]["relative_to_ar"]
        assert (rel["brierlm_2"], rel["brierlm_2_ci_low"], rel["brierlm_2_ci_high"]) == pytest.approx(
            (value / 4.0, low / 4.0, high / 4.0))
    fig = speed_quality_figure(report)
    try:
        assert len(fig.axes) == 2
        for ax, b in zip(fig.axes, (1, 8)):
            assert len(ax.containers) == len(values)  # one errorbar per entry
            for container, name in zip(ax.containers, values):
                row, (value, low, high) = report["models"][name], values[name]
                x = row["speed"][f"batch_{b}"]["tokens_per_s"] / row["baseline_speed"][f"batch_{b}"]["tokens_per_s"]
                assert container.get_label() == name
                assert container.lines[0].get_xydata().tolist()[0] == pytest.approx([x, value / 4.0])
                segment = container.lines[2][0].get_segments()[0]  # the vertical interval bar
                assert segment[:, 1].tolist() == pytest.approx([low / 4.0, high / 4.0])
                assert segment[:, 0].tolist() == pytest.approx([x, x])
    finally:
        plt.close(fig)


def test_undefined_relative_brierlm_2_is_not_plotted(report_run):
    import matplotlib.pyplot as plt

    measured = json.loads((report_run[2] / "report.json").read_text())
    report = with_brierlm_2(measured, {"ar": (0.0, 0.0, 1.0), "plm": (2.0, 1.0, 3.0)})
    assert all(row["relative_to_ar"]["brierlm_2"] is None for row in report["models"].values())
    fig = speed_quality_figure(report)
    try:
        assert all(len(ax.containers) == 0 and "not plotted" in ax.get_title() for ax in fig.axes)
    finally:
        plt.close(fig)


def test_a_report_without_ar_is_refused(folders, run_cli, tmp_path):
    code, _, err = run_cli("report", "--model", f"plm={folders / 'plm'}", "--output", str(tmp_path / "r"))
    assert code == 2 and "--model ar=DIR" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_missing_folder_is_refused_before_anything_runs(folders, run_cli, tmp_path):
    missing = tmp_path / "no-such-model"
    code, _, err = run_cli("report", "--model", f"ar={folders / 'ar'}", "--model", f"plm={missing}",
                           "--output", str(tmp_path / "r"))
    assert code == 2 and str(missing) in err and "does not exist" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, message", [
    (["--model", "ar"], "NAME=DIR"),
    (["--model", "ar=x", "--model", "ar=y"], "given twice"),
    (["--model", "ar=x", "--num-positions", "0"], "--num-positions must be at least 1"),
    (["--model", "ar=x", "--mauve-samples", "5"], "--mauve-samples must be at least 10"),
])
def test_bad_arguments_are_named(run_cli, argv, message):
    code, _, err = run_cli("report", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_latent_model_lists_the_component_it_was_built_from_apart(tmp_path, tokenizer, tiny_rows):
    """A tiny Cola VAE (2 steps) and a Cola around it (3 steps), both through the training loop: the Cola's record
    has its own tokens and FLOPs, and the VAE's run apart, each FLOPs = tokens × that model's training FLOPs per
    token at the length it was trained at, counted here again."""
    from hf_latentlm.eval.flops import training_flops_per_token
    from hf_latentlm.eval.report import _components, training_compute
    from hf_latentlm.loading import load_model_and_tokenizer

    common = dict(preset="tiny", batch_size=2, seq_len=32, eval_every=0, log_every=1, progress_bar=False)
    train(TrainConfig(family="cola-vae", output_dir=str(tmp_path / "vae"), max_steps=2, save_every=2, **common),
          tokenizer=tokenizer, train_rows=tiny_rows[:16, :32])
    train(TrainConfig(family="cola", output_dir=str(tmp_path / "cola"), max_steps=3, save_every=3,
                      components={"vae": str(tmp_path / "vae")}, **common),
          tokenizer=tokenizer, train_rows=tiny_rows[:16, :32])
    record = training_compute(tmp_path / "cola")
    vae = record["components"]["vae"]
    assert (record["steps"], record["tokens"], vae["steps"], vae["tokens"]) == (3, 3 * 2 * 32, 2, 2 * 2 * 32)
    for folder, entry, language_model in ((tmp_path / "cola", record, True), (tmp_path / "vae", vae, False)):
        model = load_model_and_tokenizer(str(folder), language_model=language_model)[0]
        per_token = training_flops_per_token(model, 32)["per_token"]
        assert entry["flops_per_token"] == per_token and entry["train_flops"] == entry["tokens"] * per_token
    assert record["flops_per_token"] > vae["flops_per_token"] > 0  # the Cola step runs the VAE and the DiT
    assert _components(record) == f"vae: 128 (2 steps), {vae['train_flops']:.3g}"
