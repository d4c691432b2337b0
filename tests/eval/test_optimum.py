"""Measuring against a generated language's optimum: the harness's estimates against closed forms computed from
the exact distribution, on stub models whose distributions are known."""

import numpy as np
import pytest
import torch
from transformers.modeling_outputs import CausalLMOutput

from hf_latentlm.data.generated import GeneratedLanguage
from hf_latentlm.eval.brier import brier_position_terms, summarize_brier
from hf_latentlm.eval.optimum import (
    LanguageReference,
    evaluate_against_optimum,
    evaluation_stream,
    likelihood_against_optimum,
    optimum_position_terms,
)
from hf_latentlm.eval.sampling import evaluation_windows


@pytest.fixture(scope="module")
def easy():
    return GeneratedLanguage.from_level("easy")


class Mixture(torch.nn.Module):
    """Draws each continuation from the true language with probability `weight`, else from its unigram: a model
    whose Brier-1 has a closed form. Its logits are the log of the mixed next-token distribution."""

    def __init__(self, language, weight):
        super().__init__()
        self.true, self.unigram, self.weight = LanguageReference(language), LanguageReference(language, "unigram"), weight
        self.config, self.device = self.true.config, self.true.device

    def generate(self, input_ids, **kwargs):
        pick_true = torch.rand(input_ids.shape[0]) < self.weight
        a, b = self.true.generate(input_ids, **kwargs), self.unigram.generate(input_ids, **kwargs)
        return torch.where(pick_true[:, None], a, b)

    def forward(self, input_ids, **kwargs):
        p = self.weight * self.true(input_ids).logits.double().exp() + (1 - self.weight) * self.unigram(input_ids).logits.double().exp()
        return CausalLMOutput(logits=p.log().float())


def exact_brier_1(language, stream, num_positions, context_len, model_probs):
    """E[Brier-1 estimate] = mean over windows of 2 q·p − q·q, with p the true and q the model's next-token law."""
    contexts, _ = evaluation_windows(stream, num_positions, context_len, 4)
    p = language.position_probs(contexts.numpy())[:, -1]
    q = model_probs(p)
    return float(np.mean(2 * (q * p).sum(-1) - (q * q).sum(-1)))


def test_true_model_brier_1_matches_closed_form(easy):
    stream = evaluation_stream(easy)
    summary = summarize_brier(brier_position_terms(LanguageReference(easy), stream, 4000, 32, batch_size=500))
    exact = exact_brier_1(easy, stream, 4000, 32, lambda p: p)  # sum_x p(x)^2 averaged over contexts
    b1 = summary["brier_1"]
    assert b1["ci_low"] <= exact <= b1["ci_high"]
    assert abs(b1["value"] - exact) < 0.03


def test_exact_target_terms_match_closed_form_brier_1_and_2(easy):
    """The variance-reduced terms of the true language: Brier-1 -> sum_x p(x)^2, Brier-2 -> sum over x1, x2 of
    p(x1 x2)^2, the latter by brute force over every first token (one forward pass per extended context)."""
    stream = evaluation_stream(easy)
    plain, exact = optimum_position_terms(LanguageReference(easy), easy, stream, 300, 16, batch_size=300, pairs=8)
    contexts, _ = evaluation_windows(stream, 300, 16, 4)
    p1 = easy.position_probs(contexts.numpy())[:, -1]  # [P, V]
    vocab = easy.vocab_size
    extended = np.concatenate([np.repeat(contexts.numpy(), vocab, axis=0),
                               np.tile(np.arange(vocab), len(contexts))[:, None]], axis=1)
    possible = p1.reshape(-1) > 0
    p2 = np.zeros((len(extended), vocab))
    p2[possible] = easy.position_probs(extended[possible])[:, -1]
    joint = p1[:, :, None] * p2.reshape(len(contexts), vocab, vocab)
    brier_2 = (joint ** 2).sum(axis=(1, 2))
    brier_1 = (p1 ** 2).sum(-1)
    for n, closed in ((0, brier_1), (1, brier_2)):
        summary = summarize_brier(exact[:, n:n + 1])["brier_1"]
        assert summary["ci_low"] <= closed.mean() <= summary["ci_high"]
        # far tighter than the harness's own estimator on the same draws
        assert exact[:, n].std() < 0.6 * plain[:, n].std()
    assert abs(exact[:, 0].mean().item() - brier_1.mean()) < 0.01


def test_gap_closed_of_a_mixture_matches_its_closed_form(easy):
    weight = 0.5
    result = evaluate_against_optimum(Mixture(easy, weight), easy, num_positions=12000, context_len=32, batch_size=1000,
                                      likelihood=False)
    stream = evaluation_stream(easy)
    u = easy.unigram_probs()
    b_true = exact_brier_1(easy, stream, 12000, 32, lambda p: p)
    b_uni = exact_brier_1(easy, stream, 12000, 32, lambda p: np.broadcast_to(u, p.shape))
    b_mix = exact_brier_1(easy, stream, 12000, 32, lambda p: weight * p + (1 - weight) * u)
    expected = (b_mix - b_uni) / (b_true - b_uni)
    gap = result["gap_closed"]["brier_1"]
    assert 0.55 < expected < 0.9  # the mixture's Brier-1 is quadratic in the weight: not the weight itself
    assert gap["ci_low"] <= expected <= gap["ci_high"]
    assert gap["ci_high"] - gap["ci_low"] < 0.5, "an interval this wide would say nothing"
    assert result["true"]["brier_1"]["value"] > result["unigram"]["brier_1"]["value"]


def test_likelihood_of_the_references_and_a_mixture(easy):
    stream = evaluation_stream(easy)
    true = likelihood_against_optimum(LanguageReference(easy), easy, stream, seq_len=64, num_rows=16)
    assert true["excess_nll"] == pytest.approx(0.0, abs=1e-6) and true["kl"] == pytest.approx(0.0, abs=1e-6)
    uni = likelihood_against_optimum(LanguageReference(easy, "unigram"), easy, stream, seq_len=64, num_rows=16)
    rows = stream[:16 * 64].view(16, 64).numpy()
    p = easy.position_probs(rows)[:, :-1]
    u = easy.unigram_probs()
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(p > 0, p * np.log(p / u), 0.0).sum(-1).mean()
    assert uni["kl"] == pytest.approx(kl, rel=1e-4)
    assert uni["nll"] == pytest.approx(uni["unigram_nll"], rel=1e-5)
    assert uni["excess_nll"] > 0.1
    # In expectation the NLL excess is the KL; on 1008 tokens they agree to sampling error.
    assert abs(uni["excess_nll"] - uni["kl"]) < 0.1


def test_a_padded_vocabulary_is_normalised_over_all_its_logits(easy):
    class Padded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.device = LanguageReference(easy), torch.device("cpu")
            self.config = self.inner.config

        def forward(self, input_ids, **kwargs):
            logits = self.inner(input_ids).logits
            extra = torch.zeros(*logits.shape[:-1], 5)  # probability mass on ids the language never uses
            return CausalLMOutput(logits=torch.cat([logits, extra], dim=-1))

    stream = evaluation_stream(easy)
    padded = likelihood_against_optimum(Padded(), easy, stream, seq_len=32, num_rows=8)
    assert padded["excess_nll"] > 0.01 and padded["kl"] > 0.01


def test_reference_refuses_options_it_does_not_implement(easy):
    with pytest.raises(ValueError, match="plain samples only"):
        LanguageReference(easy).generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2, temperature=0.5)
    with pytest.raises(ValueError, match="kind must be"):
        LanguageReference(easy, "bigram")
