"""The official CALM checkpoints (shaochenze/calm: `Autoencoder`, `EnergyTransformer`) as `CALMForCausalLM`.

The official modules map one to one onto ours in their official form: the autoencoder with biases on its
squeeze/expand/latent projections, no log σ clamp and its blocks split around the squeeze; the backbone as is
(Llama); the input compression closed by a LayerNorm(1e-6); the energy head as our "reference" head with
LayerNorm(1e-6). This module maps configs and tensors, and checks the result against the official outputs.
"""

from __future__ import annotations

import re

import torch

from ..modeling.configuration_calm import CALMAutoencoderConfig, CALMConfig
from ..modeling.modeling_calm import CALMForCausalLM, ReplayedDraws

#: Our fields that give the official modules (the rest of a config maps field by field).
OFFICIAL_AUTOENCODER_FORM = {"stage_layout": "split", "projection_bias": True, "log_std_min": None,
                             "log_std_max": None, "replace_token_id": 0, "embedding_init_std": 0.02}
OFFICIAL_CALM_FORM = {"energy_head_type": "reference", "input_norm": "layer", "layer_norm_eps": 1e-6,
                      "num_target_samples": 100}
#: The official `generate()` defaults: approximate temperature sampling at T = 1/2 from a pool of 200 draws.
OFFICIAL_SAMPLING = {"generation_temperature": 0.5, "temperature_sampler": "pool", "temperature_pool_size": 200}

# Official config fields read by the mapping below, and transformers-4 bookkeeping that means nothing here; any
# other field is ignored with a note.
READ_FIELDS = {
    "vocab_size", "patch_size", "latent_size", "hidden_size", "intermediate_size", "num_encoder_layers",
    "num_decoder_layers", "kl_weight", "kl_clamp", "ae_dropout", "rms_norm_eps", "initializer_range", "bos_token_id",
    "eos_token_id", "pad_token_id", "hidden_act", "mlp_bias", "attention_bias", "tie_word_embeddings",
    "max_position_embeddings", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rope_theta",
    "rope_scaling", "noise_size", "num_mlp_layers", "num_samples", "beta", "ae_path", "ae_model_config_from_tensors"}
BOOKKEEPING = {"architectures", "torch_dtype", "transformers_version", "model_type", "_name_or_path", "use_cache",
               "pretraining_tp", "attention_dropout", "_from_model_config"}


def _require(config: dict, required: dict, label: str) -> None:
    """ValueError naming the first field of `required` ({field: allowed values}) whose value is not allowed (a
    missing field has the first allowed value)."""
    for field, allowed in required.items():
        value = config.get(field, allowed[0])
        if value not in allowed:
            raise ValueError(f"{label}.{field} = {value!r} is not supported (supported: {list(allowed)})")


def autoencoder_config_from_official(official: dict) -> tuple[CALMAutoencoderConfig, list[str]]:
    """The official `AutoencoderConfig` fields -> (`CALMAutoencoderConfig` in the official form, notes)."""
    label = "the official autoencoder config"
    # (tie_word_embeddings: its output layer is tied by construction instead)
    _require(official, {"hidden_act": ("silu",), "mlp_bias": (False,), "tie_word_embeddings": (False,)}, label)
    for field in ("num_encoder_layers", "num_decoder_layers"):
        if official[field] % 2:
            raise ValueError(f"{label}.{field} = {official[field]} is odd: the official code runs {field} // 2 "
                             f"blocks per stage and never uses the last one; such a checkpoint is not supported")
    config = CALMAutoencoderConfig(
        vocab_size=official["vocab_size"], chunk_size=official["patch_size"], latent_size=official["latent_size"],
        hidden_size=official["hidden_size"], intermediate_size=official["intermediate_size"],
        num_encoder_layers=official["num_encoder_layers"], num_decoder_layers=official["num_decoder_layers"],
        kl_weight=official.get("kl_weight", 1e-3), kl_clamp=official.get("kl_clamp", 0.5),
        token_replace_prob=official.get("ae_dropout", 0.15), latent_dropout=official.get("ae_dropout", 0.15),
        rms_norm_eps=official["rms_norm_eps"], initializer_range=official.get("initializer_range", 0.02),
        bos_token_id=official.get("bos_token_id"), eos_token_id=official.get("eos_token_id"),
        pad_token_id=official.get("pad_token_id"), **OFFICIAL_AUTOENCODER_FORM)
    return config, _notes(official, config)


