"""PLM quadratic decoding (paper 002, Algorithm 1) checked against INDEPENDENT references: the plain causal
`forward()`, `decoder_objective` with a hand-built block layout and explicit auxiliaries, the Voronoi sampler applied
by hand to `forward()` logits, and hand computations of the acceptance rules and of R (App. 17).

Every decoding call is recorded through a spy around `_decoding_step` (state before the call, the call's logits from
a forward hook, the Voronoi owners of its verify rows, the committed tokens and counts); the references never run the
decoding code again at another setting.

Row layout of one call (width W = K_pred): W verify rows (row r reads [last committed, pending...][r] at position
i-1+r and gives q(. | x_<i+r)), then W² proposal rows, block-major (row W + m·W + k predicts x_{i+m+k} from the
auxiliary u_{count+m+k}, seeing x_<i+m and rows k' <= k of its own block).
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from hf_latentlm.families import build_model
from hf_latentlm.modeling import PLMForCausalLM
from hf_latentlm.modeling.auxiliaries import (
    exact_voronoi_owners,
    sample_auxiliary_bank,
    token_scores,
    voronoi_owners,
)
from hf_latentlm.training.loop import TrainConfig, train

K_PRED = 4
TRAIN_STEPS = 120  # batch 4 x 64 tokens: ~25 s of CPU (one thread)
# Relaxed-acceptance thresholds for the trained model. Its proposals are nearly always q's top token, so the nucleus
# rule accepts almost every one (measured: 0-9 rejections per 240 tokens, depending on the package state); the rule
# checks that need rejections use the untrained model too, whose q is nearly flat (see `fresh`).
NUCLEUS = 0.15
EPSILON = 0.03


def tiny_plm(tokenizer, seed=0) -> PLMForCausalLM:
    """As tests/modeling/test_plm.py builds it: the `tiny` preset (hidden 64, 2 layers), blocks of 4."""
    torch.manual_seed(seed)
    return build_model("plm", "tiny", tokenizer, block_size=4, k_pred=K_PRED, num_auxiliaries=128, auxiliary_top_m=32)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The Voronoi fits are small; two threads on a shared 2-core machine run ~20x slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tokenizer, tiny_rows, tmp_path_factory, one_thread) -> PLMForCausalLM:
    """A tiny PLM (hidden 64, 2 layers) trained briefly on Shakespeare rows [0, 1500), so proposals are sometimes
    accepted. Prompts and held-out rows come from rows >= 1600."""
    model = tiny_plm(tokenizer)
    cfg = TrainConfig(family="plm", preset="tiny", output_dir=str(tmp_path_factory.mktemp("plm_decoding")),
                      max_steps=TRAIN_STEPS, batch_size=4, seq_len=64, eval_every=0, save_every=TRAIN_STEPS,
                      progress_bar=False, seed=0)
    train(cfg, model=model, tokenizer=tokenizer, train_rows=tiny_rows[:1500])
    return model.eval()


def prompts(rows, lengths, first=1600):
    return [rows[first + i, :n] for i, n in enumerate(lengths)]


def decoding_cells(model, logits, cells=None):
    """Decoding's Voronoi owners [P, N_aux] of encoder logits [P, V] on the model's own sites (`cells`: a bound
    `decoding_cells` taken earlier, default the sampler's current one)."""
    cells = cells or model.auxiliary_sampler.decoding_cells
    return cells(logits, model.lm_head.weight, model.model.auxiliary_bank)


# ---------------------------------------------------------------------------------------------- recording calls

@dataclass
class Call:
    """One quadratic-decoding call as seen from outside (per batch row b)."""

    count: torch.Tensor  # [B] new tokens committed before the call (generated index of the first verify row)
    finished: torch.Tensor  # [B] row already finished before the call
    next_pos: torch.Tensor  # [B] position i of the first token this call commits
    pending: torch.Tensor  # [B, W-1] pending tokens read by verify rows 1..W-1
    pending_ok: torch.Tensor  # [B]
    aux_table: torch.Tensor  # [B, max_new + 2W]
    logits: torch.Tensor  # [B, W + W², V] the call's output logits
    owners: torch.Tensor  # [B, W, N_aux] Voronoi owners of the verify rows' q
    tokens: torch.Tensor  # [B, W] committed candidates
    counts: torch.Tensor  # [B] tokens committed (m + 1)

    @property
    def accepted(self) -> torch.Tensor:
        return self.counts - 1

    def sampled(self) -> torch.Tensor:
        """[B, W] the Voronoi token f(u_{count+r}; q_{i+r}) of every verify row."""
        width = self.owners.shape[1]
        index = self.count[:, None] + torch.arange(width)
        aux = self.aux_table.gather(1, index)
        return self.owners.gather(2, aux[..., None]).squeeze(-1)


def record_calls(model, patch) -> list[Call]:
    """Spy on every `_decoding_step` of `model` (patch: a pytest MonkeyPatch) and return the list it fills."""
    calls: list[Call] = []
    step, cells = model._decoding_step, model.auxiliary_sampler.decoding_cells
    seen = {}

    def step_spy(state, new_tokens):
        seen.clear()
        before = dict(count=new_tokens.count.clone(), finished=new_tokens.finished.clone(),
                      next_pos=state.next_pos.clone(), pending=state.pending.clone(),
                      pending_ok=state.pending_ok.clone(), aux_table=state.aux_table.clone())

        def logits_hook(module, args, out):
            seen.setdefault("logits", out.logits.float().clone())  # returns None: the output is left alone

        hook = model.register_forward_hook(logits_hook)
        try:
            result = step(state, new_tokens)
        finally:
            hook.remove()
        batch, width = result.tokens.shape
        counts = result.counts if result.counts is not None else torch.full((batch,), width)
        # The owners of EVERY verify row, fitted here from the call's logits (decoding itself fits only the rows it
        # needs, up to each row's first rejection).
        verify = seen["logits"][:, :width]
        owners = decoding_cells(model, verify.reshape(batch * width, -1), cells).view(batch, width, -1)
        calls.append(Call(**before, logits=seen["logits"], owners=owners, tokens=result.tokens.clone(),
                          counts=counts.clone()))
        return result

    patch.setattr(model, "_decoding_step", step_spy)
    return calls


def full_mask(sequences, prompt_mask):
    return torch.cat([prompt_mask, torch.ones(sequences.shape[0], sequences.shape[1] - prompt_mask.shape[1],
                                              dtype=prompt_mask.dtype)], dim=1)


@pytest.fixture(scope="module")
def fresh(tokenizer, one_thread) -> PLMForCausalLM:
    """The same tiny PLM untrained: its q is nearly flat and its proposals are unrelated to q, so relaxed acceptance
    gives a robust mix of accepted and rejected pending tokens that differs between the rows of a batch."""
    return tiny_plm(tokenizer).eval()


@pytest.fixture(scope="module", params=["trained", "fresh"])
def nucleus_run(request, tiny_rows, tokenizer, left_pad):
    """Nucleus quadratic decoding of 3 left-padded prompts, every call recorded: the trained model (nucleus 0.15:
    nearly every pending token accepted) and the untrained one (nucleus 0.5: rows accept different counts, so some
    verify keys are valid in one row and not in another)."""
    model = request.getfixturevalue(request.param)
    nucleus = NUCLEUS if request.param == "trained" else 0.5
    ids, mask = left_pad(prompts(tiny_rows, (5, 14, 9)), tokenizer.pad_token_id)
    with pytest.MonkeyPatch.context() as patch:
        calls = record_calls(model, patch)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=40, auxiliary_seeds=[21, 22, 23],
                             eos_token_id=None, k_pred=K_PRED, acceptance="nucleus", acceptance_nucleus=nucleus,
                             return_dict_in_generate=True)
    return model, ids, mask, out, calls


