"""Post-training: SFT and DPO trainers on TRL, the response-score abstraction and PLM's DPO score.

What is checked, against independent computations where there is a number to compute:
- PLM's score s(x, u) = -(L_enc^r + L_dec^r) / N_terms equals a hand computation from raw encoder logits and one
  plain causal forward per decoder row over [clean prefix; auxiliaries of its block] (strides below, at and above K).
- The frozen draws (auxiliaries u, block phase) do not depend on the batch, are shared by both candidates (phase),
  stay the same in every epoch and are the ones the reference was scored with; the phase puts the first response
  target inside a decoder block when s > K.
- At initialisation δ = 0 and the loss is log 2; the reference never gets a gradient (explicit ref model; PEFT:
  adapter-disabled model); normalisation makes the score length-independent.
- SFT's loss covers response tokens only; AR DPO is TRL's own sigmoid_norm, whose completion mask holds the
  terminal end-of-text token.
- LoRA and 2-process DDP runs (torchrun) of SFT and DPO finish with finite losses and moved weights; the CLI's
  `sft` / `dpo` write checkpoints that load and generate.
"""

import contextlib
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from family_contract import build_tiny
from safetensors.torch import load_file

from hf_latentlm.families import build_model
from hf_latentlm.training.corpus import load_corpus_documents
from hf_latentlm.training.post_training import (
    REF_CHOSEN,
    REF_REJECTED,
    LatentDPOTrainer,
    LatentSFTTrainer,
    dpo_config,
    sft_config,
)
from hf_latentlm.training.post_training import scorer_for
from hf_latentlm.training.scorers import PLMResponseScorer, ResponseScore, ResponseScorer

WORKER = Path(__file__).with_name("ddp_post_training_worker.py")
EOS = "<|endoftext|>"


# ---------------------------------------------------------------------------------------------------------------------
# Data and helpers
# ---------------------------------------------------------------------------------------------------------------------

def verse_lines(count: int) -> list[str]:
    lines = [line.strip() for line in load_corpus_documents("validation")[0].splitlines()]
    return [line for line in lines if 25 <= len(line) <= 60][:count]


def prompt_for(line: str) -> str:
    return f"User: Repeat this line exactly:\n{line}\n\nAssistant:"


def toy_sft_rows(count: int) -> list[dict]:
    return [{"prompt": prompt_for(line), "completion": f" {line}{EOS}"} for line in verse_lines(count)]


def toy_preference_rows(count: int) -> list[dict]:
    """Pairs whose rejected answer is another line (a different length in general)."""
    lines = verse_lines(count + 1)
    return [{"prompt": prompt_for(a), "chosen": f" {a}{EOS}", "rejected": f" {b}{EOS}"}
            for a, b in zip(lines[:-1], lines[1:])]


def dpo_args(tmp_path, **overrides):
    values = dict(batch_size=2, max_steps=2, logging_steps=1, warmup_steps=0, learning_rate=1e-2, seed=0)
    values.update(overrides)
    return dpo_config(str(tmp_path / "dpo"), **values)


def dpo_trainer(tmp_path, tokenizer, model=None, pairs: int = 4, **kwargs):
    model = model if model is not None else build_tiny("plm", tokenizer)
    args = kwargs.pop("args", None) or dpo_args(tmp_path)
    return LatentDPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(toy_preference_rows(pairs)),
                            processing_class=tokenizer, **kwargs)


