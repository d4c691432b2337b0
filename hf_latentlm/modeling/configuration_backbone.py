"""The transformer-backbone fields every family's configuration shares (same names and meaning as `LlamaConfig`)."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

# RoPE types whose frequencies are fixed at construction (transformers' ROPE_INIT_FUNCTIONS computes them).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def check_positive(config: PreTrainedConfig, names: tuple[str, ...]) -> None:
    """ValueError naming the first of `names` that is missing or below 1."""
    for name in names:
        value = getattr(config, name)
        if value is None or value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be at least 1, got {value}")


def check_fraction(config, names: tuple[str, ...], upper_open: bool = True) -> None:
    """ValueError naming the first of `names` outside [0, 1) ([0, 1] with upper_open=False)."""
    for name in names:
        value = getattr(config, name)
        if not (0 <= value < 1 if upper_open else 0 <= value <= 1):
            bound = "1)" if upper_open else "1]"
            raise ValueError(f"{type(config).__name__}.{name} must be in [0, {bound}, got {value}")


def check_non_negative(config, names: tuple[str, ...]) -> None:
    """ValueError naming the first of `names` below 0 (or NaN)."""
    for name in names:
        value = getattr(config, name)
        if not value >= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be >= 0, got {value}")


def run_validators(config: PreTrainedConfig) -> None:
    """Run the config's `validate_*` checks, letting their ValueError through as it is. Called at the end of
    `__post_init__`: `@strict` runs them again right after, but wraps a failure in its own exception class, which
    callers that catch ValueError (the CLI, the tests) would miss."""
    for validator in type(config).__class_validators__:
        validator(config)


def decoder_blocks_tp_plan(*block_lists: str) -> dict[str, str]:
    """Llama's tensor-parallel layout (attention and MLP in column/row pairs) for the shared decoder blocks of each
    module list named, e.g. "layers" or "encoder.layers"."""
    layout = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
              "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
              "mlp.down_proj": "rowwise"}
    return {f"{blocks}.*.{name}": style for blocks in block_lists for name, style in layout.items()}


@strict
class BackboneConfig(PreTrainedConfig):
    r"""Base of the family configurations: the decoder-only backbone built from `layers.py`. The fields mean what
    `LlamaConfig`'s of the same name mean.

    rope_parameters: RoPE in transformers' format (None -> {"rope_type": "default", "rope_theta": rope_theta}); the
    static scalings "linear", "yarn" and "llama3" are honoured (transformers' `ROPE_INIT_FUNCTIONS` computes them);
    "dynamic" and "longrope", which change with the sequence length, are refused. `rope_scaling`, the old name, is
    accepted. rope_theta is kept for old checkpoints; the value in `rope_parameters` wins.
    """

    # Tensor-parallel plan of the base model's decoder blocks (`layers`). A family whose blocks sit elsewhere names
    # them (`decoder_blocks_tp_plan`); every rule must match a parameter (transformers' `test_tp_plan_matches_params`).
    base_model_tp_plan = decoder_blocks_tp_plan("layers")

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 672  # of the SwiGLU MLP
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rope_theta: int | float = 10000.0
    rope_parameters: dict | None = None
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02  # std of the linear and embedding weights
    tie_word_embeddings: bool = False
    bos_token_id: int | list[int] | None = 0
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = 1

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters:
            self.rope_parameters = dict(self.rope_parameters)  # transformers fills it in place: not the caller's
        super().__post_init__(**kwargs)  # brings RoPE to transformers' standard form (rope_type, rope_theta, ...)
        self.rope_theta = self.rope_parameters["rope_theta"]
        run_validators(self)

    def validate_architecture(self) -> None:
        """Raise a ValueError naming the first bad backbone field."""
        rope_type = self.rope_parameters.get("rope_type")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"{type(self).__name__}.rope_parameters['rope_type'] must be one of {STATIC_ROPE_TYPES} "
                             f"(RoPE whose frequencies do not change with the sequence length), got {rope_type!r}")
        check_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "max_position_embeddings"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{type(self).__name__}.num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")


__all__ = ["BackboneConfig", "STATIC_ROPE_TYPES", "check_fraction", "check_non_negative", "check_positive",
           "decoder_blocks_tp_plan", "run_validators"]