# ---------------------------------------------------------------------------------------------- 1. verify rows

def test_verify_rows_give_the_plain_forward_next_token_distribution(nucleus_run):
    """Every verify row whose input tokens are all committed (r <= accepted count of its call) must give forward()'s
    q(. | x_<i+r) of the final sequence, on a left-padded batch. Catches verify rows at the wrong rotary positions,
    a mask that lets them see proposal rows or rejected/padded keys, and a wrong cache crop."""
    model, ids, mask, out, calls = nucleus_run
    seq = out.sequences
    with torch.no_grad():
        reference = model(input_ids=seq, attention_mask=full_mask(seq, mask)).logits.float().softmax(-1)
    width, checked, checked_after_pending = ids.shape[1], 0, 0
    for call in calls:
        for b in range(seq.shape[0]):
            if call.finished[b]:
                continue
            for r in range(int(call.accepted[b]) + 1):
                t = int(call.count[b]) + r  # generated index this verify row scores
                if t >= int(out.num_new_tokens[b]):
                    break
                got = call.logits[b, r].softmax(-1)
                torch.testing.assert_close(got, reference[b, width + t - 1], atol=1e-5, rtol=0,
                                           msg=f"row {b}, generated index {t}, verify row {r}")
                checked += 1
                checked_after_pending += r > 0
    assert checked == int(out.num_new_tokens.sum())  # each committed token's q is checked once
    assert checked_after_pending >= 10, "too few verify rows read an accepted pending token"


