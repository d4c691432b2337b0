# Copyright 2025 The hf-latentlm authors. Licensed under the Apache License, Version 2.0.
"""Shared transformer core: RMSNorm, SwiGLU, rotary embeddings, GQA attention, a pre-norm decoder block
and boolean attention-mask builders.

This file is copied into Hub checkpoints by `save_pretrained`, so it imports only `torch` and `transformers`.

Mask convention used everywhere in this file: a BOOLEAN tensor, `True` = the query row may attend to the key
column, of shape `[B, 1 or H, Tq, Tk]` (any shape broadcastable to it works in `Attention`). `Tk` counts cached keys
first, then the keys of the current call, in the order `Cache.update` concatenates them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

from .configuration_backbone import STATIC_ROPE_TYPES

class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale; computed in float32, result cast back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), without biases (as in Llama) unless `bias=True`."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --------------------------------------------------------------------------------------------------------------------
# Rotary position embeddings
# --------------------------------------------------------------------------------------------------------------------


class RotaryEmbedding(nn.Module):
    """Rotary embedding tables for explicit integer positions: forward(position_ids [B, T] or [T], any integers in any
    order, repeated or with gaps) -> cos, sin [B, T, head_dim] ([T, head_dim] for 1-D input), float32 unless `dtype`
    is given. `inv_freq` is a non-persistent buffer, which `from_pretrained` refills with empty memory: the owning
    model's `_init_weights` recomputes it (`init_backbone_weights`)."""

    def __init__(self, head_dim: int, base: float = 10000.0, config=None):
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.base = float(base)
        # With a config whose `rope_parameters` ask for a scaled RoPE, transformers computes the frequencies and the
        # cos/sin scale ("attention factor") exactly as for its own models.
        self.config = config
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    @classmethod
    def from_config(cls, config) -> "RotaryEmbedding":
        """From a backbone config: head_dim and `rope_parameters` (transformers' format)."""
        return cls(config.head_dim, base=config.rope_parameters["rope_theta"], config=config)

    def compute_inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        """base^(-2i/head_dim) for i in [0, head_dim/2), float32, shape [head_dim/2] (or the scaled RoPE's)."""
        rope_type = (self.config.rope_parameters.get("rope_type", "default") if self.config is not None
                     else "default")
        if rope_type not in STATIC_ROPE_TYPES:  # a config changed after its checks (they refuse these too)
            raise ValueError(f"rope_type {rope_type!r} is not supported: the rotary tables are computed once, so only "
                             f"RoPE whose frequencies do not change with the sequence length is ({STATIC_ROPE_TYPES})")
        if rope_type != "default":
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, device)
            return inv_freq.float()
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.base**exponents)

    @torch.no_grad()
    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in float32 even under autocast/bf16: positions times frequencies lose precision otherwise.
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(position_ids.device, torch.float32)
            emb = self.layout(freqs)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def layout(self, freqs: torch.Tensor) -> torch.Tensor:
        """The angles [..., head_dim] of each channel from the frequencies' [..., head_dim/2]: rotate-half layout,
        the two halves share frequencies."""
        return torch.cat((freqs, freqs), dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, T, D] and k [B, Hk, T, D] by cos/sin [B, T, D] (rotate-half convention)."""
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    q_rot = q * cos + rotate_half(q) * sin
    k_rot = k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)
    return q_rot, k_rot


# --------------------------------------------------------------------------------------------------------------------
# Attention and decoder block
# --------------------------------------------------------------------------------------------------------------------


def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scaling) v written out, so that the probabilities exist: they go through
    `module.attention_probs`, where `output_attentions` records them. Takes the boolean mask as given (True = may
    attend); a row with no visible key gets all-zero probabilities. Returns ([B, Tq, H, D], probabilities)."""
    key = key.repeat_interleave(module.num_key_value_groups, dim=1)
    value = value.repeat_interleave(module.num_key_value_groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = scores.softmax(-1)
    if attention_mask is not None:
        probs = probs.masked_fill(~attention_mask.any(dim=-1, keepdim=True), 0.0)
    probs = module.attention_probs(probs.to(query.dtype))
    attn_output = torch.matmul(probs, value)
    return attn_output.transpose(1, 2).contiguous(), probs


def flex_block_mask(attention_mask: torch.Tensor, shape: tuple[int, int, int, int]):
    """A flex-attention `BlockMask` of a 4-D boolean mask broadcastable to `shape` = [B, H, Tq, Tk]: flex attention skips
    the blocks of the score matrix where nothing is visible, which is what makes block-causal masks cheap."""
    from torch.nn.attention.flex_attention import create_block_mask

    # The kernel calls `may_attend` with every (batch, head) index, so the mask is indexed through a broadcast view;
    # the block summary itself needs only the mask's own batch and head sizes.
    dense = attention_mask.expand(shape)

    def may_attend(b, h, q_idx, kv_idx):
        return dense[b, h, q_idx, kv_idx]

    batch, heads = attention_mask.shape[:2]
    return create_block_mask(may_attend, batch, heads, shape[2], shape[3], device=dense.device)


class Attention(nn.Module):
    """Grouped-query self-attention with an arbitrary boolean mask, computed by the attention function that
    `config._attn_implementation` names (looked up at every call in transformers' `ALL_ATTENTION_FUNCTIONS`, as
    Llama does; "eager" is `eager_attention_forward`, no config means "sdpa").

    forward(hidden_states [B, T, hidden], cos, sin [B, T, head_dim], attention_mask, cache=None) -> [B, T, hidden]

    - `attention_mask`: bool, True = may attend, broadcastable to [B, H, T, Tk] where Tk = cached + T keys.
      `None` means every query sees every key (no causality!). For "flex_attention" it becomes a `BlockMask`.
      Flash attention takes no such masks: with it, attention is causal and `attention_mask` is None or the padding
      mask [B, Tk] (1 = real key), which only a family whose masks are plain causal ones passes.
    - `cache`: a `transformers.cache_utils.Cache` (e.g. `DynamicCache`); the new keys/values are appended with
      `cache.update(k, v, layer_idx)` and attention runs over all cached keys. Keys are cached AFTER rotary, so the
      cos/sin passed in must be those of the current call's positions only.
    - Fully masked query rows (no visible key) return exactly ZERO (before the bias-free `o_proj`). SDPA alone would
      give NaN there on some kernels, so such rows see every key and their output is zeroed afterwards.
    - `qk_norm=True` applies a per-head RMSNorm over head_dim to q and k before rotary.
    """

    # Causality lives in the masks; `None` means full attention, so the kernels must not add their own.
    is_causal = False

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        layer_idx: int | None = None,
        config=None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_key_value_groups = num_heads // num_kv_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_heads
        self.scaling = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.config = config
        self.attention_probs = AttentionProbs()

        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin)

        if cache is not None:
            if self.layer_idx is None:
                raise ValueError("Attention needs a layer_idx to use a cache")
            k, v = cache.update(k, v, self.layer_idx)

        implementation = getattr(self.config, "_attn_implementation", None) or "sdpa"
        flash_kwargs, row_has_key = {}, None
        if is_flash_attention_requested(requested_attention_implementation=implementation):
            if attention_mask is not None and attention_mask.dim() != 2:
                raise ValueError(f"{implementation} takes only causal attention with a [batch, keys] padding mask, got "
                                 f"a mask of shape {tuple(attention_mask.shape)}")
            flash_kwargs["is_causal"] = True
        elif attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask must be bool (True = may attend), got {attention_mask.dtype}")
            attention_mask = attention_mask.view((1,) * (4 - attention_mask.dim()) + attention_mask.shape)
            # Computed without a data-dependent branch, to avoid a host sync per layer.
            row_has_key = attention_mask.any(dim=-1, keepdim=True)
            if implementation == "flex_attention":
                attention_mask = flex_block_mask(attention_mask, (bsz, self.num_heads, q_len, k.shape[-2]))
            elif implementation != "eager":
                # Rows with no visible key see everything (finite softmax, finite grads) and are zeroed below.
                attention_mask = attention_mask | ~row_has_key

        attention_function = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        out, _ = attention_function(self, q, k, v, attention_mask, scaling=self.scaling, **flash_kwargs)
        if row_has_key is not None:
            out = out.masked_fill(~row_has_key.transpose(1, 2), 0.0)
        return self.o_proj(out.reshape(bsz, q_len, self.num_heads * self.head_dim))


