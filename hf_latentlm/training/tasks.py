"""Offline instruction tasks for SFT and DPO post-training, built by code from fixed seeds
(docs/post_training_tasks.md).

Every task has a long, deterministic, exactly scored answer: ``repeat`` / ``reverse`` a passage of verse from the
packaged corpus (:data:`VERSE_TASKS`; split ``s`` is drawn from the corpus split ``s``, so test prompts come from
unseen works), ``count`` ("Count from 37 to 52:") and ``count-tens`` (counts that stop at the next multiple of ten);
count pairs are split by a stable hash. Formats are TRL's plain-text "prompt/completion" and "preference":
``prompt`` = ``"User: {instruction}\\n\\nAssistant:"``, ``completion`` = ``" {response}<|endoftext|>"``. The space
starts the completion because the byte-level BPE glues a space to the word after it: the tokenized prompt is then a
prefix of the tokenized prompt + completion, which TRL's trainers need to split the two.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from datasets import Dataset, DatasetDict

from hf_latentlm.training.corpus import CORPUS_SPLITS, load_corpus_documents, load_default_tokenizer

EOS_TEXT = "<|endoftext|>"
"""The default tokenizer's end-of-text token (id 0), written out at the end of every completion."""

DEFAULT_TASK = "verse-repeat"
DEFAULT_SPLIT_SIZES: Mapping[str, int] = {"train": 2000, "test": 200}
MIN_RESPONSE_TOKENS = 24
"""Shortest response (tokens of ``" {response}"``, end-of-text excluded) a task example may have."""

SHORTER_REJECTED_KINDS = ("truncated", "dropped_word")
LONGER_REJECTED_KINDS = ("duplicated_word", "extra_line")
REJECTED_KINDS = SHORTER_REJECTED_KINDS + LONGER_REJECTED_KINDS
"""How a rejected answer is wrong: half are shorter than the chosen one, half longer, so a DPO length bias shows."""

# A verse line: short enough that it is not wrapped prose (the corpus wraps prose at ~70 characters), long enough
# to carry a few words. Passages stop growing at this many lines; they reach 24 tokens well before it.
_LINE_CHARS = (20, 60)
_LINE_WORDS = (4, 12)
_MAX_PASSAGE_LINES = 8
_MAX_ATTEMPTS_PER_EXAMPLE = 50


@dataclass(frozen=True)
class TaskKind:
    """One instruction: its wording and the deterministic map from the passage's lines to the response's lines."""

    name: str
    instruction: str
    transform: Callable[[Sequence[str]], list[str]]


TASK_KINDS: dict[str, TaskKind] = {
    "repeat": TaskKind("repeat", "Repeat these lines exactly:", list),
    "reverse": TaskKind("reverse", "Reverse the order of the words in each line:",
                        lambda lines: [" ".join(reversed(line.split())) for line in lines]),
}

VERSE_TASKS: dict[str, tuple[str, ...]] = {
    "verse-repeat": ("repeat",),
    "verse-reverse": ("reverse",),
    "verse-mixed": ("repeat", "reverse"),
}
"""Verse task name -> the instruction kinds its examples are drawn from (in equal shares)."""

COUNT_TASK = "count"
COUNT_INSTRUCTION = "Count from {start} to {stop}:"
COUNT_STARTS = (1, 499)
"""Smallest and largest first number of a count."""
COUNT_LENGTHS = (8, 20)
"""Fewest and most numbers in a count (before growing it to ``min_response_tokens``)."""
COUNT_TENS_TASK = "count-tens"
COUNT_TENS_STARTS = (11, 9993)
"""Smallest and largest first number of a ``count-tens`` count; only starts ending in 1, 2 or 3 are used."""
COUNT_TASKS: tuple[str, ...] = (COUNT_TASK, COUNT_TENS_TASK)
_COUNT_SPLIT_BUCKETS = {"test": 0, "validation": 1}
"""A (start, length) pair belongs to split s when its stable hash mod 10 is this; every other bucket is "train"."""

