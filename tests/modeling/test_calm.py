"""CALM: autoencoder, energy objective, generate (prompt alignment, batching, temperature, EOS inside a chunk).
The contract every family shares (streamer, bad input, Hub load without the package, CLI) is in
tests/test_family_contract.py."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from hf_latentlm.families import build_model
from hf_latentlm.modeling import CALMAutoencoder, CALMAutoencoderConfig, CALMConfig, CALMForCausalLM
from hf_latentlm.modeling.configuration_calm import REFERENCE_AUTOENCODER_RECIPE
from hf_latentlm.modeling.modeling_calm import (ReferenceEnergyHead, SwiGLUEnergyHead, context_spread,
                                               energy_head_parameter_count)
from hf_latentlm.training.loop import TrainConfig, train


@pytest.fixture(scope="module")
def trained_autoencoder(tokenizer, tiny_rows, tmp_path_factory):
    """The tiny autoencoder trained briefly and saved (CALM is built from the folder, as the CLI does)."""
    torch.manual_seed(0)
    model = build_model("calm-ae", "tiny", tokenizer)
    out = tmp_path_factory.mktemp("calm-ae")
    cfg = TrainConfig(family="calm-ae", preset="tiny", output_dir=str(out), max_steps=150, batch_size=16, seq_len=64,
                      eval_every=0, save_every=150, progress_bar=False, seed=0)
    train(cfg, model=model, tokenizer=tokenizer, train_rows=tiny_rows[:1500])
    return out


@pytest.fixture(scope="module")
def trained_calm(tokenizer, tiny_rows, trained_autoencoder, tmp_path_factory):
    torch.manual_seed(0)
    model = build_model("calm", "tiny", tokenizer, autoencoder=str(trained_autoencoder))
    cfg = TrainConfig(family="calm", preset="tiny", output_dir=str(tmp_path_factory.mktemp("calm")), max_steps=60,
                      batch_size=8, seq_len=64, eval_every=0, save_every=60, progress_bar=False, seed=0)
    train(cfg, model=model, tokenizer=tokenizer, train_rows=tiny_rows[:1500])
    return model.eval()


# ---------------------------------------------------------------------------------------------- config / errors

@pytest.mark.parametrize("field,value,needle", [
    ("chunk_size", 0, "chunk_size must be at least 1"),
    ("latent_size", 0, "latent_size must be at least 1"),
    ("token_replace_prob", 1.0, "token_replace_prob"),
    ("kl_weight", -1.0, "kl_weight"),
    ("stage_layout", "halves", "stage_layout must be one of"),
    ("replace_token_id", 4096, "replace_token_id must be None or a token id"),
    ("replace_token_id", -1, "replace_token_id must be None or a token id"),
    ("embedding_init_std", 0.0, "embedding_init_std must be > 0"),
])
def test_bad_autoencoder_config_values_are_named(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        CALMAutoencoderConfig(**{field: value})


@pytest.mark.parametrize("kwargs,needle", [
    (dict(chunk_size=0), "chunk_size must be at least 1"),
    (dict(num_model_samples=1), "num_model_samples"),
    (dict(generation_temperature=0.0), "generation_temperature"),
    (dict(temperature_sampler="beam"), "temperature_sampler"),
    (dict(energy_head_type="mlp"), "energy_head_type must be one of"),
    (dict(chunk_size=8), "autoencoder's chunk_size"),
    (dict(vocab_size=77), "autoencoder's vocab_size"),
])
def test_bad_calm_config_values_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        CALMConfig(**kwargs, autoencoder_config=CALMAutoencoderConfig(vocab_size=4096, chunk_size=4))


def test_autoencoder_that_disagrees_with_the_config_is_refused(tokenizer):
    ae = build_model("calm-ae", "tiny", tokenizer)
    for field, value in (("chunk_size", 8), ("vocab_size", 100)):
        kwargs = dict(vocab_size=len(tokenizer), chunk_size=4, autoencoder_config=None)
        kwargs[field] = value
        config = CALMConfig(**kwargs, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
        with pytest.raises(ValueError, match=f"autoencoder's {field}"):
            CALMForCausalLM.from_autoencoder(ae, config)


def test_calm_family_without_autoencoder_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="needs a trained autoencoder"):
        build_model("calm", "tiny", tokenizer)
    with pytest.raises(FileNotFoundError, match="not a saved autoencoder folder"):
        build_model("calm", "tiny", tokenizer, autoencoder="/nonexistent/ae")


# ---------------------------------------------------------------------------------------------- autoencoder

def test_autoencoder_loss_is_k_times_nll_plus_weighted_clamped_kl(tokenizer, tiny_rows):
    torch.manual_seed(0)
    ae = build_model("calm-ae", "tiny", tokenizer).eval()
    out = ae(tiny_rows[:2], labels=tiny_rows[:2])
    cfg = ae.config
    torch.testing.assert_close(out.loss.detach(), cfg.chunk_size * out.reconstruction_nll + cfg.kl_weight * out.kl)
    # Free bits: a posterior equal to the prior (μ = 0, σ = 1) pays exactly kl_clamp per dimension.
    with torch.no_grad():
        ae.to_posterior.weight.zero_()
        ae.to_posterior.bias.zero_()
    out = ae(tiny_rows[:2], labels=tiny_rows[:2])
    assert out.kl.item() == pytest.approx(cfg.kl_clamp * cfg.latent_size)
    assert out.posterior_std.item() == pytest.approx(1.0)


def test_autoencoder_kl_matches_the_closed_form_away_from_the_prior(tokenizer, tiny_rows):
    """KL(N(μ, σ²) || N(0, 1)) = ½(μ² + σ² − 1) − log σ per dimension, floored at kl_clamp, summed: checked at
    μ = 1.5, log σ = −1 (1.6927 per dimension, above the floor; "+ log σ" would give −0.307, floored to 0.5) on
    half the dimensions and μ = 0.2, log σ = 0 (0.02, floored to 0.5) on the other half."""
    ae = build_model("calm-ae", "tiny", tokenizer).eval()
    latent = ae.config.latent_size
    mean = torch.tensor([1.5] * (latent // 2) + [0.2] * (latent - latent // 2))
    log_std = torch.tensor([-1.0] * (latent // 2) + [0.0] * (latent - latent // 2))
    with torch.no_grad():
        ae.to_posterior.weight.zero_()
        ae.to_posterior.bias.copy_(torch.cat([mean, log_std]))
    out = ae(tiny_rows[:2], labels=tiny_rows[:2])
    per_dim = [max(0.5 * (m * m + math.exp(2 * s) - 1) - s, ae.config.kl_clamp)
               for m, s in zip(mean.tolist(), log_std.tolist())]
    assert per_dim[0] == pytest.approx(1.6927, abs=1e-4)
    assert out.kl.item() == pytest.approx(sum(per_dim), rel=1e-5)
    assert out.posterior_std.item() == pytest.approx(log_std.exp().mean().item(), rel=1e-5)


def test_autoencoder_loss_scores_only_real_labelled_chunks(tokenizer, tiny_rows):
    """The KL is averaged over the chunks with a scored token, as the reconstruction is over scored tokens: a chunk
    whose labels are all −100, or that is all padding (`attention_mask` 0, labels = input_ids), leaves both parts
    what they are on the rows without it; random ids under the padding change nothing."""
    torch.manual_seed(0)
    ae = build_model("calm-ae", "tiny", tokenizer).eval()
    K = ae.config.chunk_size
    ids = tiny_rows[:2, :4 * K].clone()
    with torch.no_grad():
        ae.to_posterior.bias.normal_()  # a KL that differs from chunk to chunk
        kept = ae(ids[:, :2 * K], labels=ids[:, :2 * K])
        labels = ids.clone()
        labels[:, 2 * K:] = -100
        unscored = ae(ids, labels=labels)
        mask = torch.ones_like(ids)
        mask[:, 2 * K:] = 0
        junk = ids.clone()
        junk[:, 2 * K:] = torch.randint(2, 100, junk[:, 2 * K:].shape)
        padded = ae(junk, labels=junk, attention_mask=mask)
        whole = ae(ids, labels=ids)
    for out in (unscored, padded):
        torch.testing.assert_close(out.kl, kept.kl)
        torch.testing.assert_close(out.reconstruction_nll, kept.reconstruction_nll)
    assert not torch.allclose(whole.kl, kept.kl)


def test_autoencoder_kl_gradient_is_the_closed_form_and_zero_under_the_free_bits_floor(tokenizer, tiny_rows):
    """Gradients, not only values: at μ = 1.5, log σ = −1 (KL 1.69 per dimension, above the 0.5 floor) on half the
    dimensions and μ = 0.2, log σ = 0 (below it) on the other half, the KL's share of ∂loss/∂(posterior bias) —
    the loss's gradient at kl_weight w minus at 0 — is w·μ and w·(σ² − 1) above the floor and exactly 0 below."""
    ae = build_model("calm-ae", "tiny", tokenizer).eval()
    latent, weight = ae.config.latent_size, 0.3
    half = latent // 2
    mean = torch.tensor([1.5] * half + [0.2] * (latent - half))
    log_std = torch.tensor([-1.0] * half + [0.0] * (latent - half))
    with torch.no_grad():
        ae.to_posterior.weight.zero_()
        ae.to_posterior.bias.copy_(torch.cat([mean, log_std]))
    grads = {}
    for w in (weight, 0.0):
        ae.config.kl_weight = w
        ae.zero_grad()
        ae(tiny_rows[:2], labels=tiny_rows[:2]).loss.backward()
        grads[w] = ae.to_posterior.bias.grad.clone()
    kl_grad = (grads[weight] - grads[0.0]) / weight
    above = torch.arange(latent) < half
    expected_mean = torch.where(above, mean, 0.0)
    expected_log_std = torch.where(above, log_std.exp().pow(2) - 1, 0.0)
    torch.testing.assert_close(kl_grad, torch.cat([expected_mean, expected_log_std]), atol=2e-4, rtol=1e-3)


