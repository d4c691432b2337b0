"""GRPO: `LatentGRPOTrainer` on TRL's `GRPOTrainer`, rollouts from each family's generate(), the family
log-likelihoods and the latent families' surrogate, and the task rewards.

What is checked, against independent computations where there is a number to compute:
- PLM's per-token log-likelihoods and entropies equal a hand computation from the encoder's logits of each row alone
  (TRL's left-padded prompt + right-padded completion layout, rows of different lengths).
- PLM's rollouts (exact acceptance) draw each token with probability n_v / N, the largest-remainder capacities of
  the renormalised top-M of the encoder's q (an empirical distribution of 4000 first tokens of a peaked model).
- The surrogate (CALM, Cola, AURORA) uses common random numbers: identical weights give a ratio of exactly 1 and a
  KL of exactly 0, a row scores as alone in any batch, and it is the mean of M scorer calls under the rollout's
  keys; with a stub velocity of 0, Cola's surrogate has a closed-form mean, which its estimate matches, and its
  variance falls as 1/M.
- Every family trains a few GRPO steps with β > 0 and logs TRL's metrics; a tiny PLM and a tiny Cola learn a
  simple reward; options a family cannot honour are refused by name; the CLI's `grpo` resumes exactly.
"""

import copy
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from family_contract import build_tiny
from safetensors.torch import load_file

from hf_latentlm.families import build_model
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.modeling.auxiliaries import largest_remainder_capacities, top_candidates
from hf_latentlm.recipes import run_grpo
from hf_latentlm.training.grpo import LatentGRPOTrainer, grpo_config, right_aligned, rollout_key
from hf_latentlm.training.scorers import ColaResponseScorer
from hf_latentlm.training.tasks import exact_match_reward, partial_credit, partial_credit_reward

DDP_WORKER = Path(__file__).with_name("ddp_grpo_worker.py")
FAMILIES = ["plm", "calm", "cola", "aurora"]
LATENT = ["calm", "cola", "aurora"]


def prompts(count: int) -> list[dict]:
    """Plain-text prompts of different lengths, with a reference `response` for the task rewards."""
    words = "the king is dead and long live the queen of all the land".split()
    return [{"prompt": "User: say " + " ".join(words[: 2 + i % 5]) + "\n\nAssistant:", "response": "yes"}
            for i in range(count)]


def tiny_model(family: str, tokenizer):
    model = build_tiny(family, tokenizer)
    if hasattr(model, "prepare_training"):  # AURORA's latent statistics, as the training loop sets them
        ids = tokenizer([p["prompt"] for p in prompts(8)], return_tensors="pt", padding=True)["input_ids"]
        model.prepare_training(ids)
    return model


def low_token_reward(completions, completion_ids, **kwargs):
    """A reward with a known optimum (1) that an untrained model meets half the time: the fraction of completion
    tokens in the lower half of the vocabulary (ids < 2048)."""
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def trainer_for(model, tokenizer, tmp_path, rewards=None, rows: int = 4, peft_config=None, **overrides):
    options = dict(batch_size=4, num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1,
                   learning_rate=1e-3, save_strategy="no")
    args = grpo_config(str(tmp_path / "grpo"), **{**options, **overrides})
    return LatentGRPOTrainer(model=model, reward_funcs=rewards or [low_token_reward], args=args,
                             train_dataset=Dataset.from_list(prompts(rows)), processing_class=tokenizer,
                             peft_config=peft_config)


def trl_layout(tokenizer, rows: list[tuple[list[int], list[int]]]):
    """TRL's model input: prompts left-padded, completions right-padded, concatenated."""
    pad = tokenizer.pad_token_id
    width_p, width_c = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids, mask = [], []
    for prompt, completion in rows:
        ids.append([pad] * (width_p - len(prompt)) + prompt + completion + [pad] * (width_c - len(completion)))
        mask.append([0] * (width_p - len(prompt)) + [1] * (len(prompt) + len(completion)) +
                    [0] * (width_c - len(completion)))
    return torch.tensor(ids), torch.tensor(mask), width_c


