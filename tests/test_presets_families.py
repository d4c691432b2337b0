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


def test_preset_names_match_the_table_and_model_types_are_unique():
    from hf_latentlm.families import FAMILIES

    assert all(preset.name == name for name, preset in PRESETS.items())
    types = [spec.model_type for spec in FAMILIES.values() if spec.model_type]
    assert len(types) == len(set(types))


def test_a_derived_preset_keeps_the_family_settings_of_its_name(tokenizer):
    import dataclasses

    derived = dataclasses.replace(PRESETS["tiny"], seq_len=32)
    assert build_model("plm", derived, tokenizer).config.num_auxiliaries == 128  # tiny's CPU setting
    assert build_model("plm", dataclasses.replace(PRESETS["base"], hidden_size=96, num_layers=1,
                                                  intermediate_size=96), tokenizer).config.num_auxiliaries == 512
    anonymous = dataclasses.replace(PRESETS["tiny"], name="mine")
    with pytest.raises(ValueError, match="plm family has settings for presets .* not for 'mine'"):
        build_model("plm", anonymous, tokenizer)
    assert build_model("ar", anonymous, tokenizer).config.hidden_size == 64  # no scale-dependent settings


def test_components_of_the_wrong_kind_are_refused(tokenizer, tmp_path):
    from hf_latentlm.families import check_components

    with pytest.raises(ValueError, match="calm family needs a trained autoencoder: train one with `--family calm-ae`"):
        check_components("calm", {})
    with pytest.raises(ValueError, match="--autoencoder only applies to --family aurora, calm, not 'plm'"):
        check_components("plm", {"autoencoder": "x"})
    build_model("plm", "tiny", tokenizer).save_pretrained(tmp_path / "plm")
    with pytest.raises(ValueError, match="holds a 'plm' model, expected a 'calm_autoencoder'"):
        build_model("calm", "tiny", tokenizer, autoencoder=str(tmp_path / "plm"))
    # Right type, wrong weights: a file from another architecture saved under the autoencoder's config.
    ae = build_model("calm-ae", "tiny", tokenizer)
    ae.save_pretrained(tmp_path / "ae")
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "ae" / "model.safetensors")
    weights["stray.weight"] = weights.pop(next(iter(weights)))
    save_file(weights, tmp_path / "ae" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weights do not match CALMAutoencoder"):
        build_model("calm", "tiny", tokenizer, autoencoder=str(tmp_path / "ae"))
