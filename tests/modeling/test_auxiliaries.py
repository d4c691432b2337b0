"""Tests for the PLM auxiliaries (hf_latentlm/modeling/auxiliaries.py). Tiny sizes, CPU only."""

import math

import pytest
import torch

from hf_latentlm.modeling.auxiliaries import (
    VoronoiAssignment,
    decode_auxiliary,
    draw_auxiliary_in_cell,
    exact_voronoi_owners,
    fit_dense_offsets,
    fit_laguerre_offsets,
    fixed_uniforms,
    hold_capacities,
    largest_remainder_capacities,
    quantile_owners,
    sample_auxiliary_bank,
    TokenScores,
    _max_and_first_index,
    token_scores,
    top_candidates,
    voronoi_owners,
)


V, D, N, M = 512, 64, 512, 128


def _lm_head(seed: int, vocab: int = V, dim: int = D) -> torch.Tensor:
    """LM-head-like rows: random directions, norms uniform in [1, 3]."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(vocab, dim, generator=g)
    return rows / rows.norm(dim=-1, keepdim=True) * (1 + 2 * torch.rand(vocab, 1, generator=g))


def _logits(kind: str, positions: int, head: torch.Tensor, seed: int) -> torch.Tensor:
    """Flat (all top-128 tokens get auxiliaries) or peaked (top-1 ~35% of the mass) next-token logits."""
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return 0.5 * torch.randn(positions, head.shape[0], generator=g)
    if kind == "peaked":
        return 3.0 * torch.randn(positions, head.shape[0], generator=g)
    # "lm_flat" / "lm_peaked": logits of a hidden state against the same head, so cells follow the head's geometry
    h = torch.randn(positions, head.shape[1], generator=g)
    scale = 2.0 if kind == "lm_flat" else 8.0
    return (h / h.norm(dim=-1, keepdim=True) * scale) @ head.T


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """The fit issues many small ops; with 2 intra-op threads on a busy 2-core box each op waits for a time slice
    (this file: ~1 s with 1 thread, ~25 s with 2 while another job runs). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup():
    head = _lm_head(0)
    bank = sample_auxiliary_bank(N, D, seed=1)
    logits = torch.cat([_logits(k, 24, head, seed=i) for i, k in enumerate(["flat", "peaked", "lm_flat", "lm_peaked"])])
    return head, bank, logits


@pytest.fixture(scope="module")
def assignment(setup) -> VoronoiAssignment:
    head, bank, logits = setup
    return voronoi_owners(logits, head, bank, top_m=M)


# --------------------------------------------------------------------------------------------------------------- bank


def test_bank_unit_vectors_seeded_and_independent_of_global_rng():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = sample_auxiliary_bank(300, 16, seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # global RNG neither read-advanced nor reseeded
    torch.manual_seed(999)
    b = sample_auxiliary_bank(300, 16, seed=7)
    assert a.shape == (300, 16) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert torch.allclose(a.norm(dim=-1), torch.ones(300), atol=1e-6)
    assert not torch.equal(a, sample_auxiliary_bank(300, 16, seed=8))
    # uniform on the sphere: no preferred direction
    assert sample_auxiliary_bank(20000, 16, seed=3).mean(0).abs().max() < 0.02


# --------------------------------------------------------------------------------------------------------- capacities


def _capacities_reference(q: list[float], total: int) -> list[int]:
    s = sum(q)
    exact = [total * x / s for x in q]
    base = [math.floor(x) for x in exact]
    order = sorted(range(len(q)), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[: total - sum(base)]:
        base[i] += 1
    return base


@pytest.mark.parametrize("total", [1, 7, 512, 1000])
def test_capacities_match_bruteforce_and_sum_to_total(total):
    g = torch.Generator().manual_seed(total)
    probs = torch.softmax(3 * torch.randn(40, 25, generator=g), dim=-1)
    probs[:5, 10:] = 0.0  # exact zeros
    probs[5:10] *= 0.37  # unnormalised rows
    caps = largest_remainder_capacities(probs, total)
    assert caps.dtype == torch.long and caps.shape == probs.shape
    assert (caps.sum(-1) == total).all() and (caps >= 0).all()
    assert (caps[:5, 10:] == 0).all()
    q = probs.double()
    q = q / q.sum(-1, keepdim=True)
    for row in range(probs.shape[0]):
        assert caps[row].tolist() == _capacities_reference(q[row].tolist(), total)


def test_capacities_ties_go_to_lower_index():
    caps = largest_remainder_capacities(torch.full((1, 4), 0.25), 510)  # four remainders of exactly 0.5
    assert caps.tolist() == [[128, 128, 127, 127]]
    caps = largest_remainder_capacities(torch.tensor([[1.0, 1.0, 1.0]]), 2)
    assert caps.tolist() == [[1, 1, 0]]


def test_top_candidates_order_and_ties():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, -1.0, 1.0]])
    cand, probs = top_candidates(logits, 4)
    assert cand.tolist() == [[1, 3, 2, 5]]  # descending logit, equal logits -> lower token id first
    assert torch.allclose(probs.sum(-1), torch.ones(1))
    assert torch.allclose(probs, torch.softmax(logits[:, [1, 3, 2, 5]], -1))