def random_rows(tokenizer, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(2, tokenizer.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    return [(draw(p), draw(c)) for p, c in lengths]


ROW_LENGTHS = [(5, 7), (9, 3), (3, 6)]


# ---------------------------------------------------------------------------------------------------------------------
# Layout and rewards
# ---------------------------------------------------------------------------------------------------------------------

def test_right_aligned_moves_real_tokens_first_and_finds_each_completion_token():
    ids = torch.tensor([[9, 9, 1, 2, 3, 4, 9], [5, 6, 7, 8, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    out_ids, out_mask, completion, columns = right_aligned(ids, mask, logits_to_keep=3)
    assert out_ids[0, :4].tolist() == [1, 2, 3, 4] and out_mask[0].tolist() == [1, 1, 1, 1, 0, 0, 0]
    assert out_ids[1].tolist() == ids[1].tolist()
    # Row 0's completion is its columns 4, 5 (6 is padding); they now sit at 2, 3.
    assert completion[0].tolist() == [0, 0, 1, 1, 0, 0, 0] and columns[0, :2].tolist() == [2, 3]
    assert completion[1].tolist() == [0, 0, 0, 0, 1, 1, 1] and columns[1].tolist() == [4, 5, 6]
    assert out_ids.gather(1, columns)[1].tolist() == [10, 11, 12]


def test_rewards_are_exact_match_and_positional_word_credit():
    assert exact_match_reward([" 1 2 3", "1 2 4", [{"role": "assistant", "content": "1 2 3"}]],
                              response=["1 2 3"] * 3) == [1.0, 0.0, 1.0]
    assert partial_credit("1 2 4", "1 2 3") == pytest.approx(2 / 3)
    assert partial_credit("1 2", "1 2 3") == pytest.approx(2 / 3)  # stops early
    assert partial_credit("1 2 3 4 5 6", "1 2 3") == pytest.approx(3 / 6)  # runs on
    assert partial_credit("0 1 2 3", "1 2 3") == 0.0  # shifted by one: nothing at its index
    assert partial_credit_reward([" 1 2 3<|endoftext|>junk"], response=["1 2 3"]) == [1.0]


# ---------------------------------------------------------------------------------------------------------------------
# PLM: encoder log-probabilities, and what the rollouts sample
# ---------------------------------------------------------------------------------------------------------------------

def test_plm_log_probs_and_entropies_are_the_encoders_of_each_row_alone(tmp_path, tokenizer):
    model = tiny_model("plm", tokenizer)
    trainer = trainer_for(model, tokenizer, tmp_path)
    rows = random_rows(tokenizer, ROW_LENGTHS)
    ids, mask, keep = trl_layout(tokenizer, rows)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, compute_entropy=True)
    assert logps.shape == entropies.shape == (3, keep)
    with torch.no_grad():
        for b, (prompt, completion) in enumerate(rows):
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].double()
            log_q = logits.log_softmax(-1)
            for j, token in enumerate(completion):
                position = len(prompt) + j - 1
                assert logps[b, j].item() == pytest.approx(log_q[position, token].item(), abs=1e-4)
                entropy = -(log_q[position].exp() * log_q[position]).sum().item()
                assert entropies[b, j].item() == pytest.approx(entropy, abs=1e-3)


def test_plm_rollouts_draw_tokens_with_the_rounded_capacities_of_the_encoder_top_m(tmp_path, tokenizer):
    """The trainer's rollouts (exact acceptance) commit Voronoi sampling's tokens, which draw token v with probability
    n_v / N: the top-M of q renormalised and rounded to cells of 1/N. With N = 16 auxiliaries the rounding is coarse
    enough to tell apart from the unrounded top-M (and from q itself)."""
    model = build_model("plm", "tiny", tokenizer, num_auxiliaries=16, auxiliary_top_m=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # a peaked q (top token ~ 0.5 of the top-M), far from uniform cells
    trainer = trainer_for(model, tokenizer, tmp_path, max_completion_length=1)
    prompt = [17, 230, 41, 990, 7]
    draws = 4000
    completions, _ = trainer._generate_single_turn([prompt] * draws, None, {}, draws)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[:, -1]
    candidates, probs = top_candidates(logits, 8)
    capacities = largest_remainder_capacities(probs, 16)[0]
    rounded = dict(zip(candidates[0].tolist(), (capacities / 16).tolist()))
    unrounded = dict(zip(candidates[0].tolist(), (probs[0] / probs[0].sum()).tolist()))
    first = [c[0] for c in completions]
    empirical = {v: first.count(v) / draws for v in set(first)}

    def tv(p, q):
        return 0.5 * sum(abs(p.get(v, 0.0) - q.get(v, 0.0)) for v in set(p) | set(q))

    assert set(empirical) <= {v for v, p in rounded.items() if p > 0}, "only tokens with a cell are drawn"
    assert tv(empirical, rounded) < 0.03  # sampling noise at 4000 draws: ~0.01
    assert tv(rounded, unrounded) > 0.06 and tv(empirical, unrounded) > 0.05, "the rounding is visible"
    q = logits.softmax(-1)[0]
    assert q[candidates[0]].sum() < 0.9, "and the truncation: the top-M hold under 90% of q"


# ---------------------------------------------------------------------------------------------------------------------
# The latent families' surrogate
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", LATENT)
def test_surrogate_shares_its_draws_so_identical_weights_give_ratio_one_and_rows_score_as_alone(tmp_path, tokenizer,
                                                                                                family):
    model = tiny_model(family, tokenizer)
    trainer = trainer_for(model, tokenizer, tmp_path)
    reference = copy.deepcopy(model)
    rows = random_rows(tokenizer, ROW_LENGTHS, seed=1)
    ids, mask, keep = trl_layout(tokenizer, rows)
    with torch.no_grad():
        policy, entropies, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep,
                                                                          compute_entropy=True)
        ref, _, _ = trainer._get_per_token_logps_and_entropies(reference, ids, mask, keep)
    assert torch.equal(policy, ref), "same weights, same draws: log ratio exactly 0"
    assert torch.isnan(entropies).all()
    kl = torch.exp(ref - policy) - (ref - policy) - 1
    assert torch.equal(kl, torch.zeros_like(kl))
    # One value per row on every completion token; a row alone gives the same value.
    for b, row in enumerate(rows):
        assert torch.unique(policy[b]).numel() == 1
        alone_ids, alone_mask, alone_keep = trl_layout(tokenizer, [row])
        with torch.no_grad():
            alone, _, _ = trainer._get_per_token_logps_and_entropies(model, alone_ids, alone_mask, alone_keep)
        assert alone[0, 0].item() == pytest.approx(policy[b, 0].item(), rel=1e-5, abs=1e-6)
    # It is the mean over the M draw sets keyed by the rollout's ids, each an ordinary scorer call.
    right_ids, right_mask, completion, _ = right_aligned(ids, mask, keep)
    keys = [rollout_key(*r) for r in zip(right_ids.tolist(), right_mask.tolist(), completion.tolist())]
    with torch.no_grad():
        per_draw = []
        for m in range(trainer.num_score_draws):
            draw_keys = [f"0/{k}/{m}" for k in keys]  # nonce 0: no generation round set
            draws = trainer.scorer.draws(model, right_ids, right_mask, completion, draw_keys)
            per_draw.append(trainer.scorer.score(model, right_ids, right_mask, completion, draws).normalised())
    assert not torch.allclose(per_draw[0], per_draw[1]), "the draw sets differ"
    torch.testing.assert_close(policy[:, 0], torch.stack(per_draw).mean(0), rtol=1e-5, atol=1e-6)


def test_cola_surrogate_is_unbiased_and_its_variance_falls_as_one_over_m(tmp_path, tokenizer, monkeypatch):
    """With a stub velocity v̂ = 0, each position's flow-matching error is mean_c (ε − μ − σξ)², whose mean over the
    draws is mean_c (1 + μ_c² + σ²) for the VAE's posterior mean μ and std σ: a closed form for E[s]."""
    model = tiny_model("cola", tokenizer).eval()
    monkeypatch.setattr(model, "velocity", lambda latents, *args, **kwargs: torch.zeros_like(latents))
    trainer = trainer_for(model, tokenizer, tmp_path)
    prompt, completion = random_rows(tokenizer, [(6, 5)], seed=2)[0]
    ids, mask, keep = trl_layout(tokenizer, [(prompt, completion)])
    with torch.no_grad():
        vae = model.model.vae
        mu = vae.encoder(torch.tensor([prompt + completion]), torch.ones(1, 11, dtype=torch.long))[0, 6:].double()
        sigma = float(vae.encoder.posterior_std())
    closed_form = -(1 + mu.pow(2) + sigma ** 2).mean(-1).mean().item()

    def estimates(draws_per_response: int, replications: int) -> list[float]:
        trainer.num_score_draws = draws_per_response
        values = []
        for seed in range(replications):
            trainer.scorer = ColaResponseScorer(seed=1000 + seed)
            with torch.no_grad():
                values.append(trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)[0][0, 0].item())
        return values

    one, four = estimates(1, 160), estimates(4, 160)
    for values in (one, four):
        standard_error = statistics.stdev(values) / math.sqrt(len(values))
        assert abs(statistics.mean(values) - closed_form) < 4 * standard_error, (statistics.mean(values), closed_form)
    ratio = statistics.variance(four) / statistics.variance(one)
    assert 0.14 < ratio < 0.45, ratio  # 1/4 up to the sampling error of two variances of 160 draws


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_with_a_reference_and_logs_trls_metrics(tmp_path, tokenizer, family):
    model = tiny_model(family, tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = trainer_for(model, tokenizer, tmp_path, rewards=[low_token_reward, partial_credit_reward],
                          beta=0.04)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) for e in logs)
    for name in ("reward", "reward_std", "kl", "num_tokens", "completions/mean_length", "clip_ratio/region_mean",
                 "rewards/partial_credit_reward/mean"):
        assert name in logs[0], name
    assert logs[0]["kl"] == 0.0, "the first step's policy is the reference"
    assert (logs[0]["entropy"] is None or math.isnan(logs[0]["entropy"])) == (family in LATENT)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    if family == "cola":  # the surrogate reads the VAE's latents without gradient: GRPO trains the prior only
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n.startswith("model.vae."))