def greedy_response(model, ids: list[int], length: int, eos: int) -> list[int]:
    """`length` tokens, each the encoder's most likely non-EOS next token (so every target has a Voronoi cell)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(length):
            logits = model(input_ids=torch.tensor([out])).logits[0, -1]
            logits[eos] = -float("inf")
            out.append(int(logits.argmax()))
    return out[len(ids):]


def right_padded(rows: list[list[int]], pad: int):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row)
        mask[b, :len(row)] = 1
    return ids, mask


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def recorded_labels(model):
    """The `labels` (cloned) of every call of `model.forward` made inside the block, in a list."""
    recorded, forward = [], model.forward

    def spy(*args, **kwargs):
        recorded.append(kwargs["labels"].clone())
        return forward(*args, **kwargs)

    model.forward = spy
    try:
        yield recorded
    finally:
        model.forward = forward


# ---------------------------------------------------------------------------------------------------------------------
# (1) PLM's score against a hand computation
# ---------------------------------------------------------------------------------------------------------------------

def hand_plm_score(model, row: torch.Tensor, first: int, phase: int, grid: torch.Tensor) -> tuple[float, int]:
    """-(Σ encoder NLL over the response incl. the terminal EOS + Σ decoder NLL over the response body) / #terms for
    one unpadded row, written out: the encoder term from the logits of a plain forward; each decoder row j of block z
    (start i_z = 1 + z·s − phase) as ONE causal forward over [x_<max(i_z,1) as tokens; u_max(i_z,1)..u_j as
    auxiliaries], positions 0..j (a decoder row sits at the rotary position of the token it predicts), its last
    hidden state through the LM head scoring x_j."""
    cfg = model.config
    K, s, T = cfg.block_size, cfg.block_stride, row.numel()
    with torch.no_grad():
        logits = model(input_ids=row[None]).logits[0]
        total, terms = 0.0, 0
        for t in range(first, T):  # encoder: response targets, terminal EOS included
            total -= torch.log_softmax(logits[t - 1].double(), -1)[row[t]].item()
            terms += 1
        for z in range(T // s + 3):
            start = 1 + z * s - phase
            for k in range(K):
                j = start + k
                if j < 1 or j >= T or j < first or j == T - 1:  # outside, prompt target, or the terminal EOS
                    continue
                begin = max(start, 1)
                aux = torch.tensor([int(grid[z * K + (p - start)]) for p in range(begin, j + 1)])
                embeds = torch.cat([model.model.embed_tokens(row[:begin]), model.model.embed_auxiliaries(aux)])
                hidden = model.model(inputs_embeds=embeds[None]).last_hidden_state[0, -1]
                total -= torch.log_softmax(model.lm_head(hidden).double(), -1)[row[j]].item()
                terms += 1
    return -total / terms, terms


@pytest.mark.parametrize("stride", [2, 4, 6])  # s < K (overlapping blocks), s = K, s > K (gaps); tiny K = 4
def test_plm_score_equals_a_hand_computation(tokenizer, stride):
    torch.manual_seed(0)
    model = build_model("plm", "tiny", tokenizer, block_stride=stride).eval()
    eos = tokenizer.eos_token_id
    prompt = tokenizer(prompt_for(verse_lines(1)[0]))["input_ids"]
    rows = [prompt + greedy_response(model, prompt, 11, eos) + [eos], prompt + greedy_response(model, prompt, 6, eos)
            + [eos]]
    ids, mask = right_padded(rows, tokenizer.pad_token_id)
    completion = mask.clone()
    completion[:, :len(prompt)] = 0
    scorer = PLMResponseScorer()
    draws = scorer.draws(model, ids, mask, completion, ["pair"] * 2)
    assert (draws["aux"] >= 0).any(), "some targets own auxiliaries (a non-trivial u)"
    score = scorer.score(model, ids, mask, completion, draws)
    for b, row in enumerate(rows):
        expected, terms = hand_plm_score(model, torch.tensor(row), len(prompt), int(draws["phase"][b]), draws["aux"][b])
        assert score.num_terms[b].item() == terms
        assert score.normalised()[b].item() == pytest.approx(expected, abs=2e-5)
        # ≈ L^r·(1 + K/s): every response target once for the encoder, K/s times on average for the decoder.
        response = len(row) - len(prompt)
        assert abs(terms - response * (1 + 4 / stride)) <= 4 / stride * 4 + 2


# ---------------------------------------------------------------------------------------------------------------------
# (2) frozen draws: batch-independent, shared phase, the same in every epoch and for policy and reference
# ---------------------------------------------------------------------------------------------------------------------

def test_phase_puts_the_first_response_target_inside_a_decoder_block(tokenizer):
    for K, s in ((4, 6), (4, 9), (8, 16), (4, 4), (4, 2)):
        config = build_model("plm", "tiny", tokenizer, block_size=K, block_stride=s, k_pred=min(4, K)).config
        for first in range(1, 40, 3):
            phases = set()
            for key in range(40):
                phase = PLMResponseScorer.pair_phase(config, f"key{key}", first)
                phases.add(phase)
                assert 0 <= phase < s
                assert (first - 1 + phase) % s < K, (K, s, first, phase)  # inside block floor((first-1+phase)/s)
            # Spread over every admissible phase: all s when s <= K, the K that place the target in a block if s > K.
            assert len(phases) == min(s, K)


def test_draws_do_not_depend_on_the_batch(tokenizer):
    model = build_tiny("plm", tokenizer).eval()
    scorer = PLMResponseScorer()
    eos = tokenizer.eos_token_id
    prompt = tokenizer(prompt_for(verse_lines(1)[0]))["input_ids"]
    a = prompt + greedy_response(model, prompt, 9, eos) + [eos]
    b = prompt + greedy_response(model, prompt, 14, eos) + [eos]

    def draws_of(rows, keys):
        ids, mask = right_padded(rows, tokenizer.pad_token_id)
        completion = mask.clone()
        completion[:, :len(prompt)] = 0
        return scorer.draws(model, ids, mask, completion, keys)

    alone = draws_of([a], ["k"])
    first = draws_of([a, b], ["k", "other"])
    second = draws_of([b, a], ["other", "k"])
    width = alone["aux"].shape[1]
    assert torch.equal(first["aux"][0, :width], alone["aux"][0]) and (first["aux"][0, width:] == -1).all()
    assert torch.equal(second["aux"][1, :width], alone["aux"][0])
    assert first["phase"][0] == second["phase"][1] == alone["phase"][0]
    # Another pair key, another draw (the seed mixes in the key).
    assert not torch.equal(draws_of([a], ["k2"])["aux"], alone["aux"])


def test_draws_are_the_same_in_every_epoch_and_for_policy_and_reference(tmp_path, tokenizer):
    model = build_tiny("plm", tokenizer)
    reference = copy.deepcopy(model).eval()
    args = dpo_args(tmp_path, max_steps=None, num_train_epochs=2, learning_rate=1e-2)
    trainer = dpo_trainer(tmp_path, tokenizer, model=model, pairs=3, args=args)
    data = trainer.train_dataset
    assert data["chosen_draw_phase"] == data["rejected_draw_phase"], "both candidates share the pair's phase"

    seen = {}  # (row tokens) -> list of (aux, phase) the policy was scored with
    score = trainer.scorer.score

    def recording_score(model, input_ids, attention_mask, completion_mask, draws):
        for b in range(input_ids.shape[0]):
            tokens = tuple(input_ids[b, attention_mask[b].bool()].tolist())
            seen.setdefault(tokens, []).append((draws["aux"][b].tolist(), int(draws["phase"][b])))
        return score(model, input_ids, attention_mask, completion_mask, draws)

    trainer.scorer.score = recording_score
    trainer.train()
    assert trainer.state.global_step == 4  # 3 pairs, batch 2: 2 steps per epoch
    stored = {}
    for example in data:
        for candidate in ("chosen", "rejected"):
            tokens = tuple(example["prompt_ids"] + example[f"{candidate}_ids"])
            stored[tokens] = (example[f"{candidate}_draw_aux"], example[f"{candidate}_draw_phase"])
    assert set(seen) == set(stored) and all(len(v) == 2 for v in seen.values()), "every row once per epoch"
    for tokens, uses in seen.items():
        aux, phase = stored[tokens]
        for used_aux, used_phase in uses:  # padded to the batch: the stored grid, then -1
            assert used_phase == phase and used_aux[:len(aux)] == aux and set(used_aux[len(aux):]) <= {-1}

    # The stored reference scores are the initial model's scores under exactly these draws.
    collate = trainer.data_collator
    batch = collate([data[i] for i in range(len(data))])
    draws = {"aux": batch["draw_aux"], "phase": batch["draw_phase"]}
    again = PLMResponseScorer().score(reference, batch["input_ids"], batch["attention_mask"],
                                      batch["completion_mask"], draws).normalised()
    torch.testing.assert_close(again, torch.cat([batch[REF_CHOSEN], batch[REF_REJECTED]]), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# (3) initialisation, (4) the reference, (5) length normalisation
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_type", ["sigmoid_norm", "sigmoid"])
def test_at_initialisation_delta_is_zero_and_the_loss_is_log_2(tmp_path, tokenizer, loss_type):
    """Also: `sigmoid_norm` (the default) scores −loss_sum / num_terms, `sigmoid` (the unnormalised ablation)
    −loss_sum, for policy and reference alike."""
    trainer = dpo_trainer(tmp_path, tokenizer, args=dpo_args(tmp_path, loss_type=[loss_type]))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    scores = trainer.policy_scores(trainer.model, batch)
    torch.testing.assert_close(scores, torch.cat([batch[REF_CHOSEN], batch[REF_REJECTED]]), atol=1e-5, rtol=0)
    draws = {k.removeprefix("draw_"): v for k, v in batch.items() if k.startswith("draw_")}
    raw = trainer.scorer.score(trainer.model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                               draws)
    expected = -raw.loss_sum / raw.num_terms if loss_type == "sigmoid_norm" else -raw.loss_sum
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    assert (raw.num_terms > 1).all()  # so the two loss types really differ
    assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(math.log(2), abs=1e-5)
    logged = trainer._metrics["train"]
    assert logged["rewards/chosen"][-1] == pytest.approx(0, abs=1e-4)
    assert logged["rewards/margins"][-1] == pytest.approx(0, abs=1e-4)


def test_dpo_loss_at_nonzero_delta_is_the_hand_computed_sigmoid_loss_and_gradient():
    """`compute_loss` on known scores with policy ≠ reference (δ ≠ 0, so β and the reference matter): the loss is
    mean −log σ(β·((s⁺ − s⁺_ref) − (s⁻ − s⁻_ref))) written out with math, its gradient with respect to each score
    ∓β·σ(−β·m)/B, and the logged rewards are β·δ."""
    from collections import defaultdict
    from types import MethodType, SimpleNamespace

    beta = 2.5
    chosen, rejected = [-1.0, -2.0, -0.5], [-1.5, -1.0, -3.0]
    ref_chosen, ref_rejected = [-1.25, -1.5, -1.0], [-1.0, -1.75, -2.0]
    scores = torch.tensor(chosen + rejected, dtype=torch.float64, requires_grad=True)
    fake = SimpleNamespace(model=SimpleNamespace(training=True), beta=beta,
                           policy_score=lambda model, inputs: ResponseScore(-scores, torch.ones(6)),
                           sequence_score=lambda score: -score.loss_sum,
                           accelerator=SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x),
                           _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    fake.log_score_metrics = MethodType(LatentDPOTrainer.log_score_metrics, fake)
    inputs = {REF_CHOSEN: torch.tensor(ref_chosen), REF_REJECTED: torch.tensor(ref_rejected),
              "attention_mask": torch.ones(6, 5, dtype=torch.long)}
    loss = LatentDPOTrainer.compute_loss(fake, None, inputs)
    margins = [(c - rc) - (r - rr) for c, rc, r, rr in zip(chosen, ref_chosen, rejected, ref_rejected)]
    assert margins == [0.75, -1.25, 1.5]
    hand = sum(math.log1p(math.exp(-beta * m)) for m in margins) / 3
    assert loss.item() == pytest.approx(hand, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, scores)
    weight = [beta / (1 + math.exp(beta * m)) / 3 for m in margins]  # β·σ(−β·m)/B
    torch.testing.assert_close(grad, torch.tensor([-g for g in weight] + weight, dtype=torch.float64))
    logged = fake._metrics["train"]
    assert logged["rewards/chosen"][-1] == pytest.approx(beta * sum(c - rc for c, rc in zip(chosen, ref_chosen)) / 3)
    assert logged["rewards/rejected"][-1] == pytest.approx(
        beta * sum(r - rr for r, rr in zip(rejected, ref_rejected)) / 3)
    assert logged["rewards/margins"][-1] == pytest.approx(beta * sum(margins) / 3)
    assert logged["rewards/accuracies"][-1] == pytest.approx(2 / 3)
    assert logged["logps/chosen"][-1] == pytest.approx(sum(chosen) / 3)  # the summed score (here the scores)
    assert logged["logps/rejected"][-1] == pytest.approx(sum(rejected) / 3)
    assert logged["num_tokens"] == [30] and "entropy" not in logged  # no token statistics in this score


def test_reference_scores_and_draws_come_from_the_ref_model_and_the_loss_uses_them(tmp_path, tokenizer):
    """Policy ≠ reference (the policy's weights perturbed), β = 3: the stored draws are the reference's own
    (`scorer.draws(ref_model)`), the stored reference scores are the reference's scores under them (not the
    policy's), and the loss is −log σ(3·(δ⁺ − δ⁻)) of the policy's scores, computed here from the scorer alone."""
    policy = build_tiny("plm", tokenizer)
    reference = copy.deepcopy(policy).eval()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for param in policy.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    beta = 3.0
    trainer = dpo_trainer(tmp_path, tokenizer, model=policy, ref_model=reference, pairs=2,
                          args=dpo_args(tmp_path, beta=beta))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    scorer = PLMResponseScorer()
    keys = list(batch["pair_key"]) * 2
    stored = {"aux": batch["draw_aux"], "phase": batch["draw_phase"]}
    for model, same in ((reference, True), (policy, False)):  # the policy's cells give other auxiliaries
        again = scorer.draws(model, ids, mask, completion, keys)
        width = again["aux"].shape[1]
        assert torch.equal(stored["aux"][:, :width], again["aux"]) == same
    assert torch.equal(stored["phase"], again["phase"])
    policy.eval()
    with torch.no_grad():
        ref_scores = scorer.score(reference, ids, mask, completion, stored).normalised()
        policy_scores = scorer.score(policy, ids, mask, completion, stored).normalised()
        stored_ref = torch.cat([batch[REF_CHOSEN], batch[REF_REJECTED]])
        torch.testing.assert_close(stored_ref, ref_scores.float(), atol=1e-5, rtol=0)
        assert (policy_scores - ref_scores).abs().min() > 1e-3  # δ ≠ 0 on every row
        loss = trainer.compute_loss(policy, batch).item()
    delta = (policy_scores - ref_scores).double()
    margins = delta[:2] - delta[2:]
    assert loss == pytest.approx(torch.nn.functional.softplus(-beta * margins).mean().item(), rel=1e-4)


def test_post_training_optimisation_is_the_papers(tmp_path):
    """App. 16: Adam (0.9, 0.95), eps 1e-8, no weight decay, clipping at 1, linear schedule; warmup 3% of SFT and
    10% of DPO; DPO's γ = 5 with the length-normalised loss and a precomputed (frozen) reference."""
    sft, dpo = sft_config(str(tmp_path / "s")), dpo_config(str(tmp_path / "d"))
    for args in (sft, dpo):
        assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon) == (0.9, 0.95, 1e-8)
        assert args.weight_decay == 0.0 and args.max_grad_norm == 1.0
        assert getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type) == "linear"
    assert sft.warmup_steps == pytest.approx(0.03) and dpo.warmup_steps == pytest.approx(0.10)
    assert dpo.beta == 5.0 and list(dpo.loss_type) == ["sigmoid_norm"] and dpo.precompute_ref_log_probs


def test_the_reference_never_receives_gradients(tmp_path, tokenizer):
    model = build_tiny("plm", tokenizer)
    ref_model = copy.deepcopy(model)
    before = snapshot(ref_model)
    eval_pairs = Dataset.from_list(toy_preference_rows(6)[4:])
    trainer = dpo_trainer(tmp_path, tokenizer, model=model, ref_model=ref_model, eval_dataset=eval_pairs)
    assert REF_CHOSEN in trainer.eval_dataset.column_names  # the eval set is scored by the reference at init too
    policy_before = snapshot(model)
    trainer.train()
    assert math.isfinite(trainer.evaluate()["eval_loss"])
    assert all(p.grad is None for p in ref_model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in ref_model.named_parameters())
    assert any(not torch.equal(p, policy_before[n]) for n, p in model.named_parameters())
    assert all(isinstance(x, float) for x in trainer.train_dataset[REF_CHOSEN])  # stored numbers, no graph


