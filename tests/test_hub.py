"""`hf-latentlm push` and its model cards.

The upload runs for real against a loopback Hub (tests/fake_hub.py). Every family is pushed by the CLI and
downloaded back with `AutoModelForCausalLM.from_pretrained(repo_id, revision=..., trust_remote_code=True)` in a `python -S` process where
`hf_latentlm` cannot be imported (tests/modeling/without_package.py), which must generate the local model's tokens
and run the card's own snippet."""

import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from family_contract import build_tiny, seeded
from fake_hub import fake_hub, hub_env  # noqa: F401  (fake_hub is a fixture)
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from hf_latentlm.families import get_family
from hf_latentlm.folders import EVAL_RESULTS_FILE, POST_TRAINING_RECORD
from hf_latentlm.hub import build_model_card
from hf_latentlm.training.checkpoint import save_tokenizer
from hf_latentlm.training.tasks import DEFAULT_TASK

FAMILIES = ("ar", "plm", "calm", "cola", "aurora")
PROMPT = [[5, 60, 700, 42, 9, 31, 17, 8]]
LEFTOVERS = ("optimizer.pt", "optimizer.safetensors", "scheduler.pt", "rng_state.pth", "rng_rank0.safetensors",
             "trainer_state.json", "training_args.bin", "metrics.jsonl", "x.pkl")
MODELING_DIR = Path(__file__).parent / "modeling"


def save_model(model, tokenizer, folder) -> Path:
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


def local_tokens(model, options) -> list:
    return model.generate(torch.tensor(PROMPT), max_new_tokens=12, **options)[0, len(PROMPT[0]):].tolist()


def generate_options(model) -> dict:
    if getattr(model, "row_seeds_option", None) is None:  # the AR baseline: greedy, so both sides are deterministic
        return {"do_sample": False, "eos_token_id": None}
    return {"eos_token_id": None, **seeded(model, [11])}


# Runs with `python -S` (no site, no editable install): only the checkpoints' own code can load the models.
DOWNLOAD = """
import contextlib, io, json, re, sys
sys.path.insert(0, {modeling!r})
from without_package import assert_package_not_loaded, block_package
block_package({purelib!r}, {platlib!r})
import torch, transformers
from huggingface_hub import hf_hub_download
results = []
for job in json.loads({jobs!r}):
    model = transformers.AutoModelForCausalLM.from_pretrained(job["repo"], revision=job["revision"],
                                                              trust_remote_code=True).eval()
    tokens = model.generate(torch.tensor(job["prompt"]), max_new_tokens=12, **job["options"])
    card = open(hf_hub_download(job["repo"], "README.md", revision=job["revision"])).read()
    snippet = re.search(r"```python\\n(.*?)```", card, re.S).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet, {{}})
    results.append({{"module": type(model).__module__, "tokens": tokens[0, len(job["prompt"][0]):].tolist(),
                     "snippet_output": printed.getvalue()}})
assert_package_not_loaded()
print(json.dumps(results))
"""

PUSH = """
import json, sys
from hf_latentlm.cli import main
sys.exit(max(main(argv) for argv in json.loads(sys.argv[1])))
"""


