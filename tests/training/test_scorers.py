"""DPO response scores of CALM, Cola DLM and AURORA-LM, and the token-likelihood score (hf_latentlm/training/scorers.py).

Per family, on tiny models: the score equals a hand computation from the model's raw pieces (explicit per-term loops,
the backbone run once per response chunk / block on its own prefix, not through the scorer's batched pass); the
draws are the documented paged generators, identical across calls, batch compositions and models, shared by the two
candidates of a pair; policy == reference gives δ = 0 exactly; length normalisation; a prompt token never changes
which terms are scored while a response token changes the score; a padded row scores as it does alone; gradients
reach the trainable parameters (and LoRA adapters, through PEFT) only.
"""

from __future__ import annotations

import copy

import pytest
import torch
from family_contract import build_tiny

from hf_latentlm.families import get_family
from hf_latentlm.training.post_training import scorer_for
from hf_latentlm.training.scorers import (
    DRAW_SEED,
    PAGE,
    AuroraResponseScorer,
    CALMResponseScorer,
    ColaResponseScorer,
    ResponseScore,
    TokenLikelihoodScorer,
    row_generator,
)

FAMILIES = ("calm", "cola", "aurora")
SCORERS = {"calm": CALMResponseScorer, "cola": ColaResponseScorer, "aurora": AuroraResponseScorer}


@pytest.fixture(scope="module")
def models(tokenizer):
    """family -> (model, a second model of the same config with other weights), eval mode. AURORA models get latent
    statistics (both from the first model's encoder, as a reference and its policy share them)."""
    out = {}
    for family in FAMILIES:
        first, second = (strengthened(build_tiny(family, tokenizer, seed=seed), seed) for seed in (0, 1))
        if family == "aurora":
            first.estimate_latent_statistics(ids_from(first, 4, 16, seed=99))
            second.model.autoencoder.load_state_dict(first.model.autoencoder.state_dict())
        out[family] = (first, second)
    return out


def strengthened(model, seed: int):
    """`model` in eval mode with its trainable matrices redrawn at std 1/√fan_in (the tiny build's 0.02 leaves an
    untrained prior almost blind to its context, which would hide a wrong context in the hand comparisons)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad and param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
    return model.eval()


def ids_from(model, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(2, min(model.config.vocab_size, 600), (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def eos(model) -> int:
    return model.config.eos_token_id


def pair_rows(model, prompt_len: int, response_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt [P], response [R]) with the response ending in EOS."""
    ids = ids_from(model, 1, prompt_len + response_len, seed)[0]
    ids[-1] = eos(model)
    return ids[:prompt_len], ids[prompt_len:]


def batch_of(rows, pad: int = 1, side: str = "right"):
    """rows: list of (prompt, response) -> (input_ids, attention_mask, completion_mask) [B, T], padded on `side`."""
    width = max(p.numel() + r.numel() for p, r in rows)
    ids = torch.full((len(rows), width), pad)
    mask, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (p, r) in enumerate(rows):
        n = p.numel() + r.numel()
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        ids[b, cols], mask[b, cols] = torch.cat([p, r]), 1
        completion[b, cols] = torch.cat([torch.zeros_like(p), torch.ones_like(r)])
    return ids, mask, completion


def score_rows(scorer, model, rows, keys, side="right", draws_model=None):
    ids, mask, completion = batch_of(rows, side=side)
    draws = scorer.draws(draws_model or model, ids, mask, completion, keys)
    with torch.no_grad():
        return scorer.score(model, ids, mask, completion, draws), draws


# ====================================================================================================================
# Hand computations (one row, explicit loops over terms, the model's raw pieces)
# ====================================================================================================================