def test_lora_dpo_reference_is_the_adapter_disabled_model(tmp_path, tokenizer):
    from peft import LoraConfig

    from hf_latentlm.families import get_family

    model = build_tiny("plm", tokenizer)
    base = snapshot(model)
    trainer = dpo_trainer(tmp_path, tokenizer, model=model,
                          peft_config=LoraConfig(r=4, target_modules=get_family("plm").lora_target_modules,
                                                 task_type="CAUSAL_LM"))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    peft_model = trainer.model
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert any(p.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n), "the adapters trained"
    for name, param in peft_model.get_base_model().named_parameters():  # the base (= the reference) never moved
        if "lora_" not in name:
            assert torch.equal(param, base[name.replace(".base_layer", "")]), name
            assert param.grad is None
    # The stored reference scores are those of the adapter-disabled model; the policy's now differ.
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    reference = torch.cat([batch[REF_CHOSEN], batch[REF_REJECTED]])
    with peft_model.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(trainer.policy_scores(peft_model, batch), reference, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert (trainer.policy_scores(peft_model, batch) - reference).abs().max() > 1e-4


def test_length_normalisation(tokenizer):
    one = ResponseScore(loss_sum=torch.tensor([2.5 * 7, 1.0 * 3]), num_terms=torch.tensor([7, 3]))
    twice = ResponseScore(loss_sum=torch.tensor([2.5 * 14, 1.0 * 6]), num_terms=torch.tensor([14, 6]))
    torch.testing.assert_close(one.normalised(), torch.tensor([-2.5, -1.0]))
    torch.testing.assert_close(twice.normalised(), one.normalised())
    assert ResponseScore(torch.zeros(1), torch.zeros(1)).normalised().item() == 0  # no term: 0, not NaN

    # PLM: with a zero LM head every term (encoder or decoder) costs log V, so a response and the same response
    # twice over score the same, although the second has about twice as many terms.
    model = build_tiny("plm", tokenizer).eval()
    eos = tokenizer.eos_token_id
    prompt = tokenizer(prompt_for(verse_lines(1)[0]))["input_ids"]
    body = greedy_response(model, prompt, 8, eos)
    ids, mask = right_padded([prompt + body + [eos], prompt + body + body + [eos]], tokenizer.pad_token_id)
    completion = mask.clone()
    completion[:, :len(prompt)] = 0
    scorer = PLMResponseScorer()
    draws = scorer.draws(model, ids, mask, completion, ["a", "b"])
    with torch.no_grad():
        model.lm_head.weight.zero_()
    score = scorer.score(model, ids, mask, completion, draws)
    assert score.num_terms[1] >= 1.8 * score.num_terms[0]
    torch.testing.assert_close(score.normalised(), torch.full((2,), -math.log(model.config.vocab_size)))


# ---------------------------------------------------------------------------------------------------------------------
# (7) SFT: the prompt is context only
# ---------------------------------------------------------------------------------------------------------------------

def test_sft_labels_mask_padding_and_everything_outside_the_completion():
    """`response_labels` by hand on a batch whose labels still hold ids at the padding and the prompt: −100 where
    attention_mask is 0 and where completion_mask is 0, the ids elsewhere; without a completion mask only the
    padding goes, and without labels the input ids are the labels."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    completion = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    labels = ids.clone()
    out = LatentSFTTrainer.response_labels({"input_ids": ids, "attention_mask": mask, "completion_mask": completion,
                                            "labels": labels})
    assert out.tolist() == [[-100, -100, 7, 8, 9, -100], [-100, 6, 7, -100, -100, -100]]
    assert torch.equal(labels, ids), "the batch's own labels are not modified"
    padding_only = LatentSFTTrainer.response_labels({"input_ids": ids, "attention_mask": mask})
    assert padding_only.tolist() == [[5, 6, 7, 8, 9, -100], [5, 6, 7, -100, -100, -100]]


def test_sft_scores_response_tokens_only(tmp_path, tokenizer):
    model = build_tiny("plm", tokenizer)
    rows = toy_sft_rows(2)
    args = sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=2, logging_steps=1, learning_rate=1e-3)
    trainer = LatentSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    prompt_lengths = [len(tokenizer(r["prompt"])["input_ids"]) for r in rows]
    for b, length in enumerate(prompt_lengths):
        real = int(batch["attention_mask"][b].sum())
        assert (batch["labels"][b, :length] == -100).all()
        assert torch.equal(batch["labels"][b, length:real], batch["input_ids"][b, length:real])
        assert batch["labels"][b, real - 1] == tokenizer.eos_token_id, "the terminal end-of-text is a target"

    with recorded_labels(model) as recorded:
        losses = [trainer.compute_loss(model, batch).item()]
        changed = {k: v.clone() for k, v in batch.items()}
        changed["input_ids"][:, 3] = (changed["input_ids"][:, 3] + 1) % tokenizer.vocab_size  # a prompt token
        losses.append(trainer.compute_loss(model, changed).item())
    assert all(math.isfinite(x) for x in losses)
    assert torch.equal(recorded[0] != -100, recorded[1] != -100), "the same terms are scored"
    assert torch.equal(recorded[0], recorded[1])
    assert not (recorded[0][:, :min(prompt_lengths)] != -100).any()

    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all(math.isfinite(e["loss"]) for e in logged)
    assert {"encoder_nll", "decoder_nll", "alignment_loss"} <= set(logged[0]), "the family's loss parts are logged"


# ---------------------------------------------------------------------------------------------------------------------
# (8) AR: TRL's own DPOTrainer with sigmoid_norm
# ---------------------------------------------------------------------------------------------------------------------

def test_ar_dpo_is_stock_sigmoid_norm_and_scores_the_terminal_eos(tmp_path, tokenizer):
    from trl import DPOTrainer

    model = build_tiny("ar", tokenizer)
    args = dpo_args(tmp_path)
    assert args.loss_type == ["sigmoid_norm"] and args.beta == 5.0 and args.precompute_ref_log_probs
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(toy_preference_rows(4)),
                         processing_class=tokenizer)
    example = trainer.train_dataset[0]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    eos = tokenizer.eos_token_id
    for b in range(4):
        real = int(batch["attention_mask"][b].sum())
        positions = batch["completion_mask"][b].nonzero().flatten()
        assert positions[-1] == real - 1 and batch["input_ids"][b, real - 1] == eos
    assert example["chosen_ids"][-1] == eos and example["chosen_ids"].count(eos) == 1
    assert batch["completion_mask"][0].sum() == len(example["chosen_ids"])  # the normaliser counts the EOS term
    # ... and the EOS term is in the summed log-probabilities TRL normalises.
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        out = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                            fused_lm_head=True)
    real = int(batch["attention_mask"][0].sum())
    assert out.log_probs[0, real - 2] < 0, "log p(EOS | response) is scored"
    assert trainer.compute_loss(trainer.model, {k: v for k, v in batch.items()}).item() == pytest.approx(
        math.log(2), abs=1e-5)
    trainer.train()
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


# ---------------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------------

def test_bad_inputs_are_refused_clearly(tmp_path, tokenizer, monkeypatch):
    from hf_latentlm import families

    model = build_tiny("plm", tokenizer)
    assert isinstance(scorer_for(model), ResponseScorer)
    with pytest.raises(ValueError, match="sigmoid_norm"):
        scorer_for(build_tiny("ar", tokenizer))
    # A family with neither a registered scorer nor a token likelihood is named, with the registry field to set.
    monkeypatch.setitem(families.FAMILIES, "calm", dataclasses.replace(families.FAMILIES["calm"],
                                                                       response_scorer=None))
    calm = build_tiny("calm", tokenizer)
    with pytest.raises(ValueError, match="calm family.*response_scorer"):
        scorer_for(calm)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="not a preference dataset"):
        LatentDPOTrainer(model=model, args=dpo_args(tmp_path), processing_class=tokenizer,
                         train_dataset=Dataset.from_list(toy_sft_rows(2)))
    with pytest.raises(ValueError, match="no 'completion'"):
        LatentSFTTrainer(model=model, args=sft_config(str(tmp_path / "s")), processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"prompt": ["a"], "answer": ["b"]}))
    ids = torch.tensor([[0, 5, 6, 7], [5, 6, 7, 8]])
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        PLMResponseScorer().draws(model, ids, left, left, ["a", "b"])
    with pytest.raises(ValueError, match="no response token"):
        PLMResponseScorer().draws(model, ids, torch.ones_like(ids), torch.zeros_like(ids), ["a", "b"])


def test_policy_rejections_replace_exactly_the_wrong_answers_with_the_models_own(tokenizer):
    """Rows the model answers wrong get its sampled answer as `rejected` (kind "sampled"); rows it answers right
    keep theirs. The right answers are made so by taking the model's own samples (same seed, batch and limit, from
    `generate_answers` called directly) as the chosen answers of rows 0 and 3."""
    from hf_latentlm.eval.task import generate_answers
    from hf_latentlm.recipes import SAMPLED_REJECTION, with_policy_rejections

    model, limit = build_tiny("ar", tokenizer), 6
    rows = [dict(row, rejected_kind="truncated") for row in toy_preference_rows(5)]
    samples, _ = generate_answers(model, tokenizer, [r["prompt"] for r in rows], limit, seed=0)
    texts = [tokenizer.decode(a) + (EOS if len(a) < limit else "") for a in samples]
    for i in (0, 3):
        rows[i]["chosen"] = texts[i]
    out = with_policy_rejections(Dataset.from_list(rows), model, tokenizer, batch_size=8, seed=0,
                                 max_new_tokens=limit)
    assert out["prompt"] == [r["prompt"] for r in rows] and out["chosen"] == [r["chosen"] for r in rows]
    for i, row in enumerate(rows):
        if i in (0, 3):
            assert (out[i]["rejected"], out[i]["rejected_kind"]) == (row["rejected"], "truncated")
        else:
            assert (out[i]["rejected"], out[i]["rejected_kind"]) == (texts[i], SAMPLED_REJECTION)
            assert out[i]["rejected"] != row["chosen"]
    with pytest.raises(ValueError, match="no preference pairs"):
        with_policy_rejections(Dataset.from_list(rows).select([]), model, tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# (6) CLI runs (LoRA SFT, full DPO) and 2-process DDP runs (full SFT, LoRA DPO)
# ---------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plm_folder(tmp_path_factory, tokenizer):
    from hf_latentlm.training.checkpoint import save_tokenizer

    folder = tmp_path_factory.mktemp("plm") / "model"
    build_tiny("plm", tokenizer).save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


def weights(folder) -> dict:
    return load_file(Path(folder) / "model.safetensors")


def moved(before: dict, after: dict) -> set:
    assert set(before) == set(after)
    return {n for n in before if not torch.equal(before[n], after[n])}


def test_cli_sft_with_lora_then_dpo_write_loadable_checkpoints(tmp_path, run_cli, plm_folder):
    pytest.importorskip("hf_latentlm.training.tasks")
    from hf_latentlm.loading import load_model_and_tokenizer

    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    common = ["--max-steps", "2", "--batch-size", "2", "--train-size", "4", "--learning-rate", "1e-2"]
    code, out, err = run_cli("sft", "--model", str(plm_folder), "--output-dir", str(sft), "--lora", *common)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stage"] == "sft" and summary["family"] == "plm" and summary["steps"] == 2 and summary["finite"]
    code, out, err = run_cli("dpo", "--model", str(sft), "--output-dir", str(dpo), "--policy-rejections", *common)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["finite"]
    record = json.loads((dpo / "post_training.json").read_text())
    assert record["policy_rejections"] is True and record["sampled_rejections"] == 4  # an untrained model errs
    # LoRA merged: only the adapted projections moved in SFT; full DPO moved weights too.
    assert moved(weights(plm_folder), weights(sft)) and all("_proj" in n for n in moved(weights(plm_folder),
                                                                                        weights(sft)))
    assert moved(weights(sft), weights(dpo))
    model, _ = load_model_and_tokenizer(str(dpo))
    assert type(model).__name__ == "PLMForCausalLM" and not any("lora" in n for n, _ in model.named_parameters())
    code, out, err = run_cli("generate", "--model", str(dpo), "--prompt", "User: hi", "--max-new-tokens", "4")
    assert code == 0, err

    code, _, err = run_cli("dpo", "--model", str(sft), "--output-dir", str(tmp_path / "x"), "--max-steps", "0")
    assert code == 2 and "--max-steps must be at least 1" in err


def test_two_process_ddp_sft_then_lora_dpo(tmp_path, plm_folder):
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"sft": toy_sft_rows(8), "dpo": toy_preference_rows(8)}))
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           str(plm_folder), str(out), str(data)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for stage in ("sft", "dpo"):
        views = [json.loads((out / f"{stage}-rank{r}.json").read_text()) for r in range(2)]
        assert all(v["world_size"] == 2 for v in views)
        for view in views:
            assert len(view["losses"]) == 3 and all(math.isfinite(x) for x in view["losses"])
        ranks = [load_file(out / f"{stage}-rank{r}.safetensors") for r in range(2)]
        assert ranks[0] and all(torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0]), "DDP kept ranks in sync"
    # DPO: each rank drew half of the pairs; after the exchange both hold all of them, identical.
    dpo_views = [json.loads((out / f"dpo-rank{r}.json").read_text()) for r in range(2)]
    for name in ("pair_key", REF_CHOSEN, REF_REJECTED, "chosen_draw_aux", "chosen_draw_phase"):
        assert dpo_views[0][name] == dpo_views[1][name] and len(dpo_views[0][name]) == 8
    assert dpo_views[0]["chosen_draw_phase"] == dpo_views[0]["rejected_draw_phase"]
    # Weights moved in both stages (SFT: full fine-tuning; DPO: LoRA, merged into the saved checkpoint).
    assert moved(weights(plm_folder), weights(out / "sft"))
    assert moved(weights(out / "sft"), weights(out / "dpo"))
    lora = load_file(out / "dpo-rank0.safetensors")
    assert lora and all("lora_" in n for n in lora)


@pytest.mark.parametrize("family", ["calm", "cola", "aurora"])
def test_latent_families_train_with_the_same_sft_and_dpo_trainers(tmp_path, tokenizer, tiny_rows, family):
    """The other families plug their scorer (`scorers.py`) into the same DPO trainer. Their seeded draws depend on
    the pair key alone, so they are not stored but made again at every step; only what the reference model made is
    stored (Cola's latents: `*_draw_latents` columns). δ = 0 at initialisation shows the policy's redraws are the ones
    the reference was scored with. A step trains; SFT trains their own loss."""
    model = build_tiny(family, tokenizer)
    if hasattr(model, "prepare_training"):  # AURORA's latent statistics, as the training loop sets them
        model.prepare_training(tiny_rows[8:24, :32])
    trainer = dpo_trainer(tmp_path, tokenizer, model=model, pairs=2, args=dpo_args(tmp_path, max_steps=1))
    assert type(trainer.scorer).__name__ == type(scorer_for(model)).__name__ != "PLMResponseScorer"
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    stored = ["latents"] if family == "cola" else []
    assert trainer._draw_keys == stored
    assert [c for c in trainer.train_dataset.column_names if "_draw_" in c] == [f"{c}_draw_{k}" for k in stored
                                                                              for c in ("chosen", "rejected")]
    assert [k for k in batch if k.startswith("draw_")] == [f"draw_{k}" for k in stored]
    assert len(batch["pair_key"]) == 2
    assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(math.log(2), abs=1e-4)
    before = snapshot(model)
    trainer.train()
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)

    args = sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=1, logging_steps=1, learning_rate=1e-3)
    sft = LatentSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(toy_sft_rows(2)),
                           processing_class=tokenizer)
    sft.train()
    assert all(math.isfinite(e["loss"]) for e in sft.state.log_history if "loss" in e)


def test_latent_dpo_refuses_a_loss_type_it_does_not_compute(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="loss_type"):
        dpo_trainer(tmp_path, tokenizer, args=dpo_args(tmp_path, loss_type=["hinge"]))


# ---------------------------------------------------------------------------------------------------------------------
# (9) CALM SFT: chunk-aligned as generate() reads the prompt, every response token and the terminal EOS trained
# ---------------------------------------------------------------------------------------------------------------------

CALM_PROMPT_LENGTHS = (5, 6, 7, 8)  # ≡ 1, 2, 3, 0 (mod K = 4)
CALM_RESPONSE_LENGTHS = (6, 3, 4, 5)  # R + 1 (terminal EOS) ≡ 3, 0, 1, 2 (mod 4)


def calm_sft_trainer(tmp_path, tokenizer):
    model = build_tiny("calm", tokenizer).eval()
    assert model.config.chunk_size == 4
    args = sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=1, logging_steps=1, learning_rate=1e-3)
    trainer = LatentSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(toy_sft_rows(2)),
                               processing_class=tokenizer)
    return model, trainer


def calm_rows(tokenizer, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) id lists, neither holding EOS or pad; the terminal EOS is added by `trl_batch`."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(2, tokenizer.vocab_size, (n,), generator=g).tolist()

    assert {tokenizer.eos_token_id, tokenizer.pad_token_id} <= {0, 1}
    return [(draw(p), draw(r)) for p, r in zip(CALM_PROMPT_LENGTHS, CALM_RESPONSE_LENGTHS)]


def trl_batch(rows, tokenizer) -> dict:
    """What TRL's SFT collator hands the trainer: [prompt][response][EOS] right-padded, labels -100 on the prompt and
    the padding."""
    eos = tokenizer.eos_token_id
    ids, mask = right_padded([p + r + [eos] for p, r in rows], tokenizer.pad_token_id)
    labels = ids.masked_fill(mask == 0, -100)
    for b, (prompt, _) in enumerate(rows):
        labels[b, :len(prompt)] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def record_calm_objective(model, monkeypatch) -> list[dict]:
    """Records every call of CALM's objective: its inputs (input_ids, attention_mask, labels) and, from the masked
    energy loss, the hidden states, target chunks, scored steps and per-step losses. The loss's draws are made to
    depend on the step index only (the same for every row and every batch), so losses compare across batches."""
    calls, forward = [], model.forward

    def spy(*args, **kwargs):
        if kwargs.get("labels") is not None:  # the objective, not an inference forward (generate)
            calls.append({k: kwargs[k].clone() for k in ("input_ids", "attention_mask", "labels")})
        return forward(*args, **kwargs)

    def masked_energy_loss(hidden, targets, scored, target_noise, model_noise):
        def step_draws(like, draw):
            return torch.stack([draw(like.shape[2:], generator=torch.Generator().manual_seed(step))
                                for step in range(like.shape[1])]).expand_as(like).to(like)
        loss, fidelity, diversity = model.energy_terms(hidden, targets, step_draws(target_noise, torch.randn),
                                                       step_draws(model_noise, torch.rand) - 0.5)
        calls[-1].update(hidden=hidden.detach(), targets=targets, scored=scored, step_loss=loss.detach())
        steps = scored.sum().clamp(min=1)
        return tuple(torch.where(scored, part, 0.0).sum() / steps for part in (loss, fidelity, diversity))

    monkeypatch.setattr(model, "forward", spy)
    monkeypatch.setattr(model, "masked_energy_loss", masked_energy_loss)
    return calls


def generate_first_hidden(model, prompt: list[int], monkeypatch) -> torch.Tensor:
    """[d] the hidden state CALM's generate() draws the first chunk after `prompt` from."""
    seen = []

    def sample_latents(hidden, noise):
        seen.append(hidden)
        return type(model).sample_latents(model, hidden, noise)

    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(model, "sample_latents", sample_latents)
        model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       max_new_tokens=1, eos_token_id=None, noise_seeds=[0])
    return seen[0][0]