# ---------------------------------------------------------------------------------------------------- Laguerre cells


def test_fitted_cell_masses_match_capacities(assignment):
    tv = assignment.total_variation
    per_kind = tv.view(4, -1)
    print(
        f"\nVoronoi TV (N={N}, M={M}): mean {tv.mean():.5f} max {tv.max():.5f}; per kind (flat, peaked, lm_flat,"
        f" lm_peaked) means {[round(x, 5) for x in per_kind.mean(1).tolist()]}"
    )
    assert tv.mean() < 0.003  # paper App. 12: < 0.3%
    assert (per_kind.mean(1) < 0.004).all()
    assert tv.max() < 0.05
    # flat inputs really use all 128 candidates, peaked ones few
    open_cells = (assignment.capacities > 0).sum(-1).view(4, -1).float().mean(1)
    assert open_cells[0] == M and open_cells[1] < 100


def test_total_variation_is_computed_from_the_owners(setup, assignment):
    _, _, logits = setup
    a = assignment
    sizes = (a.owners[:, None, :] == a.candidates[:, :, None]).sum(-1)  # [P, M] cell sizes from owners
    tv = 0.5 * (sizes - a.capacities).abs().sum(-1).float() / N
    assert torch.allclose(tv, a.total_variation)
    assert (a.capacities.sum(-1) == N).all()
    assert a.owners.shape == (logits.shape[0], N) and a.candidates.shape == (logits.shape[0], M)


def test_cells_are_disjoint_and_cover_the_bank(assignment):
    a = assignment
    # each auxiliary has exactly one owner, and it is one of the position's candidates with positive capacity
    matches = a.owners[:, :, None] == a.candidates[:, None, :]  # [P, N, M]
    assert (matches.sum(-1) == 1).all()
    owner_capacity = a.capacities.gather(1, matches.long().argmax(-1))
    assert (owner_capacity > 0).all()


def test_zero_capacity_and_out_of_top_m_tokens_own_nothing(setup, assignment):
    _, _, logits = setup
    a = assignment
    closed = torch.where(a.capacities == 0, a.candidates, -2)  # tokens with capacity 0 at each position
    assert (a.capacities == 0).any()
    assert not (a.owners[:, :, None] == closed[:, None, :]).any()
    in_top_m = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, a.candidates, True)
    assert in_top_m.gather(1, a.owners).all()


