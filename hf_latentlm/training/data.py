"""Tokenize documents and pack them into fixed-length training sequences with `datasets`.

Documents are concatenated with the end-of-document token between them (and after the last),
then cut into rows of `seq_len` tokens; the remainder that does not fill a row is dropped.
A corpus too large for memory (`train --dataset`) is packed the same way on the fly (`StreamingRows`).
"""

from __future__ import annotations

import collections
import itertools
from pathlib import Path
from typing import Sequence

import torch
from datasets import Dataset

from .corpus import load_corpus_documents, load_text_documents


def documents_to_dataset(documents: Sequence[str]) -> Dataset:
    if len(documents) == 0:
        raise ValueError("no documents given: the corpus is empty")
    return Dataset.from_dict({"text": list(documents)})


def pack_dataset(dataset: Dataset, tokenizer, seq_len: int, text_column: str = "text") -> Dataset:
    """Return a `datasets.Dataset` with one column `input_ids` of rows of exactly `seq_len` ids."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if text_column not in dataset.column_names:
        raise ValueError(f"dataset has no column {text_column!r} (columns: {dataset.column_names})")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; packing needs an end-of-document token")

    def tokenize(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"ids": [doc + [eos] for doc in ids]}

    def pack(batch):
        # Called once on the whole corpus (batch_size=None) so rows can span documents.
        stream = [tok for doc in batch["ids"] for tok in doc]
        n_rows = len(stream) // seq_len
        return {"input_ids": [stream[i * seq_len:(i + 1) * seq_len] for i in range(n_rows)]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)
    packed = tokenized.map(pack, batched=True, batch_size=None, remove_columns=["ids"])
    if len(packed) == 0:
        raise ValueError(f"the corpus has fewer than seq_len={seq_len} tokens; nothing to train on")
    return packed.with_format("torch")


def token_stream(documents: Sequence[str], tokenizer) -> torch.Tensor:
    """All documents as one 1-D id tensor, each followed by the end-of-document token."""
    ids = tokenizer(list(documents), add_special_tokens=False)["input_ids"]
    return torch.tensor([tok for doc in ids for tok in doc + [tokenizer.eos_token_id]], dtype=torch.long)


def load_split_documents(split: str, train_files: Sequence[str] | None = None,
                         validation_files: Sequence[str] | None = None) -> list[str]:
    """Documents of a split: the user's text files when given, else the embedded corpus."""
    files = {"train": train_files, "validation": validation_files}.get(split)
    if files:
        return load_text_documents(list(files))
    return load_corpus_documents(split)


class StreamingRows:
    """Packed rows of `seq_len` ids read lazily from a corpus too large to hold in memory: documents are tokenized
    one at a time, joined with the end-of-document token (as `pack_dataset` joins them) and cut into rows; nothing
    reads or counts the whole corpus.

    `documents()` returns a fresh iterable over the corpus, in a fixed order, of documents, each an iterable of text
    pieces (a record's text, or the blocks of lines of a large file); the end-of-document token follows the last
    piece. Rank `rank` of `world` reads documents rank, rank + world, ... At the end of the corpus the tokens that do
    not fill a row are dropped and the next epoch starts over (in the same order: shuffle before saving).

    The position of the next row, `state_dict()` = {"epoch", "document" (index among this rank's documents),
    "offset" (tokens of that document already used)}, is all a resumed run needs to go on with exactly the rows
    the uninterrupted run would have read."""

    def __init__(self, documents, tokenizer, seq_len: int, rank: int = 0, world: int = 1):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; packing needs an end-of-document token")
        self.documents, self.tokenizer, self.seq_len = documents, tokenizer, seq_len
        self.rank, self.world = rank, world
        self.load_state_dict({"epoch": 0, "document": 0, "offset": 0})

    def for_rank(self, rank: int, world: int) -> "StreamingRows":
        """The same corpus read as rank `rank` of `world`, from its start."""
        return StreamingRows(self.documents, self.tokenizer, self.seq_len, rank, world)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "document": self.document, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.document, self.offset = state["epoch"], state["document"], state["offset"]
        self._tokens = self._token_stream(self.document, self.offset)
        # (document, offset of the first token, tokens) pieces read but not yet in a row, and their token count
        self._pending: collections.deque[tuple[int, int, list[int]]] = collections.deque()
        self._pending_tokens = 0

    def _token_stream(self, first_document: int, offset: int):
        """(document index, offset, ids) pieces of this rank's documents from `first_document`, the first `offset`
        ids of that one left out; skipped documents are read, not tokenized."""
        mine = itertools.islice(self.documents(), self.rank, None, self.world)
        for index, pieces in enumerate(itertools.islice(mine, first_document, None), start=first_document):
            position = 0
            pieces = [pieces] if isinstance(pieces, str) else pieces
            for ids in itertools.chain((self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in pieces),
                                       [[self.tokenizer.eos_token_id]]):
                keep = ids[max(0, offset - position):]
                if keep:
                    yield index, max(position, offset), keep
                position += len(ids)
            offset = 0

    def _next_row(self) -> list[int]:
        while self._pending_tokens < self.seq_len:
            piece = next(self._tokens, None)
            if piece is None:  # end of the corpus: the remainder is dropped, the next epoch starts
                if self.document == 0 and self.offset == 0:
                    raise ValueError(f"the corpus gives rank {self.rank} of {self.world} fewer than seq_len="
                                     f"{self.seq_len} tokens; nothing to train on")
                self.load_state_dict({"epoch": self.epoch + 1, "document": 0, "offset": 0})
                continue
            self._pending.append(piece)
            self._pending_tokens += len(piece[2])
        row: list[int] = []
        while len(row) < self.seq_len:
            document, offset, ids = self._pending[0]
            used = ids[: self.seq_len - len(row)]
            row += used
            self._pending_tokens -= len(used)
            if len(used) == len(ids):
                self._pending.popleft()
            else:
                self._pending[0] = (document, offset + len(used), ids[len(used):])
        if self._pending:
            self.document, self.offset = self._pending[0][0], self._pending[0][1]
        else:  # the row ended with a piece: the next one starts where that piece ended
            self.document, self.offset = document, offset + len(used)
        return row

    def take(self, count: int) -> torch.Tensor:
        """The next `count` rows of this rank, [count, seq_len]."""
        return torch.tensor([self._next_row() for _ in range(count)], dtype=torch.long)

    def head(self, count: int) -> torch.Tensor:
        """The first `count` rows of the whole corpus (every rank's documents, one epoch at most), without moving
        this stream: the same on every rank."""
        whole = self.for_rank(0, 1)
        rows = []
        while len(rows) < count and whole.epoch == 0:
            row = whole._next_row()
            if whole.epoch == 0:
                rows.append(row)
        return torch.tensor(rows, dtype=torch.long).view(len(rows), self.seq_len)