def calm_config_from_official(official: dict, autoencoder: CALMAutoencoderConfig, **overrides) -> tuple[CALMConfig,
                                                                                                        list[str]]:
    """The official `CALMConfig` fields and the autoencoder's config -> (`CALMConfig` in the official form, notes)."""
    label = "the official CALM config"
    # (beta: our energy loss is the α = 1 energy score)
    _require(official, {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
                        "tie_word_embeddings": (False,), "beta": (1, 1.0)}, label)
    autoencoder_fields = {"patch_size": autoencoder.chunk_size, "vocab_size": autoencoder.vocab_size,
                          "latent_size": autoencoder.latent_size}
    for field, theirs in autoencoder_fields.items():
        if official[field] != theirs:
            raise ValueError(f"{label}.{field} = {official[field]} disagrees with its autoencoder's ({theirs})")
    rope = {"rope_type": "default", "rope_theta": float(official.get("rope_theta", 10000.0))}
    if official.get("rope_scaling"):
        scaling = dict(official["rope_scaling"])
        rope.update(scaling, rope_type=scaling.pop("rope_type", scaling.pop("type", "default")))
    fields = dict(
        vocab_size=official["vocab_size"], hidden_size=official["hidden_size"],
        intermediate_size=official["intermediate_size"], num_hidden_layers=official["num_hidden_layers"],
        num_attention_heads=official["num_attention_heads"],
        num_key_value_heads=official.get("num_key_value_heads") or official["num_attention_heads"],
        max_position_embeddings=official.get("max_position_embeddings", 2048) * official["patch_size"],
        rms_norm_eps=official["rms_norm_eps"], rope_parameters=rope, chunk_size=official["patch_size"],
        noise_size=official["noise_size"], num_head_blocks=official["num_mlp_layers"],
        num_model_samples=official.get("num_samples", 8), initializer_range=official.get("initializer_range", 0.02),
        bos_token_id=official.get("bos_token_id"), eos_token_id=official.get("eos_token_id"),
        pad_token_id=official.get("pad_token_id"), autoencoder_config=autoencoder.to_dict(),
        **OFFICIAL_CALM_FORM, **OFFICIAL_SAMPLING)
    fields.update(overrides)
    config = CALMConfig(**fields)
    return config, _notes(official, config)


def _notes(official: dict, config) -> list[str]:
    notes = [f"ignored {field} = {official[field]!r} (no counterpart here)"
             for field in sorted(set(official) - READ_FIELDS - BOOKKEEPING)]
    if "ae_path" in official:
        notes.append(f"ignored ae_path = {official['ae_path']!r} (the autoencoder's weights are inside the "
                     f"converted checkpoint)")
    if "max_position_embeddings" in official and isinstance(config, CALMConfig):
        notes.append(f"max_position_embeddings = {official['max_position_embeddings']} chunks is "
                     f"{config.max_position_embeddings} tokens here (this package counts tokens)")
    return notes