def test_chunking_and_batching_invariance(setup, assignment):
    head, bank, logits = setup
    b = voronoi_owners(logits, head, bank, top_m=M, chunk_size=40)  # chunks of 40, 40, 16 instead of one of 96
    assert torch.equal(b.owners, assignment.owners)
    assert torch.equal(b.total_variation, assignment.total_variation)
    rows = torch.tensor([1, 30, 90])  # flat, peaked, lm_peaked
    single = voronoi_owners(logits[rows], head, bank, top_m=M, chunk_size=1)
    assert torch.equal(single.owners, assignment.owners[rows])
    alone = voronoi_owners(logits[55:56], head, bank, top_m=M)  # lm_flat, as a batch of one
    assert torch.equal(alone.owners[0], assignment.owners[55])
    assert torch.equal(alone.candidates[0], assignment.candidates[55])
    assert torch.equal(alone.capacities[0], assignment.capacities[55])


def test_deterministic(setup, assignment):
    head, bank, logits = setup
    again = voronoi_owners(logits.clone(), head.clone(), bank.clone(), top_m=M)
    for x, y in zip(again, assignment):
        assert torch.equal(x, y)


def test_untrimmed_fit_under_compile_gives_the_same_owners(setup, assignment, monkeypatch):
    """Under torch.compile the fit keeps every candidate column (the trimmed width is data-dependent); closed
    columns never take an auxiliary, so the owners are exactly those of the trimmed eager fit."""
    head, bank, logits = setup
    peaked = logits[24:48]  # trimming drops many closed columns here
    assert (assignment.capacities[24:48] > 0).any(0).nonzero().max() + 1 < M
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    untrimmed = voronoi_owners(peaked, head, bank, top_m=M)
    assert torch.equal(untrimmed.owners, assignment.owners[24:48])
    assert torch.equal(untrimmed.total_variation, assignment.total_variation[24:48])


def test_positions_with_one_open_candidate_give_it_the_whole_bank_without_a_fit(setup, assignment, monkeypatch):
    """Near-certain positions (all N auxiliaries round to the top token) skip the fit; the owners are those the
    fit gives (checked through the untrimmed compile path, which fits every position) and the other positions in
    the batch are unchanged."""
    head, bank, logits = setup
    confident = logits[:6].clone()
    confident[torch.arange(6), torch.arange(6) * 7] = 1e4  # probability 1 - O(e^-1e4): capacity N
    mixed = torch.cat([confident, logits[24:30]])
    fast = voronoi_owners(mixed, head, bank, top_m=M)
    assert torch.equal(fast.owners[:6], (torch.arange(6) * 7)[:, None].expand(6, N))
    assert torch.equal(fast.total_variation[:6], torch.zeros(6))
    assert torch.equal(fast.owners[6:], assignment.owners[24:30])
    calls = []
    real_fit = fit_laguerre_offsets

    def counting_fit(scores, *args, **kwargs):
        calls.append(scores.shape[0])
        return real_fit(scores, *args, **kwargs)

    monkeypatch.setattr("hf_latentlm.modeling.auxiliaries.fit_laguerre_offsets", counting_fit)
    voronoi_owners(confident, head, bank, top_m=M)
    assert calls == []  # no fit at all for a batch of confident positions
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fitted = voronoi_owners(mixed, head, bank, top_m=M)
    assert calls and torch.equal(fitted.owners, fast.owners)


def test_two_open_candidates_split_the_bank_exactly_and_optimally(monkeypatch):
    """Two open candidates: cells hold exactly their capacities, and the split has the largest total score of all
    splits with those sizes (brute force over a 10-auxiliary bank); the untrimmed compile path and decoding's exact
    cells agree."""
    import itertools

    head, bank = _lm_head(3), sample_auxiliary_bank(10, D, seed=4)
    logits = torch.full((5, V), -1e4)
    pairs = [(3, 9, 0.3), (40, 2, 1.2), (7, 8, 2.0), (100, 200, 0.05), (11, 12, 0.7)]
    for p, (a, b, gap) in enumerate(pairs):
        logits[p, a], logits[p, b] = 0.0, -gap  # two tokens share all the mass
    result = voronoi_owners(logits, head, bank, top_m=8)
    scores = head @ bank.T  # [V, N]
    for p, (a, b, _) in enumerate(pairs):
        capacity = int(result.capacities[p, 0])
        assert result.candidates[p, 0] == a and (result.capacities[p, 2:] == 0).all() and 0 < capacity < 10
        owned = {u for u in range(10) if result.owners[p, u] == a}
        assert len(owned) == capacity and all(result.owners[p, u] == b for u in set(range(10)) - owned)
        best = max(itertools.combinations(range(10), capacity),
                   key=lambda cell: float(scores[a, list(cell)].sum() - scores[b, list(cell)].sum()))
        assert owned == set(best)
    assert torch.equal(result.total_variation, torch.zeros(5))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    untrimmed = voronoi_owners(logits, head, bank, top_m=8)
    assert torch.equal(untrimmed.owners, result.owners)
    assert torch.equal(untrimmed.total_variation, result.total_variation)
    assert torch.equal(exact_voronoi_owners(logits, bank, 8, token_scores(head, bank)).owners, result.owners)


