"""`train --dataset`: a corpus streamed from disk (datasets' save_to_disk folder, text files), packed on the fly into
rows, never read whole, resumed exactly."""

import json

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset

from hf_latentlm.cli import main
from hf_latentlm.families import build_model
from hf_latentlm.training import data
from hf_latentlm.training.corpus import load_corpus_documents, load_text_documents
from hf_latentlm.training.data import (
    StreamingRows,
    dataset_documents,
    documents_to_dataset,
    pack_dataset,
)
from hf_latentlm.training.loop import TrainConfig, train


@pytest.fixture(scope="module")
def documents():
    """Short documents of varied length (a few dozen to a few hundred tokens) cut from the embedded corpus."""
    text = load_corpus_documents("validation")[0]
    return [text[i:i + 50 + (i * 7) % 700] for i in range(0, 60000, 1000)]


def packed(documents, tokenizer, seq_len) -> torch.Tensor:
    """The reference: `pack_dataset`'s rows of `documents`, [N, seq_len]."""
    return pack_dataset(documents_to_dataset(documents), tokenizer, seq_len)["input_ids"][:]


def test_rows_are_those_pack_dataset_makes(tokenizer, documents):
    """One epoch of the stream is exactly `pack_dataset`'s rows (documents joined by end-of-document, cut in
    seq_len); then the next epoch starts over."""
    reference = packed(documents, tokenizer, 32)
    stream = StreamingRows(dataset_documents(Dataset.from_dict({"text": documents})), tokenizer, 32)
    assert torch.equal(stream.take(len(reference)), reference)
    assert stream.epoch == 0
    assert torch.equal(stream.take(3), reference[:3]) and stream.epoch == 1
    assert torch.equal(stream.head(5), reference[:5])


def test_ranks_read_every_world_th_document(tokenizer, documents):
    ranks = [StreamingRows(lambda: iter(documents), tokenizer, 32, rank, 2) for rank in range(2)]
    for rank, stream in enumerate(ranks):
        mine = packed(documents[rank::2], tokenizer, 32)
        assert torch.equal(stream.take(len(mine)), mine)
        assert torch.equal(stream.head(2), ranks[0].head(2))  # the corpus's first rows, whatever the rank


def test_a_resumed_stream_reads_the_rows_the_uninterrupted_one_reads(tokenizer, documents):
    """Cut after every count of rows up to past an epoch (rows ending mid-document, at a document's end, at the
    corpus's end): a fresh stream given the saved position reads on exactly as the uninterrupted one."""
    source = dataset_documents(Dataset.from_dict({"text": documents}))
    straight = StreamingRows(source, tokenizer, 16).take(400)
    epoch_rows = len(packed(documents, tokenizer, 16))
    assert epoch_rows < 390
    for cut in list(range(40)) + [epoch_rows - 1, epoch_rows, epoch_rows + 1]:
        first = StreamingRows(source, tokenizer, 16)
        first.take(cut)
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
        resumed = StreamingRows(source, tokenizer, 16)
        resumed.load_state_dict(state)
        assert torch.equal(resumed.take(10), straight[cut:cut + 10]), f"cut after {cut} rows"


def test_a_large_corpus_is_never_read_whole(tmp_path, tokenizer, documents):
    """Training 3 steps on a 100,000-document IterableDataset (no len(), no indexing) reads only the documents
    those steps need."""
    read = []

    def generate():
        for i in range(100_000):
            read.append(i)
            yield {"text": documents[i % len(documents)]}

    corpus = IterableDataset.from_generator(generate)
    stream = StreamingRows(dataset_documents(corpus), tokenizer, 64)
    cfg = TrainConfig(family="ar", preset="tiny", output_dir=str(tmp_path), max_steps=3, batch_size=4, seq_len=64,
                      eval_every=0, save_every=3, progress_bar=False)
    torch.manual_seed(0)
    metrics = train(cfg, model=build_model("ar", "tiny", tokenizer), tokenizer=tokenizer, train_rows=stream)
    assert metrics["step"] == 3
    # 12 rows of 64 tokens: a few dozen short documents (each read once more by the up-front check, head(1)).
    assert 0 < len(read) < 200
    with pytest.raises(TypeError):
        len(corpus)


def record_batches(model):
    """The input_ids of every training forward of `model`, in order."""
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].clone())
                                    if module.training else None, with_kwargs=True)
    return seen