def test_autoencoder_ignores_minus_100_labels_in_loss_and_accuracy(trained_autoencoder, tiny_rows):
    ae = CALMAutoencoder.from_pretrained(trained_autoencoder).eval()
    ids = tiny_rows[:2]
    labels = ids.clone()
    labels[0, 5:30] = -100
    labels[1, -3:] = -100
    out = ae(ids, labels=labels)
    logits, flat = out.logits.reshape(-1, ae.config.vocab_size), labels.reshape(-1)
    scored = flat != -100
    torch.testing.assert_close(out.reconstruction_nll, F.cross_entropy(logits[scored], flat[scored]))
    accuracy = (logits[scored].argmax(-1) == flat[scored]).float().mean()
    torch.testing.assert_close(out.token_accuracy, accuracy)
    counting_ignored = (logits.argmax(-1) == ids.reshape(-1)).float().mean()
    assert abs(counting_ignored - accuracy) > 1e-4  # the check above would see ignored positions counted


def test_latent_dropout_drops_at_its_rate_in_training_only_and_rescales(tokenizer, tiny_rows):
    """Latent dropout 0.4 (token replacement off, decoding μ): in training the decoder reads z with ≈ 40% of its
    coordinates zeroed and the others μ/(1 − 0.4) (inverted dropout); in eval it reads μ itself."""
    ae = build_model("calm-ae", "tiny", tokenizer, latent_dropout=0.4, token_replace_prob=0.0)
    seen = []
    decode = ae.decode_logits
    ae.decode_logits = lambda z: seen.append(z.detach()) or decode(z)
    try:
        torch.manual_seed(0)
        out = ae.train()(tiny_rows[:8], labels=tiny_rows[:8], sample_latent=False)
        mean = out.latent_mean.detach()
        z = seen[-1]
        dropped = z == 0
        assert abs(dropped.float().mean().item() - 0.4) < 0.03
        torch.testing.assert_close(z[~dropped], mean[~dropped] / 0.6)
        out = ae.eval()(tiny_rows[:8], labels=tiny_rows[:8])
        torch.testing.assert_close(seen[-1], out.latent_mean.detach())
    finally:
        del ae.decode_logits