def test_exact_cells_are_the_optimal_assignment_so_the_fit_may_stop_there(monkeypatch):
    """The early stop (`_rows_holding_capacities`) rests on this: cells that hold exactly their capacities maximise the
    total score over all assignments with those cell sizes (brute force over every assignment of a 9-auxiliary bank
    to three open candidates), so a fit that reaches them later ends with the same owners."""
    import itertools

    from hf_latentlm.modeling import auxiliaries

    head, bank = _lm_head(5), sample_auxiliary_bank(9, D, seed=6)
    logits = torch.full((6, V), -1e4)
    for p in range(6):
        logits[p, 3 * p:3 * p + 3] = torch.tensor([0.0, -0.4 - 0.1 * p, -0.9])  # three open cells of sizes ~4, 3, 2
    result = voronoi_owners(logits, head, bank, top_m=8)
    scores = head @ bank.T
    for p in range(6):
        assert result.total_variation[p] == 0
        cand, caps = result.candidates[p, :3].tolist(), result.capacities[p, :3].tolist()
        slots = [c for c, n in zip(cand, caps) for _ in range(n)]
        best = max(set(itertools.permutations(slots)), key=lambda owners: float(sum(
            scores[v, u] for u, v in enumerate(owners))))
        assert result.owners[p].tolist() == list(best)
    # And the stop itself changes no owner: the same fit with the check switched off, at 48 positions of several
    # entropies where it does stop early at some, fitted one by one (the whole fit stops) and all at once (finished
    # rows leave the fit while the others go on).
    head, bank = _lm_head(7), sample_auxiliary_bank(64, D, seed=8)
    logits = torch.randn(48, V, generator=torch.Generator().manual_seed(9)) * torch.linspace(1, 10, 48)[:, None]
    stops, check = [], auxiliaries._rows_holding_capacities
    monkeypatch.setattr(auxiliaries, "_rows_holding_capacities", lambda *a: stops.append(check(*a)) or stops[-1])
    stopping = [voronoi_owners(logits[p:p + 1], head, bank, top_m=16) for p in range(48)]
    assert any(bool(s.all()) for s in stops) and not all(bool(s.all()) for s in stops)
    stops.clear()
    together = voronoi_owners(logits, head, bank, top_m=16, chunk_size=48)
    # some rows left the batched fit before the others (they leave once they are a quarter of the rows)
    assert any(s.numel() <= 4 * int(s.sum()) < 4 * s.numel() for s in stops)
    monkeypatch.setattr(auxiliaries, "_rows_holding_capacities", lambda adjusted, *a: torch.zeros(
        adjusted.shape[0], dtype=torch.bool))
    full = [voronoi_owners(logits[p:p + 1], head, bank, top_m=16) for p in range(48)]
    for p, (a, b) in enumerate(zip(stopping, full)):
        assert torch.equal(a.owners, b.owners) and torch.equal(a.total_variation, b.total_variation)
        assert torch.equal(together.owners[p], a.owners[0])
        assert torch.equal(together.total_variation[p], a.total_variation[0])


