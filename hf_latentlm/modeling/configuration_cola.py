"""Configurations of Cola DLM (paper 004; method-specs §3): the causal text VAE and the block-causal DiT latent prior
trained jointly with it."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .configuration_backbone import (BackboneConfig, check_fraction, check_non_negative, check_positive,
                                     decoder_blocks_tp_plan)
from .configuration_block_latent import TIME_SAMPLERS, BlockLatentConfig

ODE_SOLVERS = ("euler", "heun")
#: `architecture` of the VAE and `dit_architecture` of the DiT: this project's modules, or the official code's
#: (ByteDance-Seed/Cola-DLM), which a converted checkpoint uses (hf_latentlm/official/cola.py).
ARCHITECTURES = ("ours", "official")
ATTENTION_DTYPES = (None, "bfloat16")


@strict
class ColaVAEConfig(BackboneConfig):
    r"""Causal text VAE: one latent of `latent_size` channels per token (docs/families/cola.md).

    Encoder: token embedding -> `num_hidden_layers` pre-norm blocks, block-causal over blocks of `vae_block_size`
    positions -> RMSNorm -> linear to d_z -> LayerNorm without affine parameters = posterior mean μ (**code**).
    Posterior N(μ, σ²I) with one σ² = exp(−logSNR) for every position and channel (**choice**, method-specs §3).
    Decoder (reads latents only, **code**): linear d_z -> hidden, block-causal blocks, RMSNorm, linear to the
    vocabulary; a block of latents decodes in ONE pass. The backbone fields size both halves: `num_hidden_layers`
    blocks EACH (paper: 4 + 4). Loss: reconstruction CE (sampled z) + kl_weight·KL + mask_loss_weight·masked CE.

    `architecture="official"` is the official form (ByteDance-Seed/Cola-DLM's `ColaTextVAEModel`, patch size 1;
    modules in cola_official.py, conversion in hf_latentlm/official/cola.py): post-norm LayerNorm blocks with
    biases, one extra embedding row (the masked pass's [MASK] input), linear patch layers, no final encoder norm, the
    posterior's own log-variance (no logSNR parameter), `num_decoder_layers` decoder blocks and an affine final norm.
    """

    model_type = "cola_vae"

    # The VAE's blocks are its encoder's and its decoder's; the embedding and read-out stay whole.
    base_model_tp_plan = decoder_blocks_tp_plan("encoder.layers", "decoder.layers")

    num_hidden_layers: int = 2
    latent_size: int = 16  # d_z
    # Attention block of encoder and decoder (**code** default; 1 = strictly causal, as the paper describes), counted
    # from each row's first real token.
    vae_block_size: int = 4
    logsnr_init: int | float = 1.5  # log(mean power of μ / σ²) at the start: the paper's best fixed setting
    learn_logsnr: bool = True  # False keeps `logsnr_init`
    logsnr_min: int | float = -20.0  # clamp of the logSNR (the code clamps log σ² to [−30, 20])
    logsnr_max: int | float = 30.0
    # β of β·KL(q(z|x) ‖ N(0, I)) (summed over channels, mean over scored tokens). With a LayerNorm'd mean the KL only
    # acts on the logSNR, pulling it down against the reconstruction.
    kl_weight: int | float = 1e-3
    mask_prob: int | float = 0.15  # share of input tokens replaced by a learned mask embedding in the BERT-style pass
    # λ_mask of the cross-entropy, at the masked positions only, of decoding the masked input's latents (**choice**:
    # a second encoder pass; the clean pass trains reconstruction).
    mask_loss_weight: int | float = 0.5
    architecture: str = "ours"  # "official": the official form (class docstring)
    num_decoder_layers: int | None = None  # None -> num_hidden_layers (the official form may differ)
    qkv_bias: bool = False  # biases on the q/k/v projections (official form only; the official `qk_bias`)
    # The DiT works on (μ − shifting) · scaling, and the decoder reads latents in that space (the official
    # `scaling_factor` / `shifting_factor`; 1 and 0 leave the latents as the encoder gives them).
    latent_scaling_factor: int | float = 1.0
    latent_shifting_factor: int | float = 0.0

    @property
    def official(self) -> bool:
        return self.architecture == "official"

    @property
    def num_decoder_blocks(self) -> int:
        return self.num_hidden_layers if self.num_decoder_layers is None else self.num_decoder_layers

    def validate_architecture(self) -> None:
        """Raise a ValueError naming the first bad field."""
        super().validate_architecture()
        check_positive(self, ("latent_size", "vae_block_size"))
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"ColaVAEConfig.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.num_decoder_layers is not None and self.num_decoder_layers < 1:
            raise ValueError(f"ColaVAEConfig.num_decoder_layers must be None or >= 1, got {self.num_decoder_layers}")
        if self.qkv_bias and not self.official:
            raise ValueError("ColaVAEConfig.qkv_bias is an option of the official form (architecture='official')")
        if not self.latent_scaling_factor > 0:
            raise ValueError(f"ColaVAEConfig.latent_scaling_factor must be > 0, got {self.latent_scaling_factor}")
        check_fraction(self, ("mask_prob",))
        if self.kl_weight < 0 or self.mask_loss_weight < 0:
            raise ValueError(f"ColaVAEConfig.kl_weight and mask_loss_weight must be >= 0, got {self.kl_weight} and "
                             f"{self.mask_loss_weight}")
        if not self.logsnr_min <= self.logsnr_init <= self.logsnr_max:
            raise ValueError(f"ColaVAEConfig.logsnr_init ({self.logsnr_init}) must lie in [logsnr_min, logsnr_max] = "
                             f"[{self.logsnr_min}, {self.logsnr_max}]")


@strict
class ColaConfig(BlockLatentConfig):
    r"""Cola DLM: the text VAE (a submodule, trained jointly) and a block-causal DiT prior over its latents.

    DiT backbone: the backbone fields (the AR baseline of the same preset has the same width, depth and heads), with
    adaLN-Zero timestep conditioning per position (the clean history has t = 0). `block_size` (paper 16) must be a
    multiple of the VAE's `vae_block_size`, so that a finished DiT block is also a finished VAE block.
    Training: flow matching, z_t = (1 − t)·z_0 + t·ε, target velocity ε − z_0, one t per (row, block) (**choice**:
    the reference draws one per row; independent blocks give the same expectation with less variance). The paper
    publishes none of the λ values: these are choices, logged as loss parts.

    `dit_architecture="official"` is the official form (ByteDance-Seed/Cola-DLM's `ColaDiTModel`, patch size 1;
    modules in cola_official.py): its timestep embedding, per-head LayerNorm QK-norm, interleaved RoPE on the first
    `rope_dim` channels of each head, a GELU(tanh) MLP with biases and an affine final norm. `attention_dtype=
    "bfloat16"` computes the attention products under bfloat16 autocast, as the official DiT does on every device
    (needed to reproduce its outputs closely).
    """

    model_type = "cola"
    sub_configs_defaults = {"vae_config": ColaVAEConfig}
    component_config_name = "vae_config"
    component_name = "VAE"

    # The VAE's config (its weights live in this checkpoint under `model.vae.`); build with `ColaForCausalLM.from_vae`.
    vae_config: dict | PreTrainedConfig | None = None
    flow_matching_weight: int | float = 1.0  # λ_FM
    vae_loss_weight: int | float = 1.0  # λ_VAE on the VAE's own loss
    # λ_ref of KL(q_φ ‖ q_φref) to the frozen stage-1 encoder (a frozen copy kept as `reference_encoder`; its weights
    # are saved, so a resumed run keeps the same anchor).
    reference_kl_weight: int | float = 0.1
    # VAE learning rate / DiT learning rate. 1 = joint (the paper's best); 0 = frozen VAE (no VAE or reference terms,
    # no reference copy).
    vae_learning_rate_ratio: int | float = 1.0
    # **Ours**: the VAE is held as at ratio 0 for the first N optimizer steps, then trains jointly, so the prior's
    # first steps learn on a fixed latent space. Counted in the saved `optimizer_steps` buffer. Under DDP the held
    # VAE's parameters get no gradient: launch with `find_unused_parameters=True`.
    vae_frozen_steps: int = 0
    ode_solver: str = "euler"
    dit_architecture: str = "ours"  # "official": the official form (class docstring)
    rope_dim: int | None = None  # official form: rotated channels per head (None -> head_dim)
    attention_dtype: str | None = None  # None (the inputs' dtype) or "bfloat16" (official form, class docstring)

    @property
    def trains_vae(self) -> bool:
        return self.vae_learning_rate_ratio > 0

    def validate_architecture(self) -> None:
        """Raise a ValueError naming the first bad field."""
        super().validate_architecture()
        check_non_negative(self, ("flow_matching_weight", "vae_loss_weight", "reference_kl_weight",
                                  "vae_learning_rate_ratio"))
        if self.vae_frozen_steps < 0:
            raise ValueError(f"ColaConfig.vae_frozen_steps must be an int >= 0, got {self.vae_frozen_steps!r}")
        if self.vae_frozen_steps and not self.trains_vae:
            raise ValueError("ColaConfig.vae_frozen_steps holds a VAE that trains later: it needs "
                             "vae_learning_rate_ratio > 0 (at 0 the VAE is frozen throughout)")
        if self.ode_solver not in ODE_SOLVERS:
            raise ValueError(f"ColaConfig.ode_solver must be one of {ODE_SOLVERS}, got {self.ode_solver!r}")
        if self.dit_architecture not in ARCHITECTURES:
            raise ValueError(f"ColaConfig.dit_architecture must be one of {ARCHITECTURES}, got "
                             f"{self.dit_architecture!r}")
        if self.attention_dtype not in ATTENTION_DTYPES:
            raise ValueError(f"ColaConfig.attention_dtype must be one of {ATTENTION_DTYPES}, got "
                             f"{self.attention_dtype!r}")
        if (self.rope_dim is not None or self.attention_dtype is not None) and self.dit_architecture != "official":
            raise ValueError("ColaConfig.rope_dim and attention_dtype are options of the official form "
                             "(dit_architecture='official')")
        if self.rope_dim is not None and not (0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
            raise ValueError(f"ColaConfig.rope_dim must be an even number in (0, head_dim = {self.head_dim}], got "
                             f"{self.rope_dim}")

    def validate_component(self) -> None:
        super().validate_component()
        if self.block_size % self.vae_config.vae_block_size:
            raise ValueError(f"ColaConfig.block_size ({self.block_size}) must be a multiple of the VAE's "
                             f"vae_block_size ({self.vae_config.vae_block_size})")


__all__ = ["ARCHITECTURES", "ATTENTION_DTYPES", "ColaConfig", "ColaVAEConfig", "ODE_SOLVERS", "TIME_SAMPLERS"]