def test_autoencoder_corrupts_only_in_training(tokenizer, tiny_rows):
    ae = build_model("calm-ae", "tiny", tokenizer, token_replace_prob=0.5)
    chunks = tiny_rows[:4].view(4, -1, 4)
    ae.train()
    changed = (ae.replace_tokens(chunks) != chunks).float().mean().item()
    assert 0.4 < changed < 0.6  # ≈ p, minus replacements that drew the same token
    ae.eval()
    assert torch.equal(ae.replace_tokens(chunks), chunks)


def test_fixed_id_corruption_replaces_with_that_id_at_the_set_rate(tokenizer):
    """replace_token_id (the reference's recipe): a replaced token is always that id, and tokens are replaced at
    rate p: the count of changed tokens among those not already equal to the id is within 4 binomial standard
    deviations of p times their number."""
    p, fixed = 0.15, 3
    ae = build_model("calm-ae", "tiny", tokenizer, token_replace_prob=p, replace_token_id=fixed).train()
    chunks = torch.randint(0, ae.config.vocab_size, (50, 100, 4), generator=torch.Generator().manual_seed(0))
    chunks[0, 0] = fixed  # tokens already equal to the id stay so
    torch.manual_seed(0)
    corrupted = ae.replace_tokens(chunks)
    changed = corrupted != chunks
    assert (corrupted[changed] == fixed).all() and (corrupted[0, 0] == fixed).all()
    eligible = int((chunks != fixed).sum())
    assert abs(int(changed.sum()) - p * eligible) <= 4 * (eligible * p * (1 - p)) ** 0.5
    # The default (None) draws random replacements: many distinct ids.
    torch.manual_seed(0)
    random_ids = build_model("calm-ae", "tiny", tokenizer, token_replace_prob=p).train().replace_tokens(chunks)
    assert (random_ids != chunks).any() and random_ids[random_ids != chunks].unique().numel() > 100


@pytest.mark.parametrize("std", [0.02, 1.0])
def test_embedding_init_std_sets_the_embedding_scale(tokenizer, std):
    torch.manual_seed(0)
    weight = build_model("calm-ae", "tiny", tokenizer, embedding_init_std=std).embed_tokens.weight
    # V·h ≈ 260k N(0, std²) entries: the sample std is within 1% of std (its relative sd is ≈ 1/sqrt(2·V·h)).
    assert weight.std().item() == pytest.approx(std, rel=0.01) and abs(weight.mean().item()) < 0.01 * std


@pytest.mark.parametrize("layout,layers,expected", [
    ("per_stage", 2, (2, 2)), ("split", 2, (1, 1)), ("split", 3, (1, 2)), ("split", 1, (0, 1)),
    ("per_stage", 1, (1, 1)),
])
def test_stage_layout_places_the_blocks_around_the_squeeze(tokenizer, tiny_rows, layout, layers, expected):
    """"split" (the reference) splits num_*_layers around the squeeze / expand; "per_stage" (default) repeats them."""
    ae = build_model("calm-ae", "tiny", tokenizer, stage_layout=layout, num_encoder_layers=layers,
                     num_decoder_layers=layers).eval()
    assert (len(ae.encoder_token_layers), len(ae.encoder_chunk_layers)) == expected
    assert (len(ae.decoder_chunk_layers), len(ae.decoder_token_layers)) == expected
    out = ae(tiny_rows[:2, :16], output_hidden_states=True)
    assert len(out.hidden_states) == 1 + 2 * sum(expected) and out.logits.shape[-2:] == (4, ae.config.vocab_size)


def test_reference_autoencoder_recipe_builds_and_round_trips(tokenizer, tiny_rows, tmp_path):
    ae = build_model("calm-ae", "tiny", tokenizer, **{**REFERENCE_AUTOENCODER_RECIPE, "num_encoder_layers": 2,
                                                       "num_decoder_layers": 2})
    assert (ae.config.stage_layout, ae.config.replace_token_id) == ("split", 0)
    assert len(ae.encoder_token_layers) == len(ae.decoder_token_layers) == 1
    assert ae.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.02)
    ae.save_pretrained(tmp_path / "ae")
    again = CALMAutoencoder.from_pretrained(tmp_path / "ae")
    assert (again.config.stage_layout, again.config.replace_token_id) == ("split", 0)
    torch.testing.assert_close(again.eval()(tiny_rows[:2]).logits, ae.eval()(tiny_rows[:2]).logits)