def _best_assignment(scores: torch.Tensor, capacities: list[int]) -> list[int]:
    """Brute force: the local owners [N] of the assignment with exactly `capacities` [M] auxiliaries per candidate
    that has the largest total score (scores [M, N], float64 sums)."""
    import itertools

    def assignments(free: tuple[int, ...], cand: int):
        if cand == len(capacities):
            yield {}
            return
        for cell in itertools.combinations(free, capacities[cand]):
            rest = tuple(u for u in free if u not in cell)
            for tail in assignments(rest, cand + 1):
                yield {**{u: cand for u in cell}, **tail}

    values = scores.double().tolist()
    best = max(assignments(tuple(range(scores.shape[1])), 0),
               key=lambda owner: sum(values[v][u] for u, v in owner.items()))
    return [best[u] for u in range(scores.shape[1])]


def test_hold_capacities_finds_the_optimal_assignment_from_any_offsets():
    """Successive shortest paths from far-off offsets (zeros, random, the negated fit) end at the brute-force optimum
    with exact capacities, at 8 rows of 4 open candidates over a 10-auxiliary bank fitted at once; the starting
    cells miss their capacities, so every row needs several moves, some along paths of more than one edge."""
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(8, 4, 10, generator=g)
    capacities = torch.tensor([[4, 3, 2, 1], [3, 3, 2, 2], [5, 2, 2, 1], [7, 1, 1, 1],
                               [4, 4, 1, 1], [2, 2, 3, 3], [6, 2, 1, 1], [3, 3, 3, 1]])
    expected = [_best_assignment(scores[p], capacities[p].tolist()) for p in range(8)]
    for offsets in (torch.zeros(8, 4), 2.0 * torch.randn(8, 4, generator=g), -torch.arange(4.0).expand(8, 4)):
        start = (scores + offsets[:, :, None]).argmax(dim=1)
        start_sizes = torch.zeros_like(capacities).scatter_add_(1, start, torch.ones_like(start))
        assert (start_sizes != capacities).any(dim=1).sum() >= 6
        owners = hold_capacities(scores, offsets, capacities)
        assert owners.tolist() == expected
        assert torch.equal(torch.zeros_like(capacities).scatter_add_(1, owners, torch.ones_like(owners)), capacities)


def test_hold_capacities_leaves_exact_cells_alone_and_never_uses_closed_candidates():
    """Cells that already hold their capacities are returned as they are (the argmax of the offsets); a closed
    candidate (capacity 0, offset far below) takes no auxiliary even when its scores are the best."""
    g = torch.Generator().manual_seed(12)
    scores = torch.randn(3, 5, 12, generator=g)
    offsets = 0.5 * torch.randn(3, 5, generator=g)
    argmax = (scores + offsets[:, :, None]).argmax(dim=1)
    sizes = torch.zeros(3, 5, dtype=torch.long).scatter_add_(1, argmax, torch.ones_like(argmax))
    assert torch.equal(hold_capacities(scores, offsets, sizes), argmax)

    scores[:, 4] += 10.0  # the closed candidate scores best everywhere
    capacities = torch.tensor([[5, 4, 2, 1, 0], [3, 3, 3, 3, 0], [9, 1, 1, 1, 0]])
    offsets = torch.cat([torch.zeros(3, 4), torch.full((3, 1), -1.0e4)], dim=1)
    owners = hold_capacities(scores, offsets, capacities)
    assert (owners != 4).all()
    for p in range(3):
        assert owners[p].tolist() == _best_assignment(scores[p, :4], capacities[p, :4].tolist())


