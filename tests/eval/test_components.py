"""Component reports (hf_latentlm/eval/components.py): the registry's `training_report` of each component family.

The measurements average per-call accuracies over row batches of 16; with a stub component whose per-call accuracy
is a known function of its rows (the share of even / multiple-of-three / small token ids), the reported accuracy
must be that function over all rows at once, the uneven last batch weighted by its row count."""

import pytest
import torch

from hf_latentlm.eval.components import autoencoder_accuracy, reconstruction_rows, vae_measurements
from hf_latentlm.families import get_family


def share(rows, rule) -> float:
    return rule(rows).float().mean().item()


EVEN, THIRDS = (lambda ids: ids % 2 == 0), (lambda ids: ids % 3 == 0)


class StubAutoencoder(torch.nn.Module):
    """AURORA's interface: reconstruction_accuracy(rows) -> float, and the config fields the report prints."""

    config = type("Config", (), {"keep_ratio": 1.0, "latent_size": 4})

    def reconstruction_accuracy(self, rows):
        return share(rows, EVEN)


class StubVAE(torch.nn.Module):
    """Cola's interface: reconstruction_accuracy(rows, noise_levels, generator) -> dict."""

    def reconstruction_accuracy(self, rows, noise_levels, generator):
        return {"logsnr": 1.5, "accuracy_mean": share(rows, EVEN), "accuracy_sampled": share(rows, THIRDS),
                "accuracy_vs_noise": {t: share(rows, lambda ids: ids < t * 1000) for t in noise_levels}}


@pytest.fixture(scope="module")
def stream():
    return torch.randint(0, 1000, (40 * 8 + 5,), generator=torch.Generator().manual_seed(0))  # 40 rows of 8, 5 over


def test_rows_are_whole_and_a_too_short_stream_is_named(stream):
    rows = reconstruction_rows(stream, 10_000, 8)
    assert rows.shape == (40, 8) and torch.equal(rows.flatten(), stream[:320])
    assert reconstruction_rows(stream, 100, 8).shape == (12, 8)
    with pytest.raises(ValueError, match="need at least 8 tokens, got 5"):
        reconstruction_rows(stream[:5], 100, 8)


def test_autoencoder_accuracy_weights_each_batch_by_its_rows(stream):
    result = autoencoder_accuracy(StubAutoencoder(), stream, num_tokens=10_000, row_length=8)  # batches 16, 16, 8
    assert result["num_tokens"] == 320
    assert result["accuracy"] == pytest.approx(share(stream[:320], EVEN), abs=1e-6)


def test_vae_measurements_weight_each_batch_by_its_rows(stream):
    result = vae_measurements(StubVAE(), stream, num_tokens=10_000, row_length=8, noise_levels=(0.2, 0.5))
    rows = stream[:320]
    assert result["num_tokens"] == 320 and result["logsnr"] == 1.5
    assert result["accuracy_mean"] == pytest.approx(share(rows, EVEN), abs=1e-6)
    assert result["accuracy_sampled"] == pytest.approx(share(rows, THIRDS), abs=1e-6)
    assert result["accuracy_vs_noise"] == pytest.approx({0.2: share(rows, lambda ids: ids < 200),
                                                         0.5: share(rows, lambda ids: ids < 500)}, abs=1e-6)


def test_the_registry_names_each_components_report(tokenizer):
    """`hf-latentlm train` prints `spec.training_report(model, tokenizer)` for these families, on the validation split."""
    line = get_family("aurora-ae").training_report(StubAutoencoder(), tokenizer, num_tokens=512)
    assert line.startswith("autoencoder on 512 validation tokens: reconstruction accuracy ") and "D = 4" in line
    lines = get_family("cola-vae").training_report(StubVAE(), tokenizer, num_tokens=512).splitlines()
    assert lines[0].startswith("VAE on 512 validation tokens") and "logSNR 1.50" in lines[0]
    assert lines[1].startswith("accuracy of z_t = (1-t)z + t*noise: t=0.1: ")
    assert get_family("calm-ae").training_report is not None
    assert all(get_family(name).training_report is None for name in ("ar", "plm", "calm", "cola", "aurora"))
