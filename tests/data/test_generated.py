"""The generated language: exact probabilities against independent references (brute-force enumeration,
binomial error of sampled frequencies), determinism of its streams, its tokenizer."""

import itertools
import math

import numpy as np
import pytest

from hf_latentlm.data.generated import (
    EOS_ID,
    FIRST_WORD_ID,
    LEVELS,
    GeneratedLanguage,
    LanguageSpec,
    parse_corpus,
)

TINY = LanguageSpec(num_states=3, num_words=4, words_per_state=2, successors_per_state=2, mean_document_length=3.0,
                    seed=5)


@pytest.fixture(scope="module")
def tiny():
    return GeneratedLanguage(TINY)


@pytest.fixture(scope="module")
def easy():
    return GeneratedLanguage.from_level("easy")


def brute_force_probability(language, tokens, prior):
    """p(x_1..x_n) by summing over every hidden path, from the sparse per-state lists (not the dense matrices)."""
    end = language.spec.num_states
    states = range(end + 1)

    def emit(state, token):
        if state == end:
            return 1.0 if token == EOS_ID else 0.0
        words = language.state_words[state]
        return float(language.state_emissions[state][words.index(token)]) if token in words else 0.0

    def move(state, nxt):
        if state == end:
            return float(language.start[nxt])
        successors = language.state_successors[state]
        return float(language.state_moves[state][successors.index(nxt)]) if nxt in successors else 0.0

    total = 0.0
    for path in itertools.product(states, repeat=len(tokens)):
        p = prior[path[0]] * emit(path[0], tokens[0])
        for t in range(1, len(tokens)):
            p *= move(path[t - 1], path[t]) * emit(path[t], tokens[t])
        total += p
    return total


def test_forward_algorithm_equals_enumeration_over_hidden_paths(tiny):
    vocab = [EOS_ID, *range(FIRST_WORD_ID, tiny.vocab_size)]
    rng = np.random.default_rng(0)
    sequences = [tiny.stream("validation", 5)] + [list(rng.choice(vocab, 5)) for _ in range(20)]
    checked = 0
    for seq in sequences:
        if brute_force_probability(tiny, seq, tiny.stationary) == 0:
            continue
        probs = tiny.position_probs(np.array([seq]))[0]
        for t in range(len(seq)):
            prefix = brute_force_probability(tiny, seq[:t + 1], tiny.stationary)
            for token in vocab:
                expected = brute_force_probability(tiny, [*seq[:t + 1], token], tiny.stationary) / prefix
                assert probs[t, token] == pytest.approx(expected, abs=1e-12)
        checked += 1
    assert checked >= 3
    # The very first token, before any context: the stationary state distribution's emissions.
    first = {tok: brute_force_probability(tiny, [tok], tiny.stationary) for tok in vocab}
    assert tiny.unigram_probs()[vocab] == pytest.approx([first[t] for t in vocab], abs=1e-12)


def test_stationary_distribution_is_left_fixed_point(easy):
    assert np.allclose(easy.stationary @ easy.transitions, easy.stationary, atol=1e-12)
    assert easy.stationary.sum() == pytest.approx(1.0)
    assert np.allclose(easy.transitions.sum(axis=1), 1.0) and np.allclose(easy.emissions.sum(axis=1), 1.0)


def test_sampled_document_frequencies_match_exact_marginals_within_binomial_error(easy):
    """First and first-two tokens of independent documents: multinomial counts whose exact probabilities come
    from the dense matrices (start @ B, and the joint of two steps), so sampler and matrices check each other."""
    n = 20000
    docs = [easy.document("train", 7, i) for i in range(n)]
    start = easy.start
    first_exact = start @ easy.emissions
    # p(x1, x2) = sum_s start(s) B(s, x1) sum_s' A(s, s') B(s', x2)
    joint = (start[:, None] * easy.emissions).T @ (easy.transitions @ easy.emissions)
    first = np.bincount([d[0] for d in docs], minlength=easy.vocab_size) / n
    pairs = np.zeros_like(joint)
    for d in docs:
        pairs[d[0], d[1]] += 1.0 / n
    for observed, exact in ((first, first_exact), (pairs, joint)):
        sigma = np.sqrt(exact * (1 - exact) / n)
        assert np.all(np.abs(observed - exact) <= 5 * sigma + 1e-12), np.max(np.abs(observed - exact) / (sigma + 1e-12))
    lengths = np.array([len(d) - 1 for d in docs])
    assert all(d[-1] == EOS_ID and EOS_ID not in d[:-1] for d in docs[:500])
    # Words per document are geometric with mean mean_document_length.
    assert abs(lengths.mean() - easy.spec.mean_document_length) < 5 * lengths.std() / math.sqrt(n)


def test_streams_are_deterministic_and_disjoint(easy):
    assert easy.document("train", 0, 3) == GeneratedLanguage.from_level("easy").document("train", 0, 3)
    train = easy.stream("train", 2000)
    assert train != easy.stream("train", 2000, stream=1)
    assert train != easy.stream("validation", 2000) != easy.stream("test", 2000)
    with pytest.raises(ValueError, match="unknown split"):
        easy.document("dev", 0, 0)


def test_sampled_continuations_follow_the_exact_next_token_distribution(easy):
    """Many draws after one fixed context: the first drawn token's frequencies match position_probs."""
    context = np.array([easy.stream("validation", 12)])
    n = 20000
    uniforms = np.random.default_rng(1).random((n, 4))
    draws = easy.sample_continuations(np.repeat(context, n, axis=0), uniforms)
    exact = easy.position_probs(context)[0, -1]
    observed = np.bincount(draws[:, 0], minlength=easy.vocab_size) / n
    assert np.all(np.abs(observed - exact) <= 5 * np.sqrt(exact * (1 - exact) / n) + 1e-12)


def test_tokenizer_maps_each_word_to_its_id_and_round_trips(easy):
    tok = easy.tokenizer()
    assert len(tok) == easy.vocab_size and tok.eos_token_id == EOS_ID and tok.pad_token_id == 1
    ids = easy.stream("validation", 50)
    words = [i for i in ids if i != EOS_ID]
    text = tok.decode(words)
    assert tok(text, add_special_tokens=False)["input_ids"] == words
    assert tok.convert_ids_to_tokens(FIRST_WORD_ID) == easy.words[0]


def test_record_round_trip_and_bad_input(tmp_path, easy):
    easy.save(tmp_path)
    again = GeneratedLanguage.from_folder(tmp_path)
    assert again.spec == easy.spec and again.name == "easy"
    assert GeneratedLanguage.from_folder(tmp_path / "nowhere") is None
    assert parse_corpus(None) is None and parse_corpus("shakespeare") is None
    assert parse_corpus("generated:easy").spec == LEVELS["easy"]
    with pytest.raises(ValueError, match="unknown generated-language level 'nope'"):
        parse_corpus("generated:nope")
    with pytest.raises(ValueError, match="unknown corpus"):
        parse_corpus("wiki")
    with pytest.raises(ValueError, match="words_per_state 9 exceeds num_words 4"):
        LanguageSpec(num_states=2, num_words=4, words_per_state=9, successors_per_state=1, mean_document_length=5.0)
    with pytest.raises(ValueError, match="mean_document_length"):
        LanguageSpec(num_states=2, num_words=4, words_per_state=2, successors_per_state=1, mean_document_length=1.0)
