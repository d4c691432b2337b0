"""What the block-latent families (Cola DLM, AURORA-LM) share: a trained text component (Cola's VAE, AURORA's
autoencoder) with one latent per token, and a prior over blocks of `config.block_size` latents, bidirectional inside
a block and causal across blocks (`BlockLatentConfig`). `BlockLatentPreTrainedModel` is the base of a family's base
model and language model, `BlockLatentForCausalLM` of its language model, `BlockVelocityField` of the callable an
ODE solver integrates over one block in `generate()`.

Copied into Hub checkpoints, so torch and transformers only.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from .flow import FlowMatchEulerSampler, classifier_free_guidance
from .generation import BlockDecodingState, BlockLatentGenerationMixin, DenoisedBlock
from .layers import (OffsetCache, ReadOnlyCache, block_causal_layout, draw_block_conditions, dual_stream_mask,
                     fixed_row_draw)
from .modeling_backbone import (BackbonePreTrainedModel, check_backbone_inputs, check_forward_kwargs, composite_config,
                                head_forward)


class PriorInputs(NamedTuple):
    """One pass of the prior (`prior_inputs`); mask: bool [B or 1, 1, T, cached + T]."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    cache: DynamicCache | None


class DualStreamInputs(NamedTuple):
    """The inputs of one dual-stream prior pass over every block (`dual_stream_inputs`): the noisy latents x
    [B, T, D], the stream's latents [z ; x] [B, 2T, D], timesteps [0 ; σ], noisy (the second stream's positions),
    positions and mask."""

    x: torch.Tensor
    latents: torch.Tensor
    timesteps: torch.Tensor
    noisy: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor


class BlockVelocityField:
    """`field(x, t)` -> velocity of the block's state x [B, Q, D] at solver time t (0-dim), implemented by a family's
    subclass. This base holds what both families read from the decoding state, and counts prior evaluations."""

    def __init__(self, model: BlockLatentForCausalLM, state: BlockDecodingState, positions: torch.Tensor,
                 conditional_mask: torch.Tensor):
        block_size = model.config.block_size
        self.model, self.options = model, state.options
        self.positions, self.conditional_mask = positions, conditional_mask
        self.known_mask = state.known_mask
        self.cache = ReadOnlyCache(state.prior_cache)  # the history's keys: read at every step, never extended
        # The unconditional branch of guidance sees the block alone.
        self.alone_mask = torch.ones(1, 1, block_size, block_size, dtype=torch.bool, device=positions.device)
        self.has_history = state.has_history[:, None, None]
        self.guided = self.options.guidance_scale != 1.0 and bool(state.has_history.any())
        self.calls = 0

    def block_times(self, t: torch.Tensor) -> torch.Tensor:
        """[B, Q] times of the block's positions at solver time t: 0 at the known (repainted) positions."""
        times = t.to(self.positions.device).expand(*self.positions.shape)
        return times if self.known_mask is None else torch.where(self.known_mask, 0.0, times)

    def guide(self, conditional: torch.Tensor, unconditional: torch.Tensor) -> torch.Tensor:
        """CFG at `guidance_scale`; a row without history (both branches alike) keeps the conditional exactly."""
        guided = classifier_free_guidance(conditional, unconditional, self.options.guidance_scale)
        return torch.where(self.has_history, guided, conditional)


