"""The modules of Cola DLM's official form (ByteDance-Seed/Cola-DLM's `ColaTextVAEModel` and `ColaDiTModel`),
which `modeling_cola` builds when a config asks for it (`ColaVAEConfig.architecture`, `ColaConfig.dit_architecture`).
Their attention is written out in the official order of operations (so that a converted checkpoint reproduces the
official outputs) rather than dispatched to transformers' attention functions.

Copied into Hub checkpoints, so torch and transformers only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .layers import AttentionProbs, DiTBlock, RotaryEmbedding, SwiGLUMLP, apply_rotary, decoder_layers


class InterleavedRotaryEmbedding(RotaryEmbedding):
    """RoPE tables for the official DiT: frequencies over `head_dim` = the rotated channels only, each angle repeated
    for an adjacent pair of channels (interleaved layout, not rotate-half)."""

    def layout(self, freqs: torch.Tensor) -> torch.Tensor:
        return freqs.repeat_interleave(2, dim=-1)


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [B, H, T, D] in adjacent pairs (x0, x1) -> (x0·c − x1·s,
    x1·c + x0·s); the other channels pass unchanged. Computed in float32."""
    rotated = cos.shape[-1]
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    head = x[..., :rotated].float()
    pairs = head.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return torch.cat((head * cos + turned * sin, x[..., rotated:].float()), dim=-1).to(x.dtype)


class OfficialAttention(nn.Module):
    """Self-attention of the official Cola blocks. QK-norm: a LayerNorm (affine, eps) over the whole q and k widths
    (`qk_norm="full"`, the VAE) or over each head (`"head"`, the DiT). RoPE: rotate-half over the whole head
    (`rotary="half"`, cos/sin [B, T, head_dim]) or interleaved pairs over the first channels (`"interleaved"`, cos/sin
    [B, T, rope_dim]). Scores are q·scale @ kᵀ plus an additive mask, then softmax and @ v, written out in the
    official order so that the result matches it; `attention_dtype="bfloat16"` runs them under bfloat16 autocast as
    the official DiT does. Keys are cached after norm and rotary. Masks: bool, True = may attend."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: str, eps: float,
                 qkv_bias: bool, out_bias: bool, rotary: str, attention_dtype: str | None = None,
                 layer_idx: int | None = None, config=None):
        super().__init__()
        self.config = config
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_norm_type, self.rotary, self.layer_idx = qk_norm, rotary, layer_idx
        self.attention_dtype = getattr(torch, attention_dtype) if attention_dtype else None
        self.attention_probs = AttentionProbs()
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=out_bias)
        q_width, k_width = (num_heads * head_dim, num_kv_heads * head_dim) if qk_norm == "full" else (head_dim,) * 2
        self.q_norm = nn.LayerNorm(q_width, eps=eps)
        self.k_norm = nn.LayerNorm(k_width, eps=eps)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        if self.qk_norm_type == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm_type == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary == "interleaved":
            q, k = apply_interleaved_rotary(q, cos, sin), apply_interleaved_rotary(k, cos, sin)
        else:
            q, k = apply_rotary(q.float(), k.float(), cos.float(), sin.float())
            q, k = q.to(v.dtype), k.to(v.dtype)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        additive = None
        if attention_mask is not None:
            attention_mask = attention_mask.view((1,) * (4 - attention_mask.dim()) + attention_mask.shape)
            additive = torch.zeros(attention_mask.shape, dtype=torch.float32, device=q.device)
            additive = additive.masked_fill(~attention_mask, torch.finfo(torch.float32).min)
        with torch.autocast(q.device.type, dtype=self.attention_dtype or torch.bfloat16,
                            enabled=self.attention_dtype is not None):
            scores = q.mul(self.head_dim**-0.5) @ k.transpose(-2, -1)
            if additive is not None:
                scores = scores + additive.to(scores.dtype)
            probs = scores.softmax(dim=-1)
            # Recorded for `output_attentions` only under "eager", as transformers' models do.
            if getattr(self.config, "_attn_implementation", None) == "eager":
                probs = self.attention_probs(probs)
            out = probs @ v
        out = out.to(hidden_states.dtype).transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class OfficialVAEBlock(GradientCheckpointingLayer):
    """The official VAE block (post-norm): x <- LN(x) + attn(x); out = x + LN(mlp(x)), SwiGLU MLP with biases."""

    def __init__(self, config: ColaVAEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = OfficialAttention(config.hidden_size, config.num_attention_heads,
                                           config.num_key_value_heads, config.head_dim, "full", config.rms_norm_eps,
                                           config.qkv_bias, True, "half", layer_idx=layer_idx, config=config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, bias=True)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        attended = self.self_attn(hidden_states, cos, sin, attention_mask, cache=cache)
        hidden_states = self.attention_norm(hidden_states) + attended
        return hidden_states + self.mlp_norm(self.mlp(hidden_states))


def vae_layers(config: ColaVAEConfig, num_layers: int) -> nn.ModuleList:
    """The VAE's blocks: ours (`decoder_layers`) or the official form's."""
    if config.official:
        return nn.ModuleList(OfficialVAEBlock(config, i) for i in range(num_layers))
    if num_layers == config.num_hidden_layers:
        return decoder_layers(config)
    resized = type(config).from_dict(config.to_dict())  # a copy with another depth, to size the stack
    resized.num_hidden_layers = num_layers
    return decoder_layers(resized)


class GeluMLP(nn.Module):
    """proj_out(GELU_tanh(proj_in(x))), with biases: the official DiT's MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.proj_in = nn.Linear(hidden_size, intermediate_size)
        self.proj_out = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