def test_autoencoder_samples_only_in_training_or_when_asked(tokenizer, tiny_rows, tmp_path):
    """Eval mode decodes the posterior mean: deterministic, the same for a row alone or in a batch, and after a
    save/load. Training (or sample_latent=True) decodes a sampled z."""
    torch.manual_seed(0)
    ae = build_model("calm-ae", "tiny", tokenizer).eval()
    x = tiny_rows[:3]
    first, second = ae(x, labels=x), ae(x, labels=x)
    assert torch.equal(first.logits, second.logits) and torch.equal(first.loss, second.loss)
    torch.testing.assert_close(first.logits, ae.decode_logits(ae.encode(x.view(3, -1, 4))[0]))
    torch.testing.assert_close(ae(x[1:2]).logits[0], first.logits[1], atol=1e-5, rtol=0)
    ae.save_pretrained(tmp_path / "ae")
    torch.testing.assert_close(CALMAutoencoder.from_pretrained(tmp_path / "ae").eval()(x).logits, first.logits)
    assert not torch.equal(ae(x, sample_latent=True).logits, first.logits)
    ae.train()
    assert not torch.equal(ae(x).logits, ae(x).logits)


def test_autoencoder_resizes_its_vocabulary_consistently(tokenizer, tiny_rows, tmp_path):
    """The autoencoder owns its vocabulary: embedding, output logits (tied to it) and config.vocab_size move
    together, and the resized model trains, saves and loads."""
    torch.manual_seed(0)
    ae = build_model("calm-ae", "tiny", tokenizer, token_replace_prob=0.5).eval()
    for size in (4100, 99):
        ae.resize_token_embeddings(size)
        x = tiny_rows[:2] % size
        assert ae.config.vocab_size == size and ae(x).logits.shape[-1] == size
        ae.save_pretrained(tmp_path / str(size))
        again = CALMAutoencoder.from_pretrained(tmp_path / str(size)).eval()
        torch.testing.assert_close(again(x).logits, ae(x).logits)
    ae.train()
    assert (ae.replace_tokens(x.view(2, -1, 4)) < 99).all()  # corruption draws from the new vocabulary
    ae(x, labels=x).loss.backward()


def test_calm_refuses_to_resize_its_vocabulary_before_changing_anything(tmp_path):
    """CALM's vocabulary belongs to its frozen autoencoder: a resize is refused with a clear error, the model and
    its config are untouched and still save and load; a resize to the same size is allowed (no change)."""
    ae_config = CALMAutoencoderConfig(vocab_size=99, chunk_size=4, hidden_size=32, intermediate_size=64, latent_size=8)
    model = CALMForCausalLM(CALMConfig(vocab_size=99, chunk_size=4, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, autoencoder_config=ae_config))
    for target in (model, model.model):
        with pytest.raises(NotImplementedError, match="frozen autoencoder"):
            target.resize_token_embeddings(120)
        with pytest.raises(NotImplementedError, match="frozen autoencoder"):
            target.resize_token_embeddings(None, pad_to_multiple_of=64)
    assert model.config.vocab_size == 99 == model.model.embed_tokens.num_embeddings
    assert model.resize_token_embeddings(99) is model.model.embed_tokens
    model.save_pretrained(tmp_path / "calm")
    assert CALMForCausalLM.from_pretrained(tmp_path / "calm").config.vocab_size == 99


def test_trained_autoencoder_reconstructs_from_sampled_latents(trained_autoencoder, tiny_rows):
    ae = CALMAutoencoder.from_pretrained(trained_autoencoder).eval()
    r = ae.reconstruction_accuracy(tiny_rows[1600:1700], generator=torch.Generator().manual_seed(0))
    untrained = CALMAutoencoder(ae.config).eval().reconstruction_accuracy(tiny_rows[1600:1700])
    # Held-out rows: tokens never seen in the 96k training tokens cannot be reconstructed, hence the modest bar.
    assert r["sampled_accuracy"] > 0.3 > 0.05 > untrained["sampled_accuracy"]
    assert r["mean_accuracy"] >= r["sampled_accuracy"] - 0.02
    assert 0 < r["posterior_std"] < 1


# ---------------------------------------------------------------------------------------------- energy head

def tiny_calm_config(**kwargs) -> CALMConfig:
    ae = CALMAutoencoderConfig(vocab_size=99, chunk_size=4, hidden_size=32, intermediate_size=64, latent_size=8)
    return CALMConfig(vocab_size=99, chunk_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      autoencoder_config=ae, **kwargs)


@pytest.mark.parametrize("head_type", ["reference", "swiglu"])
@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_energy_head_parameter_count_formula(head_type, blocks):
    """The count from the architecture matches the built head; a reference block is 6d² + 7d (the paper's ≈ 6d²),
    a SwiGLU block 5d² + d."""
    config = tiny_calm_config(energy_head_type=head_type, num_head_blocks=blocks, noise_size=16)
    head = CALMForCausalLM(config).energy_head
    assert isinstance(head, {"reference": ReferenceEnergyHead, "swiglu": SwiGLUEnergyHead}[head_type])
    assert sum(p.numel() for p in head.parameters()) == energy_head_parameter_count(config)
    d = config.hidden_size
    one_more = energy_head_parameter_count(tiny_calm_config(energy_head_type=head_type, num_head_blocks=blocks + 1,
                                                            noise_size=16))
    assert one_more - energy_head_parameter_count(config) == (6 * d * d + 7 * d if head_type == "reference"
                                                               else 5 * d * d + d)


