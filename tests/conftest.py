import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two test workers share the two cores: one torch thread each instead of two each fighting for them.
    torch.set_num_threads(1)

from hf_latentlm.training.corpus import load_corpus_documents, load_default_tokenizer
from hf_latentlm.training.data import token_stream


@pytest.fixture(scope="session")
def tokenizer():
    return load_default_tokenizer()


@pytest.fixture(scope="session")
def validation_stream(tokenizer) -> torch.Tensor:
    """The embedded validation split as one id stream (~135k tokens)."""
    return token_stream(load_corpus_documents("validation"), tokenizer)


@pytest.fixture(scope="session")
def tiny_rows(validation_stream) -> torch.Tensor:
    """[N, 64] packed rows for fast training tests (tiny preset's seq_len)."""
    n = validation_stream.numel() // 64
    return validation_stream[: n * 64].view(n, 64)


class RecordingStreamer:
    """A `generate(streamer=...)` target that keeps every `put` as a list of ids and notes `end`."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def left_pad_prompts(prompts, pad_id):
    """Left-pad 1-D id tensors into (ids [B, T], attention_mask [B, T])."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel():] = p
        mask[b, width - p.numel():] = 1
    return ids, mask


@pytest.fixture
def run_cli(capsys):
    """`run_cli(*argv) -> (exit status, stdout, stderr)` of `hf-latentlm`, in this process."""
    from hf_latentlm.cli import main

    def run(*argv):
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


@pytest.fixture
def streamer():
    return RecordingStreamer()


@pytest.fixture(scope="session")
def left_pad():
    return left_pad_prompts


ISOLATED_LOADER = Path(__file__).parent / "modeling" / "isolated_load.py"


def generate_without_the_package(checkpoint, auto_class: str, prompt: list, max_new_tokens: int, options: dict,
                                 home) -> dict:
    """Load `checkpoint` through `transformers.<auto_class>` with `trust_remote_code=True` in a `python -S`
    process where `hf_latentlm` cannot be imported, generate, and return {"module", "tokens"}."""
    paths = sysconfig.get_paths()
    # This process's thread count: a matmul split over another number of threads can round differently.
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run([sys.executable, "-S", str(ISOLATED_LOADER), paths["purelib"], paths["platlib"],
                           str(checkpoint), auto_class, json.dumps(prompt), str(max_new_tokens), json.dumps(options)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["module"].startswith("transformers_modules"), "must run the checkpoint's own code"
    return result


@pytest.fixture(scope="session")
def isolated_generate():
    return generate_without_the_package

