"""AURORA-LM (paper 003; method-specs §4; docs/families/aurora.md).

- `AuroraAutoencoder`: a query-based text autoencoder, trained first and then frozen. Learned query slots read the
  token embeddings causally (one slot per token at keep ratio 1) and a second set of queries reads the slots back to
  token logits in one parallel pass.
- `AuroraForCausalLM`: the frozen autoencoder and a block-causal denoiser that predicts the clean latent block (x0)
  from a noisy one, given the clean blocks before it, over the per-channel standardised latents. Training adds
  self-trajectory consistency against an EMA copy; `generate()` integrates each block with Euler steps from σ = 1 to
  0 (SC-CFG, prompt CFG at high noise, repaint of a partial prompt block) and decodes it with the frozen decoder.
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

from .configuration_aurora import SELF_CONDITION_DRAFTS, AuroraAutoencoderConfig, AuroraConfig
from .configuration_backbone import decoder_blocks_tp_plan
from .flow import (FlowMatchEulerSampler, TimestepEmbedding, classifier_free_guidance, euler_step_from_x0,
                   make_time_sampler, x0_to_velocity)
from .generation import BlockDecodingState, BlockLatentGenerationOptions
from .layers import (AttentionProbs, DecoderBlock, RMSNorm, RotaryEmbedding, decoder_layers, evaluation_generator,
                     init_backbone_weights, make_padding_position_ids)
from .modeling_backbone import (BackbonePreTrainedModel, check_backbone_inputs, check_block_training_rows,
                                check_forward_kwargs, masked_cross_entropy, recording_nothing, refuse_vocab_resize,
                                scored_positions)
from .modeling_block_latent import (BlockLatentForCausalLM, BlockLatentPreTrainedModel, BlockVelocityField,
                                   DualStreamInputs)
from .sampling import model_mode


@dataclass
class AuroraAutoencoderOutput(ModelOutput):
    """`loss`: token cross-entropy over the scored tokens (with token and latent dropout in training).
    `logits` [B, L, V]; `latents` [B, N, D] (raw, not standardised), also `last_hidden_state` (the encoder's final
    query states are the latents); `token_accuracy` of `logits`. When asked: `hidden_states`, the encoder's query
    states (N slots each) before its first and after every layer; `attentions`, its eager attention maps over the
    whole stream of token items and queries ([B, H, n + N, n + N], interleaved at keep ratio 1)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class AuroraOutput(ModelOutput):
    """`last_hidden_state` [B, T, d]: the denoiser's state of each clean latent position (one per token). With labels:
    `loss` = `denoising_loss` + `consistency_weight`·`consistency_loss` (the weight is the ramped λ_ct)."""

    loss: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    cache: DynamicCache | None = None
    denoising_loss: torch.Tensor | None = None
    consistency_loss: torch.Tensor | None = None
    consistency_weight: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


# ====================================================================================================================
# Query-based autoencoder
# ====================================================================================================================

def causal_by_position_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                            key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """[B or 1, 1, Tq, Tk] bool: a query sees a key iff key position <= query position (ties visible) and the key is
    valid; the last Tq keys are the queries' own columns, always visible (no empty row)."""
    mask = key_positions[:, None, :] <= query_positions[:, :, None]
    if key_valid is not None:
        mask = mask & key_valid.bool()[:, None, :]
    tq, tk = query_positions.shape[-1], key_positions.shape[-1]
    own = torch.arange(tk, device=mask.device)[None, :] == torch.arange(tk - tq, tk, device=mask.device)[:, None]
    return (mask | own)[:, None]


