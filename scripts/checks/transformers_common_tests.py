"""Held-out check: transformers' own common model tests (`ModelTesterMixin`) against every model class of the four
families, next to stock `LlamaModel` / `LlamaForCausalLM` under the very same harness.

Not part of the suite (it needs transformers' test files, which pip does not install, and takes minutes). The script
copies `tests/test_modeling_common.py` out of a transformers source tree into a scratch folder, writes stubs for the
two mixins it imports but this check does not run (`ExportTesterMixin`: export backends; `GenerationTesterMixin`: our
families have their own `generate`, tested by tests/family_contract.py), writes the harness
(`tests/test_latentlm_common.py`: one tiny-preset `ModelTester` and one `ModelTesterMixin` TestCase per class), runs
pytest once per class (sequentially, one CPU thread) and writes `summary.md` / `summary.json`: every test that fails
for one of our classes and for neither Llama class.

The source may be a transformers checkout, an unpacked sdist (`pip download transformers==<installed> --no-deps
--no-binary :all:` ships tests/test_modeling_common.py), the sdist .tar.gz itself, or a bare git mirror (then
`--rev`, default: the tag of the installed transformers version, else HEAD). The test file must match the installed
transformers version. Extra packages the copied file needs: `parameterized` (and `pytest-timeout` for --timeout);
install them in the venv, or `pip install --target DIR parameterized pytest-timeout` and pass `--pythonpath DIR`.

Exact command (all 13 classes, ~2,100 tests: 5 to 7 minutes on 2 shared CPU cores; the sdist fetched with the pip
command above into /tmp/tfsd, `parameterized` and `pytest-timeout` installed with --target /work/tf_common/deps):

    .venv/bin/python scripts/checks/transformers_common_tests.py /tmp/tfsd/transformers-5.24.0.tar.gz \
        --out /work/tf_common --pythonpath /work/tf_common/deps --timeout 300

Harness choices (the same for Llama and ours): tiny-preset configs built by each family's builder with a 99-token
vocabulary (bos = eos = 0, pad = 1), rebuilt from their dict so that they carry no attention implementation; inputs
[3, 8] with an all-ones attention mask; our classes added to transformers' Auto mapping names as
hf_latentlm.modeling registers them (backbones and components: AutoModel; language models: AutoModelForCausalLM);
CALM's chunk layouts declared as transformers' testers declare theirs (`encoder_seq_length`,
`expected_num_hidden_layers`); no generate tests (`all_generative_model_classes = ()`).

`--classes PLMModel,LlamaModel` runs a subset; `--summarize-only` rebuilds the summary from the junit files in --out;
arguments after `--` go to pytest (e.g. `-- -k test_save_load`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: class name -> (family, role). role: "lm" (the family's causal LM), "base" (its backbone), "component".
CLASSES = {
    "LlamaModel": ("ar", "base"), "LlamaForCausalLM": ("ar", "lm"),
    "PLMModel": ("plm", "base"), "PLMForCausalLM": ("plm", "lm"),
    "CALMAutoencoder": ("calm-ae", "component"), "CALMModel": ("calm", "base"), "CALMForCausalLM": ("calm", "lm"),
    "ColaTextVAE": ("cola-vae", "component"), "ColaModel": ("cola", "base"), "ColaForCausalLM": ("cola", "lm"),
    "AuroraAutoencoder": ("aurora-ae", "component"), "AuroraModel": ("aurora", "base"),
    "AuroraForCausalLM": ("aurora", "lm"),
}
REFERENCE = ("LlamaModel", "LlamaForCausalLM")

HARNESS = r'''"""transformers' ModelTesterMixin against hf_latentlm's classes and stock Llama (written by
scripts/checks/transformers_common_tests.py; edit it there)."""

import copy
import functools
import unittest

import torch

from transformers import LlamaForCausalLM, LlamaModel
from transformers.models.auto import modeling_auto

import hf_latentlm.modeling as latent
from hf_latentlm.families import build_fresh_model, get_family
from hf_latentlm.modeling.modeling_aurora import AuroraModel
from hf_latentlm.modeling.modeling_calm import CALMModel
from hf_latentlm.modeling.modeling_cola import ColaModel
from hf_latentlm.modeling.modeling_plm import PLMModel

from .test_modeling_common import ModelTesterMixin, ids_tensor

CLASSES = __CLASSES__
MODEL_CLASSES = {"LlamaModel": LlamaModel, "LlamaForCausalLM": LlamaForCausalLM, "PLMModel": PLMModel,
                 "CALMModel": CALMModel, "ColaModel": ColaModel, "AuroraModel": AuroraModel,
                 **{name: getattr(latent, name) for name in ("PLMForCausalLM", "CALMAutoencoder", "CALMForCausalLM",
                                                             "ColaTextVAE", "ColaForCausalLM", "AuroraAutoencoder",
                                                             "AuroraForCausalLM")}}
BATCH_SIZE, SEQ_LENGTH = 3, 8  # 8: a multiple of every tiny block / chunk size (4)


class TinyTokenizer:
    """What the family builders read from a tokenizer: its length and special ids (as the default tokenizer's:
    bos = eos = 0, pad = 1), with a 99-token vocabulary as transformers' own testers use."""

    bos_token_id, eos_token_id, pad_token_id = 0, 0, 1

    def __len__(self):
        return 99