TASKS: tuple[str, ...] = (*VERSE_TASKS, *COUNT_TASKS)
"""Every task name :func:`load_task` and :func:`load_preference_task` accept."""


# ---------------------------------------------------------------------------------------------------------------------
# Template and scoring
# ---------------------------------------------------------------------------------------------------------------------

def format_prompt(instruction: str) -> str:
    """The ``prompt`` column: the template up to and including ``"Assistant:"`` (no trailing space)."""
    return f"User: {instruction}\n\nAssistant:"


def format_completion(response: str) -> str:
    """The ``completion`` / ``chosen`` / ``rejected`` text: separating space, response, end-of-text."""
    return f" {response}{EOS_TEXT}"


def _normalise_answer(text: str) -> str:
    # Whatever a batch decode prints after the first end-of-text marker is padding.
    return text.split(EOS_TEXT, 1)[0].removeprefix(" ").rstrip()


def exact_match(prediction: str, reference: str) -> bool:
    """Whether a decoded prediction is exactly the reference response.

    Both sides lose everything from the first ``<|endoftext|>`` on, one leading space (the template's separator
    after ``"Assistant:"``, so a completion-format text can be compared with the bare ``response``) and trailing
    whitespace. Nothing else is normalised: case, punctuation, inner spacing and line breaks must all match.
    """
    return _normalise_answer(prediction) == _normalise_answer(reference)