# ---------------------------------------------------------------------------------------------- 2. proposal rows

def objective_block(model, sequence, start, aux):
    """decoder_objective's decoder logits [W, V] for ONE block of len(aux) rows starting at `start` (predicting
    start..start+W-1 from the prefix sequence[:start] and the given auxiliaries)."""
    width = aux.numel()
    tokens = torch.cat([sequence, sequence.new_zeros(max(0, start + width + 1 - sequence.numel()))])[None]
    pos = torch.arange(start, start + width)
    layout = (pos, torch.zeros_like(pos), torch.full_like(pos, start))
    with torch.no_grad():
        return model.decoder_objective(tokens, tokens, None, layout, aux=aux[None]).decoder_logits[0].float()


def test_proposal_blocks_equal_decoder_objective_rows(nucleus_run):
    """Proposal block m (m <= accepted count, so x_<i+m is committed) must equal the decoder rows of
    `decoder_objective` for a single block starting at i+m with auxiliaries u_{count+m..count+m+W-1}; the next call's
    pending tokens must be that reference's argmax of block m = accepted count, rows 1..W-1. Catches proposal rows that
    see their own targets (or later tokens), wrong proposal positions or auxiliary indices, and a wrong block picked
    for the next pending tokens."""
    model, ids, mask, out, calls = nucleus_run
    width, real = ids.shape[1], mask.sum(1)
    blocks = pending_checked = 0
    for n, call in enumerate(calls):
        for b in range(ids.shape[0]):
            if call.finished[b]:
                continue
            sequence = out.sequences[b, width - int(real[b]):]  # unpadded: real positions
            count = int(call.count[b])
            assert int(call.next_pos[b]) == int(real[b]) + count
            for m in range(int(call.accepted[b]) + 1):
                if count + m >= int(out.num_new_tokens[b]):
                    break
                start = int(real[b]) + count + m
                aux = call.aux_table[b, count + m: count + m + K_PRED]
                expected = objective_block(model, sequence[:start], start, aux)
                got = call.logits[b, K_PRED + m * K_PRED: K_PRED + (m + 1) * K_PRED]
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=f"call {n}, row {b}, block {m}")
                blocks += 1
                if m == int(call.accepted[b]) and n + 1 < len(calls) and not calls[n + 1].finished[b]:
                    nxt = calls[n + 1].pending[b]
                    chosen = expected[1:].gather(1, nxt[:, None]).squeeze(1)
                    assert (chosen >= expected[1:].max(-1).values - 1e-4).all(), (n, b)  # argmax up to ties
                    pending_checked += 1
    assert blocks > 30 and pending_checked > 20


# ---------------------------------------------------------------------------------------------- 3. first round

@pytest.mark.parametrize("relaxed", [dict(acceptance="nucleus", acceptance_nucleus=0.999999),
                                     dict(acceptance="epsilon", acceptance_epsilon=1e-12)])
