"""Cola DLM (hf_latentlm/modeling/modeling_cola.py): the causal text VAE, the joint objective and generate(), each
checked against an independent reference (a brute-force loop, a closed form, a hand replay of the objective from the
DiT's own inputs, forward hooks). The contract every family shares (batched == alone greedy, EOS, streamer, Hub
loading, CLI, ...) runs in tests/test_family_contract.py. Tiny models built directly (hidden 32, one layer each)."""

from __future__ import annotations

import copy

import latent_fixtures as lf
import pytest
import torch

from hf_latentlm.modeling.configuration_cola import ColaConfig, ColaVAEConfig
from hf_latentlm.modeling.flow import FlowMatchEulerSampler, FlowMatchHeunSampler
from hf_latentlm.modeling.modeling_cola import ColaForCausalLM, ColaTextVAE
from hf_latentlm.training.loop import TrainConfig, make_optimizer

VOCAB, Q, VAE_Q, D_Z = 64, 4, 2, 8
VAE_KW = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
              num_hidden_layers=1, latent_size=D_Z, vae_block_size=VAE_Q)
DIT_KW = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
              block_size=Q)


def make_vae(seed: int = 0, **overrides) -> ColaTextVAE:
    torch.manual_seed(seed)
    return ColaTextVAE(ColaVAEConfig(**{**VAE_KW, **overrides}))


def make_cola(seed: int = 0, vae: ColaTextVAE | None = None, randomize: bool = True, **overrides) -> ColaForCausalLM:
    """A tiny Cola around a fresh VAE. randomize: give the zero-initialised maps (adaLN modulations, velocity head)
    random weights, so that the DiT's output (and its gradient) depends on its inputs."""
    vae = make_vae(seed) if vae is None else vae
    torch.manual_seed(seed + 1)
    model = ColaForCausalLM.from_vae(vae, **{**DIT_KW, **overrides})
    if randomize:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2 and not param.any():
                    param.normal_(0.0, 0.1)
    return model


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return lf.random_tokens(VOCAB, batch, length, seed)


class VelocitySpy:
    """Replaces `model.velocity` (an instance attribute) and records every call's inputs and output."""

    def __init__(self, model: ColaForCausalLM):
        self.original, self.calls = model.velocity, []
        model.velocity = self

    def __call__(self, latents, timesteps, attention_mask=None, position_ids=None, cache=None):
        out = self.original(latents, timesteps, attention_mask, position_ids, cache=cache)
        self.calls.append(dict(latents=latents, timesteps=timesteps, attention_mask=attention_mask,
                               position_ids=position_ids, cache=cache, velocity=out))
        return out


