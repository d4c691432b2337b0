"""AURORA-LM (hf_latentlm/modeling/modeling_aurora.py; paper 003, method-specs §4): the query autoencoder, the
block-causal x0 denoiser's objective and generate(), each checked against an independent reference (the paper's
visibility formulas by perturbation, hand replays of the objective from what the networks received, a hand count of
the network calls, forward hooks). The contract every family shares (batched == alone greedy, EOS, streamer, Hub
loading, hidden states, caches, CLI) runs in tests/test_family_contract.py. Tiny models built directly (hidden 32,
one or two layers, vocabulary 96, blocks of 4)."""

from __future__ import annotations

import copy
import math

import latent_fixtures as lf
import pytest
import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from hf_latentlm.modeling import modeling_aurora
from hf_latentlm.modeling.configuration_aurora import (
    AuroraAutoencoderConfig,
    AuroraConfig,
)
from hf_latentlm.modeling.flow import FlowMatchEulerSampler
from hf_latentlm.modeling.modeling_aurora import AuroraAutoencoder, AuroraForCausalLM

VOCAB, Q, RANK, D = 96, 4, 8, 32
AE_KW = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             num_hidden_layers=1)
DENOISER_KW = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                   num_hidden_layers=1, block_size=Q, noisy_input_rank=RANK, consistency_steps=4, num_inference_steps=3)


def make_autoencoder(seed: int = 0, randomize: bool = False, **overrides) -> AuroraAutoencoder:
    """randomize: random (not zero) learned queries, so that every slot's state depends on what it reads."""
    torch.manual_seed(seed)
    autoencoder = AuroraAutoencoder(AuroraAutoencoderConfig(**{**AE_KW, **overrides}))
    if randomize:
        with torch.no_grad():
            autoencoder.encoder.query.normal_()
            autoencoder.decoder.query.normal_()
    return autoencoder


def make_aurora(seed: int = 0, autoencoder: AuroraAutoencoder | None = None, **overrides) -> AuroraForCausalLM:
    autoencoder = make_autoencoder(seed, randomize=True) if autoencoder is None else autoencoder
    torch.manual_seed(seed + 1)
    return AuroraForCausalLM.from_autoencoder(autoencoder, **{**DENOISER_KW, **overrides})


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return lf.random_tokens(VOCAB, batch, length, seed)


class DenoiserSpy:
    """Replaces a denoiser's `forward` (an instance attribute) and records every call's inputs, its output states and
    the clean-latent prediction its own x0 head makes of them (detached)."""

    def __init__(self, monkeypatch, denoiser: nn.Module):
        self.original, self.denoiser, self.calls = denoiser.forward, denoiser, []
        monkeypatch.setattr(denoiser, "forward", self)

    def __call__(self, latents, timesteps, noisy, self_condition, position_ids, mask, cache=None):
        hidden = self.original(latents, timesteps, noisy, self_condition, position_ids, mask, cache=cache)
        with torch.no_grad():
            x0 = self.denoiser.x0_head(hidden).float()
        self.calls.append(dict(latents=latents.detach(), timesteps=timesteps, noisy=noisy,
                               self_condition=None if self_condition is None else self_condition.detach(),
                               hidden=hidden, x0=x0))
        return hidden


class ConstantSigma:
    """A time sampler that draws one fixed σ everywhere."""

    def __init__(self, sigma: float):
        self.sigma = sigma

    def sample(self, shape, generator=None, device=None):
        return torch.full(shape, self.sigma, device=device)


def scored_mean(error: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Mean of error [B, L] over the scored positions, by a Python loop (0 when none is scored)."""
    total, count = torch.tensor(0.0, dtype=torch.float64), 0
    for b in range(error.shape[0]):
        for i in range(error.shape[1]):
            if scored[b, i]:
                total, count = total + error[b, i].double(), count + 1
    return total / max(count, 1)


# ====================================================================================================================
# Configuration
# ====================================================================================================================

@pytest.mark.parametrize("overrides,needle", [
    (dict(block_size=0), "block_size"),
    (dict(noisy_input_rank=0), "noisy_input_rank"),
    (dict(time_sampler="x"), "time_sampler"),
    (dict(loss_space="x"), "loss_space"),
    (dict(velocity_min_sigma=0.0), "velocity_min_sigma"),
    (dict(history_dropout=1.0), "history_dropout"),
    (dict(self_condition_prob=1.5), "self_condition_prob"),
    (dict(ema_decay=1.0), "ema_decay"),
    (dict(consistency_warmup_steps=-1), "consistency_warmup_steps"),
    (dict(cfg_scale=-1.0), "cfg_scale"),
    (dict(vocab_size=VOCAB + 1), "vocab_size"),  # disagrees with the autoencoder's
])
def test_bad_aurora_config_values_are_named(overrides, needle):
    AuroraConfig(**DENOISER_KW, vocab_size=VOCAB, autoencoder_config=AuroraAutoencoderConfig(**AE_KW))  # valid
    with pytest.raises(ValueError, match=needle):
        AuroraConfig(**{**DENOISER_KW, "vocab_size": VOCAB, **overrides},
                     autoencoder_config=AuroraAutoencoderConfig(**AE_KW))


@pytest.mark.parametrize("overrides,needle", [
    (dict(keep_ratio=0.0), "keep_ratio"), (dict(keep_ratio=1.5), "keep_ratio"),
    (dict(token_dropout=1.0), "token_dropout"), (dict(statistics_eps=0.0), "statistics_eps"),
])
def test_bad_autoencoder_config_values_are_named(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        AuroraAutoencoderConfig(**{**AE_KW, **overrides})


def test_from_autoencoder_refuses_a_config_whose_vocabulary_disagrees():
    autoencoder = make_autoencoder()
    other = AuroraConfig(**DENOISER_KW, vocab_size=VOCAB + 1,
                         autoencoder_config=AuroraAutoencoderConfig(**{**AE_KW, "vocab_size": VOCAB + 1}))
    with pytest.raises(ValueError, match="vocab_size"):
        AuroraForCausalLM.from_autoencoder(autoencoder, other)
    with pytest.raises(ValueError, match="vocab_size"):
        AuroraForCausalLM.from_autoencoder(autoencoder, **DENOISER_KW, vocab_size=VOCAB + 1)


# ====================================================================================================================
# Query autoencoder
# ====================================================================================================================

def changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position (dim 1) of [1, T, ...] tensors: does anything differ by more than rounding?"""
    return ((a - b).abs().flatten(2).amax(-1) > 1e-5)[0]


def unchanged(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a - b).abs().flatten(2).amax(-1) <= 1e-6)[0]


@pytest.mark.parametrize("keep_ratio,slots,residual", [(1.0, 12, False), (0.75, 9, False), (0.5, 6, False),
                                                        (1.0, 12, True)])
