import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_latentlm.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["train", "--preset", "gigantic", "--output-dir", "x"], "unknown preset 'gigantic'"),
    (["train", "--family", "rnn", "--output-dir", "x"], "unknown family 'rnn'"),
    (["train", "--output-dir", "x", "--max-steps", "0"], "max_steps"),
    (["generate", "--model", "/nonexistent/folder", "--prompt", "hi"], "does not exist"),
    (["eval", "--model", "/nonexistent/folder"], "does not exist"),
    (["bench", "--model", "no-equals-sign"], "NAME=DIR"),
    (["bench", "--model", "ar=x", "--sweep", "ar-top_k=4"], "MODEL:KEY=V1,V2"),
    (["bench", "--model", "ar=x", "--sweep", "plm:k_pred=2"], "no model 'plm'"),
    (["train", "--family", "plm", "--output-dir", "x", "--config", "block_sise=4"], "no field(s) ['block_sise']"),
    (["train", "--output-dir", "x", "--config", "no-equals-sign"], "expected KEY=VALUE"),
])
def test_bad_input_is_one_line_and_nonzero(run_cli, argv, needle):
    code, _, err = run_cli(*argv)
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--max-steps", "many", "--output-dir", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid int value" in err and len(err.strip().splitlines()) == 1


def test_a_command_destroys_the_process_group_it_ran_in(tmp_path, run_cli):
    """Accelerate's `end_training` step, done by the CLI whether the command succeeds or fails (here: fails): a
    rank that leaves gloo to the interpreter's exit can abort after its work is saved."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        code, _, err = run_cli("sft", "--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "out"))
        assert code == 2 and "missing" in err
        assert not dist.is_initialized(), "the command left the process group up"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_train_generate_eval_round_trip(tmp_path, run_cli):
    out = tmp_path / "ar-tiny"
    code, stdout, _ = run_cli("train", "--family", "ar", "--preset", "tiny", "--output-dir", str(out),
                              "--max-steps", "4", "--eval-every", "2", "--save-every", "2", "--batch-size", "4")
    assert code == 0
    assert "--- sample" in stdout and "tokens per model call" in stdout
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    code, stdout, _ = run_cli("generate", "--model", str(out), "--prompt", "HAMLET.\n",
                              "--max-new-tokens", "12", "--seed", "5")
    again = run_cli("generate", "--model", str(out), "--prompt", "HAMLET.\n", "--max-new-tokens", "12",
                    "--seed", "5")[1]
    assert code == 0 and stdout.startswith("HAMLET.\n") and stdout == again
    code, _, err = run_cli("generate", "--model", str(out), "--prompt", "   ")
    assert code == 2 and "prompt is empty" in err
    code, _, err = run_cli("generate", "--model", str(out), "--prompt", "x", "--max-new-tokens", "5000")
    assert code == 2 and "position limit" in err

    # Trained at tiny's 64-token rows: by default the context is the longest that fits (60 + Brier's 4 draws), as the
    # result records; an explicit context that does not fit is refused, naming both lengths.
    code, stdout, err = run_cli("eval", "--model", str(out), "--num-positions", "64", "--batch-size", "32")
    assert code == 0 and json.loads(stdout)["brier"]["context_len"] == 60
    code, _, err = run_cli("eval", "--model", str(out), "--num-positions", "64", "--context-len", "128")
    assert code == 2 and "reach 132 positions, beyond the 64 the model was trained at" in err
    code, _, err = run_cli("eval", "--model", str(out), "--context-len", "-5")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--context-len must be at least 1, got -5" in err
    code, stdout, _ = run_cli("eval", "--model", str(out), "--num-positions", "64", "--batch-size", "32",
                              "--context-len", "32")
    assert code == 0
    result = json.loads(stdout)
    for key in ("brier_1", "brier_2", "brier_3", "brier_4", "brierlm", "brierlm_2"):
        entry = result["brier"][key]
        assert entry["ci_low"] <= entry["value"] <= entry["ci_high"]
    assert result["brier"]["num_positions"] == 64

    # Your own texts: a JSON-lines file (one document a line, as the official CALM evaluation set) evaluates as the
    # same documents given one text file each, and not as the embedded corpus.
    texts = ["To be, or not to be, that is the question. " * 12, "Now is the winter of our discontent. " * 14]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(text)
    options = ["--num-positions", "64", "--batch-size", "32", "--context-len", "32"]
    jsonl = json.loads(run_cli("eval", "--model", str(out), *options, "--text-file", str(tmp_path / "eval.jsonl"))[1])
    files = json.loads(run_cli("eval", "--model", str(out), *options, "--text-file", str(tmp_path / "doc0.txt"),
                               "--text-file", str(tmp_path / "doc1.txt"))[1])
    assert jsonl["split"] == files["split"] == "documents" and jsonl["brier"] == files["brier"]
    assert jsonl["nll"] == files["nll"] and jsonl["nll"] != result["nll"]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    code, _, err = run_cli("eval", "--model", str(out), "--text-file", str(tmp_path / "bad.jsonl"))
    assert code == 2 and 'bad.jsonl\': line 2 has no string "text" field' in err
    assert 0 < result["nll"]["nll"] < 10 and result["nll"]["perplexity"] > 1


def test_config_overrides_parse_json_values_or_keep_strings():
    from hf_latentlm.cli import config_overrides

    assert config_overrides(["a=64", "b=0.5", "c=null", "d=true", "e=velocity", 'f="x0"', "g=[1, 2]"]) == {
        "a": 64, "b": 0.5, "c": None, "d": True, "e": "velocity", "f": "x0", "g": [1, 2]}


def test_train_config_overrides_reach_the_saved_config(tmp_path, run_cli):
    out = tmp_path / "plm"
    code, _, err = run_cli("train", "--family", "plm", "--preset", "tiny", "--output-dir", str(out), "--max-steps",
                           "1", "--eval-every", "0", "--batch-size", "2", "--no-sample", "--config", "k_pred=3",
                           "--config", "block_size=6")
    assert code == 0, err
    saved = json.loads((out / "config.json").read_text())
    assert saved["k_pred"] == 3 and saved["block_size"] == 6


def test_train_plm_prints_tokens_per_call_next_to_the_ar_baseline(tmp_path, run_cli):
    code, stdout, _ = run_cli("train", "--family", "plm", "--preset", "tiny", "--output-dir",
                              str(tmp_path / "plm"), "--max-steps", "2", "--eval-every", "2", "--batch-size", "2")
    assert code == 0
    assert "plm:" in stdout and "tokens per model call" in stdout
    assert json.loads((tmp_path / "plm" / "config.json").read_text())["model_type"] == "plm"
    found = re.search(r"plm: (\d+) tokens/s, .* \| untrained AR baseline of the same size \(tiny\): (\d+) tokens/s "
                      r"\| speed ratio (\d+\.\d\d)x \(median of 3 alternating pairs, (\d+\.\d\d)-(\d+\.\d\d)x\)", stdout)
    assert found, stdout
    # The relaxed rule the family registers is timed too, on its own line.
    assert re.search(r"plm \(nucleus acceptance\): \d+ tokens/s, .* \| speed ratio \d+\.\d\dx", stdout), stdout
    ratio, low, high = float(found[3]), float(found[4]), float(found[5])
    assert low <= ratio <= high
    # Where the model is and what to run on it next closes the output.
    folder = tmp_path / "plm"
    assert stdout.rstrip().endswith(f"saved to {folder}; next:\n  hf-latentlm generate --model {folder} --prompt "
                                    f"'ROMEO.'\n  hf-latentlm eval --model {folder}"), stdout


def test_train_calm_autoencoder_then_calm_then_generate(tmp_path, run_cli):
    ae, calm = tmp_path / "ae", tmp_path / "calm"
    code, stdout, _ = run_cli("train", "--family", "calm-ae", "--preset", "tiny", "--output-dir", str(ae),
                              "--max-steps", "3", "--eval-every", "3", "--batch-size", "2")
    assert code == 0 and "(sampled z)" in stdout and "mean posterior std" in stdout
    code, _, err = run_cli("generate", "--model", str(ae), "--prompt", "HAMLET.")
    assert code == 2 and "not a language model" in err
    code, _, err = run_cli("train", "--family", "calm", "--preset", "tiny", "--output-dir", str(calm))
    assert code == 2 and "--autoencoder" in err and len(err.strip().splitlines()) == 1
    code, stdout, _ = run_cli("train", "--family", "calm", "--preset", "tiny", "--output-dir", str(calm),
                              "--autoencoder", str(ae), "--max-steps", "2", "--eval-every", "2", "--batch-size", "2")
    assert code == 0 and "calm:" in stdout and "4.00 tokens per model call" in stdout and "AR baseline" in stdout
    assert json.loads((calm / "config.json").read_text())["model_type"] == "calm"
    code, stdout, _ = run_cli("generate", "--model", str(calm), "--prompt", "HAMLET.\n", "--max-new-tokens",
                              "9", "--temperature", "0.5")
    assert code == 0 and stdout.startswith("HAMLET.\n")
    code, _, err = run_cli("generate", "--model", str(calm), "--prompt", "HAMLET.", "--temperature", "2")
    assert code == 2 and "temperature must be in (0, 1]" in err


def test_bench_writes_json_and_table_with_ratios(tmp_path, run_cli, tokenizer):
    import torch

    from hf_latentlm.families import build_model

    paths = {}
    for name, seed in (("ar", 0), ("ar2", 1)):
        torch.manual_seed(seed)
        model = build_model("ar", "tiny", tokenizer)
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        paths[name] = tmp_path / name
    code, stdout, _ = run_cli("bench", "--model", f"ar={paths['ar']}", "--model", f"ar2={paths['ar2']}",
                              "--num-positions", "32", "--repeats", "1", "--max-new-tokens", "8",
                              "--output", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md"))
    assert code == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["baseline"] == "ar" and set(report["models"]) == {"ar", "ar2"}
    assert report["models"]["ar"]["ratio_to_baseline"]["tokens_per_s_batch_1"] == pytest.approx(1.0)
    assert report["models"]["ar2"]["speed"]["batch_8"]["model_calls_per_token"] == pytest.approx(1.0)
    table = (tmp_path / "b.md").read_text()
    assert table.count("\n| ar") == 2 and "BrierLM-2" in table and table in stdout
    assert "extras" not in report  # asked for none


def test_bench_extras_measure_each_model_further_next_to_the_baseline(tmp_path, run_cli, tokenizer, monkeypatch):
    """--extras (the family's decodings and measurements), --sweep, --train-steps and --profile: every row is there,
    with the options it says, and the ratios divide by the baseline."""
    import torch

    from hf_latentlm import families
    from hf_latentlm.eval.family_bench import plm_measurements
    from hf_latentlm.families import build_model

    # PLM's measurements on 4 rows of the stream, not 64: the fit at every position is what costs.
    plm_spec = families.FAMILIES["plm"]
    monkeypatch.setitem(families.FAMILIES, "plm", dataclasses.replace(
        plm_spec, bench_measurements=lambda m, b, stream: plm_measurements(m, b, stream[:1024])))
    # ... and no NLL pass over the whole split in the side-by-side table (tested above with AR models).
    monkeypatch.setattr("hf_latentlm.eval.harness.has_likelihood", lambda model: False)

    for family in ("ar", "plm"):
        torch.manual_seed(0)
        build_model(family, "tiny", tokenizer).save_pretrained(tmp_path / family)
        tokenizer.save_pretrained(tmp_path / family)
    code, stdout, _ = run_cli("bench", "--model", f"ar={tmp_path / 'ar'}", "--model", f"plm={tmp_path / 'plm'}",
                              "--num-positions", "16", "--sweep-positions", "16", "--repeats", "1",
                              "--max-new-tokens", "8", "--extras", "--sweep", "plm:k_pred=2",
                              "--sweep", "ar:temperature=0.5", "--train-steps", "1", "--train-preset", "tiny",
                              "--profile", "--output", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md"))
    assert code == 0
    extras = json.loads((tmp_path / "b.json").read_text())["extras"]
    plm, ar = extras["models"]["plm"], extras["models"]["ar"]
    assert list(plm["decodings"]) == ["default", *plm_spec.bench_decodings, "k_pred=2"]
    assert plm["decodings"]["k_pred=2"]["generate_kwargs"] == {"k_pred": 2}
    assert plm["decodings"]["nucleus acceptance"]["generate_kwargs"] == {"acceptance": "nucleus"}
    # The AR baseline has no family extras, only its sweep; at one call per token.
    assert list(ar["decodings"]) == ["default", "temperature=0.5"] and "measurements" not in ar
    assert ar["decodings"]["temperature=0.5"]["speed"]["batch_1"]["model_calls_per_token"] == pytest.approx(1.0)
    for row in plm["decodings"].values():
        speed, ratio = row["speed"], row["ratio_to_baseline"]
        assert speed["batch_8"]["batch_size"] == 8 and speed["batch_1"]["new_tokens_per_row"] == 8
        assert row["brier"]["num_positions"] == 16
        for b in (1, 8):
            assert ratio[f"batch_{b}"] == pytest.approx(speed[f"batch_{b}"]["tokens_per_s"]
                                                        / row["baseline_speed"][f"batch_{b}"]["tokens_per_s"])
    assert set(plm["measurements"]) == {"validation", "sampler"}
    assert 0 <= plm["measurements"]["sampler"]["sampler_vs_softmax_tv"] <= 1
    assert ar["training"]["tokens_per_s_over_baseline"] == 1.0
    assert plm["training"]["tokens_per_s_over_baseline"] == pytest.approx(
        plm["training"]["tokens_per_s"] / ar["training"]["tokens_per_s"])
    # Achieved FLOP/s: the counter's FLOPs per token of a step (the same function, on the saved tiny PLM, on a batch
    # of the tiny preset's size and length; PLM's token-auxiliary scores are shared by the batch) times the timed
    # tokens/s, and its ratio to AR's. torch's FlopCounterMode counts the same step within 1%.
    from transformers import AutoModelForCausalLM

    from hf_latentlm.eval.flops import counted_training_flops, training_flops_per_token
    from hf_latentlm.presets import get_preset

    plm_model = AutoModelForCausalLM.from_pretrained(tmp_path / "plm")
    tiny = get_preset("tiny")
    flops = counted_training_flops(plm_model, torch.randint(3, 100, (tiny.batch_size, tiny.seq_len)))["per_token"]
    assert plm["training"]["flops_per_token"] == pytest.approx(flops)
    assert flops == pytest.approx(training_flops_per_token(plm_model, tiny.seq_len, tiny.batch_size)["per_token"],
                                  rel=0.01)
    assert plm["training"]["achieved_flops_per_s"] == pytest.approx(flops * plm["training"]["tokens_per_s"])
    assert plm["training"]["flops_per_token"] > 1.5 * ar["training"]["flops_per_token"]  # encoder + decoder passes
    assert plm["training"]["achieved_flops_per_s_over_baseline"] == pytest.approx(
        plm["training"]["achieved_flops_per_s"] / ar["training"]["achieved_flops_per_s"])
    assert "generate" in plm["profile"]["text"] and extras["git"]["commit"]
    table = (tmp_path / "b.md").read_text()
    assert table in stdout and "plm: decoding settings" in table and "| k_pred=2 |" in table
    assert "Training step time" in table and "plm: family measurements" in table


@pytest.fixture(scope="module")
def plm_folder(tmp_path_factory, tokenizer):
    """An untrained tiny PLM saved with `save_pretrained`: a language model, not an autoencoder."""
    from hf_latentlm.families import build_model

    folder = tmp_path_factory.mktemp("cli") / "plm"
    build_model("plm", "tiny", tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    from hf_latentlm.training.corpus import load_corpus_documents

    path = tmp_path_factory.mktemp("cli-text") / "macbeth.txt"
    path.write_text(load_corpus_documents("test")[0])
    return path


def test_calm_refuses_a_plm_folder_as_autoencoder_and_creates_nothing(tmp_path, run_cli, plm_folder, small_text):
    out = tmp_path / "runs" / "calm"
    code, stdout, err = run_cli("train", "--family", "calm", "--preset", "tiny", "--output-dir", str(out),
                                "--autoencoder", str(plm_folder), "--max-steps", "1", "--train-file",
                                str(small_text), "--validation-file", str(small_text))
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert f"--autoencoder {str(plm_folder)!r} holds a 'plm' model, expected a 'calm_autoencoder'" in err, err
    assert not out.exists() and not out.parent.exists()


def damaged_copy(source, tmp_path, damage):
    import shutil

    folder = tmp_path / "damaged"
    shutil.copytree(source, folder)
    damage(folder)
    return folder


@pytest.mark.parametrize("case", [
    "missing train file", "empty train file", "train file not UTF-8", "train file is a folder",
    "missing validation file", "missing tokenizer", "missing component", "component config not JSON",
    "component without weights",
])
def test_refused_train_inputs_leave_no_output_folder(tmp_path, run_cli, plm_folder, small_text, case):
    out = tmp_path / "runs" / "model"
    text = tmp_path / "text.txt"
    family, needle, args = "plm", None, ["--train-file", str(small_text), "--validation-file", str(small_text)]
    if case == "missing train file":
        args[1], needle = str(tmp_path / "missing.txt"), "does not exist"
    elif case == "empty train file":
        text.write_text("  \n\n")
        args[1], needle = str(text), "is empty"
    elif case == "train file not UTF-8":
        text.write_bytes(b"ROMEO.\n\xff\xfe\x80 latin-1 \xe9t\xe9\n" * 50)
        args[1], needle = str(text), "cannot be read as UTF-8"
    elif case == "train file is a folder":
        args[1], needle = str(tmp_path), "is not a file"
    elif case == "missing validation file":
        args[3], needle = str(tmp_path / "missing.txt"), "does not exist"
    elif case == "missing tokenizer":
        args += ["--tokenizer", str(tmp_path / "no-such-tokenizer")]
        needle = "no such folder"
    else:  # a component folder that is missing or damaged (the calm family needs an autoencoder)
        family = "calm"
        folder = {"missing component": lambda: tmp_path / "no-such-ae",
                  "component config not JSON": lambda: damaged_copy(
                      plm_folder, tmp_path, lambda f: (f / "config.json").write_text('{"model_type": ')),
                  "component without weights": lambda: damaged_copy(
                      plm_folder, tmp_path, lambda f: (f / "model.safetensors").unlink())}[case]()
        args += ["--autoencoder", str(folder)]
        needle = {"missing component": "does not exist", "component config not JSON": "config.json is not valid JSON",
                  "component without weights": "has no weights"}[case]
    code, stdout, err = run_cli("train", "--family", family, "--preset", "tiny", "--output-dir", str(out),
                                "--max-steps", "1", "--batch-size", "2", *args)
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert needle in err, err
    assert not out.exists() and not out.parent.exists()


# A fresh interpreter parses `argv`, then reports what the parse printed and which heavy modules it imported.
PARSE_ONLY = """
import contextlib, io, json, sys
from hf_latentlm.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        main(sys.argv[1:])
        code = None
    except SystemExit as exit:
        code = exit.code
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                  "heavy": sorted(m for m in ("torch", "transformers", "datasets") if m in sys.modules)}))
"""


@pytest.mark.parametrize("argv,code", [
    (["--help"], 0),
    (["train", "--help"], 0),
    (["generate", "--help"], 0),
    (["train", "--bogus", "--output-dir", "x"], 2),
    (["train", "--max-steps", "many", "--output-dir", "x"], 2),
    (["no-such-command"], 2),
    ([], 2),
])
def test_help_and_argument_errors_do_not_import_torch_or_transformers(argv, code):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", PARSE_ONLY, *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["code"] == code
    assert result["heavy"] == [], f"parsing {argv} imported {result['heavy']}"
    if code == 2:
        assert len(result["err"].strip().splitlines()) == 1 and result["out"] == ""


def test_train_help_lists_every_registered_family_preset_and_component():
    import subprocess
    import sys

    from hf_latentlm.families import FAMILIES, component_names
    from hf_latentlm.presets import PRESETS

    run = subprocess.run([sys.executable, "-c", PARSE_ONLY, "train", "--help"], capture_output=True, text=True,
                         timeout=120)
    text = " ".join(json.loads(run.stdout)["out"].split())  # argparse wraps help lines
    assert f"model family: {', '.join(sorted(FAMILIES))}" in text
    assert f"model size: {', '.join(PRESETS)}" in text
    assert {"calm", "cola", "aurora"} <= set(FAMILIES) and component_names() == ["autoencoder", "vae"]
    for name in component_names():
        assert f"--{name} {name.upper()}" in text
    assert "--family calm: folder of a trained autoencoder (from --family calm-ae)" in text


@pytest.mark.parametrize("family", ["cola", "aurora"])
def test_config_takes_num_inference_steps_the_name_generate_takes(family):
    from hf_latentlm.cli import check_config_keys
    from hf_latentlm.families import get_family

    check_config_keys(get_family(family), {"num_inference_steps": 8})  # was "no field(s)" before the rename
    with pytest.raises(ValueError, match=r"no field\(s\) \['num_inference_step'\]"):
        check_config_keys(get_family(family), {"num_inference_step": 8})


def test_train_resume_from_a_damaged_checkpoint_is_one_line_and_previous_falls_back(tmp_path, run_cli, small_text):
    out = tmp_path / "ar"
    common = ["train", "--family", "ar", "--preset", "tiny", "--output-dir", str(out), "--max-steps", "3",
              "--save-every", "1", "--eval-every", "0", "--batch-size", "2", "--no-sample", "--train-file",
              str(small_text)]
    assert run_cli(*common, "--stop-at-step", "2")[0] == 0
    optimizer = out / "checkpoint-0000002" / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[:50])  # truncated: safetensors says "invalid header length"
    code, stdout, err = run_cli(*common, "--resume")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"checkpoint {out / 'checkpoint-0000002'} is damaged: optimizer.safetensors does not read" in err
    assert "rerun with --resume previous" in err
    code, stdout, err = run_cli(*common, "--resume", "previous")
    assert code == 0, err
    assert f"resumed from {out / 'checkpoint-0000001'} at step 1" in stdout and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("saves_before", [2, 0])
def test_ctrl_c_during_train_is_one_line_naming_the_checkpoint_and_the_resume_flag(tmp_path, run_cli, small_text,
                                                                                    monkeypatch, saves_before):
    """Ctrl-C (KeyboardInterrupt) at the step after `saves_before` checkpoints: exit 130, no traceback, and the last
    line says where the run can go on from and with which flag."""
    from hf_latentlm.training import loop

    save, saved = loop._save, []

    def save_until_interrupted(*args, **kwargs):
        if len(saved) == saves_before:
            raise KeyboardInterrupt
        saved.append(save(*args, **kwargs))
        return saved[-1]

    monkeypatch.setattr(loop, "_save", save_until_interrupted)
    out = tmp_path / "ar"
    common = ["train", "--family", "ar", "--preset", "tiny", "--output-dir", str(out), "--max-steps", "3",
              "--save-every", "1", "--eval-every", "0", "--batch-size", "2", "--no-sample", "--train-file",
              str(small_text)]
    code, stdout, err = run_cli(*common)
    assert code == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    if saves_before:
        assert last == (f"hf-latentlm train: interrupted; the last complete checkpoint is {out / 'checkpoint-0000002'}:"
                        f" continue from it with the same command plus --resume")
        monkeypatch.setattr(loop, "_save", save)
        code, stdout, err = run_cli(*common, "--resume")
        assert code == 0 and f"resumed from {out / 'checkpoint-0000002'} at step 2" in stdout, err
    else:
        assert last == (f"hf-latentlm train: interrupted; no checkpoint in {out} yet, so nothing to resume: rerun the "
                        f"command to start over")
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp")]


def test_a_real_sigint_ends_train_with_one_line_and_no_traceback(tmp_path, small_text):
    """The real thing, not a raised KeyboardInterrupt: `hf-latentlm train` in its own process gets SIGINT once its
    first checkpoint exists; it exits 130, and stderr ends with the line naming a complete checkpoint and --resume.

    It must never hang: output goes to files (a full pipe would block the child), the child runs in its own process
    group with a bounded number of steps, every wait has a timeout, and teardown kills the whole group."""
    from hf_latentlm.training.checkpoint import is_complete_checkpoint

    out, log = tmp_path / "ar", tmp_path / "stderr.txt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "hf_latentlm.cli", "train", "--family", "ar", "--preset", "tiny", "--output-dir",
               str(out), "--max-steps", "2000", "--save-every", "1", "--eval-every", "0", "--batch-size", "2",
               "--no-summary", "--train-file", str(small_text)]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not any(is_complete_checkpoint(folder) for folder in out.glob("checkpoint-*")):
            assert process.poll() is None, f"train ended before its first checkpoint:\n{log.read_text()}"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    err = log.read_text()
    assert code == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(r"hf-latentlm train: interrupted; the last complete checkpoint is (\S+): continue from it "
                         r"with the same command plus --resume", last)
    assert match, last
    assert is_complete_checkpoint(Path(match.group(1)))


# One fresh interpreter runs every refused command line in turn and reports, after each, its exit status, stderr and
# whether torch has been imported (once one case imports it, every later case shows it too: the first is the culprit).
REFUSED_WITHOUT_TORCH = """
import contextlib, io, json, sys
from hf_latentlm.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append({"argv": argv, "code": code, "err": err.getvalue(), "torch": "torch" in sys.modules})
print(json.dumps(results))
"""


def test_argument_errors_of_every_command_answer_before_torch_is_imported(tmp_path):
    import subprocess
    import sys

    missing = str(tmp_path / "missing")
    cases = [
        (["train", "--family", "rnn", "--output-dir", "x"], "unknown family 'rnn'"),
        (["train", "--preset", "gigantic", "--output-dir", "x"], "unknown preset 'gigantic'"),
        (["train", "--family", "cola", "--preset", "tiny", "--output-dir", "x"], "needs a trained vae"),
        (["train", "--family", "aurora", "--output-dir", "x"], "needs a trained autoencoder"),
        (["train", "--family", "calm", "--autoencoder", missing, "--output-dir", "x"], "does not exist"),
        (["train", "--family", "ar", "--vae", missing, "--output-dir", "x"], "--vae only applies to --family cola"),
        (["train", "--output-dir", "x", "--max-steps", "0"], "max_steps must be at least 1"),
        (["train", "--output-dir", "x", "--config", "no-equals-sign"], "expected KEY=VALUE"),
        (["generate", "--model", missing, "--prompt", "hi"], "does not exist"),
        (["eval", "--model", missing], "does not exist"),
        (["eval", "--model", missing, "--num-positions", "0"], "--num-positions must be at least 1"),
        (["bench", "--model", "no-equals-sign"], "NAME=DIR"),
        (["bench", "--model", "ar=x", "--sweep", "plm:k_pred=2"], "no model 'plm'"),
        (["bench", "--model", "ar=x", "--train-preset", "huge"], "unknown preset 'huge'"),
        (["report", "--model", "ar=x", "--repeats", "0"], "--repeats must be at least 1"),
        (["sft", "--model", missing, "--output-dir", "x"], "does not exist"),
        (["dpo", "--model", missing, "--output-dir", "x", "--task", "no-such-task"], "unknown task 'no-such-task'"),
        (["sft", "--model", missing, "--output-dir", "x", "--max-steps", "0"], "--max-steps must be at least 1"),
        (["sft", "--init-from", missing, "--family", "ar", "--output-dir", "x"], "--init-from only applies to"),
    ]
    run = subprocess.run([sys.executable, "-c", REFUSED_WITHOUT_TORCH, json.dumps([argv for argv, _ in cases])],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for (argv, needle), result in zip(cases, json.loads(run.stdout)):
        assert result["code"] == 2 and needle in result["err"], (argv, result["err"])
        assert len(result["err"].strip().splitlines()) == 1, (argv, result["err"])
        assert not result["torch"], f"{argv} imported torch before refusing"


def test_bench_refuses_a_latent_baseline(tmp_path, run_cli, plm_folder):
    """Its table divides every model by the baseline ("speed×AR"): a PLM alone would print 1.00 against itself. Refused before anything is measured, as `report` refuses a run without `ar=DIR`."""
    output = ["--output", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md")]
    code, stdout, err = run_cli("bench", "--model", f"plm={plm_folder}", *output)
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1, err
    assert "its baseline 'plm' is a plm model: add --model ar=DIR" in err
    code, _, err = run_cli("bench", "--model", f"plm={plm_folder}", "--model", f"other={plm_folder}", "--baseline",
                           "other", *output)
    assert code == 2 and "its baseline 'other' is a plm model" in err
    code, _, err = run_cli("bench", "--model", f"plm={plm_folder}", "--baseline", "ar", *output)
    assert code == 2 and "--baseline 'ar' is none of the models ['plm']" in err
    assert not (tmp_path / "b.json").exists()


def test_top_level_help_names_every_command_and_train_options_say_what_they_do_and_their_default():
    import argparse

    from hf_latentlm.cli import COMMANDS, build_parser

    parser = build_parser()
    assert parser.description == f"`hf-latentlm` command line: {', '.join(COMMANDS)}." and "report" in COMMANDS
    train = parser._subparsers._group_actions[0].choices["train"]
    formatter = train._get_formatter()  # the formatter appends each default to its option's help
    for action in train._actions:
        assert action.help, f"train {action.option_strings} has no help"
        text = formatter._get_help_string(action) % vars(action)
        if action.default not in (None, False, [], argparse.SUPPRESS):
            assert f"(default: {action.default})" in text, (action.option_strings, text)


# Every TrainConfig field, the command-line words that set it, and the value they give.
EVERY_TRAIN_FIELD = {
    "family": (["--family", "plm"], "plm"), "preset": (["--preset", "tiny"], "tiny"),
    "output_dir": (["--output-dir", "out"], "out"), "max_steps": (["--max-steps", "7"], 7),
    "stop_at_step": (["--stop-at-step", "3"], 3), "resume": (["--resume", "previous"], "previous"),
    "overwrite_output_dir": (["--overwrite-output-dir"], True),
    "batch_size": (["--batch-size", "2"], 2), "grad_accum": (["--grad-accum", "4"], 4),
    "seq_len": (["--seq-len", "32"], 32), "learning_rate": (["--learning-rate", "0.01"], 0.01),
    "schedule": (["--schedule", "wsd"], "wsd"), "warmup_steps": (["--warmup-steps", "1"], 1),
    "min_lr_ratio": (["--min-lr-ratio", "0"], 0.0), "decay_fraction": (["--decay-fraction", "0.5"], 0.5),
    "weight_decay": (["--weight-decay", "0.05"], 0.05), "adam_beta1": (["--adam-beta1", "0.8"], 0.8),
    "adam_beta2": (["--adam-beta2", "0.99"], 0.99), "adam_eps": (["--adam-eps", "1e-6"], 1e-6),
    "grad_clip": (["--grad-clip", "0"], 0.0), "eval_every": (["--eval-every", "0"], 0),
    "eval_batches": (["--eval-batches", "3"], 3), "save_every": (["--save-every", "5"], 5),
    "keep_checkpoints": (["--keep-checkpoints", "0"], 0), "log_every": (["--log-every", "1"], 1),
    "seed": (["--seed", "9"], 9), "corpus": (["--corpus", "generated:easy"], "generated:easy"),
    "train_files": (["--train-file", "a.txt", "--train-file", "b.txt"], ["a.txt", "b.txt"]),
    "validation_files": (["--validation-file", "v.txt"], ["v.txt"]), "tokenizer": (["--tokenizer", "tok"], "tok"),
    "dataset": (["--dataset", "corpus"], "corpus"), "text_column": (["--text-column", "body"], "body"),
    "mixed_precision": (["--mixed-precision", "bf16"], "bf16"), "progress_bar": (["--no-progress-bar"], False),
    "components": (["--components", '{"autoencoder": "ae"}'], {"autoencoder": "ae"}),
    "model_kwargs": (["--model-kwargs", '{"k_pred": 3}'], {"k_pred": 3}),
    "report_to": (["--report-to", "tensorboard,wandb"], "tensorboard,wandb"),
    "init_from": (["--init-from", "runs/ar-small"], "runs/ar-small"),
    "encoder_kl_weight": (["--encoder-kl-weight", "0.5"], 0.5),
}


def test_every_train_config_field_is_an_option_with_the_dataclass_default():
    from dataclasses import MISSING, fields

    from hf_latentlm.cli import build_parser
    from hf_latentlm.training.config import TrainConfig

    assert sorted(EVERY_TRAIN_FIELD) == sorted(f.name for f in fields(TrainConfig)), "a field without a test row"
    defaults = build_parser().parse_args(["train"])
    for f in fields(TrainConfig):
        assert f.metadata["help"], f"TrainConfig.{f.name} has no help"
        assert getattr(defaults, f.name) == (f.default if f.default is not MISSING else f.default_factory()), f.name
    args = build_parser().parse_args(["train", *(word for words, _ in EVERY_TRAIN_FIELD.values() for word in words)])
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    for name, (words, value) in EVERY_TRAIN_FIELD.items():
        assert getattr(cfg, name) == value, (words, getattr(cfg, name))
    assert build_parser().parse_args(["train", "--resume"]).resume == "latest"


def test_train_config_reads_mappings_as_json_and_names_its_output_folder():
    from hf_latentlm.training.config import TrainConfig

    assert TrainConfig(model_kwargs='{"block_size": 8}').model_kwargs == {"block_size": 8}
    with pytest.raises(ValueError, match="model_kwargs: not a JSON object"):
        TrainConfig(model_kwargs="block_size=8")
    with pytest.raises(ValueError, match="components must be a mapping"):
        TrainConfig(components="[1, 2]")
    assert TrainConfig(family="plm", preset="tiny").resolved().output_dir == "runs/plm-tiny"


def test_no_summary_trains_and_saves_only(tmp_path, run_cli):
    for flag in ("--no-summary", "--no-sample"):  # --no-sample: its older name
        out = tmp_path / flag
        code, stdout, err = run_cli("train", "--family", "ar", "--preset", "tiny", "--output-dir", str(out),
                                    "--max-steps", "1", "--eval-every", "0", "--batch-size", "2", flag)
        assert code == 0, err
        metrics_line, saved_line = stdout.strip().splitlines()[0:2]
        assert (out / "model.safetensors").is_file() and json.loads(metrics_line)["step"] == 1
        assert saved_line == f"saved to {out}; next:"
        assert "--- speed" not in stdout and "--- sample" not in stdout


def test_train_into_an_earlier_run_needs_resume_or_overwrite(tmp_path, run_cli, small_text):
    """A fresh run over a finished one is refused in one line naming both ways on, and leaves the folder as it was;
    --overwrite-output-dir starts afresh, and only the new run's checkpoints remain. A file is no output folder."""
    out = tmp_path / "ar"
    common = ["train", "--family", "ar", "--preset", "tiny", "--output-dir", str(out), "--eval-every", "0",
              "--batch-size", "2", "--no-summary", "--train-file", str(small_text)]
    code, _, err = run_cli(*common, "--max-steps", "3", "--save-every", "3")
    assert code == 0, err
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    code, out_text, err = run_cli(*common, "--max-steps", "2", "--save-every", "2")
    assert code == 2 and out_text == "" and len(err.strip().splitlines()) == 1
    assert "holds an earlier run (checkpoint-0000003, ...): continue it with --resume, or start afresh with " \
           "--overwrite-output-dir" in err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before
    code, _, err = run_cli(*common, "--max-steps", "2", "--save-every", "2", "--overwrite-output-dir")
    assert code == 0, err
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-0000002"]
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    code, _, err = run_cli("train", "--family", "ar", "--preset", "tiny", "--output-dir", str(a_file))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is a file, not a folder" in err
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "no network"])
def test_an_offline_hub_id_tokenizer_is_one_line_at_once(tmp_path, run_cli, small_text, monkeypatch, how):
    """A Hub id that is not in the local cache, with HF_HUB_OFFLINE set or no answer from the Hub, fails in one line
    within seconds, not after huggingface_hub's minute of retries; nothing is written."""
    import socket

    if how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)

        def unreachable(*args, **kwargs):
            raise OSError("network is unreachable")

        monkeypatch.setattr(socket, "create_connection", unreachable)
    out = tmp_path / "ar"
    start = time.monotonic()
    code, _, err = run_cli("train", "--family", "ar", "--preset", "tiny", "--output-dir", str(out), "--max-steps",
                           "1", "--tokenizer", "no-such-org/no-such-tokenizer", "--train-file", str(small_text))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is not a local folder nor in the Hub cache, and the Hub cannot be reached" in err
    assert time.monotonic() - start < 60 and not out.exists()  # (huggingface_hub alone retries for over 80 s)