class BlockLatentPreTrainedModel(BackbonePreTrainedModel):
    """A family sets `config_class`, `component_class` (its component's model class) and `component_attribute` (the
    component's attribute in the base model); its base model implements `encode_tokens(input_ids, attention_mask,
    cache, inputs_embeds=None) -> [B, T, D]`, the latents the prior sees for tokens (given as ids or as their token
    embeddings)."""

    component_class: ClassVar[type]
    component_attribute: ClassVar[str]
    _can_compile_fullgraph = False  # training draws times, noise and dropouts inside forward

    @property
    def component(self) -> BackbonePreTrainedModel:
        """The trained text component, a submodule of the base model; it owns the token embedding."""
        return getattr(self.base_model, self.component_attribute)

    @property
    def attention_block_size(self) -> int:
        """Latent positions attend bidirectionally inside blocks of this size, causally across them."""
        return self.config.block_size

    def get_input_embeddings(self):
        return self.component.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.component.set_input_embeddings(value)

    def prior_inputs(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, cache: DynamicCache | None,
                     inputs_embeds: torch.Tensor | None, latents: torch.Tensor | None, use_cache: bool | None,
                     timesteps: torch.Tensor | None, kwargs: dict) -> PriorInputs:
        """The start of the base model's forward: the checks, the cache, the latents (`input_ids` or their token
        embeddings `inputs_embeds` encoded, the encoder's keys in the same cache after the prior's layers, or
        `latents` as given), times (default 0: clean), and positions and mask from a 2-D `attention_mask` (left
        padding; blocks counted from each row's first real token) or a ready 4-D bool mask with its
        `position_ids`."""
        check_backbone_inputs(self, kwargs, input_ids=input_ids, inputs_embeds=inputs_embeds, latents=latents)
        check_forward_kwargs(self, kwargs)
        batch, length = next(x for x in (input_ids, inputs_embeds, latents) if x is not None).shape[:2]
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if latents is None:
            encoder_cache = None if cache is None else OffsetCache(cache, self.config.num_hidden_layers)
            latents = self.encode_tokens(input_ids, attention_mask, cache=encoder_cache, inputs_embeds=inputs_embeds)
        device = latents.device
        if timesteps is None:
            timesteps = torch.zeros(batch, length, device=device)
        if attention_mask is not None and attention_mask.dim() == 4:  # a ready mask (training's dual stream)
            if position_ids is None:
                raise ValueError("a 4-D attention_mask needs position_ids")
            mask = attention_mask.bool()
        else:
            position_ids, mask = block_causal_layout(attention_mask, batch, length, past, self.config.block_size,
                                                     device, position_ids)
        return PriorInputs(latents, timesteps, position_ids, mask, cache)


