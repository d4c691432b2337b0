"""The transformer-backbone fields every family's configuration shares (same names and meaning as `LlamaConfig`)."""

from __future__ import annotations

from transformers import PretrainedConfig


def check_positive(config: PretrainedConfig, names: tuple[str, ...]) -> None:
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


# RoPE types whose frequencies are fixed at construction (transformers' ROPE_INIT_FUNCTIONS computes them).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def decoder_blocks_tp_plan(*block_lists: str) -> dict[str, str]:
    """Llama's tensor-parallel layout (attention and MLP in column/row pairs) for the shared decoder blocks of each
    module list named, e.g. "layers" or "encoder.layers"."""
    layout = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
              "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
              "mlp.down_proj": "rowwise"}
    return {f"{blocks}.*.{name}": style for blocks in block_lists for name, style in layout.items()}


class BackboneConfig(PretrainedConfig):
    r"""Base of the family configurations: the decoder-only backbone built from `layers.py`.

    Args:
        vocab_size (`int`, 4096), hidden_size (`int`, 256), intermediate_size (`int`, 672, SwiGLU),
        num_hidden_layers (`int`, 4), num_attention_heads (`int`, 4), num_key_value_heads (`int`, 2, GQA),
        head_dim (`int`, None -> hidden_size / num_attention_heads), max_position_embeddings (`int`, 2048),
        rope_parameters (`dict`, None -> {"rope_type": "default", "rope_theta": rope_theta}): RoPE in transformers'
        format; the static scalings "linear", "yarn" and "llama3" are honoured (computed by transformers'
        `ROPE_INIT_FUNCTIONS`); "dynamic" and "longrope", which change with the sequence length, are refused.
        `rope_scaling` (the old name) is accepted. rope_theta (`float`, 1e4): kept for old checkpoints; the value in
        `rope_parameters` wins. rms_norm_eps (`float`, 1e-6), initializer_range (`float`, 0.02: std of the linear
        and embedding weights), tie_word_embeddings (`bool`, False), bos/eos/pad_token_id (0 / 0 / 1).
    """

    # Tensor-parallel plan of the base model's decoder blocks (`layers`). A family whose blocks sit elsewhere names
    # them (`decoder_blocks_tp_plan`); every rule must match a parameter (transformers' `test_tp_plan_matches_params`).
    base_model_tp_plan = decoder_blocks_tp_plan("layers")

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 256,
        intermediate_size: int = 672,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        rope_parameters: dict | None = None,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        bos_token_id: int | None = 0,
        eos_token_id: int | None = 0,
        pad_token_id: int | None = 1,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rope_parameters = dict(rope_parameters) if rope_parameters else None
        kwargs = self.convert_rope_params_to_dict(**kwargs)  # transformers' standard form (rope_type, rope_theta, ...)
        self.rope_theta = self.rope_parameters["rope_theta"]
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _embed_sub_config(self, name: str, value, **defaults) -> None:
        """Set the sub-config `name` (of class `sub_configs[name]`) from `value`: a config as it is, a dict of its
        fields, or None for a new one with `defaults`."""
        sub_config_class = self.sub_configs[name]
        if value is None:
            value = sub_config_class(**defaults)
        elif isinstance(value, dict):
            value = sub_config_class(**value)
        setattr(self, name, value)
        if self._attn_implementation is not None:  # the setter passes it on to sub-configs, which exist only now
            self._attn_implementation = self._attn_implementation

    def validate_backbone(self) -> None:
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
           "decoder_blocks_tp_plan"]