def test_exact_owners_are_the_iterative_fit_wherever_it_ends_exact(setup, assignment):
    """`exact_voronoi_owners` (decoding's sampler) against `voronoi_owners` (training's fit) at 96 positions of four
    regimes, N=512, M=128: every cell holds exactly its capacity; where the iterative fit ends exact the owners are
    the same (one optimal assignment), and where it does not (most rows here) they differ in a few auxiliaries; the same
    owners fitted one row at a time; the dense fit alone already lands within a few auxiliaries."""
    head, bank, logits = setup
    scores = token_scores(head, bank)
    exact = exact_voronoi_owners(logits, bank, M, scores)
    assert torch.equal(exact.candidates, assignment.candidates)
    assert torch.equal(exact.total_variation, torch.zeros(logits.shape[0]))
    sizes = (exact.owners[:, None, :] == exact.candidates[:, :, None]).sum(dim=2)
    assert torch.equal(sizes, exact.capacities)
    iterative_exact = assignment.total_variation == 0
    assert 10 <= int(iterative_exact.sum()) < logits.shape[0]
    assert torch.equal(exact.owners[iterative_exact], assignment.owners[iterative_exact])
    moved = (exact.owners != assignment.owners).sum(dim=1)[~iterative_exact]
    assert (moved > 0).all() and (moved < N // 16).all()  # a few chains of moves (here 1-22 of 512 auxiliaries)
    for p in (0, 30, 55, 90):
        alone = exact_voronoi_owners(logits[p:p + 1], bank, M, scores)
        assert torch.equal(alone.owners[0], exact.owners[p])
    candidates, capacities = assignment.candidates, assignment.capacities
    open_rows = (capacities > 0).sum(dim=1) > 2
    cand, caps = candidates[open_rows], capacities[open_rows]
    chunk = scores.scores[cand]  # [P, M, N]
    offsets = fit_dense_offsets(chunk, caps, scores.mean[cand], scores.std[cand])
    local = (chunk + offsets[:, :, None]).argmax(dim=1)
    dense_sizes = torch.zeros_like(caps).scatter_add_(1, local, torch.ones_like(local))
    assert (dense_sizes - caps).abs().sum(dim=1).float().mean() / (2 * N) < 0.01  # mean TV under 1%


def test_scores_use_unnormalised_lm_head_rows():
    # One token with a 3x longer row wins more of the bank at equal offsets: check that the fit still hits capacities
    # and that scaling the whole head (same geometry, scaled scores) leaves the owners unchanged (sigma-relative fit).
    head = _lm_head(5, vocab=64, dim=16)
    bank = sample_auxiliary_bank(256, 16, seed=2)
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    a = voronoi_owners(logits, head, bank, top_m=32)
    b = voronoi_owners(logits, 4.0 * head, bank, top_m=32)
    assert torch.equal(a.owners, b.owners)
    assert a.total_variation.mean() < 0.01


def test_fit_accepts_plain_layout_and_degenerate_sizes():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 200, 20, generator=g) * 0.3  # contiguous [P, N, M]
    caps = largest_remainder_capacities(torch.softmax(torch.randn(3, 20, generator=g), -1), 200)
    w = fit_laguerre_offsets(scores, caps)
    local = (scores + w[:, None, :]).argmax(-1)
    sizes = torch.zeros_like(caps).scatter_add_(1, local, torch.ones_like(local))
    assert 0.5 * (sizes - caps).abs().sum(-1).max() <= 4  # a handful of the 200 auxiliaries at most
    # a single open candidate takes the whole bank; M smaller than the shortlist works
    one = voronoi_owners(torch.tensor([[10.0, -50.0, -50.0]]), torch.randn(3, 8), sample_auxiliary_bank(16, 8, 0), 3)
    assert one.capacities.tolist() == [[16, 0, 0]] and (one.owners == 0).all() and one.total_variation.item() == 0


def test_masked_vocabulary_entries_never_own():
    head = _lm_head(1, vocab=40, dim=8)
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    logits[:, 20:] = float("-inf")  # e.g. padded vocabulary rows
    a = voronoi_owners(logits, head, sample_auxiliary_bank(64, 8, 0), top_m=32)
    assert (a.owners < 20).all()
    assert (a.capacities[:, 20:] == 0).all()


# ------------------------------------------------------------------------------------------------- draw and decode


