"""FLOPs counter (hf_latentlm/eval/flops.py): its results against hand counts of tiny models."""

import pytest
import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from hf_latentlm.eval.flops import count_flops, inference_flops_per_token, training_flops_per_token
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
