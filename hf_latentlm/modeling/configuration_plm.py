"""Configuration of the Parallel Language Model (PLM, paper 002; method-specs §1)."""

from huggingface_hub.dataclasses import strict

from .configuration_backbone import BackboneConfig, check_non_negative, check_positive

AUXILIARY_TYPES = ("voronoi", "quantile", "none")
ACCEPTANCE_RULES = ("exact", "epsilon", "nucleus")


@strict
class PLMConfig(BackboneConfig):
    r"""One transformer used in two modes: a causal *encoder* over token embeddings and a parallel *decoder* over
    auxiliary embeddings that reads the encoder's clean prefix. Alignment is REPA-style (Eq. 11): negative cosine
    similarity between g_ψ(decoder state) and sg(encoder state) of the same target token, read at the mid residual
    (between attention and MLP) of one 0-based block each; g_ψ is a learned affine map kept in the weights but unused
    at inference. The generation defaults (`k_pred`, `acceptance*`) can each be overridden in `generate()`.
    """

    model_type = "plm"
    keys_to_ignore_at_inference = ["cache"]

    # K, targets per decoder block in training. The paper uses 16 at 0.1–3B parameters; at CPU scale few tokens past
    # the first ~4 are reconstructed, so 8 keeps the decoder's capacity on positions that can be used.
    block_size: int = 8
    # s, distance between block starts (None -> block_size); β = s/K is the encoder:decoder loss ratio.
    block_stride: int | None = None
    # "voronoi" (Laguerre cells of fixed random unit vectors around LM-head rows, Sinkhorn-fitted), "quantile" (PTP:
    # CDF buckets in vocabulary order) or "none" (the decoder always reads the mask auxiliary: plain multi-token
    # prediction, ablation only).
    auxiliary_type: str = "voronoi"
    num_auxiliaries: int = 512  # N_aux, size of the fixed auxiliary bank (a buffer saved in the weights)
    # M, candidate tokens per position; targets outside the top-M, or with zero capacity, get the mask auxiliary.
    auxiliary_top_m: int = 128
    auxiliary_seed: int = 0  # seed of the auxiliary bank
    # Read the auxiliaries in through a learned d×d map; the paper feeds the fixed e_u directly (False). The map
    # trains better at small scale (results/plm_second_pass/).
    auxiliary_projection: bool = True
    # Offset fitting (the paper: 2 / 12 / 8); these fit the cells more closely in about the same time
    # (scripts/experiments/time_voronoi.py).
    sinkhorn_rounds: int = 4
    sinkhorn_sweeps: int = 5
    sinkhorn_shortlist: int = 6
    alignment_weight: int | float = 5.0  # λ_align; 0 disables
    alignment_decoder_layer: int | None = None  # None -> ⌊L/3⌋
    alignment_encoder_layer: int | None = None  # None -> ⌊L/2⌋
    k_pred: int = 4  # proposal width K_pred (1 ≤ K_pred ≤ block_size)
    # "exact" (lossless relative to one-token-per-call Voronoi sampling, itself a top-M truncation of the encoder's
    # softmax), "epsilon" (also accept x_j when q(x_j) > ε) or "nucleus" (also accept x_j inside the ρ-nucleus of q).
    acceptance: str = "exact"
    acceptance_epsilon: int | float = 2e-3
    acceptance_nucleus: int | float = 0.94

    def __post_init__(self, **kwargs):
        if self.block_stride is None:
            self.block_stride = self.block_size
        if self.alignment_decoder_layer is None:
            self.alignment_decoder_layer = self.num_hidden_layers // 3
        if self.alignment_encoder_layer is None:
            self.alignment_encoder_layer = self.num_hidden_layers // 2
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """Raise a ValueError naming the first bad field."""
        super().validate_architecture()
        check_positive(self, ("block_size", "block_stride", "num_auxiliaries", "auxiliary_top_m", "sinkhorn_rounds",
                             "sinkhorn_sweeps", "sinkhorn_shortlist", "k_pred"))
        if self.auxiliary_type not in AUXILIARY_TYPES:
            raise ValueError(f"PLMConfig.auxiliary_type must be one of {AUXILIARY_TYPES}, got {self.auxiliary_type!r}")
        if self.auxiliary_top_m > self.vocab_size:
            raise ValueError(f"PLMConfig.auxiliary_top_m ({self.auxiliary_top_m}) exceeds vocab_size "
                             f"({self.vocab_size})")
        if self.k_pred > self.block_size:
            raise ValueError(f"PLMConfig.k_pred ({self.k_pred}) must be between 1 and block_size ({self.block_size})")
        check_acceptance(self.acceptance, self.acceptance_epsilon, self.acceptance_nucleus, owner="PLMConfig.")
        for name in ("alignment_decoder_layer", "alignment_encoder_layer"):
            if not 0 <= getattr(self, name) < self.num_hidden_layers:
                raise ValueError(f"PLMConfig.{name} must be in [0, num_hidden_layers={self.num_hidden_layers}), "
                                 f"got {getattr(self, name)}")
        check_non_negative(self, ("alignment_weight",))


def check_acceptance(rule: str, epsilon: float, nucleus: float, owner: str = "") -> None:
    """ValueError naming the first bad quadratic-decoding acceptance setting (`owner` prefixes the name)."""
    if rule not in ACCEPTANCE_RULES:
        raise ValueError(f"{owner}acceptance must be one of {ACCEPTANCE_RULES}, got {rule!r}")
    if not 0 < epsilon < 1:
        raise ValueError(f"{owner}acceptance_epsilon must be in (0, 1), got {epsilon}")
    if not 0 < nucleus < 1:
        raise ValueError(f"{owner}acceptance_nucleus must be in (0, 1), got {nucleus}")


__all__ = ["PLMConfig", "check_acceptance"]