class OfficialDiTBlock(DiTBlock):
    """`DiTBlock`'s adaLN computation with the official DiT's sublayers: `OfficialAttention` (per-head LayerNorm
    QK-norm, interleaved RoPE on `rope_dim` channels) and `GeluMLP`. The official four modulation layers (shift and
    scale in, gate out, for attention and MLP) are the rows of the one `modulation` layer, in its order."""

    def __init__(self, config: ColaConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.layer_idx = layer_idx
        size, eps = config.hidden_size, config.rms_norm_eps
        self.attention_norm = nn.LayerNorm(size, eps=eps, elementwise_affine=False)
        self.self_attn = OfficialAttention(size, config.num_attention_heads, config.num_key_value_heads,
                                           config.head_dim, "head", eps, False, False, "interleaved",
                                           config.attention_dtype, layer_idx=layer_idx, config=config)
        self.mlp_norm = nn.LayerNorm(size, eps=eps, elementwise_affine=False)
        self.mlp = GeluMLP(size, config.intermediate_size)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(size, 6 * size))
        self.modulation[1].zero_init = True


class OfficialTimestepEmbedding(nn.Module):
    """The official DiT's time conditioning: sinusoidal(time_scale·t; 256 features: sines, then cosines, frequencies
    10000^(−i/128)) -> Linear -> SiLU -> Linear -> SiLU -> Linear."""

    def __init__(self, hidden_size: int, frequency_size: int = 256, time_scale: float = 1000.0):
        super().__init__()
        self.frequency_size, self.time_scale = frequency_size, time_scale
        self.linear_1 = nn.Linear(frequency_size, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)
        self.linear_3 = nn.Linear(hidden_size, hidden_size)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_size // 2
        # The official expression order (exponent divided by `half` last): other orders move the angles by an ulp.
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        angles = (t.float() * self.time_scale)[..., None] * torch.exp(exponent)
        features = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1).to(self.linear_1.weight.dtype)
        return self.linear_3(F.silu(self.linear_2(F.silu(self.linear_1(features)))))


__all__ = ["GeluMLP", "InterleavedRotaryEmbedding", "OfficialAttention", "OfficialDiTBlock",
           "OfficialTimestepEmbedding", "OfficialVAEBlock", "apply_interleaved_rotary", "vae_layers"]
