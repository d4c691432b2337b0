"""Offline SFT/DPO task data (hf_latentlm.training.tasks, issue 13): deterministic, unseen test prompts, long exact
responses under the real tokenizer, TRL's prompt/completion and preference formats with exactly one end-of-text, and
rejected answers that are wrong and split evenly between shorter and longer ones."""

import re

import pytest

from hf_latentlm.training.corpus import load_corpus_documents
from hf_latentlm.training.tasks import (
    DEFAULT_SPLIT_SIZES,
    EOS_TEXT,
    LONGER_REJECTED_KINDS,
    MIN_RESPONSE_TOKENS,
    REJECTED_KINDS,
    SHORTER_REJECTED_KINDS,
    COUNT_TASK,
    COUNT_TENS_TASK,
    TASK_KINDS,
    TASKS,
    VERSE_TASKS,
    exact_match,
    load_preference_task,
    load_task,
    response_lengths,
    task_accuracy,
)

SMALL = {"train": 40, "test": 12}


@pytest.fixture(scope="module")
def default_task(tokenizer):
    return load_task(tokenizer=tokenizer)


@pytest.fixture(scope="module")
def mixed_preferences(tokenizer):
    return load_preference_task("verse-mixed", split_sizes={"train": 400, "test": 100}, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def count_preferences(tokenizer):
    return load_preference_task(COUNT_TASK, split_sizes={"train": 400, "validation": 50, "test": 100},
                                tokenizer=tokenizer)


@pytest.fixture(scope="module")
def count_tens_preferences(tokenizer):
    return load_preference_task(COUNT_TENS_TASK, split_sizes={"train": 400, "validation": 50, "test": 100},
                                tokenizer=tokenizer)


@pytest.fixture(params=[COUNT_TASK, COUNT_TENS_TASK])
def any_count_preferences(request):
    """The preference data of each counting task (they share the answer, split and rejection rules)."""
    return request.getfixturevalue("count_preferences" if request.param == COUNT_TASK else "count_tens_preferences")


@pytest.fixture(params=["verse-mixed", COUNT_TASK])
def preferences(request):
    """The preference data of a verse task and of the counting task (the pair logic is shared)."""
    return request.param, request.getfixturevalue("mixed_preferences" if request.param == "verse-mixed"
                                                  else "count_preferences")


def token_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_default_task_has_the_default_sizes_and_columns(default_task):
    data = default_task
    assert {split: len(rows) for split, rows in data.items()} == dict(DEFAULT_SPLIT_SIZES)
    assert data["train"].column_names == ["prompt", "completion", "instruction", "response", "kind"]


@pytest.mark.parametrize("loader", [load_task, load_preference_task])
def test_same_seed_gives_identical_datasets_and_another_seed_different_ones(loader, tokenizer):
    first = loader("verse-mixed", split_sizes=SMALL, seed=3, tokenizer=tokenizer)
    again = loader("verse-mixed", split_sizes=SMALL, seed=3, tokenizer=tokenizer)
    other = loader("verse-mixed", split_sizes=SMALL, seed=4, tokenizer=tokenizer)
    for split in SMALL:
        assert first[split].to_dict() == again[split].to_dict()
        assert first[split]["prompt"] != other[split]["prompt"]


def test_split_sizes_extend_rather_than_reshuffle(tokenizer):
    small = load_task(split_sizes={"train": 20, "test": 5}, tokenizer=tokenizer)
    large = load_task(split_sizes={"train": 20, "test": 30}, tokenizer=tokenizer)
    assert small["train"].to_dict() == large["train"].to_dict()
    assert large["test"]["prompt"][:5] == small["test"]["prompt"]
    pairs = load_preference_task("verse-mixed", split_sizes={"train": 30}, tokenizer=tokenizer)["train"]
    fewer = load_preference_task("verse-mixed", split_sizes={"train": 10}, tokenizer=tokenizer)["train"]
    assert pairs[:10] == fewer[:10]


def test_prompts_are_distinct_and_test_prompts_never_appear_in_train(default_task):
    data = default_task
    train, test = data["train"]["prompt"], data["test"]["prompt"]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert set(train).isdisjoint(test)
    # The test passages come from works the train split never shows (the corpus "test" works).
    def stripped_lines(work: str) -> str:
        return "\n".join(line.strip() for line in work.split("\n"))

    train_works = [stripped_lines(work) for work in load_corpus_documents("train")]
    test_works = [stripped_lines(work) for work in load_corpus_documents("test")]
    for instruction in data["test"]["instruction"]:
        passage = instruction.split("\n", 1)[1]
        assert any(passage in work for work in test_works)
        assert not any(passage in work for work in train_works), passage


def test_every_response_is_long_and_its_completion_ends_with_exactly_one_eos(default_task, tokenizer):
    data = default_task
    for split, rows in data.items():
        lengths = response_lengths(rows, tokenizer)
        assert min(lengths) >= MIN_RESPONSE_TOKENS, split
        for row, length in zip(rows, lengths):
            # TRL tokenizes prompt and prompt + completion and takes the completion where they diverge.
            prompt_ids = token_ids(tokenizer, row["prompt"])
            full_ids = token_ids(tokenizer, row["prompt"] + row["completion"])
            assert full_ids[: len(prompt_ids)] == prompt_ids, row["prompt"]
            completion_ids = full_ids[len(prompt_ids):]
            assert len(completion_ids) == length + 1 >= MIN_RESPONSE_TOKENS + 1
            assert completion_ids[-1] == tokenizer.eos_token_id == 0
            assert completion_ids.count(0) == 1
            # TRL 1.16 appends eos only when the completion does not already end with it.
            assert row["completion"].endswith(tokenizer.eos_token)


def test_prompt_and_completion_concatenate_to_the_template(tokenizer):
    for name in TASKS:
        rows = load_task(name, split_sizes=SMALL, tokenizer=tokenizer)["train"]
        for row in rows:
            assert row["prompt"] + row["completion"] == \
                f"User: {row['instruction']}\n\nAssistant: {row['response']}<|endoftext|>"
            assert row["prompt"].endswith("Assistant:") and row["completion"].startswith(" ")
    for name in VERSE_TASKS:
        for row in load_task(name, split_sizes=SMALL, tokenizer=tokenizer)["train"]:
            # The response is the deterministic function of the prompt that the instruction names.
            kind = TASK_KINDS[row["kind"]]
            header, *passage = row["instruction"].split("\n")
            assert header == kind.instruction and len(passage) >= 2
            assert row["response"] == "\n".join(kind.transform(passage))
            assert row["kind"] in VERSE_TASKS[name]


def test_reverse_reverses_the_words_of_each_line():
    assert TASK_KINDS["reverse"].transform(["So foul and fair a day", "I have not seen."]) == \
        ["day a fair and foul So", "seen. not have I"]


def test_mixed_task_uses_both_instructions_in_equal_shares(mixed_preferences):
    kinds = mixed_preferences["train"]["kind"]
    assert kinds.count("repeat") == kinds.count("reverse") == len(kinds) // 2


def test_chosen_is_the_reference_and_every_rejected_is_wrong(preferences, tokenizer):
    name, pairs = preferences
    sft = load_task(name, split_sizes={split: len(rows) for split, rows in pairs.items()}, tokenizer=tokenizer)
    for split, rows in pairs.items():
        assert rows["prompt"] == sft[split]["prompt"]
        assert rows["chosen"] == sft[split]["completion"]
        for row in rows:
            assert exact_match(row["chosen"], row["response"])
            assert not exact_match(row["rejected"], row["response"])
            assert row["rejected"].endswith(EOS_TEXT) and row["rejected"].startswith(" ")
        assert task_accuracy(rows["chosen"], rows["response"]) == 1.0
        assert task_accuracy(rows["rejected"], rows["response"]) == 0.0


def test_rejected_answers_are_half_shorter_and_half_longer_in_tokens(preferences, tokenizer):
    for rows in preferences[1].values():
        kinds = rows["rejected_kind"]
        assert set(kinds) == set(REJECTED_KINDS)
        shorter = sum(kind in SHORTER_REJECTED_KINDS for kind in kinds)
        assert abs(shorter - len(kinds) / 2) <= 1
        chosen = response_lengths(rows, tokenizer, "chosen")
        rejected = response_lengths(rows, tokenizer, "rejected")
        for kind, c, r in zip(kinds, chosen, rejected):
            if kind in SHORTER_REJECTED_KINDS:
                assert r < c, kind
            else:
                assert kind in LONGER_REJECTED_KINDS and r > c, kind


def test_extra_line_rejection_continues_the_passage(mixed_preferences):
    rows = [row for row in mixed_preferences["train"] if row["rejected_kind"] == "extra_line"]
    assert rows
    for row in rows:
        correct = row["chosen"].removesuffix(EOS_TEXT)
        wrong = row["rejected"].removesuffix(EOS_TEXT)
        assert wrong.startswith(correct + "\n") and wrong.count("\n") == correct.count("\n") + 1


def _count_bounds(instruction: str) -> tuple[int, int]:
    match = re.fullmatch(r"Count from (\d+) to (\d+):", instruction)
    assert match, instruction
    return int(match[1]), int(match[2])


def test_count_answers_list_every_number_from_start_to_stop(any_count_preferences, tokenizer):
    for split, rows in any_count_preferences.items():
        for row, length in zip(rows, response_lengths(rows, tokenizer, "chosen")):
            start, stop = _count_bounds(row["instruction"])
            numbers = [int(word) for word in row["response"].split(" ")]
            assert numbers[0] == start and numbers[-1] == stop and numbers == list(range(start, stop + 1))
            assert len(numbers) >= 8 and length >= MIN_RESPONSE_TOKENS
            assert row["kind"] == COUNT_TASK


def test_count_splits_hold_disjoint_prompts(any_count_preferences):
    prompts = {split: rows["prompt"] for split, rows in any_count_preferences.items()}
    for split, rows in prompts.items():
        assert len(set(rows)) == len(rows), split
    assert set(prompts["train"]).isdisjoint(prompts["test"])
    assert set(prompts["train"]).isdisjoint(prompts["validation"])
    assert set(prompts["validation"]).isdisjoint(prompts["test"])


def test_count_rejections_skip_repeat_stop_early_or_run_past_the_stop(any_count_preferences):
    for row in any_count_preferences["train"]:
        chosen = [int(word) for word in row["chosen"].removesuffix(EOS_TEXT).split()]
        wrong = [int(word) for word in row["rejected"].removesuffix(EOS_TEXT).split()]
        kind = row["rejected_kind"]
        if kind == "extra_line":
            assert wrong == chosen + [chosen[-1] + 1]
        elif kind == "duplicated_word":
            assert len(wrong) == len(chosen) + 1 and sorted(set(wrong)) == chosen
        elif kind == "dropped_word":
            assert len(wrong) == len(chosen) - 1 and set(wrong) < set(chosen) and wrong[-1] == chosen[-1]
        else:
            assert kind == "truncated" and wrong == chosen[: len(wrong)] and len(wrong) < len(chosen)


def test_count_tens_stops_at_the_first_number_ending_in_zero(count_tens_preferences):
    # The stop is local: no number before the last one ends in 0, and the start ends in 1, 2 or 3.
    for split, rows in count_tens_preferences.items():
        for row in rows:
            numbers = [int(word) for word in row["response"].split(" ")]
            assert numbers[-1] % 10 == 0 and all(n % 10 for n in numbers[:-1]), row["response"]
            assert numbers[0] % 10 in (1, 2, 3) and 8 <= len(numbers) <= 10


def test_count_tens_leaves_short_counts_out_instead_of_growing_them(tokenizer):
    # With a minimum of 45 tokens only 9-10 number counts of 4-digit numbers qualify; none may run past its ten.
    rows = load_task(COUNT_TENS_TASK, split_sizes={"train": 50}, min_response_tokens=45, tokenizer=tokenizer)["train"]
    for row, length in zip(rows, response_lengths(rows, tokenizer)):
        numbers = [int(word) for word in row["response"].split(" ")]
        assert length >= 45 and numbers[-1] % 10 == 0 and all(n % 10 for n in numbers[:-1])


def test_asking_for_more_counts_than_a_split_holds_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="'count' task has .* distinct 'test' examples, 100000 were asked"):
        load_task(COUNT_TASK, split_sizes={"test": 100_000}, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="'count-tens' task has 298 distinct 'test' examples, 1000 were asked"):
        load_task(COUNT_TENS_TASK, split_sizes={"test": 1000}, tokenizer=tokenizer)


