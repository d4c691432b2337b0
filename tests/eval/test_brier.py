import math

import pytest
import torch

from hf_latentlm.eval.brier import brier_terms, evaluate_brier, headline, summarize_brier


def test_brier_terms_by_hand():
    y = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    a = torch.tensor([[1, 2, 3, 4], [1, 2, 9, 4], [1, 9, 3, 4], [1, 1, 1, 1]])
    b = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 1, 1, 1]])
    terms = brier_terms(a, b, y)
    # row 0: both right everywhere: 1+1-1 = 1 for every n
    # row 1: a wrong from n=3: n<=2 -> 1, n>=3 -> 0+1-0 = 1
    # row 2: a wrong from n=2: n=1 -> 1; n>=2 -> 0+1-0 = 1
    # row 3: both wrong and identical: 0+0-1 = -1 for every n
    assert terms.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [-1, -1, -1, -1]]
    disagree = brier_terms(torch.tensor([[7, 1, 1, 1]]), torch.tensor([[8, 1, 1, 1]]), torch.tensor([[9, 1, 1, 1]]))
    assert disagree.tolist() == [[0, 0, 0, 0]]


class FixedDistributionSampler(torch.nn.Module):
    """Ignores the context; every token is an independent draw from `probs`."""

    def __init__(self, probs):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.probs = torch.tensor(probs)

    def generate(self, input_ids, attention_mask=None, max_new_tokens=1, **kwargs):
        draws = torch.multinomial(self.probs, input_ids.shape[0] * max_new_tokens, replacement=True)
        return torch.cat([input_ids, draws.view(input_ids.shape[0], max_new_tokens)], dim=1)


def test_estimator_is_unbiased_for_a_known_distribution():
    probs = [0.5, 0.3, 0.2]
    stream = torch.zeros(6000, dtype=torch.long)  # truth is always token 0
    result = evaluate_brier(FixedDistributionSampler(probs), stream, num_positions=5000, context_len=8,
                            batch_size=500, seed=1)
    p_sq = sum(p * p for p in probs)
    # E[Brier-n] = 2 P(y_1..n) - sum over outcomes of P^2; tokens iid, so both factorise.
    for n in range(1, 5):
        expected = 2 * 0.5 ** n - p_sq ** n
        entry = result[f"brier_{n}"]
        assert entry["ci_low"] <= expected <= entry["ci_high"], (n, entry, expected)
        assert abs(entry["value"] - expected) < 0.03
    b1, b2 = result["brier_1"]["value"], result["brier_2"]["value"]
    assert result["brierlm_2"]["value"] == pytest.approx(100 * math.sqrt(b1 * b2))
    assert result["num_positions"] == 5000 and result["context_len"] == 8


def test_summary_flags_intervals_containing_zero_and_undefined_score():
    gen = torch.Generator().manual_seed(0)
    signal = torch.full((400, 1), 0.4)
    noise = torch.randint(-1, 2, (400, 3), generator=gen).double()  # mean ≈ 0
    result = summarize_brier(torch.cat([signal, noise], dim=1), num_bootstrap=300)
    assert not result["brier_1"]["interval_contains_zero"]
    assert result["brier_2"]["interval_contains_zero"]
    if result["brier_2"]["value"] <= 0:
        assert result["brierlm_2"]["value"] == 0.0
    assert "≈0" in headline(result)
    with pytest.raises(ValueError, match="no positions"):
        summarize_brier(torch.zeros(0, 4))


def test_brierlm_is_the_geometric_mean_of_all_four_and_brierlm_2_of_the_first_two():
    """Per-n means 0.5, 0.4, 0.2, 0.1 (all different, so a wrong n range or a wrong mean shows): BrierLM =
    100·(0.5·0.4·0.2·0.1)^(1/4) and BrierLM-2 = 100·√(0.5·0.4), each inside its bootstrap interval."""
    pattern = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [-1, 0, 0, 0],
                            [0, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    terms = pattern.repeat(20, 1).double()
    torch.testing.assert_close(terms.mean(0), torch.tensor([0.5, 0.4, 0.2, 0.1], dtype=torch.float64))
    result = summarize_brier(terms, num_bootstrap=200)
    assert result["brierlm"]["value"] == pytest.approx(100 * (0.5 * 0.4 * 0.2 * 0.1) ** 0.25)
    assert result["brierlm_2"]["value"] == pytest.approx(100 * math.sqrt(0.5 * 0.4))
    assert [result[f"brier_{n}"]["value"] for n in range(1, 5)] == pytest.approx([0.5, 0.4, 0.2, 0.1])
    for name in ("brierlm", "brierlm_2", "brier_3"):
        assert result[name]["ci_low"] <= result[name]["value"] <= result[name]["ci_high"]