# Official name pattern -> ours. The autoencoder's blocks are numbered across both stages there, per stage here.
_AUTOENCODER_KEYS = [
    (r"encoder\.embed_tokens\.weight", "embed_tokens.weight"),
    (r"encoder\.squeeze_layer\.(weight|bias)", r"encoder_squeeze.\1"),
    (r"encoder\.norm\.weight", "encoder_norm.weight"),
    (r"encoder\.hidden_to_latent\.(weight|bias)", r"to_posterior.\1"),
    (r"decoder\.latent_to_hidden\.(weight|bias)", r"decoder_in.\1"),
    (r"decoder\.expand_layer\.(weight|bias)", r"decoder_expand.\1"),
    (r"decoder\.norm\.weight", "decoder_norm.weight"),
]
_CALM_KEYS = [
    (r"transformer\.(embed_tokens\.weight|norm\.weight|layers\..*)", r"model.\1"),
    (r"embed_proj\.0\.(weight|bias)", r"model.compress_in.\1"),
    (r"embed_proj\.2\.(weight|bias)", r"model.compress_out.\1"),
    (r"embed_proj\.3\.(weight|bias)", r"model.compress_norm.\1"),
    (r"mlp_generator\.noise_embd\.(weight|bias)", r"energy_head.noise_proj.\1"),
    (r"mlp_generator\.hidden_embd\.(weight|bias)", r"energy_head.hidden_proj.\1"),
    (r"mlp_generator\.norm_noise\.(weight|bias)", r"energy_head.noise_norm.\1"),
    (r"mlp_generator\.norm_hidden\.(weight|bias)", r"energy_head.hidden_norm.\1"),
    (r"mlp_generator\.mlp_blocks\.(\d+)\.in_ln\.(weight|bias)", r"energy_head.blocks.\1.norm.\2"),
    (r"mlp_generator\.mlp_blocks\.(\d+)\.linears\.0\.(weight|bias)", r"energy_head.blocks.\1.fuse.\2"),
    (r"mlp_generator\.mlp_blocks\.(\d+)\.linears\.2\.(weight|bias)", r"energy_head.blocks.\1.inner.\2"),
    (r"mlp_generator\.mlp_blocks\.(\d+)\.linears\.4\.(weight|bias)", r"energy_head.blocks.\1.gate_up.\2"),
    (r"mlp_generator\.mlp_blocks\.(\d+)\.down_proj\.(weight|bias)", r"energy_head.blocks.\1.down.\2"),
    (r"mlp_generator\.final_layer\.in_ln\.(weight|bias)", r"energy_head.final_norm.\1"),
    (r"mlp_generator\.final_layer\.linears\.0\.(weight|bias)", r"energy_head.final_proj.\1"),
    (r"mlp_generator\.final_layer\.linears\.2\.(weight|bias)", r"energy_head.out.\1"),
]


def _autoencoder_name(name: str, config: CALMAutoencoderConfig) -> str | None:
    for pattern, ours in _AUTOENCODER_KEYS:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, ours, name)
    block = re.fullmatch(r"(encoder|decoder)\.\1_layers\.(\d+)\.(mlp\.(?:gate|up|down)_proj\.weight|layernorm\.weight)",
                         name)
    if block is None:
        return None
    side, index, rest = block.group(1), int(block.group(2)), block.group(3).replace("layernorm", "norm")
    first = getattr(config, f"num_{side}_layers") // 2
    # Encoder: per-token blocks, then per-chunk ones; the decoder the other way round.
    stages = ("token", "chunk") if side == "encoder" else ("chunk", "token")
    stage, index = (stages[0], index) if index < first else (stages[1], index - first)
    return f"{side}_{stage}_layers.{index}.{rest}"


def _drop_alias(state: dict, alias: str, original: str, label: str) -> None:
    """Remove `alias`, which the official code writes as a second name of `original`; refuse it if they differ."""
    if alias in state:
        if original not in state or not torch.equal(state[alias], state[original]):
            raise ValueError(f"{label}: {alias} should be the same tensor as {original} (the official model ties "
                             f"them) but differs")
        del state[alias]


