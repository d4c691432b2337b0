"""FLOPs counter (hf_latentlm/eval/flops.py): its results against hand counts of tiny models."""

import pytest
import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from hf_latentlm.eval.flops import (
    FlopCounter,
    compare_with_flop_counter_mode,
    count_flops,
    counted_training_flops,
    inference_flops_per_token,
    training_flops_per_token,
    weights_updated,
)
from hf_latentlm.families import build_model


@pytest.fixture(scope="module")
def ar(tokenizer):
    torch.manual_seed(0)
    return build_model("ar", "tiny", tokenizer, num_hidden_layers=1)


@pytest.fixture(scope="module")
def calm(tokenizer):
    torch.manual_seed(0)
    ae = build_model("calm-ae", "tiny", tokenizer)
    return build_model("calm", "tiny", tokenizer, autoencoder=ae, temperature_pool_size=8)


def test_linear_stack_matches_hand_count():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 5, bias=False), nn.ReLU(), nn.Linear(5, 3, bias=False))
    x = torch.randn(4, 7)
    forward, _ = count_flops(lambda: net(x))
    assert forward.total == 2 * 4 * (7 * 5 + 5 * 3)  # 2·in·out per row and layer
    both, _ = count_flops(lambda: net(x).sum().backward())
    # Backward: both weight gradients, and the input gradient of the second layer only (x needs none).
    assert both.total - forward.total == 2 * 4 * (7 * 5 + 5 * 3) + 2 * 4 * 5 * 3


def test_ar_step_by_hand(ar):
    cfg = ar.config
    d, kv, hd, inter = cfg.hidden_size, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, \
        cfg.intermediate_size
    short, long = inference_flops_per_token(ar, 8), inference_flops_per_token(ar, 40)
    weights = d * d + 2 * d * kv * hd + d * d + 3 * d * inter  # q, k, v, o, gate, up, down of the one layer
    assert short["parts"]["backbone_weights"] == long["parts"]["backbone_weights"] == 2 * weights
    assert short["parts"]["lm_head"] == 2 * d * cfg.vocab_size
    # One query against C + 1 keys: q·kᵀ and p·v, 2·d FLOPs per key each.
    assert short["parts"]["attention_over_context"] == 4 * d * (8 + 1)
    assert long["per_token"] - short["per_token"] == 4 * d * (40 - 8)


def test_counting_leaves_the_model_as_it_was(ar):
    before = ar.config._attn_implementation
    ar.train()
    training_flops_per_token(ar, 16)
    inference_flops_per_token(ar, 8)
    assert ar.training and ar.config._attn_implementation == before
    assert all(p.grad is None for p in ar.parameters())
    ar.eval()


