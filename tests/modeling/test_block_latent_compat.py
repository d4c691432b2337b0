"""Checkpoints saved before Cola DLM and AURORA-LM moved onto the block-latent base (and CALM's and PLM's configs
onto the shared sub-config helper) still load: a tiny seeded model of each family is saved by the package as it was
at `PREVIOUS_COMMIT` (its code taken from git history and run in a subprocess), then loaded by the current code,
which must see the same weights and compute the same outputs (forward, seeded generate() with its network calls, a
seeded training loss). The models and outputs come from `previous_layout.py`, run by both layouts."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import previous_layout
import pytest
import torch
from safetensors.torch import load_file

from hf_latentlm.modeling import AuroraForCausalLM, CALMForCausalLM, ColaForCausalLM, PLMForCausalLM

# The last commit before the block-latent base (issue 27).
PREVIOUS_COMMIT = "9549185"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL_CLASSES = {"cola": ColaForCausalLM, "aurora": AuroraForCausalLM, "calm": CALMForCausalLM, "plm": PLMForCausalLM}


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True)


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    """The folder of the checkpoints (and outputs) saved by the previous layout, one subfolder per family."""
    if shutil.which("git") is None:
        pytest.skip("git is not available, so the previous layout's code cannot be taken from history")
    if git("cat-file", "-e", f"{PREVIOUS_COMMIT}^{{commit}}").returncode:
        pytest.skip(f"commit {PREVIOUS_COMMIT} is not in this clone's history (a shallow clone?)")
    work = tmp_path_factory.mktemp("previous_layout")
    archive = git("archive", "--format=tar", PREVIOUS_COMMIT, "hf_latentlm")
    assert archive.returncode == 0, archive.stderr.decode()
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(work / "code", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    # The old copy first on the path: it shadows the installed package (the script checks which one it imported).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "code"), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(HERE / "previous_layout.py"), str(work / "saved"),
                          str(work / "code" / "hf_latentlm")], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return work / "saved"


@pytest.mark.parametrize("family", previous_layout.FAMILIES)
def test_a_checkpoint_of_the_previous_layout_loads_with_the_same_weights_and_outputs(previous, family):
    folder = previous / family
    model = MODEL_CLASSES[family].from_pretrained(folder)
    assert type(model).__module__.startswith("hf_latentlm.modeling.")  # the current code, not the copied files
    saved = load_file(folder / "model.safetensors")
    state = model.state_dict()
    assert set(state) == set(saved)
    assert not [name for name, value in saved.items() if not torch.equal(state[name], value)]
    expected = torch.load(folder / "outputs.pt")
    current = previous_layout.outputs(model)
    assert set(current) == set(expected)
    for name, value in expected.items():
        assert torch.equal(current[name], value), (family, name)


@pytest.mark.parametrize("family", previous_layout.FAMILIES)
def test_the_current_code_builds_the_weights_the_previous_layout_built(previous, family):
    saved = load_file(previous / family / "model.safetensors")
    built = previous_layout.build(family).state_dict()
    assert set(built) == set(saved)
    assert not [name for name, value in saved.items() if not torch.equal(built[name], value)]
