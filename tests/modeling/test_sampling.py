"""`modeling.sampling.RowSampler` / `draw_token`: per-row sampling inside transformers' `generate()` (the AR baseline's
path to batch-invariant samples, used by the server and the lm-eval adapter)."""

import torch

from hf_latentlm.modeling.sampling import draw_token


def test_the_per_row_draw_follows_the_tempered_nucleus_law():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature, top_p = 0.7, 0.8
    probs = torch.softmax(logits.double() / temperature, 0)
    # by hand: sorted order is the index order; keep a token while the mass before it is below top_p
    kept = [i for i in range(5) if probs[:i].sum() < top_p]
    expected = torch.zeros(5, dtype=torch.float64)
    expected[kept] = probs[kept] / probs[kept].sum()
    generator = torch.Generator().manual_seed(0)
    draws = torch.tensor([draw_token(logits, temperature, top_p, generator) for _ in range(8000)])
    frequencies = torch.bincount(draws, minlength=5).double() / draws.numel()
    assert kept == [0, 1] and frequencies[2:].sum() == 0
    assert torch.allclose(frequencies, expected, atol=0.02), (frequencies, expected)
    # top_k 1 keeps the most likely token only.
    assert {draw_token(logits, temperature, 1.0, generator, top_k=1) for _ in range(50)} == {0}