def test_reference_head_matches_its_written_formula():
    """The "reference" head computes, from ε and h, exactly the reference code's MLP generator, written out here
    with torch.nn.functional: input Linear + LayerNorm for each, blocks, final LayerNorm -> Linear -> SiLU -> Linear."""
    torch.manual_seed(0)
    config = tiny_calm_config(energy_head_type="reference", num_head_blocks=2, noise_size=16)
    head = CALMForCausalLM(config).energy_head
    assert config.energy_head_type == "reference" and isinstance(head, ReferenceEnergyHead)
    assert head.out.weight.abs().sum() == 0 and head.out.bias.abs().sum() == 0  # zero-initialised last layer
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3)
    hidden, noise = torch.randn(3, 32), torch.rand(3, 5, 16) - 0.5

    def ln(x, norm):
        return F.layer_norm(x, (32,), norm.weight, norm.bias, eps=config.rms_norm_eps)

    x = ln(F.linear(noise, head.noise_proj.weight, head.noise_proj.bias), head.noise_norm)
    c = ln(F.linear(hidden, head.hidden_proj.weight, head.hidden_proj.bias), head.hidden_norm)[:, None].expand(3, 5, 32)
    for b in head.blocks:
        y = F.silu(F.linear(torch.cat([ln(x, b.norm), c], -1), b.fuse.weight, b.fuse.bias))
        y = F.linear(F.silu(F.linear(y, b.inner.weight, b.inner.bias)), b.gate_up.weight, b.gate_up.bias)
        x = x + F.linear(F.silu(y[..., :32]) * y[..., 32:], b.down.weight, b.down.bias)
    x = F.silu(F.linear(ln(x, head.final_norm), head.final_proj.weight, head.final_proj.bias))
    expected = F.linear(x, head.out.weight, head.out.bias)
    torch.testing.assert_close(head(hidden, noise), expected)