@pytest.mark.parametrize("loader", [load_task, load_preference_task])
def test_unknown_task_name_raises_naming_it_and_the_known_ones(loader):
    with pytest.raises(ValueError, match="no-such-task") as error:
        loader("no-such-task")
    for name in TASKS:
        assert name in str(error.value)


@pytest.mark.parametrize("sizes", [{"dev": 5}, {"train": 0}, {"test": 2.5}])
def test_bad_split_sizes_raise(sizes):
    with pytest.raises(ValueError):
        load_task(split_sizes=sizes)


def test_exact_match_normalises_only_the_separator_trailing_whitespace_and_end_of_text():
    reference = "Thou art kind.\nAnd I another."
    assert exact_match(reference, reference)
    assert exact_match(" Thou art kind.\nAnd I another.<|endoftext|>", reference)
    assert exact_match("Thou art kind.\nAnd I another. \n", reference)
    assert exact_match("Thou art kind.\nAnd I another.<|endoftext|><|pad|><|pad|>", reference)
    assert exact_match(" Thou art kind.\nAnd I another.<|endoftext|>", f" {reference}{EOS_TEXT}")
    assert not exact_match("thou art kind.\nAnd I another.", reference)
    assert not exact_match("Thou art kind. And I another.", reference)
    assert not exact_match("Thou art  kind.\nAnd I another.", reference)
    assert not exact_match("Thou art kind.\nAnd I another", reference)
    assert not exact_match("Thou art kind.", reference)
    assert not exact_match("Thou art kind.\nAnd I another.\nAnd I", reference)