class BlockLatentForCausalLM(BlockLatentPreTrainedModel, BlockLatentGenerationMixin):
    """`self.model` is the base model (`base_model_class`). A family sets, besides `generation_options_class` and
    `network_names`, `output_class` (of `forward`) and `velocity_field_class`; it implements
    `training_objective(input_ids, labels, attention_mask)` and `_decode_latents`, and may name `frozen_modules`.
    Its component has an `encoder` and a `decoder`."""

    output_class: ClassVar[type]
    velocity_field_class: ClassVar[type]

    def __init__(self, config):
        super().__init__(config)
        self.model = self.base_model_class(config)

    @classmethod
    def from_component(cls, component, config=None, **config_kwargs):
        """A fresh model around a copy of `component` (a trained `component_class` model or its folder). `config`
        (or `config_kwargs` for a new one) must agree with it (`validate_component`); its config is embedded
        without its path."""
        if not isinstance(component, cls.component_class):
            component = cls.component_class.from_pretrained(component)
        config_class = cls.config_class
        config = composite_config(config_class, config_class.component_config_name, component.config, config,
                                  "validate_component", config_class.component_name, **config_kwargs)
        model = cls(config)
        model.load_component(component)
        return model

    def load_component(self, component) -> None:
        """Copy a trained component's weights into this model (`from_component`)."""
        self.component.load_state_dict(component.state_dict())

    def frozen_modules(self) -> list[nn.Module]:
        """The submodules that never train: they get no gradient and stay in eval mode (no dropout)."""
        return []

    def freeze_components(self) -> None:
        for module in self.frozen_modules():
            module.requires_grad_(False).eval()

    def train(self, mode: bool = True):
        super().train(mode)
        for module in self.frozen_modules():
            module.eval()
        return self

    def get_output_embeddings(self):
        return None  # the prior has no softmax over tokens (the decoder's read-out is not a next-token head)

    def counted_modules(self) -> list[nn.Module]:
        """The networks of `network_names`, in that order."""
        return [self.model, self.component.encoder, self.component.decoder]

    @head_forward
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, latents: torch.Tensor | None = None, **kwargs):
        """input_ids [B, T] (or their token embeddings `inputs_embeds`, or the prior's input `latents` [B, T, D]):
        the prior's hidden states of the clean text (a block-latent family has no next-token logits). With `labels`
        (same shape, −100 = ignore; label i scores latent i, no shift): the training objective. Transformers'
        `output_hidden_states`, `output_attentions`, `return_dict` apply."""
        check_forward_kwargs(self, kwargs)
        if labels is not None:
            if cache is not None or inputs_embeds is not None or latents is not None or position_ids is not None:
                raise ValueError(f"the {self.generation_family} training objective takes input_ids, labels and "
                                 f"attention_mask only")
            return self.training_objective(input_ids, labels, attention_mask)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, latents=latents, use_cache=use_cache, **kwargs)
        return self.output_class(last_hidden_state=out.last_hidden_state, cache=out.cache,
                                 hidden_states=out.hidden_states, attentions=out.attentions)

    def training_draws(self, z: torch.Tensor, time_sampler, generator: torch.Generator | None) -> tuple:
        """The draws of one dual-stream training pass over clean latents z [B, T, D]: (times [B, T], clean_lead,
        history_visible) of `draw_block_conditions` with `time_sampler`, then the noise ε [B, T, D]; one row shared by
        every row when a `generator` is given (an eval-mode loss, `evaluation_generator`)."""
        cfg = self.config
        batch, length = z.shape[:2]
        times, clean_lead, history_visible = draw_block_conditions(time_sampler, batch, length, cfg.block_size,
                                                                   cfg.prompt_block_prob, cfg.history_dropout,
                                                                   z.device, generator)
        noise = torch.randn_like(z) if generator is None else fixed_row_draw(generator, batch, z.shape[1:], z.device)
        return times, clean_lead, history_visible, noise

    def dual_stream_inputs(self, z: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor,
                           history_visible: torch.Tensor | None = None,
                           attention_mask: torch.Tensor | None = None) -> DualStreamInputs:
        """The inputs of one dual-stream prior pass over every block of rows whose blocks start at column 0 (right
        padding only). z [B, T, D] clean latents; sigma [B, T] (one per block; 0 on clean leading positions); noise
        [B, T, D]: ε. Returns x = (1 − σ)·z + σ·ε, latents [z (detached) ; x], timesteps [0 ; σ], noisy (the second
        stream), positions and mask (`dual_stream_mask`, history where `history_visible`)."""
        batch, length = z.shape[:2]
        device = z.device
        x = (1 - sigma[..., None]) * z + sigma[..., None] * noise
        latents = torch.cat([z.detach(), x], dim=1)
        timesteps = torch.cat([torch.zeros_like(sigma), sigma], dim=1)
        noisy = torch.arange(2 * length, device=device)[None].expand(batch, -1) >= length
        positions = torch.arange(length, device=device).repeat(2)[None].expand(batch, -1)
        mask = dual_stream_mask(length, self.config.block_size, history_visible, attention_mask, device)
        return DualStreamInputs(x, latents, timesteps, noisy, positions, mask)

    # ------------------------------------------------------------------------------------------------------------
    # generate (the block loop is `BlockLatentGenerationMixin`'s)
    # ------------------------------------------------------------------------------------------------------------

    def _encode_prompt(self, input_ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        return self.model.encode_tokens(input_ids, real.long())

    def _append_to_prior(self, latents: torch.Tensor, attention_mask: torch.Tensor, cache) -> None:
        self.model(latents=latents, attention_mask=attention_mask, cache=cache)

    def _block_solver(self, options) -> FlowMatchEulerSampler:
        return FlowMatchEulerSampler(options.num_inference_steps, shift=options.timestep_shift)

    def _denoise_block(self, state: BlockDecodingState, noise: torch.Tensor, positions: torch.Tensor,
                       conditional_mask: torch.Tensor) -> DenoisedBlock:
        field = self.velocity_field_class(self, state, positions, conditional_mask)
        solver = self._block_solver(state.options)
        solver.set_timesteps(device=noise.device)
        known_mask = None if state.known_mask is None else state.known_mask[..., None]
        return DenoisedBlock(solver.solve(field, noise, state.known, known_mask), field.calls)


__all__ = ["BlockLatentForCausalLM", "BlockLatentPreTrainedModel", "BlockVelocityField", "DualStreamInputs",
           "PriorInputs"]
