"""Per-row sampling inside transformers' `generate()`: each row draws from its own seeded generator, so a row's
text does not depend on the batch it runs in (the AR baseline in lm-eval and the server). Also `model_mode`, the
one train/eval switch that modeling/, training/ and eval/ all use."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import LogitsProcessor


@contextmanager
def model_mode(model, training: bool):
    """`model` in training (True) or eval mode inside the block; its own mode is restored after, also on an error."""
    was_training = model.training
    model.train(training)
    try:
        yield model
    finally:
        model.train(was_training)


class RowSampler(LogitsProcessor):
    """Per-row sampling inside transformers' `generate(do_sample=False)`: row b's next token is drawn from its own
    generator (seeded with `seeds[b]`) at `temperatures[b]` (0: argmax) and nucleus `top_ps[b]` (the most likely
    tokens whose cumulative probability before them is below top_p), and returned as the only finite score, so the
    greedy pick is that draw. A row thus draws one uniform per step from its own generator, in or out of a batch.

    The draw inverts the row's cumulative distribution (float64) at that uniform, so a batch's rounding differences
    in the logits move a row's token only when the uniform falls within that rounding of a boundary.
    """

    def __init__(self, temperatures: list[float], top_ps: list[float], seeds: list[int], top_k: int = 0):
        self.temperatures, self.top_ps, self.top_k = temperatures, top_ps, top_k
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        picks = torch.empty(scores.shape[0], dtype=torch.long)
        for b, (temperature, top_p, generator) in enumerate(zip(self.temperatures, self.top_ps, self.generators)):
            picks[b] = int(scores[b].argmax()) if temperature == 0 else \
                draw_token(scores[b], temperature, top_p, generator, self.top_k)
        chosen = torch.full_like(scores, float("-inf"))
        chosen[torch.arange(scores.shape[0]), picks.to(scores.device)] = 0.0
        return chosen


def draw_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
               top_k: int = 0) -> int:
    """One token from softmax(logits / temperature) restricted to its top-p nucleus (and to its `top_k` most likely
    tokens; 0: all), by inverse CDF at one uniform."""
    probs = torch.softmax(logits.detach().double().cpu() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs
    keep = before < top_p
    if top_k:
        keep &= torch.arange(keep.numel()) < top_k
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    cdf = sorted_probs.cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True).clamp(max=cdf.numel() - 1))
    return int(order[index])
