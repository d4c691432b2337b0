"""Offline default corpus and tokenizer shipped inside the package.

The corpus is the Project Gutenberg Shakespeare (37 plays and 5 poems, public domain), cleaned and split by whole
work: ``validation`` hamlet, tempest, twelfth_night; ``test`` macbeth, much_ado_about_nothing; ``train`` the rest.
The default tokenizer is a byte-level BPE (vocab 4096; ``<|endoftext|>`` = id 0 is bos/eos, ``<|pad|>`` = id 1)
trained on the train split. Both live in ``hf_latentlm/data/`` and are rebuilt by ``scripts/build_corpus.py``
(``docs/corpus.md``). Nothing here touches the network.
"""

from __future__ import annotations

import json

from pathlib import Path

from ..data import TOKENIZER_DIR, read_corpus_records

CORPUS_SPLITS = ("train", "validation", "test")


def load_corpus_records() -> list[dict[str, str]]:
    """All works of the packaged corpus as ``{"name", "split", "text"}`` dicts, in file order."""
    return read_corpus_records()


def load_corpus_documents(split: str) -> list[str]:
    """One string per work of ``split`` ("train", "validation" or "test"), in file order."""
    if split not in CORPUS_SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; expected one of {CORPUS_SPLITS}")
    return [r["text"] for r in read_corpus_records() if r["split"] == split]


def default_tokenizer_path() -> str:
    """Folder of the packaged default tokenizer (loadable with ``AutoTokenizer``)."""
    return str(TOKENIZER_DIR)


def load_default_tokenizer():
    """The packaged byte-level BPE tokenizer, loaded offline with ``AutoTokenizer``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_tokenizer_path())


def load_text_documents(paths: list[str]) -> list[str]:
    """Users' own UTF-8 text files, one document per file, in the given order: a leading byte-order mark is dropped
    and line endings become ``\\n``; ValueError for a path that is not a readable, non-blank UTF-8 file. A JSON-lines
    file (`.jsonl`, or `.json` whose every line is an object) gives one document per line, its "text" field: the
    format of datasets' `to_json` and of the official CALM evaluation set."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    documents = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            what = "is not a file" if p.exists() else "does not exist"
            raise ValueError(f"text file {str(path)!r} {what}")
        try:
            text = p.read_text(encoding="utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"text file {str(path)!r} cannot be read as UTF-8 text ({err})") from err
        if not text.strip():
            raise ValueError(f"text file {str(path)!r} is empty")
        records = json_lines(text) if p.suffix in (".json", ".jsonl") else None
        if records is None:
            documents.append(text)
            continue
        for number, record in enumerate(records, 1):
            if not isinstance(record.get("text"), str):
                raise ValueError(f"JSON-lines file {str(path)!r}: line {number} has no string \"text\" field")
            documents.append(record["text"])
    return documents


def json_lines(text: str) -> list[dict] | None:
    """The objects of a JSON-lines text, or None when it is not one (a plain text, a single JSON document)."""
    try:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        return None
    return records if records and all(isinstance(record, dict) for record in records) else None