class GeneratedRows(StreamingRows):
    """Packed rows of a generated language (`hf_latentlm.data.generated`), drawn as they are read: an endless
    corpus whose documents come from per-document seeds, so rank `rank` of `world` reads documents rank,
    rank + world, ... of `stream` and a resumed run jumps straight to its position (`state_dict()` as for any
    `StreamingRows`; the epoch never changes)."""

    def __init__(self, language, split: str, stream: int, tokenizer, seq_len: int, rank: int = 0, world: int = 1):
        self.language, self.split, self.stream = language, split, stream
        super().__init__(None, tokenizer, seq_len, rank, world)

    def for_rank(self, rank: int, world: int) -> "GeneratedRows":
        return GeneratedRows(self.language, self.split, self.stream, self.tokenizer, self.seq_len, rank, world)

    def _token_stream(self, first_document: int, offset: int):
        for index in itertools.count(first_document):
            ids = self.language.document(self.split, self.stream, self.rank + self.world * index)[offset:]
            if ids:
                yield index, offset, ids
            offset = 0


TEXT_BLOCK_CHARS = 1 << 20  # a large text file is tokenized in blocks of whole lines of about this many characters


def _file_pieces(path: Path):
    """The text of one file in blocks of whole lines (line endings normalised as `load_text_documents` does)."""
    with open(path, encoding="utf-8-sig", newline=None) as f:
        while True:
            block = f.read(TEXT_BLOCK_CHARS)
            if not block:
                return
            yield block + f.readline()


def _text_column(dataset, text_column: str | None) -> str:
    """`text_column`, or else "text", or else the dataset's only string column; ValueError naming the columns."""
    features = dataset.features
    if features is None:  # an IterableDataset of unknown features: checked when read
        return text_column or "text"
    if text_column is not None or "text" in features:
        column = text_column or "text"
        if column not in features:
            raise ValueError(f"--dataset has no column {column!r} (columns: {list(features)})")
        return column
    strings = [name for name, feature in features.items() if getattr(feature, "dtype", None) in ("string", "large_string")]
    if len(strings) != 1:
        raise ValueError(f"--dataset has no 'text' column; name the text column with --text-column "
                         f"(columns: {list(features)})")
    return strings[0]


def dataset_documents(source, text_column: str | None = None, split: str = "train"):
    """A `documents` callable for `StreamingRows`, or None when `source` has no such split.

    source: a `datasets.Dataset` / `IterableDataset` / `DatasetDict`, or a path: a folder written by `save_to_disk`
    (read memory-mapped, record by record; a `DatasetDict` gives its `train` and `validation` splits), a UTF-8 text
    file, or a folder of `*.txt` files (one document per file, read in blocks; these have a train split only)."""
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, load_from_disk

    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.exists():
            raise ValueError(f"--dataset {str(source)!r} does not exist")
        if path.is_dir() and any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json")):
            source = load_from_disk(str(path))
        else:
            files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
            if not files:
                raise ValueError(f"--dataset {str(source)!r} is neither a dataset saved with save_to_disk nor a "
                                 f"text file, nor a folder of *.txt files")
            if split != "train":
                return None
            return lambda: (_file_pieces(f) for f in files)
    if isinstance(source, (DatasetDict, IterableDatasetDict)):
        if split not in source:
            if split == "train":
                raise ValueError(f"--dataset has no train split (splits: {list(source)})")
            return None
        source = source[split]
    elif split != "train":
        return None
    if not isinstance(source, (Dataset, IterableDataset)):
        raise TypeError(f"--dataset must be a datasets Dataset or a path, got {type(source).__name__}")
    column = _text_column(source, text_column)
    # A Dataset is read through its iterable view: record by record from the memory-mapped files.
    records = (source.to_iterable_dataset() if isinstance(source, Dataset) else source).select_columns([column])
    return lambda: ([record[column]] for record in records)
