"""Exact-match evaluation on a post-training task (`hf_latentlm.training.tasks`), with the decoding cost.

Every family answers through its own `generate()`: the prompts of a split are left-padded into batches, each row
stops at the end-of-text token, and the answer (the new tokens before it) is compared with the reference by
`exact_match`. Next to accuracy the report gives the mean answer length in tokens (what DPO's length bias would
move), model calls per generated token over the whole split, and the wall-clock tokens/s of answering one prompt at
a time (batch 1, EOS included in the count), so a multi-token family and the AR baseline can be compared on the
task in one run.
"""

from __future__ import annotations

import time

import torch

from ..modeling.sampling import model_mode
from ..training.tasks import exact_match
from .sampling import PLAIN_SAMPLING
from .speed import CallCounter


def left_padded(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] ids and attention mask of the prompts, left-padded (the tokenizer's own padding, pad = EOS if unset)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt must be non-empty, and there must be at least one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


def answer_tokens(new_tokens: torch.Tensor, eos_token_id: int) -> list[list[int]]:
    """The generated ids of every row up to (not including) its first end-of-text token."""
    return [row[:row.index(eos_token_id)] if eos_token_id in row else row for row in new_tokens.tolist()]


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, seed: int = 0,
                     generate_kwargs: dict | None = None) -> tuple[list[list[int]], int]:
    """Answers (token ids before EOS) for one batch of prompts, and the number of model calls it took."""
    input_ids, mask = left_padded(tokenizer, prompts)
    device = next(model.parameters()).device
    # Plain sampling at temperature 1 unless the caller says otherwise; after SFT this task's answers are
    # low-entropy, so it is close to greedy.
    kwargs = {**PLAIN_SAMPLING, **(generate_kwargs or {}), "max_new_tokens": max_new_tokens,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    seeds_option = getattr(model, "row_seeds_option", None)
    if seeds_option is not None:  # a family's own per-row seeds: a row's answer does not depend on its batch
        kwargs[seeds_option] = [seed + i for i in range(len(prompts))]
    torch.manual_seed(seed)
    with CallCounter(model) as counter:
        out = model.generate(input_ids.to(device), attention_mask=mask.to(device), **kwargs)
    sequences = out.sequences if hasattr(out, "sequences") else out
    return answer_tokens(sequences[:, input_ids.shape[1]:].cpu(), tokenizer.eos_token_id), counter.calls


def evaluate_task(model, tokenizer, dataset, batch_size: int = 8, max_new_tokens: int | None = None, seed: int = 0,
                  speed_prompts: int = 8, generate_kwargs: dict | None = None) -> dict:
    """Exact-match accuracy of `model` on a task split (columns `prompt`, `completion`), mean answer length,
    model calls per generated token, and batch-1 tokens/s on the first `speed_prompts` prompts."""
    if len(dataset) == 0:
        raise ValueError("the task split is empty")
    for column in ("prompt", "completion"):
        if column not in dataset.column_names:
            raise ValueError(f"the task split has no {column!r} column (columns: {dataset.column_names})")
    prompts, references = list(dataset["prompt"]), list(dataset["completion"])
    if max_new_tokens is None:  # room for the longest reference and its end-of-text token, plus a margin
        max_new_tokens = max(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in references) + 8
    with model_mode(model, False):
        answers, calls = [], 0
        for start in range(0, len(prompts), batch_size):
            batch_answers, batch_calls = generate_answers(model, tokenizer, prompts[start:start + batch_size],
                                                          max_new_tokens, seed + start, generate_kwargs)
            answers += batch_answers
            calls += batch_calls
        texts = [tokenizer.decode(a, skip_special_tokens=False) for a in answers]
        correct = [exact_match(text, reference) for text, reference in zip(texts, references)]

        # Batch 1: each prompt alone, every token until EOS counted (the EOS too: the model had to produce it).
        timed_tokens, timed_calls, elapsed = 0, 0, 0.0
        generate_answers(model, tokenizer, prompts[:1], max_new_tokens, seed, generate_kwargs)  # warm-up
        for i, prompt in enumerate(prompts[:speed_prompts]):
            begin = time.perf_counter()
            (answer,), used = generate_answers(model, tokenizer, [prompt], max_new_tokens, seed + i, generate_kwargs)
            elapsed += time.perf_counter() - begin
            timed_tokens += min(len(answer) + 1, max_new_tokens)
            timed_calls += used
    return {
        "accuracy": sum(correct) / len(correct),
        "num_examples": len(correct),
        "mean_answer_tokens": sum(len(a) for a in answers) / len(answers),
        "tokens_per_call_batch_1": timed_tokens / max(timed_calls, 1),
        "tokens_per_s_batch_1": timed_tokens / elapsed if elapsed > 0 else float("nan"),
        "speed_prompts": min(speed_prompts, len(prompts)),
        "correct": correct,  # per prompt, in order: paired comparisons of two models on the same split
        "answers": texts,
        "examples": [{"prompt": p, "answer": t, "correct": c} for p, t, c in list(zip(prompts, texts, correct))[:3]],
    }
