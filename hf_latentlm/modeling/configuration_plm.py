"""Configuration of the Parallel Language Model (PLM, paper 002; method-specs §1)."""

from __future__ import annotations

from transformers import PretrainedConfig

AUXILIARY_TYPES = ("voronoi", "quantile", "none")
ACCEPTANCE_RULES = ("exact", "epsilon", "nucleus")


class PLMConfig(PretrainedConfig):
    r"""One transformer used in two modes: a causal *encoder* over token embeddings and a parallel
    *decoder* over auxiliary embeddings that reads the encoder's clean prefix.

    Backbone (same meaning as in `LlamaConfig`): `vocab_size`, `hidden_size`, `intermediate_size`
    (SwiGLU), `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
    `max_position_embeddings`, `rope_theta`, `rms_norm_eps`, `initializer_range`,
    `tie_word_embeddings`.

    Blocks:
        block_size (`int`, 8): K, targets per decoder block in training. The paper uses 16 at 0.1–3B
            parameters; at the `small` CPU scale (≈3M non-embedding parameters) few tokens past the
            first ~4 are reconstructed, so 8 keeps the decoder's capacity on positions that can be used.
        block_stride (`int`, None → block_size): s, distance between block starts; β = s/K is the
            encoder:decoder loss ratio (s = K: every encoded token is decoded once).
    Auxiliaries:
        auxiliary_type (`str`, "voronoi"): "voronoi" (Laguerre cells of fixed random unit vectors around
            LM-head rows, Sinkhorn-fitted), "quantile" (PTP: CDF buckets in vocabulary order) or "none"
            (the decoder always reads the mask auxiliary: plain multi-token prediction, ablation only).
        num_auxiliaries (`int`, 512): N_aux, size of the fixed auxiliary bank (a buffer saved in the weights).
        auxiliary_top_m (`int`, 128): M, candidate tokens per position; targets outside the top-M, or
            with zero capacity, get the learned mask auxiliary.
        auxiliary_seed (`int`, 0): seed of the auxiliary bank.
        sinkhorn_rounds / sinkhorn_sweeps / sinkhorn_shortlist (`int`, 2 / 12 / 8): offset fitting.
    Alignment (REPA-style, Eq. 11):
        alignment_weight (`float`, 5.0): λ_align; 0 disables.
        alignment_decoder_layer / alignment_encoder_layer (`int`, None → ⌊L/3⌋ / ⌊L/2⌋): 0-based block
            whose mid residual (between attention and MLP) is read. **Choice:** negative cosine
            similarity between g_ψ(decoder state) and sg(encoder state) of the same target token; g_ψ is
            a learned affine map kept in the weights but unused at inference.
    Generation defaults (each can be overridden in `generate()`):
        k_pred (`int`, 4): proposal width K_pred (1 ≤ K_pred ≤ block_size).
        acceptance (`str`, "exact"): "exact" (lossless: identical to one-token-per-call Voronoi
            sampling), "epsilon" (also accept x_j when q(x_j) > ε) or "nucleus" (also accept x_j inside
            the ρ-nucleus of q).
        acceptance_epsilon (`float`, 2e-3), acceptance_nucleus (`float`, 0.94).
    """

    model_type = "plm"
    keys_to_ignore_at_inference = ["cache"]

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
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        block_size: int = 8,
        block_stride: int | None = None,
        auxiliary_type: str = "voronoi",
        num_auxiliaries: int = 512,
        auxiliary_top_m: int = 128,
        auxiliary_seed: int = 0,
        sinkhorn_rounds: int = 2,
        sinkhorn_sweeps: int = 12,
        sinkhorn_shortlist: int = 8,
        alignment_weight: float = 5.0,
        alignment_decoder_layer: int | None = None,
        alignment_encoder_layer: int | None = None,
        k_pred: int = 4,
        acceptance: str = "exact",
        acceptance_epsilon: float = 2e-3,
        acceptance_nucleus: float = 0.94,
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
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.block_size = block_size
        self.block_stride = block_stride if block_stride is not None else block_size
        self.auxiliary_type = auxiliary_type
        self.num_auxiliaries = num_auxiliaries
        self.auxiliary_top_m = auxiliary_top_m
        self.auxiliary_seed = auxiliary_seed
        self.sinkhorn_rounds = sinkhorn_rounds
        self.sinkhorn_sweeps = sinkhorn_sweeps
        self.sinkhorn_shortlist = sinkhorn_shortlist
        self.alignment_weight = alignment_weight
        self.alignment_decoder_layer = (alignment_decoder_layer if alignment_decoder_layer is not None
                                        else num_hidden_layers // 3)
        self.alignment_encoder_layer = (alignment_encoder_layer if alignment_encoder_layer is not None
                                        else num_hidden_layers // 2)
        self.k_pred = k_pred
        self.acceptance = acceptance
        self.acceptance_epsilon = acceptance_epsilon
        self.acceptance_nucleus = acceptance_nucleus
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate_plm()

    def validate_plm(self) -> None:
        """Raise a ValueError naming the first bad field."""
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings", "block_size", "num_auxiliaries",
                    "auxiliary_top_m", "sinkhorn_rounds", "sinkhorn_sweeps", "sinkhorn_shortlist", "k_pred")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"PLMConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.block_stride < 1:
            raise ValueError(f"PLMConfig.block_stride must be at least 1, got {self.block_stride}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"PLMConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.auxiliary_type not in AUXILIARY_TYPES:
            raise ValueError(f"PLMConfig.auxiliary_type must be one of {AUXILIARY_TYPES}, got {self.auxiliary_type!r}")
        if self.auxiliary_top_m > self.vocab_size:
            raise ValueError(f"PLMConfig.auxiliary_top_m ({self.auxiliary_top_m}) exceeds vocab_size ({self.vocab_size})")
        if self.k_pred > self.block_size:
            raise ValueError(f"PLMConfig.k_pred ({self.k_pred}) must be between 1 and block_size ({self.block_size})")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"PLMConfig.acceptance must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")
        if not 0 < self.acceptance_epsilon < 1:
            raise ValueError(f"PLMConfig.acceptance_epsilon must be in (0, 1), got {self.acceptance_epsilon}")
        if not 0 < self.acceptance_nucleus < 1:
            raise ValueError(f"PLMConfig.acceptance_nucleus must be in (0, 1), got {self.acceptance_nucleus}")
        for name in ("alignment_decoder_layer", "alignment_encoder_layer"):
            if not 0 <= getattr(self, name) < self.num_hidden_layers:
                raise ValueError(f"PLMConfig.{name} must be in [0, num_hidden_layers={self.num_hidden_layers}), "
                                 f"got {getattr(self, name)}")
        if self.alignment_weight < 0:
            raise ValueError(f"PLMConfig.alignment_weight must be >= 0, got {self.alignment_weight}")


__all__ = ["PLMConfig"]