class AttentionProbs(nn.Identity):
    """Marks the attention probabilities [B, H, Tq, Tk] of the eager path: transformers' output recording hooks
    this module for `output_attentions`."""


class DecoderBlock(GradientCheckpointingLayer):
    """Pre-norm transformer block: h = x + attn(norm(x)); out = h + mlp(norm(h)). forward(hidden_states, cos, sin,
    attention_mask, cache=None, return_mid=False) returns `out`, or `(out, h)` with `return_mid=True` (PLM's
    representation alignment). Pass `hidden_states` positionally (reentrant gradient checkpointing needs it)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None,
        intermediate_size: int,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        qk_norm: bool = False,
        layer_idx: int | None = None,
        config=None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim=head_dim, qk_norm=qk_norm,
                                   rms_norm_eps=rms_norm_eps, layer_idx=layer_idx, config=config)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.mlp = SwiGLUMLP(hidden_size, intermediate_size)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: Cache | None = None,
                return_mid: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        attn_out = self.self_attn(self.input_layernorm(hidden_states), cos, sin, attention_mask, cache=cache)
        mid = hidden_states + attn_out
        out = mid + self.mlp(self.post_attention_layernorm(mid))
        if return_mid:
            return out, mid
        return out


def decoder_layers(config, qk_norm: bool = False) -> nn.ModuleList:
    """`config.num_hidden_layers` DecoderBlocks sized from a backbone config (`BackboneConfig` field names), with
    per-head QK-norm if asked."""
    return nn.ModuleList(
        DecoderBlock(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                     config.intermediate_size, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
                     qk_norm=qk_norm, layer_idx=i, config=config)
        for i in range(config.num_hidden_layers)
    )


@torch.no_grad()
def init_backbone_weights(module: nn.Module, std: float) -> None:
    """The families' `_init_weights` for the shared modules: N(0, std) linear and embedding weights (a Linear with
    `zero_init = True` starts at zero), zero biases, unit norm scales, and the rotary table recomputed (it is a
    non-persistent buffer that `from_pretrained` refills with empty memory)."""
    if isinstance(module, nn.Linear):
        if getattr(module, "zero_init", False):
            module.weight.zero_()
        else:
            module.weight.normal_(0.0, std)
        if module.bias is not None:
            module.bias.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.normal_(0.0, std)
    elif isinstance(module, RMSNorm):
        module.weight.fill_(1.0)
    elif isinstance(module, RotaryEmbedding):
        module.inv_freq.copy_(module.compute_inv_freq(module.inv_freq.device))


# --------------------------------------------------------------------------------------------------------------------
# Mask builders (bool, True = may attend)
# --------------------------------------------------------------------------------------------------------------------


def causal_layout(
    attention_mask: torch.Tensor | None,
    batch: int,
    length: int,
    past: int,
    device: torch.device | str | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, length] and boolean causal mask [B or 1, 1, length, past + length] of `length` new items after
    `past` cached ones. `attention_mask`: optional 2-D padding mask over the cached + new items (1 = real, left
    padding); positions then count real items only. Given `position_ids` are kept."""
    if attention_mask is not None and attention_mask.shape[-1] != past + length:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} items, expected cached + new = "
                         f"{past + length}")
    mask = causal_mask(length, past + length, device=device, padding_mask=attention_mask)
    if position_ids is None:
        position_ids = (make_padding_position_ids(attention_mask)[:, past:] if attention_mask is not None else
                        torch.arange(past, past + length, device=device)[None].expand(batch, -1))
    return position_ids, mask


