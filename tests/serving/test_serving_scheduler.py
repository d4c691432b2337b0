"""BatchScheduler without HTTP: rows batched into one generate() get the tokens they get alone (against independent
references: the family's own generate() alone; for AR transformers' greedy generate and a hand sampling loop), a
cancelled row stops taking steps while the others are unaffected, and the queue answers 429 / 503."""

import queue

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from family_contract import build_tiny
from hf_latentlm.serving.protocol import OpenAIError
from hf_latentlm.modeling.sampling import draw_token
from hf_latentlm.serving.sampling import resolve_sampling
from hf_latentlm.serving.scheduler import BatchScheduler, Row, RowDone
from hf_latentlm.serving.text import IncrementalText

PROMPTS = [[40, 41, 42, 43, 44, 45, 46], [50, 51, 52], [60, 61, 62, 63, 64]]


@pytest.fixture(scope="module")
def models(tokenizer):
    return {family: build_tiny(family, tokenizer).eval() for family in ("ar", "plm", "cola")}


def make_row(model, tokenizer, prompt, max_tokens, seed, temperature=None, events=None, on_piece=None, name="r"):
    events = events if events is not None else queue.Queue()
    row = Row(name, prompt, max_tokens, resolve_sampling(model, temperature, None, seed, {}),
              IncrementalText(tokenizer), events.put)
    if on_piece is not None:
        row.sink = lambda event: (on_piece(row, event), events.put(event))
    row.events = events
    return row


def wait(rows, timeout=120):
    """Each row's (text, RowDone)."""
    results = []
    for row in rows:
        pieces = []
        while True:
            event = row.events.get(timeout=timeout)
            if isinstance(event, (RowDone, OpenAIError)):
                break
            pieces.append(event)
        results.append(("".join(pieces), event))
    return results


def run(model, tokenizer, rows, **options):
    scheduler = BatchScheduler(model, tokenizer, **{"batch_wait": 0.0, **options})
    for row in rows:  # queued before the worker starts: they are one batch
        scheduler.submit(row)
    scheduler.start()
    try:
        return wait(rows), scheduler
    finally:
        scheduler.close()


def hand_sampled(model, prompt, max_tokens, seed, temperature):
    """The AR reference: one forward per token on the row alone (no cache, no padding), drawn by draw_token."""
    generator, ids = torch.Generator().manual_seed(seed), list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(draw_token(logits, temperature, 1.0, generator))
    return ids[len(prompt):]


def tokens_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_ar_rows_in_one_batch_get_their_tokens_alone(models, tokenizer):
    ar = models["ar"]
    specs = [(6, 11, 1.0), (9, 12, 0.0), (4, 13, 0.7)]  # (max_tokens, seed, temperature)
    rows = [make_row(ar, tokenizer, p, n, s, t) for p, (n, s, t) in zip(PROMPTS, specs)]
    results, scheduler = run(ar, tokenizer, rows)
    assert [done.batch_size for _, done in results] == [3, 3, 3] and scheduler.stats.batches == 1
    for prompt, (n, seed, temperature), (text, done) in zip(PROMPTS, specs, results):
        if temperature == 0:  # transformers' own greedy decoding of the row alone
            alone = ar.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None)
            reference = alone[0, len(prompt):].tolist()
        else:
            reference = hand_sampled(ar, prompt, n, seed, temperature)
        assert done.finish_reason == "length" and done.completion_tokens == n
        assert text == tokenizer.decode(reference, skip_special_tokens=True)


@pytest.mark.parametrize("family", ["plm", "cola"])
def test_multi_token_rows_with_different_max_tokens_share_a_batch_and_match_generate_alone(models, tokenizer, family):
    model = models[family]
    # The first and last rows' max_tokens end inside a step's block of tokens (Cola: the prompts' first steps
    # give 1 and 3 tokens, then 4 a step), so the batch's steps carry tokens past them that the row must not take.
    specs = [(4, 21), (10, 22), (6, 23)]
    rows = [make_row(model, tokenizer, p, n, s) for p, (n, s) in zip(PROMPTS, specs)]
    results, _ = run(model, tokenizer, rows)
    for prompt, (n, seed), (text, done) in zip(PROMPTS, specs, results):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=None,
                               **{model.row_seeds_option: [seed]})
        assert done.batch_size == 3 and done.completion_tokens == n
        assert text == tokenizer.decode(alone[0, len(prompt):], skip_special_tokens=True)