@pytest.mark.parametrize("family", LATENT)
def test_rows_without_completion_tokens_count_zero_and_keep_the_graph(tmp_path, tokenizer, family):
    """`mask_truncated_completions` zeroes a truncated row's completion mask: the surrogate scores such a row on a
    stand-in token and counts it 0, and a micro-batch of only such rows still has a gradient graph (backward and
    DDP need one); a GRPO step where every completion is truncated runs."""
    model = tiny_model(family, tokenizer)
    trainer = trainer_for(model, tokenizer, tmp_path, mask_truncated_completions=True, max_completion_length=2,
                          max_steps=1)
    rows = random_rows(tokenizer, ROW_LENGTHS, seed=3)
    ids, mask, keep = trl_layout(tokenizer, rows)
    truncated = mask.clone()
    truncated[1, -keep:] = 0
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, truncated, keep)
    full, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)
    assert logps[1].eq(0).all() and torch.allclose(logps[[0, 2]], full[[0, 2]], rtol=1e-5, atol=1e-6)
    truncated[:, -keep:] = 0
    none, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, truncated, keep)
    assert none.eq(0).all() and none.requires_grad
    none.sum().backward()
    trainer.train()  # every completion is cut at 2 tokens: all masked
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


def test_the_surrogate_draws_afresh_each_generation_round_and_shares_them_within_it(tmp_path, tokenizer):
    model = tiny_model("cola", tokenizer)
    trainer = trainer_for(model, tokenizer, tmp_path)
    ids, mask, keep = trl_layout(tokenizer, random_rows(tokenizer, ROW_LENGTHS, seed=4))
    with torch.no_grad():
        trainer._draw_nonces = torch.tensor([11, 11, 11])
        first, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)
        again, _, _ = trainer._get_per_token_logps_and_entropies(copy.deepcopy(model), ids, mask, keep)
        trainer._draw_nonces = torch.tensor([12, 12, 12])
        other, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)
    assert torch.equal(first, again) and not torch.allclose(first[:, 0], other[:, 0])
    # Each generation round gets its own nonce, carried with its rows to the loss.
    trainer._draw_nonces = None
    trainer._generate_single_turn([ids[0, -8:].tolist()] * 4, None, {}, 4)
    round_one = trainer._draw_nonces.clone()
    trainer._generate_single_turn([ids[0, -8:].tolist()] * 4, None, {}, 4)
    assert round_one.unique().numel() == 1 and not torch.equal(round_one, trainer._draw_nonces)