def test_query_encoder_and_decoder_see_what_the_paper_says(keep_ratio, slots, residual):
    """L = 12 tokens, N slots, two layers of random weights, brute force over every token and slot (0-based):
    changing token t changes slot i iff t ≤ ⌈(i+1)L/N⌉ − 1 (at N = L: slots ≥ t), and changing slot i changes the
    decoder's output j iff i ≤ ⌊j·N/L⌋ (at N = L: outputs ≥ i); everything else stays as it was. The residual copy
    path (query i starts from the learned query plus item i) keeps exactly the same dependencies."""
    length = 12
    autoencoder = make_autoencoder(randomize=True, keep_ratio=keep_ratio, num_hidden_layers=2,
                                   initializer_range=0.2, query_residual=residual).eval()
    ids = tokens(1, length, seed=4)
    latents = torch.randn(1, slots, D, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_slots, base_logits = autoencoder.encode(ids), autoencoder.decode_logits(latents, length)
        assert base_slots.shape == (1, slots, D) and base_logits.shape == (1, length, VOCAB)
        for t in range(length):
            other = ids.clone()
            other[0, t] = (ids[0, t] + 11) % VOCAB
            new = autoencoder.encode(other)
            for i in range(slots):
                sees = t <= math.ceil((i + 1) * length / slots) - 1
                if keep_ratio == 1:
                    assert sees == (i >= t)
                assert bool(changed(new, base_slots)[i] if sees else unchanged(new, base_slots)[i]), (t, i, sees)
        for i in range(slots):
            other = latents.clone()
            other[0, i] += 1.0
            new = autoencoder.decode_logits(other, length)
            for j in range(length):
                sees = i <= (j * slots) // length
                if keep_ratio == 1:
                    assert sees == (j >= i)
                assert bool(changed(new, base_logits)[j] if sees else unchanged(new, base_logits)[j]), (i, j, sees)


@pytest.mark.parametrize("residual", [False, True])
def test_slot_gradients_reach_only_the_tokens_at_or_before_the_slot(residual):
    """Brute-force gradient check of the encoder's causality: for every slot i of 10, the gradient of slot i's latent
    (a random projection of it, so that no component cancels) reaches the embeddings of tokens 0..i and no later
    one; the decoder's output j gets gradient from latents 0..j only. The residual copy path adds item i to query i:
    token i's gradient to slot i is then nonzero by construction, and nothing past i may appear."""
    length = 10
    autoencoder = make_autoencoder(randomize=True, num_hidden_layers=2, initializer_range=0.2,
                                   query_residual=residual).eval()
    ids = tokens(1, length, seed=7)
    embeds = autoencoder.embed_tokens(ids).detach().requires_grad_(True)
    slots = autoencoder.encoder(embeds, None).float()
    projection = torch.randn(D, generator=torch.Generator().manual_seed(8))
    for i in range(length):
        (grad,) = torch.autograd.grad((slots[0, i] @ projection), embeds, retain_graph=True)
        reached = grad[0].abs().amax(-1) > 0
        assert reached.tolist() == [t <= i for t in range(length)], (i, reached.tolist())
    latents = torch.randn(1, length, D, generator=torch.Generator().manual_seed(9), requires_grad=True)
    logits = autoencoder.decode_logits(latents, length)
    for j in range(length):
        (grad,) = torch.autograd.grad(logits[0, j].logsumexp(-1), latents, retain_graph=True)
        assert (grad[0].abs().amax(-1) > 0).tolist() == [i <= j for i in range(length)], j


def test_compressed_autoencoder_refuses_padding_and_caches():
    autoencoder = make_autoencoder(keep_ratio=0.5).eval()
    ids = tokens(2, 8)
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    latents = torch.randn(2, 4, D)
    with torch.no_grad():
        for call in (lambda: autoencoder.encode(ids, padded), lambda: autoencoder.encode(ids, cache=DynamicCache()),
                     lambda: autoencoder.decode_logits(latents, 8, attention_mask=padded[:, :4]),
                     lambda: autoencoder.decode_logits(latents, 8, cache=DynamicCache())):
            with pytest.raises(ValueError, match="keep_ratio < 1 takes whole unpadded rows without a cache"):
                call()
        # A mask without padding is no padding: the same latents as without a mask.
        torch.testing.assert_close(autoencoder.encode(ids, torch.ones_like(ids)), autoencoder.encode(ids), rtol=0,
                                   atol=0)
        with pytest.raises(ValueError, match="do not decode to length"):
            autoencoder.decode_logits(latents, 12)  # 4 slots at 0.5 are 8 tokens, not 12
        with pytest.raises(ValueError, match="do not decode to length"):
            autoencoder.decode_logits(latents)  # the length cannot be guessed


def test_a_denoiser_refuses_a_compressed_autoencoder_by_name():
    """keep_ratio < 1 trains and reports as an autoencoder on its own; a denoiser (training and generate) needs one
    latent per token, so the config refuses it before anything runs."""
    with pytest.raises(ValueError, match="keep_ratio 1"):
        make_aurora(autoencoder=make_autoencoder(keep_ratio=0.5))


def test_the_residual_copy_path_starts_each_query_from_its_own_item():
    """With zero learned queries and no layers' effect on the first query state, the residual start is item i
    itself: slot i of a stack whose layers are switched off is norm(E[w_i]); and keep_ratio < 1 is refused."""
    autoencoder = make_autoencoder(query_residual=True).eval()
    ids = tokens(1, 7, seed=2)
    with torch.no_grad():
        for layer in autoencoder.encoder.layers:  # a layer whose sub-blocks add nothing passes its input through
            for param in layer.parameters():
                param.zero_()
            for name, module in layer.named_modules():
                if "norm" in name and hasattr(module, "weight"):
                    module.weight.fill_(1.0)
        slots = autoencoder.encode(ids)
        embeds = autoencoder.get_input_embeddings()(ids)
        torch.testing.assert_close(slots, autoencoder.encoder.norm(embeds), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="query_residual needs keep_ratio 1"):
        AuroraAutoencoderConfig(**AE_KW, keep_ratio=0.5, query_residual=True)


@pytest.mark.parametrize("residual", [False, True])
def test_left_padded_rows_encode_and_decode_as_alone(residual):
    """keep_ratio 1: encode and decode_logits of left-padded rows equal each row alone, whatever the padded
    positions' latents hold (garbage there changes nothing)."""
    autoencoder = make_autoencoder(randomize=True, initializer_range=0.2, query_residual=residual).eval()
    rows = [tokens(1, n, seed=n)[0] for n in (5, 11, 3)]
    ids, mask = lf.left_padded(rows)
    with torch.no_grad():
        latents = autoencoder.encode(ids, mask)
        garbage = torch.where(mask.bool()[..., None], latents, 100 * torch.randn_like(latents))
        logits = autoencoder.decode_logits(garbage, attention_mask=mask)
        for b, row in enumerate(rows):
            n = row.numel()
            alone = autoencoder.encode(row[None])
            torch.testing.assert_close(latents[b, -n:], alone[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(logits[b, -n:], autoencoder.decode_logits(alone)[0], atol=1e-5, rtol=1e-4)


def test_logits_are_the_decoder_states_times_the_token_embedding():
    """o_j = h_j·Eᵀ with E the encoder's input embedding (no separate output matrix): checked by a matmul of the
    decoder's captured states, and by changing E, which changes the encoder and the logits alike."""
    autoencoder = make_autoencoder(randomize=True).eval()
    assert autoencoder.get_output_embeddings() is None
    assert [n for n, p in autoencoder.named_parameters() if p.shape == (VOCAB, D)] == ["embed_tokens.weight"]
    states = []
    hook = autoencoder.decoder.register_forward_hook(lambda module, args, out: states.append(out))
    latents = torch.randn(2, 7, D)
    try:
        with torch.no_grad():
            logits = autoencoder.decode_logits(latents)
            torch.testing.assert_close(logits, states[-1] @ autoencoder.embed_tokens.weight.T, atol=1e-5, rtol=1e-5)
            autoencoder.embed_tokens.weight.mul_(-2.0)
            scaled = autoencoder.decode_logits(latents)
    finally:
        hook.remove()
    torch.testing.assert_close(scaled, -2.0 * logits, atol=1e-5, rtol=1e-5)


def test_dropouts_act_in_training_only_whole_tokens_and_unscaled_coordinates():
    """Eval: no dropout (repeatable, and equal to the undropped maps). Training: the encoder receives each token's
    embedding either whole or all zeros, about 30% zeroed; the decoder receives each latent coordinate either as
    given (no 1/(1−p) rescaling) or zero, about 60% zeroed."""
    autoencoder = make_autoencoder(randomize=True, token_dropout=0.3, latent_dropout=0.6)
    ids = tokens(64, 24, seed=1)
    latents = torch.randn(64, 24, D, generator=torch.Generator().manual_seed(2))
    received = {}
    hooks = [autoencoder.encoder.register_forward_pre_hook(lambda m, args: received.__setitem__("embeds", args[0])),
             autoencoder.decoder.register_forward_pre_hook(lambda m, args: received.__setitem__("latents", args[0]))]
    try:
        with torch.no_grad():
            embeds = autoencoder.embed_tokens(ids)
            autoencoder.eval()
            encoded, decoded = autoencoder.encode(ids), autoencoder.decode_logits(latents)
            assert torch.equal(received["embeds"], embeds) and torch.equal(received["latents"], latents)
            assert torch.equal(autoencoder.encode(ids), encoded)
            assert torch.equal(autoencoder.decode_logits(latents), decoded)

            autoencoder.train()
            torch.manual_seed(0)
            autoencoder.encode(ids)
            seen = received["embeds"]
            kept = (seen == embeds).all(-1)
            zeroed = (seen == 0).all(-1)
            assert bool((kept ^ zeroed).all()), "a token embedding was partly zeroed or changed"
            assert float(zeroed.float().mean()) == pytest.approx(0.3, abs=0.05)

            autoencoder.decode_logits(latents)
            seen = received["latents"]
            kept, zeroed = seen == latents, seen == 0
            assert bool((kept ^ zeroed).all()), "a kept latent coordinate was rescaled"
            assert float(zeroed.float().mean()) == pytest.approx(0.6, abs=0.02)
    finally:
        for hook in hooks:
            hook.remove()


def test_without_dropout_training_and_eval_outputs_are_equal():
    autoencoder = make_autoencoder(randomize=True, token_dropout=0.0, latent_dropout=0.0)
    ids = tokens(2, 9)
    with torch.no_grad():
        trained = autoencoder.train()(input_ids=ids, labels=ids)
        evaluated = autoencoder.eval()(input_ids=ids, labels=ids)
    assert torch.equal(trained.logits, evaluated.logits) and torch.equal(trained.loss, evaluated.loss)
    # ... while the default rates do change the training output.
    dropping = make_autoencoder(randomize=True)
    with torch.no_grad():
        assert not torch.equal(dropping.train()(input_ids=ids, labels=ids).logits, evaluated.logits)


@pytest.mark.parametrize("keep_ratio", [1.0, 0.5])
def test_autoencoder_records_its_encoder_queries_and_the_denoiser_records_only_its_own(keep_ratio):
    """Alone, the autoencoder records its encoder's query states as an encoder's hidden states (layers + 1 of them,
    N slots each, the last its latents) and one eager attention map per layer over the whole stream; inside AURORA
    the recorded states are the denoiser's only (of another depth here, so a leak would change the count)."""
    autoencoder = make_autoencoder(randomize=True, num_hidden_layers=2, keep_ratio=keep_ratio,
                                   query_residual=keep_ratio == 1).eval()
    ids = tokens(2, 8)
    slots = 8 if keep_ratio == 1 else 4
    out = autoencoder(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3 and all(h.shape == (2, slots, D) for h in out.hidden_states)
    start = autoencoder.encoder.query + (autoencoder.get_input_embeddings()(ids) if keep_ratio == 1 else 0)
    torch.testing.assert_close(out.hidden_states[0], start.expand(2, slots, D))  # the queries' start
    torch.testing.assert_close(out.hidden_states[-1], out.latents)
    assert not torch.equal(out.hidden_states[1], out.hidden_states[2])
    assert autoencoder(ids).hidden_states is None
    autoencoder.set_attn_implementation("eager")
    probs = autoencoder(ids, labels=ids, output_attentions=True).attentions
    stream = 16 if keep_ratio == 1 else 12
    assert len(probs) == 2 and probs[0].shape == (2, 2, stream, stream)
    torch.testing.assert_close(probs[0].sum(-1), torch.ones(2, 2, stream))

    model = make_aurora(autoencoder=autoencoder if keep_ratio == 1 else None).eval()  # 1 denoiser layer
    model.set_attn_implementation("eager")
    prior = model(input_ids=ids, output_hidden_states=True, output_attentions=True)
    assert len(prior.hidden_states) == 2 and len(prior.attentions) == 1
    for config in (model.config, model.config.autoencoder_config):  # asked through every config: the same
        config.output_hidden_states = config.output_attentions = True
    by_config = model(input_ids=ids)
    assert len(by_config.hidden_states) == 2 and len(by_config.attentions) == 1
    # The recorded query states are those the latents are computed from: a gradient reaches each of them.
    autoencoder.set_attn_implementation("sdpa")
    states = autoencoder(ids, output_hidden_states=True).hidden_states
    grads = torch.autograd.grad(states[-1].sum(), states[:-1])
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


# ====================================================================================================================
# Standardisation
# ====================================================================================================================

def test_latent_statistics_standardise_the_valid_positions_and_invert():
    autoencoder = make_autoencoder()
    generator = torch.Generator().manual_seed(0)
    latents = 3.0 * torch.randn(4, 10, D, generator=generator) + torch.linspace(-5, 5, D)
    valid = torch.ones(4, 10, dtype=torch.bool)
    valid[1, 7:], valid[3, 4:] = False, False
    latents[~valid] = 1e3  # padding: must not enter the statistics
    autoencoder.set_latent_statistics(latents, valid)
    assert bool(autoencoder.has_latent_statistics)
    standard = autoencoder.standardize(latents)[valid]
    torch.testing.assert_close(standard.mean(0), torch.zeros(D), atol=1e-5, rtol=0)
    torch.testing.assert_close(standard.var(0, unbiased=False), torch.ones(D), atol=1e-4, rtol=0)
    torch.testing.assert_close(autoencoder.unstandardize(autoencoder.standardize(latents)), latents, atol=1e-3,
                               rtol=1e-5)
    single = torch.zeros(4, 10, dtype=torch.bool)
    single[2, 3] = True
    with pytest.raises(ValueError, match="at least two"):
        autoencoder.set_latent_statistics(latents, single)


def test_first_training_batch_sets_the_statistics_once_over_real_positions():
    """They are the per-channel mean and (biased) variance of the eval encoder's latents at the first training
    batch's real positions (right padding excluded), computed by hand; an eval forward sets nothing, and a second
    training batch changes nothing."""
    model = make_aurora()
    autoencoder = model.model.autoencoder
    ids = tokens(3, 10, seed=1)
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4, [1] * 8 + [0] * 2])
    ids = torch.where(mask.bool(), ids, 1)
    model.eval()
    model(input_ids=ids, labels=ids, attention_mask=mask)
    assert not bool(autoencoder.has_latent_statistics)
    with torch.no_grad():
        raw = autoencoder.encode(ids, mask)
    vectors = torch.stack([raw[b, i] for b in range(3) for i in range(10) if mask[b, i]])
    assert vectors.shape[0] == 24
    model.train()
    model(input_ids=ids, labels=ids, attention_mask=mask)
    assert bool(autoencoder.has_latent_statistics)
    torch.testing.assert_close(autoencoder.latent_mean, vectors.mean(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(autoencoder.latent_var, vectors.var(0, unbiased=False), atol=1e-5, rtol=1e-5)
    mean, var = autoencoder.latent_mean.clone(), autoencoder.latent_var.clone()
    model(input_ids=tokens(3, 10, seed=2), labels=tokens(3, 10, seed=2))
    assert torch.equal(autoencoder.latent_mean, mean) and torch.equal(autoencoder.latent_var, var)


def test_prepare_training_estimates_the_statistics_from_the_first_rows_in_eval_mode():
    """`prepare_training` (called by the training loop before step 0) sets the statistics to the mean / variance of
    the eval encoder's latents over the first 64 rows, batched or not; a model that has them keeps them."""
    model = make_aurora(autoencoder=make_autoencoder(randomize=True, token_dropout=0.5, latent_dropout=0.5))
    autoencoder = model.model.autoencoder
    rows = tokens(70, 9, seed=3)
    model.prepare_training(rows)
    with torch.no_grad():
        autoencoder.eval()
        vectors = torch.cat([autoencoder.encode(rows[i:i + 1]) for i in range(64)]).reshape(-1, D)
    assert bool(autoencoder.has_latent_statistics)
    torch.testing.assert_close(autoencoder.latent_mean, vectors.mean(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(autoencoder.latent_var, vectors.var(0, unbiased=False), atol=1e-5, rtol=1e-5)
    mean = autoencoder.latent_mean.clone()
    model.prepare_training(tokens(70, 9, seed=4))
    assert torch.equal(autoencoder.latent_mean, mean)
    with pytest.raises(ValueError, match="token rows"):
        model.estimate_latent_statistics(tokens(0, 9))


def test_an_adapter_fine_tune_refuses_to_set_missing_statistics():
    """An adapter does not carry buffers: statistics set inside a LoRA fine-tune would be lost on reload."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_aurora(), LoraConfig(target_modules=r"model\.denoiser\.layers\.\d+\.self_attn\.q_proj",
                                                     r=2))
    model.train()
    ids = tokens(2, 8)
    with pytest.raises(ValueError, match="estimate_latent_statistics"):
        model(input_ids=ids, labels=ids)


def test_a_freshly_built_model_keeps_its_frozen_autoencoder_out_of_dropout():
    model = make_aurora()
    assert model.training
    assert not model.model.autoencoder.training and not model.ema_denoiser.training
    ids = tokens(2, 8)
    # Token dropout would make two encodings of the same input differ.
    torch.testing.assert_close(model.model.autoencoder.encode(ids), model.model.autoencoder.encode(ids))


def test_statistics_ema_and_step_count_survive_save_and_load(tmp_path):
    model = make_aurora(consistency_warmup_steps=2).train()
    ids = tokens(2, 8)
    model(input_ids=ids, labels=ids)  # sets the statistics
    with torch.no_grad():
        for param in model.model.denoiser.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.on_optimizer_step()
    model.on_optimizer_step()
    model.save_pretrained(tmp_path)
    loaded = AuroraForCausalLM.from_pretrained(tmp_path)
    saved, restored = model.state_dict(), loaded.state_dict()
    assert set(saved) == set(restored)
    for name in ("model.autoencoder.latent_mean", "model.autoencoder.latent_var",
                 "model.autoencoder.has_latent_statistics", "optimizer_steps"):
        assert torch.equal(restored[name], saved[name]), name
    assert int(loaded.optimizer_steps) == 2 and bool(loaded.model.autoencoder.has_latent_statistics)
    ema = {n: p for n, p in saved.items() if n.startswith("ema_denoiser.")}
    assert ema
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name
    # The EMA copy lags the online denoiser, and loading must not have re-copied the online weights into it.
    lag = max((loaded.ema_denoiser.state_dict()[n] - p).abs().max().item()
              for n, p in loaded.model.denoiser.state_dict().items())
    assert lag > 1e-3
    assert not any(p.requires_grad for p in loaded.model.autoencoder.parameters())
    assert not any(p.requires_grad for p in loaded.ema_denoiser.parameters())
    assert all(p.requires_grad for p in loaded.model.denoiser.parameters())
    # The loaded model does not re-estimate the statistics from its next training batch, and λ_ct continues.
    loaded.train()
    out = loaded(input_ids=tokens(2, 8, seed=7), labels=tokens(2, 8, seed=7))
    assert torch.equal(loaded.model.autoencoder.latent_mean, saved["model.autoencoder.latent_mean"])
    assert float(out.consistency_weight) == pytest.approx(loaded.config.consistency_weight)


# ====================================================================================================================
# Denoiser inputs
# ====================================================================================================================

def test_noisy_input_bottleneck_structure():
    squeezed = make_aurora(noisy_input_rank=RANK).model.denoiser.noisy_in
    assert isinstance(squeezed, nn.Sequential) and len(squeezed) == 2
    down, up = squeezed
    assert (down.in_features, down.out_features, down.bias) == (D, RANK, None)
    assert (up.in_features, up.out_features) == (RANK, 32)
    full = make_aurora(noisy_input_rank=None).model.denoiser
    assert isinstance(full.noisy_in, nn.Linear) and (full.noisy_in.in_features, full.noisy_in.out_features) == (D, 32)
    assert full.noisy_in is not full.clean_in


@pytest.mark.parametrize("rank", [RANK, None])
def test_only_noisy_positions_take_the_noisy_path(rank):
    """Through the base model on standardised latents, clean block 0 and noisy block 1: the first layer receives
    W_up·W_down·x (+ bias) at the noisy positions and the clean map at the others, plus the additive timestep, by
    hand; perturbing the noisy path's weights changes the noisy block's states and leaves the clean block's exactly."""
    model = make_aurora(noisy_input_rank=rank).eval()
    denoiser = model.model.denoiser
    latents = torch.randn(2, 2 * Q, D, generator=torch.Generator().manual_seed(0))
    noisy = (torch.arange(2 * Q) >= Q)[None].expand(2, -1)
    timesteps = torch.where(noisy, torch.tensor([[0.7], [0.3]]), 0.0)
    received = []
    hook = denoiser.layers[0].register_forward_pre_hook(lambda m, args: received.append(args[0]))
    try:
        with torch.no_grad():
            base = model.model(latents=latents, timesteps=timesteps, noisy=noisy).last_hidden_state
            if rank is None:
                noisy_map = latents @ denoiser.noisy_in.weight.T + denoiser.noisy_in.bias
            else:
                down, up = denoiser.noisy_in
                noisy_map = (latents @ down.weight.T) @ up.weight.T + up.bias
            clean_map = latents @ denoiser.clean_in.weight.T + denoiser.clean_in.bias
            time = denoiser.time_proj[0](denoiser.time_embedding(timesteps))
            expected = torch.where(noisy[..., None], noisy_map, clean_map) + time
            torch.testing.assert_close(received[0], expected, atol=1e-5, rtol=1e-5)
            for param in denoiser.noisy_in.parameters():
                param.add_(0.1 * torch.randn_like(param))
            after = model.model(latents=latents, timesteps=timesteps, noisy=noisy).last_hidden_state
    finally:
        hook.remove()
    assert torch.equal(after[:, :Q], base[:, :Q])
    assert bool(((after[:, Q:] - base[:, Q:]).abs().amax(-1) > 1e-4).all())


# ====================================================================================================================
# Training objective
# ====================================================================================================================

def test_objective_parts_are_scalars_and_the_weight_ramps():
    """loss = denoising + λ_ct·consistency with λ_ct = consistency_weight·min(1, k / warmup) after k optimizer
    steps (0 before the first)."""
    model = make_aurora(consistency_weight=0.5, consistency_warmup_steps=3).train()
    ids = tokens(2, 10)
    weights = []
    for k in range(6):
        out = model(input_ids=ids, labels=ids)
        parts = dict(denoising=out.denoising_loss, consistency=out.consistency_loss, weight=out.consistency_weight)
        assert out.loss.dim() == 0 and out.loss.requires_grad
        assert all(v.dim() == 0 and not v.requires_grad for v in parts.values())
        assert float(parts["denoising"]) > 0 and float(parts["consistency"]) > 0
        weights.append(float(parts["weight"]))
        assert float(out.loss.detach()) == pytest.approx(float(parts["denoising"])
                                                         + weights[-1] * float(parts["consistency"]), rel=1e-6)
        model.on_optimizer_step()
    assert weights == pytest.approx([0.0, 0.5 / 3, 1.0 / 3, 0.5, 0.5, 0.5])
    assert int(model.optimizer_steps) == 6
    immediate = make_aurora(consistency_weight=0.5, consistency_warmup_steps=0).train()
    assert float(immediate(input_ids=ids, labels=ids).consistency_weight) == 0.5
    # Evaluation scores the denoising loss only: no consistency term, even with an EMA copy.
    evaluated = model.eval()(input_ids=ids, labels=ids)
    assert evaluated.consistency_loss is None and evaluated.consistency_weight is None
    assert torch.equal(evaluated.loss, evaluated.denoising_loss)


@pytest.mark.parametrize("sigma", [0.3, 0.02])  # 0.02 is below velocity_min_sigma 0.05: the floor applies
def test_velocity_space_loss_is_the_x0_loss_over_sigma_squared(monkeypatch, sigma):
    monkeypatch.setattr(modeling_aurora, "make_time_sampler", lambda kind, **kwargs: ConstantSigma(sigma))
    model = make_aurora(self_condition_prob=0.0, consistency_weight=0.0, prompt_block_prob=0.0,
                        history_dropout=0.3).train()
    ids = tokens(2, 10)
    losses = {}
    for space in ("x0", "velocity"):
        model.config.loss_space = space
        torch.manual_seed(3)
        losses[space] = float(model(input_ids=ids, labels=ids).denoising_loss)
    assert losses["x0"] > 0
    floor = max(sigma, model.config.velocity_min_sigma)
    assert losses["velocity"] == pytest.approx(losses["x0"] / floor**2, rel=1e-5)


def test_noisy_stream_is_the_straight_path_from_the_clean_latents_to_the_drawn_noise(monkeypatch):
    """σ = 0.3 everywhere and the noise ε fixed (torch.randn_like of the latents' shape returns a known tensor): the
    main pass's noisy stream is exactly (1 − σ)·z + σ·ε of its clean stream z, at time σ, and its target is z."""
    sigma = 0.3
    monkeypatch.setattr(modeling_aurora, "make_time_sampler", lambda kind, **kwargs: ConstantSigma(sigma))
    model = make_aurora(self_condition_prob=0.0, consistency_weight=0.0, prompt_block_prob=0.0).train()
    ids, length = tokens(2, 8, seed=9), 8
    noise = torch.randn(2, length, D, generator=torch.Generator().manual_seed(1))
    randn_like = torch.randn_like
    monkeypatch.setattr(torch, "randn_like", lambda t, **kw: noise.clone() if t.shape == noise.shape
                        else randn_like(t, **kw))
    spy = DenoiserSpy(monkeypatch, model.model.denoiser)
    out = model(input_ids=ids, labels=ids)
    call = spy.calls[0]
    z, x = call["latents"][:, :length], call["latents"][:, length:]
    torch.testing.assert_close(x, (1 - sigma) * z + sigma * noise, atol=1e-6, rtol=1e-5)
    assert bool((call["timesteps"][:, length:] == sigma).all()) and not call["timesteps"][:, :length].any()
    expected = scored_mean((call["x0"][:, length:] - z).pow(2).mean(-1), torch.ones(2, length, dtype=torch.bool))
    assert float(out.denoising_loss) == pytest.approx(float(expected), rel=1e-5)


def test_consistency_term_gradient_is_its_closed_form_through_the_online_prediction(monkeypatch):
    """Gradients, not only values: λ_ct = 0.7 against λ_ct = 0 on the same draws, the difference of the loss's
    gradients with respect to the online x0 head's output is λ_ct·2(ẑ − target)/(D·n) at the n scored positions
    (the target, recorded from `consistency_target`, a constant) and 0 on the clean stream."""
    monkeypatch.setattr(modeling_aurora, "make_time_sampler", lambda kind, **kwargs: ConstantSigma(0.6))
    model = make_aurora(self_condition_prob=0.0, prompt_block_prob=0.0, consistency_weight=0.7,
                        consistency_warmup_steps=0).train()
    ids, length = tokens(2, 8, seed=11), 8
    targets, heads = [], []
    consistency_target = model.consistency_target
    monkeypatch.setattr(model, "consistency_target", lambda *a: targets.append(consistency_target(*a)) or targets[-1])

    def keep(module, args, out):
        if out.requires_grad:
            out.retain_grad()
            heads.append(out)

    hook = model.model.denoiser.x0_head.register_forward_hook(keep)
    grads = {}
    try:
        for weight in (0.7, 0.0):
            model.config.consistency_weight = weight
            heads.clear()
            torch.manual_seed(4)
            model(input_ids=ids, labels=ids).loss.backward()
            (head,) = heads
            grads[weight] = head.grad.clone()
            x0 = head.detach()[:, length:].float()
    finally:
        hook.remove()
        model.config.consistency_weight = 0.7
    torch.testing.assert_close(targets[0], targets[1])
    difference = grads[0.7] - grads[0.0]
    expected = 0.7 * 2 * (x0 - targets[0]) / (D * 2 * length)
    torch.testing.assert_close(difference[:, length:], expected, atol=1e-7, rtol=1e-4)
    assert not difference[:, :length].any() and expected.abs().max() > 1e-5


@pytest.mark.parametrize("decay", [0.9999, 0.1])
def test_ema_moves_by_the_warmed_up_decay(decay):
    """After the n-th step: ema = d·ema + (1 − d)·online, d = min(ema_decay, (1 + n)/(10 + n))."""
    model = make_aurora(ema_decay=decay)
    online, ema = model.model.denoiser, model.ema_denoiser
    for name, value in online.state_dict().items():
        assert torch.equal(ema.state_dict()[name], value), name  # the copy starts as the denoiser
    for n in (1, 2):
        with torch.no_grad():
            for param in online.parameters():
                param.add_(0.1 * torch.randn_like(param))
        before = {k: v.clone() for k, v in ema.named_parameters()}
        model.on_optimizer_step()
        d = min(decay, (1 + n) / (10 + n))
        assert int(model.optimizer_steps) == n
        for name, param in online.named_parameters():
            expected = d * before[name] + (1 - d) * param
            torch.testing.assert_close(dict(ema.named_parameters())[name], expected, atol=1e-6, rtol=1e-6, msg=name)


def test_ema_and_autoencoder_never_get_gradients():
    model = make_aurora(self_condition_prob=1.0, consistency_warmup_steps=0).train()
    ids = tokens(2, 10)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in model.ema_denoiser.parameters())
    assert all(p.grad is None and not p.requires_grad for p in model.model.autoencoder.parameters())
    assert model.model.denoiser.x0_head.weight.grad is not None
    assert model.model.denoiser.self_condition_proj[0].weight.grad.abs().sum() > 0


def test_no_consistency_weight_means_no_ema_copy():
    model = make_aurora(consistency_weight=0.0).train()
    assert model.ema_denoiser is None
    assert not any(k.startswith("ema_denoiser.") for k in model.state_dict())
    model.on_optimizer_step()
    assert int(model.optimizer_steps) == 1
    ids = tokens(2, 10)
    out = model(input_ids=ids, labels=ids)
    assert out.consistency_loss is None and out.consistency_weight is None
    assert torch.equal(out.loss.detach(), out.denoising_loss)


def previous_on_grid(sigma: float, steps: int) -> float:
    """The largest point k/S of the uniform grid strictly below σ (0 at or below 1/S), by a loop."""
    below = [k / steps for k in range(steps + 1) if k / steps < sigma]
    return max(below)


@pytest.mark.parametrize("self_condition_prob,prompt_block_prob", [(0.0, 0.0), (1.0, 0.0), (0.0, 0.99)])
def test_consistency_target_is_the_ema_at_the_previous_grid_point(monkeypatch, self_condition_prob,
                                                                  prompt_block_prob):
    """Replay from both denoisers' inputs: the EMA sees the clean stream unchanged and, on the noisy stream, σ' =
    Prev_S(σ) (a loop over the grid, and flow's previous_timestep) with x̃ = (σ'/σ)·x + (1 − σ'/σ)·ẑ from the online
    pass's own x and ẑ (clean leading positions: σ' = 0 and x̃ = x); its draft is the online prediction when the
    model self-conditions. The consistency loss is ‖ẑ − ẑ_EMA‖² over the scored positions."""
    steps, length = 4, 10
    model = make_aurora(self_condition_prob=self_condition_prob, prompt_block_prob=prompt_block_prob,
                        consistency_steps=steps, consistency_warmup_steps=0, history_dropout=0.0).train()
    with torch.no_grad():  # an EMA copy that differs from the online denoiser
        for param in model.ema_denoiser.parameters():
            param.add_(0.05 * torch.randn_like(param))
    online, ema = DenoiserSpy(monkeypatch, model.model.denoiser), DenoiserSpy(monkeypatch, model.ema_denoiser)
    ids = tokens(3, length)
    labels = ids.clone()
    labels[0, 2] = -100
    torch.manual_seed(0)
    out = model(input_ids=ids, labels=labels)
    assert len(online.calls) == (2 if self_condition_prob else 1) and len(ema.calls) == 1
    main, target = online.calls[-1], ema.calls[0]
    sigma = main["timesteps"][:, length:]
    assert not main["timesteps"][:, :length].any() and not target["timesteps"][:, :length].any()
    clean_lead = sigma == 0
    assert bool(clean_lead.any()) == (prompt_block_prob > 0)
    by_loop = torch.tensor([[previous_on_grid(float(s), steps) if s > 0 else 0.0 for s in row] for row in sigma])
    previous = target["timesteps"][:, length:]
    torch.testing.assert_close(previous, by_loop, atol=1e-6, rtol=0)
    grid = FlowMatchEulerSampler(steps)
    torch.testing.assert_close(previous[~clean_lead], grid.previous_timestep(sigma[~clean_lead]), atol=0, rtol=0)
    assert bool((previous[~clean_lead] < sigma[~clean_lead]).all()) and not previous[clean_lead].any()

    torch.testing.assert_close(target["latents"][:, :length], main["latents"][:, :length], atol=0, rtol=0)
    x, x0 = main["latents"][:, length:], main["x0"][:, length:]
    ratio = (by_loop / torch.where(clean_lead, 1.0, sigma))[..., None]
    expected = torch.where(clean_lead[..., None], x, ratio * x + (1 - ratio) * x0)
    torch.testing.assert_close(target["latents"][:, length:], expected, atol=1e-5, rtol=1e-5)
    if self_condition_prob:
        assert not target["self_condition"][:, :length].any()
        torch.testing.assert_close(target["self_condition"][:, length:], x0, atol=1e-6, rtol=1e-6)
    else:
        assert target["self_condition"] is None
    scored = (labels != -100) & ~clean_lead
    consistency = scored_mean((x0 - target["x0"][:, length:]).pow(2).mean(-1), scored)
    assert float(out.consistency_loss) == pytest.approx(float(consistency), rel=1e-5)


def test_self_conditioning_draft_is_the_first_passs_prediction(monkeypatch):
    assert make_aurora(self_condition_prob=0.0).model.denoiser.self_condition_proj is None
    model = make_aurora(self_condition_prob=1.0, consistency_weight=0.0).train()
    spy = DenoiserSpy(monkeypatch, model.model.denoiser)
    ids, length = tokens(2, 10), 10
    model(input_ids=ids, labels=ids)
    first, main = spy.calls
    assert not first["hidden"].requires_grad and main["hidden"].requires_grad  # the draft pass has no gradient
    assert not first["self_condition"].any()
    assert not main["self_condition"][:, :length].any()  # the clean stream never has a draft
    draft = main["self_condition"][:, length:]
    assert draft.abs().amin(-1).gt(0).all()
    torch.testing.assert_close(draft, first["x0"][:, length:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(main["latents"], first["latents"], atol=0, rtol=0)

    # p = 0.5: each row's draft is either zeros or its first-pass prediction, and both happen.
    model = make_aurora(self_condition_prob=0.5, consistency_weight=0.0).train()
    spy = DenoiserSpy(monkeypatch, model.model.denoiser)
    torch.manual_seed(1)
    model(input_ids=tokens(12, 6), labels=tokens(12, 6))
    first, main = spy.calls
    kinds = []
    for b in range(12):
        row = main["self_condition"][b, 6:]
        kinds.append("none" if not row.any() else "draft")
        if row.any():
            torch.testing.assert_close(row, first["x0"][b, 6:], atol=1e-6, rtol=1e-6)
    assert set(kinds) == {"none", "draft"}
    # Eval: one pass with a zero draft.
    spy.calls.clear()
    model.eval()
    model(input_ids=tokens(2, 6), labels=tokens(2, 6))
    assert len(spy.calls) == 1 and not spy.calls[0]["self_condition"].any()


def test_denoising_targets_are_the_latents_standardised_with_the_stored_statistics(monkeypatch):
    """Statistics far from (0, 1) per channel (means −2..2, variances 4..0.25): the clean stream the denoiser
    receives in training is (z_enc − μ)/√(var + ε) of the frozen encoder's latents (hand formula, real positions),
    and the denoising loss is measured against exactly that z, not the raw latents."""
    model = make_aurora(self_condition_prob=0.0, consistency_warmup_steps=0, prompt_block_prob=0.0).train()
    autoencoder = model.model.autoencoder
    mean, var = torch.linspace(-2.0, 2.0, D), torch.linspace(0.25, 4.0, D).flip(0)
    autoencoder.set_latent_statistics(torch.stack([mean - var.sqrt(), mean + var.sqrt()])[None])
    torch.testing.assert_close(autoencoder.latent_mean, mean)
    torch.testing.assert_close(autoencoder.latent_var, var)
    spy = DenoiserSpy(monkeypatch, model.model.denoiser)
    length = 10
    ids = tokens(2, length, seed=6)
    mask = torch.tensor([[1] * length, [1] * 7 + [0] * 3])
    out = model(input_ids=ids, labels=ids, attention_mask=mask)
    with torch.no_grad():
        raw = autoencoder.encode(ids, mask)
    z = (raw - mean) / torch.sqrt(var + autoencoder.config.statistics_eps)
    call = spy.calls[0]
    clean, x0 = call["latents"][:, :length], call["x0"][:, length:]
    real = mask.bool()
    torch.testing.assert_close(clean[real], z[real], atol=1e-5, rtol=1e-5)
    assert float(out.denoising_loss) == pytest.approx(float(scored_mean((x0 - z).pow(2).mean(-1), real)), rel=1e-5)


def test_denoising_loss_scores_only_labelled_real_positions(monkeypatch):
    """Replay from the main pass's inputs: mean over channels of (ẑ − z)², averaged over positions whose label is
    not −100 and that are not right padding (a Python loop); masking labels changes the loss; nothing scored gives
    0 (not NaN); left padding is refused."""
    model = make_aurora(self_condition_prob=0.0, consistency_warmup_steps=0, prompt_block_prob=0.0).train()
    spy = DenoiserSpy(monkeypatch, model.model.denoiser)
    length = 10
    ids = tokens(2, length, seed=4)
    mask = torch.tensor([[1] * length, [1] * 7 + [0] * 3])
    labels = ids.clone()
    labels[0, [1, 5]] = -100
    losses = {}
    for name, lab in (("all", ids), ("masked", labels)):
        spy.calls.clear()
        torch.manual_seed(5)
        out = model(input_ids=ids, labels=lab, attention_mask=mask)
        call = spy.calls[0]
        z, x0 = call["latents"][:, :length], call["x0"][:, length:]
        scored = (lab != -100) & mask.bool()
        expected = scored_mean((x0 - z).pow(2).mean(-1), scored)
        assert float(out.denoising_loss) == pytest.approx(float(expected), rel=1e-5)
        losses[name] = float(out.denoising_loss)
    assert losses["all"] != pytest.approx(losses["masked"], rel=1e-4)
    nothing = model(input_ids=ids, labels=torch.full_like(ids, -100), attention_mask=mask)
    assert float(nothing.denoising_loss) == 0 and float(nothing.consistency_loss) == 0
    assert torch.isfinite(nothing.loss) and float(nothing.loss.detach()) == 0
    left = mask.flip(1)
    with pytest.raises(ValueError, match="right padding"):
        model(input_ids=ids, labels=ids, attention_mask=left)


# ====================================================================================================================
# generate()
# ====================================================================================================================

@pytest.fixture(scope="module")
def generator_model():
    """A tiny AURORA with self-conditioning and latent statistics of its own (so standardising changes latents)."""
    model = make_aurora(seed=3).eval()
    with torch.no_grad():
        autoencoder = model.model.autoencoder
        autoencoder.set_latent_statistics(autoencoder.encode(tokens(4, 12, seed=30)))
    assert autoencoder.latent_var.sub(1).abs().max() > 0.1 or autoencoder.latent_mean.abs().max() > 0.1
    return model


def expected_calls(prompt_length: int, max_new: int, steps: int, sc_guidance: float, guidance: float,
                   cfg_min_sigma: float, self_conditioning: bool = True) -> dict[str, int]:
    """Hand count for one row: 1 encoder pass; a denoiser and a decoder pass over the prompt's complete blocks (if
    any); per generated block: a denoiser pass appending the previous block (from the second block on), and per
    Euler step σ = 1 − k/S one aware evaluation, one blind from the second step (SC-CFG on, with a draft), one
    unconditional while σ ≥ cfg_min_sigma (prompt CFG on, the row has history); one decoder pass."""
    complete, known = divmod(prompt_length, Q)
    blocks = 1 + max(0, -(-(max_new - (Q - known)) // Q))
    denoiser = int(complete > 0)
    for b in range(blocks):
        history = complete > 0 or b > 0
        denoiser += int(b > 0)
        for k in range(steps):
            denoiser += 1
            denoiser += int(self_conditioning and sc_guidance != 1 and k > 0)
            denoiser += int(guidance != 1 and history and 1 - k / steps >= cfg_min_sigma)
    return {"ae_encoder": 1, "denoiser": denoiser, "ae_decoder": int(complete > 0) + blocks}


@pytest.mark.parametrize("prompt_length,max_new", [(3, 6), (8, 5), (6, 7)])  # no history / whole blocks / mid-block
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("sc_guidance", [1.0, 4.0])
@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_calls_by_network_match_a_hand_count_and_the_forward_hooks(generator_model, prompt_length, max_new, steps,
                                                                   sc_guidance, guidance):
    model = generator_model
    cfg_min_sigma = 0.5  # at S = 4: σ = 1, 0.75 and 0.5 (the boundary counts) are guided
    expected = expected_calls(prompt_length, max_new, steps, sc_guidance, guidance, cfg_min_sigma)
    names = dict(zip(("denoiser", "ae_encoder", "ae_decoder"), model.counted_modules()))
    with lf.forward_calls_counted(names) as counted:
        out = model.generate(tokens(1, prompt_length), max_new_tokens=max_new, eos_token_id=None,
                             return_dict_in_generate=True, num_inference_steps=steps,
                             self_condition_guidance=sc_guidance, guidance_scale=guidance,
                             cfg_min_sigma=cfg_min_sigma, noise_seeds=[0])
    lf.assert_calls_match(out, max_new, expected, counted)


def test_generate_defaults_come_from_the_config(generator_model):
    """With no generate() options, the config's (non-default) self_condition_guidance 3, cfg_scale 2.5,
    cfg_min_sigma 0.5 and num_inference_steps 4 are used: the calls per network are their hand count."""
    model = copy.deepcopy(generator_model)
    cfg = model.config
    cfg.self_condition_guidance, cfg.cfg_scale, cfg.cfg_min_sigma, cfg.num_inference_steps = 3.0, 2.5, 0.5, 4
    out = model.generate(tokens(1, 2 * Q, seed=33), max_new_tokens=Q, eos_token_id=None,
                         return_dict_in_generate=True, noise_seeds=[0])
    expected = expected_calls(2 * Q, Q, 4, 3.0, 2.5, 0.5)
    assert {k: v.tolist() for k, v in out.calls_by_network.items()} == {k: [v] for k, v in expected.items()}
    assert expected["denoiser"] == 1 + 4 + 3 + 3  # prefill; aware ×4, blind ×3, unconditional at σ = 1, .75, .5


def test_no_blind_evaluation_without_self_conditioning():
    model = make_aurora(seed=4, self_condition_prob=0.0).eval()
    out = model.generate(tokens(1, 6), max_new_tokens=6, eos_token_id=None, return_dict_in_generate=True,
                         num_inference_steps=4, self_condition_guidance=4.0, guidance_scale=2.0, cfg_min_sigma=0.9,
                         noise_seeds=[0])
    expected = expected_calls(6, 6, 4, 4.0, 2.0, 0.9, self_conditioning=False)
    assert {k: v.tolist() for k, v in out.calls_by_network.items()} == {k: [v] for k, v in expected.items()}


def test_prompt_guidance_is_skipped_exactly_for_a_row_without_history(generator_model):
    """Batched next to a row with history (so the unconditional branch runs), a row shorter than one block gets
    exactly the same first block and tokens at w = 3 as at w = 1; the row with history is guided (differs)."""
    model = generator_model
    short, long = tokens(1, 3, seed=8)[0], tokens(1, 9, seed=9)[0]
    ids, mask = lf.left_padded([short, long])
    results = {}
    with lf.first_inputs_recorded(model.model.autoencoder.decoder) as blocks:
        for w in (1.0, 3.0):
            blocks.clear()
            sequences = model.generate(ids, attention_mask=mask, max_new_tokens=1, eos_token_id=None,
                                       num_inference_steps=3, guidance_scale=w, cfg_min_sigma=0.3,
                                       noise_seeds=[4, 5])
            results[w] = sequences, blocks[-1]  # the generated block (the first decoder call reads the history)
    (plain, plain_block), (guided, guided_block) = results[1.0], results[3.0]
    assert torch.equal(guided_block[0], plain_block[0])
    assert torch.equal(guided[0], plain[0])
    assert (guided_block[1] - plain_block[1]).abs().max() > 1e-4


@pytest.mark.parametrize("draft_mode", ["unguided", "guided"])
def test_sc_cfg_and_prompt_cfg_mix_their_branches_on_rows_with_history(generator_model, monkeypatch, draft_mode):
    """w_sc = 3 and w = 2.5 (neither 0 nor 1), batched rows with and without history, σ grid 1, .75, .5, .25 with
    cfg_min_sigma 0.5: every velocity the solver receives is (x − ẑ)/σ with ẑ_sc = ẑ_blind + 3·(ẑ_aware − ẑ_blind)
    (from the second step on; ẑ_aware alone before) and ẑ = ẑ_uncond + 2.5·(ẑ_sc − ẑ_uncond) on the row with
    history while σ ≥ 0.5, ẑ_sc otherwise. Branches identified by their inputs: aware and blind read the history
    cache (with the previous draft / a zero draft), the unconditional one the block alone (Q × Q, no cache) with the
    aware call's draft. A stub offset per branch makes the three predictions differ. The next step's draft is the
    previous aware prediction ("unguided") or the previous fully guided ẑ ("guided")."""
    from hf_latentlm.modeling.modeling_aurora import AuroraBlockVelocity

    w_sc, w, steps = 3.0, 2.5, 4
    predictions, fields = [], []
    original_predict, original_call = AuroraBlockVelocity.predict, AuroraBlockVelocity.__call__

    def predict(self, x, sigma, mask, draft, cache):
        out = original_predict(self, x, sigma, mask, draft, cache)
        alone, blind = cache is None, not bool(draft.any())
        out = out + (0.3 if alone else 0.0) + (-0.2 if blind else 0.0)  # the branches differ by input
        predictions.append(dict(alone=alone, mask=mask, draft=draft.clone(), out=out.clone()))
        return out

    def call(self, x, sigma):
        start = len(predictions)
        out = original_call(self, x, sigma)
        fields.append((x.clone(), float(sigma), self.has_history.flatten().tolist(), predictions[start:], out.clone()))
        return out

    monkeypatch.setattr(AuroraBlockVelocity, "predict", predict)
    monkeypatch.setattr(AuroraBlockVelocity, "__call__", call)
    ids, mask = lf.left_padded([tokens(1, 9, seed=22)[0], tokens(1, 3, seed=23)[0]])  # history / none
    generator_model.generate(ids, attention_mask=mask, max_new_tokens=1, eos_token_id=None,
                             num_inference_steps=steps, self_condition_guidance=w_sc, guidance_scale=w,
                             cfg_min_sigma=0.5, self_condition_draft=draft_mode, noise_seeds=[8, 9])
    assert [f[1] for f in fields] == [1.0, 0.75, 0.5, 0.25] and all(f[2] == [True, False] for f in fields)
    previous = None
    for k, (x, sigma, _, calls, out) in enumerate(fields):
        conditional = [c for c in calls if not c["alone"]]
        unconditional = [c for c in calls if c["alone"]]
        assert len(conditional) == (1 if k == 0 else 2) and len(unconditional) == int(sigma >= 0.5)
        if k == 0:
            (aware,) = conditional
            z_sc = aware["out"]
        else:
            (aware,) = [c for c in conditional if c["draft"].any()]
            (blind,) = [c for c in conditional if not c["draft"].any()]
            z_sc = blind["out"] + w_sc * (aware["out"] - blind["out"])
        expected = z_sc.clone()
        if unconditional:
            (uncond,) = unconditional
            assert uncond["mask"].shape[-2:] == (Q, Q) and bool(uncond["mask"].all())
            assert torch.equal(uncond["draft"], aware["draft"])
            expected[0] = uncond["out"][0] + w * (z_sc[0] - uncond["out"][0])
        torch.testing.assert_close(out, (x - expected) / sigma, atol=1e-4, rtol=1e-4)
        if previous is not None:
            torch.testing.assert_close(aware["draft"], previous, atol=1e-5, rtol=1e-5)
        previous = expected if draft_mode == "guided" else aware["out"]


def test_generate_standardises_the_prompt_and_unstandardises_before_decoding(generator_model):
    """Per-channel statistics far from (0, 1) (means −2..2, variances 0.25..4): the denoiser receives the prompt's
    clean history as (z − μ)/√(var + ε), and the decoder reads every generated block as x·√(var + ε) + μ of the
    block the solver returned (hand formulas, per channel), and the history as the raw encoder latents."""
    model = copy.deepcopy(generator_model)
    autoencoder = model.model.autoencoder
    eps = autoencoder.config.statistics_eps
    mean, var = torch.linspace(-2.0, 2.0, D), torch.linspace(0.25, 4.0, D).flip(0)
    with torch.no_grad():
        autoencoder.latent_mean.copy_(mean)
        autoencoder.latent_var.copy_(var)
    prompt = tokens(1, 2 * Q, seed=40)
    with torch.no_grad():
        raw = autoencoder.encode(prompt)
    solved, appended = [], []
    denoise, append = model._denoise_block, model._append_to_prior
    model._denoise_block = lambda *args: solved.append(denoise(*args)) or solved[-1]
    model._append_to_prior = lambda latents, *args: appended.append(latents.clone()) or append(latents, *args)
    with lf.first_inputs_recorded(autoencoder.decoder) as decoded:
        model.generate(prompt, max_new_tokens=2 * Q, eos_token_id=None, num_inference_steps=2,
                       self_condition_guidance=1.0, guidance_scale=1.0, noise_seeds=[0])
    assert len(decoded) == 3 and len(solved) == 2
    torch.testing.assert_close(appended[0], (raw - mean) / torch.sqrt(var + eps), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decoded[0], raw, atol=1e-4, rtol=1e-4)
    for block, seen in zip(solved, decoded[1:]):
        torch.testing.assert_close(seen, block.latents * torch.sqrt(var + eps) + mean, atol=1e-5, rtol=1e-5)


def test_repaint_holds_the_prompt_latents_at_time_zero_in_every_call(generator_model, monkeypatch):
    """Prompts of 6 and 5 tokens (known 2 and 1 positions of the first generated block, left padded together):
    every denoiser evaluation of that block (aware, blind and unconditional) sees the prompt's standardised latents
    (computed alone) at the known positions at σ = 0, and the step's σ elsewhere."""
    model = generator_model
    autoencoder = model.model.autoencoder
    rows = [tokens(1, 6, seed=1)[0], tokens(1, 5, seed=2)[0]]
    ids, mask = lf.left_padded(rows)
    with torch.no_grad():
        known = [autoencoder.standardize(autoencoder.encode(r[None]))[0, Q:] for r in rows]
        raw = [autoencoder.encode(r[None])[0, Q:] for r in rows]
    assert (known[0] - raw[0]).abs().max() > 0.1  # standardising matters here
    spy = DenoiserSpy(monkeypatch, model.model.denoiser)
    steps = 3
    model.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None, num_inference_steps=steps,
                   self_condition_guidance=4.0, guidance_scale=2.0, cfg_min_sigma=0.5, noise_seeds=[1, 2])
    block_calls = [c for c in spy.calls if c["noisy"] is not None]
    assert len(block_calls) == expected_calls(6, 2, steps, 4.0, 2.0, 0.5)["denoiser"] - 1  # minus the prefill
    grid = FlowMatchEulerSampler(steps).timesteps[:-1].tolist()
    seen_sigmas = set()
    for call in block_calls:
        for b, clean in enumerate(known):
            k = clean.shape[0]
            torch.testing.assert_close(call["latents"][b, :k], clean, atol=1e-5, rtol=1e-4)
            assert not call["timesteps"][b, :k].any()
            rest = call["timesteps"][b, k:]
            assert bool((rest == rest[0]).all()) and rest[0].item() in grid
            seen_sigmas.add(rest[0].item())
    assert seen_sigmas == set(grid)


def test_timestep_shift_moves_the_solver_grid(generator_model, monkeypatch):
    """timestep_shift = 3 (not the identity 1): the block's denoiser evaluations are exactly at the shifted grid's
    σ = 3t/(1 + 2t), t = 1, 2/3, 1/3, hand values 1, 6/7, 3/5 (one evaluation each: no SC-CFG, no prompt CFG)."""
    spy = DenoiserSpy(monkeypatch, generator_model.model.denoiser)
    generator_model.generate(tokens(1, 2 * Q, seed=31), max_new_tokens=1, eos_token_id=None, num_inference_steps=3,
                             self_condition_guidance=1.0, guidance_scale=1.0, timestep_shift=3.0, noise_seeds=[0])
    seen = [c["timesteps"][0, -1].item() for c in spy.calls if c["noisy"] is not None]
    assert seen == pytest.approx([1.0, 6 / 7, 3 / 5], abs=1e-6)


@pytest.mark.parametrize("option,value", [
    ("num_inference_steps", 0), ("num_inference_steps", 1.5), ("self_condition_guidance", -1.0),
    ("guidance_scale", -1.0), ("cfg_min_sigma", 2.0), ("timestep_shift", 0.0), ("top_k", 5), ("top_p", 0.5),
    ("temperature", -1.0),
])
def test_bad_generate_options_are_named(generator_model, option, value):
    with pytest.raises(ValueError, match=option):
        generator_model.generate(tokens(1, 5), max_new_tokens=2, **{option: value})


def test_sampled_read_out_uses_each_rows_own_generator(generator_model):
    """temperature 1: rows of different prompt lengths (no history, mid-block, whole blocks), left padded, give in
    a batch exactly what they give alone; the read-out does sample (other seeds or greedy give other tokens)."""
    lf.assert_sampled_rows_as_alone(generator_model, [tokens(1, n, seed=10 + n)[0] for n in (3, 6, 8)])


@pytest.mark.parametrize("draft", ["guided", "unguided"])
def test_the_next_draft_is_the_guided_or_the_aware_prediction(generator_model, monkeypatch, draft):
    """Every denoiser evaluation of one block recorded in order (aware, then blind from the second step; prompt CFG
    off): the draft step k + 1's aware call sees is blind + 4·(aware − blind) of step k ("guided") or step k's aware
    prediction itself ("unguided"); the blind calls always see a zero draft."""
    from hf_latentlm.modeling.modeling_aurora import AuroraBlockVelocity

    calls = []
    original = AuroraBlockVelocity.predict

    def recorded(self, x, sigma, mask, draft_in, cache):
        out = original(self, x, sigma, mask, draft_in, cache)
        calls.append((draft_in.clone(), out.clone()))
        return out

    monkeypatch.setattr(AuroraBlockVelocity, "predict", recorded)
    steps, w = 4, 4.0
    generator_model.generate(tokens(1, Q), max_new_tokens=1, eos_token_id=None, num_inference_steps=steps,
                             self_condition_guidance=w, guidance_scale=1.0, self_condition_draft=draft,
                             noise_seeds=[3])
    assert len(calls) == 2 * steps - 1  # aware at every step, blind from the second
    aware = [calls[0]] + [calls[i] for i in range(1, len(calls), 2)]
    blind = [calls[i] for i in range(2, len(calls), 2)]
    assert not aware[0][0].any() and all(not b[0].any() for b in blind)
    for k in range(1, steps):
        previous = aware[k - 1][1]
        if k > 1:  # from the second step on the step's prediction was guided
            previous_guided = blind[k - 2][1] + w * (aware[k - 1][1] - blind[k - 2][1])
            assert (previous_guided - previous).abs().max() > 1e-4  # the two candidates differ here
            if draft == "guided":
                previous = previous_guided
        torch.testing.assert_close(aware[k][0], previous, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="self_condition_draft must be one of"):
        generator_model.generate(tokens(1, 5), max_new_tokens=2, self_condition_draft="blind")
