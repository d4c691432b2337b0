import pytest

from hf_latentlm.families import build_model
from hf_latentlm.presets import PRESETS, get_preset


def non_embedding_params(model) -> int:
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def test_ar_baseline_is_stock_llama_with_preset_dimensions(tokenizer):
    from transformers import LlamaForCausalLM

    model = build_model("ar", "tiny", tokenizer)
    assert type(model) is LlamaForCausalLM
    cfg, preset = model.config, PRESETS["tiny"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == \
        (64, 2, preset.num_heads, preset.num_kv_heads)
    assert cfg.vocab_size == len(tokenizer) and cfg.eos_token_id == tokenizer.eos_token_id


def test_small_preset_has_a_few_million_non_embedding_parameters(tokenizer):
    model = build_model("ar", "small", tokenizer)
    assert 2.5e6 < non_embedding_params(model) < 3.2e6
    assert 4.5e6 < sum(p.numel() for p in model.parameters()) < 5.5e6


def test_unknown_names_are_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="unknown preset 'xl'"):
        get_preset("xl")
    with pytest.raises(ValueError, match="unknown family 'rnn'"):
        build_model("rnn", "tiny", tokenizer)


def test_calm_matches_the_ar_backbone_and_its_head_is_about_a_tenth(tokenizer):
    ae = build_model("calm-ae", "small", tokenizer)
    assert (ae.config.chunk_size, ae.config.latent_size) == (4, 128)
    calm = build_model("calm", "small", tokenizer, autoencoder=ae)
    ar = build_model("ar", "small", tokenizer)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size"):
        assert getattr(calm.config, name) == getattr(ar.config, name), name
    assert calm.config.num_head_blocks == 1  # ⌈4 layers / 4⌉
    trainable = sum(p.numel() for p in calm.parameters() if p.requires_grad)
    head = sum(p.numel() for p in calm.energy_head.parameters())
    assert 0.05 < head / trainable < 0.15  # paper: the head is ≈10% of the model