def task_accuracy(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of predictions that :func:`exact_match` their reference (ValueError for unequal or empty lists)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        raise ValueError("task_accuracy needs at least one prediction")
    return sum(exact_match(p, r) for p, r in zip(predictions, references)) / len(references)


def partial_credit(prediction: str, reference: str) -> float:
    """The fraction of the reference's words (whitespace-separated: the numbers of a count, the words of a verse
    passage) that the prediction has at the same index, over the longer of the two word counts, after the
    normalisation of :func:`exact_match`. 1.0 exactly when the words match; a missing, extra or shifted word
    costs its share, so a count that stops early or runs on scores below 1."""
    predicted, wanted = _normalise_answer(prediction).split(), _normalise_answer(reference).split()
    if not predicted and not wanted:
        return 1.0
    return sum(p == w for p, w in zip(predicted, wanted)) / max(len(predicted), len(wanted))


def _completion_text(completion) -> str:
    # TRL hands a reward function plain strings, or [{"role": "assistant", "content": ...}] for conversational data.
    return completion[-1]["content"] if isinstance(completion, list) else completion


def exact_match_reward(completions, response, **kwargs) -> list[float]:
    """TRL reward function (GRPO): 1.0 where the completion is exactly the row's ``response`` column, else 0.0."""
    return [float(exact_match(_completion_text(c), r)) for c, r in zip(completions, response)]


def partial_credit_reward(completions, response, **kwargs) -> list[float]:
    """TRL reward function (GRPO): :func:`partial_credit` of each completion against the row's ``response``."""
    return [partial_credit(_completion_text(c), r) for c, r in zip(completions, response)]


def response_lengths(dataset: Dataset, tokenizer, column: str = "completion") -> list[int]:
    """Token count of each row's ``column`` text with its trailing ``<|endoftext|>`` left out.

    For ``completion``, ``chosen`` or ``rejected`` this is the number of tokens the model must generate before the
    end-of-text token (the separating space included); its mean is the task's mean response length.
    """
    texts = [text.removesuffix(EOS_TEXT) for text in dataset[column]]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# ---------------------------------------------------------------------------------------------------------------------
# Verse passages
# ---------------------------------------------------------------------------------------------------------------------

def _is_verse_line(line: str) -> bool:
    """A line of spoken verse, not a speaker name, heading, stage direction, cast list entry or wrapped prose."""
    words = line.split()
    if not (_LINE_CHARS[0] <= len(line) <= _LINE_CHARS[1] and _LINE_WORDS[0] <= len(words) <= _LINE_WORDS[1]):
        return False
    if not line[0].isupper() or "  " in line or any(c in line for c in "[]_"):
        return False
    first_word_letters = "".join(c for c in words[0] if c.isalpha())
    # "DUNCAN, King of Scotland." or "SCENE III. A heath." start with an all-capitals word; "I'll" and "O," do not.
    return not (len(first_word_letters) > 1 and first_word_letters.isupper())


@lru_cache(maxsize=len(CORPUS_SPLITS))
def verse_runs(corpus_split: str) -> tuple[tuple[str, ...], ...]:
    """Maximal runs of consecutive verse lines (one speech or part of it) in the works of ``corpus_split``."""
    runs: list[tuple[str, ...]] = []
    for document in load_corpus_documents(corpus_split):
        run: list[str] = []
        in_stage_direction = False
        for raw_line in document.split("\n") + [""]:  # the blank line at the end closes the last run
            line = raw_line.strip()
            # Stage directions are bracketed and may span lines: "[Enter BERTRAM, ... all\nin black.]".
            if line.startswith("["):
                in_stage_direction = True
            verse = not in_stage_direction and _is_verse_line(line)
            if in_stage_direction and "]" in line:
                in_stage_direction = False
            if verse:
                run.append(line)
            else:
                if len(run) >= 3:  # two lines to show and one to continue with (the "extra_line" rejection)
                    runs.append(tuple(run))
                run = []
    return tuple(runs)


@dataclass(frozen=True)
class _Example:
    kind: str
    instruction: str
    response_lines: tuple[str, ...]
    # The answer carried one step too far, for a plausible "extra_line" rejection: the passage with the play's next
    # line added and transformed alike, or the count with the next number.
    overrun: str
    key: tuple  # what must not repeat within or across splits: the passage, or (start, stop)

    @property
    def response(self) -> str:
        return "\n".join(self.response_lines)


def _response_tokens(tokenizer, response: str) -> int:
    """Tokens of the completion of ``response`` without its end-of-text: ``" {response}"``."""
    return len(tokenizer(format_completion(response).removesuffix(EOS_TEXT), add_special_tokens=False)["input_ids"])


def _sample_examples(kinds: Sequence[TaskKind], corpus_split: str, size: int, rng: random.Random,
                     kind_rng: random.Random, tokenizer, min_response_tokens: int,
                     excluded_passages: set[tuple[str, ...]]) -> list[_Example]:
    """``size`` distinct passages of ``corpus_split``, each grown until its response is long enough.

    Passages are drawn from ``rng`` and instruction kinds from ``kind_rng``, one after the other, so a larger
    ``size`` extends a smaller one's examples instead of reshuffling them.
    """
    runs = verse_runs(corpus_split)
    # Every line that has at least two more lines after it in its run can start a passage.
    starts = [(r, i) for r, run in enumerate(runs) for i in range(len(run) - 2)]
    if not starts:
        raise ValueError(f"corpus split {corpus_split!r} has no verse passages")
    kind_order = balanced_order(kinds, size, kind_rng)
    examples: list[_Example] = []
    used = set(excluded_passages)
    attempts = 0
    while len(examples) < size:
        attempts += 1
        if attempts > _MAX_ATTEMPTS_PER_EXAMPLE * size:
            raise ValueError(
                f"could not draw {size} distinct passages with >= {min_response_tokens} response tokens from "
                f"corpus split {corpus_split!r}; ask for fewer examples or a shorter minimum"
            )
        kind = kind_order[len(examples)]
        run_index, start = rng.choice(starts)
        run = runs[run_index]
        for end in range(start + 2, min(len(run), start + _MAX_PASSAGE_LINES + 1)):
            passage = run[start:end]  # end < len(run): a next line exists
            response_lines = tuple(kind.transform(passage))
            if _response_tokens(tokenizer, "\n".join(response_lines)) >= min_response_tokens:
                break
        else:
            continue  # the run ends (or the cap is hit) before the response is long enough
        if passage in used:
            continue
        used.add(passage)
        examples.append(_Example(kind.name, kind.instruction + "\n" + "\n".join(passage), response_lines,
                                 "\n".join(kind.transform(passage + (run[end],))), passage))
    return examples


def count_response(start: int, stop: int) -> str:
    """The numbers from ``start`` to ``stop`` inclusive, separated by single spaces."""
    return " ".join(str(n) for n in range(start, stop + 1))


def count_split(start: int, length: int) -> str:
    """The split a (start, length) count belongs to, from a hash that is stable across processes."""
    bucket = zlib.crc32(f"{start}/{length}".encode()) % 10
    return next((split for split, b in _COUNT_SPLIT_BUCKETS.items() if b == bucket), "train")


def _count_pool(name: str, split: str) -> list[tuple[int, int]]:
    """The (start, stop) pairs a counting task may draw for ``split``, in a fixed order (before shuffling)."""
    if name == COUNT_TASK:
        return [(start, start + length - 1) for start in range(COUNT_STARTS[0], COUNT_STARTS[1] + 1)
                for length in range(COUNT_LENGTHS[0], COUNT_LENGTHS[1] + 1) if count_split(start, length) == split]
    # count-tens: the stop is the first multiple of ten after the start.
    pairs = [(start, start - start % 10 + 10) for start in range(COUNT_TENS_STARTS[0], COUNT_TENS_STARTS[1] + 1)
             if start % 10 in (1, 2, 3)]
    return [(start, stop) for start, stop in pairs if count_split(start, stop - start + 1) == split]


def _sample_count_examples(name: str, split: str, size: int, rng: random.Random, tokenizer,
                           min_response_tokens: int, excluded: set[tuple]) -> list[_Example]:
    """``size`` distinct counts of ``split`` in a seeded order (a shuffle of the split's pool, so a larger ``size``
    extends a smaller one's examples). A ``count`` too short grows one number at a time; a ``count-tens`` one is
    left out, since growing it would carry it past its multiple of ten."""
    pool = _count_pool(name, split)
    rng.shuffle(pool)
    examples: list[_Example] = []
    used = set(excluded)

    def too_short(start, stop):
        return _response_tokens(tokenizer, count_response(start, stop)) < min_response_tokens

    for start, stop in pool:
        if len(examples) == size:
            break
        if name == COUNT_TENS_TASK and too_short(start, stop):
            continue
        while too_short(start, stop):
            stop += 1
        if (start, stop) in used:
            continue  # two lengths that grew to the same stop
        used.add((start, stop))
        examples.append(_Example(COUNT_TASK, COUNT_INSTRUCTION.format(start=start, stop=stop),
                                 (count_response(start, stop),), count_response(start, stop + 1), (start, stop)))
    if len(examples) < size:
        raise ValueError(f"the {name!r} task has {len(examples)} distinct {split!r} examples, "
                         f"{size} were asked for")
    return examples


def balanced_order(items: Sequence, size: int, rng: random.Random) -> list:
    """``size`` items in equal shares (to within one), each block of ``len(items)`` a seeded permutation.

    Block by block rather than one shuffle of the whole list, so the first n of a longer order are the order of
    length n: asking for more examples never changes the earlier ones.
    """
    order: list = []
    while len(order) < size:
        order.extend(rng.sample(list(items), len(items)))
    return order[:size]


def _split_rng(name: str, split: str, seed: int, purpose: str) -> random.Random:
    # A string seed is hashed with SHA-512 by `random`, so it is stable across processes and Python hash seeds;
    # each split and purpose gets its own stream, so e.g. the test size never changes the train examples.
    return random.Random(f"hf_latentlm.tasks/{name}/{split}/{seed}/{purpose}")


def _check_request(name: str, split_sizes: Mapping[str, int] | None) -> dict[str, int]:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    sizes = dict(DEFAULT_SPLIT_SIZES if split_sizes is None else split_sizes)
    for split, size in sizes.items():
        if split not in CORPUS_SPLITS:
            raise ValueError(f"unknown split {split!r}; splits are drawn from the corpus splits {CORPUS_SPLITS}")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"split {split!r} needs a positive integer size, got {size!r}")
    return sizes