@pytest.mark.parametrize("family", ["ar", "cola"])
def test_a_cancelled_row_stops_taking_steps_and_the_others_are_unaffected(models, tokenizer, family):
    model = models[family]
    cancel_after_first_piece = lambda row, event: row.cancelled.set()
    rows = [make_row(model, tokenizer, PROMPTS[0], 200, 31, on_piece=cancel_after_first_piece),
            make_row(model, tokenizer, PROMPTS[1], 12, 32)]
    (_, cancelled), (text, done) = run(model, tokenizer, rows)[0]
    assert cancelled.finish_reason == "cancelled" and cancelled.completion_tokens < 20
    reference, _ = run(model, tokenizer, [make_row(model, tokenizer, PROMPTS[1], 12, 32)])
    assert done.batch_size == 2 and done.finish_reason == "length" and text == reference[0][0]


def test_stop_sequences_and_eos_end_a_row_with_finish_reason_stop(models, tokenizer):
    ar = models["ar"]
    full, _ = run(ar, tokenizer, [make_row(ar, tokenizer, PROMPTS[0], 12, 41, 0.0)])
    text = full[0][0]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    row = make_row(ar, tokenizer, PROMPTS[0], 12, 41, 0.0)
    row.text = IncrementalText(tokenizer, [stop])
    (cut, done), = run(ar, tokenizer, [row])[0]
    assert cut == text[:text.find(stop)] and done.finish_reason == "stop"
    # EOS: the first greedy token made the end of text, the row stops at once with nothing to say
    first = tokens_of(tokenizer, text)[0]
    eos_model = build_tiny("ar", tokenizer).eval()
    eos_model.generation_config.eos_token_id = first
    (eos_text, eos_done), = run(eos_model, tokenizer, [make_row(eos_model, tokenizer, PROMPTS[0], 12, 41, 0.0)])[0]
    assert eos_text == "" and eos_done.finish_reason == "stop" and eos_done.completion_tokens == 1


def test_a_full_queue_is_a_429_and_a_closing_one_a_503(models, tokenizer):
    ar = models["ar"]
    scheduler = BatchScheduler(ar, tokenizer, max_queue=1)
    waiting = make_row(ar, tokenizer, PROMPTS[0], 4, 1)
    scheduler.submit(waiting)
    with pytest.raises(OpenAIError) as full:
        scheduler.submit(make_row(ar, tokenizer, PROMPTS[1], 4, 2))
    assert full.value.status == 429 and full.value.body()["error"]["code"] == "queue_full"
    scheduler.close()
    (_, event), = wait([waiting])
    assert isinstance(event, OpenAIError) and event.status == 503
    with pytest.raises(OpenAIError) as closing:
        scheduler.submit(make_row(ar, tokenizer, PROMPTS[1], 4, 2))
    assert closing.value.status == 503 and scheduler.stats.rejected_full == scheduler.stats.rejected_closing == 1


class StepSizes(StoppingCriteria):
    """Records how many tokens each step of a multi-token generate() commits."""

    def __init__(self):
        self.totals = []

    def __call__(self, input_ids, scores=None, num_new_tokens=None, **kwargs):
        self.totals.append(int(num_new_tokens[0]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_stop_inside_a_multi_token_step_counts_the_tokens_up_to_the_one_completing_it(models, tokenizer):
    cola, prompt, seed = models["cola"], PROMPTS[0], 51
    steps = StepSizes()
    alone = cola.generate(torch.tensor([prompt]), max_new_tokens=12, eos_token_id=None,
                          stopping_criteria=StoppingCriteriaList([steps]),
                          **{cola.row_seeds_option: [seed]})[0, len(prompt):].tolist()
    decoded = [tokenizer.decode(alone[:n]) for n in range(len(alone) + 1)]
    # a token's text that first appears with that token, and not at the end of a step (Cola commits several)
    for n in range(2, len(alone) + 1):
        stop = tokenizer.decode(alone[n - 1:n])
        if stop.strip() and not decoded[n].endswith("\ufffd") and stop not in decoded[n - 1] and n not in steps.totals:
            break
    else:
        pytest.fail(f"no token of {alone} ends a stop sequence mid-step ({steps.totals})")
    needed = next(m for m in range(1, len(alone) + 1) if stop in decoded[m])  # by brute force
    row = make_row(cola, tokenizer, prompt, 12, seed)
    row.text = IncrementalText(tokenizer, [stop])
    [(text, done)], scheduler = run(cola, tokenizer, [row])
    assert done.finish_reason == "stop" and text == decoded[needed][:decoded[needed].find(stop)]
    assert done.completion_tokens == needed == n and scheduler.stats.generated_tokens == needed  # /metrics' count
