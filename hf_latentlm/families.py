"""Family registry: how `hf-latentlm train --family NAME --preset P` builds a fresh model.

Each entry turns a preset plus a tokenizer into an untrained `PreTrainedModel` whose forward
returns `loss` (and, optionally, named 0-dim loss parts) for `input_ids`/`labels` batches, which
is all the shared training loop needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from .presets import Preset, get_preset


def backbone_config_kwargs(preset: Preset, tokenizer) -> dict:
    """Config fields shared by every family (Llama names): the preset's backbone and the tokenizer's ids."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rope_theta=preset.rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_ar_baseline(preset: Preset, tokenizer, **overrides) -> LlamaForCausalLM:
    """The matched autoregressive baseline: transformers' own `LlamaForCausalLM` with the
    preset's dimensions (RMSNorm, SwiGLU, RoPE, GQA — the same core as our families)."""
    return LlamaForCausalLM(LlamaConfig(**{**backbone_config_kwargs(preset, tokenizer), **overrides}))


# PLM settings that depend on scale. The paper's N_aux = 512 / M = 128 are the config defaults (used by
# `base`); on 2 CPU cores fitting them at every position costs 5.3 s per `small` step (4080 positions) vs
# 0.63 s for N_aux = 128 / M = 32 (`python scripts/time_voronoi.py`), so the CPU presets use the latter.
PLM_PRESET_OVERRIDES: dict[str, dict] = {
    "tiny": {"block_size": 4, "k_pred": 4, "num_auxiliaries": 128, "auxiliary_top_m": 32},
    "small": {"block_size": 8, "k_pred": 4, "num_auxiliaries": 128, "auxiliary_top_m": 32},
    "base": {"block_size": 16, "k_pred": 6},
}


def build_plm(preset: Preset, tokenizer, **overrides) -> PreTrainedModel:
    """Parallel Language Model on the same backbone dimensions as the AR baseline."""
    from .modeling import PLMConfig, PLMForCausalLM

    overrides = {**PLM_PRESET_OVERRIDES.get(_preset_name(preset), {}), **overrides}

    return PLMForCausalLM(PLMConfig(**{**backbone_config_kwargs(preset, tokenizer), **overrides}))


# CALM autoencoder sizes. `base` is the supplement's reference (hidden 512, intermediate 1280); `small` halves
# the width so an epoch of the embedded corpus takes minutes on 2 CPU cores. K = 4 and l = 128 throughout.
CALM_AUTOENCODER_PRESETS: dict[str, dict] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "latent_size": 32, "num_encoder_layers": 1,
             "num_decoder_layers": 1},
    "small": {"hidden_size": 256, "intermediate_size": 640, "latent_size": 128},
    "base": {"hidden_size": 512, "intermediate_size": 1280, "latent_size": 128},
}


def _preset_name(preset: Preset) -> str | None:
    from .presets import PRESETS

    return next((k for k, v in PRESETS.items() if v == preset), None)


def build_calm_autoencoder(preset: Preset, tokenizer, **overrides) -> PreTrainedModel:
    """CALM's chunk autoencoder (K tokens <-> one latent); its size comes from `CALM_AUTOENCODER_PRESETS`."""
    from .modeling import CALMAutoencoder, CALMAutoencoderConfig

    kwargs = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, **CALM_AUTOENCODER_PRESETS.get(_preset_name(preset), {}))
    return CALMAutoencoder(CALMAutoencoderConfig(**{**kwargs, **overrides}))


def build_calm(preset: Preset, tokenizer, autoencoder=None, **overrides) -> PreTrainedModel:
    """CALM on the preset's backbone around a trained autoencoder (a folder or a `CALMAutoencoder`), which is
    frozen and copied into the model."""
    from .modeling import CALMForCausalLM

    if autoencoder is None:
        raise ValueError("the calm family needs a trained autoencoder: train one with `--family calm-ae` and pass "
                         "its folder with --autoencoder DIR")
    if isinstance(autoencoder, str) and not (Path(autoencoder) / "config.json").is_file():
        raise FileNotFoundError(f"--autoencoder {autoencoder!r} is not a saved autoencoder folder (no config.json)")
    return CALMForCausalLM.from_autoencoder(autoencoder, **backbone_config_kwargs(preset, tokenizer), **overrides)


FAMILIES: dict[str, Callable[..., PreTrainedModel]] = {
    "ar": build_ar_baseline,
    "plm": build_plm,
    "calm-ae": build_calm_autoencoder,
    "calm": build_calm,
}

# Families whose models are language models (generate text); the others are components.
LANGUAGE_MODEL_FAMILIES = ("ar", "plm", "calm")


def build_model(family: str, preset: str | Preset, tokenizer, **overrides) -> PreTrainedModel:
    """A fresh model of `family` at `preset`; `overrides` go to the family's config."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    if isinstance(preset, str):
        preset = get_preset(preset)
    return FAMILIES[family](preset, tokenizer, **overrides)