def test_a_config_saved_before_the_head_option_loads_the_swiglu_head(tmp_path):
    """transformers fills a key missing from config.json with the `__init__` default; a checkpoint saved before
    the option existed holds SwiGLU-head weights, so it must load as "swiglu", with its weights and identical
    outputs, through from_pretrained and the Auto classes, whatever the default. A "reference" model reloads as
    "reference", and the default model as "swiglu"."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    old = CALMForCausalLM(tiny_calm_config(energy_head_type="swiglu")).eval()
    with torch.no_grad():
        old.energy_head.out.weight.normal_(0.0, 0.2)
    old.save_pretrained(tmp_path / "old")
    path = tmp_path / "old" / "config.json"
    saved = json.loads(path.read_text())
    assert saved.pop("energy_head_type") == "swiglu"
    path.write_text(json.dumps(saved))  # as written before the field existed

    assert CALMConfig.from_pretrained(tmp_path / "old").energy_head_type == "swiglu"
    assert CALMConfig.from_json_file(path).energy_head_type == "swiglu"
    assert AutoConfig.from_pretrained(tmp_path / "old").energy_head_type == "swiglu"
    hidden, noise = torch.randn(2, 32), torch.rand(2, 3, 64) - 0.5
    for loaded in (CALMForCausalLM.from_pretrained(tmp_path / "old"), AutoModelForCausalLM.from_pretrained(tmp_path / "old")):
        assert isinstance(loaded.energy_head, SwiGLUEnergyHead)
        for name, value in old.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), name
        torch.testing.assert_close(loaded.eval().energy_head(hidden, noise), old.energy_head(hidden, noise))

    assert CALMConfig().energy_head_type == "swiglu"
    new = CALMForCausalLM(tiny_calm_config(energy_head_type="reference"))
    new.save_pretrained(tmp_path / "new")
    assert json.loads((tmp_path / "new" / "config.json").read_text())["energy_head_type"] == "reference"
    assert isinstance(CALMForCausalLM.from_pretrained(tmp_path / "new").energy_head, ReferenceEnergyHead)
    # An explicit override still wins over the legacy fill-in.
    assert CALMConfig.from_pretrained(tmp_path / "old", energy_head_type="reference").energy_head_type == "reference"


# ---------------------------------------------------------------------------------------------- CALM objective

def test_from_autoencoder_copies_freezes_and_embeds_no_path(trained_autoencoder, tokenizer, tmp_path):
    model = build_model("calm", "tiny", tokenizer, autoencoder=str(trained_autoencoder))
    ae = CALMAutoencoder.from_pretrained(trained_autoencoder)
    for name, value in ae.state_dict().items():
        assert torch.equal(model.autoencoder.state_dict()[name], value)
    assert not any(p.requires_grad for p in model.autoencoder.parameters())
    model.train()
    assert model.training and not model.autoencoder.training
    model.save_pretrained(tmp_path / "calm")
    text = (tmp_path / "calm" / "config.json").read_text()
    assert str(trained_autoencoder) not in text and json.loads(text)["autoencoder_config"]["latent_size"] == 32


def test_energy_objective_trains_the_head_not_the_autoencoder(trained_autoencoder, tokenizer, tiny_rows):
    torch.manual_seed(0)
    model = build_model("calm", "tiny", tokenizer, autoencoder=str(trained_autoencoder)).train()
    assert model.energy_head.out.weight.abs().sum() == 0  # zero-initialised last layer
    out = model(input_ids=tiny_rows[:2], labels=tiny_rows[:2])
    torch.testing.assert_close(out.loss.detach(), out.energy_fidelity - out.energy_diversity)
    out.loss.backward()
    assert all(p.grad is None for p in model.autoencoder.parameters())
    assert model.energy_head.out.weight.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_ignored_labels_remove_their_steps(trained_autoencoder, tokenizer, tiny_rows):
    model = build_model("calm", "tiny", tokenizer, autoencoder=str(trained_autoencoder))
    labels = tiny_rows[:1].clone()
    labels[:, 4:] = -100  # only chunk 0 is scored, which is never a target: nothing left
    torch.manual_seed(0)
    out = model(input_ids=tiny_rows[:1], labels=labels)
    assert out.loss.item() == 0 and out.loss.requires_grad  # nothing to score: 0, never NaN
    # Every step is computed and weighted by the mask (static shapes for torch.compile): with the same draws, the
    # loss equals that of the scored steps alone, and the unscored ones (targets -100) get no gradient and no NaN.
    ids = tiny_rows[:2]
    labels = ids.clone()
    labels[0, 8:20] = labels[1, 40:41] = -100  # steps 1-4 of row 0 and step 9 of row 1 are not scored
    torch.manual_seed(0)
    out = model(input_ids=ids, labels=labels)
    hidden = model(input_ids=ids[:, :-4]).last_hidden_state.detach().requires_grad_()
    targets = labels.view(2, -1, 4)[:, 1:]
    scored = (targets != -100).all(-1)
    cfg = model.config
    torch.manual_seed(0)  # the forward's draws, in its order
    target_noise = torch.randn(*scored.shape, cfg.num_target_samples, cfg.latent_size)
    model_noise = torch.rand(*scored.shape, cfg.num_model_samples, cfg.noise_size) - 0.5
    masked = model.masked_energy_loss(hidden, targets, scored, target_noise, model_noise)
    torch.testing.assert_close(masked, (out.loss, out.energy_fidelity, out.energy_diversity))
    alone = model.masked_energy_loss(hidden[scored][None], targets[scored][None], scored[scored][None],
                                     target_noise[scored][None], model_noise[scored][None])
    torch.testing.assert_close(masked, alone)
    masked[0].backward()
    assert torch.isfinite(hidden.grad).all() and (hidden.grad[~scored] == 0).all()


def test_head_noise_is_uniform_on_the_centred_cube_in_training_eval_and_generate(trained_calm, tiny_rows):
    """The energy head's noise input ε ~ U[−0.5, 0.5]^d_noise (CALM defaults) wherever it is drawn: the training
    loss (train mode), the eval loss and generate() at T = 1: every draw inside [−0.5, 0.5], mean ≈ 0, variance
    ≈ 1/12, both halves used."""
    model = copy.deepcopy(trained_calm)
    seen = []
    hook = model.energy_head.register_forward_pre_hook(lambda module, args: seen.append(args[1].detach().flatten()))
    try:
        for mode, run in (("train", lambda: model.train()(input_ids=tiny_rows[:2], labels=tiny_rows[:2])),
                          ("eval", lambda: model.eval()(input_ids=tiny_rows[:2], labels=tiny_rows[:2])),
                          ("generate", lambda: model.eval().generate(tiny_rows[:2, :8], max_new_tokens=16,
                                                                     eos_token_id=None, temperature=1.0,
                                                                     noise_seeds=[1, 2]))):
            seen.clear()
            torch.manual_seed(0)
            with torch.no_grad():
                run()
            noise = torch.cat(seen).double()
            assert noise.numel() > 500, mode
            assert noise.min() >= -0.5 and noise.max() <= 0.5, mode
            assert abs(noise.mean().item()) < 0.05 and abs(noise.var().item() - 1 / 12) < 0.012, mode
    finally:
        hook.remove()


def test_context_spread_is_the_std_over_scored_steps_only():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8)
    scored = torch.tensor([[True, True, False, True, True], [False, True, True, True, False]])
    expected = hidden[scored].std(0).mean()  # independent reference: boolean selection, torch.std (n - 1)
    torch.testing.assert_close(context_spread(hidden, scored), expected)
    wild = hidden.clone()
    wild[~scored] = 1e4  # unscored (padding) steps do not count
    torch.testing.assert_close(context_spread(wild, scored), expected)
    same = torch.randn(8).expand(2, 5, 8)  # one vector at every step: the collapse it is meant to show
    assert context_spread(same, scored).item() < 1e-6
    assert context_spread(hidden, torch.zeros_like(scored)).item() == 0  # nothing scored: 0, not NaN
    assert context_spread(hidden, scored & torch.tensor([[True] + [False] * 4] * 2)).item() == 0  # one step


def test_forward_reports_the_context_spread_and_training_logs_it(trained_autoencoder, tokenizer, tiny_rows):
    from hf_latentlm.training.loop import step_losses

    torch.manual_seed(0)
    model = build_model("calm", "tiny", tokenizer, autoencoder=str(trained_autoencoder))
    ids = tiny_rows[:2]
    labels = ids.clone()
    labels[1, 12:] = -100
    out = model(input_ids=ids, labels=labels)
    hidden = model(input_ids=ids[:, :-4]).last_hidden_state
    scored = (labels.view(2, -1, 4)[:, 1:] != -100).all(-1)
    torch.testing.assert_close(out.context_spread, hidden[scored].std(0).mean())
    assert out.context_spread.item() > 0.1 and not out.context_spread.requires_grad
    assert step_losses(out)["context_spread"] == out.context_spread


def test_backbone_is_causal_over_chunks_and_cache_matches(trained_calm, tiny_rows):
    ids = tiny_rows[1600:1602, :32]
    full = trained_calm(input_ids=ids).last_hidden_state
    changed = ids.clone()
    changed[:, 20:] = 7
    torch.testing.assert_close(trained_calm(input_ids=changed).last_hidden_state[:, :5], full[:, :5])
    cache = None
    steps = []
    for start in range(0, 32, 8):
        out = trained_calm(input_ids=ids[:, start:start + 8], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.last_hidden_state)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


def test_sequences_not_made_of_whole_chunks_are_refused(trained_calm):
    with pytest.raises(ValueError, match="not a multiple of chunk_size=4"):
        trained_calm(input_ids=torch.ones(1, 7, dtype=torch.long))


# ---------------------------------------------------------------------------------------------- generate

def test_generate_gives_exactly_max_new_tokens_for_any_prompt_length(trained_calm, tokenizer):
    prompt = tokenizer("ROMEO.\nWhat light", return_tensors="pt", add_special_tokens=False).input_ids
    for length in (7, 8, 5):
        for max_new in (10, 12, 1):
            out = trained_calm.generate(prompt[:, :length], max_new_tokens=max_new, eos_token_id=None,
                                        noise_seeds=[3], return_dict_in_generate=True)
            assert out.sequences.shape == (1, length + max_new)
            assert torch.equal(out.sequences[:, :length], prompt[:, :length])
            assert out.model_calls.item() == -(-max_new // 4)  # one backbone call per chunk, prefill included


def test_short_prompt_is_read_as_the_start_of_a_document(trained_calm, tokenizer):
    # The documented rule: a 7-token prompt is left-filled with EOS to 8, so it equals the explicit version.
    prompt = tokenizer("ROMEO.\nWhat light", return_tensors="pt", add_special_tokens=False).input_ids[:, :7]
    explicit = torch.cat([torch.tensor([[tokenizer.eos_token_id]]), prompt], dim=1)
    a = trained_calm.generate(prompt, max_new_tokens=12, eos_token_id=None, noise_seeds=[5])[:, 7:]
    b = trained_calm.generate(explicit, max_new_tokens=12, eos_token_id=None, noise_seeds=[5])[:, 8:]
    assert torch.equal(a, b)


@pytest.fixture(scope="module")
def confident_calm(trained_calm):
    """The trained tiny CALM with its head's noise input made small next to a fixed offset (the noise embedding is
    layer-normed, so only its share counts): draws often, not always, decode to the same chunk, so exact rejection
    needs a varying number of rounds per row (the undertrained model's chunks almost never agree)."""
    model = copy.deepcopy(trained_calm)
    with torch.no_grad():
        proj = model.energy_head.noise_proj
        proj.bias.copy_(torch.randn(proj.bias.shape, generator=torch.Generator().manual_seed(0)) * proj.weight.std())
        proj.weight.mul_(0.02)
    return model


@pytest.mark.parametrize("options", [
    dict(),
    dict(temperature=0.5),
    dict(temperature=0.5, temperature_sampler="exact"),
    dict(temperature=0.6, temperature_sampler="exact"),
    dict(temperature=0.6, temperature_pool_size=32),
    dict(do_sample=False, temperature_pool_size=16),
])
def test_batched_rows_match_running_each_alone(trained_calm, confident_calm, tiny_rows, tokenizer, options,
                                               left_pad):
    if options.get("temperature_sampler") == "exact":
        trained_calm = confident_calm
    prompts = [tiny_rows[1600 + i, :n] for i, n in enumerate((9, 4, 13))]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    seeds = [11, 12, 13]
    batched = trained_calm.generate(ids, attention_mask=mask, max_new_tokens=10, noise_seeds=seeds,
                                    eos_token_id=None, **options)[:, ids.shape[1]:]
    for b, p in enumerate(prompts):
        alone = trained_calm.generate(p[None], max_new_tokens=10, noise_seeds=[seeds[b]], eos_token_id=None,
                                      **options)[0, p.numel():]
        assert torch.equal(batched[b], alone), (b, options)


def test_lower_temperature_concentrates_samples(trained_calm, tiny_rows):
    prompt = tiny_rows[1600:1601, :8].expand(24, -1)
    seeds = list(range(24))

    def distinct(**options):
        out = trained_calm.generate(prompt, max_new_tokens=4, noise_seeds=seeds, eos_token_id=None, **options)
        return len({tuple(r) for r in out[:, 8:].tolist()})

    assert distinct(temperature=0.25, temperature_pool_size=64) < distinct()


def test_eos_stops_a_row_inside_a_chunk_and_pads_it(trained_calm, tiny_rows, tokenizer):
    prompt = tiny_rows[1600:1601, :8]
    free = trained_calm.generate(prompt, max_new_tokens=24, noise_seeds=[1], eos_token_id=None)[0, 8:]
    # Pick a token generated at a position that is not the last of its chunk, and call it EOS.
    stop_at = next(i for i in range(24) if i % 4 != 3 and free[i] not in free[:i])
    out = trained_calm.generate(torch.cat([prompt, prompt]), max_new_tokens=24, noise_seeds=[1, 2],
                                eos_token_id=int(free[stop_at]), pad_token_id=tokenizer.pad_token_id,
                                return_dict_in_generate=True)
    assert out.num_new_tokens[0].item() == stop_at + 1
    assert torch.equal(out.sequences[0, 8:8 + stop_at + 1], free[:stop_at + 1])
    assert (out.sequences[0, 8 + stop_at + 1:] == tokenizer.pad_token_id).all()
    assert out.model_calls[0].item() == stop_at // 4 + 1


def test_streamer_receives_prompt_then_every_new_token(trained_calm, tiny_rows, streamer):
    prompt = tiny_rows[1600:1601, :6]
    rec = streamer
    out = trained_calm.generate(prompt, max_new_tokens=10, noise_seeds=[4], eos_token_id=None, streamer=rec)
    assert rec.ended and rec.chunks[0] == prompt[0].tolist()
    assert sum(rec.chunks[1:], []) == out[0, 6:].tolist()
    assert [len(c) for c in rec.chunks[1:]] == [4, 4, 2]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(num_beams=2), "num_beams"),
    (dict(top_k=5), "top_k"),
    (dict(top_p=0.9), "top_p"),
    (dict(temperature=0.0), r"temperature must be in \(0, 1\]"),
    (dict(temperature=1.5), r"temperature must be in \(0, 1\]"),
    (dict(temperature_sampler="beam"), "temperature_sampler"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=5000), "max_position_embeddings"),
    (dict(noise_seeds=[1, 2]), "noise_seeds"),
    (dict(repetition_penalty=1.2), "repetition_penalty"),
])
def test_bad_generation_options_are_named(trained_calm, kwargs, needle):
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=needle):
        trained_calm.generate(torch.tensor([[5, 6, 7, 8]]), **kwargs)


