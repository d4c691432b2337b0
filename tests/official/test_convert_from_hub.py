"""`hf-latentlm convert` given Hub ids: the official folders are downloaded through huggingface_hub from the loopback
Hub (tests/fake_hub.py), in a process with the Hub's environment (and a timeout), and convert to the same weights
as the local folders."""

import subprocess
import sys
from pathlib import Path

import torch
from fake_hub import fake_hub, hub_env  # noqa: F401  (fake_hub is a fixture)
from safetensors.torch import load_file

from hf_latentlm.official.convert import convert_calm, convert_cola

FIXTURES = Path(__file__).parents[1] / "fixtures" / "official"


def upload(hub, repo: str, folder: Path) -> None:
    """Store a folder's files in the loopback Hub as the main branch of `repo`."""
    hub.repos[repo] = {"main": {p.relative_to(folder).as_posix(): p.read_bytes()
                                for p in folder.rglob("*") if p.is_file()}}


def convert(endpoint, home: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_latentlm.cli", "convert", *argv], capture_output=True,
                          text=True, timeout=300, env=hub_env(endpoint, home))


def assert_same_weights(a: Path, b: Path) -> None:
    ours, theirs = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_calm_and_cola_convert_from_hub_ids(fake_hub, tmp_path):
    endpoint, hub = fake_hub
    upload(hub, "authors/calm-tiny", FIXTURES / "calm" / "calm")
    upload(hub, "authors/calm-tiny-ae", FIXTURES / "calm" / "autoencoder")
    upload(hub, "authors/cola-tiny-vae", FIXTURES / "cola" / "cola_vae")
    upload(hub, "authors/cola-tiny-dit", FIXTURES / "cola" / "cola_dit")
    calm = FIXTURES / "calm"
    cola = FIXTURES / "cola"
    runs = {
        "calm": (["calm", "--model", "authors/calm-tiny", "--autoencoder", "authors/calm-tiny-ae"],
                 lambda out: convert_calm(str(calm / "calm"), out, autoencoder=str(calm / "autoencoder"))),
        "cola": (["cola", "--vae", "authors/cola-tiny-vae", "--dit", "authors/cola-tiny-dit"],
                 lambda out: convert_cola(str(cola / "cola_vae"), str(cola / "cola_dit"), out)),
    }
    for name, (hub_args, convert_local) in runs.items():
        from_hub = convert(endpoint, tmp_path / "home", *hub_args, "--output-dir", str(tmp_path / f"{name}_hub"))
        assert from_hub.returncode == 0, from_hub.stderr
        convert_local(str(tmp_path / f"{name}_local"))
        assert_same_weights(tmp_path / f"{name}_hub", tmp_path / f"{name}_local")
    requested = " ".join(str(r) for r in hub.requests)
    assert "authors/calm-tiny-ae" in requested and "authors/cola-tiny-dit" in requested


def test_a_hub_id_that_is_not_there_is_named(fake_hub, tmp_path):
    endpoint, _ = fake_hub
    done = convert(endpoint, tmp_path / "home", "cola", "--vae", "authors/no-such-vae", "--dit", "authors/no-dit",
                   "--output-dir", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "could not fetch --vae authors/no-such-vae from the Hub" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
