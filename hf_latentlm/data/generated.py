"""A generated language with an exact likelihood: a seeded hidden Markov model over words.

A document starts in a hidden state drawn from `start`; each state emits one word from its own sparse,
Zipf-shaped emission distribution and then moves to one of a few successor states or, with probability
1 / mean_document_length, to the end state, which emits ``<|endoftext|>``. The end state moves on as `start`
does, so documents packed one after another (as the training loop packs them) form one stationary Markov chain,
and the forward algorithm gives the true p(x_t | x_<t) at every position of any window of it: the optimum every
family is measured against (``docs/generated_language.md``).

Ids: 0 ``<|endoftext|>`` (bos/eos), 1 ``<|pad|>``, 2 ``<|unk|>`` (never emitted), then the words, which are the
embedded corpus's most frequent lowercase words, so a sample reads as word salad. Training documents are drawn
from per-document seeds (split, stream, index), so a stream never repeats, any document is reached without
drawing the ones before it, and the validation and test splits are fixed and disjoint from every training stream.

Imports numpy only (the tokenizer, built on demand, needs `tokenizers` and `transformers`).
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import json
import random
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from . import read_corpus_records

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|unk|>")
EOS_ID, PAD_ID, UNK_ID = 0, 1, 2
FIRST_WORD_ID = len(SPECIAL_TOKENS)
CORPUS_PREFIX = "generated:"  # `--corpus generated:LEVEL`
LANGUAGE_RECORD = "generated_language.json"  # written into every folder trained on the language
SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class LanguageSpec:
    """The knobs of a generated language; the same spec always builds the same language.

    num_states: hidden states (the end state comes on top). num_words: word vocabulary.
    words_per_state / successors_per_state: sparsity of the emissions and transitions.
    mean_document_length: expected words per document (the end probability is its inverse).
    word_zipf: how strongly states share the popular words (their pick weights fall as rank^-word_zipf); the more
        they share, the more context a model needs to tell the state. emission_zipf: the shape of one state's
        emission probabilities (rank^-emission_zipf over its own words). seed: of the construction.
    """

    num_states: int
    num_words: int
    words_per_state: int
    successors_per_state: int
    mean_document_length: float
    word_zipf: float = 1.0
    emission_zipf: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("num_states", "num_words", "words_per_state", "successors_per_state"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.words_per_state > self.num_words:
            raise ValueError(f"words_per_state {self.words_per_state} exceeds num_words {self.num_words}")
        if self.successors_per_state > self.num_states:
            raise ValueError(f"successors_per_state {self.successors_per_state} exceeds num_states {self.num_states}")
        if not self.mean_document_length > 1:
            raise ValueError(f"mean_document_length must exceed 1, got {self.mean_document_length}")


# Named difficulty levels. `easy` is what the suite's learning tests train on; `medium` is the equal-compute
# benchmark's language (docs/generated_language.md says how it was chosen); `hard` needs more context and data.
LEVELS: dict[str, LanguageSpec] = {
    "easy": LanguageSpec(num_states=8, num_words=48, words_per_state=4, successors_per_state=2,
                         mean_document_length=40.0, word_zipf=0.5, seed=1),
    "medium": LanguageSpec(num_states=32, num_words=256, words_per_state=8, successors_per_state=3,
                           mean_document_length=120.0, emission_zipf=1.5, seed=2),
    "hard": LanguageSpec(num_states=128, num_words=2048, words_per_state=16, successors_per_state=4,
                         mean_document_length=300.0, emission_zipf=1.2, seed=3),
}


@functools.lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """The embedded corpus's lowercase words, most frequent first (ties alphabetically)."""
    counts = collections.Counter(word for record in read_corpus_records() if record["split"] == "train"
                                 for word in re.findall(r"[a-z]+", record["text"].lower()))
    return tuple(word for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _cumulative(probs) -> list[float]:
    """Cumulative sums for `bisect` sampling, the last one exactly 1 so a draw in [0, 1) always lands."""
    cum = list(itertools.accumulate(float(p) for p in probs))
    cum[-1] = 1.0
    return cum


class GeneratedLanguage:
    """One hidden Markov language: documents, the exact next-token distribution, samples from it.

    Exact quantities are float64 arrays: `transitions` [S+1, S+1] (the last state is the end state), `emissions`
    [S+1, vocab_size], `start` and `stationary` [S+1] (the distribution of the state that emits the next token at
    a random position of the packed stream, the prior of any window)."""

    def __init__(self, spec: LanguageSpec, name: str | None = None):
        self.spec, self.name = spec, name
        words = corpus_words()
        if spec.num_words > len(words):
            raise ValueError(f"num_words {spec.num_words} exceeds the {len(words)} words of the embedded corpus")
        self.words = words[:spec.num_words]
        rng = np.random.default_rng(spec.seed)
        num_states, end = spec.num_states, spec.num_states
        pick = 1.0 / np.arange(1, spec.num_words + 1) ** spec.word_zipf
        shape = 1.0 / np.arange(1, spec.words_per_state + 1) ** spec.emission_zipf
        end_probability = 1.0 / spec.mean_document_length
        self.state_words, self.state_emissions, self.state_successors, self.state_moves = [], [], [], []
        for _ in range(num_states):
            chosen = rng.choice(spec.num_words, spec.words_per_state, replace=False, p=pick / pick.sum())
            self.state_words.append([FIRST_WORD_ID + int(w) for w in chosen])
            self.state_emissions.append(shape / shape.sum())
            successors = rng.choice(num_states, spec.successors_per_state, replace=False)
            self.state_successors.append([int(s) for s in successors] + [end])
            self.state_moves.append(np.append(rng.dirichlet(np.ones(len(successors))) * (1 - end_probability),
                                              end_probability))
        self.start = np.append(rng.dirichlet(np.ones(num_states)), 0.0)

        self.transitions = np.zeros((num_states + 1, num_states + 1))
        self.emissions = np.zeros((num_states + 1, self.vocab_size))
        for state in range(num_states):
            self.transitions[state, self.state_successors[state]] = self.state_moves[state]
            self.emissions[state, self.state_words[state]] = self.state_emissions[state]
        self.transitions[end] = self.start
        self.emissions[end, EOS_ID] = 1.0
        self.stationary = self._stationary()
        self._transition_cum = np.cumsum(self.transitions, axis=1)  # row-wise, for batched draws
        self._emission_cum_dense = np.cumsum(self.emissions, axis=1)
        self._start_cum = _cumulative(self.start[:num_states])
        self._emission_cum = [_cumulative(p) for p in self.state_emissions]
        self._move_cum = [_cumulative(p) for p in self.state_moves]

    # ---- construction helpers and records -------------------------------------------------------------------

    @classmethod
    def from_level(cls, level: str) -> "GeneratedLanguage":
        if level not in LEVELS:
            raise ValueError(f"unknown generated-language level {level!r}; choose one of {sorted(LEVELS)}")
        return cls(LEVELS[level], name=level)

    @classmethod
    def from_record(cls, record: dict) -> "GeneratedLanguage":
        known = {f.name for f in fields(LanguageSpec)}
        spec = record.get("spec")
        if not isinstance(spec, dict) or set(spec) - known:
            raise ValueError(f"not a generated-language record (spec fields {sorted(known)}): {record!r}")
        return cls(LanguageSpec(**spec), name=record.get("level"))

    @classmethod
    def from_folder(cls, folder: str | Path) -> "GeneratedLanguage | None":
        """The language a folder was trained on (its `generated_language.json`), or None when it records none."""
        path = Path(folder) / LANGUAGE_RECORD
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not readable JSON ({err})") from err
        return cls.from_record(record)

    def record(self) -> dict:
        return {"level": self.name, "spec": asdict(self.spec)}

    def save(self, folder: str | Path) -> None:
        """The record and the word-level tokenizer into `folder` (train with `--tokenizer folder`)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer().save_pretrained(str(folder))
        self.write_record(folder)

    def write_record(self, folder: str | Path, **extra) -> None:
        """`generated_language.json` in `folder`: the record (and `extra` fields, e.g. the training stream), which
        `from_folder` reads back."""
        (Path(folder) / LANGUAGE_RECORD).write_text(json.dumps({**self.record(), **extra}, indent=1) + "\n")

    @property
    def vocab_size(self) -> int:
        return FIRST_WORD_ID + self.spec.num_words

    def tokenizer(self):
        """A word-level `transformers` tokenizer: one token per word, ids as this language uses them."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *self.words))}
        backend = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[UNK_ID]))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
        return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=SPECIAL_TOKENS[EOS_ID],
                                       eos_token=SPECIAL_TOKENS[EOS_ID], pad_token=SPECIAL_TOKENS[PAD_ID],
                                       unk_token=SPECIAL_TOKENS[UNK_ID], clean_up_tokenization_spaces=False)

    # ---- drawing documents ----------------------------------------------------------------------------------

    def document(self, split: str, stream: int, index: int) -> list[int]:
        """Document `index` of `stream` of `split`: word ids ending with the end-of-document id. The same
        (split, stream, index) always gives the same document; different ones are independent draws."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        # A string seed goes through SHA-512 in `random`, so it is the same in every process and Python run.
        rng = random.Random(f"{self.spec}/{split}/{stream}/{index}")
        state, end, ids = bisect.bisect(self._start_cum, rng.random()), self.spec.num_states, []
        while state != end:
            ids.append(self.state_words[state][bisect.bisect(self._emission_cum[state], rng.random())])
            state = self.state_successors[state][bisect.bisect(self._move_cum[state], rng.random())]
        ids.append(EOS_ID)
        return ids

    def stream(self, split: str, num_tokens: int, stream: int = 0) -> list[int]:
        """The first `num_tokens` ids of `split`'s documents packed one after another."""
        ids: list[int] = []
        for index in itertools.count():
            if len(ids) >= num_tokens:
                return ids[:num_tokens]
            ids += self.document(split, stream, index)

    # ---- the exact distribution -----------------------------------------------------------------------------

    def _stationary(self) -> np.ndarray:
        """Left eigenvector of the transition matrix for eigenvalue 1 (the chain is irreducible: every state
        reaches the end state, which reaches every state)."""
        size = len(self.transitions)
        system = np.vstack([self.transitions.T - np.eye(size), np.ones(size)])
        solution = np.linalg.lstsq(system, np.append(np.zeros(size), 1.0), rcond=None)[0]
        return np.clip(solution, 0.0, None) / np.clip(solution, 0.0, None).sum()

    def _condition(self, prior: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bayes then one transition: (the distribution of the next emitting state after seeing `tokens` [P] from
        states distributed as `prior` [P, S+1], the probability of each token under `prior`). A row whose token
        is impossible keeps its prior."""
        posterior = prior * self.emissions[:, tokens].T
        total = posterior.sum(axis=1, keepdims=True)
        return np.where(total > 0, posterior / np.where(total > 0, total, 1.0), prior) @ self.transitions, total[:, 0]

    def _observe(self, prior: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """`_condition`'s next-state distribution; ValueError when a token is impossible (a context the language
        cannot produce has no true continuation)."""
        following, total = self._condition(prior, tokens)
        if (total <= 0).any():
            raise ValueError("a context has probability 0 under this language (a token no state emits there)")
        return following

    def position_probs(self, rows) -> np.ndarray:
        """[N, T, vocab] with [n, t] = p(x_{t+1} | rows[n, :t+1]), each row a window of the packed stream (prior:
        the stationary distribution): what a causal LM's logits at position t predict."""
        rows = np.asarray(rows, dtype=np.int64)
        prior = np.broadcast_to(self.stationary, (rows.shape[0], len(self.stationary)))
        out = np.empty((*rows.shape, self.vocab_size))
        for t in range(rows.shape[1]):
            prior = self._observe(prior, rows[:, t])
            out[:, t] = prior @ self.emissions
        return out

    def next_state_probs(self, contexts) -> np.ndarray:
        """[P, S+1]: the distribution of the state that emits the token after each context row."""
        contexts = np.asarray(contexts, dtype=np.int64)
        prior = np.broadcast_to(self.stationary, (contexts.shape[0], len(self.stationary)))
        for t in range(contexts.shape[1]):
            prior = self._observe(prior, contexts[:, t])
        return np.ascontiguousarray(prior)

    def continuation_probs(self, contexts, continuations, states: np.ndarray | None = None) -> np.ndarray:
        """[P, n] with [p, k] = the true probability of continuations[p, :k+1] right after contexts[p] (0 from the
        first token the language cannot emit there on). `states`: `next_state_probs(contexts)`, when the caller
        already has it."""
        continuations = np.asarray(continuations, dtype=np.int64)
        prior = self.next_state_probs(contexts) if states is None else states
        out = np.empty(continuations.shape)
        running = np.ones(len(continuations))
        for k in range(continuations.shape[1]):
            prior, probability = self._condition(prior, continuations[:, k])
            running = running * probability
            out[:, k] = running
        return out

    def unigram_probs(self) -> np.ndarray:
        """The marginal token distribution of the packed stream: the best model that ignores the prefix."""
        return self.stationary @ self.emissions

    def sample_unigram(self, uniforms) -> np.ndarray:
        """[P, n] ids drawn from `unigram_probs()` independently, one per uniform in [0, 1)."""
        uniforms = np.asarray(uniforms, dtype=np.float64)
        cumulative = np.broadcast_to(np.cumsum(self.unigram_probs()), (uniforms.size, self.vocab_size))
        return _draw(cumulative, uniforms.reshape(-1)).reshape(uniforms.shape)

    def sample_continuations(self, contexts, uniforms) -> np.ndarray:
        """[P, n] ids drawn from the true distribution after each context row, from `uniforms` [P, 2n] in [0, 1)
        (two per token: the emitting state, then its word)."""
        uniforms = np.asarray(uniforms, dtype=np.float64)
        states = self.next_state_probs(contexts)
        out = np.empty((uniforms.shape[0], uniforms.shape[1] // 2), dtype=np.int64)
        current = _draw(np.cumsum(states, axis=1), uniforms[:, 0])
        for n in range(out.shape[1]):
            if n:
                current = _draw(self._transition_cum[current], uniforms[:, 2 * n])
            out[:, n] = _draw(self._emission_cum_dense[current], uniforms[:, 2 * n + 1])
        return out

    def conditional_entropy(self, num_tokens: int = 200_000, split: str = "validation") -> float:
        """Nats per token: the mean entropy of p(x_t | x_<t) along the first `num_tokens` of `split` (one
        forward pass from the stationary prior): the entropy rate, estimated without sampling noise in the
        per-position term."""
        ids = np.asarray(self.stream(split, num_tokens), dtype=np.int64)
        prior, total = self.stationary[None], 0.0
        for token in ids:
            probs = prior @ self.emissions
            total -= float(np.sum(probs * np.log(np.where(probs > 0, probs, 1.0))))
            prior = self._observe(prior, np.array([token]))
        return total / len(ids)


def _draw(cumulative: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Row-wise categorical draws: the first index whose cumulative probability exceeds the uniform."""
    index = (cumulative <= uniforms[:, None] * cumulative[:, -1:]).sum(axis=1)
    return np.minimum(index, cumulative.shape[1] - 1)


def parse_corpus(corpus: str | None) -> GeneratedLanguage | None:
    """`generated:LEVEL` -> that language; None (or "shakespeare") -> None, the embedded corpus."""
    if corpus is None or corpus == "shakespeare":
        return None
    if not corpus.startswith(CORPUS_PREFIX):
        raise ValueError(f"unknown corpus {corpus!r}; expected 'shakespeare' or "
                         f"'{CORPUS_PREFIX}LEVEL' with LEVEL one of {sorted(LEVELS)}")
    return GeneratedLanguage.from_level(corpus[len(CORPUS_PREFIX):])