def test_exact_sampler_gives_up_with_a_clear_error(trained_calm):
    # The undertrained model's chunks practically never agree: rejection must stop and say what to do.
    with pytest.raises(ValueError, match="accepted no chunk at T = 0.33"):
        trained_calm.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, temperature=1 / 3,
                              temperature_sampler="exact", noise_seeds=[0])


def test_exact_rejection_retries_without_extra_backbone_calls(confident_calm, monkeypatch):
    import hf_latentlm.modeling.modeling_calm as modeling_calm
    from hf_latentlm.eval.speed import CallCounter

    rounds = []
    original = modeling_calm.exact_temperature_scan

    def counted(chunks, uniforms, temperature, state):
        new = original(chunks, uniforms, temperature, state)
        rounds.append(new.accepted.tolist())
        return new

    monkeypatch.setattr(modeling_calm, "exact_temperature_scan", counted)
    monkeypatch.setattr(confident_calm.config, "exact_attempts", 1)  # two draws per round: rejections show
    with CallCounter(confident_calm) as backbone:
        confident_calm.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=16, temperature=0.5,
                                temperature_sampler="exact", noise_seeds=[0], eos_token_id=None)
    assert backbone.calls == 4  # one per chunk
    assert len(rounds) > 4 and [False] in rounds  # some chunk was rejected and drawn again


