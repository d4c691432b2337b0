"""The converted official checkpoints that the tool tests (lm-eval, serving, push, pipeline, sft) run next to the
registry's families: official-format fixtures written by the official code, converted by `hf-latentlm convert`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import hf_latentlm
from hf_latentlm.official.convert import convert_calm, convert_cola

FIXTURES = Path(__file__).parent / "fixtures" / "official"
PARITY_SCRIPT = Path(__file__).parents[1] / "scripts" / "checks" / "official_parity.py"
PACKAGE_TOKENIZER = Path(hf_latentlm.__file__).parent / "data" / "tokenizer"
#: The names converted models go by next to the families: the vocab-4096 fixtures, with the package's tokenizer.
CONVERTED_CALM, CONVERTED_COLA = "calm-official", "cola-official"
CONVERTED = (CONVERTED_CALM, CONVERTED_COLA)


def convert_calm_fixture(folder: Path, fixture: str = "calm_tools") -> Path:
    """The official-format CALM `fixture` converted into `folder`, with the package's tokenizer."""
    convert_calm(str(FIXTURES / fixture / "calm"), str(folder), tokenizer=str(PACKAGE_TOKENIZER))
    return folder


def convert_cola_fixture(folder: Path, fixture: str = "cola_tools") -> Path:
    """The official-format Cola DLM `fixture` converted into `folder`, with the package's tokenizer."""
    convert_cola(str(FIXTURES / fixture / "cola_vae"), str(FIXTURES / fixture / "cola_dit"), str(folder),
                 tokenizer=str(PACKAGE_TOKENIZER))
    return folder


def convert_fixture(name: str, folder: Path) -> Path:
    """The converted model `name` (one of CONVERTED) written into `folder`."""
    return {CONVERTED_CALM: convert_calm_fixture, CONVERTED_COLA: convert_cola_fixture}[name](folder)


#: Torch threads of the parity runs (the fixtures' bf16 parity is verified with as many: results/official_checkpoints).
PARITY_THREADS = 1


def run_parity(family: str, model_dir: Path, reference: Path) -> tuple[int, dict[str, float], str]:
    """scripts/checks/official_parity.py on a converted folder, with PARITY_THREADS torch threads: (exit status,
    {quantity: max_abs_diff}, stderr)."""
    done = subprocess.run([sys.executable, str(PARITY_SCRIPT), "--family", family, "--model", str(model_dir),
                           "--reference", str(reference)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": str(PARITY_THREADS)})
    diffs = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+) max_abs_diff=(\S+)$", done.stdout, re.M)}
    return done.returncode, diffs, done.stderr
