"""Configurations of CALM (paper 000; method-specs §2, calm-supplement.md): the chunk autoencoder and the
continuous autoregressive model that predicts its latents."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .configuration_backbone import BackboneConfig, check_fraction, check_non_negative, check_positive, run_validators

TEMPERATURE_SAMPLERS = ("pool", "exact")
ENERGY_HEAD_TYPES = ("reference", "swiglu")
STAGE_LAYOUTS = ("per_stage", "split")
INPUT_NORMS = ("rms", "layer")
#: The reference implementation's autoencoder recipe (shaochenze/calm), as `CALMAutoencoderConfig` fields: its
#: `num_encoder_layers` blocks are split around the squeeze (2 -> 1 + 1), embeddings start at std 0.02, and corrupted
#: input tokens become token 0 (`input_ids * keep_mask`).
REFERENCE_AUTOENCODER_RECIPE = {"stage_layout": "split", "embedding_init_std": 0.02, "replace_token_id": 0}


@strict
class CALMAutoencoderConfig(PreTrainedConfig):
    r"""Context-free MLP autoencoder: a chunk of K tokens <-> one latent vector of size l.

    Encoder: token embedding -> residual SwiGLU blocks per token (stage 0) -> flatten K·h -> linear to h
    ("squeeze") -> residual blocks per chunk (stage 1) -> linear to 2·l (mean, log σ). The decoder mirrors it
    (l -> h -> blocks per chunk -> linear to K·h -> per-token blocks -> norm -> logits through the tied embedding).
    `REFERENCE_AUTOENCODER_RECIPE` holds the reference code's values of the three recipe fields.
    Loss: K × token cross-entropy (mean over tokens) + kl_weight × clamped KL (mean over chunks).
    """

    model_type = "calm_autoencoder"

    vocab_size: int = 4096
    chunk_size: int = 4  # K tokens per latent
    latent_size: int = 128  # l
    hidden_size: int = 512  # width of the residual SwiGLU blocks
    intermediate_size: int = 1280
    num_encoder_layers: int = 2  # residual blocks of the encoder / decoder, laid out by `stage_layout`
    num_decoder_layers: int = 2
    # "per_stage" puts `num_*_layers` blocks in EACH of the two stages (2 -> 2 + 2 per side); "split" splits them
    # around the squeeze / expand as the reference code does: ⌊n/2⌋ in the first stage (encoder: per token; decoder:
    # per chunk), the rest in the second (2 -> 1 + 1).
    stage_layout: str = "per_stage"
    kl_weight: int | float = 1e-3  # weight of the clamped KL to N(0, I)
    kl_clamp: int | float = 0.5  # free bits, per latent dimension: the loss uses Σ_i max(KL_i, kl_clamp)
    token_replace_prob: int | float = 0.15  # share of input tokens replaced before encoding (training only)
    # What a replaced token becomes: None = a uniformly random token; an id = always that token (the reference: 0).
    replace_token_id: int | None = None
    latent_dropout: int | float = 0.15  # dropout on the sampled latent before decoding (training only)
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02  # std of the linear layers
    # Std of the token embedding, which is also the output layer (the reference: 0.02, its initializer_range); 1.0
    # reconstructs much better after a short training (scripts/experiments/calm_probes.py ae-init).
    embedding_init_std: int | float = 1.0
    # Clamp of the posterior log σ, for numerical safety; both None = no clamp (the official form).
    log_std_min: int | float | None = -10.0
    log_std_max: int | float | None = 2.0
    # Biases on the squeeze, latent-to-hidden and expand projections (the official form: True).
    projection_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | list[int] | None = 0
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = 1

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        run_validators(self)

    def validate_architecture(self) -> None:
        """Raise a ValueError naming the first bad field."""
        super().validate_architecture()
        check_positive(self, ("vocab_size", "chunk_size", "latent_size", "hidden_size", "intermediate_size"))
        check_non_negative(self, ("num_encoder_layers", "num_decoder_layers"))
        check_fraction(self, ("token_replace_prob", "latent_dropout"))
        check_non_negative(self, ("kl_weight", "kl_clamp"))
        if (self.log_std_min is None) != (self.log_std_max is None):
            raise ValueError("CALMAutoencoderConfig.log_std_min and log_std_max must both be set or both be None "
                             "(no clamp)")
        if self.log_std_min is not None and not self.log_std_min < self.log_std_max:
            raise ValueError("CALMAutoencoderConfig.log_std_min must be below log_std_max")
        if self.stage_layout not in STAGE_LAYOUTS:
            raise ValueError(f"CALMAutoencoderConfig.stage_layout must be one of {STAGE_LAYOUTS}, "
                             f"got {self.stage_layout!r}")
        if self.replace_token_id is not None and not (isinstance(self.replace_token_id, int)
                                                      and 0 <= self.replace_token_id < self.vocab_size):
            raise ValueError(f"CALMAutoencoderConfig.replace_token_id must be None or a token id in [0, vocab_size = "
                             f"{self.vocab_size}), got {self.replace_token_id!r}")
        if not self.embedding_init_std > 0:
            raise ValueError(f"CALMAutoencoderConfig.embedding_init_std must be > 0, got {self.embedding_init_std}")

    def stage_layers(self, num_layers: int) -> tuple[int, int]:
        """(first stage, second stage) block counts for `num_layers` under `stage_layout`."""
        if self.stage_layout == "split":
            return num_layers // 2, num_layers - num_layers // 2
        return num_layers, num_layers


@strict
class CALMConfig(BackboneConfig):
    r"""Continuous Autoregressive LM: a transformer over chunk steps whose energy head samples the next latent,
    which the frozen autoencoder (a submodule, weights inside the checkpoint) decodes into K tokens.

    `max_position_embeddings` counts TOKENS; the backbone uses one rotary position per chunk. Step i reads the K
    tokens of chunk i-1, embedded (own table, d) and compressed by Linear(K·d, 2d) -> SiLU -> Linear(2d, d) -> RMSNorm.
    Energy head, `energy_head_type` (both zero-initialise their last linear layer, as the paper does): "swiglu"
    (this project's `SwiGLUEnergyHead`, 5d² weights a block) or "reference" (the reference code's MLPGenerator,
    `ReferenceEnergyHead`, ≈ 6d² a block; not the default: at small scale it drives the backbone's output to the same
    vector at every position, results/calm_equal_compute/).
    Energy loss: Eq. 10, α = 1. The generation defaults (`generation_temperature`, `temperature_*`, `exact_*`) can
    each be overridden in `generate()`.
    """

    model_type = "calm"
    sub_configs_defaults = {"autoencoder_config": CALMAutoencoderConfig}
    keys_to_ignore_at_inference = ["cache"]
    has_token_likelihood = False

    chunk_size: int = 4
    noise_size: int = 64  # d_noise, noise ε ~ U[-0.5, 0.5]^{d_noise}
    num_head_blocks: int | None = None  # residual blocks of the energy head; None -> ceil(num_hidden_layers / 4)
    energy_head_type: str = "swiglu"
    num_model_samples: int = 8  # N head samples per step
    num_target_samples: int = 100  # M posterior samples of the target latent per step
    # The frozen autoencoder's config; its weights live in this model's safetensors under `autoencoder.`.
    # `chunk_size` and `vocab_size` must agree with it; `latent_size` is read from it. Never a path: build with
    # `CALMForCausalLM.from_autoencoder(...)`.
    autoencoder_config: dict | PreTrainedConfig | None = None
    # Default T in (0, 1]; T = 1 is one head draw per step (transformers reserves `temperature` for the
    # GenerationConfig).
    generation_temperature: int | float = 1.0
    # For T < 1: "pool" (approximate: a weighted pick among `temperature_pool_size` draws) or "exact" (rejection
    # sampling); see `CALMGenerationOptions`.
    temperature_sampler: str = "pool"
    # Norm closing the input compression: "rms" (RMSNorm, rms_norm_eps) or "layer" (LayerNorm with bias, the
    # official form).
    input_norm: str = "rms"
    # eps of the LayerNorms (the "reference" energy head's, and a "layer" input norm); None = rms_norm_eps. The
    # official form: 1e-6.
    layer_norm_eps: int | float | None = None
    temperature_pool_size: int = 200
    exact_attempts: int = 16  # the exact sampler draws exact_attempts · ⌈1/T⌉ samples per pending row per round
    exact_max_rounds: int = 64  # rounds before the exact sampler gives up with an error

    def __post_init__(self, **kwargs):
        if self.num_head_blocks is None:
            self.num_head_blocks = -(-self.num_hidden_layers // 4)
        if self.autoencoder_config is None or isinstance(self.autoencoder_config, dict):
            fields = self.autoencoder_config or {"vocab_size": self.vocab_size, "chunk_size": self.chunk_size}
            self.autoencoder_config = CALMAutoencoderConfig(**fields)
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "CALMConfig":
        # A config saved before `energy_head_type` existed has no such key and holds "swiglu" head weights; filled in
        # explicitly so that such a checkpoint keeps its head whatever the `__init__` default is.
        if "energy_head_type" not in config_dict:
            config_dict = {**config_dict, "energy_head_type": "swiglu"}
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_json_file(cls, json_file) -> "CALMConfig":
        return cls.from_dict(cls._dict_from_json_file(json_file))

    @property
    def latent_size(self) -> int:
        return self.autoencoder_config.latent_size

    def validate_architecture(self) -> None:
        """Raise a ValueError naming the first bad field."""
        super().validate_architecture()
        check_positive(self, ("chunk_size", "noise_size", "num_head_blocks", "num_target_samples",
                             "temperature_pool_size", "exact_attempts", "exact_max_rounds"))
        if self.num_model_samples < 2:
            raise ValueError(f"CALMConfig.num_model_samples must be at least 2 (the energy loss's diversity term "
                             f"compares pairs of samples), got {self.num_model_samples}")
        ae = self.autoencoder_config
        if ae.chunk_size != self.chunk_size:
            raise ValueError(f"the autoencoder's chunk_size ({ae.chunk_size}) disagrees with CALMConfig.chunk_size "
                             f"({self.chunk_size})")
        if ae.vocab_size != self.vocab_size:
            raise ValueError(f"the autoencoder's vocab_size ({ae.vocab_size}) disagrees with CALMConfig.vocab_size "
                             f"({self.vocab_size})")
        if not 0 < self.generation_temperature <= 1:
            raise ValueError(f"CALMConfig.generation_temperature must be in (0, 1], got {self.generation_temperature}")
        if self.energy_head_type not in ENERGY_HEAD_TYPES:
            raise ValueError(f"CALMConfig.energy_head_type must be one of {ENERGY_HEAD_TYPES}, "
                             f"got {self.energy_head_type!r}")
        if self.input_norm not in INPUT_NORMS:
            raise ValueError(f"CALMConfig.input_norm must be one of {INPUT_NORMS}, got {self.input_norm!r}")
        if self.layer_norm_eps is not None and not self.layer_norm_eps > 0:
            raise ValueError(f"CALMConfig.layer_norm_eps must be > 0 or None, got {self.layer_norm_eps}")
        if self.temperature_sampler not in TEMPERATURE_SAMPLERS:
            raise ValueError(f"CALMConfig.temperature_sampler must be one of {TEMPERATURE_SAMPLERS}, "
                             f"got {self.temperature_sampler!r}")


__all__ = ["CALMAutoencoderConfig", "CALMConfig", "ENERGY_HEAD_TYPES", "INPUT_NORMS", "REFERENCE_AUTOENCODER_RECIPE",
           "STAGE_LAYOUTS", "TEMPERATURE_SAMPLERS"]