def test_train_dataset_resumes_with_the_same_batches(tmp_path, tokenizer, documents):
    """A save_to_disk DatasetDict: train straight for 6 steps, or stop after 3 and resume; the resumed run trains on
    exactly the batches of the straight one and ends with the same weights. Validation comes from its split."""
    folder = tmp_path / "corpus"
    DatasetDict({"train": Dataset.from_dict({"text": documents}),
                 "validation": Dataset.from_dict({"text": documents[:5]})}).save_to_disk(folder)

    def run(out, **kw):
        cfg = TrainConfig(family="plm", preset="tiny", output_dir=str(tmp_path / out), max_steps=6, batch_size=4,
                          seq_len=64, eval_every=3, eval_batches=1, save_every=3, progress_bar=False, seed=1,
                          dataset=str(folder), **kw)
        torch.manual_seed(1)
        model = build_model("plm", "tiny", tokenizer)
        batches = record_batches(model)
        return model, batches, train(cfg, model=model, tokenizer=tokenizer)

    straight_model, straight_batches, straight = run("a")
    _, first_batches, _ = run("b", stop_at_step=3)
    resumed_model, resumed_batches, resumed = run("b", resume=True)
    assert len(straight_batches) == 6
    assert all(torch.equal(a, b) for a, b in zip(straight_batches, first_batches + resumed_batches))
    assert len(first_batches + resumed_batches) == 6
    assert not torch.equal(straight_batches[0], straight_batches[3])
    for (name, a), (_, b) in zip(straight_model.state_dict().items(), resumed_model.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], abs=1e-5)
    epoch = packed(documents, tokenizer, 64)
    assert len(epoch) == 18  # 24 rows: the run goes on into a second epoch, over the same rows in the same order
    assert torch.equal(torch.cat(straight_batches), torch.cat([epoch, epoch])[:24])


def test_text_files_stream_one_document_per_file(tmp_path, tokenizer, documents, monkeypatch):
    """A folder of *.txt files streams as `--train-file` reads them (one document per file); a file larger than a
    read block keeps its text whole across blocks."""
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text("\n".join(documents[i * 10:(i + 1) * 10]), encoding="utf-8")
    files = sorted(str(p) for p in tmp_path.glob("*.txt"))
    reference = packed(load_text_documents(files), tokenizer, 32)
    assert torch.equal(StreamingRows(dataset_documents(tmp_path), tokenizer, 32).take(len(reference)), reference)
    monkeypatch.setattr(data, "TEXT_BLOCK_CHARS", 100)  # many blocks per file
    rows = StreamingRows(dataset_documents(tmp_path), tokenizer, 32).take(len(reference) - 5)
    text = tokenizer.decode(rows.flatten())
    whole = "".join(doc + tokenizer.eos_token for doc in load_text_documents(files))
    # The files' text, whole, with the end-of-document token after each file only (the third one's is in the
    # rows left out).
    assert whole.startswith(text) and text.count(tokenizer.eos_token) == 2


@pytest.mark.parametrize("make,match", [
    (lambda tmp: str(tmp / "missing"), "does not exist"),
    (lambda tmp: str(tmp), "neither a dataset saved with save_to_disk"),
    (lambda tmp: Dataset.from_dict({"a": ["x"], "b": ["y"]}), "no 'text' column"),
    (lambda tmp: Dataset.from_dict({"text": ["x"]}), None),
])
def test_bad_datasets_are_named(tmp_path, tokenizer, make, match):
    if match is None:  # a real column, but far too short
        with pytest.raises(ValueError, match="fewer than seq_len=32 tokens"):
            StreamingRows(dataset_documents(make(tmp_path)), tokenizer, 32).take(1)
        return
    with pytest.raises(ValueError, match=match):
        dataset_documents(make(tmp_path))


def test_a_lone_string_column_is_the_text_and_a_named_one_is_checked(tokenizer, documents):
    corpus = Dataset.from_dict({"id": list(range(len(documents))), "body": documents})
    reference = packed(documents, tokenizer, 32)
    assert torch.equal(StreamingRows(dataset_documents(corpus), tokenizer, 32).take(4), reference[:4])
    with pytest.raises(ValueError, match="no column 'content'"):
        dataset_documents(corpus, text_column="content")


def test_cli_train_dataset(tmp_path, documents, capsys):
    folder = tmp_path / "corpus"
    Dataset.from_dict({"text": documents}).save_to_disk(folder)
    code = main(["train", "--family", "ar", "--preset", "tiny", "--output-dir", str(tmp_path / "run"),
                 "--dataset", str(folder), "--max-steps", "2", "--batch-size", "2", "--seq-len", "32",
                 "--eval-every", "2", "--save-every", "2", "--no-sample"])
    assert code in (0, None)
    out = capsys.readouterr().out
    assert "no validation split" in out
    state = json.loads((tmp_path / "run" / "checkpoint-0000002" / "trainer_state.json").read_text())
    assert state["data_streams"] == [{"epoch": 0, "document": state["data_streams"][0]["document"],
                                      "offset": state["data_streams"][0]["offset"]}]
    assert state["data_streams"][0]["document"] > 0
    code = main(["train", "--preset", "tiny", "--output-dir", str(tmp_path / "bad"), "--dataset", str(folder),
                 "--train-file", str(folder / "state.json"), "--max-steps", "1"])
    assert code == 2 and "give one" in capsys.readouterr().err
    code = main(["train", "--preset", "tiny", "--output-dir", str(tmp_path / "bad"), "--dataset", str(folder),
                 "--text-column", "body", "--max-steps", "1", "--no-sample"])
    assert code == 2 and "no column 'body'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