def _build_examples(name: str, sizes: Mapping[str, int], seed: int, min_response_tokens: int,
                    tokenizer) -> dict[str, list[_Example]]:
    # "train" first, so the other splits can leave out any passage it used (they come from other works anyway).
    order = sorted(sizes, key=lambda split: split != "train")
    used: set[tuple] = set()
    examples = {}
    for split in order:
        if name in COUNT_TASKS:
            examples[split] = _sample_count_examples(name, split, sizes[split], _split_rng(name, split, seed, "counts"),
                                                     tokenizer, min_response_tokens, used)
        else:
            examples[split] = _sample_examples(
                [TASK_KINDS[k] for k in VERSE_TASKS[name]], split, sizes[split],
                _split_rng(name, split, seed, "passages"), _split_rng(name, split, seed, "kinds"), tokenizer,
                min_response_tokens, used,
            )
        used.update(example.key for example in examples[split])
    return {split: examples[split] for split in sizes}


def load_task(name: str = DEFAULT_TASK, split_sizes: Mapping[str, int] | None = None, seed: int = 0,
              min_response_tokens: int = MIN_RESPONSE_TOKENS, tokenizer=None) -> DatasetDict:
    """The SFT data of task ``name``: one split per key of ``split_sizes`` (default train 2000, test 200).

    Each split ``s`` of a verse task is drawn from the corpus split ``s`` ("train", "validation" or "test"), so a
    test split's prompts come from works never seen in training; the ``count`` task's splits hold disjoint
    (start, stop) pairs (:func:`count_split`). Columns: ``prompt``, ``completion`` (TRL's prompt/completion format,
    see the module docstring), ``instruction`` (the user's text), ``response`` (the bare reference answer for
    :func:`exact_match`) and ``kind`` ("repeat", "reverse" or "count"). The same ``seed`` gives identical datasets.
    ``tokenizer`` (default: the packaged one) measures ``min_response_tokens``. ValueError for an unknown task or
    split, a size that is not a positive integer, or more ``count`` examples than the split has.
    """
    sizes = _check_request(name, split_sizes)
    tokenizer = load_default_tokenizer() if tokenizer is None else tokenizer
    examples = _build_examples(name, sizes, seed, min_response_tokens, tokenizer)
    return DatasetDict({split: Dataset.from_dict({"prompt": [format_prompt(e.instruction) for e in rows],
                                                  "completion": [format_completion(e.response) for e in rows],
                                                  **_metadata_columns(rows)})
                        for split, rows in examples.items()})


