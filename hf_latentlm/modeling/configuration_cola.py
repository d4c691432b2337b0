"""Configurations of Cola DLM (paper 004; method-specs §3): the causal text VAE and the block-causal DiT latent prior
trained jointly with it."""

from __future__ import annotations

from .configuration_backbone import (BackboneConfig, check_fraction, check_non_negative, check_positive,
                                     decoder_blocks_tp_plan)
from .configuration_block_latent import TIME_SAMPLERS, BlockLatentConfig

ODE_SOLVERS = ("euler", "heun")


class ColaVAEConfig(BackboneConfig):
    r"""Causal text VAE: one latent of `latent_size` channels per token.

    Encoder: token embedding -> `num_hidden_layers` pre-norm blocks (block-causal attention: bidirectional inside
    blocks of `vae_block_size` positions, causal across) -> RMSNorm -> linear to d_z -> LayerNorm without affine
    parameters = posterior mean μ (power ≈ 1 per channel, **code**). Posterior N(μ, σ²I) with one σ² = exp(−logSNR)
    for every position and channel (**choice**, method-specs §3: the logSNR is a scalar, learnable or fixed).
    Decoder (reads latents only, **code**): linear d_z -> hidden, `num_hidden_layers` block-causal blocks, RMSNorm,
    linear to the vocabulary; position i yields the logits of token i, so a block of latents decodes in ONE pass.

    Backbone fields (`BackboneConfig`, Llama names) size both halves: `num_hidden_layers` blocks EACH (paper: 4 + 4).
    Args:
        latent_size (`int`, 16): d_z.
        vae_block_size (`int`, 4): attention block of encoder and decoder (**code** default; 1 = strictly causal, as
            the paper describes). Blocks are counted from each row's first real token.
        logsnr_init (`float`, 1.5): initial VAE logSNR = log(mean power of μ / σ²); the paper's learned value ended
            near 4.5 and fixed 1.5 was its best fixed setting.
        learn_logsnr (`bool`, True): train the logSNR (False keeps `logsnr_init`).
        logsnr_min / logsnr_max (`float`, -20 / 30): clamp of the logSNR (the code clamps log σ² to [−30, 20]).
        kl_weight (`float`, 1e-3): β of β·KL(q(z|x) ‖ N(0, I)) (summed over channels, mean over scored tokens). With
            a LayerNorm'd mean the KL only acts on the logSNR, pulling it down against the reconstruction.
        mask_prob (`float`, 0.15): share of input tokens replaced by a learned mask embedding in the BERT-style pass.
        mask_loss_weight (`float`, 0.5): λ_mask of the cross-entropy, at the masked positions only, of decoding the
            masked input's latents (**choice**: a second encoder pass; the clean pass trains reconstruction).
    Loss: reconstruction CE (clean input, sampled z) + kl_weight·KL + mask_loss_weight·masked CE.
    """

    model_type = "cola_vae"

    # The VAE's blocks are its encoder's and its decoder's; the embedding and read-out stay whole.
    base_model_tp_plan = decoder_blocks_tp_plan("encoder.layers", "decoder.layers")

    def __init__(
        self,
        latent_size: int = 16,
        vae_block_size: int = 4,
        logsnr_init: float = 1.5,
        learn_logsnr: bool = True,
        logsnr_min: float = -20.0,
        logsnr_max: float = 30.0,
        kl_weight: float = 1e-3,
        mask_prob: float = 0.15,
        mask_loss_weight: float = 0.5,
        **kwargs,
    ):
        kwargs.setdefault("num_hidden_layers", 2)
        super().__init__(**kwargs)
        self.latent_size = latent_size
        self.vae_block_size = vae_block_size
        self.logsnr_init = logsnr_init
        self.learn_logsnr = learn_logsnr
        self.logsnr_min = logsnr_min
        self.logsnr_max = logsnr_max
        self.kl_weight = kl_weight
        self.mask_prob = mask_prob
        self.mask_loss_weight = mask_loss_weight
        self.validate_vae()

    def validate_vae(self) -> None:
        """Raise a ValueError naming the first bad field."""
        self.validate_backbone()
        check_positive(self, ("latent_size", "vae_block_size"))
        check_fraction(self, ("mask_prob",))
        if self.kl_weight < 0 or self.mask_loss_weight < 0:
            raise ValueError(f"ColaVAEConfig.kl_weight and mask_loss_weight must be >= 0, got {self.kl_weight} and "
                             f"{self.mask_loss_weight}")
        if not self.logsnr_min <= self.logsnr_init <= self.logsnr_max:
            raise ValueError(f"ColaVAEConfig.logsnr_init ({self.logsnr_init}) must lie in [logsnr_min, logsnr_max] = "
                             f"[{self.logsnr_min}, {self.logsnr_max}]")


