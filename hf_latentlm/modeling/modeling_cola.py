"""Cola DLM (Continuous Latent Diffusion Language Model, paper 004; method-specs §3; docs/families/cola.md).

- `ColaTextVAE`: a causal text VAE, one latent of d_z channels per token; its decoder reads latents only and turns
  a block of them into that block's tokens in one parallel pass.
- `ColaForCausalLM`: the VAE and a block-causal DiT prior over its latents, trained jointly by flow matching.
  `generate()` integrates the ODE block by block (classifier-free guidance against the block alone, the clean
  history in a KV cache that the denoising steps only read), then the VAE decoder reads each block out to tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import ModelOutput
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .cola_official import InterleavedRotaryEmbedding, OfficialDiTBlock, OfficialTimestepEmbedding, vae_layers
from .configuration_cola import ODE_SOLVERS, ColaConfig, ColaVAEConfig
from .flow import FlowMatchEulerSampler, FlowMatchHeunSampler, TimestepEmbedding, make_time_sampler
from .generation import BlockLatentGenerationOptions
from .layers import (AttentionProbs, DecoderBlock, DiTBlock, RMSNorm, RotaryEmbedding, block_causal_layout,
                     dit_layers, evaluation_generator, fixed_row_draw, init_backbone_weights)
from .modeling_backbone import (BackbonePreTrainedModel, check_backbone_inputs, check_block_training_rows,
                                check_forward_kwargs, masked_cross_entropy, recording_nothing, scored_positions)
from .modeling_block_latent import BlockLatentForCausalLM, BlockLatentPreTrainedModel, BlockVelocityField


@dataclass
class ColaVAEOutput(ModelOutput):
    """`loss` = reconstruction CE + kl_weight·KL + mask_loss_weight·masked CE. `logits` [B, T, V]: the decoding of
    the sampled latents (of the posterior mean in eval mode unless `sample_latent=True`). The 0-dim parts are
    logged by the training loop; `token_accuracy` is that of `logits` on the scored tokens. `last_hidden_state`
    [B, T, hidden]: the encoder's final (normed) states, from which `latent_mean` is read; `hidden_states` /
    `attentions`: the encoder blocks', when asked."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    latent_mean: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    reconstruction_nll: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    mask_nll: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    logsnr: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class ColaOutput(ModelOutput):
    """`last_hidden_state` [B, T, d]: the DiT's state of each clean latent position (one per token). With labels:
    `loss` = flow_matching_weight·`flow_matching_loss` + vae_loss_weight·`vae_loss` + reference_kl_weight·
    `reference_kl`; the VAE's own parts are logged too."""

    loss: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    cache: DynamicCache | None = None
    flow_matching_loss: torch.Tensor | None = None
    vae_loss: torch.Tensor | None = None
    reconstruction_nll: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    mask_nll: torch.Tensor | None = None
    reference_kl: torch.Tensor | None = None
    logsnr: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


# ====================================================================================================================
# Text VAE
# ====================================================================================================================

class LogSNR(nn.Module):
    """The VAE's one noise level: logSNR = log(mean power of μ / σ²), σ² = exp(−logSNR), clamped to its bounds."""

    def __init__(self, config: ColaVAEConfig):
        super().__init__()
        self.initial, self.bounds = config.logsnr_init, (config.logsnr_min, config.logsnr_max)
        self.value = nn.Parameter(torch.tensor(float(config.logsnr_init)))  # frozen by the VAE if not learned

    def forward(self) -> torch.Tensor:
        return self.value.float().clamp(*self.bounds)