def _metadata_columns(rows: Sequence[_Example]) -> dict[str, list[str]]:
    return {"instruction": [e.instruction for e in rows], "response": [e.response for e in rows],
            "kind": [e.kind for e in rows]}


# ---------------------------------------------------------------------------------------------------------------------
# Preference pairs
# ---------------------------------------------------------------------------------------------------------------------

def _join_lines(word_lines: Sequence[Sequence[str]]) -> str:
    return "\n".join(" ".join(words) for words in word_lines if words)


def _wrong_response(example: _Example, rejected_kind: str, rng: random.Random) -> str:
    """A plausible wrong answer of the given kind (whole words only, so the tokens change where the words do)."""
    word_lines = [line.split() for line in example.response_lines]
    positions = [(li, wi) for li, words in enumerate(word_lines) for wi in range(len(words))]
    if rejected_kind == "truncated":
        # Stop early at a word boundary in the second half, as if generation ended too soon.
        keep = rng.randrange(len(positions) // 2, len(positions))
        kept = [[] for _ in word_lines]
        for li, wi in positions[:keep]:
            kept[li].append(word_lines[li][wi])
        return _join_lines(kept)
    if rejected_kind == "dropped_word":
        li, wi = rng.choice(positions[:-1])  # not the last word: that would be a truncation
        word_lines[li].pop(wi)
        return _join_lines(word_lines)
    if rejected_kind == "duplicated_word":
        li, wi = rng.choice(positions)
        word_lines[li].insert(wi, word_lines[li][wi])
        return _join_lines(word_lines)
    if rejected_kind == "extra_line":
        # Carry on one step too far (the play's next line, the next number), as if the answer did not stop.
        return example.overrun
    raise ValueError(f"unknown rejected kind {rejected_kind!r}; expected one of {REJECTED_KINDS}")


def _rejected_for(example: _Example, rejected_kind: str, rng: random.Random, tokenizer) -> str:
    """A wrong answer of ``rejected_kind`` that is strictly shorter (or longer) in tokens than the right one."""
    chosen_tokens = _response_tokens(tokenizer, example.response)
    want_shorter = rejected_kind in SHORTER_REJECTED_KINDS
    for _ in range(_MAX_ATTEMPTS_PER_EXAMPLE):
        wrong = _wrong_response(example, rejected_kind, rng)
        tokens = _response_tokens(tokenizer, wrong)
        if not exact_match(wrong, example.response) and (tokens < chosen_tokens if want_shorter
                                                         else tokens > chosen_tokens):
            return wrong
    # Input-driven (the caller's tokenizer measures the lengths, `seed` picks the wrong words): a ValueError, as for
    # the other bad requests the CLI reports.
    raise ValueError(f"no {rejected_kind!r} rejection of {example.response!r} found in {_MAX_ATTEMPTS_PER_EXAMPLE} "
                     f"attempts whose token count is strictly {'below' if want_shorter else 'above'} the chosen "
                     f"answer's ({chosen_tokens} tokens) under this tokenizer; try another seed or tokenizer")


def load_preference_task(name: str = DEFAULT_TASK, split_sizes: Mapping[str, int] | None = None, seed: int = 0,
                         min_response_tokens: int = MIN_RESPONSE_TOKENS, tokenizer=None) -> DatasetDict:
    """The DPO data of task ``name``: the examples of :func:`load_task` (same prompts) as preference pairs.

    Columns: ``prompt``, ``chosen`` (exactly the SFT ``completion``), ``rejected`` (a wrong answer in the same
    completion form), ``rejected_kind`` (one of :data:`REJECTED_KINDS`, in equal shares), ``instruction``,
    ``response`` (the reference) and ``kind``. ``truncated`` / ``dropped_word`` rejections have strictly fewer
    tokens than the chosen answer and ``duplicated_word`` / ``extra_line`` strictly more, so a preference that
    merely tracks length is right on one half and wrong on the other. ValueError as :func:`load_task`, or when no
    rejection of an example's kind has the required token count under ``tokenizer``.
    """
    sizes = _check_request(name, split_sizes)
    tokenizer = load_default_tokenizer() if tokenizer is None else tokenizer
    examples = _build_examples(name, sizes, seed, min_response_tokens, tokenizer)
    splits = {}
    for split, rows in examples.items():
        rng = _split_rng(name, split, seed, "rejected")
        rejected_kinds = balanced_order(REJECTED_KINDS, len(rows), _split_rng(name, split, seed, "rejected kinds"))
        rejected = [_rejected_for(e, kind, rng, tokenizer) for e, kind in zip(rows, rejected_kinds)]
        splits[split] = Dataset.from_dict({
            "prompt": [format_prompt(e.instruction) for e in rows],
            "chosen": [format_completion(e.response) for e in rows],
            "rejected": [format_completion(wrong) for wrong in rejected],
            "rejected_kind": rejected_kinds,
            **_metadata_columns(rows),
        })
    return DatasetDict(splits)