@functools.lru_cache(maxsize=None)
def tiny_model(family):
    """The tiny-preset model of `family`, built around tiny models of its components (tests/family_contract.py's
    build_tiny without its re-initialisation of zero output layers)."""
    return build_fresh_model(family, "tiny", TinyTokenizer())


def tiny_config(family):
    """A fresh copy of the tiny model's config: rebuilt from its dict, so that it carries no attention implementation
    (a model's __init__ sets one), as a tester's config built from scratch."""
    config = tiny_model(family).config
    return type(config).from_dict(copy.deepcopy(config.to_dict()))


# `_prepare_for_class` adds labels, and test_training skips base models, by looking class names up in transformers'
# Auto mapping names; our classes are registered with the Auto classes at run time only, so they are added here the
# way hf_latentlm.modeling registers them (AutoModel: backbone or component, AutoModelForCausalLM: language model).
for _name, (_family, _role) in CLASSES.items():
    _type = get_family(_family).model_type
    if _type is None:
        continue  # Llama: already in the tables
    if _role in ("base", "component"):
        modeling_auto.MODEL_MAPPING_NAMES[_type] = _name
    else:
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[_type] = _name


class TinyModelTester:
    def __init__(self, parent, family, batch_size=BATCH_SIZE, seq_length=SEQ_LENGTH):
        self.parent, self.family = parent, family
        config = tiny_config(family)
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, True
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.num_hidden_layers = getattr(config, "num_hidden_layers", None)
        if self.num_hidden_layers is None:
            self.num_hidden_layers = getattr(config, "num_encoder_layers", 1)
        self.num_attention_heads = getattr(config, "num_attention_heads", None)

    def get_config(self):
        return tiny_config(self.family)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def calm_layout(name, tester):
    """CALM's documented layouts, declared the way transformers' own testers declare theirs (`encoder_seq_length`,
    `expected_num_hidden_layers`): its backbone runs over T / K chunk steps; its autoencoder's hidden states are the
    embeddings [B, T/K, K, h] and then every residual block's output, encoder then decoder."""
    config = tiny_config(tester.family)
    if name == "CALMAutoencoder":
        from hf_latentlm.modeling.modeling_calm import ResidualMLP

        blocks = sum(isinstance(m, ResidualMLP) for m in tiny_model(tester.family).modules())
        tester.expected_num_hidden_layers, tester.encoder_seq_length = blocks + 1, config.chunk_size
    elif name in ("CALMModel", "CALMForCausalLM"):
        tester.encoder_seq_length = tester.seq_length // config.chunk_size


def _set_up(self):
    self.model_tester = TinyModelTester(self, self.family)
    calm_layout(self.all_model_classes[0].__name__, self.model_tester)


for _name, (_family, _role) in CLASSES.items():
    _model_class = MODEL_CLASSES[_name]
    globals()[f"{_name}Test"] = type(f"{_name}Test", (ModelTesterMixin, unittest.TestCase), {
        "__module__": __name__, "family": _family, "all_model_classes": (_model_class,),
        # no generate tests (GenerationTesterMixin is not run), for Llama as for ours
        "all_generative_model_classes": (),
        # run the `_init_weights` coverage check, which transformers skips for configuration files without a
        # "# Copyright <year>" header dated 2023 or later (ours have none; Llama's says 2022)
        "test_can_init_all_missing_weights_before_2023": True,
        # a component without attention layers at all (CALM's MLP autoencoder), as its own tester would say
        "has_attentions": _name != "CALMAutoencoder",
        "setUp": _set_up,
    })