def test_calm_sft_layout_by_hand(tmp_path, tokenizer):
    """The re-laid-out rows of a K = 4 batch, written out: EOS left-fill (attention 0, as generate()), the response
    from a chunk boundary, the last chunk EOS-filled (attended, labelled), whole padding chunks on the right."""
    from hf_latentlm.training.post_training import chunk_aligned_sft_batch

    E, P = 0, 1  # EOS, pad
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, E, P, P],
                        [5, 6, 7, 8, 10, E, P, P, P, P]])
    mask = (ids != P).long()
    labels = torch.tensor([[-100] * 5 + [10, 11, E] + [-100] * 2,
                           [-100] * 4 + [10, E] + [-100] * 4])
    out = chunk_aligned_sft_batch(ids, mask, labels, 4, E)
    x = -100
    assert out["input_ids"].tolist() == [[E, E, E, 5, 6, 7, 8, 9, 10, 11, E, E],
                                         [5, 6, 7, 8, 10, E, E, E, E, E, E, E]]
    assert out["attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                                              [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]]
    assert out["labels"].tolist() == [[x, x, x, x, x, x, x, x, 10, 11, E, E],
                                      [x, x, x, x, 10, E, E, E, x, x, x, x]]


def test_calm_sft_trains_every_response_token_and_the_terminal_eos(tmp_path, tokenizer, monkeypatch):
    """For prompts of every length mod K: the trained chunks are exactly the response + terminal EOS (+ EOS fill),
    ⌈(R + 1) / K⌉ of them, consecutive; what precedes them is the EOS-left-filled prompt with generate()'s attention,
    and the hidden state that predicts the first response chunk is the one generate() draws it from."""
    model, trainer = calm_sft_trainer(tmp_path, tokenizer)
    K, eos = model.config.chunk_size, tokenizer.eos_token_id
    rows = calm_rows(tokenizer)
    calls = record_calm_objective(model, monkeypatch)
    loss = trainer.compute_loss(model, trl_batch(rows, tokenizer))
    assert math.isfinite(loss.item())
    (call,) = calls
    for b, (prompt, response) in enumerate(rows):
        P, R = len(prompt), len(response)
        chunks = -(-(R + 1) // K)  # by hand: response + terminal EOS in whole chunks
        scored = call["scored"][b].nonzero().flatten().tolist()
        assert len(scored) == chunks
        first = scored[0]
        assert scored == list(range(first, first + chunks)), "the response's chunks are consecutive"
        trained = call["targets"][b, scored].flatten().tolist()
        assert trained == response + [eos] + [eos] * (chunks * K - R - 1)
        # Context of the first response chunk: chunks 0..first, the prompt left-filled with EOS (attention 0).
        fill = (-P) % K
        assert (first + 1) * K == fill + P, "the response starts on a chunk boundary, right after the prompt"
        assert call["input_ids"][b, :(first + 1) * K].tolist() == [eos] * fill + prompt
        assert call["attention_mask"][b, :(first + 1) * K].tolist() == [0] * fill + [1] * P
        assert not (call["labels"][b, :(first + 1) * K] != -100).any(), "no prompt token is a target"

        torch.testing.assert_close(call["hidden"][b, first], generate_first_hidden(model, prompt, monkeypatch),
                                   atol=1e-5, rtol=1e-4)


def test_calm_sft_row_loss_is_the_same_alone_and_in_a_batch(tmp_path, tokenizer, monkeypatch):
    """With the loss's draws fixed per step, each row's mean energy loss in the batch equals the loss of the row
    alone, and the batch loss is the mean over all trained chunks of the batch."""
    model, trainer = calm_sft_trainer(tmp_path, tokenizer)
    rows = calm_rows(tokenizer, seed=1)
    calls = record_calm_objective(model, monkeypatch)
    with torch.no_grad():
        batch_loss = trainer.compute_loss(model, trl_batch(rows, tokenizer))
        alone = [trainer.compute_loss(model, trl_batch([row], tokenizer)) for row in rows]
    scored, step_loss = calls[0]["scored"], calls[0]["step_loss"]
    in_batch = torch.where(scored, step_loss, 0.0).sum(1) / scored.sum(1)
    torch.testing.assert_close(in_batch, torch.stack(alone), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(batch_loss, (in_batch * scored.sum(1)).sum() / scored.sum(), atol=1e-6, rtol=1e-5)


def test_calm_sft_scored_chunks_do_not_depend_on_the_prompt_tokens(tmp_path, tokenizer, monkeypatch):
    """TRL's own collated prompt/completion batch: ⌈R / K⌉ trained chunks per row (R: TRL's labelled tokens, the
    terminal EOS included), unchanged, with the same targets, when a prompt token changes; one training step is
    finite."""
    model, trainer = calm_sft_trainer(tmp_path, tokenizer)
    K = model.config.chunk_size
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    responses = (batch["labels"] != -100).sum(1)
    calls = record_calm_objective(model, monkeypatch)
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][:, 3] = (changed["input_ids"][:, 3] + 1) % tokenizer.vocab_size  # a prompt token
    assert (batch["labels"][:, 3] == -100).all()
    with torch.no_grad():
        trainer.compute_loss(model, batch)
        trainer.compute_loss(model, changed)
    assert calls[0]["scored"].sum(1).tolist() == [-(-int(r) // K) for r in responses]
    assert torch.equal(calls[0]["scored"], calls[1]["scored"])
    assert torch.equal(calls[0]["labels"], calls[1]["labels"])
    assert not torch.equal(calls[0]["input_ids"], calls[1]["input_ids"])
    monkeypatch.undo()
    trainer.train()
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints and resume; autocast; refused TRL options; independent checks of the stored draws and pair keys
# ---------------------------------------------------------------------------------------------------------------------

def step_recorder(stop_at: int | None = None):
    """A `TrainerCallback` that records the global step after every optimizer step it sees (`.steps`) and, with
    `stop_at`, ends training after that step (as a crash right after a checkpoint)."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)
            if stop_at is not None and state.global_step >= stop_at:
                control.should_training_stop = True

    recorder = Recorder()
    recorder.steps = []
    return recorder


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_two_steps_then_resume_ends_where_four_straight_steps_do(tmp_path, plm_folder, stage):
    from hf_latentlm.recipes import run_dpo, run_sft

    run = run_sft if stage == "sft" else run_dpo
    rows = toy_sft_rows(8) if stage == "sft" else toy_preference_rows(8)
    common = {"max_steps": 4, "batch_size": 2, "learning_rate": 1e-2, "seed": 0, "save_every": 2, "logging_steps": 1}
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run(plm_folder, straight, dataset=Dataset.from_list(rows), **common)
    stopped = step_recorder(stop_at=2)
    first = run(plm_folder, interrupted, dataset=Dataset.from_list(rows), callbacks=[stopped], **common)
    assert stopped.steps == [1, 2] and first["steps"] == 2
    assert (interrupted / "checkpoint-2" / "trainer_state.json").is_file()
    halfway = weights(interrupted)
    # A fresh run into a folder holding checkpoints is refused (rotation would delete them) ...
    with pytest.raises(ValueError, match="--resume"):
        run(plm_folder, interrupted, dataset=Dataset.from_list(rows), **common)
    # ... a half-written newest checkpoint (the Trainer's save is not atomic) is skipped for the complete one ...
    (interrupted / "checkpoint-3").mkdir()
    continued = step_recorder()
    resumed = run(plm_folder, interrupted, dataset=Dataset.from_list(rows), resume=True, callbacks=[continued],
                  **common)
    assert continued.steps == [3, 4] and resumed["steps"] == 4, "steps 3 and 4 only, from checkpoint-2"
    # ... and resuming reaches the uninterrupted run's weights (same data order, schedule, RNG and, for DPO, the
    # same frozen reference rebuilt from the starting folder).
    final, expected = weights(interrupted), weights(straight)
    assert moved(halfway, final), "the resumed run trained"
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)
    # The final model stays at the top of output_dir, beside the checkpoints (the newest 2 kept).
    assert (straight / "config.json").is_file() and (straight / "post_training_log.json").is_file()
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    with pytest.raises(ValueError, match="no complete checkpoint"):
        run(plm_folder, tmp_path / "empty", dataset=Dataset.from_list(rows), resume=True, **common)


def test_reference_and_policy_scores_run_under_the_same_autocast(tmp_path, tokenizer):
    """bf16 mixed precision (CPU autocast): the precomputed draws and reference scores and the policy scores are all
    computed inside `accelerator.autocast()`, so δ = 0 at initialisation holds under mixed precision too."""
    seen = []

    class Recording(PLMResponseScorer):
        def draws(self, *args, **kwargs):
            seen.append(("draws", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return super().draws(*args, **kwargs)

        def score(self, *args, **kwargs):
            seen.append(("score", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return super().score(*args, **kwargs)

    trainer = dpo_trainer(tmp_path, tokenizer, scorer=Recording(), args=dpo_args(tmp_path, bf16=True, use_cpu=True))
    assert {kind for kind, _, _ in seen} == {"draws", "score"}
    assert all(on and dtype == torch.bfloat16 for _, on, dtype in seen), seen
    seen.clear()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        scores = trainer.policy_scores(trainer.model, batch)
    assert seen == [("score", True, torch.bfloat16)]
    # bf16 rows batched otherwise than at precomputation differ by rounding that depends on the machine's bf16
    # kernels (1.7e-5 on torch 2.13's AVX512-BF16 path); the same scores computed without autocast differ by 3.3e-4.
    # Half of that still tells the two apart, with room for other kernels' rounding.
    torch.testing.assert_close(scores, torch.cat([batch[REF_CHOSEN], batch[REF_REJECTED]]), atol=1.6e-4, rtol=0)
    with torch.no_grad():  # the loss moves by at most β/2 · 2 · 1.6e-4 from log 2
        assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(math.log(2), abs=8e-4)


@pytest.mark.parametrize(("option", "value"), [("label_smoothing", 0.1), ("ld_alpha", 0.5), ("loss_weights", [2.0]),
                                               ("use_weighting", True), ("truncation_mode", "keep_end"),
                                               ("rpo_alpha", 1.0), ("f_divergence_type", "forward_kl"),
                                               ("f_divergence_type", "alpha_divergence"),
                                               ("router_aux_loss_coef", 0.01)])
def test_latent_dpo_refuses_trl_options_it_would_ignore(tmp_path, tokenizer, option, value):
    args = dpo_args(tmp_path)
    setattr(args, option, value)  # rpo_alpha is gone from the installed TRL's DPOConfig; still refused where it is set
    with pytest.raises(ValueError, match=rf"does not support {option}="):
        dpo_trainer(tmp_path, tokenizer, args=args)


def test_latent_dpo_accepts_the_defaults_of_those_options(tmp_path, tokenizer):
    args = dpo_args(tmp_path, loss_weights=[1.0], label_smoothing=0.0, use_weighting=False, ld_alpha=None,
                    truncation_mode="keep_start", f_divergence_type="reverse_kl", router_aux_loss_coef=0.0)
    trainer = dpo_trainer(tmp_path, tokenizer, args=args, pairs=2)
    assert trainer.args.loss_weights == [1.0] and trainer.args.f_divergence_type == "reverse_kl"


def test_every_dpo_config_field_is_either_honoured_refused_or_inert():
    """`UNSUPPORTED_DPO_OPTIONS`'s comment sorts TRL's `DPOConfig` fields (those beyond `TrainingArguments`) into
    honoured / checked / refused / inert: a field a new TRL adds (which the latent loss may silently ignore) fails
    here until it is sorted."""
    import inspect
    import re

    from transformers import TrainingArguments
    from trl import DPOConfig

    from hf_latentlm.training import post_training

    own = {f.name for f in dataclasses.fields(DPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    source = inspect.getsource(post_training)
    comment = source[source.index("#: TRL's `DPOConfig` fields"):source.index("UNSUPPORTED_DPO_OPTIONS = {")]
    sorted_names = set(re.findall(r"[a-z_]+", comment)) | set(post_training.UNSUPPORTED_DPO_OPTIONS)
    assert "f_divergence_type" in post_training.UNSUPPORTED_DPO_OPTIONS
    assert len(own) > 20 and not (own - sorted_names), sorted(own - sorted_names)


@pytest.mark.parametrize("option", ["packing", "padding_free"])
def test_latent_sft_refuses_packing_and_padding_free(tmp_path, tokenizer, option):
    args = sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=1, **{option: True})
    with pytest.raises(ValueError, match=rf"does not support {option}=True"):
        LatentSFTTrainer(model=build_tiny("plm", tokenizer), args=args,
                         train_dataset=Dataset.from_list(toy_sft_rows(2)), processing_class=tokenizer)


def test_every_stored_auxiliary_lies_in_the_cell_of_its_observed_target(tmp_path, tokenizer):
    """Independently of `PLMResponseScorer.draws`: for every stored row, cell (z, k) of the grid is target position
    1 + z·s − phase + k; where the stored auxiliary is >= 0 it is owned (Voronoi cell under the reference encoder's
    distribution at that position, from the model's public `auxiliary_owners`) by the row's observed token there; it
    is -1 outside the sequence and where that token owns no auxiliary. Also: each stored `pair_key` is the sha256 key
    of the row's own prompt / chosen / rejected ids."""
    from hf_latentlm.training.scorers import pair_key

    model = build_tiny("plm", tokenizer)
    reference = copy.deepcopy(model).eval()
    trainer = dpo_trainer(tmp_path, tokenizer, model=model, pairs=4)
    cfg = reference.config
    K, s = cfg.block_size, cfg.block_stride
    drawn = 0
    for example in trainer.train_dataset:
        assert example["pair_key"] == pair_key(example["prompt_ids"], example["chosen_ids"], example["rejected_ids"])
        for candidate in ("chosen", "rejected"):
            tokens = torch.tensor(example["prompt_ids"] + example[f"{candidate}_ids"])
            grid, phase = example[f"{candidate}_draw_aux"], example[f"{candidate}_draw_phase"]
            assert len(grid) % K == 0
            with torch.no_grad():
                logits = reference(input_ids=tokens[None]).logits[0]
            owners, _ = reference.auxiliary_owners(logits[:-1])  # row t-1 predicts target t
            covered = set()
            for cell, aux in enumerate(grid):
                z, k = divmod(cell, K)
                target = 1 + z * s - phase + k
                covered.add(target)
                if not 1 <= target < tokens.numel():
                    assert aux == -1, (cell, target)
                    continue
                owns = owners[target - 1] == tokens[target]
                if aux >= 0:
                    assert owns[aux], (candidate, cell, target, aux)
                    drawn += 1
                else:
                    assert not owns.any(), (candidate, cell, target)
            # Every response target that lies in a decoder block (offset (t − 1 + phase) mod s < K) has a cell.
            response = range(len(example["prompt_ids"]), tokens.numel())
            assert {t for t in response if (t - 1 + phase) % s < K} <= covered
    assert drawn > 0, "some auxiliaries were drawn"


def test_cli_sft_and_dpo_pass_save_every_and_resume(tmp_path, run_cli, monkeypatch, plm_folder):
    """...and print the run's summary without an empty `losses` (a run shorter than the logging period logs none);
    `dpo` on a model `sft` did not write (no post_training.json) warns in one line, and goes on."""
    import shutil

    from hf_latentlm import recipes

    calls = []

    def fake(kind):
        def run(model_dir, output_dir, **kwargs):
            calls.append((kind, kwargs))
            return {"stage": kind, "steps": 0, "losses": [] if kind == "sft" else [2.5]}
        return run

    monkeypatch.setattr(recipes, "run_sft", fake("sft"))
    monkeypatch.setattr(recipes, "run_dpo", fake("dpo"))
    base = ["--model", str(plm_folder), "--output-dir", str(tmp_path / "out")]
    code, out, err = run_cli("sft", *base)
    assert code == 0 and json.loads(out) == {"stage": "sft", "steps": 0} and err == ""
    code, out, err = run_cli("dpo", *base, "--save-every", "7", "--resume")
    assert code == 0 and json.loads(out)["losses"] == [2.5]
    assert err == (f"hf-latentlm dpo: warning: {plm_folder} was not fine-tuned by `hf-latentlm sft` (no "
                   f"post_training.json); DPO is meant to start from an SFT model\n")
    assert [(k, kw["save_every"], kw["resume"]) for k, kw in calls] == [("sft", 100, False), ("dpo", 7, True)]
    sft_output = tmp_path / "sft"  # what `sft` writes: the model and its record
    shutil.copytree(plm_folder, sft_output)
    (sft_output / "post_training.json").write_text(json.dumps({"stage": "sft"}))
    code, _, err = run_cli("dpo", "--model", str(sft_output), "--output-dir", str(tmp_path / "out2"))
    assert code == 0 and err == ""
    code, _, err = run_cli("sft", *base, "--save-every", "0")
    assert code == 2 and "--save-every must be at least 1" in err


def test_evaluate_task_restores_the_training_mode_on_error(tokenizer, monkeypatch):
    from hf_latentlm.eval import task

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(task, "generate_answers", broken)
    model = build_tiny("plm", tokenizer).train()
    with pytest.raises(KeyboardInterrupt):
        task.evaluate_task(model, tokenizer, Dataset.from_list(toy_sft_rows(2)), max_new_tokens=4)
    assert model.training


def test_a_rejection_that_cannot_be_made_is_a_value_error(tokenizer, monkeypatch):
    from hf_latentlm.training import tasks

    monkeypatch.setattr(tasks, "_wrong_response", lambda example, kind, rng: example.response)  # never wrong
    with pytest.raises(ValueError, match="rejection of .* found in 50 attempts"):
        tasks.load_preference_task(split_sizes={"train": 1}, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# Cola: DPO trains the prior on the reference's latents, never the VAE
# ---------------------------------------------------------------------------------------------------------------------

def perturbed(model, prefixes: tuple[str, ...], scale: float, seed: int, inside: bool = True):
    """`model` with its trainable parameters whose names start (inside=True) / do not start with `prefixes` moved by
    scale·N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and name.startswith(prefixes) == inside:
                param.add_(scale * torch.randn(param.shape, generator=generator))
    return model


def test_cola_dpo_trains_the_prior_only_and_scores_policy_and_reference_on_the_reference_latents(tmp_path, tokenizer):
    """A Cola model whose VAE trains (`trains_vae`, so only the score keeps DPO off it), its prior perturbed away from
    an explicit reference (δ ≠ 0): a DPO backward gives the VAE no gradient and the prior (DiT, velocity head) one;
    perturbing the policy's VAE then leaves δ exactly unchanged (both are scored on the reference VAE's stored
    latents), while the documented `latents="policy"` ablation does see the perturbation and does train the VAE."""
    from hf_latentlm.training.scorers import ColaResponseScorer

    vae = ("model.vae.",)
    reference = build_tiny("cola", tokenizer).eval()
    assert reference.config.trains_vae and all(p.requires_grad for p in reference.model.vae.parameters())
    policy = perturbed(copy.deepcopy(reference), vae + ("reference_encoder.",), 0.05, seed=0, inside=False)
    trainer = dpo_trainer(tmp_path, tokenizer, model=policy, ref_model=reference, pairs=2,
                          args=dpo_args(tmp_path, beta=3.0))
    assert trainer._draw_keys == ["latents"]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    stored_ref = torch.cat([batch[REF_CHOSEN], batch[REF_REJECTED]])

    policy.train()
    trainer.compute_loss(policy, batch).backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    assert all(g is None or not g.any() for n, g in grads.items() if n.startswith(vae))
    assert any(g is not None and g.any() for n, g in grads.items() if n.startswith("model.layers."))
    assert any(g is not None and g.any() for n, g in grads.items() if n.startswith("velocity_head."))
    policy.zero_grad(set_to_none=True)

    with torch.no_grad():
        delta = trainer.policy_scores(policy, batch) - stored_ref
        ablation = ColaResponseScorer(latents="policy")
        ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
        keys = list(batch["pair_key"]) * 2
        ablation_draws = ablation.draws(reference, ids, mask, completion, keys)
        own = ablation.score(policy, ids, mask, completion, ablation_draws).normalised()
    assert delta.abs().min() > 1e-4  # the prior's perturbation moves every row's score
    perturbed(policy, vae, 0.5, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(trainer.policy_scores(policy, batch) - stored_ref, delta, rtol=0, atol=0)
        own_after = ablation.score(policy, ids, mask, completion, ablation_draws).normalised()
    assert (own_after - own).abs().min() > 1e-3  # the policy's own latents did move
    ablation.score(policy, ids, mask, completion, ablation_draws).loss_sum.sum().backward()
    assert any(p.grad is not None and p.grad.any() for p in policy.model.vae.encoder.parameters())


@pytest.mark.parametrize(("overrides", "named"), [({}, "loss_type and beta are"), ({"beta": 5.0}, "loss_type is"),
                                                  ({"loss_type": ["sigmoid_norm"]}, "beta is")])
def test_a_plain_dpo_config_warns_that_it_trains_trls_defaults_not_the_papers_loss(tmp_path, tokenizer, caplog,
                                                                                   overrides, named):
    """A user's own `trl.DPOConfig` (CPU-safe, else as TRL makes it) keeps TRL's loss_type ["sigmoid"] and/or
    β = 0.1: the trainer names what it trains with and points at `dpo_config()`; `dpo_config()` (the paper's
    sigmoid_norm, β = 5) and its documented ablations that leave TRL's defaults (β = 3 with sigmoid_norm) do not warn.
    """
    import logging

    from trl import DPOConfig

    plain = DPOConfig(output_dir=str(tmp_path / "plain"), bf16=False, use_cpu=True, activation_checkpointing=False,
                      per_device_train_batch_size=2, max_steps=1, report_to=[], **overrides)
    assert (list(plain.loss_type), plain.beta) == (overrides.get("loss_type", ["sigmoid"]), overrides.get("beta", 0.1))
    name = "hf_latentlm.training.post_training"
    with caplog.at_level(logging.WARNING, logger=name):
        dpo_trainer(tmp_path, tokenizer, args=plain, pairs=2)
    warnings = [r.getMessage() for r in caplog.records
                if r.name == name and "TRL's DPOConfig default" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert f"loss_type={list(plain.loss_type)} and beta={plain.beta};" in warnings[0]
    assert f"{named} TRL's DPOConfig default" in warnings[0] and "dpo_config(" in warnings[0]
    for args in (dpo_args(tmp_path), dpo_args(tmp_path, beta=3.0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=name):
            dpo_trainer(tmp_path, tokenizer, args=args, pairs=2)
        assert not [r for r in caplog.records if "TRL's DPOConfig default" in r.getMessage()]


# ---------------------------------------------------------------------------------------------------------------------
# conversational datasets through the packaged chat template
# ---------------------------------------------------------------------------------------------------------------------

def instruction_for(line: str) -> str:
    return f"Repeat this line exactly:\n{line}"


def test_a_messages_dataset_trains_in_latent_sft_with_the_prompt_unlabelled(tmp_path, tokenizer):
    """`messages` rows (user instruction, assistant answer) with `assistant_only_loss=True`: each row is tokenized
    as the task's text format_prompt(instruction) + format_completion(response), the prompt's labels are -100 and
    exactly the completion's tokens (the terminal EOS included) are targets, in the batch and in what the family's
    objective receives; two steps train."""
    from hf_latentlm.training.tasks import format_completion, format_prompt

    lines = verse_lines(2)
    rows = [{"messages": [{"role": "user", "content": instruction_for(line)},
                          {"role": "assistant", "content": line}]} for line in lines]
    model = build_tiny("plm", tokenizer)
    before = snapshot(model)
    args = sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=2, logging_steps=1, learning_rate=1e-3,
                      assistant_only_loss=True)
    trainer = LatentSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    labels = trainer.model_inputs(batch)["labels"]
    for b, line in enumerate(lines):
        prompt = tokenizer(format_prompt(instruction_for(line)))["input_ids"]
        whole = tokenizer(format_prompt(instruction_for(line)) + format_completion(line))["input_ids"]
        assert whole[:len(prompt)] == prompt and whole[-1] == tokenizer.eos_token_id
        real = int(batch["attention_mask"][b].sum())
        assert batch["input_ids"][b, :real].tolist() == whole
        assert (labels[b, :len(prompt)] == -100).all() and (labels[b, real:] == -100).all()
        assert labels[b, len(prompt):real].tolist() == whole[len(prompt):]
    with recorded_labels(model) as recorded:
        trainer.train()
    label_rows = sorted(row.tolist() for row in labels)  # each step's batch holds both rows, in the sampler's order
    assert len(recorded) == 2 and all(sorted(row.tolist() for row in r) == label_rows for r in recorded)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all(math.isfinite(e["loss"]) for e in logged)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    # The trained folder keeps the template: reloaded, it renders the task format.
    from transformers import AutoTokenizer

    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    assert reloaded.apply_chat_template(rows[0]["messages"], tokenize=False) == \
        format_prompt(instruction_for(lines[0])) + format_completion(lines[0])


def test_a_messages_dataset_without_assistant_only_loss_warns_that_every_turn_is_trained(tmp_path, tokenizer,
                                                                                         caplog):
    import logging

    rows = [{"messages": [{"role": "user", "content": instruction_for(line)},
                          {"role": "assistant", "content": line}]} for line in verse_lines(2)]
    name = "hf_latentlm.training.post_training"
    for only, expected in ((False, 1), (True, 0)):
        caplog.clear()
        args = sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=1, assistant_only_loss=only)
        with caplog.at_level(logging.WARNING, logger=name):
            trainer = LatentSFTTrainer(model=build_tiny("plm", tokenizer), args=args,
                                       train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
        warned = [r for r in caplog.records if r.name == name and "assistant_only_loss=True" in r.getMessage()]
        assert len(warned) == expected
        labels = trainer.train_dataset[0]["labels"] if "labels" in trainer.train_dataset.column_names else None
        assert labels is not None and ((-100 in labels) == only)  # without it the user's turn is a target too


def test_a_conversational_preference_dataset_trains_in_latent_dpo_as_its_text_form_does(tmp_path, tokenizer):
    """prompt / chosen / rejected as message lists go through the chat template into exactly the token ids, and so
    the same reference scores, as the task's text form (format_prompt / format_completion); a step trains."""
    from hf_latentlm.training.tasks import format_completion, format_prompt

    lines = verse_lines(3)
    pairs = list(zip(lines[:-1], lines[1:]))
    chat = [{"prompt": [{"role": "user", "content": instruction_for(a)}],
             "chosen": [{"role": "assistant", "content": a}], "rejected": [{"role": "assistant", "content": b}]}
            for a, b in pairs]
    text = [{"prompt": format_prompt(instruction_for(a)), "chosen": format_completion(a),
             "rejected": format_completion(b)} for a, b in pairs]
    model = build_tiny("plm", tokenizer)
    before = snapshot(model)
    trainers = [LatentDPOTrainer(model=model, args=dpo_args(tmp_path, max_steps=1), processing_class=tokenizer,
                                 train_dataset=Dataset.from_list(rows)) for rows in (text, chat)]
    for column in ("prompt_ids", "chosen_ids", "rejected_ids", REF_CHOSEN, REF_REJECTED):
        assert trainers[1].train_dataset[column] == trainers[0].train_dataset[column], column
    assert trainers[1].train_dataset["chosen_ids"][0][-1] == tokenizer.eos_token_id
    trainers[1].train()
    assert math.isfinite(trainers[1].state.log_history[0]["loss"])
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


# ---------------------------------------------------------------------------------------------------------------------
# TRL's metrics in the latent trainers
# ---------------------------------------------------------------------------------------------------------------------

def hand_token_metrics(model, ids, mask, scored) -> tuple[list[float], list[float], list[float], list[int]]:
    """Per row, from ONE plain forward of `model` (next-token logits): Σ entropy, Σ mean logit, #argmax hits and
    #targets over the positions t with scored[b, t] (predicted from t − 1), written out position by position."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    entropy, mean_logit, hits, count = [], [], [], []
    for b in range(ids.shape[0]):
        h = m = 0.0
        c = n = 0
        for t in range(1, ids.shape[1]):
            if scored[b, t]:
                log_p = torch.log_softmax(logits[b, t - 1], -1)
                h -= float((log_p.exp() * log_p).sum())
                m += float(logits[b, t - 1].mean())
                c += int(int(logits[b, t - 1].argmax()) == int(ids[b, t]))
                n += 1
        entropy.append(h), mean_logit.append(m), hits.append(c), count.append(n)
    return entropy, mean_logit, hits, count


def greedy_pair_batch(trainer, model, tokenizer):
    """A hand-made [chosen; rejected] batch of 2 pairs with its draws and reference scores (the model is its own
    reference): chosen = 7 of the encoder's greedy tokens + EOS (so the token accuracy is neither 0 nor 1 in
    general), rejected = other verse tokens + EOS."""
    eos = tokenizer.eos_token_id
    lines = verse_lines(4)
    rows, prompts = [], []
    for line, other in ((lines[0], lines[2]), (lines[1], lines[3])):
        prompt = tokenizer(prompt_for(line))["input_ids"]
        prompts.append(prompt)
        rows.append((prompt + greedy_response(model, prompt, 7, eos) + [eos],
                     prompt + tokenizer(" " + other)["input_ids"][:9] + [eos]))
    stacked = [r[0] for r in rows] + [r[1] for r in rows]
    ids, mask = right_padded(stacked, tokenizer.pad_token_id)
    completion = mask.clone()
    for b, prompt in enumerate(prompts + prompts):
        completion[b, :len(prompt)] = 0
    keys = ["p0", "p1"]
    scorer = PLMResponseScorer()
    model.eval()
    draws = scorer.draws(model, ids, mask, completion, keys + keys)
    with torch.no_grad():
        reference = scorer.score(model, ids, mask, completion, draws).normalised().float()
    batch = {"input_ids": ids, "attention_mask": mask, "completion_mask": completion, "pair_key": keys,
             "draw_aux": draws["aux"], "draw_phase": draws["phase"], REF_CHOSEN: reference[:2],
             REF_REJECTED: reference[2:]}
    return batch, draws


def test_latent_dpo_logs_trls_logps_token_metrics_and_num_tokens_with_their_values(tmp_path, tokenizer):
    """PLM DPO on a hand-made batch: logps/chosen and logps/rejected are the policy's summed scores −loss_sum (the
    scorer's, called directly); entropy (both candidates), mean_token_accuracy (chosen, as TRL), logits/chosen and
    logits/rejected are those of the encoder's next-token distributions over the response targets, from a plain
    forward written out position by position; num_tokens counts the attended tokens of the training batches."""
    model = build_tiny("plm", tokenizer)
    trainer = dpo_trainer(tmp_path, tokenizer, model=model, pairs=2)
    batch, draws = greedy_pair_batch(trainer, model, tokenizer)
    ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    model.train()  # "train" metrics; dropout is off (TRL's disable_dropout)
    start = trainer._total_train_tokens
    with torch.no_grad():
        trainer.compute_loss(model, batch)
        trainer.compute_loss(model, batch)
        summed = -PLMResponseScorer().score(model, ids, mask, completion, draws).loss_sum.double()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert logged["logps/chosen"] == pytest.approx(summed[:2].mean().item(), rel=1e-5)
    assert logged["logps/rejected"] == pytest.approx(summed[2:].mean().item(), rel=1e-5)
    assert logged["logps/chosen"] != pytest.approx(logged["scores/chosen"], rel=1e-3)  # summed, not normalised
    assert logged["num_tokens"] == start + 2 * int(mask.sum())
    scored = completion.bool() & mask.bool()
    entropy, mean_logit, hits, count = hand_token_metrics(model, ids, mask, scored)
    assert 0 < sum(hits[:2]) < sum(count[:2])  # the greedy tokens are hits, the terminal EOS in general not
    assert logged["mean_token_accuracy"] == pytest.approx(sum(hits[:2]) / sum(count[:2]))
    assert logged["entropy"] == pytest.approx(sum(entropy) / sum(count), rel=1e-4)
    assert logged["logits/chosen"] == pytest.approx(sum(mean_logit[:2]) / sum(count[:2]), rel=1e-4, abs=1e-6)
    assert logged["logits/rejected"] == pytest.approx(sum(mean_logit[2:]) / sum(count[2:]), rel=1e-4, abs=1e-6)


def test_latent_sft_logs_num_tokens_and_plms_token_accuracy_and_entropy(tmp_path, tokenizer):
    """PLM SFT: mean_token_accuracy and entropy are the encoder's over the trained (labelled) targets, by hand from a
    plain forward; num_tokens counts the attended tokens of TRL's batches. Cola (no token predictions) logs
    num_tokens and neither of the other two."""
    eos = tokenizer.eos_token_id
    model = build_tiny("plm", tokenizer)
    args = sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=1, learning_rate=1e-3, logging_steps=1)
    trainer = LatentSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(toy_sft_rows(2)),
                               processing_class=tokenizer)
    prompts = [tokenizer(prompt_for(line))["input_ids"] for line in verse_lines(2)]
    model.eval()
    rows = [prompts[0] + greedy_response(model, prompts[0], 6, eos) + [eos],
            prompts[1] + tokenizer(" " + verse_lines(3)[2])["input_ids"][:5] + [eos]]
    ids, mask = right_padded(rows, tokenizer.pad_token_id)
    labels = ids.clone()
    for b, prompt in enumerate(prompts):
        labels[b, :len(prompt)] = -100
    labels[mask == 0] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    model.train()
    start = trainer._total_train_tokens
    with torch.no_grad():
        trainer.compute_loss(model, batch)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    entropy, _, hits, count = hand_token_metrics(model, ids, mask, labels != -100)
    assert sum(count) == int((labels != -100).sum()) and 0 < sum(hits) < sum(count)
    assert logged["mean_token_accuracy"] == pytest.approx(sum(hits) / sum(count))
    assert logged["entropy"] == pytest.approx(sum(entropy) / sum(count), rel=1e-4)
    assert logged["num_tokens"] == start + int(mask.sum())

    cola = LatentSFTTrainer(model=build_tiny("cola", tokenizer), args=args,
                            train_dataset=Dataset.from_list(toy_sft_rows(2)), processing_class=tokenizer)
    cola.train()
    logged = [e for e in cola.state.log_history if "loss" in e][-1]
    assert logged["num_tokens"] > 0 and "mean_token_accuracy" not in logged and "entropy" not in logged


# ---------------------------------------------------------------------------------------------------------------------
# a family's learning-rate scales (Cola's VAE:DiT ratio) in the TRL trainers' optimizers
# ---------------------------------------------------------------------------------------------------------------------

RATIO = 0.25


def cola_with_ratio(tokenizer, ratio: float = RATIO):
    model = build_tiny("cola", tokenizer)
    model.config.vae_learning_rate_ratio = ratio  # read by parameter_learning_rate_scales(); the VAE still trains
    assert model.parameter_learning_rate_scales() == {"model.vae.": ratio}
    return model


def group_of(optimizer, model) -> dict[str, dict]:
    """parameter name -> its optimizer group (each trainable parameter in exactly one)."""
    ids = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert id(param) not in ids, "a parameter in two groups"
            ids[id(param)] = group
    named = {n: ids.get(id(p)) for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in named.values()), [n for n, g in named.items() if g is None]
    return named


def max_step(before: dict, model, names) -> float:
    return max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters() if n in names)


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_trainers_give_colas_vae_its_learning_rate_ratio_through_the_schedule(tmp_path, tokenizer, stage):
    """Cola with VAE:DiT ratio 0.25 and weight decay 0.1: the optimizer (the Trainer's own AdamW class and betas) has
    the VAE's parameters in groups at 0.25 × lr and every other one at lr, decay where the Trainer puts it; after one
    step the scheduler's rates are still in that ratio (and have moved: the schedule scales every group), and in
    SFT, where the VAE has a gradient, Adam's first step moved VAE weights by at most 0.25 × what it moved the DiT's."""
    lr = 1e-2
    model = cola_with_ratio(tokenizer)
    common = dict(batch_size=2, max_steps=2, learning_rate=lr, weight_decay=0.1, warmup_steps=0, logging_steps=1)
    if stage == "sft":
        trainer = LatentSFTTrainer(model=model, args=sft_config(str(tmp_path / "sft"), **common),
                                   train_dataset=Dataset.from_list(toy_sft_rows(4)), processing_class=tokenizer)
    else:
        trainer = dpo_trainer(tmp_path, tokenizer, model=model, pairs=4, args=dpo_args(tmp_path, **common))
    optimizer = trainer.create_optimizer()
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["betas"] == (0.9, 0.95)
    groups = group_of(optimizer, trainer.model)
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    for name, group in groups.items():
        assert group["lr"] == pytest.approx(lr * (RATIO if name.startswith("model.vae.") else 1.0)), name
        assert group["weight_decay"] == (0.1 if name in decay else 0.0), name
    assert optimizer.param_groups[0]["lr"] == lr  # the group a Trainer logs the rate of
    vae = {n for n in groups if n.startswith("model.vae.")}
    dit = {n for n in groups if n.startswith("model.layers.")}
    assert vae and dit and decay & vae and vae - decay

    before = snapshot(model)
    recorder = step_recorder(stop_at=1)
    trainer.add_callback(recorder)
    trainer.train()
    assert trainer.state.global_step == 1
    rates = trainer.lr_scheduler.get_last_lr()
    group_index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    params = dict(model.named_parameters())
    factor = trainer.lr_scheduler.lr_lambdas[0](1)
    assert 0 < factor < 1  # the linear decay has moved every rate
    for name in groups:
        expected = lr * factor * (RATIO if name in vae else 1.0)
        assert rates[group_index[id(params[name])]] == pytest.approx(expected), name
    if stage == "sft":  # Adam's first step moves each weight by about its group's lr
        dit_step, vae_step = max_step(before, model, dit), max_step(before, model, vae)
        assert dit_step == pytest.approx(lr, rel=0.05) and vae_step == pytest.approx(RATIO * lr, rel=0.05)
    else:  # DPO trains the prior only (Cola's score reads the reference's latents)
        assert max_step(before, model, vae) == 0 and max_step(before, model, dit) > 0.5 * lr


def test_under_lora_the_adapters_inside_colas_vae_get_its_learning_rate_ratio(tmp_path, tokenizer):
    """LoRA on q_proj of both the DiT and the VAE encoder: the PEFT model's names carry `base_model.model.`, yet the
    adapters inside the VAE are grouped at 0.25 × lr and the DiT's at lr (the scales are matched against names
    relative to the wrapped model), the frozen base weights are in no group, and Adam's first step moves the VAE's
    lora_B weights by 0.25 × what it moves the DiT's."""
    from peft import LoraConfig

    lr = 1e-2
    model = cola_with_ratio(tokenizer)
    args = sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=1, learning_rate=lr, warmup_steps=0,
                      logging_steps=1)
    target = r"model\.(vae\.encoder\.)?layers\.\d+\.self_attn\.q_proj"
    trainer = LatentSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(toy_sft_rows(4)),
                               processing_class=tokenizer, peft_config=LoraConfig(r=4, target_modules=target))
    peft_model = trainer.model
    groups = group_of(trainer.create_optimizer(), peft_model)
    assert groups and all("lora_" in n and n.startswith("base_model.model.") for n in groups)
    vae = {n for n in groups if n.startswith("base_model.model.model.vae.encoder.")}
    dit = {n for n in groups if n.startswith("base_model.model.model.layers.")}
    assert vae and dit and vae | dit == set(groups)
    assert all(groups[n]["lr"] == pytest.approx(RATIO * lr) for n in vae) and all(groups[n]["lr"] == lr for n in dit)
    before = snapshot(peft_model)
    trainer.train()
    lora_b = {n for n in groups if "lora_B" in n}
    dit_step, vae_step = max_step(before, peft_model, lora_b & dit), max_step(before, peft_model, lora_b & vae)
    assert dit_step == pytest.approx(lr, rel=0.05) and vae_step == pytest.approx(RATIO * lr, rel=0.05)


def test_an_optimizer_that_builds_its_own_groups_is_refused_when_it_would_drop_the_scales(tmp_path, tokenizer):
    """An optimizer whose kwargs bring their own `params` (as GaLore's do): refused by name for Cola with a VAE ratio
    ≠ 1 (the scales would be lost), built the Trainer's way, with those params, for a family without scales."""
    args = sft_config(str(tmp_path / "sft"), batch_size=2, max_steps=1)
    for family, refused in (("cola", True), ("plm", False)):
        model = cola_with_ratio(tokenizer) if family == "cola" else build_tiny(family, tokenizer)
        trainer = LatentSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(toy_sft_rows(2)),
                                   processing_class=tokenizer)
        own = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": 3e-3}]
        trainer.optimizer_cls_and_kwargs = (torch.optim.SGD, {"params": own, "lr": 1e-3})
        if refused:
            with pytest.raises(ValueError, match="builds its own parameter groups"):
                trainer.create_optimizer()
        else:
            optimizer = trainer.create_optimizer()
            assert type(optimizer) is torch.optim.SGD and [g["lr"] for g in optimizer.param_groups] == [3e-3]


def test_parameter_groups_see_through_wrappers_that_rename_parameters(tokenizer):
    """`loop.parameter_groups` (the grouping of `make_optimizer` and of the trainers): the model itself and its
    torch.compile wrapper (names under `_orig_mod.`) give the same lr per parameter: the VAE's at 0.25 × lr, the rest
    at lr, matrices decayed."""
    from hf_latentlm.training.loop import parameter_groups

    model = cola_with_ratio(tokenizer)
    compiled = torch.compile(model)  # nothing is compiled until a forward
    assert all(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    for wrapped in (model, compiled):
        lrs = {id(p): (g["lr"], g["weight_decay"]) for g in parameter_groups(wrapped, 1e-3, 0.1) for p in g["params"]}
        for name, param in model.named_parameters():
            if param.requires_grad:
                expected = 1e-3 * (RATIO if name.startswith("model.vae.") else 1.0)
                assert lrs[id(param)] == (pytest.approx(expected), 0.1 if param.dim() >= 2 else 0.0), name