def autoencoder_state_dict_from_official(state: dict, config: CALMAutoencoderConfig,
                                         label: str = "the official autoencoder") -> dict[str, torch.Tensor]:
    """The official `Autoencoder` tensors (keys `encoder.*`, `decoder.*`) -> `CALMAutoencoder.state_dict()` keys."""
    state = dict(state)
    _drop_alias(state, "decoder.lm_head_weight", "encoder.embed_tokens.weight", label)
    out = {}
    for name, tensor in state.items():
        ours = _autoencoder_name(name, config)
        if ours is None:
            raise ValueError(f"{label}: unexpected tensor {name} {tuple(tensor.shape)}")
        out[ours] = tensor
    return out


def calm_state_dict_from_official(state: dict, config: CALMConfig, autoencoder_state: dict | None = None,
                                  label: str = "the official CALM checkpoint") -> dict[str, torch.Tensor]:
    """The official `EnergyTransformer` tensors -> `CALMForCausalLM.state_dict()` keys. The autoencoder comes from
    the checkpoint's own `ae_model.*` tensors or, when it has none, from `autoencoder_state` (the official
    autoencoder's own file); both at once must agree."""
    state = dict(state)
    for name in [n for n in state if n.startswith("generative_head.")]:
        _drop_alias(state, name, "mlp_generator." + name[len("generative_head."):], label)
    inside = {n[len("ae_model."):]: state.pop(n) for n in [n for n in state if n.startswith("ae_model.")]}
    if not inside and autoencoder_state is None:
        raise ValueError(f"{label} holds no ae_model.* tensors: pass the official autoencoder too (--autoencoder)")
    if inside and autoencoder_state is not None:
        for name, tensor in autoencoder_state.items():
            if name in inside and not torch.equal(inside[name], tensor):
                raise ValueError(f"{label}: ae_model.{name} differs from the given autoencoder's {name}")
    out = {"autoencoder." + k: v for k, v in autoencoder_state_dict_from_official(
        inside or autoencoder_state, config.autoencoder_config).items()}
    for name, tensor in state.items():
        for pattern, ours in _CALM_KEYS:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, ours, name)] = tensor
                break
        else:
            raise ValueError(f"{label}: unexpected tensor {name} {tuple(tensor.shape)}")
    return out


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], label: str) -> None:
    """Copy `state` into `model`; a missing, extra or mis-shaped tensor is an error naming it."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{label}: " + "; ".join(part for part in (
            f"missing tensor(s) {missing[:5]}" if missing else "", f"unexpected tensor(s) {extra[:5]}" if extra else "")
            if part))
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{label}: tensor for {name} has shape {tuple(tensor.shape)}, the config gives "
                             f"{tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


def calm_from_official(official_config: dict, state: dict, autoencoder_config: dict | None = None,
                       autoencoder_state: dict | None = None, **overrides) -> tuple[CALMForCausalLM, list[str]]:
    """An official CALM (its config.json as a dict and its tensors; the autoencoder's when the checkpoint has no
    `ae_model.*`) -> (`CALMForCausalLM` in fp32, eval mode; notes on fields that did not carry over)."""
    if autoencoder_config is None:
        if not any(n.startswith("ae_model.") for n in state):
            raise ValueError("the official CALM checkpoint holds no ae_model.* tensors: pass the official "
                             "autoencoder too (--autoencoder)")
        autoencoder_config = _autoencoder_config_from_tensors(state, official_config)
    ae_config, ae_notes = autoencoder_config_from_official(autoencoder_config)
    if "ae_model_config_from_tensors" in autoencoder_config:
        ae_notes.append("the autoencoder's config was read off its ae_model.* tensors, with the official default "
                        "rms_norm_eps = 1e-6 (not in the tensors); pass --autoencoder to use its own config.json")
    config, notes = calm_config_from_official(official_config, ae_config, **overrides)
    model = CALMForCausalLM(config).float().eval()
    load_into(model, calm_state_dict_from_official(state, config, autoencoder_state), "the official CALM checkpoint")
    return model, ae_notes + notes


def _autoencoder_config_from_tensors(state: dict, official_config: dict) -> dict:
    """The autoencoder's config read off its `ae_model.*` tensor shapes, for a checkpoint whose autoencoder folder
    (`ae_path`) is not at hand. rms_norm_eps is not in the tensors: the official default, 1e-6."""
    def shape(name):
        return tuple(state["ae_model." + name].shape)

    def count(side):
        return len({m.group(1) for n in state if (m := re.match(rf"ae_model\.{side}\.{side}_layers\.(\d+)\.", n))})

    vocab, hidden = shape("encoder.embed_tokens.weight")
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": shape(
        "encoder.encoder_layers.0.mlp.gate_proj.weight")[0], "latent_size": shape("decoder.latent_to_hidden.weight")[1],
        "patch_size": shape("encoder.squeeze_layer.weight")[1] // hidden, "num_encoder_layers": count("encoder"),
        "num_decoder_layers": count("decoder"), "rms_norm_eps": 1e-6, "ae_model_config_from_tensors": True,
        "bos_token_id": official_config.get("bos_token_id"), "eos_token_id": official_config.get("eos_token_id"),
        "pad_token_id": official_config.get("pad_token_id")}


# ---------------------------------------------------------------------------------------------------------------------
# Paper sizes
# ---------------------------------------------------------------------------------------------------------------------

# The official configs of the published checkpoints, as the official training scripts write them: the config
# class's defaults, the scripts' `--config_overrides`, and the tokenizer's ids and size (Llama 3: 128,256 entries,
# no pad token). CALM-L and CALM-XL are published without their configs in the code; convert their folders instead.
LLAMA3_TOKENS = {"vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": None}
OFFICIAL_AUTOENCODER_CONFIG = {
    "patch_size": 4, "latent_size": 128, "hidden_size": 512, "intermediate_size": 1280, "num_encoder_layers": 2,
    "num_decoder_layers": 2, "kl_weight": 1e-3, "kl_clamp": 0.5, "ae_dropout": 0.15, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "mlp_bias": False, "tie_word_embeddings": False, **LLAMA3_TOKENS}
OFFICIAL_CALM_CONFIGS = {
    "calm-m": {"patch_size": 4, "latent_size": 128, "num_mlp_layers": 4, "noise_size": 64, "num_samples": 8,
               "beta": 1.0, "hidden_size": 1024, "intermediate_size": 2752, "num_hidden_layers": 16,
               "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 2048,
               "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False,
               "mlp_bias": False, "tie_word_embeddings": False, **LLAMA3_TOKENS},
}


def official_calm_config(name: str) -> CALMConfig:
    """The `CALMConfig` (official form, with its autoencoder's config) of a published CALM size, for a model with
    fresh weights at that size (`CALMForCausalLM(official_calm_config("calm-m"))`)."""
    if name not in OFFICIAL_CALM_CONFIGS:
        raise ValueError(f"unknown official CALM size {name!r}; known: {sorted(OFFICIAL_CALM_CONFIGS)} (convert a "
                         f"published folder for the others: hf-latentlm convert calm --model ...)")
    autoencoder, _ = autoencoder_config_from_official(OFFICIAL_AUTOENCODER_CONFIG)
    config, _ = calm_config_from_official(OFFICIAL_CALM_CONFIGS[name], autoencoder)
    return config


# ---------------------------------------------------------------------------------------------------------------------
# Parity with the official outputs
# ---------------------------------------------------------------------------------------------------------------------

def _max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    if ours.shape != theirs.shape:
        raise ValueError(f"shape {tuple(ours.shape)} against the reference's {tuple(theirs.shape)}")
    return (ours.double() - theirs.double()).abs().max().item()


@torch.no_grad()
def calm_parity(model: CALMForCausalLM, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each quantity the reference file holds, computed by `model` from the reference's inputs: {name: max |ours −
    official|}. Keys as in ../shared/reference/calm/reference_outputs.safetensors (any sizes), plus the energy loss
    and `generate()` records that scripts/checks/official_reference_calm.py writes."""
    model = model.float().eval()
    ids = reference["input_ids"].long()
    chunks = ids.view(ids.shape[0], -1, model.config.chunk_size)
    diffs = {}
    mean, log_std = model.autoencoder.encode(chunks)
    diffs["ae_mean"] = _max_diff(mean, reference["ae_mean"])
    diffs["ae_log_std"] = _max_diff(log_std, reference["ae_log_std"])
    logits = model.autoencoder.decode_logits(reference["ae_z"])
    diffs["ae_logits"] = _max_diff(logits.flatten(1, 2), reference["ae_logits"])
    hidden = model(input_ids=ids).last_hidden_state
    diffs["calm_hidden"] = _max_diff(hidden, reference["calm_hidden"])
    noise = reference["head_noise"]
    samples = model.sample_latents(reference["calm_hidden"], noise)
    diffs["head_samples"] = _max_diff(samples, reference["head_samples"])
    if "energy_loss" in reference:  # the official energy score with recorded draws, on input_ids' chunks
        diffs["energy_loss"] = _max_diff(_energy_loss(model, ids, reference), reference["energy_loss"])
    for name in sorted(k[:-len("_tokens")] for k in reference if k.startswith("generate_") and k.endswith("_tokens")):
        diffs[f"{name}_tokens"] = _generate_difference(model, reference, name)
    return diffs


def _energy_loss(model: CALMForCausalLM, ids: torch.Tensor, reference: dict) -> torch.Tensor:
    """The official training loss: every chunk after the first is a target, predicted from the hidden state of the
    chunk before; the loss is the mean over those steps."""
    hidden = model(input_ids=ids[:, :-model.config.chunk_size]).last_hidden_state
    targets = ids[:, model.config.chunk_size:].reshape(ids.shape[0], -1, model.config.chunk_size)
    # Recorded in the official layout: model noise [N, steps, d_noise], target noise [M, steps, l] over the
    # flattened (row, step) pairs.
    batch, steps = targets.shape[:2]
    model_noise = reference["energy_model_noise"].permute(1, 0, 2).reshape(batch, steps, -1, model.config.noise_size)
    target_noise = reference["energy_target_noise"].permute(1, 0, 2).reshape(batch, steps, -1,
                                                                            model.config.latent_size)
    loss, _, _ = model.energy_terms(hidden, targets, target_noise, model_noise - 0.5)
    return loss.mean()


def _generate_difference(model: CALMForCausalLM, reference: dict, name: str) -> float:
    """`generate()` with the official run's recorded draws: 0 when every token agrees, else the number of tokens that
    differ (compared up to each row's first EOS, after which the official code pads)."""
    prompt = reference[f"{name}_prompt"].long()
    official = reference[f"{name}_tokens"].long()
    temperature = reference[f"{name}_temperature"].item()
    draws = ReplayedDraws([reference[k] for k in sorted(
        (k for k in reference if k.startswith(f"{name}_draw_")), key=lambda k: int(k.rsplit("_", 1)[1]))])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=official.shape[1],
                         temperature=temperature, do_sample=True, draws=draws, eos_token_id=None,
                         pad_token_id=model.config.pad_token_id)
    ours = out[:, prompt.shape[1]:]
    differing = 0
    eos = model.config.eos_token_id
    for row_ours, row_official in zip(ours.tolist(), official.tolist()):
        stop = row_official.index(eos) + 1 if eos in row_official else len(row_official)
        differing += sum(a != b for a, b in zip(row_ours[:stop], row_official[:stop]))
    return float(differing)


__all__ = ["OFFICIAL_AUTOENCODER_FORM", "OFFICIAL_CALM_FORM", "OFFICIAL_SAMPLING", "autoencoder_config_from_official",
           "autoencoder_state_dict_from_official", "calm_config_from_official", "calm_from_official", "calm_parity",
           "calm_state_dict_from_official", "load_into", "official_calm_config", "OFFICIAL_CALM_CONFIGS"]
