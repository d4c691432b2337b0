"""Every family learns: a short seeded run on the easiest generated language must beat the best model that
ignores the prefix. That bound is computed from the language, not measured from our code: the unigram marginal u
is the best prefix-ignoring model both in NLL (its entropy H(u)) and in Brier-1 (E[2 q·p − q·q] over contexts is
largest at q = u, where it equals Σ u²). A silently broken objective trains a model that stays at or below it."""

import math

import numpy as np
import pytest

from hf_latentlm.data.generated import GeneratedLanguage
from hf_latentlm.eval.brier import summarize_brier
from hf_latentlm.eval.optimum import evaluation_stream, optimum_position_terms
from hf_latentlm.families import get_family
from hf_latentlm.loading import load_model_and_tokenizer
from hf_latentlm.training.loop import TrainConfig, train

CORPUS = "generated:easy"
# Optimizer steps (tiny preset, batch 8 x 64) of each family and of the components they are built on.
STEPS = {"ar": 60, "plm": 60, "calm": 80, "cola": 300, "aurora": 400, "calm-ae": 80, "cola-vae": 80, "aurora-ae": 100}
# The test checks the training objective, not guidance: the papers' guidance amplifies the error of a prior this
# undertrained (Cola, CFG w = 7: Brier-1 0.150 against 0.211 at w = 1 after 400 steps; AURORA, SC-CFG 4 and CFG:
# 0.101 against 0.220 without either after 600; results/generated_findings/).
DECODING = {"cola": {"guidance_scale": 1.0}, "aurora": {"self_condition_guidance": 1.0, "guidance_scale": 1.0}}


@pytest.fixture(scope="module")
def easy():
    return GeneratedLanguage.from_level("easy")


def trained(family: str, folder, **components):
    cfg = TrainConfig(family=family, preset="tiny", output_dir=str(folder), max_steps=STEPS[family],
                      eval_every=0, save_every=10**6, corpus=CORPUS, progress_bar=False, components=components)
    train(cfg)
    return str(folder)


@pytest.mark.parametrize("family", ["ar", "plm", "calm", "cola", "aurora"])
def test_family_beats_the_best_prefix_ignoring_model(family, easy, tmp_path):
    components = {name: trained(source, tmp_path / source) for name, source in get_family(family).components.items()}
    model, _ = load_model_and_tokenizer(trained(family, tmp_path / family, **components))
    u = easy.unigram_probs()
    _, exact = optimum_position_terms(model.eval(), easy, evaluation_stream(easy), num_positions=1500, context_len=32,
                                      batch_size=250, generate_kwargs=DECODING.get(family))
    brier_1 = summarize_brier(exact)["brier_1"]
    assert brier_1["ci_low"] > float(np.sum(u * u)), (family, brier_1, float(np.sum(u * u)))
    if family in ("ar", "plm"):  # token likelihoods: the validation NLL is below the unigram's entropy
        import torch

        rows = evaluation_stream(easy)[: 32 * 64].view(32, 64)
        with torch.no_grad():
            logits = model(input_ids=rows).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
        entropy_u = -float(np.sum(u[u > 0] * np.log(u[u > 0])))
        assert nll < entropy_u - 0.1, (family, nll, entropy_u)
        assert math.isfinite(nll)
