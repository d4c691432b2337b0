"""The families' own `bench --extras` measurements (hf_latentlm/eval/family_bench.py), reached through the registry:
Cola's and AURORA's measure the component inside the language model (the jointly trained VAE, the frozen
autoencoder copy), not a stage-1 folder."""

import pytest
import torch
from family_contract import build_tiny

from hf_latentlm.eval import family_bench
from hf_latentlm.families import get_family


@pytest.mark.parametrize(("family", "measure", "component", "key"), [
    ("cola", "vae_measurements", lambda model: model.model.vae, "vae"),
    ("aurora", "autoencoder_accuracy", lambda model: model.model.autoencoder, "autoencoder"),
])
def test_latent_families_measure_the_component_inside_the_model(tokenizer, monkeypatch, family, measure, component,
                                                                key):
    model = build_tiny(family, tokenizer).eval()
    stream = torch.arange(3, 3 + 600) % 500
    seen = []
    real = getattr(family_bench, measure)

    def recording(measured, rows, *args, **kwargs):
        seen.append(measured)
        return real(measured, rows[:512], *args, **kwargs)

    monkeypatch.setattr(family_bench, measure, recording)
    result = get_family(family).bench_measurements(model, None, stream)
    assert seen == [component(model)] and set(result) == {key}
    assert result[key]["num_tokens"] == 512


def test_families_without_measurements_have_none():
    assert all(get_family(name).bench_measurements is None for name in ("ar", "calm-ae", "cola-vae", "aurora-ae"))
    assert all(get_family(name).bench_measurements is not None for name in ("plm", "calm", "cola", "aurora"))