def replay_flow_matching(call: dict, length: int, scored: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The flow-matching loss recomputed by hand from what the DiT received in the dual-stream pass: z0 is the clean
    stream, z_t the noisy one, t its times, ε = (z_t − (1 − t)·z0) / t, target ε − z0; mean over channels, then over
    the `scored` positions (a Python loop)."""
    latents, times, velocity = call["latents"].detach(), call["timesteps"], call["velocity"].detach()
    z0, z_t, t = latents[:, :length], latents[:, length:], times[:, length:, None]
    noise = (z_t - (1 - t) * z0) / t
    error = (velocity[:, length:] - (noise - z0)).pow(2).mean(-1)
    total, count = 0.0, 0
    for b in range(scored.shape[0]):
        for i in range(length):
            if scored[b, i]:
                total, count = total + error[b, i], count + 1
    return (total / count if count else torch.tensor(0.0)), dict(z0=z0, z_t=z_t, t=t, noise=noise)


# ====================================================================================================================
# Configuration
# ====================================================================================================================

@pytest.mark.parametrize("overrides,needle", [
    (dict(block_size=6), "block_size"),  # not a multiple of vae_block_size 4
    (dict(vocab_size=65), "vocab_size"),
    (dict(time_sampler="beta"), "time_sampler"),
    (dict(ode_solver="rk4"), "ode_solver"),
    (dict(history_dropout=1.0), "history_dropout"),
    (dict(cfg_scale=-1.0), "cfg_scale"),
    (dict(vae_learning_rate_ratio=-0.5), "vae_learning_rate_ratio"),
])
def test_bad_cola_config_values_are_named(overrides, needle):
    vae_config = ColaVAEConfig(**{**VAE_KW, "vae_block_size": 4})
    with pytest.raises(ValueError, match=needle):
        ColaConfig(**{**DIT_KW, "vocab_size": VOCAB, "block_size": 8, **overrides}, vae_config=vae_config)


@pytest.mark.parametrize("overrides,needle", [
    (dict(logsnr_init=40.0), "logsnr_init"), (dict(mask_prob=1.0), "mask_prob"),
    (dict(vae_block_size=0), "vae_block_size"), (dict(kl_weight=-1.0), "kl_weight"),
])
def test_bad_vae_config_values_are_named(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        ColaVAEConfig(**{**VAE_KW, **overrides})


def test_from_vae_refuses_a_disagreeing_config():
    vae = make_vae()
    with pytest.raises(ValueError, match="vocab_size"):
        ColaForCausalLM.from_vae(vae, ColaConfig(**DIT_KW, vocab_size=VOCAB + 1,
                                                 vae_config=ColaVAEConfig(**{**VAE_KW, "vocab_size": VOCAB + 1})))
    with pytest.raises(ValueError, match="block_size"):
        ColaForCausalLM.from_vae(vae, **{**DIT_KW, "block_size": 3})


# ====================================================================================================================
# VAE
# ====================================================================================================================

def test_vae_encoder_and_decoder_are_block_causal():
    """Brute force over every position p: changing token p (latent p for the decoder) leaves every position of an
    earlier VAE block exactly as it was, and changes every position of p's own block (before p too) and after."""
    vae = make_vae(initializer_range=0.2).eval()
    length = 7  # not a multiple of vae_block_size
    ids = tokens(1, length)
    latents = torch.randn(1, length, D_Z, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_mean, base_logits = vae.encode(ids), vae.decode_logits(latents)
        for p in range(length):
            changed_ids = ids.clone()
            changed_ids[0, p] = (ids[0, p] + 7) % VOCAB
            changed_latents = latents.clone()
            changed_latents[0, p] += 1.0
            mean_diff = (vae.encode(changed_ids) - base_mean).abs().amax(-1)[0]
            logit_diff = (vae.decode_logits(changed_latents) - base_logits).abs().amax(-1)[0]
            for q in range(length):
                for name, diff in (("encoder", mean_diff), ("decoder", logit_diff)):
                    if q // VAE_Q < p // VAE_Q:
                        assert diff[q] == 0, f"{name}: position {q} sees a later block's change at {p}"
                    else:
                        assert diff[q] > 1e-5, f"{name}: position {q} does not see the change at {p}"


def test_posterior_mean_is_layer_normed_over_channels():
    """Zero mean and unit variance over the channels at every position, and (no affine parameters) blind to a common
    shift or a positive scale of the pre-norm projection."""
    vae = make_vae(initializer_range=0.2).eval()
    ids = tokens(3, 9)
    with torch.no_grad():
        mean = vae.encode(ids)
        assert mean.dtype == torch.float32 and mean.shape == (3, 9, D_Z)
        torch.testing.assert_close(mean.mean(-1), torch.zeros(3, 9), atol=1e-5, rtol=0)
        torch.testing.assert_close(mean.var(-1, unbiased=False), torch.ones(3, 9), atol=2e-3, rtol=0)
        vae.encoder.to_latent.weight.mul_(3.0)
        vae.encoder.to_latent.bias.mul_(3.0).add_(5.0)
        torch.testing.assert_close(vae.encode(ids), mean, atol=1e-4, rtol=1e-4)


def unpadded_right(batch_lengths: list[int], width: int) -> torch.Tensor:
    return torch.tensor([[1] * n + [0] * (width - n) for n in batch_lengths])


def test_vae_loss_parts_match_hand_computation_over_scored_tokens():
    """Eval mode, decoding the mean: reconstruction = CE over the scored tokens (labels != −100 and not padding,
    label i is token i), KL = 0.5·Σ_c(μ² + σ² − 1 − log σ²) averaged over the same tokens, loss = CE + β·KL, and
    no masked pass."""
    vae = make_vae(kl_weight=0.05).eval()
    with torch.no_grad():
        vae.encoder.logsnr.value.fill_(0.7)
    ids = tokens(2, 9, seed=3)
    mask = unpadded_right([9, 6], 9)
    labels = ids.clone()
    labels[0, [0, 4]] = -100
    labels[1, 2] = -100  # row 1: positions 6..8 are padding, their labels (= their ids) must not count
    with torch.no_grad():
        out = vae(input_ids=ids, labels=labels, attention_mask=mask, sample_latent=False)
    assert out.mask_nll is None
    var = torch.exp(torch.tensor(-0.7))
    nll_sum, kl_sum, count = 0.0, 0.0, 0
    for b in range(2):
        for i in range(9):
            if labels[b, i] == -100 or not mask[b, i]:
                continue
            nll_sum += -torch.log_softmax(out.logits[b, i].double(), -1)[labels[b, i]]
            mu = out.latent_mean[b, i].double()
            kl_sum += 0.5 * (mu.pow(2) + var - 1 - torch.log(var)).sum()
            count += 1
    assert count == 9 - 2 + 6 - 1
    torch.testing.assert_close(out.reconstruction_nll.double(), nll_sum / count, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.kl.double(), kl_sum / count, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss.double(), nll_sum / count + 0.05 * kl_sum / count, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logsnr, torch.tensor(0.7))
    # The logits are the decoder's reading of the posterior mean, padding hidden.
    with torch.no_grad():
        expected = vae.decode_logits(vae.encode(ids, mask), mask)
    torch.testing.assert_close(out.logits[0], expected[0])
    torch.testing.assert_close(out.logits[1, :6], expected[1, :6])


def test_logsnr_gets_gradient_only_when_learned():
    """Decoding the mean, the logSNR s enters the loss only through β·KL, whose derivative is the closed form
    β·0.5·d_z·(1 − e^(−s)); with learn_logsnr=False it is no parameter to train and gets nothing."""
    ids = tokens(2, 6)
    for learn in (True, False):
        vae = make_vae(kl_weight=0.1, learn_logsnr=learn, logsnr_init=0.5).eval()
        assert vae.encoder.logsnr.value.requires_grad is learn
        vae(input_ids=ids, labels=ids, sample_latent=False).loss.backward()
        grad = vae.encoder.logsnr.value.grad
        if learn:
            expected = 0.1 * 0.5 * D_Z * (1 - torch.exp(torch.tensor(-0.5)))
            torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5)
        else:
            assert grad is None
        # In training (sampled z, masked pass) the learned logSNR gets a gradient from the reconstruction too.
        vae.zero_grad(set_to_none=True)
        vae.train()
        torch.manual_seed(0)
        vae(input_ids=ids, labels=ids).loss.backward()
        grad = vae.encoder.logsnr.value.grad
        assert (grad is not None and torch.isfinite(grad) and grad != 0) if learn else grad is None


def test_masked_pass_runs_in_training_only_and_adds_its_weighted_loss():
    vae = make_vae(mask_prob=0.5, mask_loss_weight=0.7, kl_weight=0.05)
    ids = tokens(2, 8)
    vae.train()
    torch.manual_seed(1)
    out = vae(input_ids=ids, labels=ids)
    assert out.mask_nll is not None and out.mask_nll.dim() == 0 and out.mask_nll > 0
    torch.testing.assert_close(out.loss.detach(), out.reconstruction_nll + 0.05 * out.kl + 0.7 * out.mask_nll)
    # Only scored tokens are masked: nothing scored, nothing masked (0, not NaN).
    unscored = vae(input_ids=ids, labels=torch.full_like(ids, -100))
    assert unscored.mask_nll == 0 and unscored.reconstruction_nll == 0 and unscored.kl == 0
    assert torch.isfinite(unscored.loss)
    vae.eval()
    evaluated = vae(input_ids=ids, labels=ids)
    assert evaluated.mask_nll is None
    torch.testing.assert_close(evaluated.loss, evaluated.reconstruction_nll + 0.05 * evaluated.kl)


def test_masked_pass_replaces_the_drawn_inputs_and_scores_exactly_them():
    """The BERT-style pass by hand: its encoder call gets `masked` = the drawn positions (scored ones only, about
    mask_prob of them), and mask_nll is the CE of its decoder's logits at exactly those positions (not at every
    scored one), for the row's own tokens."""
    vae = make_vae(mask_prob=0.5, mask_loss_weight=0.7).train()
    ids = tokens(2, 8, seed=5)
    labels = ids.clone()
    labels[1, :3] = -100
    encoder_calls, decoder_logits = [], []
    encoder, decoder = vae.encoder.forward, vae.decoder.forward
    vae.encoder.forward = lambda *a, **k: encoder_calls.append(k.get("masked")) or encoder(*a, **k)
    vae.decoder.forward = lambda *a, **k: decoder_logits.append(decoder(*a, **k)) or decoder_logits[-1]
    try:
        torch.manual_seed(2)
        out = vae(input_ids=ids, labels=labels)
    finally:
        del vae.encoder.forward, vae.decoder.forward
    (masked,) = [m for m in encoder_calls if m is not None]
    assert 0 < int(masked.sum()) < int((labels != -100).sum()) and not masked[1, :3].any()
    logits = decoder_logits[-1].detach()  # the masked pass decodes last
    nll = [-torch.log_softmax(logits[b, i].double(), -1)[ids[b, i]] for b in range(2) for i in range(8) if masked[b, i]]
    assert float(out.mask_nll) == pytest.approx(float(sum(nll) / len(nll)), rel=1e-5)


def test_masked_encoder_inputs_are_the_mask_embedding():
    """encoder(ids, masked=m): a masked position reads the [MASK] embedding, so its token no longer matters (the
    output is unchanged when that token changes), while an unmasked token still does; no mask is the plain pass."""
    vae = make_vae().eval()
    ids = tokens(1, 8, seed=7)
    masked = torch.zeros(1, 8, dtype=torch.bool)
    masked[0, [2, 5]] = True
    other = ids.clone()
    other[0, [2, 5]] = (ids[0, [2, 5]] + 1 - 2) % (VOCAB - 2) + 2
    with torch.no_grad():
        base = vae.encoder(ids, masked=masked)
        torch.testing.assert_close(vae.encoder(other, masked=masked), base)
        assert (vae.encoder(other) - vae.encoder(ids)).abs().max() > 1e-3
        unmasked_changed = ids.clone()
        unmasked_changed[0, 3] = (ids[0, 3] + 1 - 2) % (VOCAB - 2) + 2
        assert (vae.encoder(unmasked_changed, masked=masked) - base).abs().max() > 1e-3
        torch.testing.assert_close(vae.encoder(ids, masked=torch.zeros_like(masked)), vae.encoder(ids))


def test_left_padded_batch_gives_each_row_what_it_gets_alone():
    """VAE encoder, VAE decoder and the DiT base model (input_ids) on rows of lengths that are not multiples of the
    VAE block (2) or the DiT block (4), left padded: blocks are counted from each row's first real token."""
    model = make_cola().eval()
    vae = model.model.vae
    rows = [tokens(1, n, seed=n)[0] for n in (5, 11, 3)]
    ids, mask = lf.left_padded(rows)
    with torch.no_grad():
        mean = vae.encode(ids, mask)
        logits = vae.decode_logits(mean, mask)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for b, row in enumerate(rows):
            n = row.numel()
            alone_mean = vae.encode(row[None])
            torch.testing.assert_close(mean[b, -n:], alone_mean[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(logits[b, -n:], vae.decode_logits(alone_mean)[0], atol=1e-5, rtol=1e-4)
            alone_hidden = model.model(input_ids=row[None]).last_hidden_state
            torch.testing.assert_close(hidden[b, -n:], alone_hidden[0], atol=1e-5, rtol=1e-4)


# ====================================================================================================================
# Joint objective
# ====================================================================================================================

def test_flow_matching_reaches_the_vae_only_through_the_noisy_stream_and_target(monkeypatch):
    """Replay: from what the DiT received, rebuild the noisy stream and the target from a leaf copy Z of the VAE's
    latent z0, keep the clean stream constant, and differentiate the flow-matching loss by Z. The model's gradient
    on z0 must be exactly that; with the clean stream differentiable too it would be another (checked, so the test
    can fail)."""
    model = make_cola(vae_loss_weight=0.0, reference_kl_weight=0.0, prompt_block_prob=0.0, history_dropout=0.0,
                      initializer_range=0.3)
    model.train()
    vae = model.model.vae
    captured = {}
    losses = vae.losses

    def losses_spy(*args, **kwargs):
        out, z0 = losses(*args, **kwargs)
        z0.retain_grad()
        captured["z0"] = z0
        return out, z0

    monkeypatch.setattr(vae, "losses", losses_spy)
    spy = VelocitySpy(model)
    ids = tokens(2, 10)  # 2.5 DiT blocks
    torch.manual_seed(0)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    model_grad = captured["z0"].grad
    (call,) = spy.calls
    length = ids.shape[1]
    replayed, parts = replay_flow_matching(call, length, torch.ones(2, length, dtype=torch.bool))
    torch.testing.assert_close(replayed, out.flow_matching_loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(parts["z0"], captured["z0"].detach())

    def fm_grad(clean_differentiable: bool) -> torch.Tensor:
        z = parts["z0"].clone().requires_grad_(True)
        t, noise = parts["t"], parts["noise"]
        clean = z if clean_differentiable else parts["z0"]
        latents = torch.cat([clean, (1 - t) * z + t * noise], dim=1)
        velocity = spy.original(latents, call["timesteps"], call["attention_mask"], call["position_ids"])
        loss = (velocity[:, length:] - (noise - z)).pow(2).mean(-1).mean()
        (grad,) = torch.autograd.grad(loss, z)
        return grad

    torch.testing.assert_close(model_grad, fm_grad(False), atol=1e-6, rtol=1e-4)
    assert (fm_grad(True) - model_grad).abs().max() > 1e-4, "the clean stream's gradient path must be measurable"


def test_zero_flow_matching_weight_leaves_the_vae_gradients_of_the_vae_loss_alone():
    model = make_cola(flow_matching_weight=0.0, reference_kl_weight=0.0).train()
    alone = copy.deepcopy(model.model.vae).train()
    ids = tokens(2, 9)
    torch.manual_seed(5)
    model(input_ids=ids, labels=ids).loss.backward()
    torch.manual_seed(5)  # the objective's first draws are the VAE loss's
    alone(input_ids=ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(model.model.vae.named_parameters(), alone.named_parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-5, msg=name)
    dit_grads = [p.grad for p in model.model.layers.parameters()]
    assert all(g is None or not g.any() for g in dit_grads), "flow-matching weight 0 must not train the DiT"


@pytest.mark.parametrize("length", [12, 10])
def test_full_history_dropout_makes_every_block_its_own_unconditional_run(length):
    """history_dropout 0.999 (1 is refused): with this seed every block drops its history, and each noisy block's
    velocity in the dual-stream pass equals the DiT on that block alone (generation's unconditional branch). With
    history_dropout 0 the blocks after the first differ (the comparison can fail). The last block of length 10 is
    partial."""
    ids = tokens(2, length)
    blocks = [slice(s, min(s + Q, length)) for s in range(0, length, Q)]
    velocities = {}
    for dropout in (0.999, 0.0):
        model = make_cola(history_dropout=dropout, prompt_block_prob=0.0).train()
        spy = VelocitySpy(model)
        torch.manual_seed(0)
        out = model(input_ids=ids, labels=ids)
        (call,) = spy.calls
        noisy, times = call["latents"][:, length:].detach(), call["timesteps"][:, length:]
        with torch.no_grad():
            alone = [spy.original(noisy[:, s], times[:, s], position_ids=call["position_ids"][:, length:][:, s])
                     for s in blocks]
        velocities[dropout] = (call["velocity"][:, length:].detach(), alone)
        if dropout:
            replayed, _ = replay_flow_matching(call, length, torch.ones(2, length, dtype=torch.bool))
            torch.testing.assert_close(replayed, out.flow_matching_loss, atol=1e-5, rtol=1e-4)
    dual, alone = velocities[0.999]
    for s, expected in zip(blocks, alone):
        torch.testing.assert_close(dual[:, s], expected, atol=1e-5, rtol=1e-4)
    dual, alone = velocities[0.0]
    torch.testing.assert_close(dual[:, blocks[0]], alone[0], atol=1e-5, rtol=1e-4)  # block 0 has no history anyway
    assert all((dual[:, s] - a).abs().max() > 1e-4 for s, a in zip(blocks[1:], alone[1:]))


def test_prompt_blocks_enter_clean_at_time_zero_and_unscored():
    """prompt_block_prob 0.999: every block's first k positions (1 <= k < Q) are its known prefix: at t = 0 with the
    clean latent in the noisy stream, and outside the flow-matching average (the training side of repaint)."""
    model = make_cola(prompt_block_prob=0.999, history_dropout=0.0).train()
    spy = VelocitySpy(model)
    length = 11  # a partial last block of 3
    ids = tokens(2, length)
    torch.manual_seed(4)
    out = model(input_ids=ids, labels=ids)
    (call,) = spy.calls
    z0, z_t, t = call["latents"][:, :length], call["latents"][:, length:], call["timesteps"][:, length:]
    known = torch.zeros(2, length, dtype=torch.bool)
    for b in range(2):
        for start in range(0, length, Q):
            times = t[b, start:start + Q].tolist()
            k = next((i for i, value in enumerate(times) if value > 0), len(times))
            assert 1 <= k < Q, (b, start, times)
            assert len(set(times[k:])) <= 1, "one time per block"
            known[b, start:start + k] = True
    assert torch.equal(z_t[known], z0[known])
    replayed, _ = replay_flow_matching(call, length, ~known)
    torch.testing.assert_close(replayed, out.flow_matching_loss, atol=1e-5, rtol=1e-4)


def test_right_padding_and_masked_labels_reduce_the_scored_positions():
    model = make_cola(prompt_block_prob=0.0, history_dropout=0.0).train()
    with torch.no_grad():  # a reference KL that is not 0
        model.model.vae.encoder.to_latent.weight.add_(0.05 * torch.randn_like(model.model.vae.encoder.to_latent.weight))
    spy = VelocitySpy(model)
    length = 10
    ids = tokens(3, length, seed=4)
    mask = unpadded_right([10, 7, 3], length)
    labels = ids.clone()  # as the training loop passes them: padding positions carry real-looking labels
    labels[0, [1, 8]] = -100
    labels[2, 0] = -100
    torch.manual_seed(2)
    out = model(input_ids=ids, labels=labels, attention_mask=mask)
    scored = (labels != -100) & mask.bool()
    assert int(scored.sum()) == 8 + 7 + 2
    replayed, _ = replay_flow_matching(spy.calls[0], length, scored)
    torch.testing.assert_close(replayed, out.flow_matching_loss, atol=1e-5, rtol=1e-4)
    everything, _ = replay_flow_matching(spy.calls[0], length, torch.ones_like(scored))
    assert (everything - out.flow_matching_loss).abs() > 1e-4  # the scored set matters
    # Reference KL over the same scored tokens, against torch.distributions.
    with torch.no_grad():
        mean = model.model.vae.encode(ids, mask)
        ref_mean = model.reference_encoder(ids, mask)
        std = model.model.vae.encoder.posterior_std()
        ref_std = model.reference_encoder.posterior_std()
    per_token = torch.distributions.kl_divergence(torch.distributions.Normal(mean, std),
                                                  torch.distributions.Normal(ref_mean, ref_std)).sum(-1)
    assert out.reference_kl > 1e-3
    torch.testing.assert_close(out.reference_kl, per_token[scored].mean(), atol=1e-6, rtol=1e-4)


def test_all_labels_masked_give_zero_losses_not_nan():
    model = make_cola().train()
    ids = tokens(2, 9)
    out = model(input_ids=ids, labels=torch.full_like(ids, -100))
    for name in ("flow_matching_loss", "reconstruction_nll", "kl", "reference_kl", "mask_nll"):
        assert getattr(out, name) == 0, name
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_left_padding_is_refused_by_the_objective():
    model = make_cola()
    ids = tokens(2, 8)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    with pytest.raises(ValueError, match="right padding"):
        model(input_ids=ids, labels=ids, attention_mask=mask)


def test_reference_kl_is_zero_at_init_and_grows_when_the_encoder_moves():
    model = make_cola().train()
    ids = tokens(2, 8)
    assert model.reference_encoder is not None and not model.reference_encoder.training
    assert not any(p.requires_grad for p in model.reference_encoder.parameters())
    out = model(input_ids=ids, labels=ids)
    assert out.reference_kl.abs() < 1e-7
    with torch.no_grad():
        model.model.vae.encoder.logsnr.value.add_(0.5)  # the variances part
    assert model(input_ids=ids, labels=ids).reference_kl > 1e-3
    with torch.no_grad():
        model.model.vae.encoder.logsnr.value.sub_(0.5)
        model.model.vae.encoder.layers[0].mlp.up_proj.weight.mul_(3.0)  # the means part
    assert model(input_ids=ids, labels=ids).reference_kl > 1e-3


def test_gaussian_kl_against_torch_distributions_and_its_gradient():
    """KL(N(μ, σ²) ‖ N(μ_ref, σ_ref²)) summed over channels, away from N(0, I) on both sides (per-channel reference
    means and scales, a scalar σ ≠ 1): the value is torch.distributions' and the gradients are the closed forms
    ∂/∂μ = (μ − μ_ref)/σ_ref² and ∂/∂σ = Σ (σ/σ_ref² − 1/σ)."""
    from hf_latentlm.modeling.modeling_cola import gaussian_kl

    generator = torch.Generator().manual_seed(0)
    mean = torch.randn(2, 3, D_Z, generator=generator, dtype=torch.float64).requires_grad_()
    std = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    ref_mean = torch.randn(2, 3, D_Z, generator=generator, dtype=torch.float64) + 0.5
    ref_std = torch.linspace(0.4, 1.7, D_Z, dtype=torch.float64)
    kl = gaussian_kl(mean, std, ref_mean, ref_std)
    expected = torch.distributions.kl_divergence(torch.distributions.Normal(mean, std.expand_as(mean)),
                                                 torch.distributions.Normal(ref_mean, ref_std)).sum(-1)
    torch.testing.assert_close(kl, expected)
    grad_mean, grad_std = torch.autograd.grad(kl.sum(), (mean, std))
    torch.testing.assert_close(grad_mean, (mean - ref_mean).detach() / ref_std**2)
    torch.testing.assert_close(grad_std, (std / ref_std**2 - 1 / std).detach().expand_as(mean).sum())


def test_reference_kl_is_kl_of_the_current_posterior_from_the_reference_one():
    """The objective's reference_kl is the mean over scored positions of KL(q_φ ‖ q_φref) (this direction: the
    reverse differs here by more than the tolerance), computed by hand from both encoders' means and σ's after
    the current encoder's weights and logSNR moved; its gradient reaches the current encoder's logSNR."""
    model = make_cola(vae=make_vae(mask_loss_weight=0.0), flow_matching_weight=0.0, vae_loss_weight=0.0,
                      reference_kl_weight=1.0).train()
    vae = model.model.vae
    with torch.no_grad():
        vae.encoder.layers[0].mlp.up_proj.weight.mul_(3.0)
        vae.encoder.logsnr.value.add_(0.8)
    ids = tokens(2, 8, seed=4)
    out = model(input_ids=ids, labels=ids)
    with torch.no_grad():
        q = torch.distributions.Normal(vae.encoder(ids).double(), float(vae.encoder.posterior_std()))
        ref = torch.distributions.Normal(model.reference_encoder(ids).double(),
                                         float(model.reference_encoder.posterior_std()))
    forward = torch.distributions.kl_divergence(q, ref).sum(-1).mean()
    reverse = torch.distributions.kl_divergence(ref, q).sum(-1).mean()
    assert abs(float(forward - reverse)) > 0.05 * float(forward)
    assert float(out.reference_kl) == pytest.approx(float(forward), rel=1e-4)
    out.loss.backward()
    # ∂KL/∂logSNR: σ² = e^{−logSNR} ⇒ ∂/∂logSNR Σ_c ½(σ²/σ_ref² − log σ²) = ½·d_z·(1 − σ²/σ_ref²), averaged.
    sigma2 = float(vae.encoder.posterior_std().detach()) ** 2
    ref2 = float(model.reference_encoder.posterior_std()) ** 2
    assert float(vae.encoder.logsnr.value.grad) == pytest.approx(0.5 * D_Z * (1 - sigma2 / ref2), rel=1e-4)


def test_logged_parts_are_scalars_and_the_loss_is_their_weighted_sum():
    vae = make_vae(kl_weight=0.05, mask_loss_weight=0.5, mask_prob=0.3)
    model = make_cola(vae=vae, flow_matching_weight=0.7, vae_loss_weight=1.3, reference_kl_weight=0.4).train()
    with torch.no_grad():  # a reference KL well above 0 (a scale of to_latent would not do: μ is LayerNorm'd)
        model.model.vae.encoder.layers[0].mlp.up_proj.weight.mul_(3.0)
        model.model.vae.encoder.logsnr.value.add_(0.3)
    ids = tokens(2, 10)
    torch.manual_seed(3)
    out = model(input_ids=ids, labels=ids)
    parts = {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k != "loss"}
    assert set(parts) == {"flow_matching_loss", "vae_loss", "reconstruction_nll", "kl", "mask_nll", "reference_kl",
                          "logsnr"}
    assert out.loss.dim() == 0 and out.loss.requires_grad
    assert all(v.dim() == 0 and not v.requires_grad for v in parts.values())
    assert all(float(parts[k]) > 0 for k in parts) and parts["reference_kl"] > 1e-2
    f = {k: float(v) for k, v in parts.items()}
    assert float(out.loss.detach()) == pytest.approx(0.7 * f["flow_matching_loss"] + 1.3 * f["vae_loss"]
                                            + 0.4 * f["reference_kl"], rel=1e-5)
    assert f["vae_loss"] == pytest.approx(f["reconstruction_nll"] + 0.05 * f["kl"] + 0.5 * f["mask_nll"], rel=1e-5)
    assert f["logsnr"] == pytest.approx(vae.config.logsnr_init + 0.3)


def optimizer_lrs(model, learning_rate=1e-3) -> tuple[dict[int, float], dict[int, float]]:
    cfg = TrainConfig(learning_rate=learning_rate, weight_decay=0.1)
    optimizer = make_optimizer(model, cfg)
    lr, decay = {}, {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert id(param) not in lr, "a parameter in two groups"
            lr[id(param)], decay[id(param)] = group["lr"], group["weight_decay"]
    return lr, decay


def test_vae_learning_rate_ratio_zero_freezes_the_vae():
    model = make_cola(vae_learning_rate_ratio=0.0).train()
    vae = model.model.vae
    assert not any(p.requires_grad for p in vae.parameters())
    assert model.reference_encoder is None and not vae.training
    ids = tokens(2, 9)
    out = model(input_ids=ids, labels=ids)
    for name in ("vae_loss", "reconstruction_nll", "kl", "mask_nll", "reference_kl"):
        assert getattr(out, name) is None, name
    assert float(out.loss.detach()) == pytest.approx(model.config.flow_matching_weight * float(out.flow_matching_loss))
    out.loss.backward()
    assert all(p.grad is None for p in vae.parameters())
    lr, _ = optimizer_lrs(model)
    vae_ids = {id(p) for p in vae.parameters()}
    assert not vae_ids & set(lr)
    assert set(lr) == {id(p) for p in model.parameters() if id(p) not in vae_ids}
    assert set(lr.values()) == {1e-3}


def test_vae_frozen_steps_hold_the_vae_for_the_first_steps_then_train_it(tmp_path):
    """vae_frozen_steps = 2: for two optimizer steps the objective is exactly the frozen-VAE one (the same loss as
    a ratio-0 copy with the same weights and draws; no VAE term, no gradient into the VAE); from the third step on
    it is the joint one (VAE loss and reference KL in the loss, gradient in the VAE). The count is saved."""
    held = make_cola(vae_frozen_steps=2).train()
    frozen = make_cola(vae_learning_rate_ratio=0.0).train()
    frozen.load_state_dict({k: v for k, v in held.state_dict().items() if k in frozen.state_dict()})
    vae = held.model.vae
    ids = tokens(2, 9)
    for step in range(2):
        torch.manual_seed(5)
        out = held(input_ids=ids, labels=ids)
        torch.manual_seed(5)
        reference = frozen(input_ids=ids, labels=ids)
        assert out.vae_loss is None and out.reference_kl is None
        torch.testing.assert_close(out.loss, reference.loss, rtol=1e-6, atol=1e-7)
        held.zero_grad(set_to_none=True)
        out.loss.backward()
        assert all(p.grad is None for p in vae.parameters()), step
        held.on_optimizer_step()
    torch.manual_seed(5)
    out = held(input_ids=ids, labels=ids)
    assert out.vae_loss is not None and out.reference_kl is not None
    expected = (held.config.flow_matching_weight * out.flow_matching_loss + held.config.vae_loss_weight * out.vae_loss
                + held.config.reference_kl_weight * out.reference_kl)
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in vae.encoder.parameters())
    held.save_pretrained(tmp_path)
    assert int(ColaForCausalLM.from_pretrained(tmp_path).optimizer_steps) == 2
    with pytest.raises(ValueError, match="vae_frozen_steps holds a VAE that trains later"):
        ColaConfig(vae_frozen_steps=3, vae_learning_rate_ratio=0.0)
    with pytest.raises(ValueError, match="vae_frozen_steps must be an int >= 0"):
        ColaConfig(vae_frozen_steps=-1)


def test_vae_learning_rate_ratio_half_gives_the_vae_half_the_rate():
    model = make_cola(vae_learning_rate_ratio=0.5)
    lr, decay = optimizer_lrs(model, learning_rate=2e-3)
    named = dict(model.named_parameters())
    trainable = {id(p) for p in named.values() if p.requires_grad}
    assert set(lr) == trainable
    assert not {id(p) for p in model.reference_encoder.parameters()} & set(lr)
    vae_ids = {id(p) for p in model.model.vae.parameters()}
    assert vae_ids <= set(lr)
    for name, param in named.items():
        if id(param) in lr:
            assert lr[id(param)] == pytest.approx(1e-3 if id(param) in vae_ids else 2e-3), name
            assert decay[id(param)] == (0.1 if param.dim() >= 2 else 0.0), name


# ====================================================================================================================
# generate()
# ====================================================================================================================

@pytest.fixture(scope="module")
def generator_model():
    return make_cola(seed=3).eval()


def expected_calls(prompt_length: int, max_new: int, evaluations: int, guided: bool) -> dict[str, int]:
    """Hand count for one row: 1 encoder pass; a DiT and a decoder pass over the prompt's complete blocks (if any);
    per generated block `evaluations` DiT calls (twice with guidance once the row has history) and one decoder
    pass; one clean DiT pass to append each finished block before the next."""
    complete, known = divmod(prompt_length, Q)
    blocks = 1 + max(0, -(-(max_new - (Q - known)) // Q))
    history = [complete > 0] + [True] * (blocks - 1)
    dit = int(complete > 0) + sum(evaluations * (2 if h and guided else 1) for h in history) + blocks - 1
    return {"vae_encoder": 1, "dit": dit, "vae_decoder": int(complete > 0) + blocks}


@pytest.mark.parametrize("prompt_length,max_new,solver,guidance", [
    (8, 7, "euler", 7.0),  # whole blocks of history
    (3, 7, "euler", 7.0),  # shorter than a block: the first block has no history (no CFG doubling)
    (3, 1, "heun", 7.0),  # ... and only that block
    (6, 7, "heun", 7.0),  # ends mid-block
    (6, 2, "euler", 1.0),  # no guidance
])
def test_calls_by_network_match_a_hand_count_and_the_forward_hooks(generator_model, prompt_length, max_new, solver,
                                                                   guidance):
    model, steps = generator_model, 3
    sampler = FlowMatchHeunSampler if solver == "heun" else FlowMatchEulerSampler
    expected = expected_calls(prompt_length, max_new, sampler.evaluations(steps), guidance != 1.0)
    modules = {"dit": model.model, "vae_encoder": model.model.vae.encoder, "vae_decoder": model.model.vae.decoder}
    with lf.forward_calls_counted(modules) as counted:
        out = model.generate(tokens(1, prompt_length), max_new_tokens=max_new, eos_token_id=None,
                             return_dict_in_generate=True, num_inference_steps=steps, ode_solver=solver,
                             guidance_scale=guidance, noise_seeds=[0])
    lf.assert_calls_match(out, max_new, expected, counted)


def test_generate_defaults_come_from_the_config(generator_model):
    """With no generate() options, the config's (non-default) cfg_scale 2.5, num_inference_steps 3 and ode_solver
    "heun" are used: the calls per network are the hand count for Heun's 5 evaluations per block, doubled by CFG."""
    model = copy.deepcopy(generator_model)
    model.config.cfg_scale, model.config.num_inference_steps, model.config.ode_solver = 2.5, 3, "heun"
    out = model.generate(tokens(1, 8, seed=32), max_new_tokens=4, eos_token_id=None, return_dict_in_generate=True,
                         noise_seeds=[0])
    expected = expected_calls(8, 4, FlowMatchHeunSampler.evaluations(3), True)
    assert {k: v.tolist() for k, v in out.calls_by_network.items()} == {k: [v] for k, v in expected.items()}
    assert expected["dit"] == 1 + 2 * 5


def test_guidance_is_skipped_exactly_for_a_row_without_history(generator_model):
    """In a batch guided at w = 7 next to a row that has history, a row shorter than one block denoises its first
    block exactly as it would alone at w = 1; the row with history is guided (differs from w = 1)."""
    model = generator_model
    short, long = tokens(1, 3, seed=8)[0], tokens(1, 9, seed=9)[0]
    ids, mask = lf.left_padded([short, long])
    with lf.first_inputs_recorded(model.model.vae.decoder) as blocks:
        def run(prompt, attention_mask, guidance, seeds):
            blocks.clear()
            out = model.generate(prompt, attention_mask=attention_mask, max_new_tokens=1, eos_token_id=None,
                                 num_inference_steps=3, guidance_scale=guidance, noise_seeds=seeds)
            return out, blocks[-1]  # the generated block (the first decoder call reads the prompt's history)

        batched, batched_block = run(ids, mask, 7.0, [4, 5])
        alone, alone_block = run(short[None], None, 1.0, [4])
        _, alone_guided_block = run(short[None], None, 7.0, [4])
        _, long_unguided_block = run(long[None], None, 1.0, [5])
    torch.testing.assert_close(batched_block[0], alone_block[0], atol=1e-5, rtol=1e-4)
    assert torch.equal(alone_block, alone_guided_block)
    assert batched[0, -1] == alone[0, -1]
    assert (batched_block[1] - long_unguided_block[0]).abs().max() > 1e-3


def test_guided_velocity_is_the_cfg_mix_of_its_two_branches_on_rows_with_history(generator_model, monkeypatch):
    """At w = 3 (neither 0 nor 1), batched rows with and without history: every velocity the solver receives is
    v_uncond + 3·(v_cond − v_uncond) on the row with history and exactly v_cond on the row without, where v_cond is
    the DiT evaluation that reads the history cache and v_uncond the one on the block alone (no cache, a Q × Q
    all-visible mask); the unconditional branch equals the DiT run on the block by itself. The tiny DiT barely
    reads its history, so the conditional branch gets +0.5 (a stub whose two branches differ)."""
    from hf_latentlm.modeling.modeling_cola import ColaBlockVelocity

    model, w = generator_model, 3.0
    ids, mask = lf.left_padded([tokens(1, 9, seed=20)[0], tokens(1, 3, seed=21)[0]])  # history / none
    spy = VelocitySpy(model)
    real = spy.original
    spy.original = lambda latents, timesteps, attention_mask, position_ids, cache=None: (
        real(latents, timesteps, attention_mask, position_ids, cache=cache) + (0.5 if cache is not None else 0.0))
    fields = []
    original_call = ColaBlockVelocity.__call__

    def recorded(self, x, t):
        start = len(spy.calls)
        out = original_call(self, x, t)
        fields.append((x.clone(), self.has_history.flatten().clone(), spy.calls[start:], out.clone()))
        return out

    monkeypatch.setattr(ColaBlockVelocity, "__call__", recorded)
    try:
        model.generate(ids, attention_mask=mask, max_new_tokens=1, eos_token_id=None, num_inference_steps=3,
                       guidance_scale=w, noise_seeds=[6, 7])
    finally:
        del model.velocity
    assert len(fields) == 3 and [h.tolist() for _, h, _, _ in fields] == [[True, False]] * 3
    for x, _, calls, out in fields:
        assert len(calls) == 2
        (cond,) = [c for c in calls if c["cache"] is not None]
        (uncond,) = [c for c in calls if c["cache"] is None]
        alone = uncond["attention_mask"]
        assert alone.shape[-2:] == (Q, Q) and bool(alone.all())
        v_cond, v_uncond = cond["velocity"].detach(), uncond["velocity"].detach()
        torch.testing.assert_close(out[0], v_uncond[0] + w * (v_cond[0] - v_uncond[0]), atol=1e-5, rtol=1e-5)
        assert torch.equal(out[1], v_cond[1])
        with torch.no_grad():
            by_itself = real(x, uncond["timesteps"], None, uncond["position_ids"])
        torch.testing.assert_close(v_uncond, by_itself, atol=1e-5, rtol=1e-5)


def test_repaint_holds_the_prompt_latents_at_time_zero_in_every_call(generator_model):
    """Prompts ending mid-block (known 2 and 1 positions of the first generated block, left padded together): every
    DiT evaluation of that block, both CFG branches and Heun's predictor, sees the prompt's clean latents (its VAE
    posterior mean, computed alone) at the known positions, at t = 0, and the solver's time elsewhere."""
    model = generator_model
    rows = [tokens(1, 6, seed=1)[0], tokens(1, 5, seed=2)[0]]
    ids, mask = lf.left_padded(rows)
    with torch.no_grad():
        clean = [model.model.vae.encode(r[None])[0, (r.numel() // Q) * Q:] for r in rows]
    spy = VelocitySpy(model)
    try:
        model.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None, num_inference_steps=3,
                       ode_solver="heun", noise_seeds=[1, 2])
    finally:
        del model.velocity
    assert len(spy.calls) == 2 * FlowMatchHeunSampler.evaluations(3)  # both rows have history: CFG doubles
    grid = set(FlowMatchHeunSampler(3).timesteps[:-1].tolist())
    for call in spy.calls:
        for b, known in enumerate(clean):
            k = known.shape[0]
            torch.testing.assert_close(call["latents"][b, :k], known, atol=1e-5, rtol=1e-4)
            assert not call["timesteps"][b, :k].any()
            rest = call["timesteps"][b, k:]
            assert (rest == rest[0]).all() and rest[0].item() in grid
    assert {c["timesteps"][0, -1].item() for c in spy.calls} == grid


def test_timestep_shift_moves_the_solver_grid(generator_model):
    """timestep_shift = 3 (not the identity 1): the DiT is evaluated exactly at the shifted grid's times
    3t/(1 + 2t), t = 1, 2/3, 1/3, hand values 1, 6/7, 3/5, which differ from the uniform grid."""
    model = generator_model
    spy = VelocitySpy(model)
    try:
        model.generate(tokens(1, 8, seed=30), max_new_tokens=1, eos_token_id=None, num_inference_steps=3,
                       guidance_scale=1.0, timestep_shift=3.0, noise_seeds=[0])
    finally:
        del model.velocity
    seen = [c["timesteps"][0, -1].item() for c in spy.calls]
    assert seen == pytest.approx([1.0, 6 / 7, 3 / 5], abs=1e-6)


@pytest.mark.parametrize("option,value", [
    ("top_k", 5), ("top_p", 0.9), ("num_inference_steps", 0), ("ode_solver", "rk4"), ("guidance_scale", -1.0),
    ("timestep_shift", 0.0), ("temperature", -1.0), ("repetition_penalty", 0.0), ("block_seed_offset", -1),
])
def test_bad_generate_options_are_named(generator_model, option, value):
    with pytest.raises(ValueError, match=option):
        generator_model.generate(tokens(1, 5), max_new_tokens=2, **{option: value})


def test_sampled_read_out_uses_each_rows_own_generator(generator_model):
    """temperature 1: rows of different prompt lengths (history or not, ending mid-block or not), left padded,
    give in a batch exactly what they give alone; the read-out does sample (other seeds, other tokens; greedy
    differs), and config.decode_temperature is the default temperature."""
    run = lf.assert_sampled_rows_as_alone(generator_model, [tokens(1, n, seed=10 + n)[0] for n in (3, 6, 9)])
    sampling_model = copy.deepcopy(generator_model)
    sampling_model.config.decode_temperature = 1.0
    same = dict(attention_mask=run.mask, noise_seeds=run.seeds, **run.kwargs)
    assert torch.equal(sampling_model.generate(run.ids, **same), run.batched)
    assert torch.equal(sampling_model.generate(run.ids, do_sample=False, **same), run.greedy)


def test_repetition_penalty_sees_every_earlier_read_out_and_comes_from_the_generation_config(generator_model):
    """With penalty p, each block is read out from its decoder logits with the logit s of every token read out in an
    earlier block of the call (all its positions: a prompt's re-decoded partial block too; the prompt itself not)
    made s·p (s < 0) or s/p: a hand loop over the recorded logits gives the generated tokens. The generation
    config's repetition_penalty is the default, and p changes the tokens."""
    model = copy.deepcopy(generator_model)
    prompt = tokens(1, 6, seed=40)
    recorded = []
    decode = model._decode_latents
    model._decode_latents = lambda *args: recorded.append(decode(*args).float()) or recorded[-1]
    kwargs = dict(max_new_tokens=10, eos_token_id=None, noise_seeds=[5], do_sample=False)
    plain = model.generate(prompt, **kwargs)
    recorded.clear()
    model.generation_config.repetition_penalty = 3.0
    penalised = model.generate(prompt, **kwargs)
    assert not torch.equal(plain, penalised)
    read_out = []
    for logits in recorded[1:]:  # recorded[0]: the prompt's complete block
        logits = logits[0].clone()
        for token in {t for block in read_out for t in block.tolist()}:
            logits[:, token] = torch.where(logits[:, token] < 0, logits[:, token] * 3.0, logits[:, token] / 3.0)
        read_out.append(logits.argmax(-1))
    assert torch.equal(penalised[0, 6:], torch.cat(read_out)[2:])  # the first block's 2 known positions dropped
    assert torch.equal(model.generate(prompt, repetition_penalty=1.0, **kwargs), plain)


def test_block_seed_offset_starts_each_block_from_its_own_seed(generator_model):
    """With block_seed_offset, block n of a row starts from torch.randn drawn by a generator seeded seed + n·offset
    (recorded as the solver's first input), whatever the row's batch."""
    model = generator_model
    seen = []
    denoise = model._denoise_block
    model._denoise_block = lambda state, noise, *rest: seen.append(noise.clone()) or denoise(state, noise, *rest)
    try:
        model.generate(tokens(1, 8, seed=41), max_new_tokens=12, eos_token_id=None, noise_seeds=[7],
                       block_seed_offset=1000)
    finally:
        del model._denoise_block
    assert len(seen) == 3
    for n, noise in enumerate(seen):
        expected = torch.randn(Q, model.config.latent_size, generator=torch.Generator().manual_seed(7 + 1000 * n))
        assert torch.equal(noise[0], expected)


# ====================================================================================================================
# Save / load
# ====================================================================================================================

def test_save_and_load_keep_the_logsnr_and_the_reference_encoder(tmp_path):
    """from_pretrained must not re-initialise the logSNR (its init fills `logsnr_init`) or the reference encoder."""
    model = make_cola(vae=make_vae(learn_logsnr=True))
    with torch.no_grad():
        for param in model.reference_encoder.parameters():
            param.add_(0.01 * torch.randn_like(param))
        model.model.vae.encoder.logsnr.value.fill_(2.3)
        model.reference_encoder.logsnr.value.fill_(-0.4)
    model.save_pretrained(tmp_path)
    loaded = ColaForCausalLM.from_pretrained(tmp_path)
    assert loaded.model.vae.encoder.logsnr.value.item() == pytest.approx(2.3)
    assert loaded.reference_encoder.logsnr.value.item() == pytest.approx(-0.4)
    saved, restored = model.state_dict(), loaded.state_dict()
    assert set(saved) == set(restored) and any(k.startswith("reference_encoder.") for k in saved)
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name
    ids = tokens(2, 7)
    model.eval(), loaded.eval()
    torch.manual_seed(0)
    first = model(input_ids=ids, labels=ids)
    torch.manual_seed(0)
    second = loaded(input_ids=ids, labels=ids)
    torch.testing.assert_close(second.loss, first.loss)
    assert first.reference_kl > 0


def test_save_and_load_keep_a_vae_logsnr(tmp_path):
    vae = make_vae(learn_logsnr=False, logsnr_init=1.1)
    with torch.no_grad():
        vae.encoder.logsnr.value.fill_(3.0)  # not the init value
    vae.save_pretrained(tmp_path)
    assert ColaTextVAE.from_pretrained(tmp_path).encoder.logsnr.value.item() == pytest.approx(3.0)


def test_from_pretrained_keeps_what_init_froze(tmp_path):
    """A loaded model trains what a built one trains: a fixed logSNR, the reference encoder and a frozen VAE
    (vae_learning_rate_ratio 0) stay without gradient."""
    make_vae(learn_logsnr=False).save_pretrained(tmp_path / "vae")
    make_cola().save_pretrained(tmp_path / "cola")
    make_cola(vae_learning_rate_ratio=0.0).save_pretrained(tmp_path / "frozen")
    trainable = {
        "fixed logSNR": ColaTextVAE.from_pretrained(tmp_path / "vae").encoder.logsnr.value.requires_grad,
        "reference encoder": any(p.requires_grad for p in
                                 ColaForCausalLM.from_pretrained(tmp_path / "cola").reference_encoder.parameters()),
        "frozen VAE": any(p.requires_grad for p in
                          ColaForCausalLM.from_pretrained(tmp_path / "frozen").model.vae.parameters()),
    }
    assert not any(trainable.values()), trainable


def test_vae_records_its_encoder_and_the_dit_records_only_its_own_blocks():
    """The VAE alone records its encoder's blocks as transformers' encoders do (layers + 1 hidden states, the last
    its `last_hidden_state`; one eager attention map per layer, block-causal); inside Cola the recorded states are
    the DiT's only (it has another depth here, so a VAE state leaking in would change the count)."""
    vae = ColaTextVAE(ColaVAEConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_key_value_heads=1, num_hidden_layers=2, latent_size=8, vae_block_size=2)).eval()
    ids = torch.randint(2, 64, (2, 8))
    out = vae(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3 and out.hidden_states[0].shape == (2, 8, 32)
    torch.testing.assert_close(out.hidden_states[0], vae.get_input_embeddings()(ids))
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
    assert vae(ids).hidden_states is None
    vae.set_attn_implementation("eager")
    probs = vae(ids, labels=ids, output_attentions=True).attentions
    assert len(probs) == 2 and probs[0].shape == (2, 2, 8, 8)
    later_block = torch.arange(8)[None, :] // 2 > torch.arange(8)[:, None] // 2
    assert (probs[0][..., later_block] == 0).all()
    as_tuple = vae(ids, labels=ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], vae(ids, labels=ids).loss)

    model = make_cola(vae=vae).eval()  # a DiT of 1 layer over a VAE of 2
    model.set_attn_implementation("eager")
    dit = model(input_ids=ids, output_hidden_states=True, output_attentions=True)
    assert len(dit.hidden_states) == 2 and len(dit.attentions) == 1
    assert dit.hidden_states[0].shape[-1] == model.config.hidden_size
    # Asked through the configs (every sub-config too), as transformers' tests do: still the DiT's alone.
    for config in (model.config, model.config.vae_config):
        config.output_hidden_states = config.output_attentions = True
    by_config = model(input_ids=ids)
    assert len(by_config.hidden_states) == 2 and len(by_config.attentions) == 1


def test_resize_token_embeddings_keeps_every_vocabulary_piece_consistent(tmp_path):
    """The VAE's encoder embedding, its decoder read-out, the frozen reference encoder and both configs move
    together, old rows kept; a new token gets the VAE's new row in the reference too (the KL anchor starts at the
    VAE). The resized checkpoint saves, loads with the same outputs, trains on a new token and generates."""
    model = make_cola(seed=5)
    old_embedding = model.get_input_embeddings().weight.detach().clone()
    old_reference = model.reference_encoder.embed_tokens.weight.detach().clone()
    old_head = model.model.vae.decoder.lm_head.weight.detach().clone()
    size = VOCAB + 5
    embedding = model.resize_token_embeddings(size, pad_to_multiple_of=8)
    padded = -(-size // 8) * 8
    vae = model.model.vae
    assert embedding is vae.encoder.embed_tokens and embedding.weight.shape[0] == padded
    assert vae.decoder.lm_head.weight.shape[0] == padded
    assert model.reference_encoder.embed_tokens.weight.shape[0] == padded
    assert not model.reference_encoder.embed_tokens.weight.requires_grad
    assert model.config.vocab_size == model.config.vae_config.vocab_size == vae.config.vocab_size == padded
    assert model.vocab_size == model.model.vocab_size == padded  # transformers models' attribute
    torch.testing.assert_close(embedding.weight[:VOCAB], old_embedding)
    torch.testing.assert_close(vae.decoder.lm_head.weight[:VOCAB], old_head)
    torch.testing.assert_close(model.reference_encoder.embed_tokens.weight[:VOCAB], old_reference)
    torch.testing.assert_close(model.reference_encoder.embed_tokens.weight[VOCAB:], embedding.weight[VOCAB:])

    ids = tokens(2, 2 * Q, seed=6)
    ids[0, 3] = padded - 1  # a new token
    model.save_pretrained(tmp_path)
    loaded = ColaForCausalLM.from_pretrained(tmp_path).eval()
    model.eval()
    torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    out = loaded.generate(ids[:1], max_new_tokens=Q, eos_token_id=None, num_inference_steps=2, noise_seeds=[0])
    assert out.shape == (1, 3 * Q) and int(out.max()) < padded
    loaded.train()
    loaded(input_ids=ids, labels=ids).loss.backward()
    assert loaded.model.vae.encoder.embed_tokens.weight.grad[padded - 1].abs().sum() > 0


def test_the_base_model_alone_resizes_consistently(tmp_path):
    """`AutoModel` gives `ColaModel`: its resize also moves the VAE's both ends and both configs, and reloads."""
    from hf_latentlm.modeling.modeling_cola import ColaModel

    make_cola(seed=5).save_pretrained(tmp_path / "lm")
    base = ColaModel.from_pretrained(tmp_path / "lm").eval()
    base.resize_token_embeddings(VOCAB + 3)
    assert base.vae.decoder.lm_head.weight.shape[0] == base.vae.encoder.embed_tokens.weight.shape[0] == VOCAB + 3
    assert base.config.vocab_size == base.config.vae_config.vocab_size == VOCAB + 3
    base.save_pretrained(tmp_path / "base")
    ids = tokens(1, 2 * Q, seed=7)
    ids[0, 0] = VOCAB + 2
    again = ColaModel.from_pretrained(tmp_path / "base").eval()
    torch.testing.assert_close(again(input_ids=ids).last_hidden_state, base(input_ids=ids).last_hidden_state)