def test_harness_measures_calm_without_a_likelihood(trained_calm, tiny_rows):
    from hf_latentlm.eval.brier import evaluate_brier
    from hf_latentlm.eval.nll import has_likelihood
    from hf_latentlm.eval.speed import measure_generation_speed

    assert not has_likelihood(trained_calm)
    result = evaluate_brier(trained_calm, tiny_rows[1600:1700].reshape(-1), num_positions=32, context_len=16,
                            batch_size=16)
    assert result["num_positions"] == 32 and -1 <= result["brier_1"]["value"] <= 1
    speed = measure_generation_speed(trained_calm, tiny_rows[1600:1602, :16], max_new_tokens=16, repeats=1)
    assert speed["new_tokens_per_row"] == 16 and speed["model_calls_per_token"] == pytest.approx(4 / 16)


# ---------------------------------------------------------------------------------------------- Hub contract


def test_autoencoder_folder_loads_through_automodel(trained_autoencoder):
    from transformers import AutoModel

    import hf_latentlm.modeling  # noqa: F401

    ae = AutoModel.from_pretrained(trained_autoencoder, trust_remote_code=True)
    assert isinstance(ae, CALMAutoencoder)
    auto_map = json.loads((trained_autoencoder / "config.json").read_text())["auto_map"]
    assert auto_map == {"AutoConfig": "configuration_calm.CALMAutoencoderConfig",
                        "AutoModel": "modeling_calm.CALMAutoencoder"}


def test_autoencoder_follows_the_transformers_output_conventions(tokenizer, tiny_rows):
    ae = build_model("calm-ae", "tiny", tokenizer).eval()
    ids = tiny_rows[:2, :16]
    out = ae(ids, output_hidden_states=True)
    blocks = 2 * (ae.config.num_encoder_layers + ae.config.num_decoder_layers)
    assert len(out.hidden_states) == 1 + blocks  # the embeddings, then every residual block
    torch.testing.assert_close(out.hidden_states[0], ae.embed_tokens(ids.view(2, -1, 4)))
    assert ae(ids).hidden_states is None
    as_tuple = ae(ids, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], out.logits)
    with pytest.raises(TypeError, match="foo"):
        ae(ids, foo=1)
    # No attention: every implementation is accepted and none changes the outputs.
    for implementation in ("eager", "flex_attention", "sdpa"):
        ae.set_attn_implementation(implementation)
        torch.testing.assert_close(ae(ids).logits, out.logits, atol=0, rtol=0)


def test_from_pretrained_keeps_the_autoencoder_frozen(tmp_path, tokenizer):
    """transformers replaces loaded weights with new trainable parameters; the loaded CALM must still train only its
    backbone and head (a trainable autoencoder that gets no gradient breaks DDP)."""
    from hf_latentlm.families import build_model

    torch.manual_seed(0)
    calm = build_model("calm", "tiny", tokenizer, autoencoder=build_model("calm-ae", "tiny", tokenizer))
    calm.save_pretrained(tmp_path / "calm")
    loaded = type(calm).from_pretrained(tmp_path / "calm")
    for model in (calm, loaded):
        assert not any(p.requires_grad for p in model.autoencoder.parameters())
        assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("autoencoder."))


def test_right_padded_chunks_do_not_enter_the_energy_loss():
    """labels = input_ids (the HF convention) with a right-padding attention_mask: a step is scored by its TARGET
    chunk's padding, so the eval-mode loss cannot depend on the ids under the padding, and equals the same rows with
    those labels set to −100; the padding is not ignored altogether (shorter rows change the loss)."""
    torch.manual_seed(0)
    model = CALMForCausalLM(tiny_calm_config()).eval()
    ids = torch.randint(1, 99, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # row 1: chunks 2 and 3 are padding
    other = ids.clone()
    other[1, 8:] = torch.randint(1, 99, (8,))  # other ids under the padding
    masked_labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        torch.testing.assert_close(model(input_ids=other, attention_mask=mask, labels=other).loss, loss)
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask, labels=masked_labels).loss, loss)
        assert not torch.allclose(model(input_ids=ids, labels=ids).loss, loss)