def test_generation_kwargs_may_add_options_but_not_change_what_the_trainer_fixes(tmp_path, tokenizer):
    plm = tiny_model("plm", tokenizer)
    with pytest.raises(ValueError, match="acceptance"):
        trainer_for(plm, tokenizer, tmp_path, generation_kwargs={"acceptance": "nucleus"})
    for name in ("max_new_tokens", "do_sample", "auxiliary_seeds"):
        with pytest.raises(ValueError, match=name):
            trainer_for(plm, tokenizer, tmp_path, generation_kwargs={name: 3})
    trainer = trainer_for(plm, tokenizer, tmp_path, generation_kwargs={"k_pred": 2})
    assert trainer.rollout_options == {"acceptance": "exact", "k_pred": 2}


def test_sync_ref_model_updates_the_frozen_reference_copy(tmp_path, tokenizer):
    """TRL's sync_ref_model (TR-DPO style mixing every `ref_model_sync_steps`) acts on the reference this trainer
    builds: after a synced step the reference has moved towards the policy; without it, it stays the start."""
    for sync in (False, True):
        model = tiny_model("plm", tokenizer)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = trainer_for(model, tokenizer, tmp_path, beta=0.04, sync_ref_model=sync, ref_model_sync_steps=1,
                              ref_model_mixup_alpha=0.5, max_steps=1)
        trainer.train()
        reference = dict(trainer.ref_model.named_parameters())
        changed = any(not torch.equal(reference[n], start[n]) for n in start)
        assert changed == sync