class ColaConfig(BlockLatentConfig):
    r"""Cola DLM: the text VAE (a submodule, trained jointly) and a block-causal DiT prior over its latents.

    DiT backbone: the fields of `BackboneConfig` (Llama names; the AR baseline of the same preset has the same width,
    depth and heads). Blocks with adaLN-Zero timestep conditioning (sinusoidal -> MLP, per position: the clean
    history has t = 0), bidirectional inside a latent block, causal across blocks.

    Args:
        block_size (`int`, 16): latent positions per DiT block (paper 16). Must be a multiple of the VAE's
            `vae_block_size`, so that a finished DiT block is also a finished VAE block.
        vae_config (`ColaVAEConfig` or dict): the VAE's config; its weights live in this checkpoint under
            `model.vae.`. `vocab_size` must agree. Build with `ColaForCausalLM.from_vae(...)`.
    Training (flow matching, z_t = (1 − t)·z_0 + t·ε, target velocity ε − z_0):
        time_sampler (`str`, "logit_normal"): "logit_normal" (t = sigmoid(loc + scale·n)), "shifted" or "uniform".
        time_loc / time_scale (`float`, 1.0 / 1.0): the logit-normal's loc and scale (paper loc = 1); time_shift
            (`float`, 1.0) for "shifted". One t per (row, block) (**choice**: the reference draws one per row;
            independent blocks give the same expectation with less variance).
        history_dropout (`float`, 0.1): probability that a noisy block sees no clean history, which trains the
            unconditional branch of classifier-free guidance (**code**: the block alone) (**choice** of 0.1).
        prompt_block_prob (`float`, 0.05): probability that a block's first k positions (k uniform in 1..Q−1) enter
            clean at t = 0 and unscored, which trains the repaint of a prompt that ends mid-block (**code**).
        flow_matching_weight (`float`, 1.0): λ_FM. vae_loss_weight (`float`, 1.0): λ_VAE on the VAE's own loss.
        reference_kl_weight (`float`, 0.1): λ_ref of KL(q_φ ‖ q_φref) to the frozen stage-1 encoder (a frozen copy
            kept as `reference_encoder`; its weights are saved, so a resumed run keeps the same anchor).
        vae_learning_rate_ratio (`float`, 1.0): VAE learning rate / DiT learning rate. 1 = joint (paper's best);
            0 = frozen VAE (no VAE or reference terms, no reference copy).
        vae_frozen_steps (`int`, 0): **ours**: the VAE is held as at ratio 0 (no VAE or reference terms, no gradient
            into it) for the first N optimizer steps, then trains jointly, so the prior's first steps learn on a
            fixed latent space. 0 = joint from the first step. The steps are counted in the `optimizer_steps`
            buffer (saved, so a resumed run continues the count). Under DDP the held VAE's parameters get no
            gradient: launch with `find_unused_parameters=True`.
        The paper publishes none of the λ values: these are choices, logged as loss parts.
    Generation defaults (each can be overridden in `generate()`):
        num_inference_steps (`int`, 16): Euler (or Heun) steps per block (`num_ode_steps`: its deprecated
            spelling). ode_solver (`str`, "euler").
        cfg_scale (`float`, 7.0): classifier-free guidance w; forced to 1 for a block with no history.
        decode_temperature (`float`, 0.0): 0 reads each token out greedily from the VAE decoder; > 0 samples.
    """

    model_type = "cola"
    sub_configs = {"vae_config": ColaVAEConfig}
    component_config_name = "vae_config"
    component_name = "VAE"

    def __init__(
        self,
        block_size: int = 16,
        vae_config: ColaVAEConfig | dict | None = None,
        flow_matching_weight: float = 1.0,
        vae_loss_weight: float = 1.0,
        reference_kl_weight: float = 0.1,
        vae_learning_rate_ratio: float = 1.0,
        vae_frozen_steps: int = 0,
        ode_solver: str = "euler",
        **kwargs,
    ):
        # The shared fields (time sampler, dropouts, generation defaults) are `BlockLatentConfig`'s, with its defaults.
        super().__init__(block_size=block_size, **kwargs)
        self._embed_sub_config("vae_config", vae_config, vocab_size=self.vocab_size)
        self.flow_matching_weight = flow_matching_weight
        self.vae_loss_weight = vae_loss_weight
        self.reference_kl_weight = reference_kl_weight
        self.vae_learning_rate_ratio = vae_learning_rate_ratio
        self.vae_frozen_steps = vae_frozen_steps
        self.ode_solver = ode_solver
        self.validate_cola()

    @property
    def trains_vae(self) -> bool:
        return self.vae_learning_rate_ratio > 0

    def validate_component(self) -> None:
        super().validate_component()
        if self.block_size % self.vae_config.vae_block_size:
            raise ValueError(f"ColaConfig.block_size ({self.block_size}) must be a multiple of the VAE's "
                             f"vae_block_size ({self.vae_config.vae_block_size})")

    def validate_cola(self) -> None:
        """Raise a ValueError naming the first bad field."""
        self.validate_block_latent()
        check_non_negative(self, ("flow_matching_weight", "vae_loss_weight", "reference_kl_weight",
                                  "vae_learning_rate_ratio"))
        if not isinstance(self.vae_frozen_steps, int) or self.vae_frozen_steps < 0:
            raise ValueError(f"ColaConfig.vae_frozen_steps must be an int >= 0, got {self.vae_frozen_steps!r}")
        if self.vae_frozen_steps and not self.trains_vae:
            raise ValueError("ColaConfig.vae_frozen_steps holds a VAE that trains later: it needs "
                             "vae_learning_rate_ratio > 0 (at 0 the VAE is frozen throughout)")
        if self.ode_solver not in ODE_SOLVERS:
            raise ValueError(f"ColaConfig.ode_solver must be one of {ODE_SOLVERS}, got {self.ode_solver!r}")


__all__ = ["ColaConfig", "ColaVAEConfig", "ODE_SOLVERS", "TIME_SAMPLERS"]