def vae_blocks(half: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None, cache,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, hidden] through the `layers` of a VAE half, block-causal over blocks of `vae_block_size` positions
    after the keys in `cache`."""
    past = cache.get_seq_length() if cache is not None else 0
    positions, mask = block_causal_layout(attention_mask, x.shape[0], x.shape[1], past, half.config.vae_block_size,
                                          x.device, position_ids)
    cos, sin = half.rotary(positions, dtype=x.dtype)
    for layer in half.layers:
        x = layer(x, cos, sin, mask, cache=cache)
    return x


class ColaVAEEncoder(nn.Module):
    """Tokens -> posterior mean μ [B, T, d_z] (LayerNorm'd over channels) and the shared logSNR."""

    def __init__(self, config: ColaVAEConfig):
        super().__init__()
        self.config = config
        official = config.official
        # The official embedding's extra last row serves as the [MASK] input here (its code ships no VAE training).
        self.embed_tokens = nn.Embedding(config.vocab_size + official, config.hidden_size)
        if not official:
            self.mask_embedding = nn.Embedding(1, config.hidden_size)  # the BERT-style pass's [MASK] input
        self.patch_in = nn.Linear(config.hidden_size, config.hidden_size) if official else None
        self.layers = vae_layers(config, config.num_hidden_layers)
        self.norm = None if official else RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.to_latent = nn.Linear(config.hidden_size, config.latent_size * (2 if official else 1))
        self.logsnr = None if official else LogSNR(config)
        self.rotary = RotaryEmbedding.from_config(config)

    def forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                masked: torch.Tensor | None = None, cache=None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] (or their token embeddings `inputs_embeds` [B, T, hidden]); attention_mask [B, cached + T]
        (left padding); masked [B, T] bool: positions whose input is the mask embedding; cache: keys of earlier
        tokens (written). Returns μ [B, T, d_z] in float32."""
        return self.posterior(self.states(input_ids, attention_mask, masked, cache, inputs_embeds))[0]

    def states(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
               masked: torch.Tensor | None = None, cache=None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The final normed states [B, T, hidden] that `forward` reads μ from (same arguments)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if masked is not None:
            mask_row = (self.embed_tokens.weight[self.config.vocab_size] if self.config.official
                        else self.mask_embedding.weight[0])
            x = torch.where(masked[..., None], mask_row.to(x.dtype), x)
        if self.patch_in is not None:
            x = self.patch_in(x)
        x = vae_blocks(self, x, attention_mask, cache)
        return x if self.norm is None else self.norm(x)

    def posterior(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ [B, T, d_z], σ) of the final states, float32: σ is one scalar (the logSNR's), or [B, T, d_z] from the
        posterior's own log-variance in the official form."""
        out = self.to_latent(states).float()
        if not self.config.official:
            # No affine parameters: power ≈ 1 per channel (code).
            return F.layer_norm(out, (out.shape[-1],)), self.posterior_std()
        mean, logvar = self._official_parameters(out)
        return mean, torch.exp(0.5 * logvar)

    def _official_parameters(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, logvar = out.chunk(2, dim=-1)
        return F.layer_norm(mean, (mean.shape[-1],), eps=self.config.rms_norm_eps), logvar.clamp(-30.0, 20.0)

    def posterior_log_variance(self, states: torch.Tensor) -> torch.Tensor:
        """log σ² [B, T, d_z] of the final states."""
        if self.config.official:
            return self._official_parameters(self.to_latent(states).float())[1]
        return (-self.logsnr()).expand(*states.shape[:-1], self.config.latent_size)

    def posterior_std(self) -> torch.Tensor:
        if self.logsnr is None:
            raise ValueError("the official-form VAE has a posterior σ per position: read it from posterior(states)")
        return torch.exp(-0.5 * self.logsnr())

    def logsnr_value(self, mean: torch.Tensor | None = None, std: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logSNR parameter; in the official form its estimate log(mean μ² / mean σ²) from a pass, if given."""
        if self.logsnr is not None:
            return self.logsnr()
        if mean is None or std is None:
            return None
        return torch.log(mean.detach().pow(2).mean() / std.detach().pow(2).mean().clamp(min=1e-30))


class ColaVAEDecoder(nn.Module):
    """Latents [B, T, d_z] -> token logits [B, T, V]; position i gives token i's logits. Block-causal over latent
    positions (`vae_block_size`), so a finished block decodes in one pass given the cache of earlier latents."""

    def __init__(self, config: ColaVAEConfig):
        super().__init__()
        self.config = config
        official = config.official
        self.latent_in = nn.Linear(config.latent_size, config.hidden_size)
        self.layers = vae_layers(config, config.num_decoder_blocks)
        self.patch_out = nn.Linear(config.hidden_size, config.hidden_size) if official else None
        self.norm = (nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps) if official
                     else RMSNorm(config.hidden_size, eps=config.rms_norm_eps))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=official)
        self.rotary = RotaryEmbedding.from_config(config)

    def forward(self, latents: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.latent_in(latents.to(self.latent_in.weight.dtype))
        x = vae_blocks(self, x, attention_mask, cache, position_ids)
        if self.patch_out is not None:
            x = self.patch_out(x)
        return self.lm_head(self.norm(x))


@torch.no_grad()
def init_cola_weights(module: nn.Module, std: float) -> None:
    """`_init_weights` of both Cola models: the shared modules' init, plus the logSNR's initial value."""
    init_backbone_weights(module, std)
    if isinstance(module, LogSNR):
        module.value.fill_(module.initial)
    elif isinstance(module, nn.LayerNorm) and module.weight is not None:  # the official form's affine norms
        module.weight.fill_(1.0)
        if module.bias is not None:
            module.bias.zero_()


def _detached(value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else value.detach()


def gaussian_kl(mean: torch.Tensor, std: torch.Tensor, ref_mean: torch.Tensor, ref_std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std²) ‖ N(ref_mean, ref_std²)) per position, summed over channels: [B, T] (std scalars or tensors
    broadcastable to mean)."""
    var, ref_var = std**2, ref_std**2
    per_channel = 0.5 * ((var + (mean - ref_mean) ** 2) / ref_var - 1 + torch.log(ref_var) - torch.log(var))
    return per_channel.expand_as(mean).sum(-1)


class ColaTextVAE(BackbonePreTrainedModel):
    """The text VAE on its own (stage 1). `forward(input_ids, labels=...)` returns its loss; `encode` / `decode_logits`
    / `sample_latents` are the maps Cola uses."""

    config_class = ColaVAEConfig
    base_model_prefix = "vae"
    main_input_name = "input_ids"
    _no_split_modules = ["DecoderBlock"]
    # The encoder's blocks, as an encoder model's. The VAE is also a submodel of `ColaModel`, whose recorded states
    # must be the DiT's only: a recorder hook fires into whichever capture is active, so the outer model reaches the
    # VAE only through `encode`, which records nothing (`recording_nothing`).
    _can_record_outputs = {"hidden_states": OutputRecorder(DecoderBlock, layer_name="encoder.layers"),
                           "attentions": OutputRecorder(AttentionProbs, layer_name="encoder.layers")}
    _can_compile_fullgraph = False  # the masked pass draws its mask inside forward

    def __init__(self, config: ColaVAEConfig):
        super().__init__(config)
        self.encoder = ColaVAEEncoder(config)
        self.decoder = ColaVAEDecoder(config)
        self.post_init()
        self.freeze_components()

    def freeze_components(self) -> None:
        """A fixed logSNR (`learn_logsnr=False`) gets no gradient."""
        if self.encoder.logsnr is not None:
            self.encoder.logsnr.value.requires_grad_(self.config.learn_logsnr)

    @torch.no_grad()
    def _init_weights(self, module):
        init_cola_weights(module, self.config.initializer_range)

    def get_input_embeddings(self):
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value):
        self.encoder.embed_tokens = value

    def get_output_embeddings(self):
        return self.decoder.lm_head

    def set_output_embeddings(self, value):
        self.decoder.lm_head = value

    @recording_nothing
    def encode(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None, cache=None,
               inputs_embeds: torch.Tensor | None = None, masked: torch.Tensor | None = None) -> torch.Tensor:
        """The posterior mean μ [B, T, d_z] (what inference uses) of the tokens (ids, or their embeddings)."""
        return self.encoder(input_ids, attention_mask, masked=masked, cache=cache, inputs_embeds=inputs_embeds)

    @recording_nothing
    def encode_posterior(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         masked: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ, σ) of the tokens (`ColaVAEEncoder.posterior`)."""
        return self.encoder.posterior(self.encoder.states(input_ids, attention_mask, masked=masked))

    def sample_latents(self, mean: torch.Tensor, noise: torch.Tensor | None = None,
                       std: torch.Tensor | None = None) -> torch.Tensor:
        """z = μ + σ·ε (ε standard normal; drawn from the global RNG unless given; σ the logSNR's unless given)."""
        noise = torch.randn_like(mean) if noise is None else noise
        return mean + (self.encoder.posterior_std() if std is None else std) * noise

    def to_prior_space(self, latents: torch.Tensor) -> torch.Tensor:
        """(z − latent_shifting_factor) · latent_scaling_factor: the space of the DiT and of the decoder's input."""
        cfg = self.config
        if cfg.latent_scaling_factor == 1 and cfg.latent_shifting_factor == 0:
            return latents
        return (latents - cfg.latent_shifting_factor) * cfg.latent_scaling_factor

    def decode_logits(self, latents: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder(latents, attention_mask)

    def losses(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
               sample_latent: bool = True, latent_noise: torch.Tensor | None = None) -> tuple[ColaVAEOutput, torch.Tensor]:
        """The VAE objective on one batch, and the latents it decoded (sampled z = μ + σ·ε with gradient, ε the
        given `latent_noise` or a fresh draw; or μ).

        Reconstruction: decode z from the clean input; KL(N(μ, σ²) ‖ N(0, I)); BERT-style: a second encoder pass
        with `mask_prob` of the scored inputs replaced by the mask embedding, whose latents must still decode to the
        masked tokens (CE at the masked positions only; skipped outside training or when its weight is 0)."""
        cfg = self.config
        scored = scored_positions(labels, attention_mask)
        states = self.encoder.states(input_ids, attention_mask)
        mean, std = self.encoder.posterior(states)
        z = self.sample_latents(mean, latent_noise, std) if sample_latent else mean
        logits = self.decoder(z, attention_mask)
        reconstruction = masked_cross_entropy(logits, labels, scored)
        zero = torch.zeros((), device=mean.device)
        kl_tokens = gaussian_kl(mean, std, zero, zero + 1.0)
        kl = (kl_tokens * scored).sum() / scored.sum().clamp(min=1)
        loss = reconstruction + cfg.kl_weight * kl
        mask_nll = None
        if self.training and cfg.mask_loss_weight > 0 and cfg.mask_prob > 0:
            masked = (torch.rand(scored.shape, device=scored.device) < cfg.mask_prob) & scored
            if cfg.official:  # σ per position: from the same pass
                masked_mean, masked_std = self.encode_posterior(input_ids, attention_mask, masked=masked)
                masked_z = self.sample_latents(masked_mean, std=masked_std)
            else:
                masked_z = self.sample_latents(self.encode(input_ids, attention_mask, masked=masked))  # not recorded
            mask_nll = masked_cross_entropy(self.decoder(masked_z, attention_mask), labels, masked)
            loss = loss + cfg.mask_loss_weight * mask_nll
        accuracy = ((logits.argmax(-1) == labels) & scored).sum() / scored.sum().clamp(min=1)
        out = ColaVAEOutput(loss=loss, logits=logits, latent_mean=mean, last_hidden_state=states,
                            reconstruction_nll=reconstruction.detach(),
                            kl=kl.detach(), mask_nll=None if mask_nll is None else mask_nll.detach(),
                            token_accuracy=accuracy, logsnr=_detached(self.encoder.logsnr_value(mean, std)))
        return out, z

    @capture_outputs
    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, sample_latent: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> ColaVAEOutput:
        """input_ids [B, T] (or their token embeddings `inputs_embeds`); with labels (same shape, −100 = ignore;
        label i is token i, no shift) the loss. sample_latent: decode z = μ + σ·ε (default in training) or μ
        (default in eval mode). `return_dict`, `output_hidden_states` and `output_attentions` (the encoder's
        blocks) apply as in transformers."""
        check_backbone_inputs(self, kwargs, input_ids=input_ids, inputs_embeds=inputs_embeds)
        check_forward_kwargs(self, kwargs)
        sample = self.training if sample_latent is None else sample_latent
        if labels is None:
            states = self.encoder.states(input_ids, attention_mask, inputs_embeds=inputs_embeds)
            mean, std = self.encoder.posterior(states)
            z = self.sample_latents(mean, std=std) if sample else mean
            return ColaVAEOutput(logits=self.decoder(z, attention_mask), latent_mean=mean, last_hidden_state=states,
                                 logsnr=_detached(self.encoder.logsnr_value(mean, std)))
        if inputs_embeds is not None:
            raise ValueError("the Cola VAE loss takes input_ids and labels (not inputs_embeds)")
        return self.losses(input_ids, labels, attention_mask, sample_latent=sample)[0]

    @torch.no_grad()
    def reconstruction_accuracy(self, input_ids: torch.Tensor, noise_levels: tuple[float, ...] = (),
                                generator: torch.Generator | None = None) -> dict:
        """Token accuracy on clean input (eval mode, no masking) of decoding the posterior mean and a sampled z, and
        of decoding z_t = (1 − t)·z + t·ε for each t in `noise_levels` (the paper's robustness curve), plus the
        logSNR. input_ids [B, T]."""
        mean, std = self.encode_posterior(input_ids)

        def accuracy(latents):
            return (self.decoder(latents).argmax(-1) == input_ids).float().mean().item()

        def normal():
            return torch.randn(mean.shape, generator=generator).to(mean.device)

        sampled = mean + std * normal()
        return {"accuracy_mean": accuracy(mean), "accuracy_sampled": accuracy(sampled),
                "accuracy_vs_noise": {float(t): accuracy((1 - t) * sampled + t * normal()) for t in noise_levels},
                "logsnr": self.encoder.logsnr_value(mean, std).item()}


# ====================================================================================================================
# Cola DLM: DiT prior + VAE
# ====================================================================================================================

class ColaPreTrainedModel(BlockLatentPreTrainedModel):
    config_class = ColaConfig
    component_class = ColaTextVAE
    component_attribute = "vae"
    _no_split_modules = ["DiTBlock", "DecoderBlock"]
    # Hidden states: the DiT's blocks only (not the VAE's), embeddings first. Attentions: the DiT's (`layers.*`).
    _can_record_outputs = {"hidden_states": DiTBlock,
                           "attentions": OutputRecorder(AttentionProbs, layer_name="layers")}

    @torch.no_grad()
    def _init_weights(self, module):
        init_cola_weights(module, self.config.initializer_range)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """The VAE owns the vocabulary at both ends (its encoder's embedding, its decoder's read-out), so it is
        resized as a whole (transformers' resize of the VAE); the frozen reference encoder gets the same new rows
        (its KL anchor starts where the VAE starts for a new token), and both configs record the new size, so the
        checkpoint saves, loads and generates."""
        vae = self.base_model.vae
        embedding = vae.resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        size = embedding.weight.shape[0]
        reference = getattr(self, "reference_encoder", None)
        if reference is not None:
            old = reference.embed_tokens.weight
            resized = nn.Embedding(size, old.shape[1], device=old.device, dtype=old.dtype)
            with torch.no_grad():
                kept = min(size, old.shape[0])
                resized.weight[:kept] = old[:kept]
                resized.weight[kept:] = embedding.weight[kept:]
            reference.embed_tokens = resized.requires_grad_(False)
        self.config.vocab_size = self.config.vae_config.vocab_size = size
        return embedding


class ColaModel(ColaPreTrainedModel):
    """The VAE and the DiT backbone (without the velocity head). `forward(input_ids)` encodes the tokens with the
    VAE's posterior mean and runs the DiT over those clean latents (t = 0), block-causally: what generation computes
    for the history (`inputs_embeds`: the tokens' embeddings instead of their ids). `forward(latents=..., timesteps=...)`
    runs the DiT on given latents [B, T, d_z]."""

    # The causal LM's own parts, which `AutoModel` on its checkpoint leaves out on purpose: not reported as
    # unexpected keys (the README's backbone snippet loads quietly).
    _keys_to_ignore_on_load_unexpected = [r"^(reference_encoder|velocity_head)(\.|$)"]

    def __init__(self, config: ColaConfig):
        super().__init__(config)
        self.vae = ColaTextVAE(config.vae_config)
        self.latent_in = nn.Linear(config.latent_size, config.hidden_size)
        official = config.dit_architecture == "official"
        if official:
            self.time_embedding = OfficialTimestepEmbedding(config.hidden_size)
            self.layers = nn.ModuleList(OfficialDiTBlock(config, i) for i in range(config.num_hidden_layers))
            self.rotary = InterleavedRotaryEmbedding(config.rope_dim or config.head_dim,
                                                     base=config.rope_parameters["rope_theta"])
        else:
            self.time_embedding = TimestepEmbedding(config.hidden_size)
            self.layers = dit_layers(config)
            self.rotary = RotaryEmbedding.from_config(config)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps, elementwise_affine=official)
        self.post_init()

    def denoiser(self, latents: torch.Tensor, timesteps: torch.Tensor, position_ids: torch.Tensor,
                 mask: torch.Tensor | None, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The DiT on latents [B, T, d_z] at per-position times [B, T] (0 = clean): final states [B, T, d] (normed,
        before the velocity head's modulation) and the time conditioning [B, T, d] the head needs."""
        hidden = self.latent_in(latents.to(self.latent_in.weight.dtype))
        conditioning = self.time_embedding(timesteps).to(hidden.dtype)
        cos, sin = self.rotary(position_ids, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, conditioning, cos, sin, mask, cache=cache)
        return self.norm(hidden), conditioning

    def encode_tokens(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                      cache=None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The VAE's posterior mean [B, T, d_z] of the tokens (ids, or their embeddings), in the DiT's space."""
        return self.vae.to_prior_space(self.vae.encode(input_ids, attention_mask, cache=cache,
                                                       inputs_embeds=inputs_embeds))

    @deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")
    @capture_outputs
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                timesteps: torch.Tensor | None = None, latents: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        """The DiT over input_ids [B, T] or their token embeddings `inputs_embeds` (encoded by the VAE), or over its
        input `latents` [B, T, d_z]; the other arguments as `prior_inputs` takes them (timesteps default 0: clean).
        `output_hidden_states` / `output_attentions` (eager) are recorded for the DiT's blocks."""
        inputs = self.prior_inputs(input_ids, attention_mask, position_ids, cache, inputs_embeds, latents, use_cache,
                                   timesteps, kwargs)
        hidden, _ = self.denoiser(inputs.latents, inputs.timesteps, inputs.position_ids, inputs.mask,
                                  cache=inputs.cache)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=inputs.cache)


class VelocityHead(nn.Module):
    """Final adaLN layer of the DiT: velocity = Linear(LN(h)·(1 + scale) + shift), scale and shift from the time
    conditioning; both linear maps start at zero (the untrained prior predicts zero velocity)."""

    def __init__(self, hidden_size: int, latent_size: int):
        super().__init__()
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.proj = nn.Linear(hidden_size, latent_size)
        self.modulation[1].zero_init = True
        self.proj.zero_init = True

    def forward(self, hidden: torch.Tensor, conditioning: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(conditioning).chunk(2, dim=-1)
        return self.proj(hidden * (1 + scale) + shift).float()


@dataclass
class ColaGenerationOptions(BlockLatentGenerationOptions):
    """Cola DLM's own `generate()` options, besides the transformers ones and those shared with AURORA-LM
    (`BlockLatentGenerationOptions`). Alignment, repaint of a partial prompt block, `max_new_tokens` and EOS:
    `BlockLatentGenerationMixin`.

    ode_solver (default config.ode_solver = "euler"): "euler" (one DiT evaluation per step) or "heun" (two, the last
        step one).
    guidance_scale (default config.cfg_scale = 7): w of v = v_uncond + w·(v_cond − v_uncond), where the unconditional
        branch is the DiT on the current block alone; 1 = no guidance (one DiT evaluation per step); a row with no
        history block uses 1 (both branches would be the same).
    """

    family: ClassVar[str] = "Cola DLM"

    ode_solver: str | None = None
    guidance_scale: float | None = None

    def resolved(self, config: ColaConfig, batch_size: int) -> "ColaGenerationOptions":
        shared = self.resolved_block_options(config, batch_size)
        solver = config.ode_solver if self.ode_solver is None else self.ode_solver
        if solver not in ODE_SOLVERS:
            raise ValueError(f"ode_solver must be one of {ODE_SOLVERS}, got {solver!r}")
        scale = config.cfg_scale if self.guidance_scale is None else float(self.guidance_scale)
        if not scale >= 0:
            raise ValueError(f"guidance_scale must be >= 0, got {scale}")
        return replace(self, ode_solver=solver, guidance_scale=scale, **shared)


class ColaBlockVelocity(BlockVelocityField):
    """The DiT's velocity of the block being generated, with classifier-free guidance against the block alone for
    the rows that have history (one DiT evaluation per call without guidance, two with)."""

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        times = self.block_times(t)
        conditional = self.model.velocity(x, times, self.conditional_mask, self.positions, cache=self.cache)
        self.calls += 1
        if not self.guided:
            return conditional
        unconditional = self.model.velocity(x, times, self.alone_mask, self.positions)
        self.calls += 1
        return self.guide(conditional, unconditional)


def pad_partial_block(input_ids: torch.Tensor, real: torch.Tensor, block_size: int,
                      pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-aligned prompts [B, W] with each row's partial last block filled up with `pad_token_id` tokens that
    the VAE reads as text: the official VAE was trained on documents padded so to whole blocks, and its encoder
    attends within a block in both directions, so the official inference encodes a prompt this way."""
    complete = input_ids.shape[1] // block_size * block_size
    if complete == input_ids.shape[1]:
        return input_ids, real
    width = complete + block_size
    grow = width - input_ids.shape[1]
    input_ids = torch.cat([input_ids, input_ids.new_full((input_ids.shape[0], grow), pad_token_id)], dim=1)
    real = torch.cat([real, real.new_zeros(real.shape[0], grow)], dim=1)
    tail = real[:, complete:]
    partial = tail.any(dim=1, keepdim=True)
    filled = torch.arange(block_size, device=real.device)[None] >= tail.long().sum(1, keepdim=True)
    input_ids[:, complete:] = torch.where(partial & filled, pad_token_id, input_ids[:, complete:])
    real[:, complete:] = tail | (partial & filled)
    return input_ids, real


class ColaForCausalLM(ColaPreTrainedModel, BlockLatentForCausalLM):
    """Cola DLM: VAE + block-causal DiT prior + velocity head. `forward(input_ids)` returns the DiT's hidden states
    of the clean text; `forward(input_ids, labels=...)` the joint objective; `generate()` denoises a block of latents
    per ODE solve and decodes it with the VAE. Build a trainable model around a trained VAE with `from_vae`."""

    generation_options_class = ColaGenerationOptions
    base_model_class = ColaModel
    output_class = ColaOutput
    velocity_field_class = ColaBlockVelocity
    network_names = {"prior": "dit", "encoder": "vae_encoder", "decoder": "vae_decoder"}

    def __init__(self, config: ColaConfig):
        super().__init__(config)
        self.velocity_head = VelocityHead(config.hidden_size, config.latent_size)
        self.reference_encoder = None
        if config.trains_vae and config.reference_kl_weight > 0:
            self.reference_encoder = ColaVAEEncoder(config.vae_config)  # frozen stage-1 encoder: KL anchor
        if config.vae_frozen_steps:  # only then: older checkpoints have no such buffer
            self.register_buffer("optimizer_steps", torch.zeros((), dtype=torch.long))
        self.post_init()
        self.freeze_components()

    def frozen_modules(self) -> list[nn.Module]:
        """The reference encoder; the VAE too at `vae_learning_rate_ratio=0` (then no masked pass either)."""
        frozen = [] if self.reference_encoder is None else [self.reference_encoder]
        return frozen if self.config.trains_vae else frozen + [self.model.vae]

    def freeze_components(self) -> None:
        self.model.vae.freeze_components()  # a fixed logSNR
        super().freeze_components()

    @classmethod
    def from_vae(cls, vae: "str | ColaTextVAE", config: ColaConfig | None = None, **config_kwargs) -> "ColaForCausalLM":
        """A fresh Cola DLM whose VAE (and frozen reference encoder) start as copies of `vae` (a trained
        `ColaTextVAE` or its folder); see `from_component`."""
        return cls.from_component(vae, config, **config_kwargs)

    def load_component(self, component: ColaTextVAE) -> None:
        super().load_component(component)
        if self.reference_encoder is not None:
            self.reference_encoder.load_state_dict(component.encoder.state_dict())

    def parameter_learning_rate_scales(self) -> dict[str, float]:
        """Parameter-name prefix -> learning-rate multiplier, read by the training loop's optimizer: the VAE trains
        at `vae_learning_rate_ratio` × the DiT's rate."""
        return {"model.vae.": self.config.vae_learning_rate_ratio}

    @torch.no_grad()
    def on_optimizer_step(self) -> None:
        """After each optimizer step: count it while `vae_frozen_steps` holds the VAE."""
        if self.config.vae_frozen_steps:
            self.optimizer_steps += 1

    def trains_vae_now(self) -> bool:
        """Whether this step's objective trains the VAE: `trains_vae`, and past the first `vae_frozen_steps`."""
        cfg = self.config
        return cfg.trains_vae and not (cfg.vae_frozen_steps and int(self.optimizer_steps) < cfg.vae_frozen_steps)

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Predicted velocity [B, T, d_z] (float32) of latents [B, T, d_z] at per-position times [B, T]: one DiT
        evaluation through the base model's forward (where call counters see it). attention_mask: 2-D over cached +
        new positions, or a ready 4-D bool mask (then position_ids are required)."""
        hidden = self.model(latents=latents, timesteps=timesteps, attention_mask=attention_mask,
                            position_ids=position_ids, cache=cache).last_hidden_state
        return self.velocity_head(hidden, self.model.time_embedding(timesteps).to(hidden.dtype))

    def training_objective(self, input_ids: torch.Tensor, labels: torch.Tensor,
                           attention_mask: torch.Tensor | None = None) -> ColaOutput:
        """λ_FM·flow matching + λ_VAE·VAE loss + λ_ref·KL(q_φ ‖ q_φref) on packed or right-padded rows.

        Flow matching runs every block at once over [clean stream ; noisy stream] (`dual_stream_mask`): block b's
        noisy copy z_t = (1 − t)·z_0 + t·ε, t drawn per (row, block), sees itself and the clean, detached blocks
        < b (none with probability `history_dropout`), and regresses the velocity ε − z_0. z_0 is the VAE's sampled
        latent with gradient when the VAE trains, so the latent space co-adapts with the prior.

        In eval mode every draw (the latent's ε, times, block conditions, the flow's ε) is one fixed row from
        `evaluation_generator`, shared by every row: the same batch gives the same loss."""
        cfg = self.config
        check_block_training_rows(input_ids, attention_mask, "Cola")
        batch, length = input_ids.shape
        vae = self.model.vae
        generator = None if self.training else evaluation_generator()
        latent_noise = None if generator is None else fixed_row_draw(generator, batch, (length, cfg.latent_size),
                                                                     input_ids.device)
        parts = {}
        joint = self.trains_vae_now()
        if joint:
            vae_out, z0 = vae.losses(input_ids, labels, attention_mask, latent_noise=latent_noise)
            parts.update(vae_loss=vae_out.loss, reconstruction_nll=vae_out.reconstruction_nll, kl=vae_out.kl,
                         mask_nll=vae_out.mask_nll)
            mean = vae_out.latent_mean
        else:
            with torch.no_grad():
                mean, std = vae.encode_posterior(input_ids, attention_mask)
                z0 = vae.sample_latents(mean, latent_noise, std)
        z0 = vae.to_prior_space(z0)
        scored = scored_positions(labels, attention_mask)
        if self.reference_encoder is not None and joint:
            with torch.no_grad():
                ref_mean, ref_std = self.reference_encoder.posterior(self.reference_encoder.states(input_ids,
                                                                                                   attention_mask))
            std = vae.encoder.posterior(vae_out.last_hidden_state)[1]
            ref_kl = gaussian_kl(mean, std, ref_mean, ref_std)
            parts["reference_kl"] = (ref_kl * scored).sum() / scored.sum().clamp(min=1)

        sampler = make_time_sampler(cfg.time_sampler, **cfg.time_sampler_kwargs())
        t, clean_lead, history_visible, noise = self.training_draws(z0, sampler, generator)
        error = self.flow_matching_error(z0, t, noise, history_visible, attention_mask)
        fm_scored = (scored & ~clean_lead).float()
        flow_matching = (error * fm_scored).sum() / fm_scored.sum().clamp(min=1)

        loss = cfg.flow_matching_weight * flow_matching
        if "vae_loss" in parts:
            loss = loss + cfg.vae_loss_weight * parts["vae_loss"]
        if "reference_kl" in parts:
            loss = loss + cfg.reference_kl_weight * parts["reference_kl"]
        detached = {name: _detached(value) for name, value in parts.items()}
        return ColaOutput(loss=loss, flow_matching_loss=flow_matching.detach(),
                          logsnr=_detached(vae.encoder.logsnr_value()), **detached)

    def flow_matching_error(self, z0: torch.Tensor, times: torch.Tensor, noise: torch.Tensor,
                            history_visible: torch.Tensor | None = None,
                            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The flow-matching error of every latent position with the given draws, unreduced: [B, T] (float32), the
        mean over channels of (v̂ − (ε − z0))² in one dual-stream pass (`dual_stream_inputs`, arguments as there; the
        caller leaves clean leading positions unscored). Used by the training loss (a masked mean) and by
        per-response scores (sums over a response's positions, hf_latentlm/training/scorers.py)."""
        stream = self.dual_stream_inputs(z0, times, noise, history_visible, attention_mask)
        velocity = self.velocity(stream.latents, stream.timesteps, stream.mask, stream.positions)[:, z0.shape[1]:]
        return (velocity - (noise - z0).float()).pow(2).mean(-1)

    # ------------------------------------------------------------------------------------------------------------
    # generate (the block loop is `BlockLatentGenerationMixin`'s, the shared steps `BlockLatentForCausalLM`'s)
    # ------------------------------------------------------------------------------------------------------------

    def _encode_prompt(self, input_ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        if self.config.vae_config.architecture == "official":
            input_ids, real = pad_partial_block(input_ids, real, self.config.block_size, self.config.pad_token_id)
        return super()._encode_prompt(input_ids, real)

    def _decode_latents(self, latents: torch.Tensor, attention_mask: torch.Tensor, cache) -> torch.Tensor:
        return self.model.vae.decoder(latents, attention_mask, cache=cache)

    def _block_solver(self, options: ColaGenerationOptions) -> FlowMatchEulerSampler:
        solver_class = FlowMatchHeunSampler if options.ode_solver == "heun" else FlowMatchEulerSampler
        return solver_class(options.num_inference_steps, shift=options.timestep_shift)


__all__ = ["ColaConfig", "ColaForCausalLM", "ColaGenerationOptions", "ColaModel", "ColaOutput", "ColaTextVAE",
           "ColaVAEConfig", "ColaVAEDecoder", "ColaVAEEncoder", "ColaVAEOutput", "VelocityHead", "gaussian_kl"]