def test_first_round_commits_one_token_then_up_to_k_pred(trained, tiny_rows, tokenizer, left_pad, monkeypatch,
                                                         relaxed):
    """The zero-filled pending tokens before the first proposal must never be accepted, even by a rule that accepts
    (nearly) everything: the first call commits exactly 1 token per row, later calls up to K_pred (and mostly K_pred
    under such a rule)."""
    ids, mask = left_pad(prompts(tiny_rows, (6, 11)), tokenizer.pad_token_id)
    calls = record_calls(trained, monkeypatch)
    out = trained.generate(ids, attention_mask=mask, max_new_tokens=21, auxiliary_seeds=[5, 6], eos_token_id=None,
                           k_pred=K_PRED, return_dict_in_generate=True, **relaxed)
    assert calls[0].counts.tolist() == [1, 1]
    assert calls[0].tokens[:, 0].tolist() == out.sequences[:, ids.shape[1]].tolist()
    later = torch.stack([c.counts for c in calls[1:]])
    assert (later >= 1).all() and (later <= K_PRED).all()
    assert (later == K_PRED).float().mean() > 0.7
    # 21 tokens: 1 in the first call, then 5 calls of 4 (plus the prefill)
    assert out.model_calls.tolist() == [1 + 1 + 5, 1 + 1 + 5]


# ---------------------------------------------------------------------------------------------- 4. acceptance

def rule_by_hand(rule, probs, token, threshold):
    """Does `rule` accept `token` under `probs` [V] (float64)? Returns (accepts, whether the statistic is too close to
    the threshold to judge across float32 / float64 rounding)."""
    p = probs[token]
    if rule == "epsilon":
        return bool(p > threshold), bool(abs(p - threshold) < 1e-4 * threshold)
    ordered = probs.sort(descending=True).values
    above = ordered[ordered > p].sum()  # mass of the strictly more likely tokens
    return bool(above < threshold), bool(abs(above - threshold) < 1e-5)


@pytest.mark.parametrize("model_name,rule,threshold,mixed", [
    ("fresh", "nucleus", 0.5, True), ("fresh", "epsilon", 2.0 ** -12, True),  # q ~ uniform: 1/4096 splits it
    ("trained", "nucleus", NUCLEUS, False), ("trained", "epsilon", EPSILON, False)])
def test_relaxed_acceptance_token_by_token(request, tiny_rows, tokenizer, left_pad, monkeypatch, model_name, rule,
                                           threshold, mixed):
    """Each call: the pending tokens before the accepted count are each the Voronoi sample or pass the rule by hand;
    the first rejected one (if any) is neither; the call commits the accepted pending tokens then the Voronoi sample
    at the first rejected row. Rule-only accepts must occur, and (untrained model) rejections too."""
    model = request.getfixturevalue(model_name)
    ids, mask = left_pad(prompts(tiny_rows, (5, 14, 9, 7, 11, 6), first=1650), tokenizer.pad_token_id)
    calls = record_calls(model, monkeypatch)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, auxiliary_seeds=[31, 32, 33, 34, 35, 36],
                         eos_token_id=None, k_pred=K_PRED, acceptance=rule, **{f"acceptance_{rule}": threshold},
                         return_dict_in_generate=True)
    by_rule = by_sample = rejected = 0
    for n, call in enumerate(calls):
        sampled = call.sampled()
        for b in range(ids.shape[0]):
            if call.finished[b]:
                continue
            m = int(call.accepted[b])
            assert call.tokens[b, :m].tolist() == call.pending[b, :m].tolist(), (n, b)
            assert int(call.tokens[b, m]) == int(sampled[b, m]), (n, b)
            if not call.pending_ok[b]:
                assert n == 0 and m == 0
                continue
            for r in range(min(m + 1, K_PRED - 1)):
                token = int(call.pending[b, r])
                accepts, too_close = rule_by_hand(rule, call.logits[b, r].double().softmax(-1), token, threshold)
                if too_close:
                    if r == m:
                        break
                    continue
                if r < m:
                    assert token == int(sampled[b, r]) or accepts, (n, b, r)
                    by_sample += token == int(sampled[b, r])
                    by_rule += token != int(sampled[b, r])
                else:
                    assert token != int(sampled[b, r]) and not accepts, (n, b, r)
                    rejected += 1
    assert by_rule >= 5, (by_rule, by_sample, rejected)
    if mixed:
        assert rejected >= 10 and by_rule >= 10, (by_rule, by_sample, rejected)
    assert int(out.num_new_tokens.sum()) == 6 * 30