@torch.no_grad()
def test_calm_step_is_the_sum_of_its_parts(calm):
    cfg, K, context = calm.config, calm.config.chunk_size, 16
    result = inference_flops_per_token(calm, context)
    # The three pieces of a decoding step, called here by hand on a cache holding `context` tokens.
    prompt = torch.randint(3, cfg.vocab_size, (1, context))
    cache = DynamicCache(config=cfg)
    calm(input_ids=prompt, cache=cache)
    chunk = torch.randint(3, cfg.vocab_size, (1, K))
    mask = torch.ones(1, context + K, dtype=torch.long)
    backbone, out = count_flops(lambda: calm(input_ids=chunk, attention_mask=mask, cache=cache), calm)
    head, latents = count_flops(lambda: calm.sample_latents(out.last_hidden_state[:, -1],
                                                            torch.rand(1, 1, cfg.noise_size) - 0.5), calm)
    decoder, _ = count_flops(lambda: calm.autoencoder.decode(latents[:, 0]))
    assert result["per_token"] == (backbone.total + head.total + decoder.total) / K
    assert result["parts"]["energy_head"] == head.total / K
    assert result["parts"]["autoencoder_decoder"] == decoder.total / K
    # The new chunk attends to context/K + 1 chunk keys: 4·d FLOPs per key per layer, shared by K tokens.
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    assert result["parts"]["attention_over_context"] == 4 * d * layers * (context // K + 1) / K
    longer = inference_flops_per_token(calm, context + 4 * K)
    assert longer["per_token"] - result["per_token"] == 4 * d * layers * 4 / K


def test_calm_pool_decodes_every_draw(calm):
    single = inference_flops_per_token(calm, 8)
    pool = inference_flops_per_token(calm, 8, temperature=0.5)
    assert pool["head_draws_per_step"] == calm.config.temperature_pool_size == 8
    assert pool["parts"]["autoencoder_decoder"] == 8 * single["parts"]["autoencoder_decoder"]
    assert pool["parts"]["backbone_weights"] == single["parts"]["backbone_weights"]


def test_training_parts(ar, calm):
    a = training_flops_per_token(ar, 16, batch_size=2)
    assert a["tokens"] == 32
    # Every product in the AR step needs both gradients (the first layer's input is the trainable embedding).
    assert a["backward_per_token"] == 2 * a["forward_per_token"]
    c = training_flops_per_token(calm, 16, batch_size=2)
    assert c["parts"]["forward"]["autoencoder"] > 0 and "autoencoder" not in c["parts"]["backward"]  # frozen encode
    assert c["parts"]["backward"]["model"] == 2 * c["parts"]["forward"]["model"]
    assert c["parts"]["forward"]["loss_and_other"] > 0  # the energy loss's cdist, counted by its own rule
    assert c["per_token"] == pytest.approx(c["forward_per_token"] + c["backward_per_token"])


def test_bad_input(ar, calm):
    with pytest.raises(ValueError, match="context_length"):
        inference_flops_per_token(ar, 0)
    with pytest.raises(ValueError, match="chunk_size"):
        inference_flops_per_token(calm, 6)  # K = 4
    with pytest.raises(ValueError, match="chunk_size"):
        training_flops_per_token(calm, 18)
    with pytest.raises(ValueError, match="temperature"):
        inference_flops_per_token(calm, 8, temperature=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        inference_flops_per_token(ar, ar.config.max_position_embeddings)


# ====================================================================================================================
# FlopCounter: the torch-function counter behind the benchmark's achieved FLOP/s
# ====================================================================================================================

def test_counter_rules_by_hand():
    """Each rule on shapes where every term differs, forward and the backward implied by which operands need a
    gradient, against a hand count."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 7), torch.randn(4, 7, requires_grad=True)
    a, b = torch.randn(2, 1, 3, 6), torch.randn(5, 6, 9, requires_grad=True)
    with FlopCounter() as counter:
        torch.nn.functional.linear(x, w)  # x needs no gradient: dW only
        a @ b  # broadcast batch 2 x 5
    assert counter.forward == 2 * 15 * 7 * 4 + 2 * 10 * 3 * 6 * 9
    assert counter.backward == 2 * 15 * 7 * 4 + 2 * 10 * 3 * 6 * 9
    with FlopCounter() as counter:
        torch.randn(7, 3).__rmatmul__(torch.randn(4, 7))  # [4, 7] @ [7, 3]
    assert counter.forward == 2 * 4 * 7 * 3
    q = torch.randn(2, 4, 3, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 6)
    with FlopCounter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    scores, values = 2 * 8 * 3 * 5 * 8, 2 * 8 * 3 * 5 * 6
    assert counter.forward == scores + values
    assert counter.backward == scores + values  # dq from the scores' gradient, dp from the output's; no dk, dv
    with FlopCounter() as counter, torch.no_grad():
        torch.nn.functional.linear(x, w)
        torch.cdist(torch.randn(4, 3), torch.randn(6, 3))
    assert (counter.forward, counter.backward) == (2 * 15 * 7 * 4 + 2 * 4 * 6 * 3, 0)  # no backward without grad
    with FlopCounter() as counter:  # a call torch refuses fails as without the counter, and counts nothing
        with pytest.raises(TypeError):
            torch.matmul(torch.ones(2, 2), "not a tensor")
    assert counter.forward == 0


def test_counter_attention_backward_matches_torch():
    """The SDPA rule against torch's own count of the same attention written out as matmuls, for each combination
    of operands that need a gradient."""
    torch.manual_seed(0)
    for grads in [(True, False, False), (False, True, True), (True, True, True), (False, False, True)]:
        q, k, v = (torch.randn(2, 3, 4, 8, requires_grad=g) for g in grads)
        with FlopCounter() as counter:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        written_out = lambda: torch.matmul((q @ k.transpose(-1, -2)).softmax(-1), v).sum().backward()  # noqa: E731
        reference, _ = count_flops(written_out)
        assert counter.total == reference.total, grads
        del out


@pytest.fixture(scope="module")
def every_family(tokenizer):
    torch.manual_seed(0)
    return {"ar": build_model("ar", "tiny", tokenizer), "plm": build_model("plm", "tiny", tokenizer),
            "calm": build_model("calm", "tiny", tokenizer, autoencoder=build_model("calm-ae", "tiny", tokenizer)),
            "cola": build_model("cola", "tiny", tokenizer, vae=build_model("cola-vae", "tiny", tokenizer)),
            "aurora": build_model("aurora", "tiny", tokenizer,
                                  autoencoder=build_model("aurora-ae", "tiny", tokenizer))}


@pytest.mark.parametrize("family", ["ar", "plm", "calm", "cola", "aurora"])
def test_counter_matches_torch_on_every_family(every_family, family):
    """A training step and a whole generate() of every family: FlopCounter (SDPA attention, backward from the
    forward alone) within 5% of FlopCounterMode (eager attention, the real backward)."""
    model = every_family[family]
    rows = torch.randint(3, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    counts = compare_with_flop_counter_mode(model, rows)
    reference, ours = counts["training"]
    assert ours == pytest.approx(reference, rel=0.05)
    assert counts["same_generation"] and counts["backward"] == 0  # the same call, so the same work; no grad
    reference, ours = counts["generate"]
    assert ours == pytest.approx(reference, rel=0.05)
    # The step's backward is counted: more than the same forward run without grad.
    with FlopCounter() as forward_only, torch.no_grad():
        model(input_ids=rows, labels=rows)
    assert counts["training"][1] > forward_only.forward