'''

STUBS = {
    "tests/__init__.py": "",
    "tests/exporters/__init__.py": "",
    "tests/exporters/test_export.py": '"""Stub: the export backends are not part of this check."""\n\n\n'
                                      "class ExportTesterMixin:\n    pass\n",
    "tests/generation/__init__.py": "",
    "tests/generation/test_utils.py": '"""Stub: generate() tests are not part of this check."""\n\n\n'
                                      "class GenerationTesterMixin:\n    pass\n",
    "pytest.ini": "[pytest]\naddopts = -p no:cacheprovider\n"
                  "filterwarnings =\n    ignore::pytest.PytestUnknownMarkWarning\n",
}
NEEDED = ("tests/test_modeling_common.py",)


def installed_transformers_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("transformers")


def read_sources(source: Path, rev: str | None) -> dict[str, str]:
    """The needed test files from a checkout / unpacked sdist, an sdist tarball or a bare git mirror."""
    if source.is_file() and source.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(source) as archive:
            members = {m.name.split("/", 1)[1]: m for m in archive.getmembers() if "/" in m.name}
            return {path: archive.extractfile(members[path]).read().decode() for path in NEEDED}
    if (source / "tests").is_dir():
        return {path: (source / path).read_text() for path in NEEDED}
    git = ["git", f"--git-dir={source}"]
    if rev is None:
        tag = f"v{installed_transformers_version()}"
        known = subprocess.run(git + ["rev-parse", "--verify", "--quiet", tag], capture_output=True, text=True)
        rev = tag if known.returncode == 0 else "HEAD"
        print(f"revision: {rev}", file=sys.stderr)
    return {path: subprocess.run(git + ["show", f"{rev}:{path}"], check=True, capture_output=True,
                                 text=True).stdout for path in NEEDED}


def write_harness(out: Path, sources: dict[str, str]) -> None:
    for path, text in {**STUBS, **sources}.items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
    (out / "tests/test_latentlm_common.py").write_text(HARNESS.replace("__CLASSES__", repr(CLASSES)))


def code_state() -> str:
    """The commit of this checkout, the installed transformers and torch, and whether hf_latentlm/ has uncommitted
    changes (the run tests the working tree)."""
    import torch
    import transformers

    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "hf_latentlm")
    return (f"hf_latentlm at {git('rev-parse', '--short', 'HEAD') or '?'}"
            f"{' + uncommitted changes in hf_latentlm/' if dirty else ''}, transformers {transformers.__version__}, "
            f"torch {torch.__version__}, started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")


def run_class(out: Path, name: str, pythonpath: list[str], timeout: int, extra: list[str]) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([*pythonpath, str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", f"tests/test_latentlm_common.py::{name}Test", "-q", "-rN",
           f"--junitxml=junit/{name}.xml", "-o", "junit_family=xunit1"]
    has_timeout = subprocess.run([sys.executable, "-c", "import pytest_timeout"], env=env,
                                 capture_output=True).returncode == 0
    if timeout and has_timeout:  # the plugin loads itself through its entry point
        cmd += [f"--timeout={timeout}"]
    start = time.time()
    done = subprocess.run(cmd + extra, cwd=out, env=env, capture_output=True, text=True)
    (out / "junit" / f"{name}.log").write_text(done.stdout + done.stderr)
    tail = ((done.stdout + done.stderr).strip().splitlines() or ["(no output)"])[-1]
    print(f"{name}: {tail} [{time.time() - start:.0f} s]", flush=True)
    return time.time() - start


def gist(element) -> str:
    # the traceback's "E" lines hold the whole message (junit's `message` attribute is cut at its first line)
    error_lines = [line[1:].strip() for line in (element.text or "").splitlines() if line.startswith("E ")]
    message = " ".join(error_lines) if error_lines else (element.get("message") or element.text or "")
    return " ".join(message.split())[:400]


def outcomes(out: Path, name: str) -> dict[str, tuple[str, str]]:
    """test name -> (outcome, one-line message) from the class's junit file."""
    path = out / "junit" / f"{name}.xml"
    if not path.exists():
        return {}
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome, message = kind, gist(element)
                break
        result[case.get("name")] = (outcome, message)
    return result


def summarize(out: Path, names: list[str]) -> dict:
    results = {name: outcomes(out, name) for name in names}
    failing = lambda name: {t for t, (o, _) in results.get(name, {}).items() if o in ("failure", "error")}
    reference = set().union(*(failing(name) for name in REFERENCE if name in results))
    summary = {"reference_failures": sorted(reference), "classes": {}}
    stamp = (out / "junit" / "code_state.txt").read_text().strip() if (out / "junit" / "code_state.txt").exists() else "?"
    lines = ["# transformers common tests: failures beyond stock Llama's", "", f"Code tested: {stamp}", "",
             f"Llama (reference) failures: {', '.join(sorted(reference)) or 'none'}", "",
             "| class | passed | failed | skipped | failing beyond Llama |", "|---|---|---|---|---|"]
    for name in names:
        counts = {k: sum(o == k for o, _ in results[name].values()) for k in ("passed", "failure", "error", "skipped")}
        # parameterized variants of one test (test_x_00_fp16..., test_x_01_...) that all fail: one entry
        groups = {}
        for test in sorted(failing(name) - reference):
            groups.setdefault(re.sub(r"_\d+(_\w*)?$", "", test), []).append(test)
        beyond = {}
        for base, tests in groups.items():
            if len(tests) == 1:
                beyond[tests[0]] = results[name][tests[0]][1]
            else:
                messages = sorted({results[name][t][1] for t in tests})
                beyond[f"{base}_*"] = f"[{len(tests)} variants] " + " | ".join(messages)
        # skipped here though a Llama class runs (and passes) it: coverage the comparison does not have
        counterpart = "LlamaForCausalLM" if CLASSES[name][1] == "lm" else "LlamaModel"
        llama_ran = {t for t, (o, _) in results.get(counterpart, {}).items() if o == "passed"}
        skipped = {t: m for t, (o, m) in results[name].items() if o == "skipped" and t in llama_ran}
        summary["classes"][name] = {"counts": counts, "beyond_reference": beyond, "skipped_where_llama_runs": skipped}
        lines.append(f"| {name} | {counts['passed']} | {counts['failure'] + counts['error']} | {counts['skipped']} | "
                     f"{len(failing(name) - reference) if name not in REFERENCE else '-'} |")
    for name in names:
        if name in REFERENCE or not summary["classes"][name]["beyond_reference"]:
            continue
        lines += ["", f"## {name}", ""]
        lines += [f"- `{t}`: {m}" for t, m in summary["classes"][name]["beyond_reference"].items()]
    lines += ["", "## Skipped for a class although its Llama counterpart (LlamaForCausalLM for a language model, "
              "LlamaModel otherwise) runs and passes them", ""]
    for name in names:
        if name not in REFERENCE and summary["classes"][name]["skipped_where_llama_runs"]:
            lines.append(f"- {name}: " + "; ".join(f"`{t}` ({m})" for t, m in
                                                     sorted(summary["classes"][name]["skipped_where_llama_runs"].items())))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, nargs="?", help="transformers checkout, sdist (.tar.gz or unpacked) "
                                                            "or bare git mirror")
    parser.add_argument("--rev", help="revision of a bare git mirror (default: v<installed version>, else HEAD)")
    parser.add_argument("--out", type=Path, help="scratch folder, kept (default: a temporary one, removed)")
    parser.add_argument("--classes", help="comma-separated subset of: " + ", ".join(CLASSES))
    parser.add_argument("--pythonpath", action="append", default=[], help="extra import folder (parameterized)")
    parser.add_argument("--timeout", type=int, default=600, help="per-test seconds (pytest-timeout); 0: none")
    parser.add_argument("--write-only", action="store_true", help="write the harness, run nothing")
    parser.add_argument("--summarize-only", action="store_true", help="summarize the junit files in --out")
    args = parser.parse_args(argv)
    names = args.classes.split(",") if args.classes else list(CLASSES)
    unknown = set(names) - set(CLASSES)
    if unknown:
        parser.error(f"unknown classes {sorted(unknown)}")
    if args.summarize_only:
        if args.out is None:
            parser.error("--summarize-only needs --out")
        print((args.out / "summary.md").read_text() if summarize(args.out, names) else "")
        return 0
    if args.source is None:
        parser.error("the transformers source is required")
    scratch = None if args.out else tempfile.TemporaryDirectory(prefix="tf_common_")
    out = args.out or Path(scratch.name)
    out.mkdir(parents=True, exist_ok=True)
    (out / "junit").mkdir(exist_ok=True)
    write_harness(out, read_sources(args.source.resolve(), args.rev))
    print(f"harness: {out / 'tests/test_latentlm_common.py'}", file=sys.stderr)
    if args.write_only:
        return 0
    start = time.time()
    (out / "junit" / "code_state.txt").write_text(code_state())
    for name in names:
        run_class(out, name, args.pythonpath, args.timeout, extra)
    summarize(out, names)
    print((out / "summary.md").read_text())
    kept = f"junit files and logs in {out / 'junit'}" if scratch is None else "scratch folder removed (--out keeps it)"
    print(f"total: {time.time() - start:.0f} s; {kept}", file=sys.stderr)
    if scratch is not None:
        scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
