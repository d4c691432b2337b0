"""Energy loss and temperature sampling from draws (modeling/energy.py), against brute force and known laws."""

import math

import pytest
import torch

from hf_latentlm.modeling.energy import (
    chunk_agreement,
    energy_loss,
    exact_temperature_choice,
    exact_temperature_n,
    log_binomial,
    pool_temperature_choice,
)


def brute_force_energy(samples, targets):
    p, n, _ = samples.shape
    m = targets.shape[1]
    out = []
    for i in range(p):
        fid = sum((targets[i, a] - samples[i, b]).norm() for a in range(m) for b in range(n)) * 2 / (n * m)
        div = sum((samples[i, a] - samples[i, b]).norm() for a in range(n) for b in range(n) if a != b) / (n * (n - 1))
        out.append(fid - div)
    return torch.stack(out)


def test_energy_loss_matches_the_double_sum():
    torch.manual_seed(0)
    samples, targets = torch.randn(3, 5, 7, dtype=torch.float64), torch.randn(3, 9, 7, dtype=torch.float64)
    loss, fidelity, diversity = energy_loss(samples, targets)
    torch.testing.assert_close(loss, brute_force_energy(samples, targets))
    torch.testing.assert_close(loss, fidelity - diversity)


def test_energy_loss_has_finite_gradients_when_samples_coincide():
    # A zero-initialised head makes all N samples equal at the first step.
    samples = torch.zeros(2, 4, 3, requires_grad=True)
    loss, _, diversity = energy_loss(samples, torch.randn(2, 6, 3))
    loss.sum().backward()
    assert torch.isfinite(samples.grad).all() and samples.grad.abs().sum() > 0
    assert diversity.max() < 1e-5


def test_energy_score_prefers_the_true_distribution():
    # Proper scoring rule: in expectation the true law scores best (lowest loss) against its own draws.
    gen = torch.Generator().manual_seed(0)
    targets = torch.randn(4000, 8, 2, generator=gen)
    true = torch.randn(4000, 8, 2, generator=gen)
    shifted = true + 0.5
    collapsed = torch.zeros(4000, 8, 2) + 1e-3 * torch.randn(4000, 8, 2, generator=gen)
    too_wide = 2 * true
    scores = {name: energy_loss(s, targets)[0].mean().item()
              for name, s in {"true": true, "shifted": shifted, "collapsed": collapsed, "wide": too_wide}.items()}
    assert scores["true"] < min(scores["shifted"], scores["collapsed"], scores["wide"]) - 0.02, scores


def test_energy_loss_traces_without_graph_breaks():
    """It runs at every CALM training step: no boolean indexing (the diagonal is masked), so torch.compile captures
    it whole."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(energy_loss)(torch.randn(3, 4, 5), torch.randn(3, 2, 5))
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


def test_energy_loss_rejects_bad_shapes():
    with pytest.raises(ValueError, match="at least 2 model samples"):
        energy_loss(torch.zeros(2, 1, 3), torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="samples"):
        energy_loss(torch.zeros(2, 3, 3), torch.zeros(2, 4, 5))


def test_log_binomial_matches_math_comb():
    counts = torch.arange(0, 9)
    for n in (1, 2, 3):
        expected = [math.log(math.comb(c, n)) if c >= n else -math.inf for c in range(9)]
        assert log_binomial(counts, float(n)).tolist() == pytest.approx(expected)


def pool_frequencies(chunks, temperature, grid=4000):
    """Fraction of a fine uniform grid mapped to each pool index (a deterministic picture of the choice law)."""
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    picked = pool_temperature_choice(chunks.expand(grid, -1, -1), temperature, u)
    return torch.bincount(picked, minlength=chunks.shape[1]).double() / grid


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1 / 3])
def test_pool_choice_weights_each_distinct_chunk_by_count_choose_n(temperature):
    # Pool of 9 draws: chunk A ×5, B ×3, C ×1 (K = 2).
    labels = [0, 1, 0, 2, 0, 1, 0, 1, 0]
    chunks = torch.tensor([[[v, v + 10] for v in labels]])
    freq = pool_frequencies(chunks, temperature)
    n = round(1 / temperature)
    weight = {v: math.comb(labels.count(v), n) for v in set(labels)}
    total = sum(weight.values())
    for v in set(labels):
        mass = sum(freq[i].item() for i, lab in enumerate(labels) if lab == v)
        assert mass == pytest.approx(weight[v] / total, abs=2e-3)


def test_pool_choice_falls_back_to_the_most_frequent_chunk():
    chunks = torch.tensor([[[1], [2], [2], [3]]])
    u = torch.tensor([0.99])
    # No chunk occurs 3 times, so T = 1/3 has no weight anywhere: take the mode. T = 0 asks for it directly.
    assert chunks[0, pool_temperature_choice(chunks, 1 / 3, u)].item() == 2
    assert chunks[0, pool_temperature_choice(chunks, 0.0, u)].item() == 2


def test_chunk_agreement_needs_every_token_equal():
    chunks = torch.tensor([[[1, 2], [1, 3], [1, 2]]])
    assert chunk_agreement(chunks)[0].tolist() == [[True, False, True], [False, True, False], [True, False, True]]


def test_exact_rejection_samples_p_to_the_power_n():
    # A sampler over 3 chunks with p = (0.6, 0.3, 0.1); n = 2 must give p² / Σp².
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    rows, attempts, n = 20000, 8, 2
    draws = torch.multinomial(p.expand(rows * attempts * n, -1), 1, generator=gen).view(rows, attempts, n, 1)
    accepted, chosen = exact_temperature_choice(draws)
    assert accepted.float().mean() > 0.99
    freq = torch.bincount(chosen[accepted, 0], minlength=3).double() / accepted.sum()
    torch.testing.assert_close(freq, (p**2 / (p**2).sum()).double(), atol=0.01, rtol=0)


def test_exact_rejection_reports_rows_without_agreement():
    draws = torch.tensor([[[[1], [2]], [[3], [4]]], [[[1], [2]], [[5], [5]]]])  # row 0: none agree; row 1: 2nd
    accepted, chosen = exact_temperature_choice(draws)
    assert accepted.tolist() == [False, True] and chosen[1].tolist() == [5]


@pytest.mark.parametrize("temperature,n", [(1.0, 1), (0.5, 2), (1 / 3, 3), (0.25, 4)])
def test_exact_temperature_n_accepts_reciprocals(temperature, n):
    assert exact_temperature_n(temperature) == n


@pytest.mark.parametrize("temperature,needle", [(0.4, "1/n"), (0.0, r"\(0, 1\]"), (1.5, r"\(0, 1\]")])
def test_exact_temperature_n_names_bad_temperatures(temperature, needle):
    with pytest.raises(ValueError, match=needle):
        exact_temperature_n(temperature)


def test_pool_choice_is_independent_per_row():
    # Rows are decided by their own draws and uniform only.
    a = torch.tensor([[[1], [1], [2]]])
    b = torch.tensor([[[7], [8], [8]]])
    both = pool_temperature_choice(torch.cat([a, b]), 0.5, torch.tensor([0.3, 0.8]))
    assert both[0] == pool_temperature_choice(a, 0.5, torch.tensor([0.3]))[0]
    assert both[1] == pool_temperature_choice(b, 0.5, torch.tensor([0.8]))[0]