# ---------------------------------------------------------------------------------------------- 5. exact = Voronoi

def test_exact_decoding_reproduces_voronoi_sampling_by_hand(trained, tiny_rows, tokenizer, left_pad):
    """The tokens of exact quadratic decoding must be x_t = owner of u_t in the Voronoi cells of forward()'s q_t, with
    u_t drawn as the decoder draws its table (one seeded torch.Generator per row), in fewer calls than tokens."""
    max_new, seeds = 40, [41, 42]
    ids, mask = left_pad(prompts(tiny_rows, (7, 12), first=1700), tokenizer.pad_token_id)
    out = trained.generate(ids, attention_mask=mask, max_new_tokens=max_new, auxiliary_seeds=seeds,
                           eos_token_id=None, k_pred=K_PRED, acceptance="exact", return_dict_in_generate=True)
    seq, width = out.sequences, ids.shape[1]
    with torch.no_grad():
        q = trained(input_ids=seq, attention_mask=full_mask(seq, mask)).logits[:, width - 1:-1]  # q_t, t < max_new
        owners = decoding_cells(trained, q.reshape(-1, q.shape[-1])).view(2, max_new, -1)
    for b, seed in enumerate(seeds):
        table = torch.randint(trained.config.num_auxiliaries, (max_new + 2 * K_PRED,),
                              generator=torch.Generator().manual_seed(seed))
        expected = owners[b].gather(1, table[:max_new, None]).squeeze(1)
        assert seq[b, width:].tolist() == expected.tolist(), b
    decoding_calls = out.model_calls - 1  # minus the prefill
    assert (decoding_calls < max_new).all() and int(decoding_calls.sum()) <= 0.9 * 2 * max_new


def test_verify_rows_after_the_first_rejection_are_never_fitted(fresh, tiny_rows, tokenizer, left_pad, monkeypatch):
    """The untrained model's q is nearly flat, so every verify row has many open candidates (an iterative fit). Exact
    acceptance must then fit exactly the rows up to each row's commit row: m + 1 per unfinished row and call, never
    all W (the committed tokens themselves are checked against fits of every row in the tests above)."""
    ids, mask = left_pad(prompts(tiny_rows, (6, 9), first=1720), tokenizer.pad_token_id)
    calls = record_calls(fresh, monkeypatch)
    fitted_rows, cells = [], fresh.auxiliary_sampler.decoding_cells

    def count_rows(logits, head, bank, ranked=None):
        fitted_rows.append(logits.shape[0])
        return cells(logits, head, bank, ranked)

    monkeypatch.setattr(fresh.auxiliary_sampler, "decoding_cells", count_rows)
    fresh.generate(ids, attention_mask=mask, max_new_tokens=12, auxiliary_seeds=[5, 6], eos_token_id=None,
                   k_pred=K_PRED, acceptance="exact")
    assert len(calls) > 1 and fitted_rows
    expected = sum(int(call.counts.sum()) for call in calls)  # m + 1 rows of each of the 2 rows, every call
    # (The recording spy fits all W rows for its reference with the unpatched method, so they are not counted.)
    assert sum(fitted_rows) == expected < len(calls) * 2 * K_PRED


# ---------------------------------------------------------------------------------------------- 6. training helps

def tokens_per_call(model, tiny_rows, seeds):
    """Exact quadratic decoding of 60 new tokens from one 12-token prompt per seed (one batch; a row's tokens and
    calls do not depend on its batch): new tokens / decoding calls (the prefill not counted)."""
    rows = tiny_rows[1750:1750 + len(seeds), :12]
    out = model.generate(rows, max_new_tokens=60, auxiliary_seeds=list(seeds), eos_token_id=None, k_pred=K_PRED,
                         acceptance="exact", return_dict_in_generate=True)
    return int(out.num_new_tokens.sum()) / int((out.model_calls - 1).sum())