def test_draw_decodes_back_to_target(assignment):
    a = assignment
    g = torch.Generator().manual_seed(0)
    # targets: a random candidate with positive capacity at every position
    weights = (a.capacities > 0).float()
    targets = a.candidates.gather(1, torch.multinomial(weights, 1, generator=g)).squeeze(1)
    owned = (a.owners == targets[:, None]).any(-1)
    index = draw_auxiliary_in_cell(a.owners, targets, generator=g)
    assert ((index >= 0) == owned).all()
    assert owned.float().mean() > 0.9  # cells of open candidates are rarely empty
    assert torch.equal(decode_auxiliary(a.owners, index)[owned], targets[owned])


def test_draw_is_uniform_over_the_cell_and_seeded():
    owners = torch.tensor([[3, 1, 3, 3, 2, 3, 1, 3]]).repeat(20000, 1)
    targets = torch.full((20000,), 3)
    index = draw_auxiliary_in_cell(owners, targets, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(index, minlength=8)
    assert counts[[1, 4, 6]].sum() == 0
    assert ((counts[[0, 2, 3, 5, 7]].float() / 4000 - 1).abs() < 0.06).all()
    again = draw_auxiliary_in_cell(owners, targets, generator=torch.Generator().manual_seed(0))
    assert torch.equal(index, again)


def test_given_uniforms_replace_the_rng():
    """Eval-mode draws (PLM) use fixed numbers: no RNG is read, and the pick is the floor(U·|cell|)-th member."""
    u = fixed_uniforms(10_000)
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1
    assert torch.equal(u, fixed_uniforms(10_000)) and torch.equal(u[:7], fixed_uniforms(7))
    assert (torch.bincount((u * 10).long(), minlength=10) - 1000).abs().max() <= 2  # evenly spread
    owners = torch.tensor([[3, 1, 3, 3, 2, 3, 1, 3]]).repeat(4, 1)
    targets = torch.tensor([3, 3, 1, 2])
    state = torch.get_rng_state()
    index = draw_auxiliary_in_cell(owners, targets, uniform=torch.tensor([0.0, 0.99, 0.6, 0.3]))
    assert torch.equal(torch.get_rng_state(), state)
    assert index.tolist() == [0, 7, 6, 4]  # cell of 3: [0, 2, 3, 5, 7]; cell of 1: [1, 6]; cell of 2: [4]


def test_mask_path_for_targets_without_auxiliaries(assignment):
    a = assignment
    outside = torch.full((a.owners.shape[0],), -5)  # not a token at all
    assert (draw_auxiliary_in_cell(a.owners, outside) == -1).all()
    # a token outside the top M and a top-M token with capacity 0
    has_closed = (a.capacities == 0).any(-1)
    closed_token = a.candidates.gather(1, (a.capacities == 0).long().argmax(-1, keepdim=True)).squeeze(1)
    index = draw_auxiliary_in_cell(a.owners[has_closed], closed_token[has_closed])
    assert (index == -1).all()
    assert (decode_auxiliary(a.owners[has_closed], index) == -1).all()


# --------------------------------------------------------------------------------------------------------- quantile


def _quantile_reference(logits: torch.Tensor, n: int) -> list[list[int]]:
    out = []
    for row in torch.softmax(logits.double(), -1).tolist():
        cdf, acc = [], 0.0
        for p in row:
            acc += p
            cdf.append(acc)
        owners = []
        for b in range(n):
            mid = (b + 0.5) / n * cdf[-1]
            owners.append(next(v for v, c in enumerate(cdf) if mid < c))  # first token whose CDF passes the midpoint
        out.append(owners)
    return out


def test_quantile_owners_match_bruteforce_and_sizes():
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(12, 30, generator=g)
    logits[:3, 5:10] = float("-inf")  # zero-probability tokens
    owners = quantile_owners(logits, 64)
    assert owners.shape == (12, 64) and owners.dtype == torch.long
    assert owners.tolist() == _quantile_reference(logits, 64)
    assert not ((owners[:3] >= 5) & (owners[:3] < 10)).any()
    assert (owners[:, 1:] >= owners[:, :-1]).all()  # vocabulary order
    sizes = torch.zeros(12, 30).scatter_add_(1, owners, torch.ones(12, 64))
    assert ((sizes - 64 * torch.softmax(logits, -1)).abs() < 1.0 + 1e-4).all()
    index = draw_auxiliary_in_cell(owners, owners[:, 17])
    assert torch.equal(decode_auxiliary(owners, index), owners[:, 17])


def test_precomputed_token_scores_give_identical_owners(setup, assignment):
    head, bank, logits = setup
    ts = token_scores(head, bank)
    assert isinstance(ts, TokenScores)
    assert ts.scores.shape == (V, N) and ts.mean.shape == (V,) and ts.std.shape == (V,)
    assert torch.allclose(ts.scores, head @ bank.T, atol=1e-5)
    b = voronoi_owners(logits, head, bank, top_m=M, scores=ts)
    for x, y in zip(b, assignment):
        assert torch.equal(x, y)
    # decode-size call: a few rows, cached scores
    rows = voronoi_owners(logits[[3, 40, 70, 90]], head, bank, top_m=M, scores=ts)
    assert torch.equal(rows.owners, assignment.owners[[3, 40, 70, 90]])


def _tempered_logits(head: torch.Tensor, entropy: torch.Tensor, seed: int) -> torch.Tensor:
    """Zipfian rank profile + a part aligned with the head, tempered per row to the given entropy (nats)."""
    g = torch.Generator().manual_seed(seed)
    rows, (vocab, dim) = entropy.shape[0], head.shape
    h = torch.randn(rows, dim, generator=g)
    ranks = torch.argsort(torch.rand(rows, vocab, generator=g), dim=-1).float() + 1
    base = -1.1 * ranks.log() + 0.5 * (h / h.norm(dim=-1, keepdim=True) * 8.0) @ head.T
    lo, hi = torch.full((rows, 1), 1e-3), torch.full((rows, 1), 1e3)
    for _ in range(50):
        mid = (lo * hi).sqrt()
        logp = torch.log_softmax(base * mid, dim=-1)
        too_flat = -(logp.exp() * logp).sum(-1, keepdim=True) > entropy[:, None]
        lo, hi = torch.where(too_flat, mid, lo), torch.where(too_flat, hi, mid)
    return base * (lo * hi).sqrt()


def test_default_fit_meets_paper_tv_across_entropy_regimes():
    """Defaults (DEFAULT_ROUNDS x DEFAULT_SWEEPS x DEFAULT_SHORTLIST) on LM-like logits from peaked to flat: mean TV
    per regime below the paper's 0.3% (scripts/experiments/time_voronoi.py measures the same at d=256, V=4096)."""
    head = _lm_head(7, vocab=1024, dim=128)
    bank = sample_auxiliary_bank(N, 128, seed=3)
    regimes = {"peaked": (0.5, 1.5), "mid": (2.0, 4.0), "flat": (4.5, 6.0)}
    g = torch.Generator().manual_seed(0)
    for i, (name, (lo, hi)) in enumerate(regimes.items()):
        entropy = lo + (hi - lo) * torch.rand(30, generator=g)
        logits = _tempered_logits(head, entropy, seed=i)
        tv = voronoi_owners(logits, head, bank, top_m=M).total_variation
        print(f"\n{name}: mean TV {tv.mean():.5f} max {tv.max():.5f}")
        assert tv.mean() < 0.003, name
        assert tv.max() < 0.03, name


def test_max_and_first_index_matches_torch_max():
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 4, (5, 9, 33), generator=g).float()  # many exact ties
    values[0, :, 0] = float("-inf")
    values[1, 3:, :] = float("-inf")
    expected = values.max(dim=1)
    best, index = _max_and_first_index(values, torch.empty_like(values))
    assert torch.equal(best, expected.values)
    assert torch.equal(index, values.argmax(dim=1))  # first maximum
    assert torch.equal(index, expected.indices)