class QueryStates(nn.Module):
    """Marks a query stack's query states (the stream without its context items) for transformers' output
    recording, as `AttentionProbs` marks attention probabilities: forward(before, after) -> after, called once per
    layer, so that the recorder's initial state is the queries' start (its first input)."""

    def forward(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        return after


class QueryStack(nn.Module):
    """Learned queries that read a fixed context: every layer runs over the merged stream of context items and query
    items, causal by position, and the context items are reset to the given context before the next layer (the
    context is read at every layer, never updated). One learned vector starts every query; it starts at zero, so
    that the first layer's queries begin as a plain average of the context they see (**choice**).

    read(context [B, n, d], is_context [T] bool, positions [B or 1, T], mask, cache) -> normed query states [B, m, d]
    (T = n + m; the stream's items in order, context where `is_context`); `read_one_per_position` and
    `read_compressed` lay the stream out for keep ratio 1 and below 1."""

    def __init__(self, config: AuroraAutoencoderConfig):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(config.hidden_size))
        self.query_residual = config.query_residual
        self.keep_ratio = config.keep_ratio
        self.layers = decoder_layers(config)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = RotaryEmbedding.from_config(config)
        self.query_states = QueryStates()

    def read(self, context: torch.Tensor, is_context: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cache=None, query_start: torch.Tensor | None = None) -> torch.Tensor:
        """query_start [B, m, d]: what each query starts from (default: the learned query alone)."""
        batch, dtype = context.shape[0], self.query.dtype
        # Index tensors once per call (boolean indexing would sync with the device at every layer).
        context_index, query_index = is_context.nonzero().squeeze(1), (~is_context).nonzero().squeeze(1)
        stream = context.new_zeros(batch, is_context.numel(), context.shape[-1], dtype=dtype)
        stream = stream.index_copy(1, context_index, context.to(dtype))
        state = (self.query.expand(batch, query_index.numel(), -1) if query_start is None
                 else query_start.to(dtype))
        cos, sin = self.rotary(positions.expand(batch, -1), dtype=dtype)
        # The query items' states are carried on their own and put into the stream for each layer (the context items
        # are reset to the given context), so that the recorded states are the ones the output is computed from.
        for layer in self.layers:
            out = layer(stream.index_copy(1, query_index, state), cos, sin, mask, cache=cache)
            state = self.query_states(state, out.index_select(1, query_index))
        return self.norm(state)

    def read_one_per_position(self, context: torch.Tensor, attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """Keep ratio 1: query i shares position i with context item i (interleaved stream), so left padding
        (`attention_mask` [B, cached + n]) and a cache of earlier items work as for a causal LM."""
        past = cache.get_seq_length() // 2 if cache is not None else 0
        if attention_mask is not None:
            positions = make_padding_position_ids(attention_mask)
        else:
            positions = torch.arange(past + context.shape[1], device=context.device)[None]
        # The stream interleaves context item i and query i (context first), so that cached keys keep their order.
        key_pos = positions.repeat_interleave(2, dim=1)
        key_valid = None if attention_mask is None else attention_mask.repeat_interleave(2, dim=1)
        is_context = torch.arange(key_pos.shape[-1], device=key_pos.device) % 2 == 0
        mask = causal_by_position_mask(key_pos[:, 2 * past:], key_pos, key_valid)
        # The residual copy path: query i starts from the learned query plus item i, which it shares a position with.
        start = self.query + context if self.query_residual else None
        return self.read(context, is_context[2 * past:], key_pos[:, 2 * past:], mask, cache=cache, query_start=start)

    def read_compressed(self, context: torch.Tensor, context_positions: torch.Tensor,
                        query_positions: torch.Tensor) -> torch.Tensor:
        """Keep ratio < 1: [context ; queries] at the given positions, whole unpadded rows, no cache."""
        positions = torch.cat([context_positions, query_positions])[None]
        is_context = torch.arange(positions.shape[-1], device=positions.device) < context_positions.numel()
        return self.read(context, is_context, positions, causal_by_position_mask(positions, positions))


class AuroraQueryEncoder(QueryStack):
    """Token embeddings [B, L, d] -> latent slots [B, N, d]. Slot i sees slots ≤ i and tokens 0 .. ⌈(i+1)L/N⌉ − 1."""

    def forward(self, token_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """attention_mask [B, cached + L] (left padding; keep ratio 1 only); cache: keys of earlier tokens (written;
        keep ratio 1 only)."""
        if self.keep_ratio == 1:
            return self.read_one_per_position(token_embeds, attention_mask, cache)
        check_compressed_call(attention_mask, cache)
        length, device = token_embeds.shape[1], token_embeds.device
        slots = compressed_slot_count(length, self.keep_ratio)
        # Slot i sits at the position of the last token it covers: ⌈(i+1)L/N⌉ − 1.
        slot_pos = -(-(torch.arange(1, slots + 1, device=device) * length) // slots) - 1
        return self.read_compressed(token_embeds, torch.arange(length, device=device), slot_pos)


class AuroraQueryDecoder(QueryStack):
    """Latent slots [B, N, d] -> decoder states [B, L, d]. Position j sees states ≤ j and slots ≤ ⌊j·N/L⌋; it never
    sees a token."""

    def forward(self, latents: torch.Tensor, length: int | None = None, attention_mask: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """length: L (default N at keep ratio 1); attention_mask [B, cached + N] and cache: keep ratio 1 only."""
        slots, device = latents.shape[1], latents.device
        if self.keep_ratio == 1:
            if length not in (None, slots):
                raise ValueError(f"at keep_ratio 1 the decoder gives one token per slot ({slots}), not {length}")
            return self.read_one_per_position(latents, attention_mask, cache)
        check_compressed_call(attention_mask, cache)
        if length is None or compressed_slot_count(length, self.keep_ratio) != slots:
            raise ValueError(f"{slots} slots at keep_ratio {self.keep_ratio} do not decode to length {length}")
        # Slot i becomes visible at the first position j with ⌊j·N/L⌋ ≥ i, i.e. j = ⌈i·L/N⌉.
        slot_pos = -(-(torch.arange(slots, device=device) * length) // slots)
        return self.read_compressed(latents, slot_pos, torch.arange(length, device=device))


@torch.no_grad()
def init_aurora_weights(module: nn.Module, std: float) -> None:
    """`_init_weights` of every AURORA model: the shared modules' init, the learned queries at zero (their start, see
    `QueryStack`), the latent statistics unset (identity standardisation until `prepare_training` measures them)
    and the step count at zero. A meta-device build followed by `init_weights()` is then the fresh model."""
    init_backbone_weights(module, std)
    if isinstance(module, QueryStack):
        module.query.zero_()
    elif isinstance(module, AuroraAutoencoder):
        module.latent_mean.zero_()
        module.latent_var.fill_(1.0)
        module.has_latent_statistics.fill_(False)


def compressed_slot_count(length: int, keep_ratio: float) -> int:
    return max(1, round(keep_ratio * length))


def check_compressed_call(attention_mask: torch.Tensor | None, cache) -> None:
    if cache is not None or (attention_mask is not None and not bool(attention_mask.bool().all())):
        raise ValueError("an AURORA autoencoder with keep_ratio < 1 takes whole unpadded rows without a cache (slots "
                         "and tokens are not one-to-one); use keep_ratio 1 for padding, caching and generation")


class AuroraAutoencoder(BackbonePreTrainedModel):
    """The query autoencoder on its own (trained first, then frozen inside `AuroraForCausalLM`).
    `forward(input_ids, labels=...)` returns its loss; `encode` / `decode_logits` / `standardize` /
    `unstandardize` are the maps the denoiser uses. The per-channel statistics are buffers saved with the weights."""

    config_class = AuroraAutoencoderConfig
    base_model_prefix = "autoencoder"
    main_input_name = "input_ids"
    # The encoder's query states and attention maps. The autoencoder is also a submodel of `AuroraModel`, whose
    # recorded states must be the denoiser's only: a recorder hook fires into whichever capture is active, so the
    # outer model reaches the autoencoder only through `encode`, which records nothing (`recording_nothing`, as
    # Cola's VAE).
    _can_record_outputs = {
        "hidden_states": OutputRecorder(QueryStates, layer_name="encoder"),
        "attentions": OutputRecorder(AttentionProbs, layer_name="encoder.layers")}
    _can_compile_fullgraph = False  # the dropouts draw their masks inside forward

    def __init__(self, config: AuroraAutoencoderConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder = AuroraQueryEncoder(config)
        self.decoder = AuroraQueryDecoder(config)
        self.register_buffer("latent_mean", torch.zeros(config.hidden_size))
        self.register_buffer("latent_var", torch.ones(config.hidden_size))
        self.register_buffer("has_latent_statistics", torch.zeros((), dtype=torch.bool))
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        init_aurora_weights(module, self.config.initializer_range)

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def get_output_embeddings(self):
        return None  # the logits go through the input embedding itself: h·Eᵀ

    @recording_nothing
    def encode(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None, cache=None,
               inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Raw latents [B, N, D] (float32) of the tokens (ids, or their embeddings `inputs_embeds` [B, N, D]). Token
        dropout applies in training mode."""
        return self.latents_of(input_ids, attention_mask, cache, inputs_embeds)

    def latents_of(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None, cache=None,
                   inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`encode` inside this model's own forward (where its states are recorded)."""
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.training and self.config.token_dropout > 0:
            keep = torch.rand(embeds.shape[:2], device=embeds.device) >= self.config.token_dropout
            embeds = embeds * keep[..., None].to(embeds.dtype)
        return self.encoder(embeds, attention_mask, cache=cache).float()

    def decode_logits(self, latents: torch.Tensor, length: int | None = None,
                      attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Raw latents [B, N, D] -> logits [B, L, V] through the tied embedding. Latent dropout applies in training."""
        if self.training and self.config.latent_dropout > 0:
            latents = latents * (torch.rand_like(latents) >= self.config.latent_dropout).to(latents.dtype)
        states = self.decoder(latents, length, attention_mask, cache=cache)
        return F.linear(states, self.embed_tokens.weight)

    def standardize(self, latents: torch.Tensor) -> torch.Tensor:
        return (latents - self.latent_mean) / torch.sqrt(self.latent_var + self.config.statistics_eps)

    def unstandardize(self, latents: torch.Tensor) -> torch.Tensor:
        return latents * torch.sqrt(self.latent_var + self.config.statistics_eps) + self.latent_mean

    @torch.no_grad()
    def set_latent_statistics(self, latents: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Per-channel mean and variance of raw latents [B, N, D] at the `valid` [B, N] positions; marks them set."""
        flat = latents.reshape(-1, latents.shape[-1]).float()
        if valid is not None:
            flat = flat[valid.reshape(-1).bool()]
        if flat.shape[0] < 2:
            raise ValueError("need at least two latent vectors to estimate the standardisation statistics")
        self.latent_mean.copy_(flat.mean(0))
        self.latent_var.copy_(flat.var(0, unbiased=False))
        self.has_latent_statistics.fill_(True)

    @capture_outputs
    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> AuroraAutoencoderOutput:
        """input_ids [B, L] (or their token embeddings `inputs_embeds`); labels (same shape, −100 = ignore; label j
        is token j, no shift) give the loss. `return_dict`, `output_hidden_states` and `output_attentions` (the
        encoder's, see `AuroraAutoencoderOutput`) apply as in transformers."""
        check_backbone_inputs(self, kwargs, input_ids=input_ids, inputs_embeds=inputs_embeds)
        check_forward_kwargs(self, kwargs)
        latents = self.latents_of(input_ids, attention_mask, inputs_embeds=inputs_embeds)
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        logits = self.decode_logits(latents, length, attention_mask)
        out = AuroraAutoencoderOutput(logits=logits, latents=latents, last_hidden_state=latents)
        if labels is not None:
            scored = scored_positions(labels, attention_mask)
            out.loss = masked_cross_entropy(logits, labels, scored)
            out.token_accuracy = ((logits.argmax(-1) == labels) & scored).sum() / scored.sum().clamp(min=1)
        return out

    @torch.no_grad()
    def reconstruction_accuracy(self, input_ids: torch.Tensor) -> float:
        """Token accuracy of decoding the encoded input (call in eval mode: no dropout). input_ids [B, L]."""
        logits = self.decode_logits(self.encode(input_ids), input_ids.shape[1])
        return (logits.argmax(-1) == input_ids).float().mean().item()


# ====================================================================================================================
# AURORA-LM: block-causal denoiser over the frozen autoencoder's latents
# ====================================================================================================================

class AuroraDenoiser(nn.Module):
    """The trainable denoiser: input maps, additive timestep and self-conditioning, QK-normed decoder blocks, final
    RMSNorm and the x0 head. One module, so that the EMA copy is one `copy.deepcopy`.

    forward(latents [B, T, D], timesteps [B, T], noisy [B, T] bool or None, self_condition [B, T, D] or None,
    position_ids, mask, cache) -> final states [B, T, d] (normed). `x0_head(states)` is the clean-latent prediction.
    """

    def __init__(self, config: AuroraConfig):
        super().__init__()
        d, latent = config.hidden_size, config.latent_size
        self.clean_in = nn.Linear(latent, d)
        rank = config.noisy_input_rank
        # Only the noisy pathway is squeezed (D -> D_b -> d); None keeps one full-width map.
        self.noisy_in = (nn.Sequential(nn.Linear(latent, rank, bias=False), nn.Linear(rank, d)) if rank is not None
                         else nn.Linear(latent, d))
        self.time_embedding = TimestepEmbedding(d)
        self.time_proj = nn.ModuleList(nn.Linear(d, d) for _ in range(config.num_hidden_layers))
        self.self_condition_proj = None
        if config.self_condition_prob > 0:  # bias-free: a zero draft (no draft) adds nothing
            self.self_condition_proj = nn.ModuleList(nn.Linear(latent, d, bias=False)
                                                     for _ in range(config.num_hidden_layers))
        self.layers = decoder_layers(config, qk_norm=True)
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.x0_head = nn.Linear(d, latent)
        self.rotary = RotaryEmbedding.from_config(config)

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, noisy: torch.Tensor | None,
                self_condition: torch.Tensor | None, position_ids: torch.Tensor, mask: torch.Tensor | None,
                cache=None) -> torch.Tensor:
        dtype = self.clean_in.weight.dtype
        latents = latents.to(dtype)
        hidden = self.clean_in(latents)
        # A pass with no noisy position skips noisy_in; under torch.compile always take the where (the same values,
        # no data-dependent branch).
        if noisy is not None and (torch.compiler.is_compiling() or bool(noisy.any())):
            hidden = torch.where(noisy[..., None], self.noisy_in(latents), hidden)
        time = self.time_embedding(timesteps).to(dtype)
        use_draft = self.self_condition_proj is not None and self_condition is not None
        cos, sin = self.rotary(position_ids, dtype=dtype)
        for i, layer in enumerate(self.layers):
            hidden = hidden + self.time_proj[i](time)
            if use_draft:
                hidden = hidden + self.self_condition_proj[i](self_condition.to(dtype))
            hidden = layer(hidden, cos, sin, mask, cache=cache)
        return self.norm(hidden)


class AuroraPreTrainedModel(BlockLatentPreTrainedModel):
    config_class = AuroraConfig
    component_class = AuroraAutoencoder
    component_attribute = "autoencoder"
    # Hidden states and attentions: the denoiser's blocks (the autoencoder is a submodel that records nothing).
    _can_record_outputs = {"hidden_states": DecoderBlock,
                           "attentions": OutputRecorder(AttentionProbs, layer_name="layers")}

    @torch.no_grad()
    def _init_weights(self, module):
        init_aurora_weights(module, self.config.initializer_range)
        if isinstance(module, AuroraForCausalLM):  # last: its submodules are initialised before it
            module.optimizer_steps.zero_()
            ema = module.ema_denoiser
            # The EMA copy starts as the denoiser, unless a checkpoint gave it its own weights.
            if ema is not None and not any(getattr(p, "_is_hf_initialized", False) for p in ema.parameters()):
                ema.load_state_dict(module.model.denoiser.state_dict())

    def check_vocab_resize(self, size: int) -> None:
        refuse_vocab_resize(self, size, "the frozen autoencoder", "an AuroraAutoencoder",
                            "AuroraForCausalLM.from_autoencoder")


class AuroraModel(AuroraPreTrainedModel):
    """The frozen autoencoder and the denoiser (without its x0 head's use). `forward(input_ids)` encodes the tokens,
    standardises the latents and runs the denoiser over them as clean history (σ = 0), block-causally: what
    generation computes for the prefix (`inputs_embeds`: the tokens' embeddings instead of their ids).
    `forward(latents=..., timesteps=..., noisy=...)` runs the denoiser on given standardised latents [B, T, D]."""

    # The causal LM's own parts, which `AutoModel` on its checkpoint leaves out on purpose: not reported as
    # unexpected keys (the README's backbone snippet loads quietly).
    _keys_to_ignore_on_load_unexpected = [r"^(ema_denoiser|optimizer_steps)(\.|$)"]

    def __init__(self, config: AuroraConfig):
        super().__init__(config)
        self.autoencoder = AuroraAutoencoder(config.autoencoder_config)
        self.denoiser = AuroraDenoiser(config)
        self.post_init()

    def encode_tokens(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                      cache=None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The autoencoder's latents [B, T, D] of the tokens (ids, or their embeddings), standardised."""
        return self.autoencoder.standardize(self.autoencoder.encode(input_ids, attention_mask, cache=cache,
                                                                    inputs_embeds=inputs_embeds))

    @deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")
    @capture_outputs
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                timesteps: torch.Tensor | None = None, noisy: torch.Tensor | None = None,
                self_condition: torch.Tensor | None = None, latents: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        """The denoiser over input_ids [B, T] or their token embeddings `inputs_embeds` (encoded by the autoencoder),
        or over standardised `latents` [B, T, D]; the other arguments as `prior_inputs` takes them (timesteps default
        0: clean). noisy [B, T] bool: positions that take the noisy-input bottleneck (default none); self_condition
        [B, T, D]: the draft (default none). `output_hidden_states` / `output_attentions` (eager) are recorded for the
        denoiser's blocks."""
        inputs = self.prior_inputs(input_ids, attention_mask, position_ids, cache, inputs_embeds, latents, use_cache,
                                   timesteps, kwargs)
        hidden = self.denoiser(inputs.latents, inputs.timesteps, noisy, self_condition, inputs.position_ids,
                               inputs.mask, cache=inputs.cache)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=inputs.cache)


@dataclass
class AuroraGenerationOptions(BlockLatentGenerationOptions):
    """AURORA-LM's own `generate()` options, besides the transformers ones and those shared with Cola DLM
    (`BlockLatentGenerationOptions`). Alignment, repaint of a partial prompt block, `max_new_tokens` and EOS:
    `BlockLatentGenerationMixin`. Per block: `num_inference_steps` Euler steps on the σ grid from 1 to 0; each step
    predicts ẑ, feeds it to the next step as the self-conditioning draft, and moves x to (σ'/σ)·x + (1 − σ'/σ)·ẑ.

    self_condition_guidance (default config.self_condition_guidance = 4; `small`: 1): w_sc of SC-CFG, ẑ = ẑ_blind +
        w_sc·(ẑ_aware − ẑ_blind), where "aware" sees the previous step's draft and "blind" a zero draft (two denoiser
        evaluations per step from the second step on; 1 = one evaluation, the aware prediction).
    guidance_scale (default config.cfg_scale = 2): w of prompt CFG, ẑ = ẑ_uncond + w·(ẑ − ẑ_uncond), where the
        unconditional branch is the block alone (with the draft); applied only while σ ≥ cfg_min_sigma and only to
        rows with a complete history block; 1 = off.
    cfg_min_sigma (default config.cfg_min_sigma = 0.9).
    self_condition_draft (default config.self_condition_draft = "unguided"): the next step's draft, the aware
        prediction before guidance ("unguided") or the guided one ("guided").
    """

    family: ClassVar[str] = "AURORA-LM"

    self_condition_guidance: float | None = None
    guidance_scale: float | None = None
    cfg_min_sigma: float | None = None
    self_condition_draft: str | None = None

    def resolved(self, config: AuroraConfig, batch_size: int) -> "AuroraGenerationOptions":
        shared = self.resolved_block_options(config, batch_size)
        values = {}
        for name, default in (("self_condition_guidance", config.self_condition_guidance),
                              ("guidance_scale", config.cfg_scale), ("cfg_min_sigma", config.cfg_min_sigma)):
            given = getattr(self, name)
            values[name] = float(default if given is None else given)
            if not values[name] >= 0:
                raise ValueError(f"{name} must be >= 0, got {values[name]}")
        if values["cfg_min_sigma"] > 1:
            raise ValueError(f"cfg_min_sigma must be in [0, 1], got {values['cfg_min_sigma']}")
        values["self_condition_draft"] = self.self_condition_draft or config.self_condition_draft
        if values["self_condition_draft"] not in SELF_CONDITION_DRAFTS:
            raise ValueError(f"self_condition_draft must be one of {SELF_CONDITION_DRAFTS}, got "
                             f"{values['self_condition_draft']!r}")
        return replace(self, **values, **shared)


def noisy_stream_draft(draft: torch.Tensor | None) -> torch.Tensor | None:
    """The dual stream's self-conditioning input for a draft [B, T, D] of the noisy stream: the clean stream never
    has one (zeros)."""
    return None if draft is None else torch.cat([torch.zeros_like(draft), draft], dim=1)


class AuroraBlockVelocity(BlockVelocityField):
    """Each call predicts the clean block (x0) and returns the velocity of that prediction (the Euler step of an x0
    prediction). The prediction sees the previous call's as its self-conditioning draft (zeros at the first call),
    is guided against a zero draft from the second call on (SC-CFG, `self_condition_guidance`) and against the block
    alone while σ ≥ `cfg_min_sigma` (prompt CFG). `draft` is carried from call to call."""

    def __init__(self, model: AuroraForCausalLM, state: BlockDecodingState, positions: torch.Tensor,
                 conditional_mask: torch.Tensor):
        super().__init__(model, state, positions, conditional_mask)
        self.noisy = torch.ones(*positions.shape, dtype=torch.bool, device=positions.device)
        self.uses_draft = model.model.denoiser.self_condition_proj is not None
        self.draft = None  # the previous call's prediction

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, mask: torch.Tensor, draft: torch.Tensor | None,
                cache) -> torch.Tensor:
        self.calls += 1
        return self.model.predict_x0(x, self.block_times(sigma), self.noisy, draft, mask, self.positions, cache=cache)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        options = self.options
        draft = None
        if self.uses_draft:
            draft = torch.zeros_like(x) if self.draft is None else self.draft
        prediction = aware = self.predict(x, sigma, self.conditional_mask, draft, self.cache)
        if self.draft is not None and options.self_condition_guidance != 1.0:
            blind = self.predict(x, sigma, self.conditional_mask, torch.zeros_like(draft), self.cache)
            prediction = classifier_free_guidance(prediction, blind, options.self_condition_guidance)
        if self.guided and float(sigma) >= options.cfg_min_sigma:
            prediction = self.guide(prediction, self.predict(x, sigma, self.alone_mask, draft, None))
        if self.uses_draft:
            self.draft = prediction if options.self_condition_draft == "guided" else aware
        # σ > 0 at every evaluated grid point.
        return x0_to_velocity(x, prediction.to(x.dtype), sigma.to(x.dtype))


class AuroraForCausalLM(AuroraPreTrainedModel, BlockLatentForCausalLM):
    """AURORA-LM: frozen query autoencoder + block-causal x0 denoiser (+ its EMA copy for self-trajectory
    consistency). `forward(input_ids)` returns the denoiser's hidden states of the clean text;
    `forward(input_ids, labels=...)` the training objective; `generate()` denoises a block of latents per ODE solve
    and decodes it. Build a trainable model around a trained autoencoder with `from_autoencoder`.

    The training loop calls `on_optimizer_step()` after every optimizer step: it counts the steps (λ_ct's ramp) and
    moves the EMA copy; both are saved with the weights, so a resumed run continues them exactly."""

    generation_options_class = AuroraGenerationOptions
    base_model_class = AuroraModel
    output_class = AuroraOutput
    velocity_field_class = AuroraBlockVelocity
    network_names = {"prior": "denoiser", "encoder": "ae_encoder", "decoder": "ae_decoder"}

    def __init__(self, config: AuroraConfig):
        super().__init__(config)
        self.ema_denoiser = AuroraDenoiser(config) if config.uses_consistency else None
        self.register_buffer("optimizer_steps", torch.zeros((), dtype=torch.long))
        self.post_init()
        if self.ema_denoiser is not None:  # sharded as the online denoiser it follows (the EMA update mixes them)
            self._tp_plan.update(decoder_blocks_tp_plan("ema_denoiser.layers"))
        self.freeze_components()
        if self.ema_denoiser is not None and not self.model.denoiser.clean_in.weight.is_meta:
            self.ema_denoiser.load_state_dict(self.model.denoiser.state_dict())

    def frozen_modules(self) -> list[nn.Module]:
        """The autoencoder and the EMA copy (frozen and in eval mode from the start)."""
        return [self.model.autoencoder] + ([] if self.ema_denoiser is None else [self.ema_denoiser])

    @classmethod
    def from_autoencoder(cls, autoencoder: "str | AuroraAutoencoder", config: AuroraConfig | None = None,
                         **config_kwargs) -> "AuroraForCausalLM":
        """A fresh AURORA-LM whose frozen autoencoder is a copy of `autoencoder` (a trained `AuroraAutoencoder` or its
        folder); see `from_component`."""
        return cls.from_component(autoencoder, config, **config_kwargs)

    @torch.no_grad()
    def estimate_latent_statistics(self, rows: torch.Tensor, max_rows: int = 64, batch_size: int = 16) -> None:
        """Per-channel standardisation statistics of the frozen encoder's latents over the first `max_rows` of
        `rows` [N, L] (unpadded token rows), in eval mode. They are buffers of the autoencoder, saved with the
        weights; the denoiser's targets are standardised with them."""
        rows = rows[:max_rows]
        if rows.ndim != 2 or rows.shape[0] == 0:
            raise ValueError(f"estimate_latent_statistics needs [N, L] token rows with N >= 1, got {tuple(rows.shape)}")
        autoencoder = self.model.autoencoder
        device = autoencoder.embed_tokens.weight.device
        with model_mode(autoencoder, False):
            raw = torch.cat([autoencoder.encode(chunk.to(device)) for chunk in rows.split(batch_size)])
        autoencoder.set_latent_statistics(raw)

    training_rows_needed = 64  # the latent statistics' rows (`estimate_latent_statistics`)

    def prepare_training(self, train_rows: torch.Tensor) -> None:
        """Called by the training loop before the first step: the latent statistics, from the training rows, unless
        the model (or the checkpoint it resumes) already has them."""
        if not bool(self.model.autoencoder.has_latent_statistics):
            self.estimate_latent_statistics(train_rows)

    @torch.no_grad()
    def on_optimizer_step(self) -> None:
        """After each optimizer step: count it and move the EMA copy toward the denoiser with decay
        min(ema_decay, (1 + n) / (10 + n)), n = steps so far."""
        self.optimizer_steps += 1
        if self.ema_denoiser is None:
            return
        n = int(self.optimizer_steps)
        decay = min(self.config.ema_decay, (1 + n) / (10 + n))
        for ema, online in zip(self.ema_denoiser.parameters(), self.model.denoiser.parameters()):
            ema.lerp_(online.detach().to(ema.dtype), 1 - decay)

    def consistency_weight(self) -> float:
        """λ_ct now: consistency_weight · min(1, steps / consistency_warmup_steps)."""
        cfg = self.config
        if not cfg.uses_consistency:
            return 0.0
        ramp = 1.0 if cfg.consistency_warmup_steps == 0 else min(1.0, int(self.optimizer_steps) /
                                                                cfg.consistency_warmup_steps)
        return cfg.consistency_weight * ramp

    # ------------------------------------------------------------------------------------------------------------
    # training objective
    # ------------------------------------------------------------------------------------------------------------

    def predict_x0(self, latents: torch.Tensor, timesteps: torch.Tensor, noisy: torch.Tensor | None = None,
                   self_condition: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, cache=None, ema: bool = False) -> torch.Tensor:
        """The predicted clean latents [B, T, D] (float32) of standardised latents [B, T, D] at per-position σ [B, T]:
        one denoiser evaluation, through the base model's forward (where call counters see it), or through the EMA
        copy with `ema=True` (then `attention_mask` must be a ready 4-D mask with `position_ids`)."""
        if ema:
            hidden = self.ema_denoiser(latents, timesteps, noisy, self_condition, position_ids, attention_mask, cache)
            return self.ema_denoiser.x0_head(hidden).float()
        hidden = self.model(latents=latents, timesteps=timesteps, noisy=noisy, self_condition=self_condition,
                            attention_mask=attention_mask, position_ids=position_ids, cache=cache).last_hidden_state
        return self.model.denoiser.x0_head(hidden).float()

    def training_objective(self, input_ids: torch.Tensor, labels: torch.Tensor,
                           attention_mask: torch.Tensor | None = None) -> AuroraOutput:
        """Denoising loss (+ λ_ct · self-trajectory consistency) on packed or right-padded rows.

        Every block at once over [clean stream ; noisy stream] (`dual_stream_mask`): block b's noisy copy x_σ =
        (1 − σ)·z + σ·ε, σ drawn per (row, block), sees itself and the clean blocks < b (none with probability
        `history_dropout`) and predicts z. With probability `self_condition_prob` per row, a first pass without
        gradient gives the draft the main pass sees (`self_condition_draft`). Consistency (`consistency_target`):
        the EMA copy's prediction one Euler step further down the sampling grid is the target of the online
        prediction.

        In eval mode the draws (σ, block conditions, ε) are one fixed row from `evaluation_generator`, shared by
        every row, and nothing else is random (no draft, no consistency term): the same batch gives the same loss."""
        cfg = self.config
        check_block_training_rows(input_ids, attention_mask, "AURORA")
        length = input_ids.shape[1]
        scored = scored_positions(labels, attention_mask)
        z = self.latent_targets(input_ids, attention_mask)
        sampler = make_time_sampler(cfg.time_sampler, **cfg.time_sampler_kwargs())
        generator = None if self.training else evaluation_generator()
        sigma, clean_lead, history_visible, noise = self.training_draws(z, sampler, generator)
        stream = self.dual_stream_inputs(z, sigma, noise, history_visible, attention_mask)
        draft = self.self_condition_draft(stream)
        x0 = self.predict_x0(stream.latents, stream.timesteps, stream.noisy, noisy_stream_draft(draft), stream.mask,
                             stream.positions)[:, length:]

        fm_scored = (scored & ~clean_lead).float()
        denoising = (self.denoising_error(x0, z, sigma) * fm_scored).sum() / fm_scored.sum().clamp(min=1)
        loss = denoising
        consistency = weight = None
        if self.ema_denoiser is not None and self.training:
            weight = torch.tensor(self.consistency_weight(), device=input_ids.device)
            target = self.consistency_target(stream, z, sigma, x0.detach(), draft is not None)
            consistency = ((x0 - target).pow(2).mean(-1) * fm_scored).sum() / fm_scored.sum().clamp(min=1)
            loss = loss + weight * consistency
            consistency = consistency.detach()
        return AuroraOutput(loss=loss, denoising_loss=denoising.detach(), consistency_loss=consistency,
                            consistency_weight=weight)

    @torch.no_grad()
    def latent_targets(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The denoiser's targets z [B, T, D]: the frozen encoder's latents of the rows, standardised. The latent
        statistics are normally set before the first step (`prepare_training`); a model trained through the bare
        API estimates them from its first training batch here (`_first_batch_statistics`)."""
        autoencoder = self.model.autoencoder
        raw = autoencoder.encode(input_ids, attention_mask)
        if self.training and not bool(autoencoder.has_latent_statistics):
            self._first_batch_statistics(raw, attention_mask)
        return autoencoder.standardize(raw)

    def _first_batch_statistics(self, raw: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        # Never inside an adapter fine-tune: an adapter does not carry buffers, so the reloaded base would
        # standardise differently.
        if any("lora_" in name for name, _ in self.named_parameters()):
            raise ValueError("this AURORA model has no latent statistics, and a fine-tune with adapters cannot set "
                             "them (an adapter does not carry buffers): call `model.estimate_latent_statistics(rows)` "
                             "on the base model before attaching the adapters, and save it")
        self.model.autoencoder.set_latent_statistics(raw, None if attention_mask is None else attention_mask.bool())

    def self_condition_draft(self, stream: DualStreamInputs) -> torch.Tensor | None:
        """The self-conditioning draft [B, T, D] of the main pass: None without self-conditioning; else zeros,
        except in training for the rows (each with probability `self_condition_prob`) that get a first prediction,
        made without gradient."""
        if self.model.denoiser.self_condition_proj is None:
            return None
        draft = torch.zeros_like(stream.x)
        if self.training:
            use = torch.rand(draft.shape[0], device=draft.device) < self.config.self_condition_prob
            if bool(use.any()):
                with torch.no_grad():
                    first = self.predict_x0(stream.latents, stream.timesteps, stream.noisy, noisy_stream_draft(draft),
                                            stream.mask, stream.positions)
                draft = torch.where(use[:, None, None], first[:, draft.shape[1]:], draft)
        return draft

    @torch.no_grad()
    def consistency_target(self, stream: DualStreamInputs, z: torch.Tensor, sigma: torch.Tensor, x0: torch.Tensor,
                           self_conditioned: bool) -> torch.Tensor:
        """The self-trajectory consistency target [B, T, D]: from σ, the Euler step with the (detached) online
        prediction x0 to σ' = Prev_S(σ) on the `consistency_steps` grid gives x̃_σ'; the EMA copy's prediction
        there, with x0 as its draft when the model self-conditions. Clean leading positions (σ = 0) stay where
        they are."""
        length = z.shape[1]
        grid = FlowMatchEulerSampler(self.config.consistency_steps)
        grid.set_timesteps(device=z.device)
        positive = sigma > 0
        sigma_safe = torch.where(positive, sigma, 1.0)
        previous = torch.where(positive, grid.previous_timestep(sigma_safe), 0.0)
        stepped = euler_step_from_x0(stream.x, x0, sigma_safe[..., None], previous[..., None])
        x_previous = torch.where(positive[..., None], stepped, stream.x)
        latents = torch.cat([z, x_previous], dim=1)
        timesteps = torch.cat([torch.zeros_like(sigma), previous], dim=1)
        draft = noisy_stream_draft(x0 if self_conditioned else None)
        return self.predict_x0(latents, timesteps, stream.noisy, draft, stream.mask, stream.positions,
                               ema=True)[:, length:]

    def denoising_error(self, x0: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Per-position denoising error [B, T]: mean over channels of (ẑ − z)², divided by σ² (clamped at
        `velocity_min_sigma`) when `loss_space` is "velocity"."""
        cfg = self.config
        error = (x0 - z).pow(2).mean(-1)
        if cfg.loss_space == "velocity":  # ‖v̂ − v‖² = ‖ẑ − z‖² / σ²
            error = error / sigma.clamp(min=cfg.velocity_min_sigma).pow(2)
        return error

    def denoising_terms(self, z: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor,
                        history_visible: torch.Tensor | None = None,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The plain denoising error of every latent position with the given draws, unreduced: [B, T] (float32).
        One pass of the online denoiser, without a self-conditioning draft (a zero draft, as the training objective
        gives a row that draws none) and without consistency; arguments as `dual_stream_inputs`. Used by
        per-response scores (sums over a response's positions, hf_latentlm/training/scorers.py)."""
        stream = self.dual_stream_inputs(z, sigma, noise, history_visible, attention_mask)
        draft = None if self.model.denoiser.self_condition_proj is None else torch.zeros_like(stream.latents)
        x0 = self.predict_x0(stream.latents, stream.timesteps, stream.noisy, draft, stream.mask, stream.positions)
        return self.denoising_error(x0[:, z.shape[1]:], z, sigma)

    # ------------------------------------------------------------------------------------------------------------
    # generate (the block loop is `BlockLatentGenerationMixin`'s, the shared steps `BlockLatentForCausalLM`'s)
    # ------------------------------------------------------------------------------------------------------------

    def _encode_prompt(self, input_ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The standardised latents of the aligned prompts."""
        keep_ratio = self.model.autoencoder.config.keep_ratio
        if keep_ratio != 1:
            raise ValueError(f"generate() needs an autoencoder with keep_ratio 1 (one latent per token), this one has "
                             f"{keep_ratio}")
        return super()._encode_prompt(input_ids, real)

    def _decode_latents(self, latents: torch.Tensor, attention_mask: torch.Tensor, cache) -> torch.Tensor:
        autoencoder = self.model.autoencoder
        return autoencoder.decode_logits(autoencoder.unstandardize(latents), attention_mask=attention_mask,
                                         cache=cache)


__all__ = ["AuroraAutoencoder", "AuroraAutoencoderConfig", "AuroraAutoencoderOutput", "AuroraConfig",
           "AuroraDenoiser", "AuroraForCausalLM", "AuroraGenerationOptions", "AuroraModel", "AuroraOutput",
           "AuroraQueryDecoder", "AuroraQueryEncoder", "causal_by_position_mask"]