def test_task_accuracy_counts_exact_matches_and_refuses_mismatched_lists():
    assert task_accuracy(["a b", "c", "d<|endoftext|>", "x"], ["a b", "C", "d", "y"]) == 0.5
    with pytest.raises(ValueError):
        task_accuracy(["a"], ["a", "b"])
    with pytest.raises(ValueError):
        task_accuracy([], [])


def test_trl_sft_and_dpo_trainers_take_the_data_with_one_eos_per_completion(tokenizer, tmp_path):
    """TRL 1.16's own preparation: no second eos, the loss covers the completion and its eos only."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    sizes = {"train": 6}
    sft = load_task("verse-mixed", split_sizes=sizes, tokenizer=tokenizer)["train"]
    trainer = SFTTrainer(model=LlamaForCausalLM(config), train_dataset=sft, processing_class=tokenizer,
                         args=SFTConfig(output_dir=str(tmp_path / "sft"), use_cpu=True, report_to=[]))
    prepared = trainer.train_dataset
    for row, length in zip(prepared, response_lengths(sft, tokenizer)):
        assert row["input_ids"][-1] == 0 and row["input_ids"].count(0) == 1
        trained_on = [label for label in row["labels"] if label != -100]
        assert len(trained_on) == length + 1 and trained_on[-1] == 0

    preferences = load_preference_task("verse-mixed", split_sizes=sizes, tokenizer=tokenizer)["train"]
    dpo = DPOTrainer(model=LlamaForCausalLM(config), ref_model=LlamaForCausalLM(config), train_dataset=preferences,
                     processing_class=tokenizer, args=DPOConfig(output_dir=str(tmp_path / "dpo"), use_cpu=True,
                                                                report_to=[]))
    for row in dpo.train_dataset:
        assert 0 not in row["prompt_ids"]
        for column in ("chosen_ids", "rejected_ids"):
            assert row[column][-1] == 0 and row[column].count(0) == 1
