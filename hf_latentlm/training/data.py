"""Tokenize documents and pack them into fixed-length training sequences with `datasets`.

Documents are concatenated with the end-of-document token between them (and after the last),
then cut into rows of `seq_len` tokens; the remainder that does not fill a row is dropped.
"""

from __future__ import annotations

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
