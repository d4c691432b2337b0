"""Attention through transformers' attention interface: `layers.Attention` runs the function that
`config._attn_implementation` names; flex attention takes our boolean masks as BlockMasks; every family declares
what it supports, and refuses flash attention by name unless its masks are plain causal + padding (CALM)."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_latentlm.families import build_fresh_model
from hf_latentlm.modeling.layers import (
    Attention,
    RotaryEmbedding,
    block_causal_mask,
    causal_mask,
    dual_stream_mask,
)

HIDDEN, HEADS, KV_HEADS = 32, 4, 2


def attention(implementation: str) -> Attention:
    torch.manual_seed(0)
    config = types.SimpleNamespace(_attn_implementation=implementation)
    return Attention(HIDDEN, HEADS, KV_HEADS, layer_idx=0, config=config).eval()


def run(attn: Attention, implementation: str, x, mask, past: int = 0):
    """The layer's output on the last `x.shape[1] - past` positions, the first `past` ones cached before."""
    attn.config._attn_implementation = implementation
    cos, sin = RotaryEmbedding(HIDDEN // HEADS)(torch.arange(x.shape[1])[None].expand(x.shape[0], -1))
    cache = DynamicCache()
    with torch.no_grad():
        if past:
            attn(x[:, :past], cos[:, :past], sin[:, :past], None, cache=cache)
        return attn(x[:, past:], cos[:, past:], sin[:, past:], mask, cache=cache)


@pytest.fixture
def uncompiled_flex(monkeypatch):
    """Flex attention on torch's reference path instead of an inductor compile per mask shape (minutes on a small
    CPU): the masks handed to it are what is under test here; one test below runs the compiled kernel."""
    monkeypatch.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    with torch._dynamo.config.patch(disable=True):
        yield


def test_compiled_flex_attention_takes_our_boolean_masks_as_sdpa_does():
    """Dual-stream with padding and a row with no visible key (zero output), through the compiled kernel."""
    attn = attention("sdpa")
    x = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(1))
    empty_row = causal_mask(12, 12).expand(2, 1, 12, 12).clone()
    empty_row[0, 0, 5] = False
    dual_stream = dual_stream_mask(6, 2, padding_mask=torch.tensor([[1] * 4 + [0] * 2, [1] * 6]))
    for mask in (dual_stream, empty_row):
        torch.testing.assert_close(run(attn, "flex_attention", x, mask), run(attn, "sdpa", x, mask), atol=1e-5,
                                   rtol=1e-5)
    assert torch.equal(run(attn, "flex_attention", x, empty_row)[0, 5], torch.zeros(HIDDEN))


def test_flex_attention_takes_per_head_batch_shared_and_cached_masks(uncompiled_flex):
    attn = attention("sdpa")
    x = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(2))
    masks = {
        "per head": torch.rand(2, HEADS, 12, 12, generator=torch.Generator().manual_seed(2)) > 0.5,
        "shared by the batch": block_causal_mask(12, 3),
        "unbatched": block_causal_mask(12, 5)[0, 0],
    }
    for name, mask in masks.items():
        torch.testing.assert_close(run(attn, "flex_attention", x, mask), run(attn, "sdpa", x, mask), atol=1e-5,
                                   rtol=1e-5, msg=name)
    for past in (8, 11):  # a block, then one item, after a cached prefix
        cached = block_causal_mask(12, 3)[:, :, past:]
        torch.testing.assert_close(run(attn, "flex_attention", x, cached, past=past),
                                   run(attn, "sdpa", x, cached, past=past), atol=1e-5, rtol=1e-5)


def test_eager_is_our_function_and_records_zero_probabilities_for_a_row_with_no_key():
    attn = attention("eager")
    x = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(3))
    mask = causal_mask(5, 5).clone()
    mask[0, 0, 2] = False
    recorded = []
    attn.attention_probs.register_forward_hook(lambda module, args, out: recorded.append(out))
    out = run(attn, "eager", x, mask)
    (probs,) = recorded
    assert probs.shape == (1, HEADS, 5, 5) and torch.equal(probs[0, :, 2], torch.zeros(HEADS, 5))
    torch.testing.assert_close(probs[0, :, [0, 1, 3, 4]].sum(-1), torch.ones(HEADS, 4))
    assert not probs.masked_select(~mask).any()
    torch.testing.assert_close(out, run(attn, "sdpa", x, mask), atol=1e-5, rtol=1e-5)


def test_an_implementation_registered_with_transformers_is_called(monkeypatch):
    calls = []

    def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append((module, attention_mask.shape))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "recording", recording_sdpa)
    attn = attention("sdpa")
    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(4))
    mask = block_causal_mask(6, 2)
    torch.testing.assert_close(run(attn, "recording", x, mask), run(attn, "sdpa", x, mask), atol=0, rtol=0)
    assert calls == [(attn, (1, 1, 6, 6))]