def causal_mask(
    q_len: int,
    kv_len: int,
    device: torch.device | str | None = None,
    past_len: int | None = None,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal mask for `q_len` new queries over `kv_len` keys (cached keys first).

    Query i sits at key column `past_len + i` (`past_len` defaults to `kv_len - q_len`, i.e. the queries are the last
    `q_len` keys) and sees key columns `<= past_len + i`.
    `padding_mask` [B, kv_len] (1/True = real token) additionally hides padded keys; a padded query row still sees its
    own column, so no row is empty (its output is garbage-but-finite and must be ignored by the caller).
    Returns [1, 1, q_len, kv_len], or [B, 1, q_len, kv_len] with `padding_mask`.
    """
    if past_len is None:
        past_len = kv_len - q_len
    if device is None and padding_mask is not None:
        device = padding_mask.device
    q_col = torch.arange(q_len, device=device)[:, None] + past_len  # key column of each query
    k_col = torch.arange(kv_len, device=device)[None, :]
    mask = k_col <= q_col  # [Tq, Tk]
    if padding_mask is None:
        return mask[None, None]
    key_real = padding_mask.to(device=device).bool()[:, None, :]  # [B, 1, Tk]
    own_column = k_col == q_col  # [Tq, Tk]
    return ((mask[None] & key_real) | own_column[None])[:, None]


def block_causal_mask(
    seq_len: int,
    block_size: int,
    padding_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bidirectional inside consecutive blocks of `block_size` columns, causal across blocks.

    Query i sees key j iff `j // block_size <= i // block_size`. Blocks are counted on column index from 0, so with
    LEFT padding the block boundaries do not line up with real tokens: use right padding (or no padding).
    `padding_mask` [B, T] (1/True = real token) hides padded keys; every row (padded ones too) also sees its own
    column, so no row is empty. Padded rows' outputs are meaningless and must be ignored.
    Returns [1, 1, T, T], or [B, 1, T, T] with `padding_mask`. `block_size=1` gives the plain causal mask.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if device is None and padding_mask is not None:
        device = padding_mask.device
    block = torch.arange(seq_len, device=device) // block_size
    mask = block[None, :] <= block[:, None]  # [T, T]
    if padding_mask is None:
        return mask[None, None]
    key_real = padding_mask.to(device=device).bool()[:, None, :]  # [B, 1, T]
    own_column = torch.eye(seq_len, dtype=torch.bool, device=device)
    return ((mask[None] & key_real) | own_column[None])[:, None]


def _as_batched(x: torch.Tensor) -> torch.Tensor:
    # Promote a per-row descriptor [T] to [1, T] so it broadcasts against batched ones.
    return x[None] if x.dim() == 1 else x


def visibility_mask(
    query_pos: torch.Tensor,
    query_limit: torch.Tensor,
    query_group: torch.Tensor,
    key_pos: torch.Tensor,
    key_group: torch.Tensor,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """General mask from per-row and per-column descriptors ("clean prefix + own group").

    Every key column is either CLEAN (`key_group < 0`, e.g. ordinary/encoder tokens, cached or not) or belongs to a
    GROUP (`key_group >= 0`, e.g. the decoder rows of one PLM block). Query row r may see key column c iff
    `key_valid[c]` and
        - c is clean   and key_pos[c] <  query_limit[r]                                   (clean prefix), or
        - c is grouped and key_group[c] == query_group[r] and key_pos[c] <= query_pos[r]  (causal inside own group).
    Query rows with `query_group < 0` never see grouped keys.

    Args (LongTensor unless noted; each [B, T] or [T], batch dims broadcast):
        query_pos   [B, Tq]: position of each query row (its rotary position).
        query_limit [B, Tq]: exclusive upper bound on the positions of clean keys the row sees.
        query_group [B, Tq]: group id of the row, -1 for none.
        key_pos     [B, Tk]: position of each key column (cached keys first, in cache order).
        key_group   [B, Tk]: group id of the key, -1 for clean keys.
        key_valid   [B, Tk] bool, optional: False hides the key (padding).
    Returns bool [B, 1, Tq, Tk].

    PLM usage: encoder row at position p: (pos=p, limit=p+1, group=-1) -> plain causal over clean tokens. Decoder row
    predicting position j of block z starting at i_z: (pos=j, limit=i_z, group=z) -> clean keys at positions < i_z
    plus its own block's decoder keys at positions <= j. Quadratic decoding: proposal block for acceptance length m
    gets limit = (first pending position) + m.
    A row can end up with no visible key (e.g. a padded row); `Attention` returns zeros for such rows.
    """
    query_pos, query_limit, query_group = map(_as_batched, (query_pos, query_limit, query_group))
    key_pos, key_group = _as_batched(key_pos), _as_batched(key_group)
    q_pos, q_limit, q_group = query_pos[..., :, None], query_limit[..., :, None], query_group[..., :, None]
    k_pos, k_group = key_pos[..., None, :], key_group[..., None, :]

    clean_visible = (k_group < 0) & (k_pos < q_limit)
    group_visible = (k_group >= 0) & (k_group == q_group) & (k_pos <= q_pos)
    mask = clean_visible | group_visible  # [B, Tq, Tk]
    if key_valid is not None:
        mask = mask & _as_batched(key_valid.bool())[..., None, :]
    return mask[:, None]


def make_padding_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens: cumsum(mask) - 1, clamped at 0 (padded slots before the first real
    token get 0). attention_mask [B, T] of 0/1 -> LongTensor [B, T]. Right padding: trailing pads repeat the last
    real position, which is harmless since they are masked out as keys."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# --------------------------------------------------------------------------------------------------------------------
# Latent-diffusion pieces: the dual-stream training mask, an adaLN DiT block, a cache the denoising steps only read
# --------------------------------------------------------------------------------------------------------------------


def dual_stream_mask(
    length: int,
    block_size: int,
    history_visible: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Mask of a block-causal denoiser trained on every block in one pass over [clean stream ; noisy stream].

    Columns (and rows) `[0, length)` hold the clean latents, `[length, 2·length)` the noisy copy of the same
    positions; block of position p = p // block_size.
    - clean row i sees clean key j iff block(j) <= block(i) (block-causal over clean history, as at inference);
    - noisy row i sees noisy key j iff block(j) == block(i) (its own block, bidirectionally), and clean key j iff
      block(j) < block(i) and `history_visible[b, block(i)]` (history dropout: False = the block sees only itself,
      which is what the unconditional branch of classifier-free guidance runs);
    - clean rows never see noisy keys.
    history_visible: bool [B, num_blocks] (num_blocks = ceil(length / block_size)); None = all visible.
    padding_mask: [B, length] (1/True = real position) hides padded positions as keys in both streams; every row
    also sees its own column, so no row is empty (padded rows' outputs are meaningless).
    Returns bool [1 or B, 1, 2·length, 2·length].
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if device is None:
        device = next((t.device for t in (history_visible, padding_mask) if t is not None), None)
    block = torch.arange(length, device=device) // block_size
    same = block[:, None] == block[None, :]
    earlier = block[None, :] < block[:, None]  # [query, key]: the key's block precedes the query's
    noisy_sees_clean = earlier[None]
    if history_visible is not None:
        noisy_sees_clean = noisy_sees_clean & history_visible.to(device).bool()[:, block][:, :, None]
    batch = noisy_sees_clean.shape[0]
    clean_rows = torch.cat([(same | earlier).expand(batch, -1, -1),
                            torch.zeros(batch, length, length, dtype=torch.bool, device=device)], dim=2)
    noisy_rows = torch.cat([noisy_sees_clean.expand(batch, -1, -1), same.expand(batch, -1, -1)], dim=2)
    mask = torch.cat([clean_rows, noisy_rows], dim=1)
    if padding_mask is not None:
        real = padding_mask.to(device).bool().repeat(1, 2)  # [B, 2L]: both copies of a position
        own = torch.eye(2 * length, dtype=torch.bool, device=device)
        mask = (mask & real[:, None, :]) | own
    return mask[:, None]


# Seed of the draws an eval-mode loss makes (`evaluation_generator`).
EVALUATION_SEED = 0


def evaluation_generator() -> torch.Generator:
    """Where an eval-mode latent-family loss draws its noise, flow times and block conditions: a CPU generator with a
    fixed seed, new at every call, so the same batch gives the same loss and the global RNG is left alone. Callers
    draw ONE row and expand it over the batch (`fixed_row_draw`), so a row's loss does not depend on the others."""
    return torch.Generator().manual_seed(EVALUATION_SEED)


def fixed_row_draw(generator: torch.Generator, batch: int, shape: tuple[int, ...], device=None,
                   dtype: torch.dtype = torch.float32, uniform: bool = False) -> torch.Tensor:
    """Standard normal (or, with `uniform`, U[0, 1)) draws of one row's `shape` from `generator`, the same for every
    one of `batch` rows: [batch, *shape]. Prefix-consistent: a longer row's first positions are a shorter row's."""
    draw = (torch.rand if uniform else torch.randn)(shape, generator=generator, device=generator.device)
    return draw.to(device=device, dtype=dtype).expand(batch, *shape)


def draw_block_conditions(time_sampler, batch: int, length: int, block_size: int, prompt_block_prob: float,
                          history_dropout: float, device=None,
                          generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The random conditions of one dual-stream training pass of a block-causal denoiser (Cola DLM, AURORA-LM).
    From the global RNG; with a `generator` (an eval-mode loss, `evaluation_generator`), one row's conditions drawn
    from it, shared by every row.

    - times [B, length]: one flow time per (row, block) from `time_sampler.sample(shape, device=...)`, spread over
      the block's positions, and 0 on clean leading positions;
    - clean_lead [B, length] bool: with probability `prompt_block_prob` a block's first k positions (k uniform in
      1..Q−1) enter clean at time 0, which trains the repaint of a prompt that ends mid-block (they are not scored);
    - history_visible [B, num_blocks] bool: False with probability `history_dropout` (the block sees only itself:
      the unconditional branch of classifier-free guidance), for `dual_stream_mask`.
    """
    num_blocks = -(-length // block_size)
    block = torch.arange(length, device=device) // block_size
    offset = torch.arange(length, device=device) % block_size
    rows, draw_device = (batch, device) if generator is None else (1, generator.device)
    draws = {"generator": generator, "device": draw_device}
    times = time_sampler.sample((rows, num_blocks), **draws)
    prompt_block = torch.rand(rows, num_blocks, **draws) < prompt_block_prob
    known_len = torch.randint(1, max(block_size, 2), (rows, num_blocks), **draws)
    history_visible = torch.rand(rows, num_blocks, **draws) >= history_dropout
    times, prompt_block, known_len, history_visible = (
        x.to(device).expand(batch, -1) for x in (times, prompt_block, known_len, history_visible))
    clean_lead = (prompt_block & (block_size > 1))[:, block] & (offset[None] < known_len[:, block])
    times = torch.where(clean_lead, 0.0, times[:, block])
    return times, clean_lead, history_visible


class DiTBlock(GradientCheckpointingLayer):
    """Transformer block with adaLN-Zero conditioning (DiT): per position, a conditioning vector c sets the shift,
    scale and gate of both sublayers,
        h = x + gate_a · attn(LN(x)·(1 + scale_a) + shift_a),  out = h + gate_m · mlp(LN(h)·(1 + scale_m) + shift_m),
    with LN a LayerNorm without affine parameters. `modulation` (SiLU -> Linear(d, 6d)) starts at zero, so every
    block starts as the identity. forward(hidden_states [B, T, d], conditioning [B, T, d], cos, sin, attention_mask,
    cache=None); attention is the shared `Attention` (GQA, RoPE, optional QK-norm)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None, intermediate_size: int,
                 head_dim: int | None = None, rms_norm_eps: float = 1e-6, qk_norm: bool = False,
                 layer_idx: int | None = None, config=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_norm = nn.LayerNorm(hidden_size, eps=rms_norm_eps, elementwise_affine=False)
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim=head_dim, qk_norm=qk_norm,
                                   rms_norm_eps=rms_norm_eps, layer_idx=layer_idx, config=config)
        self.mlp_norm = nn.LayerNorm(hidden_size, eps=rms_norm_eps, elementwise_affine=False)
        self.mlp = SwiGLUMLP(hidden_size, intermediate_size)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.modulation[1].zero_init = True

    def forward(self, hidden_states: torch.Tensor, conditioning: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: Cache | None = None) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.modulation(conditioning).chunk(6, dim=-1)
        x = self.attention_norm(hidden_states) * (1 + scale_a) + shift_a
        hidden_states = hidden_states + gate_a * self.self_attn(x, cos, sin, attention_mask, cache=cache)
        x = self.mlp_norm(hidden_states) * (1 + scale_m) + shift_m
        return hidden_states + gate_m * self.mlp(x)


