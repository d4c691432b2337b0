"""`evaluate_task`: exact-match accuracy, answer lengths and call counts, checked against an oracle whose answers
are known, and a real tiny model whose batched answers must equal its answers alone."""

import pytest
import torch

from hf_latentlm.eval.task import answer_tokens, evaluate_task, generate_answers, left_padded
from hf_latentlm.training.tasks import load_task


class Oracle(torch.nn.Module):
    """Answers each known prompt with a fixed token list (then EOS, then padding), in ONE forward call per batch."""

    def __init__(self, tokenizer, answers: dict[str, list[int]]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer = tokenizer
        self.answers = {tuple(tokenizer(p, add_special_tokens=False)["input_ids"]): a for p, a in answers.items()}
        self.seen_kwargs = []

    def forward(self, input_ids):
        return input_ids

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kwargs):
        self.seen_kwargs.append(kwargs)
        self(input_ids)
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            answer = self.answers[tuple(ids[mask.bool()].tolist())] + [eos_token_id]
            answer = (answer + [pad_token_id] * max_new_tokens)[:max_new_tokens]
            rows.append(torch.cat([ids, torch.tensor(answer)]))
        return torch.stack(rows)


@pytest.fixture(scope="module")
def split():
    return load_task(split_sizes={"train": 4, "test": 6})["test"]


def test_left_padding_and_answers_cut_at_the_first_eos(tokenizer):
    ids, mask = left_padded(tokenizer, ["User: a", "User: a longer prompt"])
    assert mask.sum(1).tolist() == [len(tokenizer("User: a")["input_ids"]),
                                    len(tokenizer("User: a longer prompt")["input_ids"])]
    assert (ids[0, :mask.shape[1] - mask[0].sum()] == tokenizer.pad_token_id).all()
    assert answer_tokens(torch.tensor([[5, 6, 0, 7], [8, 9, 9, 9]]), 0) == [[5, 6], [8, 9, 9, 9]]
    with pytest.raises(ValueError, match="non-empty"):
        left_padded(tokenizer, [])


def test_accuracy_lengths_and_calls_against_an_oracle(tokenizer, split):
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    references = [encode(c.removesuffix("<|endoftext|>")) for c in split["completion"]]
    # Rows 0, 2, 4 answer exactly; row 1 drops its last token; rows 3 and 5 add one.
    answers = [r if i % 2 == 0 else (r[:-1] if i == 1 else r + [42]) for i, r in enumerate(references)]
    oracle = Oracle(tokenizer, dict(zip(split["prompt"], answers)))
    report = evaluate_task(oracle, tokenizer, split, batch_size=4, speed_prompts=3)
    assert report["accuracy"] == pytest.approx(0.5)
    assert report["mean_answer_tokens"] == pytest.approx(sum(map(len, answers)) / 6)
    # One call per batch-1 answer: tokens per call is the answer length + its EOS, averaged over the 3 prompts.
    assert report["tokens_per_call_batch_1"] == pytest.approx(sum(len(a) + 1 for a in answers[:3]) / 3)
    assert [e["correct"] for e in report["examples"]] == [True, False, True]
    with pytest.raises(ValueError, match="empty"):
        evaluate_task(oracle, tokenizer, split.select([]))
    with pytest.raises(ValueError, match="'completion'"):
        evaluate_task(oracle, tokenizer, split.remove_columns("completion"))


@pytest.mark.parametrize("family", ["ar", "plm"])
def test_a_batched_answer_equals_the_answer_alone(family, tokenizer, split):
    from family_contract import build_tiny

    model = build_tiny(family, tokenizer).eval()
    prompts = list(split["prompt"][:3])
    # AR has no per-row seeds, so it is compared greedily; PLM samples with one seed per row (seed + row index).
    options = {"do_sample": False} if family == "ar" else None
    batched, _ = generate_answers(model, tokenizer, prompts, max_new_tokens=6, seed=7, generate_kwargs=options)
    assert all(len(answer) <= 6 for answer in batched)
    for i, prompt in enumerate(prompts):
        alone, _ = generate_answers(model, tokenizer, [prompt], max_new_tokens=6, seed=7 + i, generate_kwargs=options)
        assert alone == [batched[i]]