def test_training_lowers_decoder_nll_and_raises_tokens_per_call(trained, fresh, tiny_rows):
    """Measured with this fixture (120 steps, batch 4): decoder NLL 8.28 -> 5.89 nats on held-out rows, R 1.00 ->
    1.11; tokens per call of exact decoding 1.01-1.03 untrained vs 1.36-1.49 trained over 4 sets of 5 seeds (1.36 for
    the seeds used here; 150 steps gave 1.27-1.40). Floors: NLL down by > 1.5 nats, tokens per call < 1.08 untrained
    and > 1.15 trained."""
    held_out = tiny_rows[1800:1808]
    with torch.no_grad():
        before = fresh(input_ids=held_out, labels=held_out)
        after = trained(input_ids=held_out, labels=held_out)
    assert before.decoder_nll > 8.0  # ~log(4096) = 8.32 untrained
    assert after.decoder_nll < before.decoder_nll - 1.5
    assert after.reconstructed_tokens > before.reconstructed_tokens
    # The decoder learned to READ its auxiliaries (not only the prefix, which the encoder loss alone would teach
    # it): with the auxiliaries drawn from the observed tokens' cells its NLL is lower than with uniform random ones,
    # in the same layout (measured: 5.89 vs 6.73 nats; at 150 steps 5.82 vs 6.72, and 6.26 vs 6.43 when the decoder
    # term is dropped from the loss).
    layout = trained.block_layout(held_out.shape[1], 0)
    drawn = trained.draw_auxiliaries(after.logits[:, :-1], held_out, layout[0])[0]
    uniform = torch.randint(trained.config.num_auxiliaries, drawn.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        informed = trained.decoder_objective(held_out, held_out, None, layout, aux=drawn).decoder_nll
        uninformed = trained.decoder_objective(held_out, held_out, None, layout, aux=uniform).decoder_nll
    torch.testing.assert_close(informed, after.decoder_nll)
    assert informed < uninformed - 0.5
    seeds = (51, 52, 53, 54, 55)
    assert tokens_per_call(fresh, tiny_rows, seeds) < 1.08
    assert tokens_per_call(trained, tiny_rows, seeds) > 1.15


# ---------------------------------------------------------------------------------------------- 7. EOS mid-round

def test_eos_mid_round_stops_its_row_and_the_other_row_continues(fresh, tiny_rows, tokenizer, left_pad,
                                                                 monkeypatch):
    """Row 0's EOS is a token its call commits neither first nor last (mid-round): row 0 must end right after it (the
    rest of that call dropped, then pad_token_id), row 1 must equal its solo run, and row 0 must count fewer model
    calls (only those made while it was unfinished). The untrained model: its tokens rarely repeat, so a token that
    row 0 commits once and row 1 never is easy to find, and nucleus 0.9 makes most calls commit several tokens."""
    max_new, seeds, pad = 30, [61, 62], tokenizer.pad_token_id
    options = dict(max_new_tokens=max_new, k_pred=K_PRED, acceptance="nucleus", acceptance_nucleus=0.9,
                   return_dict_in_generate=True, pad_token_id=pad)
    row_prompts = prompts(tiny_rows, (8, 13), first=1720)
    ids, mask = left_pad(row_prompts, pad)
    width = ids.shape[1]
    with monkeypatch.context() as patch:
        calls = record_calls(fresh, patch)
        free = fresh.generate(ids, attention_mask=mask, auxiliary_seeds=seeds, eos_token_id=None, **options)
    row0, row1 = free.sequences[0, width:].tolist(), free.sequences[1, width:].tolist()
    call_starts = {int(c.count[0]) for c in calls}
    # mid-round: neither the first token its call commits nor the last (the same call also commits t + 1)
    picks = [t for t in range(3, max_new - 8) if t not in call_starts and t + 1 not in call_starts
             and row0[t] not in row0[:t] and row0[t] not in row1 and row0[t] != pad]
    assert picks, "no mid-round token to use as EOS; change the seeds"
    t = picks[0]
    eos = row0[t]

    out = fresh.generate(ids, attention_mask=mask, auxiliary_seeds=seeds, eos_token_id=eos, **options)
    assert out.num_new_tokens.tolist() == [t + 1, max_new]
    assert out.sequences[0, width:].tolist() == row0[:t + 1] + [pad] * (max_new - t - 1)
    solo = fresh.generate(row_prompts[1][None], auxiliary_seeds=seeds[1:], eos_token_id=eos, **options)
    assert out.sequences[1, width:].tolist() == solo.sequences[0, row_prompts[1].numel():].tolist() == row1
    assert out.model_calls[0] < out.model_calls[1] == solo.model_calls[0]
    # row 0 is counted for the calls up to and including the one that commits index t (plus the prefill)
    assert int(out.model_calls[0]) == 1 + sum(int(c.count[0]) <= t for c in calls)


# ---------------------------------------------------------------------------------------------- 8. R

def test_reconstructed_tokens_on_a_hand_built_grid():
    """R = mean over scored blocks of the correct-prefix length (App. 17). Blocks of 4: [T,T,F,T] -> 2,
    [T,F,T,T] -> 1, [T,T,T,T] -> 4; a 4th block whose first row is unscored does not count; a truncated block of 2
    rows [T,T] counts 2."""
    T, F_ = True, False
    rows = [T, T, F_, T] + [T, F_, T, T] + [T, T, T, T]
    block = torch.arange(3).repeat_interleave(4)
    offset = torch.arange(4).repeat(3)
    first = offset == 0
    correct = torch.tensor([rows])
    R = PLMForCausalLM.reconstructed_tokens
    assert R(correct, block, offset, first).item() == pytest.approx(7 / 3)
    assert R(correct, block, offset, first, num_blocks=6, block_size=8).item() == pytest.approx(7 / 3)

    unscored = torch.tensor([rows + [F_, T, T, T]])
    block4, offset4 = torch.arange(4).repeat_interleave(4), torch.arange(4).repeat(4)
    assert R(unscored, block4, offset4, offset4 == 0).item() == pytest.approx(7 / 3)
    assert R(unscored, block4, offset4, offset4 == 0, num_blocks=5, block_size=4).item() == pytest.approx(7 / 3)

    truncated = torch.tensor([rows + [T, T]])
    block5 = torch.cat([block, torch.tensor([3, 3])])
    offset5 = torch.cat([offset, torch.tensor([0, 1])])
    assert R(truncated, block5, offset5, offset5 == 0).item() == pytest.approx(9 / 4)
    assert R(truncated, block5, offset5, offset5 == 0, num_blocks=7, block_size=5).item() == pytest.approx(9 / 4)

    # two sequences: the mean runs over every scored block of the batch
    batch = torch.tensor([rows, [T, T, T, F_] + [F_, F_, F_, F_] + [T, T, F_, F_]])
    assert R(batch, block, offset, first).item() == pytest.approx((7 + 3 + 2) / 5)
    assert R(torch.zeros(1, 12, dtype=torch.bool), block, offset, first).item() == 0.0


def test_objective_reports_r_from_its_decoder_argmax(trained, tiny_rows):
    """The objective's R equals the hand count over its own decoder rows (argmax == target, first row counted as
    correct), blocks of 4 starting at 1, 5, ... in eval mode."""
    x = tiny_rows[1810:1812, :33]
    with torch.no_grad():
        out = trained(input_ids=x, labels=x)
    hits = (out.decoder_logits.argmax(-1) == x[:, 1:]).view(2, 8, 4)
    hits[..., 0] = True
    lengths = hits.long().cumprod(-1).sum(-1)
    assert out.reconstructed_tokens.item() == pytest.approx(lengths.float().mean().item())
    assert out.reconstructed_tokens.item() > 1.0


# ---------------------------------------------------------------------------------------------- 9. Voronoi geometry

def test_voronoi_owners_use_unnormalised_lm_head_rows():
    """Cells are argmax_v e_v·e_u + w_v with e_v the RAW LM-head row: scaling one candidate's row changes the owners
    where it is a candidate (only there), and owners equal those of F.normalize(W) exactly when every row has the
    same norm."""
    g = torch.Generator().manual_seed(0)
    vocab, dim, num_aux, top_m = 64, 16, 128, 16
    W = torch.randn(vocab, dim, generator=g) * (0.5 + torch.rand(vocab, 1, generator=g))
    bank = sample_auxiliary_bank(num_aux, dim, 3)
    logits = torch.randn(6, vocab, generator=g) * 2
    owners = voronoi_owners(logits, W, bank, top_m).owners

    candidates = logits.topk(top_m).indices
    token = int(candidates[0, 0])  # the most likely token at position 0
    scaled = W.clone()
    scaled[token] *= 3
    moved = voronoi_owners(logits, scaled, bank, top_m).owners
    is_candidate = (candidates == token).any(1)
    assert (moved[0] != owners[0]).any()
    assert torch.equal(moved[~is_candidate], owners[~is_candidate])

    unit = F.normalize(W, dim=-1)
    assert not torch.equal(owners, voronoi_owners(logits, unit, bank, top_m).owners)
    assert torch.equal(voronoi_owners(logits, 2.5 * unit, bank, top_m).owners,
                       voronoi_owners(logits, unit, bank, top_m).owners)


def test_model_auxiliary_owners_use_the_raw_lm_head(trained, tiny_rows):
    """The model's samplers (training's fit and decoding's exact cells) must fit cells on its raw LM-head weight, not
    a normalised copy."""
    cfg = trained.config
    with torch.no_grad():
        logits = trained(input_ids=tiny_rows[1830:1831, :6]).logits[0]
    got = trained.auxiliary_owners(logits)[0]
    weight, bank = trained.lm_head.weight.detach().float(), trained.model.auxiliary_bank
    kwargs = dict(rounds=cfg.sinkhorn_rounds, sweeps=cfg.sinkhorn_sweeps, shortlist=cfg.sinkhorn_shortlist)
    assert torch.equal(got, voronoi_owners(logits, weight, bank, cfg.auxiliary_top_m, **kwargs).owners)
    assert weight.norm(dim=-1).std() > 0.01  # rows of unequal norm, so normalising would matter
    assert not torch.equal(got, voronoi_owners(logits, F.normalize(weight, dim=-1), bank, cfg.auxiliary_top_m,
                                               **kwargs).owners)
    decoding = decoding_cells(trained, logits)
    exact = exact_voronoi_owners(logits, bank, cfg.auxiliary_top_m, token_scores(weight, bank)).owners
    assert torch.equal(decoding, exact)
    assert not torch.equal(decoding, exact_voronoi_owners(logits, bank, cfg.auxiliary_top_m,
                                                          token_scores(F.normalize(weight, dim=-1), bank)).owners)


@pytest.mark.parametrize("decoding", ["quadratic", "voronoi"])
def test_greedy_decoding_is_the_encoders_argmax_token_by_token(trained, tiny_rows, tokenizer, left_pad, decoding):
    """do_sample=False: every token is the argmax of forward()'s logits given the tokens before it (a hand loop, one
    row alone, no cache), rows batched with left padding give what they give alone, and quadratic decoding needs
    fewer calls than tokens (the trained decoder's proposals are mostly the argmax)."""
    max_new, rows = 24, prompts(tiny_rows, (7, 12), first=1700)
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    out = trained.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                           decoding=decoding, k_pred=K_PRED, acceptance="exact", auxiliary_seeds=[3, 4],
                           return_dict_in_generate=True)
    for b, row in enumerate(rows):
        seq = row[None].clone()
        with torch.no_grad():
            for _ in range(max_new):
                seq = torch.cat([seq, trained(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert out.sequences[b, ids.shape[1]:].tolist() == seq[0, row.numel():].tolist(), b
        alone = trained.generate(row[None], max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                 decoding=decoding, k_pred=K_PRED, acceptance="exact", auxiliary_seeds=[3 + b])
        assert alone[0, row.numel():].tolist() == seq[0, row.numel():].tolist(), b
    if decoding == "quadratic":
        assert int((out.model_calls - 1).sum()) < 2 * max_new