def calm_hand(model, prompt, response, draws) -> list[float]:
    """Per response chunk c: the backbone over the chunk-aligned prefix alone (as generate()'s prefill: EOS left-fill
    with attention 0), the energy head's N samples from model_noise[c], the M posterior samples of the target chunk
    (μ + σ·target_noise[c]), and Eq. 10 by loops over n, m."""
    K, fill = model.config.chunk_size, eos(model)
    left, right = (-prompt.numel()) % K, (-response.numel()) % K
    ids = torch.cat([torch.full((left,), fill), prompt, response, torch.full((right,), fill)])
    mask = torch.cat([torch.zeros(left), torch.ones(prompt.numel() + response.numel()), torch.zeros(right)]).long()
    first = (left + prompt.numel()) // K
    terms = []
    for c in range((response.numel() + right) // K):
        end = (first + c) * K
        with torch.no_grad():
            h = model.model(input_ids=ids[None, :end], attention_mask=mask[None, :end]).last_hidden_state[0, -1]
            samples = model.energy_head(h, draws["model_noise"][0, c]).float()  # [N, l]
            mean, log_std = model.autoencoder.encode(ids[end:end + K])
        targets = mean + log_std.exp() * draws["target_noise"][0, c]  # [M, l]
        n, m = samples.shape[0], targets.shape[0]
        fidelity = sum(float((targets[j] - samples[i]).norm()) for i in range(n) for j in range(m)) * 2 / (n * m)
        diversity = sum(float((samples[i] - samples[k]).norm()) for i in range(n) for k in range(n) if i != k)
        terms.append(fidelity - diversity / (n * (n - 1)))
    return terms


def flow_row(model, prompt, response, alignment):
    Q = model.config.block_size
    left = (-prompt.numel()) % Q if alignment == "eos_fill" else 0
    ids = torch.cat([torch.full((left,), eos(model)), prompt, response])
    return ids, left + prompt.numel()


def flow_hand(family, model, prompt, response, draws, alignment="repaint") -> list[float]:
    """Per block touching the response: one pass of the prior over [clean history ; the block] alone (the plain
    block-causal layout, not the dual-stream mask), the block's response positions noisy at the block's drawn time,
    its prompt positions clean at time 0; the error of each response position by a loop."""
    Q = model.config.block_size
    ids, start = flow_row(model, prompt, response, alignment)
    length = ids.numel()
    with torch.no_grad():
        if family == "cola":  # the reference's latents, drawn with `draws` (checked by hand in the test below)
            z = draws["latents"][0, :length].float()
        else:
            ae = model.model.autoencoder
            z = ae.standardize(ae.encode(ids[None]))[0]
    terms = []
    for k, block_start in enumerate(range(start // Q * Q, length, Q)):
        end = min(block_start + Q, length)
        x, times = z[:end].clone(), torch.zeros(end)
        for p in range(max(block_start, start), end):
            t, eps = draws["times"][0, k], draws["noise"][0, p - start]
            x[p] = (1 - t) * z[p] + t * eps
            times[p] = t
        with torch.no_grad():
            if family == "cola":
                out = model.velocity(x[None], times[None])[0]
            else:
                noisy = torch.arange(end) >= block_start
                out = model.predict_x0(x[None], times[None], noisy[None], torch.zeros_like(x)[None])[0]
        for p in range(max(block_start, start), end):
            if family == "cola":
                target = draws["noise"][0, p - start] - z[p]
            else:
                target = z[p]
            terms.append(float((out[p] - target).pow(2).mean()))
    assert len(terms) == response.numel()
    return terms


def hand_terms(family, model, prompt, response, draws, alignment="repaint"):
    if family == "calm":
        return calm_hand(model, prompt, response, draws)
    return flow_hand(family, model, prompt, response, draws, alignment)


def scorer_of(family, alignment="repaint"):
    return SCORERS[family]() if family == "calm" else SCORERS[family](alignment=alignment)


def seeded(scorer, draws: dict) -> dict:
    """The draws seeded by the pair keys: all but those the reference model makes (`reference_draws`: Cola's
    latents)."""
    return {k: v for k, v in draws.items() if k not in getattr(scorer, "reference_draws", ())}


CASES = [("calm", "repaint"), ("cola", "repaint"), ("cola", "eos_fill"), ("aurora", "repaint"),
         ("aurora", "eos_fill")]


# ====================================================================================================================
# (a) hand computation, (d) normalisation
# ====================================================================================================================

@pytest.mark.parametrize("family,alignment", CASES)
def test_score_is_the_sum_of_hand_computed_terms(models, family, alignment):
    model = models[family][0]
    prompt, response = pair_rows(model, 6, 7, seed=1)  # mid-block prompt end, response ending mid-chunk
    scorer = scorer_of(family, alignment)
    score, draws = score_rows(scorer, model, [(prompt, response)], ["pair-1"])
    terms = hand_terms(family, model, prompt, response, draws, alignment)
    expected_terms = -(-7 // model.config.chunk_size) if family == "calm" else 7
    assert len(terms) == expected_terms and score.num_terms.tolist() == [expected_terms]
    assert float(score.loss_sum[0]) == pytest.approx(sum(terms), rel=1e-4, abs=1e-5)
    assert float(score.normalised()[0]) == pytest.approx(-sum(terms) / len(terms), rel=1e-4, abs=1e-5)


def test_normalisation_is_the_mean_per_term_loss_whatever_the_length():
    """A response whose per-term losses are each repeated (twice, thrice) keeps its normalised score; the raw sum
    does not."""
    per_term = torch.tensor([0.7, 1.9, 0.2, 3.1])
    base = ResponseScore(per_term.sum()[None], torch.tensor([4.0]))
    for copies in (2, 3):
        longer = per_term.repeat_interleave(copies)
        scaled = ResponseScore(longer.sum()[None], torch.tensor([float(longer.numel())]))
        torch.testing.assert_close(scaled.normalised(), base.normalised())
        assert float(scaled.loss_sum[0]) != pytest.approx(float(base.loss_sum[0]))


# ====================================================================================================================
# (b) draws
# ====================================================================================================================

@pytest.mark.parametrize("family", FAMILIES)
def test_draws_are_frozen_per_pair_and_independent_of_batch_and_model(models, family):
    model, other = models[family]
    scorer = scorer_of(family)
    a, b, c = pair_rows(model, 5, 9, 2), pair_rows(model, 8, 4, 3), pair_rows(model, 3, 11, 4)
    keys = {"a": "key-a", "b": "key-b", "c": "key-c"}
    rows = {"a": a, "b": b, "c": c}

    def draws_of(order, side="right", ref=model):
        ids, mask, completion = batch_of([rows[n] for n in order], side=side)
        return seeded(scorer, scorer.draws(ref, ids, mask, completion, [keys[n] for n in order]))

    def row_draw(draws, index, name, count):
        return draws[name][index, :count]

    alone = {n: draws_of([n]) for n in rows}
    batches = [draws_of(["a", "b", "c"]), draws_of(["c", "a", "b"], side="left"), draws_of(["b", "a"], ref=other),
               draws_of(["a", "b", "c"])]
    for draws, order in zip(batches, (["a", "b", "c"], ["c", "a", "b"], ["b", "a"], ["a", "b", "c"])):
        for i, name in enumerate(order):
            for key, value in alone[name].items():
                count = value.shape[1]
                assert torch.equal(row_draw(draws, i, key, count), value[0]), (family, key, name)
                assert not draws[key][i, count:].any()  # zero padding past the row's terms
    # The documented generator: term i of a stream is row i % PAGE of page i // PAGE.
    first = alone["a"]
    config = model.config
    if family == "calm":
        n = config.num_model_samples
        page = torch.rand(PAGE, n, config.noise_size, generator=row_generator(DRAW_SEED, "key-a", "calm-head-noise",
                                                                            0)) - 0.5
        torch.testing.assert_close(first["model_noise"][0], page[: first["model_noise"].shape[1]], rtol=0, atol=0)
    else:
        page = torch.randn(PAGE, config.latent_size, generator=row_generator(DRAW_SEED, "key-a", f"{family}-noise", 0))
        torch.testing.assert_close(first["noise"][0], page[: first["noise"].shape[1]], rtol=0, atol=0)
        assert ((first["times"] > 0) & (first["times"] < 1)).all()
    # Another pair key or seed draws differently.
    ids, mask, completion = batch_of([a])
    for other_draws in (scorer.draws(model, ids, mask, completion, ["key-z"]),
                        type(scorer)(seed=1).draws(model, ids, mask, completion, ["key-a"])):
        assert all(not torch.equal(other_draws[k], first[k]) for k in first)


def test_cola_latents_are_the_reference_vaes_posterior_sample_under_the_documented_draw(models):
    """Cola's `latents` draw is z0 = μ_ref + σ_ref·ξ of the model `draws` is given (the reference), ξ of row position
    p being row p % PAGE of page p // PAGE of the "cola-posterior" stream: by hand, row by row; it differs for
    another reference; a padded batch holds each row's own latents. The seeded draws hold no ξ (nothing but t, ε)."""
    model, other = models["cola"]
    scorer = ColaResponseScorer()
    assert scorer.reference_draws == ("latents",) and scorer.draws_from_keys
    rows = [pair_rows(model, 5, 20, 21), pair_rows(model, 3, 6, 22)]  # 25 positions: two pages of ξ
    ids, mask, completion = batch_of(rows)
    draws = scorer.draws(model, ids, mask, completion, ["ka", "kb"])
    assert set(draws) == {"times", "noise", "latents"}
    assert set(scorer.keyed_draws(model.config, ids, mask, completion, ["ka", "kb"])) == {"times", "noise"}
    vae = model.model.vae
    for b, (key, (prompt, response)) in enumerate(zip(["ka", "kb"], rows)):
        row = torch.cat([prompt, response])
        xi = torch.cat([torch.randn(PAGE, model.config.latent_size,
                                    generator=row_generator(DRAW_SEED, key, "cola-posterior", page))
                        for page in range(2)])[: row.numel()]
        with torch.no_grad():
            hand = vae.encoder(row[None])[0] + vae.encoder.posterior_std() * xi
        torch.testing.assert_close(draws["latents"][b, : row.numel()], hand, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(scorer.draws(other, ids, mask, completion, ["ka", "kb"])["latents"], draws["latents"])


@pytest.mark.parametrize("family", FAMILIES)
def test_chosen_and_rejected_of_a_pair_share_their_draws_term_by_term(models, family):
    """Same pair key: the candidates' draws agree at every term index both have (common random numbers: the flow
    families' t per response block and ε per response position are shared between the two candidates, as
    Diffusion-DPO shares t and ε between the winning and losing sample; unlike Diffusion-DPO, which draws them afresh
    at every step, these are frozen for the whole run, `test_draws_are_frozen_per_pair_...` above)."""
    model = models[family][0]
    scorer = scorer_of(family)
    prompt, chosen = pair_rows(model, 6, 13, 5)
    rejected = pair_rows(model, 6, 6, 6)[1]
    ids, mask, completion = batch_of([(prompt, chosen), (prompt, rejected)])
    draws = seeded(scorer, scorer.draws(model, ids, mask, completion, ["pair", "pair"]))
    for key, value in draws.items():
        shorter = int((value[1].flatten(1) != 0).any(1).sum()) if value.dim() > 2 else int((value[1] != 0).sum())
        assert shorter > 0
        assert torch.equal(value[0, :shorter], value[1, :shorter]), key


# ====================================================================================================================
# (c) policy == reference, (e) prompt vs response tokens, (f) padding
# ====================================================================================================================

@pytest.mark.parametrize("family", FAMILIES)
def test_policy_equal_to_reference_gives_delta_exactly_zero(models, family):
    model = models[family][0]
    policy, reference = copy.deepcopy(model).train(), copy.deepcopy(model).eval()
    scorer = scorer_of(family)
    rows = [pair_rows(model, 7, 9, 7), pair_rows(model, 7, 5, 8)]
    ids, mask, completion = batch_of(rows)
    draws = scorer.draws(reference, ids, mask, completion, ["p", "p"])
    with torch.no_grad():
        ref = scorer.score(reference, ids, mask, completion, draws)
    pol = scorer.score(policy, ids, mask, completion, draws)
    delta = pol.normalised() - ref.normalised()
    assert torch.equal(delta.detach(), torch.zeros(2))
    # and the other model's weights give another score under the same draws
    other = scorer.score(models[family][1], ids, mask, completion, draws)
    assert not torch.allclose(other.loss_sum.detach(), ref.loss_sum)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_tokens_never_change_which_terms_are_scored(models, family):
    model = models[family][0]
    scorer = scorer_of(family)
    prompt, response = pair_rows(model, 7, 10, 9)
    base, draws = score_rows(scorer, model, [(prompt, response)], ["k"])
    changed_prompt = prompt.clone()
    changed_prompt[-1] = prompt[-1] % 500 + 2 if prompt[-1] % 500 + 2 != prompt[-1] else 3
    changed_response = response.clone()
    changed_response[1] = response[1] % 500 + 2 if response[1] % 500 + 2 != response[1] else 3
    config = model.config
    for new_prompt, new_response in ((changed_prompt, response), (prompt, changed_response)):
        ids, mask, completion = batch_of([(new_prompt, new_response)])
        new_draws = scorer.draws(model, ids, mask, completion, ["k"])
        assert all(torch.equal(new_draws[k], draws[k]) for k in seeded(scorer, draws))
        with torch.no_grad():
            new = scorer.score(model, ids, mask, completion, new_draws)
        assert torch.equal(new.num_terms, base.num_terms)
        if family == "calm":
            layout = scorer.layout(config, ids, mask, completion)
            assert layout.response_chunks.tolist() == [-(-10 // config.chunk_size)]
        else:
            layout = scorer.layout(config, ids, mask, completion)
            _, _, in_response = scorer.conditions(config, layout, new_draws["times"], new_draws["noise"])
            assert in_response[0].nonzero().flatten().tolist() == list(range(7, 17))
        if new_response is not response:
            assert float(new.loss_sum[0]) != pytest.approx(float(base.loss_sum[0]), rel=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_row_scores_as_it_does_alone(models, family, side):
    model = models[family][0]
    scorer = scorer_of(family)
    rows = [pair_rows(model, 5, 6, 10), pair_rows(model, 9, 14, 11), pair_rows(model, 2, 3, 12)]
    keys = ["x", "y", "z"]
    batched, _ = score_rows(scorer, model, rows, keys, side=side)
    for b, row in enumerate(rows):
        alone, _ = score_rows(scorer, model, [row], [keys[b]])
        torch.testing.assert_close(batched.loss_sum[b], alone.loss_sum[0], rtol=1e-5, atol=1e-5)
        assert float(batched.num_terms[b]) == float(alone.num_terms[0])


# ====================================================================================================================
# Gradients, PEFT, dispatch, refusals
# ====================================================================================================================

@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_reach_the_trainable_prior_only_and_lora_through_peft(models, family):
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(models[family][0])
    scorer = scorer_of(family)
    rows = [pair_rows(model, 6, 7, 13)]
    ids, mask, completion = batch_of(rows)
    draws = scorer.draws(model, ids, mask, completion, ["g"])
    base = scorer.score(model, ids, mask, completion, draws)
    base.loss_sum.sum().backward()
    # Cola: the VAE trains (`trains_vae`) but the score reads the reference's latents, so it gets no gradient.
    frozen = {"calm": ("autoencoder.",), "cola": ("reference_encoder.", "model.vae."),
              "aurora": ("model.autoencoder.",)}[family]
    if family == "cola":
        assert model.config.trains_vae and all(p.requires_grad for p in model.model.vae.parameters())
    moved = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    assert moved and not any(n.startswith(frozen) for n in moved)
    model.zero_grad(set_to_none=True)

    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=get_family(family).lora_target_modules))
    wrapped = scorer.score(peft_model, ids, mask, completion, draws)  # LoRA starts as the identity (B = 0)
    torch.testing.assert_close(wrapped.loss_sum, base.loss_sum, rtol=1e-5, atol=1e-6)
    wrapped.loss_sum.sum().backward()
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.grad is not None and p.grad.any() for p in lora_b)


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_run_through_the_wrappers_forward_with_adapters_as_peft_sets_them(models, family):
    """The score runs as the forward (`scoring_pass`), so PEFT applies its adapters, or not inside
    `disable_adapter()`, and nothing on the model is replaced: its `forward` and signature stay the class's."""
    import inspect

    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(models[family][0])
    scorer = scorer_of(family)
    ids, mask, completion = batch_of([pair_rows(model, 6, 7, 13)])
    draws = scorer.draws(model, ids, mask, completion, ["g"])
    with torch.no_grad():
        base = scorer.score(model, ids, mask, completion, draws).loss_sum
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=get_family(family).lora_target_modules))
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
        adapted = scorer.score(peft_model, ids, mask, completion, draws).loss_sum
        with peft_model.disable_adapter():
            disabled = scorer.score(peft_model, ids, mask, completion, draws).loss_sum
    assert (adapted - base).abs().max() > 1e-4, "the adapters change the score"
    torch.testing.assert_close(disabled, base, rtol=1e-5, atol=1e-6)
    assert "forward" not in model.__dict__ and "scoring_pass" not in inspect.signature(model.forward).parameters


@pytest.mark.parametrize("family", FAMILIES)
def test_scorer_for_dispatches_each_latent_family(models, family):
    assert type(scorer_for(models[family][0])) is SCORERS[family]


def test_bad_rows_and_options_are_named(models):
    model = models["calm"][0]
    prompt, response = pair_rows(model, 4, 5, 14)
    ids, mask, completion = batch_of([(prompt, response)])
    scorer = CALMResponseScorer()
    with pytest.raises(ValueError, match="no response token"):
        scorer.draws(model, ids, mask, torch.zeros_like(completion), ["k"])
    gap = completion.clone()
    gap[0, -1] = 0
    with pytest.raises(ValueError, match="one run at the end"):
        scorer.draws(model, ids, mask, gap, ["k"])
    with pytest.raises(ValueError, match="at least 1 token"):
        scorer.draws(model, ids, mask, torch.ones_like(completion), ["k"])
    with pytest.raises(ValueError, match="pair keys"):
        scorer.draws(model, ids, mask, completion, ["k", "l"])
    with pytest.raises(ValueError, match="target_noise"):
        scorer.score(model, ids, mask, completion, {"model_noise": torch.zeros(1)})
    with pytest.raises(ValueError, match="alignment"):
        ColaResponseScorer(alignment="middle")
    with pytest.raises(ValueError, match="num_model_samples"):
        CALMResponseScorer(num_model_samples=1)
    fresh = copy.deepcopy(models["aurora"][0])
    fresh.model.autoencoder.has_latent_statistics.fill_(False)
    ids, mask, completion = batch_of([pair_rows(fresh, 4, 5, 15)])
    draws = AuroraResponseScorer().draws(fresh, ids, mask, completion, ["k"])
    with pytest.raises(ValueError, match="latent statistics"):
        AuroraResponseScorer().score(fresh, ids, mask, completion, draws)


def test_token_likelihood_score_is_the_mean_log_probability_of_the_response_tokens(tokenizer):
    """By hand, token by token from the model's own logits on each row alone: the summed -log p of the response
    tokens (prompt and padding excluded) and their count. Rows of different prompt and response lengths, right
    padded; the AR baseline's weights redrawn so that every position's distribution differs."""
    model = strengthened(build_tiny("ar", tokenizer), 3)
    ids = ids_from(model, 3, 12, seed=5)
    mask = torch.ones_like(ids)
    completion = torch.zeros_like(ids)
    lengths, prompts = [12, 9, 7], [4, 6, 2]
    for b, (length, prompt) in enumerate(zip(lengths, prompts)):
        mask[b, length:] = 0
        completion[b, prompt:length] = 1
    scorer = TokenLikelihoodScorer()
    assert scorer.draws(model, ids, mask, completion, ["k1", "k2", "k3"]) == {}
    with torch.no_grad():
        score = scorer.score(model, ids, mask, completion, {})
    for b, (length, prompt) in enumerate(zip(lengths, prompts)):
        with torch.no_grad():
            log_probs = model(input_ids=ids[b:b + 1, :length]).logits[0].float().log_softmax(-1)
        expected = -sum(log_probs[t - 1, ids[b, t]] for t in range(prompt, length))
        assert score.loss_sum[b].item() == pytest.approx(expected.item(), rel=1e-4)
        assert score.num_terms[b].item() == length - prompt
        # Its next-token statistics (TRL's entropy / mean_token_accuracy / logits metrics), position by position.
        entropy = -sum(float((log_probs[t - 1].exp() * log_probs[t - 1]).sum()) for t in range(prompt, length))
        hits = sum(int(log_probs[t - 1].argmax()) == int(ids[b, t]) for t in range(prompt, length))
        assert score.tokens.count[b].item() == length - prompt and score.tokens.correct[b].item() == hits
        assert score.tokens.entropy_sum[b].item() == pytest.approx(entropy, rel=1e-4)
    assert torch.allclose(score.normalised(), -score.loss_sum / torch.tensor([8.0, 3.0, 5.0]))
