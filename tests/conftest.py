import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

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
