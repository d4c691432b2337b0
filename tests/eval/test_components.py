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

    def __init__(self, trained_seq_len=None):
        super().__init__()
        self.row_lengths = []
        if trained_seq_len is not None:
            self.config = type("Config", (), {"keep_ratio": 1.0, "latent_size": 4, "trained_seq_len": trained_seq_len})

    def reconstruction_accuracy(self, rows):
        self.row_lengths.append(rows.shape[1])
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
    assert line.startswith("autoencoder on 512 validation tokens (rows of 256): reconstruction accuracy ") and "D = 4" in line
    lines = get_family("cola-vae").training_report(StubVAE(), tokenizer, num_tokens=512).splitlines()
    assert lines[0].startswith("VAE on 512 validation tokens") and "logSNR 1.50" in lines[0]
    assert lines[1].startswith("accuracy of z_t = (1-t)z + t*noise: t=0.1: ")
    assert get_family("calm-ae").training_report is not None
    assert all(get_family(name).training_report is None for name in ("ar", "plm", "calm", "cola", "aurora"))


def test_a_component_is_measured_on_rows_no_longer_than_it_was_trained_at():
    stream = torch.randint(0, 1000, (4096,), generator=torch.Generator().manual_seed(1))
    trained_at_64 = StubAutoencoder(trained_seq_len=64)
    result = autoencoder_accuracy(trained_at_64, stream, num_tokens=4096)
    assert result["row_length"] == 64 and set(trained_at_64.row_lengths) == {64} and result["num_tokens"] == 4096
    # Trained at longer rows (or unrecorded): the default 256-token rows.
    assert autoencoder_accuracy(StubAutoencoder(trained_seq_len=512), stream, num_tokens=4096)["row_length"] == 256
    assert autoencoder_accuracy(StubAutoencoder(), stream, num_tokens=4096)["row_length"] == 256
    # The report names the length it used.
    from hf_latentlm.eval.components import aurora_autoencoder_report

    assert "(rows of 64)" in aurora_autoencoder_report(StubAutoencoder(trained_seq_len=64), None, 4096, stream=stream)