def test_flash_attention_refuses_a_mask_that_is_not_padding():
    attn = attention("flash_attention_2")
    x = torch.randn(1, 4, HIDDEN)
    with pytest.raises(ValueError, match=r"flash_attention_2 takes only causal attention .* shape \(1, 1, 4, 4\)"):
        run(attn, "flash_attention_2", x, block_causal_mask(4, 2))


@pytest.fixture
def flash_environment(monkeypatch):
    """transformers' own flash checks (package installed, GPU present) pass, so that only the families' decide."""
    monkeypatch.setattr(PreTrainedModel, "_flash_attn_can_dispatch", lambda self, *args, **kwargs: True)


@pytest.mark.parametrize("family", ["plm", "cola", "aurora", "cola-vae", "aurora-ae"])
def test_families_whose_masks_are_not_causal_refuse_flash_attention_by_name(tokenizer, family, flash_environment):
    model = build_fresh_model(family, "tiny", tokenizer)
    with pytest.raises(ValueError, match=rf"{type(model).__name__} cannot use flash_attention_2: .* 'flex_attention'"):
        model.set_attn_implementation("flash_attention_2")
    assert model.config._attn_implementation == "sdpa"
    for implementation in ("flex_attention", "eager", "sdpa"):
        model.set_attn_implementation(implementation)
        assert {m.config._attn_implementation for m in model.modules() if isinstance(m, PreTrainedModel)} == {
            implementation}


def test_from_pretrained_refuses_flash_attention_by_name(tokenizer, tmp_path):
    build_fresh_model("cola-vae", "tiny", tokenizer).save_pretrained(tmp_path)
    model_class = type(build_fresh_model("cola-vae", "tiny", tokenizer))
    with pytest.raises(ValueError, match="ColaTextVAE cannot use flash_attention_2"):
        model_class.from_pretrained(tmp_path, attn_implementation="flash_attention_2")
    assert model_class.from_pretrained(tmp_path, attn_implementation="flex_attention").config._attn_implementation == (
        "flex_attention")


def causal_padding_attention(module, query, key, value, attention_mask, scaling=None, is_causal=None, **kwargs):
    """flash attention's contract, on SDPA: causal (aligned on the last key when keys outnumber queries), padded keys
    hidden by a [batch, keys] mask, a query with no real key at all gives 0."""
    assert is_causal is True and (attention_mask is None or attention_mask.dim() == 2), attention_mask
    q_len, kv_len = query.shape[2], key.shape[2]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]
    if attention_mask is not None:
        visible = visible & attention_mask.bool()[:, None, None, :]
    has_key = visible.any(-1, keepdim=True)
    groups = module.num_key_value_groups
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                         attn_mask=visible | ~has_key, scale=scaling).masked_fill(~has_key, 0.0)
    return out.transpose(1, 2), None


def test_calm_takes_flash_attention_with_its_padding_mask(tokenizer, monkeypatch, flash_environment):
    """CALM's backbone masks are causal + padding: under flash attention it passes the chunk padding mask and the
    causal flag (checked here against flash's contract on SDPA), and the real positions match SDPA's, with left
    padding and over a cached prefix."""
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "flash_attention_2", causal_padding_attention)
    model = build_fresh_model("calm", "tiny", tokenizer).eval()
    chunk = model.config.chunk_size
    ids = torch.randint(5, 100, (2, 6 * chunk), generator=torch.Generator().manual_seed(5))
    padding = torch.ones_like(ids)
    padding[0, : 2 * chunk] = 0  # row 0: two chunks of left padding
    with torch.no_grad():
        expected = model.model(input_ids=ids, attention_mask=padding).last_hidden_state
        # set_attn_implementation would load a flash kernel here; the family's own check is what runs
        assert model.get_correct_attn_implementation("flash_attention_2") == "flash_attention_2"
        model.config._attn_implementation = "flash_attention_2"
        assert model.model.config._attn_implementation == "flash_attention_2"
        full = model.model(input_ids=ids, attention_mask=padding).last_hidden_state
        prefix = model.model(input_ids=ids[:, : 4 * chunk], attention_mask=padding[:, : 4 * chunk], use_cache=True)
        continued = model.model(input_ids=ids[:, 4 * chunk:], attention_mask=padding,
                                cache=prefix.cache).last_hidden_state
    torch.testing.assert_close(full[0, 2:], expected[0, 2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full[1], expected[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(continued, expected[:, 4:], atol=1e-5, rtol=1e-5)


def test_a_block_latent_family_gives_the_same_loss_under_flex_attention(tokenizer, uncompiled_flex):
    """Cola DLM's eval loss (its VAE's block-causal masks, the denoiser's dual-stream mask) under flex attention."""
    model = build_fresh_model("cola", "tiny", tokenizer).eval()
    ids = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss
        model.set_attn_implementation("flex_attention")
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, expected, atol=1e-5, rtol=1e-5)