def test_the_optimizer_gives_colas_vae_its_learning_rate_ratio(tmp_path, tokenizer):
    model = tiny_model("cola", tokenizer)
    model.config.vae_learning_rate_ratio = 0.25
    trainer = trainer_for(model, tokenizer, tmp_path, learning_rate=1e-2)
    optimizer = trainer.create_optimizer()
    rate = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert rate[id(param)] == pytest.approx(1e-2 * (0.25 if name.startswith("model.vae.") else 1.0)), name


def test_rollouts_come_from_the_familys_generate_with_one_seed_per_row(tmp_path, tokenizer):
    model = tiny_model("cola", tokenizer)
    trainer = trainer_for(model, tokenizer, tmp_path)
    prompt_ids = [tokenizer(prompts(1)[0]["prompt"])["input_ids"]] * 4
    first, _ = trainer._generate_single_turn(prompt_ids, None, {}, 4)
    assert len({tuple(c) for c in first}) > 1, "the 4 copies of one prompt get different completions"
    trainer._last_rollout = (None, -1)
    again, _ = trainer._generate_single_turn(prompt_ids, None, {}, 4)
    assert again == first, "the seeds are a function of the step and row: a rerun repeats them"
    third, _ = trainer._generate_single_turn(prompt_ids, None, {}, 4)
    assert third != first, "a second rollout at the same step draws afresh"
    eos = tokenizer.eos_token_id
    assert all(len(c) <= 8 and (eos not in c or c.index(eos) == len(c) - 1) for c in first)


