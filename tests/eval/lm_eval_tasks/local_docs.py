"""The documents of this folder's tasks, read from the JSONL file next to this module whatever the working directory
(each task's `custom_dataset: !function local_docs.load` with `dataset_kwargs: {data_file: NAME}`; lm-eval passes its
metadata, the model_args included, as further keyword arguments, which are not needed here)."""

import json
from pathlib import Path

import datasets


def load(data_file: str, **metadata) -> dict:
    lines = (Path(__file__).parent / data_file).read_text(encoding="utf-8").splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])}