def test_push_then_download_every_family_in_a_process_without_the_package(tmp_path, fake_hub, tokenizer):
    endpoint, hub = fake_hub
    folders, expected, jobs = {}, {}, []
    for family in FAMILIES:
        model = build_tiny(family, tokenizer).eval()
        folders[family] = save_model(model, tokenizer, tmp_path / family)
        options = generate_options(model)
        expected[family] = local_tokens(model, options)
        jobs.append({"repo": f"someone/tiny-{family}", "revision": "main", "prompt": PROMPT, "options": options})
    # Another PLM (other weights) on a branch of the PLM repository: each revision must give its own tokens.
    other = build_tiny("plm", tokenizer, seed=1).eval()
    folders["plm@dev"] = save_model(other, tokenizer, tmp_path / "plm-dev")
    expected["plm@dev"] = local_tokens(other, generate_options(other))
    assert expected["plm@dev"] != expected["plm"]
    jobs.append({"repo": "someone/tiny-plm", "revision": "dev", "prompt": PROMPT, "options": generate_options(other)})
    # Training leftovers that must never leave the machine.
    for name in LEFTOVERS:
        (folders["plm"] / name).write_bytes(b"secret")
    (folders["plm"] / "checkpoint-2").mkdir()
    (folders["plm"] / "checkpoint-2" / "model.safetensors").write_bytes(b"old")

    # One process runs `hf-latentlm push` (cli.main) for every folder: the import of torch is paid once.
    argvs = [["push", "--model", str(folders[f]), "--repo-id", f"someone/tiny-{f}"] for f in FAMILIES]
    argvs[0].append("--private")
    argvs.append(["push", "--model", str(folders["plm@dev"]), "--repo-id", "someone/tiny-plm", "--revision", "dev"])
    done = subprocess.run([sys.executable, "-c", PUSH, json.dumps(argvs)], env=hub_env(endpoint, tmp_path / "up"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("/commit/") == len(argvs) and "hf_dummy" not in done.stdout + done.stderr

    for family in FAMILIES:
        files = hub.repos[f"someone/tiny-{family}"]["main"]
        local = {p.name for p in folders[family].iterdir() if p.is_file()} - set(LEFTOVERS)
        assert set(files) == local | {"README.md"}, family  # weights, config, remote code, tokenizer, card
        assert files["model.safetensors"] == (folders[family] / "model.safetensors").read_bytes()
        config = json.loads(files["config.json"])
        if family == "ar":
            assert "auto_map" not in config and not any(n.endswith(".py") for n in files)
        else:
            assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
            assert {f"{ref.split('.')[0]}.py" for ref in config["auto_map"].values()} <= set(files)
        assert ModelCard(files["README.md"].decode()).data.tags[0] == family
    assert [r for r, v in hub.visibility.items() if v == "private"] == ["someone/tiny-ar"]  # --private for AR only
    branches = hub.repos["someone/tiny-plm"]
    assert set(branches) == {"main", "dev"}
    assert branches["dev"]["model.safetensors"] == (folders["plm@dev"] / "model.safetensors").read_bytes()
    assert 'revision="dev"' in branches["dev"]["README.md"].decode()
    assert ("POST", "/api/models/someone/tiny-plm/branch/dev") in hub.requests

    paths = sysconfig.get_paths()
    script = DOWNLOAD.format(modeling=str(MODELING_DIR), purelib=paths["purelib"], platlib=paths["platlib"],
                             jobs=json.dumps(jobs))
    env = {**hub_env(endpoint, tmp_path / "down"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-S", "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:] + str(hub.requests[-5:])
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name, result in zip([*FAMILIES, "plm@dev"], results):
        assert result["tokens"] == expected[name], name
        if name != "ar":  # transformers' own Llama needs no remote code
            assert result["module"].startswith("transformers_modules.someone"), result["module"]
        # The card's snippet ran against the Hub copy: one line per prompt (two), then the calls where it prints them.
        lines = result["snippet_output"].strip().splitlines()
        assert len(lines) == (2 if name == "ar" else 3), (name, result["snippet_output"])
    fetched = [re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", p).groups() for m, p in hub.requests
               if m == "GET" and "/resolve/" in p]
    assert {(f"someone/tiny-{f}", f"modeling_{f}.py") for f in FAMILIES[1:]} <= {(r, n) for r, _, n in fetched}
    plm_weights = {rev for r, rev, n in fetched if (r, n) == ("someone/tiny-plm", "model.safetensors")}
    assert len(plm_weights) == 2  # main's and dev's commits
    assert str(hub.requests).count("hf_dummy") == 0


# --- model cards (no network) ----------------------------------------------------------------------------------------

def eval_json(value: float, **settings) -> dict:
    """An `hf-latentlm eval` JSON as cmd_eval writes it (the fields the card reads)."""
    def entry(v):
        return {"value": v, "ci_low": v * 0.9, "ci_high": v * 1.1, "interval_contains_zero": False}
    return {"split": settings.get("split", "validation"),
            "brier": {"brier_1": entry(0.1), "brier_2": entry(value / 1e3), "brierlm_2": entry(value),
                      "num_positions": settings.get("num_positions", 2000), "context_len": 128},
            "nll": {"nll": 5.25, "perplexity": 190.57, "num_tokens": 100}, "model": settings.get("model", "runs/x")}


@pytest.fixture(scope="module")
def plm_dir(tmp_path_factory, tokenizer):
    return save_model(build_tiny("plm", tokenizer), tokenizer, tmp_path_factory.mktemp("card") / "plm")


def front_matter(card) -> dict:
    return yaml.safe_load(str(card).split("---\n")[1])


def test_card_round_trips_and_its_metadata_is_well_formed(tmp_path, plm_dir):
    (tmp_path / "ours.json").write_text(json.dumps(eval_json(4.0, model="runs/plm-small")))
    (tmp_path / "ar.json").write_text(json.dumps(eval_json(5.0, model="runs/ar-small")))
    card = build_model_card(plm_dir, "someone/tiny-plm", eval_file=tmp_path / "ours.json",
                            baseline_file=tmp_path / "ar.json", datasets=["someone/verse"])
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    assert loaded.data.to_dict() == card.data.to_dict() and loaded.text == card.text
    # card.validate() posts the card to the Hub's /api/validate-yaml (network): the metadata are checked here by
    # parsing them back into huggingface_hub's own classes (which raise on a malformed model-index) and by hand.
    data = ModelCardData(**front_matter(card), ignore_metadata_errors=False)
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.tags == ["plm", "custom_code", "hf-latentlm"] and data.license == "apache-2.0"
    assert data.datasets == ["someone/verse"] and data.base_model is None
    assert {r.metric_type: r.metric_value for r in data.eval_results} == {
        "brierlm_2": 4.0, "brier_1": 0.1, "brier_2": 0.004, "nll": 5.25, "perplexity": 190.57}
    assert all(isinstance(r, EvalResult) and r.dataset_split == "validation" for r in data.eval_results)
    (index,) = front_matter(card)["model-index"]
    assert index["name"] == "tiny-plm"
    (result,) = index["results"]
    assert result["task"] == {"type": "text-generation"} and {"name", "type"} <= set(result["dataset"])
    assert all(set(m) == {"type", "value", "name"} and isinstance(m["value"], float) for m in result["metrics"])
    # Body: the family, a snippet with its own options, results against AR with both commands, limits, citation.
    text = card.text
    assert get_family("plm").model_card.about in text and 'acceptance="exact"' in text and "auxiliary_seeds" in text
    assert "| BrierLM-2 | 4.0000 [3.6000, 4.4000] | 5.0000 [4.5000, 5.5000] | 0.80 |" in text
    assert "`hf-latentlm eval --model runs/ar-small --split validation --num-positions 2000 --context-len 128`" in text
    assert "`hf-latentlm eval --model runs/plm-small" in text
    assert "truncation of the encoder's softmax" in text and "Parallel Language Models via Variational" in text


@pytest.mark.parametrize("family", ["calm", "cola", "aurora", "ar"])
def test_each_family_gets_its_own_card(tmp_path, tokenizer, family):
    folder = save_model(build_tiny(family, tokenizer), tokenizer, tmp_path / family)
    card = build_model_card(folder, f"someone/{family}", revision="dev")
    assert card.data.tags[0] == family and card.data.eval_results is None
    assert get_family(family).model_card.generate in card.text and get_family(family).model_card.limitations in card.text
    remote = ", trust_remote_code=True" if family != "ar" else ""  # transformers' own Llama needs no remote code
    assert f'AutoModelForCausalLM.from_pretrained("someone/{family}", revision="dev"{remote})' in card.text
    assert ("custom_code" in card.data.tags) == (family != "ar")
    assert ("## Citation" in card.text) == (family != "ar")


def test_eval_results_file_in_the_folder_is_read_by_default(tmp_path, tokenizer):
    folder = save_model(build_tiny("plm", tokenizer), tokenizer, tmp_path / "plm")
    assert build_model_card(folder, "someone/x").data.eval_results is None
    assert "No evaluation was given" in build_model_card(folder, "someone/x").text
    (folder / EVAL_RESULTS_FILE).write_text(json.dumps(eval_json(3.5)))
    card = build_model_card(folder, "someone/x")
    assert card.data.eval_results[0].metric_value == 3.5 and "| BrierLM-2 | 3.5000" in card.text


def test_post_trained_folder_names_its_base_model(tmp_path, run_cli, plm_dir):
    out = tmp_path / "sft"
    code, _, err = run_cli("sft", "--model", str(plm_dir), "--output-dir", str(out), "--max-steps", "1",
                           "--batch-size", "2", "--train-size", "2", "--lora")
    assert code == 0, err
    record = json.loads((out / POST_TRAINING_RECORD).read_text())
    assert record == {"stage": "sft", "base_model": str(plm_dir), "lora": True, "task": DEFAULT_TASK}
    # The record names a local folder: the card needs its Hub name.
    code, _, err = run_cli("push", "--model", str(out), "--repo-id", "someone/plm-sft")
    assert code == 2 and "--base-model OWNER/NAME" in err and len(err.strip().splitlines()) == 1, err
    card = build_model_card(out, "someone/plm-sft", base_model="someone/tiny-plm")
    assert card.data.base_model == "someone/tiny-plm" and card.data.to_dict()["base_model_relation"] == "finetune"
    assert f"SFT with LoRA, merged on the `{record['task']}` task" in card.text
    assert front_matter(card)["base_model"] == "someone/tiny-plm"
    # A record that already names a Hub repository is used as it is.
    (out / POST_TRAINING_RECORD).write_text(json.dumps({**record, "base_model": "someone/base", "lora": False}))
    card = build_model_card(out, "someone/plm-sft")
    assert card.data.base_model == "someone/base" and "SFT on the" in card.text
    assert "base_model" not in build_model_card(plm_dir, "someone/x").data.to_dict()
    # DPO records the SFT folder it started from.
    code, _, err = run_cli("dpo", "--model", str(out), "--output-dir", str(tmp_path / "dpo"), "--max-steps", "1",
                           "--batch-size", "2", "--train-size", "2")
    assert code == 0, err
    assert json.loads((tmp_path / "dpo" / POST_TRAINING_RECORD).read_text()) == {
        "stage": "dpo", "base_model": str(out), "lora": False, "task": DEFAULT_TASK}
    card = build_model_card(tmp_path / "dpo", "someone/plm-dpo", base_model="someone/plm-sft")
    assert card.data.base_model == "someone/plm-sft" and f"DPO on the `{DEFAULT_TASK}` task" in card.text


def damage(kind):
    def make(folder, tokenizer, tmp_path):
        if kind == "empty":
            return
        if kind == "component":
            save_model(build_tiny("calm-ae", tokenizer), tokenizer, folder)
            return
        save_model(build_tiny("plm", tokenizer), tokenizer, folder)
        if kind == "no-weights":
            (folder / "model.safetensors").unlink()
        elif kind == "no-remote-code":
            (folder / "modeling_plm.py").unlink()
        elif kind == "no-tokenizer":
            (folder / "tokenizer.json").unlink()
            (folder / "tokenizer_config.json").unlink()
    return make


@pytest.mark.parametrize("make,extra,needle", [
    (damage("empty"), [], "no config.json"),
    (damage("no-weights"), [], "no weights"),
    (damage("no-remote-code"), [], "modeling_plm.py, which the folder lacks"),
    (damage("no-tokenizer"), [], "no tokenizer files"),
    (damage("component"), [], "a component, not a language model"),
    (damage("plm"), ["--repo-id", "not a valid/repo/id"], "bad --repo-id"),
    (damage("plm"), ["--repo-id", "bad..name"], "bad --repo-id"),
    (damage("plm"), ["--repo-id", "noowner"], "expected OWNER/NAME"),
    (damage("plm"), ["--eval-results", "missing.json"], "--eval-results 'missing.json' does not exist"),
    (damage("plm"), ["--eval-results", "{bad}"], "not the JSON written by `hf-latentlm eval`"),
    (damage("plm"), ["--eval-results", "{ours}", "--baseline-eval", "{other}"], "measured with other settings"),
    (damage("plm"), ["--baseline-eval", "{ours}"], "--baseline-eval needs the model's own evaluation"),
    (damage("plm"), ["--base-model", "a/b/c"], "--base-model 'a/b/c' is not a Hub repo id"),
])
def test_push_refuses_with_one_line(tmp_path, run_cli, tokenizer, make, extra, needle):
    # Refused before any network call, so in this process (no Hub endpoint needed).
    folder = tmp_path / "m"
    folder.mkdir()
    make(folder, tokenizer, tmp_path)
    files = {"bad": {"brier": {}}, "ours": eval_json(4.0), "other": eval_json(5.0, num_positions=100)}
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    extra = [str(tmp_path / f"{a[1:-1]}.json") if a.startswith("{") else a for a in extra]
    if "--repo-id" not in extra:
        extra = ["--repo-id", "someone/x", *extra]
    code, _, err = run_cli("push", "--model", str(folder), *extra)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_card_says_how_a_trained_folder_was_trained(tmp_path, run_cli):
    folder = tmp_path / "ar"
    code, _, err = run_cli("train", "--family", "ar", "--preset", "tiny", "--output-dir", str(folder), "--max-steps",
                           "2", "--no-sample")
    assert code == 0, err
    card = build_model_card(folder, "someone/ar-tiny")
    assert "`hf-latentlm train --family ar --preset tiny` for 2 steps on the Project Gutenberg" in card.text
    assert "on someone/verse" in build_model_card(folder, "someone/ar-tiny", datasets=["someone/verse"]).text


@pytest.mark.parametrize("cause", ["offline", "no token", "no network"])
def test_push_names_why_it_cannot_reach_the_hub_in_one_line(tmp_path, run_cli, tokenizer, monkeypatch, capsys,
                                                            cause):
    """Offline mode and a missing token, which huggingface_hub reports only as a network error (OfflineModeIsEnabled,
    or a ConnectError that never mentions the token), are named; so is an unreachable endpoint."""
    from huggingface_hub import constants

    folder = tmp_path / "m"
    folder.mkdir()
    damage("plm")(folder, tokenizer, tmp_path)
    capsys.readouterr()  # (saving it may have drawn a progress bar)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: never the real Hub
    monkeypatch.setattr(constants, "is_offline_mode", lambda: cause == "offline")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    if cause == "no network":
        monkeypatch.setenv("HF_TOKEN", "hf_dummy_token_for_tests")
    code, stdout, err = run_cli("push", "--model", str(folder), "--repo-id", "someone/x")
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    needle = {"offline": "offline mode is on (HF_HUB_OFFLINE=1): unset HF_HUB_OFFLINE to push",
              "no token": "needs a Hugging Face token with write access, and none is set: run `hf auth login` or set "
                          "HF_TOKEN",
              "no network": "cannot reach the Hub at http://127.0.0.1:9 to push someone/x (ConnectError"}[cause]
    assert needle in err, err
