"""`PLMForCausalLM.from_causal_lm`: a PLM whose encoder is a given Llama-architecture causal LM at step 0 (this
package's `ar` family, or any `LlamaForCausalLM`), refusals of what the backbone cannot express, and exact
decoding that reproduces the source's greedy tokens."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_latentlm.families import build_model
from hf_latentlm.modeling import PLMForCausalLM

TINY_PLM = dict(block_size=4, k_pred=4, num_auxiliaries=64, auxiliary_top_m=16)


def llama(seed=0, **overrides) -> LlamaForCausalLM:
    """A small transformers Llama with GQA (4 query heads over 2 key/value heads)."""
    torch.manual_seed(seed)
    values = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
                  pad_token_id=2)
    return LlamaForCausalLM(LlamaConfig(**{**values, **overrides})).eval()


@pytest.fixture(params=["ar-tiny", "llama-untied", "llama-tied", "llama3-rope"])
def source(request, tokenizer):
    if request.param == "ar-tiny":
        torch.manual_seed(0)
        return build_model("ar", "tiny", tokenizer).eval()
    if request.param == "llama3-rope":  # a static RoPE scaling, which the backbone supports
        return llama(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 32})
    return llama(tie_word_embeddings=request.param == "llama-tied")


def left_padded_batch(vocab_size: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (3, 16), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, 2), mask


def source_logits(model, ids, mask):
    # Positions that count real tokens only, as transformers' generate() gives them (and as PLM derives them).
    return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits


def test_encoder_logits_equal_the_source_on_a_left_padded_batch(source):
    plm = PLMForCausalLM.from_causal_lm(source, **TINY_PLM).eval()
    ids, mask = left_padded_batch(source.config.vocab_size)
    with torch.no_grad():
        expected, got = source_logits(source, ids, mask), plm(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)
    # Tied where the source ties, separate copies where it does not.
    tied = source.config.tie_word_embeddings
    assert plm.config.tie_word_embeddings == tied
    assert (plm.lm_head.weight is plm.model.embed_tokens.weight) == tied
    assert plm.model.embed_tokens.weight.data_ptr() != source.model.embed_tokens.weight.data_ptr()  # a copy


def test_plm_parts_start_off_the_encoder_path_at_the_source_scale():
    source = llama()
    plm = PLMForCausalLM.from_causal_lm(source, **TINY_PLM)
    assert torch.equal(plm.alignment_proj.weight, torch.eye(64)) and not plm.alignment_proj.bias.any()
    scale = source.model.embed_tokens.weight.pow(2).mean().sqrt()
    aux = plm.model.embed_auxiliaries(torch.arange(64))
    assert 0.8 < aux.pow(2).mean().sqrt() / scale < 1.25
    assert plm.config.block_size == 4 and plm.config.vocab_size == 320 and plm.config.num_key_value_heads == 2


def test_from_a_saved_folder(tmp_path, tokenizer):
    torch.manual_seed(0)
    source = build_model("ar", "tiny", tokenizer).eval()
    source.save_pretrained(tmp_path / "ar")
    plm = PLMForCausalLM.from_causal_lm(tmp_path / "ar", **TINY_PLM).eval()
    ids, mask = left_padded_batch(source.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(plm(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                                   source_logits(source, ids, mask)[mask.bool()], atol=1e-5, rtol=0)
    assert plm.dtype == torch.float32


def test_exact_generate_gives_the_source_greedy_tokens_at_step_0():
    source = llama(seed=3)
    plm = PLMForCausalLM.from_causal_lm(source, **TINY_PLM).eval()
    ids, mask = left_padded_batch(320, seed=4)
    ids, mask = ids[:2, :10], mask[:2, :10]
    expected = source.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=2)
    got = plm.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, acceptance="exact",
                       eos_token_id=None, pad_token_id=2)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("field,value", [
    ("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu"), ("attention_dropout", 0.1),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
])
def test_what_the_backbone_cannot_express_is_refused_by_field_name(field, value):
    source = llama(**{field: value})
    with pytest.raises(ValueError, match=field) as err:
        PLMForCausalLM.from_causal_lm(source, **TINY_PLM)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field,value", [("sliding_window", 64), ("use_qk_norm", True),
                                         ("layer_types", ["sliding_attention"] * 3)])
def test_attention_variants_a_llama_config_may_carry_are_refused(field, value):
    source = llama()
    setattr(source.config, field, value)
    with pytest.raises(ValueError, match=field):
        PLMForCausalLM.from_causal_lm(source, **TINY_PLM)


def test_other_sources_and_backbone_overrides_are_refused(tokenizer):
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        PLMForCausalLM.from_causal_lm(build_model("plm", "tiny", tokenizer, **TINY_PLM))
    with pytest.raises(ValueError, match="hidden_size"):
        PLMForCausalLM.from_causal_lm(llama(), hidden_size=128)