def dit_layers(config) -> nn.ModuleList:
    """`config.num_hidden_layers` DiTBlocks sized from a backbone config (`BackboneConfig` field names)."""
    return nn.ModuleList(
        DiTBlock(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
                 head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, layer_idx=i, config=config)
        for i in range(config.num_hidden_layers)
    )


class ReadOnlyCache:
    """A view of a `Cache` that attention reads but never writes: `update(k, v, layer)` returns the cached keys and
    values followed by the new ones, and stores nothing. The denoising steps of a block attend to the clean history
    this way; only the finished block's clean pass is appended to the real cache."""

    def __init__(self, cache: Cache):
        self.cache = cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length(layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layers = getattr(self.cache, "layers", [])
        if layer_idx >= len(layers) or not getattr(layers[layer_idx], "is_initialized", False):
            return key_states, value_states
        layer = layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


class OffsetCache:
    """A view of a `DynamicCache` whose layer i is the cache's layer `offset + i`, so that a second stack of blocks
    (a text encoder in front of a backbone) keeps its keys in the same cache object as the backbone. Missing layers
    are appended to `cache.layers` (a cache built from the backbone's config only has the backbone's layers)."""

    def __init__(self, cache: Cache, offset: int):
        self.cache, self.offset = cache, offset

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if len(self.cache.layers) <= self.offset + layer_idx:
            return 0
        return self.cache.get_seq_length(self.offset + layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.cache.layers) <= self.offset + layer_idx:
            self.cache.layers.append(DynamicLayer())
        return self.cache.update(key_states, value_states, self.offset + layer_idx, *args, **kwargs)


def block_causal_layout(
    attention_mask: torch.Tensor | None,
    batch: int,
    length: int,
    past: int,
    block_size: int,
    device: torch.device | str | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, length] and boolean mask [B or 1, 1, length, past + length] of `length` new items after `past`
    cached ones, block-causal BY POSITION: a query sees a key iff block(key position) <= block(query position),
    block = position // block_size. `attention_mask` [B, past + length] (1 = real, left padding) hides padded keys
    and makes positions count real items only, so each row's blocks start at its first real item (as the row would
    alone); padded query rows see their own column. Given `position_ids` are kept for the new items (cached keys are
    then assumed at positions 0..past-1 unless a mask says otherwise)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if attention_mask is not None:
        if attention_mask.shape[-1] != past + length:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} items, expected cached + new = "
                             f"{past + length}")
        device = attention_mask.device
        key_pos = make_padding_position_ids(attention_mask)
    else:
        key_pos = torch.arange(past + length, device=device)[None]
    if position_ids is None:
        position_ids = key_pos[:, past:].expand(batch, -1)
    else:  # the new keys are the new items: at the given positions
        rows = max(key_pos.shape[0], position_ids.shape[0])
        key_pos = torch.cat([key_pos[:, :past].expand(rows, -1), position_ids.expand(rows, -1)], dim=1)
    mask = (key_pos[:, None, :] // block_size) <= (position_ids[:, :, None] // block_size)
    if attention_mask is not None:
        own = torch.arange(past + length, device=device)[None, :] == torch.arange(past, past + length,
                                                                                     device=device)[:, None]
        mask = (mask & attention_mask.bool()[:, None, :]) | own
    return position_ids, mask[:, None]


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [B, T] of logits [B, T, V] (float32) against targets [B, T] (negative ids read as 0;
    the caller masks them). Over rows of the contiguous [B·T, V] layout: the [B, V, T] transpose that
    `F.cross_entropy` otherwise wants makes CPU log-softmax run strided, much slower."""
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.clamp(min=0).reshape(-1),
                          reduction="none")
    return nll.view(targets.shape)
