"""The official Cola DLM checkpoints (ByteDance-Seed/Cola-DLM: `ColaTextVAEModel`, `ColaDiTModel`) as
`ColaForCausalLM`. Both official modules map one to one onto ours in their official form (`architecture="official"`
of the VAE, `dit_architecture="official"` of the DiT; see their config docstrings). This module maps configs and
tensors, and checks the result against the official outputs.
"""

from __future__ import annotations

import re

import torch

from ..modeling.configuration_cola import ColaConfig, ColaVAEConfig
from ..modeling.modeling_cola import ColaForCausalLM
from .calm import _max_diff, _require, load_into

#: The official `generate_task_repaint_inference` defaults the papers' numbers use: greedy read-out, CFG 7, 16 Euler
#: steps per block.
OFFICIAL_SAMPLING = {"cfg_scale": 7.0, "num_inference_steps": 16, "decode_temperature": 0.0}
#: Fields of the converted folder's generation config: the official inference's repetition penalty.
OFFICIAL_GENERATION = {"repetition_penalty": 1.1}
#: The official DiT training (scripts/cola_pretrain.py) keeps the VAE frozen and drops no history.
OFFICIAL_TRAINING = {"vae_learning_rate_ratio": 0.0, "history_dropout": 0.0, "prompt_block_prob": 0.05}

# Official fields whose value must be the one our official form computes (value -> allowed values).
_VAE_REQUIRED = {"patch_size": (1,), "layer_norm_type": ("layer_norm",), "layer_norm_affine": (True,),
                 "post_norm": (True,), "qk_norm": (True,), "qk_norm_affine": (True,), "clip_qkv": (None,),
                 "bias": (True,), "act": ("swiglu",), "causal": (False,), "block_causal": (True,),
                 "use_variation": (True,), "use_emb": (True,), "encoder_last_ln": (True,)}
_DIT_REQUIRED = {"patch_size": (1,), "qk_bias": (False,)}
# Official fields read by the mapping, and fields that mean nothing at inference (initialisation, dropout,
# transformers-4 bookkeeping); any other field is ignored with a note.
_VAE_READ = {"vocab_size", "encoder_num_blocks", "decoder_num_blocks", "dim", "ffn_dim", "latent_dim", "num_heads",
             "shared_heads_kv", "layer_norm_eps", "qk_bias", "rope_theta", "block_size", "scaling_factor",
             "shifting_factor", "init_std", "bos_token_id", "eos_token_id", "pad_token_id", *_VAE_REQUIRED}
_DIT_READ = {"txt_in_channels", "txt_out_channels", "txt_dim", "emb_dim", "heads", "head_dim", "expand_ratio",
             "num_layers", "norm_eps", "rope_dim", "block_size", *_DIT_REQUIRED}
_UNUSED = {"architectures", "torch_dtype", "transformers_version", "model_type", "_name_or_path", "dropout",
           "attn_dropout", "init_fn", "init_cutoff_factor", "rope_full_precision", "_from_model_config"}
#: The official DiT's RoPE base (fixed in its code, not a config field).
DIT_ROPE_THETA = 10000.0


