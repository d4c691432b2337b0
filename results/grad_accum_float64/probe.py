"""The largest parameter difference between batch 4 x grad_accum 1 and batch 2 x grad_accum 2 after 4 AR `tiny` steps,
in float32 and float64, with 1 and 2 threads (what tests/training/test_loop.py::test_grad_accum_matches_one_big_batch
compares). Run from the repository root:  .venv/bin/python results/grad_accum_float64/probe.py"""

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "training")]

from test_loop import max_difference, run, tiny_config  # noqa: E402

from hf_latentlm.training.corpus import load_corpus_documents, load_default_tokenizer  # noqa: E402
from hf_latentlm.training.data import token_stream  # noqa: E402

tokenizer = load_default_tokenizer()
stream = token_stream(load_corpus_documents("validation"), tokenizer)
rows = stream[: stream.numel() // 64 * 64].view(-1, 64)
for dtype in (torch.float32, torch.float64):
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with tempfile.TemporaryDirectory() as tmp:
            big = tiny_config(Path(tmp) / "big", max_steps=4, eval_every=0, grad_clip=0).resolved()
            acc = tiny_config(Path(tmp) / "acc", max_steps=4, eval_every=0, grad_clip=0, batch_size=2,
                              grad_accum=2).resolved()
            a, _ = run(big, tokenizer, rows, dtype=dtype)
            b, _ = run(acc, tokenizer, rows, dtype=dtype)
        print(f"{str(dtype):14s} threads={threads}: max |difference| = {max_difference(a, b):.3g}")
