"""Configuration of the Parallel Language Model (PLM, paper 002; method-specs §1)."""

from __future__ import annotations

from .configuration_backbone import BackboneConfig, check_positive

AUXILIARY_TYPES = ("voronoi", "quantile", "none")
ACCEPTANCE_RULES = ("exact", "epsilon", "nucleus")


class PLMConfig(BackboneConfig):
    r"""One transformer used in two modes: a causal *encoder* over token embeddings and a parallel
    *decoder* over auxiliary embeddings that reads the encoder's clean prefix.

    Backbone: the fields of `BackboneConfig` (same meaning as in `LlamaConfig`), passed as keywords.

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
        auxiliary_projection (`bool`, True): read the auxiliaries in through a learned d×d map. The paper feeds
            the fixed e_u directly (its only added parameters are g_ψ and the mask auxiliary); at `small`, 150
            steps, same seed, the map gave lower decoder NLL (5.18 vs 5.33), higher R (1.28 vs 1.23) and more
            tokens per call (1.23 vs 1.15), so it is the default and False is the paper-faithful variant
            (docs/benchmarks.md, "PLM second pass").
        sinkhorn_rounds / sinkhorn_sweeps / sinkhorn_shortlist (`int`, 4 / 5 / 6): offset fitting. The paper uses
            2 / 12 / 8; `python scripts/experiments/time_voronoi.py --settings 4,5,6 2,12,8 --threads 1
            --positions 1020` gave mean TV 0.067% vs 0.108% at about the same time, so these are the defaults.
    Alignment (REPA-style, Eq. 11):
        alignment_weight (`float`, 5.0): λ_align; 0 disables.
        alignment_decoder_layer / alignment_encoder_layer (`int`, None → ⌊L/3⌋ / ⌊L/2⌋): 0-based block
            whose mid residual (between attention and MLP) is read. **Choice:** negative cosine
            similarity between g_ψ(decoder state) and sg(encoder state) of the same target token; g_ψ is
            a learned affine map kept in the weights but unused at inference.
    Generation defaults (each can be overridden in `generate()`):
        k_pred (`int`, 4): proposal width K_pred (1 ≤ K_pred ≤ block_size).
        acceptance (`str`, "exact"): "exact" (lossless relative to one-token-per-call Voronoi sampling, which
            is itself a top-M truncation of the encoder's softmax), "epsilon" (also accept x_j when q(x_j) > ε)
            or "nucleus" (also accept x_j inside the ρ-nucleus of q).
        acceptance_epsilon (`float`, 2e-3), acceptance_nucleus (`float`, 0.94).
    """

    model_type = "plm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        block_size: int = 8,
        block_stride: int | None = None,
        auxiliary_type: str = "voronoi",
        num_auxiliaries: int = 512,
        auxiliary_top_m: int = 128,
        auxiliary_seed: int = 0,
        auxiliary_projection: bool = True,
        sinkhorn_rounds: int = 4,
        sinkhorn_sweeps: int = 5,
        sinkhorn_shortlist: int = 6,
        alignment_weight: float = 5.0,
        alignment_decoder_layer: int | None = None,
        alignment_encoder_layer: int | None = None,
        k_pred: int = 4,
        acceptance: str = "exact",
        acceptance_epsilon: float = 2e-3,
        acceptance_nucleus: float = 0.94,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.block_size = block_size
        self.block_stride = block_stride if block_stride is not None else block_size
        self.auxiliary_type = auxiliary_type
        self.num_auxiliaries = num_auxiliaries
        self.auxiliary_top_m = auxiliary_top_m
        self.auxiliary_seed = auxiliary_seed
        self.auxiliary_projection = auxiliary_projection
        self.sinkhorn_rounds = sinkhorn_rounds
        self.sinkhorn_sweeps = sinkhorn_sweeps
        self.sinkhorn_shortlist = sinkhorn_shortlist
        self.alignment_weight = alignment_weight
        self.alignment_decoder_layer = (alignment_decoder_layer if alignment_decoder_layer is not None
                                        else self.num_hidden_layers // 3)
        self.alignment_encoder_layer = (alignment_encoder_layer if alignment_encoder_layer is not None
                                        else self.num_hidden_layers // 2)
        self.k_pred = k_pred
        self.acceptance = acceptance
        self.acceptance_epsilon = acceptance_epsilon
        self.acceptance_nucleus = acceptance_nucleus
        self.validate_plm()

    def validate_plm(self) -> None:
        """Raise a ValueError naming the first bad field."""
        self.validate_backbone()
        check_positive(self, ("block_size", "block_stride", "num_auxiliaries", "auxiliary_top_m", "sinkhorn_rounds",
                             "sinkhorn_sweeps", "sinkhorn_shortlist", "k_pred"))
        if self.auxiliary_type not in AUXILIARY_TYPES:
            raise ValueError(f"PLMConfig.auxiliary_type must be one of {AUXILIARY_TYPES}, got {self.auxiliary_type!r}")
        if self.auxiliary_top_m > self.vocab_size:
            raise ValueError(f"PLMConfig.auxiliary_top_m ({self.auxiliary_top_m}) exceeds vocab_size ({self.vocab_size})")
        if self.k_pred > self.block_size:
            raise ValueError(f"PLMConfig.k_pred ({self.k_pred}) must be between 1 and block_size ({self.block_size})")
        check_acceptance(self.acceptance, self.acceptance_epsilon, self.acceptance_nucleus, owner="PLMConfig.")
        for name in ("alignment_decoder_layer", "alignment_encoder_layer"):
            if not 0 <= getattr(self, name) < self.num_hidden_layers:
                raise ValueError(f"PLMConfig.{name} must be in [0, num_hidden_layers={self.num_hidden_layers}), "
                                 f"got {getattr(self, name)}")
        if self.alignment_weight < 0:
            raise ValueError(f"PLMConfig.alignment_weight must be >= 0, got {self.alignment_weight}")


def check_acceptance(rule: str, epsilon: float, nucleus: float, owner: str = "") -> None:
    """ValueError naming the first bad quadratic-decoding acceptance setting (`owner` prefixes the name)."""
    if rule not in ACCEPTANCE_RULES:
        raise ValueError(f"{owner}acceptance must be one of {ACCEPTANCE_RULES}, got {rule!r}")
    if not 0 < epsilon < 1:
        raise ValueError(f"{owner}acceptance_epsilon must be in (0, 1), got {epsilon}")
    if not 0 < nucleus < 1:
        raise ValueError(f"{owner}acceptance_nucleus must be in (0, 1), got {nucleus}")


__all__ = ["PLMConfig", "check_acceptance"]