def cola_config_from_official(vae: dict, dit: dict, **overrides) -> tuple[ColaConfig, list[str]]:
    """The official VAE and DiT config.json fields -> (`ColaConfig` in the official form, notes on fields that did
    not carry over)."""
    _require(vae, _VAE_REQUIRED, "the official VAE config")
    _require(dit, _DIT_REQUIRED, "the official DiT config")
    heads, shared = vae["num_heads"], vae.get("shared_heads_kv", 1)
    # The official attention broadcasts k/v heads against q heads: only 1 or all heads per k/v head run there.
    if shared not in (1, heads):
        raise ValueError(f"the official VAE config's shared_heads_kv = {shared} is neither 1 nor num_heads = {heads}: "
                         f"the official code cannot run it")
    if vae["ffn_dim"] % 2:
        raise ValueError(f"the official VAE config's ffn_dim = {vae['ffn_dim']} is odd (its SwiGLU halves it)")
    if dit["emb_dim"] != dit["txt_dim"]:
        raise ValueError(f"the official DiT config's emb_dim = {dit['emb_dim']} differs from txt_dim = "
                         f"{dit['txt_dim']}: the official adaLN layers take txt_dim inputs, so it cannot run")
    for field in ("txt_in_channels", "txt_out_channels"):
        if dit[field] != vae["latent_dim"]:
            raise ValueError(f"the official DiT config's {field} = {dit[field]} disagrees with the VAE's latent_dim "
                             f"= {vae['latent_dim']}")
    if dit["block_size"] % vae["block_size"]:
        raise ValueError(f"the official DiT block_size = {dit['block_size']} is not a multiple of the VAE's "
                         f"block_size = {vae['block_size']}")
    ids = {name: vae.get(name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    vae_config = ColaVAEConfig(
        vocab_size=vae["vocab_size"], hidden_size=vae["dim"], intermediate_size=vae["ffn_dim"] // 2,
        num_hidden_layers=vae["encoder_num_blocks"], num_decoder_layers=vae["decoder_num_blocks"],
        num_attention_heads=heads, num_key_value_heads=heads // shared, head_dim=vae["dim"] // heads,
        latent_size=vae["latent_dim"], vae_block_size=vae["block_size"], rms_norm_eps=vae["layer_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": float(vae.get("rope_theta", 500000))},
        max_position_embeddings=8192, initializer_range=vae.get("init_std", 0.02), qkv_bias=vae.get("qk_bias", False),
        latent_scaling_factor=vae.get("scaling_factor", 1.0), latent_shifting_factor=vae.get("shifting_factor", 0.0),
        architecture="official", **ids)
    fields = dict(
        vocab_size=vae["vocab_size"], hidden_size=dit["txt_dim"],
        intermediate_size=dit["txt_dim"] * dit["expand_ratio"],
        num_hidden_layers=dit["num_layers"], num_attention_heads=dit["heads"], num_key_value_heads=dit["heads"],
        head_dim=dit["head_dim"], rms_norm_eps=dit["norm_eps"], max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": DIT_ROPE_THETA}, rope_dim=dit["rope_dim"],
        block_size=dit["block_size"], dit_architecture="official", attention_dtype="bfloat16",
        vae_config=vae_config.to_dict(), **ids, **OFFICIAL_SAMPLING, **OFFICIAL_TRAINING)
    fields.update(overrides)
    config = ColaConfig(**fields)
    notes = [f"ignored VAE field {field} = {vae[field]!r} (no counterpart here)"
             for field in sorted(set(vae) - _VAE_READ - _UNUSED)]
    notes += [f"ignored DiT field {field} = {dit[field]!r} (no counterpart here)"
              for field in sorted(set(dit) - _DIT_READ - _UNUSED)]
    return config, notes


def cola_conversion_notes(config: ColaConfig) -> list[str]:
    """Where the converted model's defaults come from, for its model card."""
    return [f"generation defaults of the official inference: greedy read-out, guidance scale {config.cfg_scale}, "
            f"{config.num_inference_steps} Euler steps per block, repetition penalty "
            f"{OFFICIAL_GENERATION['repetition_penalty']} over the tokens read out so far (generation_config.json)",
            "the DiT's attention runs under bfloat16 autocast (attention_dtype='bfloat16'), as the official code runs "
            "it on every device; set attention_dtype=None for float32 attention",
            "training defaults follow the official DiT training: the VAE frozen (vae_learning_rate_ratio=0), no "
            "history dropout"]


# Official name -> ours (re patterns). VAE blocks: `{side}.blocks.i.*` -> `model.vae.{side}.layers.i.*`.
_VAE_BLOCK_KEYS = {"norm_attn": "attention_norm", "norm_ffn": "mlp_norm", "q_norm": "self_attn.q_norm",
                   "k_norm": "self_attn.k_norm", "attn_out_proj": "self_attn.o_proj", "ffn_out": "mlp.down_proj"}
_VAE_KEYS = {"encoder.wte.weight": "encoder.embed_tokens.weight", "encoder.final_layer": "encoder.to_latent",
             "encoder.patch_embedder": "encoder.patch_in", "decoder.in_layer": "decoder.latent_in",
             "decoder.unpatch_layer": "decoder.patch_out", "decoder.final_norm": "decoder.norm",
             "decoder.final_layer": "decoder.lm_head"}
_DIT_KEYS = {"txt_in.proj": "model.latent_in", "emb_in.proj_in": "model.time_embedding.linear_1",
             "emb_in.proj_hid": "model.time_embedding.linear_2", "emb_in.proj_out": "model.time_embedding.linear_3",
             "txt_out_norm": "model.norm", "txt_out_ada.out_in.1": "velocity_head.modulation.1",
             "txt_out.proj": "velocity_head.proj"}
_DIT_BLOCK_KEYS = {"msa.proj_out": "self_attn.o_proj", "msa.norm_q": "self_attn.q_norm",
                   "msa.norm_k": "self_attn.k_norm", "mlp.proj_in": "mlp.proj_in", "mlp.proj_out": "mlp.proj_out"}
# The official adaLN layers, in the row order of our one modulation layer.
_ADA_ORDER = ("msa_in", "msa_out", "mlp_in", "mlp_out")


def _split(name: str, tensor: torch.Tensor, sizes: list[int], label: str) -> tuple[torch.Tensor, ...]:
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"{label}: tensor {name} has shape {tuple(tensor.shape)}, the config gives {sum(sizes)} rows")
    return tensor.split(sizes)


def _vae_state(state: dict, config: ColaVAEConfig, label: str) -> dict[str, torch.Tensor]:
    out = {}
    q_size, kv_size = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    for name, tensor in state.items():
        parts = name.rsplit(".", 1)
        block = re.fullmatch(r"(encoder|decoder)\.blocks\.(\d+)\.(\w+)\.(weight|bias)", name)
        if block:
            side, index, module, kind = block.groups()
            prefix = f"{side}.layers.{index}."
            if module == "qkv_proj":
                for proj, piece in zip("qkv", _split(name, tensor, [q_size, kv_size, kv_size], label)):
                    out[f"{prefix}self_attn.{proj}_proj.{kind}"] = piece
            elif module == "ffn_proj":  # fused [up; gate]: the official SwiGLU multiplies silu(second half)
                up, gate = _split(name, tensor, [config.intermediate_size] * 2, label)
                out[f"{prefix}mlp.up_proj.{kind}"], out[f"{prefix}mlp.gate_proj.{kind}"] = up, gate
            elif module in _VAE_BLOCK_KEYS:
                out[f"{prefix}{_VAE_BLOCK_KEYS[module]}.{kind}"] = tensor
            else:
                raise ValueError(f"{label}: unexpected tensor {name} {tuple(tensor.shape)}")
        elif name in _VAE_KEYS:
            out[_VAE_KEYS[name]] = tensor
        elif parts[0] in _VAE_KEYS and parts[1] in ("weight", "bias"):
            # The patch embedding is a Conv1d of kernel 1 (patch size 1): a linear map.
            out[f"{_VAE_KEYS[parts[0]]}.{parts[1]}"] = tensor.squeeze(-1) if parts[0].endswith("embedder") else tensor
        else:
            raise ValueError(f"{label}: unexpected tensor {name} {tuple(tensor.shape)}")
    return {"model.vae." + k: v for k, v in out.items()}


def _dit_state(state: dict, config: ColaConfig, label: str) -> dict[str, torch.Tensor]:
    out, ada = {}, {}
    inner = config.num_attention_heads * config.head_dim
    rope_dim = config.rope_dim or config.head_dim
    expected_freqs = 1.0 / (DIT_ROPE_THETA ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
    for name, tensor in state.items():
        parts = name.rsplit(".", 1)
        block = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias|freqs)", name)
        if block:
            index, module, kind = block.groups()
            prefix = f"model.layers.{index}."
            ada_match = re.fullmatch(r"ada\.(\w+)\.1", module)
            if module == "msa.rope.rope" and kind == "freqs":  # a buffer: recomputed here, so only checked
                if tensor.shape != expected_freqs.shape or not torch.allclose(tensor.float(), expected_freqs):
                    raise ValueError(f"{label}: tensor {name} is not the RoPE frequencies of rope_dim = {rope_dim}, "
                                     f"θ = {DIT_ROPE_THETA:g}")
            elif module == "msa.proj_qkv":
                for proj, piece in zip("qkv", _split(name, tensor, [inner] * 3, label)):
                    out[f"{prefix}self_attn.{proj}_proj.{kind}"] = piece
            elif ada_match and ada_match.group(1) in _ADA_ORDER:
                ada.setdefault(index, {})[(ada_match.group(1), kind)] = tensor
            elif module in _DIT_BLOCK_KEYS:
                out[f"{prefix}{_DIT_BLOCK_KEYS[module]}.{kind}"] = tensor
            else:
                raise ValueError(f"{label}: unexpected tensor {name} {tuple(tensor.shape)}")
        elif parts[0] in _DIT_KEYS and parts[1] in ("weight", "bias"):
            out[f"{_DIT_KEYS[parts[0]]}.{parts[1]}"] = tensor
        else:
            raise ValueError(f"{label}: unexpected tensor {name} {tuple(tensor.shape)}")
    for index, pieces in ada.items():
        for kind in ("weight", "bias"):
            missing = [f"blocks.{index}.ada.{layer}.1.{kind}" for layer in _ADA_ORDER if (layer, kind) not in pieces]
            if missing:
                raise ValueError(f"{label}: missing tensor(s) {missing}")
            out[f"model.layers.{index}.modulation.1.{kind}"] = torch.cat([pieces[(layer, kind)]
                                                                          for layer in _ADA_ORDER])
    return out


def cola_state_dict_from_official(vae_state: dict, dit_state: dict, config: ColaConfig) -> dict[str, torch.Tensor]:
    """The official VAE and DiT tensors -> `ColaForCausalLM.state_dict()` keys (with a reference encoder, a copy of
    the VAE's encoder, when the config trains the VAE jointly). An unknown tensor is an error naming it; missing
    and mis-shaped ones are named by `load_into`."""
    out = {**_vae_state(vae_state, config.vae_config, "the official Cola VAE checkpoint"),
           **_dit_state(dit_state, config, "the official Cola DiT checkpoint")}
    if config.trains_vae and config.reference_kl_weight > 0:  # joint training's frozen anchor starts as the encoder
        prefix = "model.vae.encoder."
        out.update({"reference_encoder." + k[len(prefix):]: v for k, v in list(out.items()) if k.startswith(prefix)})
    return out


def cola_from_official(vae_config: dict, dit_config: dict, vae_state: dict, dit_state: dict,
                       **overrides) -> tuple[ColaForCausalLM, list[str]]:
    """The official VAE and DiT (config.json dicts and tensors) -> (`ColaForCausalLM` in fp32, eval mode; notes)."""
    config, notes = cola_config_from_official(vae_config, dit_config, **overrides)
    model = ColaForCausalLM(config).float().eval()
    load_into(model, cola_state_dict_from_official(vae_state, dit_state, config), "the official Cola checkpoint")
    model.generation_config.update(**OFFICIAL_GENERATION)
    return model, notes + cola_conversion_notes(config)


def cola_2b_config(**overrides) -> ColaConfig:
    """The released Cola DLM (Text VAE 501.9M + DiT 1.83B) in the official form: the official configs' defaults
    (vocab 100278, VAE 4 + 4 blocks of width 1536, FFN 6144, 12 heads, latent 16, block 4; DiT 24 layers of width
    2048, 16 heads of 128, rope_dim 96, expand ratio 4, block 4)."""
    vae = {"vocab_size": 100278, "encoder_num_blocks": 4, "decoder_num_blocks": 4, "dim": 1536, "ffn_dim": 6144,
           "latent_dim": 16, "num_heads": 12, "shared_heads_kv": 1, "layer_norm_eps": 1e-6, "qk_bias": False,
           "rope_theta": 500000, "block_size": 4, "scaling_factor": 1.0, "shifting_factor": 0.0,
           "pad_token_id": 100277}
    dit = {"txt_in_channels": 16, "txt_out_channels": 16, "txt_dim": 2048, "emb_dim": 2048, "heads": 16,
           "head_dim": 128, "expand_ratio": 4, "num_layers": 24, "norm_eps": 1e-5, "rope_dim": 96, "block_size": 4}
    return cola_config_from_official(vae, dit, **overrides)[0]


# ---------------------------------------------------------------------------------------------------------------------
# Parity with the official outputs
# ---------------------------------------------------------------------------------------------------------------------

def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [T_i, ...] -> (left-padded batch [B, T, ...] filled with zeros, attention mask [B, T])."""
    length = max(row.shape[0] for row in rows)
    batch = torch.zeros(len(rows), length, *rows[0].shape[1:], dtype=rows[0].dtype)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, length - row.shape[0]:] = row
        mask[i, length - row.shape[0]:] = 1
    return batch, mask


def _flattened_layout(lengths: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [1, ΣT] and mask [1, 1, ΣT, ΣT] of rows laid end to end in one sequence (the official layout):
    each row's positions start at 0, and a position sees its own row's blocks up to its own."""
    positions = torch.cat([torch.arange(n) for n in lengths])
    row = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    block = positions // block_size
    mask = (row[:, None] == row[None, :]) & (block[None, :] <= block[:, None])
    return positions[None], mask[None, None]


@torch.no_grad()
def cola_parity(model: ColaForCausalLM, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each quantity the reference file holds, computed by `model` from the reference's inputs: {name: max |ours −
    official|}. Keys as in ../shared/reference/cola/reference_outputs.safetensors (any sizes and number of rows).

    The VAE runs the rows as one left-padded batch. The DiT runs them laid end to end in one sequence as the
    official code does (its bfloat16 attention rounds the same products only in the same layout); official times
    are on its 0..1000 scale, ours on 0..1."""
    model = model.float().eval()
    vae, config = model.model.vae, model.config
    rows = [reference[k].long() for k in sorted((k for k in reference if re.fullmatch(r"row\d+_ids", k)),
                                                key=lambda k: int(k[3:-4]))]
    lengths = [row.shape[0] for row in rows]
    diffs = {}
    ids, mask = _left_padded(rows)
    states = vae.encoder.states(ids, mask)
    mean, std = vae.encoder.posterior(states)
    logvar = vae.encoder.posterior_log_variance(states)
    for i, n in enumerate(lengths):
        for name, ours in (("mean", mean), ("logvar", logvar)):
            if f"row{i}_{name}" in reference:
                diffs[f"row{i}_{name}"] = _max_diff(ours[i, -n:], reference[f"row{i}_{name}"])
    if "decode_latents" in reference:
        latents, mask = _left_padded(list(reference["decode_latents"].split(lengths)))
        logits = vae.decoder(latents, mask)
        diffs["decode_logits"] = _max_diff(torch.cat([logits[i, -n:] for i, n in enumerate(lengths)]),
                                           reference["decode_logits"])
    if "dit_input" in reference:
        positions, mask = _flattened_layout(lengths, config.block_size)
        times = (reference["dit_timestep"].double() / 1000).float()
        velocity = model.velocity(reference["dit_input"][None], times[None], mask, positions)[0]
        diffs["dit_velocity"] = _max_diff(velocity, reference["dit_velocity"])
    if "dit_uncond_input" in reference:
        blocks = reference["dit_uncond_input"].shape[0] // config.block_size
        positions, mask = _flattened_layout([config.block_size] * blocks, config.block_size)
        # The official unconditional branch runs each block alone at the time of that block in the conditional pass.
        times = reference.get("dit_uncond_timestep")
        if times is None:
            ends = torch.tensor(lengths).cumsum(0)
            times = torch.cat([reference["dit_timestep"][end - config.block_size:end] for end in ends.tolist()])
        velocity = model.velocity(reference["dit_uncond_input"][None], (times.double() / 1000).float()[None], mask,
                                  positions)[0]
        diffs["dit_uncond_velocity"] = _max_diff(velocity, reference["dit_uncond_velocity"])
    if "generate_row_seeds" in reference:
        diffs.update(_generate_parity(model, reference))
    return diffs


#: The official inference's per-sample seeding: block n of a sample starts from noise seeded base + 1000·id + n·this.
OFFICIAL_BLOCK_SEED_OFFSET = 10_000_000


def official_generation_options(reference: dict[str, torch.Tensor]) -> dict:
    """`generate()` options that decode as the reference's official run did (greedy, its guidance, steps, repetition
    penalty and per-sample noise seeds, no EOS stop)."""
    return {"do_sample": False, "guidance_scale": reference["generate_guidance_scale"].item(),
            "num_inference_steps": int(reference["generate_num_steps"]),
            "repetition_penalty": reference["generate_repetition_penalty"].item(),
            "noise_seeds": reference["generate_row_seeds"].tolist(),
            "block_seed_offset": OFFICIAL_BLOCK_SEED_OFFSET, "eos_token_id": None}


def _generate_parity(model: ColaForCausalLM, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """The latents the official inference encodes each prompt to, and its tokens against ours with the prompts as
    one left-padded batch and each alone (max |token id difference| over the official output's length; 0: the same
    tokens)."""
    prompts = [reference[f"generate_prompt{i}"].long() for i in range(len(reference["generate_row_seeds"]))]
    official = [reference[f"generate_tokens{i}"].long() for i in range(len(prompts))]
    diffs = {"generate_prompt_latents": max(
        _max_diff(model._encode_prompt(prompt[None], torch.ones(1, len(prompt), dtype=torch.bool))[0],
                  reference[f"generate_prompt_latents{i}"]) for i, prompt in enumerate(prompts))}
    options = official_generation_options(reference)
    ids, mask = _left_padded(prompts)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=max(len(t) for t in official), **options)
    new = batched[:, ids.shape[1]:]
    diffs["generate_tokens_batched"] = max(_max_diff(new[i, :len(t)], t) for i, t in enumerate(official))
    alone = []
    for i, (prompt, tokens) in enumerate(zip(prompts, official)):
        row_options = dict(options, noise_seeds=[options["noise_seeds"][i]])
        out = model.generate(prompt[None], max_new_tokens=len(tokens), **row_options)
        alone.append(_max_diff(out[0, prompt.shape[0]:], tokens))
    diffs["generate_tokens_alone"] = max(alone)
    return diffs


def bf16_kernels(threads: int | None = None) -> dict:
    """What decides how this machine rounds CPU bfloat16 matmuls with `threads` torch threads (default: this
    process's). The official DiT's attention runs under bf16 autocast, where a last-bit difference before rounding
    moves a velocity by a whole bf16 step (about 1e-4), so its outputs reproduce bit for bit only on the same
    kernels."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx_tile": torch.cpu._is_amx_tile_supported(),
            "threads": threads or torch.get_num_threads()}


__all__ = ["DIT_ROPE_THETA", "OFFICIAL_BLOCK_SEED_OFFSET", "OFFICIAL_GENERATION", "OFFICIAL_SAMPLING",
           "OFFICIAL_TRAINING", "bf16_kernels", "cola_2b_config", "cola_config_from_official", "cola_conversion_notes",
           "cola_from_official", "cola_parity", "cola_state_dict_from_official", "official_generation_options"]
