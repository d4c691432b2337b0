"""Configurations of AURORA-LM (paper 003; method-specs §4): the frozen query-based text autoencoder and the
block-causal flow-matching denoiser over its standardised latents."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .configuration_backbone import (BackboneConfig, check_fraction, check_non_negative, check_positive,
                                     decoder_blocks_tp_plan)
from .configuration_block_latent import TIME_SAMPLERS, BlockLatentConfig

AURORA_TIME_SAMPLERS = ("tan", *TIME_SAMPLERS)
LOSS_SPACES = ("x0", "velocity")


@strict
class AuroraAutoencoderConfig(BackboneConfig):
    r"""Query-based text autoencoder: L tokens <-> N = round(keep_ratio·L) latent slots of width D = hidden_size.

    Encoder: every slot starts from one learned query vector; at every layer slot i (0-based) attends to slots ≤ i
    and to the token embeddings of the prefix w_0 .. w_{⌈(i+1)L/N⌉−1} (the raw embeddings, read again at every
    layer; RoPE on both, a slot at the position of the last token it covers); a final RMSNorm gives the latent.
    Decoder: every output position starts from a second learned query; position j attends to decoder states ≤ j
    and to slots ≤ ⌊j·N/L⌋; it never sees a token, so a sequence decodes in one parallel pass, with logits
    h_j·Eᵀ through the encoder's token embedding E. Both are causal by position, so with keep_ratio 1 slot i is the
    latent of token i and a prefix encodes (and decodes) the same whatever follows.
    The backbone fields size both halves: `num_hidden_layers` blocks EACH (paper: 6 + 6). Loss: token cross-entropy
    only. The standardisation statistics are buffers of the autoencoder, set by the denoiser's training.
    """

    model_type = "aurora_autoencoder"

    # The blocks are the encoder's and the decoder's query stacks. The embedding is also the decoder's output matrix
    # (logits = h·Eᵀ): it stays whole on every rank ("replicate"), instead of transformers' default row sharding of
    # an `embed_tokens`, under which the read-out would see a vocabulary shard.
    base_model_tp_plan = {"embed_tokens": "replicate", **decoder_blocks_tp_plan("encoder.layers", "decoder.layers")}

    num_hidden_layers: int = 2
    # c = N / L in (0, 1] (the paper's models use 1). The denoiser needs 1; below 1 the autoencoder trains and reports
    # on its own (no padding, no cache).
    keep_ratio: int | float = 1.0
    token_dropout: int | float = 0.3  # probability of zeroing a whole input token embedding (training only)
    # Probability of zeroing a latent coordinate before decoding (training only, no rescaling, as in the paper).
    latent_dropout: int | float = 0.6
    statistics_eps: int | float = 1e-6  # ε of the per-channel standardisation z = (z_enc − μ) / sqrt(var + ε)
    # **Ours, not the paper's**: each query starts from the learned query plus the context item at its own position
    # (encoder slot i: token embedding i; decoder position j: latent j), a copy path the shared query must otherwise
    # learn through RoPE alone. Still causal by position; keep_ratio 1 only.
    query_residual: bool = False

    @property
    def latent_size(self) -> int:
        return self.hidden_size

    def validate_architecture(self) -> None:
        """Raise a ValueError naming the first bad field."""
        super().validate_architecture()
        if not 0 < self.keep_ratio <= 1:
            raise ValueError(f"AuroraAutoencoderConfig.keep_ratio must be in (0, 1], got {self.keep_ratio}")
        check_fraction(self, ("token_dropout", "latent_dropout"))
        if self.query_residual and self.keep_ratio != 1:
            raise ValueError(f"AuroraAutoencoderConfig.query_residual needs keep_ratio 1 (one query per context item), "
                             f"got keep_ratio {self.keep_ratio}")
        if not self.statistics_eps > 0:
            raise ValueError(f"AuroraAutoencoderConfig.statistics_eps must be > 0, got {self.statistics_eps}")


#: What the next Euler step sees as its self-conditioning draft (`AuroraConfig.self_condition_draft`).
SELF_CONDITION_DRAFTS = ("guided", "unguided")


@strict
class AuroraConfig(BlockLatentConfig):
    r"""AURORA-LM: a frozen query autoencoder (a submodule, saved in this checkpoint) and a block-causal denoiser
    that predicts clean latent blocks.

    Denoiser backbone: the backbone fields (the AR baseline of the same preset has the same width, depth and heads),
    with per-head QK-norm. Clean latents enter through a full-width linear map; noisy latents through the low-rank
    bottleneck D -> `noisy_input_rank` -> hidden (**choice**: the clean history keeps full width, as the paper
    squeezes "only the noisy pathway"). The timestep and the self-conditioning draft each go through one linear map
    per layer and are ADDED to the residual stream before that layer. The head predicts the clean latent ẑ (x0).
    Training: x_σ = (1 − σ)·z + σ·ε over standardised latents z, one σ per (row, block) ("tan" sampler: flow.py).
    Generation: prompt CFG (`cfg_scale`, 1 = off) applies only while σ ≥ `cfg_min_sigma` and only to rows with a
    clean prefix.
    """

    model_type = "aurora"
    sub_configs_defaults = {"autoencoder_config": AuroraAutoencoderConfig}
    component_config_name = "autoencoder_config"
    component_name = "autoencoder"
    time_samplers = AURORA_TIME_SAMPLERS

    base_model_tp_plan = decoder_blocks_tp_plan("denoiser.layers")  # the denoiser's blocks

    # AURORA's own defaults of shared fields: the paper's "tan" schedule with d = 7, prompt CFG w = 2.
    time_sampler: str = "tan"
    time_shift: int | float = 7.0
    time_loc: int | float = 0.0
    cfg_scale: int | float = 2.0
    # The frozen autoencoder's config (build with `AuroraForCausalLM.from_autoencoder`); `vocab_size` must agree.
    autoencoder_config: dict | PreTrainedConfig | None = None
    noisy_input_rank: int | None = 128  # D_b of the noisy-input bottleneck; None = one linear map D -> hidden
    # "x0" = mean ‖ẑ − z‖² (the paper's best); "velocity" = the same error in velocity space, ‖ẑ − z‖² /
    # max(σ, velocity_min_sigma)² (the paper's ablation that weights low noise up).
    loss_space: str = "x0"
    velocity_min_sigma: int | float = 0.05  # floor of σ in the velocity-space weight (**choice**: 1/σ² is unbounded)
    # p_sc: per row, a first pass (no gradient) gives a draft ẑ that the main pass receives; otherwise zeros.
    self_condition_prob: int | float = 0.6
    consistency_weight: int | float = 1.0  # final λ_ct of self-trajectory consistency (0 = off, no EMA copy)
    consistency_warmup_steps: int = 10000  # λ_ct ramps linearly from 0 over this many optimizer steps
    consistency_steps: int = 16  # S of the sampling grid whose Prev_S(σ) the consistency target is taken at
    # Decay of the EMA copy that gives the consistency target, applied as min(ema_decay, (1 + n) / (10 + n)) after the
    # n-th optimizer step (**choice**: the usual warm-up, so that a short run has a useful target).
    ema_decay: int | float = 0.9999
    # w_sc of SC-CFG, ẑ = ẑ_blind + w_sc·(ẑ_aware − ẑ_blind) (1 = off).
    self_condition_guidance: int | float = 4.0
    # The draft the next Euler step sees: "unguided", the step's aware prediction before any guidance (the kind of
    # draft training shows), or "guided", its final prediction. The paper does not say.
    self_condition_draft: str = "unguided"
    cfg_min_sigma: int | float = 0.9

    @property
    def uses_consistency(self) -> bool:
        return self.consistency_weight > 0

    def validate_component(self) -> None:
        super().validate_component()
        keep_ratio = self.autoencoder_config.keep_ratio
        if keep_ratio != 1:
            raise ValueError(f"AURORA-LM's denoiser needs an autoencoder with keep_ratio 1 (one latent per token, so "
                             f"that latent blocks are token blocks); this one has keep_ratio {keep_ratio}")

    def validate_architecture(self) -> None:
        """Raise a ValueError naming the first bad field."""
        super().validate_architecture()
        check_positive(self, ("consistency_steps",))
        if self.noisy_input_rank is not None and self.noisy_input_rank < 1:
            raise ValueError(f"AuroraConfig.noisy_input_rank must be None (no bottleneck) or at least 1, got "
                             f"{self.noisy_input_rank}")
        if self.loss_space not in LOSS_SPACES:
            raise ValueError(f"AuroraConfig.loss_space must be one of {LOSS_SPACES}, got {self.loss_space!r}")
        if not 0 < self.velocity_min_sigma <= 1:
            raise ValueError(f"AuroraConfig.velocity_min_sigma must be in (0, 1], got {self.velocity_min_sigma}")
        check_fraction(self, ("self_condition_prob", "cfg_min_sigma"), upper_open=False)
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"AuroraConfig.ema_decay must be in [0, 1), got {self.ema_decay}")
        check_non_negative(self, ("consistency_warmup_steps", "consistency_weight", "self_condition_guidance"))
        if self.self_condition_draft not in SELF_CONDITION_DRAFTS:
            raise ValueError(f"AuroraConfig.self_condition_draft must be one of {SELF_CONDITION_DRAFTS}, got "
                             f"{self.self_condition_draft!r}")


__all__ = ["AURORA_TIME_SAMPLERS", "AuroraAutoencoderConfig", "AuroraConfig", "LOSS_SPACES", "SELF_CONDITION_DRAFTS"]
