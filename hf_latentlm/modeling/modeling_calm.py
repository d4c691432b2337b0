"""Continuous Autoregressive Language Model (CALM, paper 000; method-specs §2, calm-supplement.md).

Two models:
- `CALMAutoencoder`: a context-free MLP autoencoder, chunk of K tokens <-> one latent z (Gaussian posterior,
  free-bits KL, token replacement and latent dropout for robustness).
- `CALMForCausalLM`: a transformer over chunk steps. Step i reads the K tokens of chunk i-1 (embedded and
  compressed to one vector), and its energy head turns the hidden state plus uniform noise into a sample of
  z_i in ONE pass; the frozen autoencoder (a submodule whose weights are saved in this checkpoint) decodes
  z_i into K tokens, which are fed back. Trained with the energy loss; no softmax, no token likelihood.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import ModelOutput
from transformers.utils.generic import is_flash_attention_requested
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_calm import TEMPERATURE_SAMPLERS, CALMAutoencoderConfig, CALMConfig
from .energy import RejectionState, energy_loss, exact_temperature_scan, inverse_temperature, pool_temperature_choice
from .generation import (DecodingStep, GenerateOutput, GenerationOptions, MultiTokenGenerationMixin,
                         refuse_token_filters, row_seeds)
from .layers import (AttentionProbs, DecoderBlock, RMSNorm, RotaryEmbedding, SwiGLUMLP, causal_layout, decoder_layers,
                     evaluation_generator, fixed_row_draw)
from .modeling_backbone import (BackbonePreTrainedModel, check_backbone_inputs, check_forward_kwargs, composite_config,
                                head_forward, refuse_vocab_resize)


@dataclass
class CALMAutoencoderOutput(ModelOutput):
    """`loss` = K × token cross-entropy + kl_weight × clamped KL. The scalars are logged by the training loop:
    `token_accuracy` of the decoded latent (sampled and dropped out in training, the posterior mean in eval mode
    unless `sample_latent=True`), `posterior_std` the mean σ."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    latent_mean: torch.Tensor | None = None
    latent_log_std: torch.Tensor | None = None
    reconstruction_nll: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    posterior_std: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class CALMOutput(ModelOutput):
    """`last_hidden_state` [B, L, d]: one vector per chunk step (h_i conditions the latent of chunk i+1).
    With labels: `loss` = mean energy loss over scored steps = `energy_fidelity` − `energy_diversity`, and
    `context_spread`, how much the energy head's input differs between the scored steps (see `context_spread`)."""

    loss: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    cache: DynamicCache | None = None
    energy_fidelity: torch.Tensor | None = None
    energy_diversity: torch.Tensor | None = None
    context_spread: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


# One output class for every multi-token family (model_calls: backbone calls; the prefill, which also yields the
# first chunk, included); the family name is kept for existing imports.
CALMGenerateOutput = GenerateOutput


@dataclass
class CALMGenerationOptions(GenerationOptions):
    """CALM's own `generate()` options (next to the transformers ones the shared skeleton honours).

    Prompt alignment rule: chunks are counted from the END of the prompt, so the last prompt token closes a chunk.
    A prompt whose length is not a multiple of K is left-filled with `eos_token_id` (the document separator;
    `pad_token_id` if there is none) up to the next multiple, i.e. it is read as the start of a new document, which
    is how every document appears in the training stream. Left padding (attention_mask 0) is filled the same way;
    chunks with no real token are masked out. Exactly `max_new_tokens` tokens come back unless EOS stops a row
    (inside a chunk if need be).

    temperature (default config.generation_temperature = 1): T in (0, 1]. T = 1 draws one latent per step.
    temperature_sampler "pool" (default): draw `temperature_pool_size` latents, decode them, pick a chunk with
        weight C(count, 1/T) (approximate; see `pool_temperature_choice`). "exact": rejection sampling of the
        tempered law p^(1/T)/Σ at any T in (0, 1] (see `exact_temperature_scan`).
    do_sample=False takes the most frequent chunk of the pool (T -> 0).
    noise_seeds: one int per row; row b draws all its noise from a generator seeded with it, so a row gives the
        same tokens alone or in any batch. Default: seeds drawn from the global torch RNG.
    draws: where the random numbers come from instead (`RowGenerators` or `ReplayedDraws`); `noise_seeds` is then
        unused.
    top_k / top_p: refused unless 0 / 1.0 (CALM has no token probabilities).
    """

    family: ClassVar[str] = "CALM"
    row_seeds_option: ClassVar[str] = "noise_seeds"

    temperature_sampler: str | None = None
    temperature_pool_size: int | None = None
    noise_seeds: list[int] | None = None
    draws: "RowGenerators | ReplayedDraws | None" = None

    def resolved(self, config: CALMConfig, batch_size: int) -> "CALMGenerationOptions":
        """Defaults from `config`, every value checked (ValueError naming the option), one seed per row."""
        refuse_token_filters("CALM", "no token probabilities; use temperature", self.top_k, self.top_p)
        temperature = config.generation_temperature if self.temperature is None else float(self.temperature)
        if not 0 < temperature <= 1:
            raise ValueError(f"temperature must be in (0, 1] for CALM (T > 1 cannot be drawn from an implicit "
                             f"sampler), got {temperature}")
        sampler = config.temperature_sampler if self.temperature_sampler is None else self.temperature_sampler
        if sampler not in TEMPERATURE_SAMPLERS:
            raise ValueError(f"temperature_sampler must be one of {TEMPERATURE_SAMPLERS}, got {sampler!r}")
        pool_size = config.temperature_pool_size if self.temperature_pool_size is None else self.temperature_pool_size
        if pool_size < 1:
            raise ValueError(f"temperature_pool_size must be at least 1, got {pool_size}")
        # Duck-typed: remote code has its own copies of the classes.
        if self.draws is not None and not callable(getattr(self.draws, "uniform", None)):
            raise ValueError(f"draws must be a RowGenerators or a ReplayedDraws, got {type(self.draws).__name__}")
        return replace(self, temperature=temperature, temperature_sampler=sampler, temperature_pool_size=pool_size,
                       noise_seeds=row_seeds(self.noise_seeds, batch_size, "noise_seeds"))

    @classmethod
    def sampling_defaults(cls, config: CALMConfig) -> dict:
        return {"do_sample": True, "temperature": float(config.generation_temperature)}