@pytest.mark.parametrize("family", ["plm", "cola"])
def test_conversational_prompts_render_through_the_chat_template_and_are_rewarded(tmp_path, tokenizer, family):
    """A `prompt` column of messages: TRL renders it with the packaged chat template (add_generation_prompt), so
    the rollouts see exactly the plain-text prompt of the task format, and the reward functions get the completions
    as assistant messages."""
    from hf_latentlm.training.tasks import format_prompt

    instruction = "Count from 11 to 20:"
    seen = {}

    def record(prompts, completions, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return low_token_reward(completions, completion_ids)

    model = tiny_model(family, tokenizer)
    args = grpo_config(str(tmp_path / "chat"), batch_size=4, num_generations=4, max_completion_length=6, max_steps=1,
                       save_strategy="no")
    rows = [{"prompt": [{"role": "user", "content": instruction}], "response": "11 12 13"}] * 4
    trainer = LatentGRPOTrainer(model=model, reward_funcs=[record, exact_match_reward], args=args,
                                train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    generated = {}
    original = trainer._generate_single_turn

    def spy(prompt_ids, *rest):
        generated["prompt_ids"] = prompt_ids
        return original(prompt_ids, *rest)

    trainer._generate_single_turn = spy
    trainer.train()
    expected = tokenizer(format_prompt(instruction), add_special_tokens=False)["input_ids"]
    assert [list(ids) for ids in generated["prompt_ids"]] == [expected] * 4
    assert seen["prompts"][0] == rows[0]["prompt"]
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in seen["completions"])


def test_grpo_raises_a_simple_reward(tmp_path, tokenizer):
    """A tiny PLM learns to write low token ids: the mean reward of the last steps beats the first steps'."""
    model = tiny_model("plm", tokenizer)
    trainer = trainer_for(model, tokenizer, tmp_path, rewards=[low_token_reward], max_steps=24,
                          learning_rate=3e-3, rows=8)
    trainer.train()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    assert statistics.mean(rewards[-4:]) > statistics.mean(rewards[:4]) + 0.2, rewards


def test_options_a_family_cannot_honour_are_refused_by_name(tmp_path, tokenizer):
    plm, cola = tiny_model("plm", tokenizer), tiny_model("cola", tokenizer)
    for option, value in (("temperature", 0.7), ("top_p", 0.9), ("repetition_penalty", 1.2), ("use_vllm", True),
                          ("cache_implementation", "static"), ("cast_lm_head_to_fp32", True)):
        with pytest.raises(ValueError, match=option):
            trainer_for(plm, tokenizer, tmp_path, **{option: value})
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        trainer_for(cola, tokenizer, tmp_path, top_entropy_quantile=0.2)
    with pytest.raises(ValueError, match="entropy_coef"):
        trainer_for(cola, tokenizer, tmp_path, entropy_coef=0.01)
    trainer_for(plm, tokenizer, tmp_path, top_entropy_quantile=0.2)  # PLM has token entropies
    with pytest.raises(ValueError, match="num_score_draws"):
        LatentGRPOTrainer(model=cola, reward_funcs=[low_token_reward], num_score_draws=0,
                          args=grpo_config(str(tmp_path / "x"), batch_size=4, num_generations=4),
                          train_dataset=Dataset.from_list(prompts(4)), processing_class=tokenizer)
    with pytest.raises(ValueError, match="tools"):
        LatentGRPOTrainer(model=cola, reward_funcs=[low_token_reward], tools=[len],
                          args=grpo_config(str(tmp_path / "x"), batch_size=4, num_generations=4),
                          train_dataset=Dataset.from_list(prompts(4)), processing_class=tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# CLI: a checkpoint that loads, and exact resume
# ---------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cola_folder(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("cola")
    tiny_model("cola", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def stop_after(step: int):
    """A `TrainerCallback` that ends training after optimizer step `step` (as a crash right after a checkpoint)."""
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= step
    return Stop()


def test_grpo_run_resumes_where_the_straight_run_ends(tmp_path, cola_folder):
    """`run_grpo` (the CLI's `grpo`) of 4 steps stopped after step 2, then resumed, ends on the weights of 4 straight
    steps: the rollout seeds are a function of the optimizer step, so the resumed run draws the same completions."""
    common = dict(task="count-tens", train_size=8, batch_size=4, num_generations=4, learning_rate=1e-3,
                  num_score_draws=1, save_every=2, reward_funcs=[low_token_reward], max_steps=4)
    run_grpo(cola_folder, tmp_path / "straight", **common)
    assert run_grpo(cola_folder, tmp_path / "resumed", callbacks=[stop_after(2)], **common)["steps"] == 2
    assert run_grpo(cola_folder, tmp_path / "resumed", resume=True, **common)["steps"] == 4
    straight, resumed = (load_file(tmp_path / f / "model.safetensors") for f in ("straight", "resumed"))
    start = load_file(cola_folder / "model.safetensors")
    assert any(not torch.equal(straight[n], start[n]) for n in start), "the run trained"
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6)
    record = json.loads((tmp_path / "straight" / "post_training.json").read_text())
    assert record["stage"] == "grpo" and record["task"] == "count-tens"


def test_cli_grpo_trains_and_writes_a_loadable_model(tmp_path, run_cli, cola_folder):
    code, out, err = run_cli("grpo", "--model", str(cola_folder), "--output-dir", str(tmp_path / "cli"),
                             "--task", "count-tens", "--train-size", "4", "--batch-size", "4", "--num-generations",
                             "4", "--max-steps", "1", "--num-score-draws", "1")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["stage"] == "grpo"
    model, _ = load_model_and_tokenizer(str(tmp_path / "cli"))
    assert type(model).__name__ == "ColaForCausalLM"


def test_a_grpo_dataset_without_reference_answers_is_refused_by_name(tmp_path, cola_folder):
    with pytest.raises(ValueError, match="'response' column"):
        run_grpo(cola_folder, tmp_path / "x", dataset=Dataset.from_list([{"prompt": "User: hi\n\nAssistant:"}]))


def test_cli_grpo_refuses_a_group_that_does_not_divide_the_batch(run_cli, cola_folder, tmp_path):
    code, _, err = run_cli("grpo", "--model", str(cola_folder), "--output-dir", str(tmp_path / "x"),
                           "--batch-size", "6", "--num-generations", "4")
    assert code == 2 and "--num-generations" in err and "Traceback" not in err


def test_two_process_ddp_lora_grpo_keeps_ranks_in_sync_with_the_adapter_disabled_reference(tmp_path, cola_folder):
    """torchrun, 2 CPU processes, LoRA on Cola with β > 0: both ranks end with the same adapter weights, which moved;
    the ranks drew different completions (the process index is in the rollout seeds); the first step's KL is 0
    (the reference is the adapter-disabled model, equal to the policy before any step)."""
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(DDP_WORKER),
           str(cola_folder), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    views = [json.loads((out / f"grpo-rank{r}.json").read_text()) for r in range(2)]
    assert all(v["world_size"] == 2 and len(v["losses"]) == 3 for v in views)
    assert views[0]["completions"] != views[1]["completions"]
    assert views[0]["kl"][0] == 0.0 and all(k >= 0 for k in views[0]["kl"])
    ranks = [load_file(out / f"grpo-rank{r}.safetensors") for r in range(2)]
    assert ranks[0] and all("lora_" in n for n in ranks[0])
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0]), "DDP kept the ranks in sync"
    assert any(ranks[0][n].abs().sum() > 0 for n in ranks[0] if "lora_B" in n), "the adapter trained"
