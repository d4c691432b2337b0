"""Data made or shipped offline: the embedded corpus file and a generated language with an exact likelihood.

* ``shakespeare.jsonl.xz`` and ``tokenizer/``: the embedded corpus and its BPE (read by ``hf_latentlm.training.corpus``;
  rebuilt by ``scripts/build_corpus.py``).
* ``generated.py``: a seeded hidden Markov language whose next-token distribution is known at every position
  (``docs/generated_language.md``).

Nothing here imports torch or the rest of the package.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
CORPUS_FILE = DATA_DIR / "shakespeare.jsonl.xz"
TOKENIZER_DIR = DATA_DIR / "tokenizer"


def read_corpus_records() -> list[dict[str, str]]:
    """All works of the embedded corpus as ``{"name", "split", "text"}`` dicts, in file order."""
    lines = lzma.decompress(CORPUS_FILE.read_bytes()).decode("utf-8").splitlines()
    return [json.loads(line) for line in lines if line]