class RowGenerators:
    """CALM decoding's random numbers: one torch.Generator per row, seeded from `seeds`, so that a row draws the same
    numbers alone or in any batch."""

    def __init__(self, seeds: list[int]):
        self.generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]

    def uniform(self, rows: list[int], shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
        """[len(rows), *shape] uniform in [0, 1), each row from its own generator."""
        return torch.stack([torch.rand(shape, generator=self.generators[r], dtype=dtype) for r in rows])


class ReplayedDraws:
    """Uniform draws recorded elsewhere, replayed in order: each request takes the next tensor [batch, *shape] and
    keeps the requested rows. With the draws another implementation made, decoding reproduces its samples
    (hf_latentlm/official/calm.py records the official code's)."""

    def __init__(self, draws: list[torch.Tensor]):
        self.draws = list(draws)

    def uniform(self, rows: list[int], shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
        if not self.draws:
            raise ValueError("ReplayedDraws ran out of recorded draws")
        draw = self.draws.pop(0)
        if tuple(draw.shape[1:]) != tuple(shape) or max(rows) >= draw.shape[0]:
            raise ValueError(f"the next recorded draw has shape {tuple(draw.shape)}; decoding asked for rows {rows} "
                             f"of shape {tuple(shape)}")
        return draw[list(rows)].to(dtype)


@dataclass
class CALMDecodingState:
    """What CALM decoding carries from one step to the next."""

    cache: DynamicCache  # backbone keys of every chunk so far
    attention_mask: torch.Tensor  # [B, tokens so far] token-level mask (prompt left-fill and padding are 0)
    hidden: torch.Tensor  # [B, d] last hidden state: the energy head draws the next chunk from it
    last_chunk: torch.Tensor | None  # [B, K] chunk drawn last step, fed back at the start of the next one
    draws: RowGenerators | ReplayedDraws  # where the noise and uniforms come from
    options: CALMGenerationOptions


class ResidualMLP(nn.Module):
    """x + SwiGLU(RMSNorm(x)): the autoencoder's building block."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.mlp = SwiGLUMLP(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def chunk_tokens(input_ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T] -> [B, T/K, K]; T must be a multiple of K."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] % chunk_size:
        raise ValueError(f"sequence length {input_ids.shape[1]} is not a multiple of chunk_size={chunk_size}")
    return input_ids.view(input_ids.shape[0], -1, chunk_size)


# ====================================================================================================================
# Autoencoder
# ====================================================================================================================

class CALMAutoencoder(BackbonePreTrainedModel):
    """Chunk of K tokens <-> latent z ∈ R^l. `forward(input_ids, labels=...)` trains it on packed rows (each row cut
    into chunks of K); `encode` / `decode` / `decode_logits` are the maps CALM uses. Output logits are computed with
    the token embedding matrix (tied by construction)."""

    config_class = CALMAutoencoderConfig
    base_model_prefix = "autoencoder"
    supports_gradient_checkpointing = False  # no attention blocks to checkpoint
    _no_split_modules = None
    _can_compile_fullgraph = True  # MLPs only; eval and training forwards compile (tests/modeling/test_compile.py)
    # No attention at all: any implementation is fine, so the CALM around it can switch freely.
    _supports_sdpa = _supports_flex_attn = _supports_flash_attn = True
    # Hidden states: the embeddings, then the output of every residual block, encoder then decoder.
    _can_record_outputs = {"hidden_states": ResidualMLP}
    # `resize_token_embeddings` is supported as is: the output logits read `embed_tokens.weight` and token
    # replacement reads `config.vocab_size`, which transformers' resize updates together (tests/modeling/test_calm.py).

    def __init__(self, config: CALMAutoencoderConfig):
        super().__init__(config)
        h, i, k, eps = config.hidden_size, config.intermediate_size, config.chunk_size, config.rms_norm_eps
        encoder_token, encoder_chunk = config.stage_layers(config.num_encoder_layers)
        decoder_chunk, decoder_token = config.stage_layers(config.num_decoder_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.encoder_token_layers = nn.ModuleList(ResidualMLP(h, i, eps) for _ in range(encoder_token))
        bias = config.projection_bias
        self.encoder_squeeze = nn.Linear(k * h, h, bias=bias)
        self.encoder_chunk_layers = nn.ModuleList(ResidualMLP(h, i, eps) for _ in range(encoder_chunk))
        self.encoder_norm = RMSNorm(h, eps=eps)
        self.to_posterior = nn.Linear(h, 2 * config.latent_size)
        self.decoder_in = nn.Linear(config.latent_size, h, bias=bias)
        self.decoder_chunk_layers = nn.ModuleList(ResidualMLP(h, i, eps) for _ in range(decoder_chunk))
        self.decoder_expand = nn.Linear(h, k * h, bias=bias)
        self.decoder_token_layers = nn.ModuleList(ResidualMLP(h, i, eps) for _ in range(decoder_token))
        self.decoder_norm = RMSNorm(h, eps=eps)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self.embed_tokens:
            module.weight.normal_(0.0, self.config.embedding_init_std)

    def encode(self, chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """chunks [..., K] token ids -> posterior (mean, log σ), each [..., l]."""
        x = self.embed_tokens(chunks)
        for layer in self.encoder_token_layers:
            x = layer(x)
        x = self.encoder_squeeze(x.flatten(-2))
        for layer in self.encoder_chunk_layers:
            x = layer(x)
        mean, log_std = self.to_posterior(self.encoder_norm(x)).chunk(2, dim=-1)
        if self.config.log_std_min is None:
            return mean, log_std
        return mean, log_std.clamp(self.config.log_std_min, self.config.log_std_max)

    def decode_logits(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [..., l] -> token logits [..., K, V]."""
        x = self.decoder_in(latents.to(self.decoder_in.weight.dtype))
        for layer in self.decoder_chunk_layers:
            x = layer(x)
        x = self.decoder_expand(x).unflatten(-1, (self.config.chunk_size, self.config.hidden_size))
        for layer in self.decoder_token_layers:
            x = layer(x)
        return F.linear(self.decoder_norm(x), self.embed_tokens.weight)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [..., l] -> the K most likely tokens [..., K]."""
        return self.decode_logits(latents).argmax(-1)

    def replace_tokens(self, chunks: torch.Tensor) -> torch.Tensor:
        """Training-time corruption: each token is replaced with probability p, by `replace_token_id` or, when that
        is None, by a uniformly random token."""
        p, fixed = self.config.token_replace_prob, self.config.replace_token_id
        if not self.training or p == 0:
            return chunks
        swap = torch.rand(chunks.shape, device=chunks.device) < p
        replacement = torch.full_like(chunks, fixed) if fixed is not None else torch.randint_like(
            chunks, self.config.vocab_size)
        return torch.where(swap, replacement, chunks)

    @capture_outputs
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, attention_mask=None,
                sample_latent: bool | None = None, **kwargs) -> CALMAutoencoderOutput:
        """input_ids [B, T] (T a multiple of K) or chunks [B, L, K]. With labels (same shape; −100 = ignore), the
        loss over the scored tokens (not −100, and not padding where `attention_mask` [B, T] is 0; every chunk is
        encoded on its own, so padding changes nothing else). Training mode corrupts the input and drops out the
        sampled latent. sample_latent: decode a sampled z = μ + σ·ε (True) or the posterior mean μ (False); default:
        sample only in training, so that an eval-mode forward is deterministic. `output_hidden_states` and
        `return_dict` apply as in transformers."""
        check_forward_kwargs(self, kwargs)
        cfg = self.config
        chunks = input_ids if input_ids.dim() == 3 else chunk_tokens(input_ids, cfg.chunk_size)
        mean, log_std = self.encode(self.replace_tokens(chunks))
        std = log_std.exp()
        sample = self.training if sample_latent is None else sample_latent
        z = mean + std * torch.randn_like(mean) if sample else mean
        z = F.dropout(z, p=cfg.latent_dropout, training=self.training)
        logits = self.decode_logits(z)
        out = CALMAutoencoderOutput(logits=logits, latent_mean=mean, latent_log_std=log_std,
                                    posterior_std=std.detach().mean())
        if labels is None:
            return out
        targets = labels.reshape(chunks.shape)
        if attention_mask is not None:  # padding is never a target
            targets = targets.masked_fill(~attention_mask.reshape(chunks.shape).bool(), -100)
        scored = targets != -100
        nll = F.cross_entropy(logits.flatten(0, -2).float(), targets.reshape(-1), ignore_index=-100)
        # KL(N(μ, σ²) || N(0, 1)) per dimension, floored at kl_clamp ("free bits"), summed over dimensions, averaged
        # over the chunks with a scored token (all of them in packed rows), as the reconstruction is.
        kl_dim = 0.5 * (mean.float().pow(2) + std.float().pow(2) - 1) - log_std.float()
        kl_chunk = kl_dim.clamp(min=cfg.kl_clamp).sum(-1)
        chunk_scored = scored.any(-1)
        kl = (kl_chunk * chunk_scored).sum() / chunk_scored.sum().clamp(min=1)
        out.loss = cfg.chunk_size * nll + cfg.kl_weight * kl
        out.reconstruction_nll, out.kl = nll.detach(), kl.detach()
        out.token_accuracy = ((logits.argmax(-1) == targets) & scored).sum() / scored.sum().clamp(min=1)
        return out

    @torch.no_grad()
    def reconstruction_accuracy(self, input_ids: torch.Tensor, generator: torch.Generator | None = None) -> dict:
        """Token accuracy of decoding the posterior mean and a sampled z = μ + σ·ε, and the mean σ, on clean input
        (no corruption, no dropout). input_ids [B, T], T a multiple of K."""
        chunks = chunk_tokens(input_ids, self.config.chunk_size)
        mean, log_std = self.encode(chunks)
        noise = torch.randn(mean.shape, generator=generator, device="cpu").to(mean)
        from_mean = self.decode(mean) == chunks
        from_sample = self.decode(mean + log_std.exp() * noise) == chunks
        return {"mean_accuracy": from_mean.float().mean().item(), "sampled_accuracy": from_sample.float().mean().item(),
                "posterior_std": log_std.exp().mean().item(), "num_tokens": chunks.numel()}


# ====================================================================================================================
# CALM
# ====================================================================================================================

class SwiGLUEnergyHeadBlock(nn.Module):
    """x + SwiGLU(RMSNorm(W_x x + W_h h)): fuse the running vector with the hidden state, refine, add back."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.fuse_latent = nn.Linear(hidden_size, hidden_size, bias=False)
        self.fuse_hidden = nn.Linear(hidden_size, hidden_size, bias=False)
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.mlp = SwiGLUMLP(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(self.fuse_latent(x) + self.fuse_hidden(hidden)))


class SwiGLUEnergyHead(nn.Module):
    """`energy_head_type="swiglu"`, this project's first head (its parameter names are those of older checkpoints):
    (hidden h [..., d], noise ε [..., S, d_noise]) -> S latent samples [..., S, l]."""

    def __init__(self, config: CALMConfig):
        super().__init__()
        d = config.hidden_size
        self.hidden_proj = nn.Linear(d, d)
        self.noise_proj = nn.Linear(config.noise_size, d)
        self.blocks = nn.ModuleList(SwiGLUEnergyHeadBlock(d, config.rms_norm_eps)
                                    for _ in range(config.num_head_blocks))
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.out = nn.Linear(d, config.latent_size)
        self.out.zero_init = True  # paper: last layer zero-initialised

    def forward(self, hidden: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        h = self.hidden_proj(hidden)[..., None, :]  # shared by the S samples of a step
        x = self.noise_proj(noise.to(h.dtype))
        for block in self.blocks:
            x = block(x, h)
        return self.out(self.norm(x))


class ReferenceEnergyHeadBlock(nn.Module):
    """The reference code's residual block (≈ 6d² weights): the running vector x, layer-normed, is concatenated with
    the conditioning c and goes through Linear(2d, d) -> SiLU -> Linear(d, d) -> SiLU -> Linear(d, 2d) -> gated SiLU
    -> Linear(d, d), added back to x."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        d = hidden_size
        self.norm = nn.LayerNorm(d, eps=eps)
        self.fuse = nn.Linear(2 * d, d)
        self.inner = nn.Linear(d, d)
        self.gate_up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.norm(x), condition.expand_as(x)], dim=-1)
        gate, up = self.gate_up(F.silu(self.inner(F.silu(self.fuse(y))))).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ReferenceEnergyHead(nn.Module):
    """`energy_head_type="reference"`, the reference code's MLP generator: noise and hidden state each
    through a Linear and a LayerNorm, residual blocks, then LayerNorm -> Linear -> SiLU -> Linear (zero-initialised).
    (hidden h [..., d], noise ε [..., S, d_noise]) -> S latent samples [..., S, l]."""

    def __init__(self, config: CALMConfig):
        super().__init__()
        d, eps = config.hidden_size, layer_norm_eps(config)
        self.hidden_proj = nn.Linear(d, d)
        self.hidden_norm = nn.LayerNorm(d, eps=eps)
        self.noise_proj = nn.Linear(config.noise_size, d)
        self.noise_norm = nn.LayerNorm(d, eps=eps)
        self.blocks = nn.ModuleList(ReferenceEnergyHeadBlock(d, eps) for _ in range(config.num_head_blocks))
        self.final_norm = nn.LayerNorm(d, eps=eps)
        self.final_proj = nn.Linear(d, d)
        self.out = nn.Linear(d, config.latent_size)
        self.out.zero_init = True  # paper and reference: last layer zero-initialised

    def forward(self, hidden: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        c = self.hidden_norm(self.hidden_proj(hidden))[..., None, :]  # shared by the S samples of a step
        x = self.noise_norm(self.noise_proj(noise.to(c.dtype)))
        for block in self.blocks:
            x = block(x, c)
        return self.out(F.silu(self.final_proj(self.final_norm(x))))


ENERGY_HEADS = {"reference": ReferenceEnergyHead, "swiglu": SwiGLUEnergyHead}


def layer_norm_eps(config: CALMConfig) -> float:
    """eps of CALM's LayerNorms: `config.layer_norm_eps`, or the RMSNorms' when unset."""
    return config.rms_norm_eps if config.layer_norm_eps is None else config.layer_norm_eps


def energy_head_parameter_count(config: CALMConfig) -> int:
    """Parameters of the energy head `config` describes, counted from the architecture (biases and norm scales
    included), for reports and FLOP counts without building it. d = hidden_size, l = latent_size."""
    d, l, noise, blocks = config.hidden_size, config.latent_size, config.noise_size, config.num_head_blocks
    if config.energy_head_type == "reference":
        inputs = (d * d + d) + 2 * d + (noise * d + d) + 2 * d  # Linear + LayerNorm, for h and for ε
        block = 2 * d + (2 * d * d + d) + (d * d + d) + (2 * d * d + 2 * d) + (d * d + d)  # 6d² + 7d
        final = 2 * d + (d * d + d) + (d * l + l)
    else:
        inputs = (d * d + d) + (noise * d + d)
        block = 2 * d * d + d + 3 * d * d  # fuse_latent, fuse_hidden, RMSNorm, SwiGLU(d, d): 5d² + d
        final = d + (d * l + l)
    return inputs + blocks * block + final


@torch.no_grad()
def context_spread(hidden: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Feature-wise standard deviation of `hidden` [B, L, d] over the scored steps (`scored` [B, L] bool), averaged
    over features: a training diagnostic. The energy head sees the context only through this state (RMS 1 after the
    final norm); a spread near 0 means every step hands it the same vector and the model has stopped using its
    context, which the loss alone does not show (docs/benchmarks.md, "Energy heads"). 0 with under two steps."""
    weight = scored.to(torch.float32)[..., None]
    count = weight.sum()
    h = hidden.detach().float()
    mean = (h * weight).sum((0, 1)) / count.clamp(min=1)
    variance = ((h - mean) ** 2 * weight).sum((0, 1)) / (count - 1).clamp(min=1)
    return torch.where(count >= 2, variance.sqrt().mean(), 0.0)


class CALMPreTrainedModel(BackbonePreTrainedModel):
    config_class = CALMConfig
    _supports_flash_attn = True  # the backbone's masks are causal + padding (CALMModel passes flash the padding)
    _can_record_outputs = {"hidden_states": DecoderBlock, "attentions": OutputRecorder(AttentionProbs)}
    # The inference forward compiles with fullgraph=True, and so does the energy objective (tests/modeling/
    # test_compile.py).
    _can_compile_fullgraph = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, nn.LayerNorm):  # the reference energy head's norms (the shared init knows RMSNorm only)
            module.weight.fill_(1.0)
            module.bias.zero_()

    def check_vocab_resize(self, size: int) -> None:
        """Refused unless the size stays the same: the vocabulary belongs to the frozen autoencoder, which maps every
        chunk to and from its latent, so a new token has no latent and the saved config would disagree with the
        autoencoder's. Resize the autoencoder, retrain it, then build a new CALM with `from_autoencoder`."""
        refuse_vocab_resize(self, size, "the frozen autoencoder (chunks <-> latents)", "a CALMAutoencoder",
                            "CALMForCausalLM.from_autoencoder")


class CALMModel(CALMPreTrainedModel):
    """Backbone over chunk steps: token embedding, input compression of each chunk's K embeddings, decoder
    blocks, final norm. One rotary position per chunk."""

    # The causal LM's own parts, which `AutoModel` on its checkpoint leaves out on purpose: not reported as
    # unexpected keys (the README's backbone snippet loads quietly).
    _keys_to_ignore_on_load_unexpected = [r"^(autoencoder|energy_head)(\.|$)"]

    def __init__(self, config: CALMConfig):
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.compress_in = nn.Linear(config.chunk_size * d, 2 * d)
        self.compress_out = nn.Linear(2 * d, d)
        self.compress_norm = (RMSNorm(d, eps=config.rms_norm_eps) if config.input_norm == "rms"
                              else nn.LayerNorm(d, eps=layer_norm_eps(config)))
        self.layers = decoder_layers(config)
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary = RotaryEmbedding.from_config(config)
        self.gradient_checkpointing = False
        self.post_init()

    def compress(self, token_embeds: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, d], T a multiple of K -> one input vector per chunk [B, T / K, d]."""
        batch, length, width = token_embeds.shape
        K = self.config.chunk_size
        if length % K:
            raise ValueError(f"sequence length {length} is not a multiple of chunk_size={K}")
        x = token_embeds.reshape(batch, length // K, K * width)
        return self.compress_norm(self.compress_out(F.silu(self.compress_in(x))))

    @deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")
    @capture_outputs
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        """The backbone over chunk steps, as transformers' base models: one hidden state per chunk of K tokens.

        input_ids: [B, T] tokens, T a multiple of chunk_size (or `inputs_embeds`: their token embeddings
            [B, T, d], `get_input_embeddings()(input_ids)`). attention_mask: token-level [B, cached + new tokens];
            a chunk is attended when any of its tokens is real. position_ids: chunk positions [B, T / K] (default:
            from the mask, or consecutive).
        `output_hidden_states` / `output_attentions` (the latter with attn_implementation="eager") are recorded by
        transformers' output capturing (`_can_record_outputs`).
        """
        check_backbone_inputs(self, kwargs, input_ids=input_ids, inputs_embeds=inputs_embeds)
        K = self.config.chunk_size
        if input_ids is not None:
            chunk_tokens(input_ids, K)  # refuses ids that are not [batch, whole chunks]
        hidden = self.compress(self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds)
        batch, length = hidden.shape[:2]
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        chunk_mask = None
        if attention_mask is not None:
            if attention_mask.shape[-1] != (past + length) * K:
                raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} tokens, expected cached + new = "
                                 f"{(past + length) * K}")
            chunk_mask = attention_mask.view(batch, past + length, K).any(-1)  # a chunk with a real token counts
        position_ids, mask = causal_layout(chunk_mask, batch, length, past, hidden.device, position_ids)
        if is_flash_attention_requested(self.config):  # causal by its own flag: it takes the padding mask alone
            mask = chunk_mask
        cos, sin = self.rotary(position_ids, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask, cache=cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), cache=cache)


class CALMForCausalLM(CALMPreTrainedModel, MultiTokenGenerationMixin):
    """CALM: backbone + energy head + frozen autoencoder. `forward(input_ids)` returns one hidden state per chunk;
    `forward(input_ids, labels=...)` the energy loss; `generate()` samples K tokens per backbone call.
    Build a trainable model around a trained autoencoder with `from_autoencoder`."""

    generation_options_class = CALMGenerationOptions
    base_model_class = CALMModel

    def __init__(self, config: CALMConfig):
        super().__init__(config)
        self.model = CALMModel(config)
        self.energy_head = ENERGY_HEADS[config.energy_head_type](config)
        self.autoencoder = CALMAutoencoder(config.autoencoder_config)
        self.post_init()
        self.freeze_components()

    def freeze_components(self) -> None:
        """The autoencoder is frozen."""
        self.autoencoder.requires_grad_(False)

    @classmethod
    def from_autoencoder(cls, autoencoder: "str | CALMAutoencoder", config: CALMConfig | None = None,
                         **config_kwargs) -> "CALMForCausalLM":
        """A fresh CALM whose frozen autoencoder is a copy of `autoencoder` (a trained `CALMAutoencoder` or its
        folder). `config` (or `config_kwargs` for a new `CALMConfig`) must agree with it on vocab_size and
        chunk_size; the autoencoder's config is embedded (without its path) and its weights copied in."""
        if not isinstance(autoencoder, CALMAutoencoder):
            autoencoder = CALMAutoencoder.from_pretrained(autoencoder)
        config = composite_config(CALMConfig, "autoencoder_config", autoencoder.config, config,
                                  component_name="autoencoder", shared=("vocab_size", "chunk_size"), **config_kwargs)
        model = cls(config)
        model.autoencoder.load_state_dict(autoencoder.state_dict())
        return model

    def train(self, mode: bool = True):
        super().train(mode)
        self.autoencoder.eval()  # frozen: never corrupt inputs or drop out latents
        return self

    # ------------------------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------------------------

    @head_forward
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, **kwargs) -> CALMOutput:
        """input_ids [B, T], T a multiple of chunk_size; returns one hidden state per chunk (CALM has no token
        logits). attention_mask: token-level [B, cached + T]. With `labels` (same shape as input_ids, −100 =
        ignore): the energy loss of predicting the latent of chunk i+1 from the hidden state of chunk i.
        Transformers' `output_hidden_states`, `output_attentions`, `return_dict` apply."""
        check_forward_kwargs(self, kwargs)
        if labels is not None:
            if cache is not None or inputs_embeds is not None:
                raise ValueError("the CALM training objective takes input_ids and labels only (no cache/inputs_embeds)")
            K = self.config.chunk_size
            return self.energy_objective(chunk_tokens(input_ids, K), chunk_tokens(labels, K), attention_mask, **kwargs)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        return CALMOutput(last_hidden_state=out.last_hidden_state, cache=out.cache, hidden_states=out.hidden_states,
                          attentions=out.attentions)

    def sample_latents(self, hidden: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """hidden [..., d], noise [..., S, d_noise] in [-0.5, 0.5] -> S latent samples [..., S, l]."""
        return self.energy_head(hidden, noise)

    def energy_objective(self, chunks: torch.Tensor, label_chunks: torch.Tensor, attention_mask=None,
                         **kwargs) -> CALMOutput:
        cfg = self.config
        if chunks.shape[1] < 2:
            raise ValueError(f"the energy loss needs at least 2 chunks (2 × chunk_size = {2 * cfg.chunk_size} tokens) "
                             f"per row, got {chunks.shape[1] * cfg.chunk_size}")
        out = self.model(input_ids=chunks[:, :-1].flatten(1),
                         attention_mask=None if attention_mask is None else attention_mask[:, :-cfg.chunk_size],
                         **kwargs)
        hidden = out.last_hidden_state
        targets = label_chunks[:, 1:]
        scored = (targets != -100).all(-1)
        if attention_mask is not None:
            scored &= attention_mask[:, cfg.chunk_size:].view_as(targets).bool().all(-1)
        # Draws for every step (scored or not): from the global RNG in training; in eval mode one fixed row from
        # `evaluation_generator`, shared by every row, so the same batch gives the same loss.
        batch, steps = scored.shape
        target_shape = (steps, cfg.num_target_samples, cfg.latent_size)
        model_shape = (steps, cfg.num_model_samples, cfg.noise_size)
        if self.training:
            target_noise = torch.randn(batch, *target_shape, device=hidden.device)
            model_noise = torch.rand(batch, *model_shape, device=hidden.device, dtype=hidden.dtype) - 0.5
        else:
            generator = evaluation_generator()
            target_noise = fixed_row_draw(generator, batch, target_shape, hidden.device)
            model_noise = fixed_row_draw(generator, batch, model_shape, hidden.device, hidden.dtype, uniform=True) - 0.5
        loss, fidelity, diversity = self.masked_energy_loss(hidden, targets, scored, target_noise, model_noise)
        return CALMOutput(loss=loss, last_hidden_state=hidden, energy_fidelity=fidelity.detach(),
                          energy_diversity=diversity.detach(), context_spread=context_spread(hidden, scored),
                          hidden_states=out.hidden_states, attentions=out.attentions)

    def masked_energy_loss(self, hidden: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor,
                           target_noise: torch.Tensor, model_noise: torch.Tensor):
        """Mean energy loss over the scored steps, and its fidelity and diversity parts (scalars).

        hidden [B, L, d]: the state that predicts each target chunk; targets [B, L, K] (−100 allowed where not
        scored); scored [B, L] bool; target_noise [B, L, M, l] standard normal (samples of the target posterior
        μ + σ·ε); model_noise [B, L, N, d_noise] uniform in [-0.5, 0.5] (the energy head's input).
        Every step is computed and the per-step losses are weighted by `scored` (no boolean indexing: static shapes
        under torch.compile, the same value); nothing scored gives 0, not NaN."""
        loss, fidelity, diversity = self.energy_terms(hidden, targets, target_noise, model_noise)
        keep, steps = scored.flatten(), scored.sum().clamp(min=1)
        return tuple(torch.where(keep, part.flatten(), 0.0).sum() / steps for part in (loss, fidelity, diversity))

    def energy_terms(self, hidden: torch.Tensor, targets: torch.Tensor, target_noise: torch.Tensor,
                     model_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The energy loss of every step with the given draws, unreduced: (loss, fidelity, diversity), each [B, L].

        Arguments as `masked_energy_loss` (targets may hold −100 where the caller ignores a step: read as token 0).
        The targets' posterior samples are μ + σ·target_noise from the frozen autoencoder (no gradient); the model's
        samples come from the energy head with `model_noise`. Used by the training loss (masked mean over steps) and
        by per-response scores (sums over a response's chunks, hf_latentlm/training/scorers.py)."""
        with torch.no_grad():
            mean, log_std = self.autoencoder.encode(targets.clamp(min=0))  # unscored steps: any token, weight 0
            target_samples = mean[..., None, :] + log_std.exp()[..., None, :] * target_noise  # [B, L, M, l]
        samples = self.sample_latents(hidden, model_noise).float()  # [B, L, N, l]
        loss, fidelity, diversity = energy_loss(samples.flatten(0, 1), target_samples.flatten(0, 1).float())
        return tuple(part.view(targets.shape[:2]) for part in (loss, fidelity, diversity))

    # ------------------------------------------------------------------------------------------------------------
    # generate
    # ------------------------------------------------------------------------------------------------------------

    def compiled_methods(self) -> list[tuple[nn.Module, str]]:
        """The backbone, and the energy head and autoencoder read-out that draw each chunk."""
        return [*super().compiled_methods(), (self.energy_head, "forward"), (self.autoencoder, "decode")]

    def _start_decoding(self, input_ids, request, options: CALMGenerationOptions):
        """Left-fill the prompt to whole chunks (see `CALMGenerationOptions`) and encode it; the prefill's last
        hidden state yields the first chunk."""
        cfg = self.config
        prompt_len = input_ids.shape[1]
        fill_token = cfg.eos_token_id if cfg.eos_token_id is not None else request.pad_token_id
        fill = (-prompt_len) % cfg.chunk_size
        mask = F.pad(request.attention_mask, (fill, 0))
        ids = torch.where(mask.bool(), F.pad(input_ids, (fill, 0)), fill_token)
        cache = DynamicCache(config=cfg)
        hidden = self(input_ids=ids, attention_mask=mask, cache=cache).last_hidden_state[:, -1]
        draws = RowGenerators(options.noise_seeds) if options.draws is None else options.draws
        return CALMDecodingState(cache, mask, hidden, None, draws, options), 1

    def _decoding_step(self, state: CALMDecodingState, new_tokens) -> DecodingStep:
        """Feed the previous chunk back (one backbone call; the first chunk comes from the prefill), then draw
        the next chunk of K tokens."""
        called = state.last_chunk is not None
        if called:
            state.attention_mask = torch.cat([state.attention_mask, state.attention_mask.new_ones(
                state.last_chunk.shape)], dim=1)
            state.hidden = self(input_ids=state.last_chunk, attention_mask=state.attention_mask,
                                cache=state.cache).last_hidden_state[:, -1]
        opt, hidden, draws = state.options, state.hidden, state.draws
        if not opt.do_sample:
            chunk = self._pool_step(hidden, draws, opt.temperature_pool_size, 0.0)
        elif opt.temperature == 1.0:
            chunk = self.autoencoder.decode(self.sample_latents(hidden, self._noise(draws, 1, hidden))[:, 0])
        elif opt.temperature_sampler == "pool":
            chunk = self._pool_step(hidden, draws, opt.temperature_pool_size, opt.temperature)
        else:
            chunk = self._exact_step(hidden, draws, opt.temperature, ~new_tokens.finished)
        state.last_chunk = chunk
        return DecodingStep(chunk, model_calls=int(called))

    def _noise(self, draws, count: int, hidden: torch.Tensor, rows: list[int] | None = None):
        """[len(rows), count, d_noise] noise in [-0.5, 0.5] (uniform draws − 0.5 in the hidden dtype, as the official
        head draws it)."""
        rows = list(range(hidden.shape[0])) if rows is None else rows
        return draws.uniform(rows, (count, self.config.noise_size)).to(hidden) - 0.5

    def _pool_step(self, hidden, draws, pool_size: int, temperature: float) -> torch.Tensor:
        """Approximate temperature sampling: decode a pool of draws per row, pick a chunk (C(count, 1/T) weights)."""
        chunks = self.autoencoder.decode(self.sample_latents(hidden, self._noise(draws, pool_size, hidden)))
        uniforms = draws.uniform(list(range(hidden.shape[0])), (), torch.float64)
        picked = pool_temperature_choice(chunks, temperature, uniforms.to(hidden.device))
        return chunks[torch.arange(chunks.shape[0], device=chunks.device), picked]

    def _exact_step(self, hidden, draws, temperature: float, active: torch.Tensor) -> torch.Tensor:
        """Exact temperature sampling (`exact_temperature_scan`) for the rows in `active`. Each round draws
        `exact_attempts` · ⌈1/T⌉ latents and as many uniforms per still-pending row (only those rows' generators
        advance); an attempt in progress carries over to the next round."""
        cfg = self.config
        draws_per_round = cfg.exact_attempts * math.ceil(inverse_temperature(temperature))
        state = RejectionState.start(hidden.shape[0], cfg.chunk_size, hidden.device)
        for _ in range(cfg.exact_max_rounds):
            rows = (active & ~state.accepted).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            noise = self._noise(draws, draws_per_round, hidden, rows.tolist())
            uniforms = draws.uniform(rows.tolist(), (draws_per_round,), torch.float64).to(hidden.device)
            chunks = self.autoencoder.decode(self.sample_latents(hidden[rows], noise))
            state = state.with_rows(rows, exact_temperature_scan(chunks, uniforms, temperature, state.rows(rows)))
        if bool((active & ~state.accepted).any()):
            raise ValueError(f"exact temperature sampling accepted no chunk at T = {temperature} in "
                             f"{cfg.exact_max_rounds * draws_per_round} draws; raise the temperature or use "
                             f"temperature_sampler='pool'")
        return torch.where(state.accepted[:, None], state.candidate, 0)


__all__ = ["CALMAutoencoder", "CALMAutoencoderOutput", "CALMForCausalLM", "CALMModel", "CALMPreTrainedModel",
           "CALMOutput", "CALMGenerateOutput", "CALMGenerationOptions", "CALMDecodingState", "ReplayedDraws",
           "RowGenerators", "ENERGY_HEADS", "ReferenceEnergyHead", "SwiGLUEnergyHead", "chunk_tokens", "context_spread",
           "energy_head_parameter_count"]
