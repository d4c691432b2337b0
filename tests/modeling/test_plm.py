"""PLM: objective, masks, Voronoi decoding, quadratic decoding (lossless), batching. The contract every family
shares (EOS, streamer, bad input, Hub load without the package, CLI) is in tests/test_family_contract.py."""


import pytest
import torch

from hf_latentlm.families import build_model
from hf_latentlm.modeling import PLMConfig, PLMForCausalLM
from hf_latentlm.modeling.modeling_plm import AcceptanceRule
from hf_latentlm.training.loop import TrainConfig, train

TINY_PLM = dict(block_size=4, k_pred=4, num_auxiliaries=128, auxiliary_top_m=32)


def tiny_plm(tokenizer, seed=0, **overrides) -> PLMForCausalLM:
    torch.manual_seed(seed)
    return build_model("plm", "tiny", tokenizer, **{**TINY_PLM, **overrides})


@pytest.fixture(scope="module")
def trained_plm(tokenizer, tiny_rows, tmp_path_factory):
    """A tiny PLM trained briefly on Shakespeare, so proposals are sometimes accepted."""
    model = tiny_plm(tokenizer)
    cfg = TrainConfig(family="plm", preset="tiny", output_dir=str(tmp_path_factory.mktemp("plm")), max_steps=120,
                      batch_size=8, seq_len=64, eval_every=0, save_every=120, progress_bar=False, seed=0)
    train(cfg, model=model, tokenizer=tokenizer, train_rows=tiny_rows[:1500])
    return model.eval()


def prompts_from(rows, lengths):
    return [rows[1600 + i, :n] for i, n in enumerate(lengths)]


# ---------------------------------------------------------------------------------------------- config / errors

@pytest.mark.parametrize("field,value", [("k_pred", 9), ("k_pred", 0), ("block_stride", 0), ("auxiliary_top_m", 5000),
                                         ("auxiliary_type", "gumbel"), ("acceptance", "greedy"),
                                         ("acceptance_epsilon", 1.5), ("acceptance_nucleus", 0.0)])
def test_bad_config_values_are_named(field, value):
    values = dict(vocab_size=4096, block_size=8)
    values[field] = value
    with pytest.raises(ValueError, match=field):
        PLMConfig(**values)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(num_beams=2), "num_beams"), (dict(k_pred=5), "k_pred"), (dict(k_pred=0), "k_pred"),
    (dict(acceptance="epsilon", acceptance_epsilon=0.0), "acceptance_epsilon"),
    (dict(acceptance="nucleus", acceptance_nucleus=1.0), "acceptance_nucleus"),
    (dict(temperature=0.7), "temperature"),
    (dict(max_new_tokens=600), "max_position_embeddings"), (dict(frobnicate=True), "frobnicate"),
])
def test_bad_generation_options_are_named(tokenizer, kwargs, needle):
    model = tiny_plm(tokenizer).eval()
    with pytest.raises(ValueError, match=needle):
        model.generate(torch.tensor([[5, 6, 7]]), **{"max_new_tokens": 4, **kwargs})


# ---------------------------------------------------------------------------------------------- training objective

def test_block_layout_covers_targets_and_truncates(tokenizer):
    model = tiny_plm(tokenizer, block_size=4, block_stride=4)
    pos, block, start = model.block_layout(11, phase=2)
    assert pos.tolist() == list(range(1, 11)), "stride = K decodes every target once"
    assert start.tolist() == [1, 1, 3, 3, 3, 3, 7, 7, 7, 7]  # phase 2: first block [-1, 3) truncated to [1, 3)
    assert block.unique().numel() == 3
    overlap = tiny_plm(tokenizer, block_size=4, block_stride=2)
    pos, _, _ = overlap.block_layout(11, phase=0)
    assert pos.numel() > 10 and set(pos.tolist()) == set(range(1, 11))


def test_decoder_rows_stop_after_end_of_document(tokenizer):
    model = tiny_plm(tokenizer)
    eos = tokenizer.eos_token_id
    ids = torch.tensor([[5, 6, eos, 7, 8, 9, 10, 11, 12]])
    pos, _, start = model.block_layout(ids.shape[1], phase=0)  # blocks [1..4], [5..8]
    valid = model.decoder_row_valid(ids, pos, start)[0]
    assert valid.tolist() == [True, True, False, False, True, True, True, True]


def test_loss_is_normalised_sum_of_parts(tokenizer, tiny_rows):
    model = tiny_plm(tokenizer, alignment_weight=0.0).eval()
    x = tiny_rows[:3]
    out = model(input_ids=x, labels=x)
    n_enc = x.shape[0] * (x.shape[1] - 1)
    n_dec = n_enc  # stride = K: each target decoded once; no EOS in these rows
    assert not (x == tokenizer.eos_token_id).any()
    expected = (out.encoder_nll * n_enc + out.decoder_nll * n_dec) / (n_enc + n_dec)
    torch.testing.assert_close(out.loss, expected)
    # The encoder logits are the model's plain causal forward, same shape with or without labels.
    torch.testing.assert_close(out.logits, model(input_ids=x).logits, atol=1e-5, rtol=0)
    assert 0.0 <= out.mask_auxiliary_fraction <= 1.0 and out.reconstructed_tokens >= 1.0


def test_loss_normalises_by_encoder_plus_decoder_terms_when_blocks_overlap(tokenizer, tiny_rows):
    """Stride 2 < K = 4 (blocks overlap, so most targets are decoded twice and n_dec ≈ 2·n_enc): the loss is
    (Σ enc NLL + Σ dec NLL) / (n_enc + n_dec) with n_dec counted by hand from the block starts 1 + 2z (phase 0 in
    eval), each block's rows truncated to targets in [1, T)."""
    model = tiny_plm(tokenizer, alignment_weight=0.0, block_stride=2).eval()
    x = tiny_rows[:2, :20]
    assert not (x == tokenizer.eos_token_id).any()
    out = model(input_ids=x, labels=x)
    T, K, s = x.shape[1], 4, 2
    n_enc = x.shape[0] * (T - 1)
    n_dec = x.shape[0] * sum(1 for z in range(T) for k in range(K) if 1 <= 1 + z * s + k < T)
    assert n_dec > 1.8 * n_enc
    expected = (out.encoder_nll * n_enc + out.decoder_nll * n_dec) / (n_enc + n_dec)
    torch.testing.assert_close(out.loss, expected)


def test_decoder_rows_never_see_their_own_targets(tokenizer, tiny_rows):
    """With the auxiliaries fixed (mask auxiliary everywhere), a decoder row whose block starts at or before
    position t must not change when token x_t changes; rows of later blocks may."""
    model = tiny_plm(tokenizer, auxiliary_type="none").eval()
    x = tiny_rows[:1, :20].clone()
    pos, _, start = model.block_layout(20, phase=0)
    t = 9
    y = x.clone()
    y[0, t] = (y[0, t] + 1) % 4096
    a = model(input_ids=x, labels=x).decoder_logits[0]
    b = model(input_ids=y, labels=y).decoder_logits[0]
    blind = start <= t
    torch.testing.assert_close(a[blind], b[blind], atol=1e-5, rtol=0)
    assert (a[~blind] - b[~blind]).abs().max() > 1e-4


def rows_without_eos(rows, tokenizer, count, length):
    picked = [r[:length] for r in rows if not (r[:length] == tokenizer.eos_token_id).any()][:count]
    return torch.stack(picked)


def test_masked_prompt_draws_auxiliaries_for_the_observed_tokens(trained_plm, tiny_rows, tokenizer, monkeypatch):
    """SFT labels mask the prompt with -100; each decoder row's auxiliary must still lie in the Voronoi cell of the
    token actually observed at its target position (it is an input of the later rows of its block)."""
    x = rows_without_eos(tiny_rows[1700:], tokenizer, 2, 30)
    labels = x.clone()
    labels[:, :11] = -100  # blocks of 4 start at 1, 5, 9, 13: the block 9..12 mixes prompt and response rows
    drawn = []
    original = trained_plm.draw_auxiliaries
    monkeypatch.setattr(trained_plm, "draw_auxiliaries", lambda *a: drawn.append(original(*a)) or drawn[-1])
    trained_plm(input_ids=x, labels=labels)
    aux = drawn[0][0]  # [B, D]
    dec_pos = trained_plm.block_layout(x.shape[1], 0)[0]
    # Independent reference: the owners of the plain forward's next-token distributions.
    q = trained_plm(input_ids=x).logits[:, :-1]
    owners = trained_plm.auxiliary_owners(q.reshape(-1, q.shape[-1]))[0].view(2, x.shape[1] - 1, -1)
    for b in range(2):
        for d, pos in enumerate(dec_pos.tolist()):
            cell = owners[b, pos - 1] == x[b, pos]
            if cell.any():
                assert aux[b, d] >= 0 and cell[aux[b, d]], (b, pos)
            else:
                assert aux[b, d] == -1, (b, pos)
    assert (aux[:, dec_pos < 11] >= 0).any(), "some prompt-side rows should have a cell to test"


def test_cells_are_fitted_only_where_the_observed_token_has_one(trained_plm, tiny_rows, monkeypatch):
    """Training fits the Voronoi cells only at positions whose observed token is an open top-M candidate, and draws
    exactly the auxiliaries of fitting every position (the same global-RNG numbers, the same cells)."""
    from hf_latentlm.modeling.auxiliaries import draw_auxiliary_in_cell, ranked_candidates

    cfg = trained_plm.config
    x = tiny_rows[1600:1604, :48]
    dec_pos = trained_plm.block_layout(x.shape[1], 2)[0]
    with torch.no_grad():
        q = trained_plm(input_ids=x).logits[:, :-1]
    flat_q = q.reshape(-1, q.shape[-1])
    candidates, capacities = ranked_candidates(flat_q, cfg.auxiliary_top_m, cfg.num_auxiliaries)
    has_cell = ((candidates == x[:, 1:].reshape(-1, 1)) & (capacities > 0)).any(1)
    assert 0 < int(has_cell.sum()) < has_cell.numel()
    from hf_latentlm.modeling import auxiliaries

    fitted_rows = []
    fit, original = auxiliaries.voronoi_owners, trained_plm.auxiliary_owners
    monkeypatch.setattr(auxiliaries, "voronoi_owners",
                        lambda logits, *a, **k: fitted_rows.append(logits.shape[0]) or fit(logits, *a, **k))
    trained_plm.train()
    try:
        torch.manual_seed(7)
        aux, tv = trained_plm.draw_auxiliaries(q, x, dec_pos)
    finally:
        trained_plm.eval()
    assert fitted_rows == [int(has_cell.sum())] and tv.shape == (int(has_cell.sum()),)
    # Reference: every position fitted, the same draw.
    owners = original(flat_q)[0].view(x.shape[0], x.shape[1] - 1, -1)[:, dec_pos - 1]
    torch.manual_seed(7)
    reference = draw_auxiliary_in_cell(owners.reshape(-1, owners.shape[-1]), x[:, dec_pos].reshape(-1))
    assert torch.equal(aux.reshape(-1), reference)
    assert (reference >= 0).any() and (reference < 0).any()


def test_no_cell_to_fit_reads_the_mask_auxiliary_everywhere(trained_plm, tiny_rows, monkeypatch):
    """When no observed token is an open candidate, nothing is fitted: every row reads the mask auxiliary and the
    logged TV is 0 (a mean over no fitted position), not NaN; otherwise it is the mean over the fitted positions."""
    model = trained_plm
    x = tiny_rows[1600:1602, :24]
    q = torch.zeros(2, 23, model.config.vocab_size)
    q.scatter_(2, x[:, 1:, None], -100.0)  # each observed token far below the others: outside the top M
    dec_pos = model.block_layout(24, 0)[0]
    aux, tv = model.draw_auxiliaries(q, x, dec_pos)
    assert (aux == -1).all() and tv.numel() == 0
    drawn = []
    original = model.draw_auxiliaries
    monkeypatch.setattr(model, "draw_auxiliaries", lambda *a: drawn.append(original(*a)) or drawn[-1])
    logged = model(input_ids=x, labels=x).auxiliary_tv
    assert drawn[-1][1].numel() > 0 and torch.equal(logged, drawn[-1][1].mean())
    monkeypatch.setattr(model, "draw_auxiliaries", lambda q_logits, input_ids, positions: (aux, tv))
    assert model(input_ids=x, labels=x).auxiliary_tv == 0


def test_masked_loss_is_the_unmasked_loss_restricted_to_the_response(trained_plm, tiny_rows, tokenizer):
    """Labels only decide which rows are scored: the masked loss equals the unmasked run's per-row losses summed over
    the response rows (targets = the observed tokens at the row's position, not shifted), over their count."""
    model = trained_plm
    weight = model.config.alignment_weight
    model.config.alignment_weight = 0.0
    try:
        x = rows_without_eos(tiny_rows[1700:], tokenizer, 2, 30)
        labels = x.clone()
        labels[:, :11] = -100
        full = model(input_ids=x, labels=x)
        masked = model(input_ids=x, labels=labels)
    finally:
        model.config.alignment_weight = weight
    dec_pos = model.block_layout(x.shape[1], 0)[0]
    enc_nll = torch.nn.functional.cross_entropy(full.logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
    dec_nll = torch.nn.functional.cross_entropy(full.decoder_logits.transpose(1, 2), x[:, dec_pos], reduction="none")
    enc_rows = torch.arange(1, x.shape[1]) >= 11
    dec_rows = dec_pos >= 11
    expected = (enc_nll[:, enc_rows].sum() + dec_nll[:, dec_rows].sum()) / (2 * enc_rows.sum() + 2 * dec_rows.sum())
    torch.testing.assert_close(masked.loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(masked.encoder_nll, enc_nll[:, enc_rows].mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(masked.decoder_nll, dec_nll[:, dec_rows].mean(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(masked.loss, full.loss)


def test_alignment_loss_matches_a_hand_computation(trained_plm, tiny_rows, tokenizer):
    """1 - cos(g_psi(decoder mid residual at layer L//3), encoder mid residual at layer L//2 of the row j-1 that
    predicts the same target x_j), averaged over scored decoder rows; mid residuals read from the blocks' inputs to
    their post-attention norm."""
    model, cfg = trained_plm, trained_plm.config
    x = rows_without_eos(tiny_rows[1700:], tokenizer, 2, 24)
    seen = {cfg.alignment_encoder_layer: [], cfg.alignment_decoder_layer: []}
    hooks = [model.model.layers[i].post_attention_layernorm.register_forward_hook(
        lambda mod, args, out, i=i: seen[i].append(args[0].detach())) for i in seen]
    try:
        out = model(input_ids=x, labels=x)
    finally:
        for h in hooks:
            h.remove()
    enc_mid = seen[cfg.alignment_encoder_layer][0]  # first call: the encoder pass [B, T, d]
    dec_mid = seen[cfg.alignment_decoder_layer][-1]  # last call: the decoder pass [B, D, d]
    dec_pos = model.block_layout(x.shape[1], 0)[0]
    assert enc_mid.shape[1] == x.shape[1] and dec_mid.shape[1] == dec_pos.numel()
    with torch.no_grad():
        cos = torch.nn.functional.cosine_similarity(model.alignment_proj(dec_mid), enc_mid[:, dec_pos - 1], dim=-1)
    torch.testing.assert_close(out.alignment_loss, (1 - cos).mean(), atol=1e-5, rtol=1e-5)
    n = 2 * (x.shape[1] - 1)
    torch.testing.assert_close(out.loss, (out.encoder_nll * n + out.decoder_nll * n
                                          + cfg.alignment_weight * out.alignment_loss * n) / (2 * n))


def test_alignment_target_is_a_stop_gradient(tokenizer, tiny_rows):
    """sg[encoder state] (Eq. 11): the gradient reaching the encoder's mid residual (layer L//2, the alignment
    target) is the same with the alignment term (λ = 5) as without it (λ = 0), while the decoder's mid residual and
    g_ψ do get the term's gradient. Eval mode: fixed auxiliary quantiles, so both passes see the same draws."""
    model = tiny_plm(tokenizer).eval()
    cfg = model.config
    x = tiny_rows[:2, :16]
    captured = {}

    def capture(layer):
        def hook(module, args):
            tensor = args[0]
            if tensor.requires_grad:
                tensor.retain_grad()
            captured.setdefault(layer, []).append(tensor)
        return hook

    hooks = [model.model.layers[i].post_attention_layernorm.register_forward_pre_hook(capture(i))
             for i in (cfg.alignment_encoder_layer, cfg.alignment_decoder_layer)]
    grads = {}
    try:
        for weight in (5.0, 0.0):
            cfg.alignment_weight = weight
            captured.clear()
            model.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            encoder_mid = captured[cfg.alignment_encoder_layer][0]  # first call: the encoder pass
            decoder_mid = captured[cfg.alignment_decoder_layer][-1]  # last call: the decoder pass
            grads[weight] = (encoder_mid.grad.clone(), decoder_mid.grad.clone(), model.alignment_proj.weight.grad)
    finally:
        cfg.alignment_weight = 5.0
        for h in hooks:
            h.remove()
    (enc_w, dec_w, proj_w), (enc_0, dec_0, proj_0) = grads[5.0], grads[0.0]
    assert proj_0 is None and proj_w is not None and proj_w.abs().max() > 0
    assert (dec_w - dec_0).abs().max() > 1e-3 * dec_0.abs().max()  # the term does have a gradient
    torch.testing.assert_close(enc_w, enc_0, atol=1e-6 * float(enc_0.abs().max()), rtol=0)


def test_zero_alignment_weight_skips_the_alignment(tokenizer, tiny_rows):
    model = tiny_plm(tokenizer, alignment_weight=0.0).train()
    out = model(input_ids=tiny_rows[:2, :16], labels=tiny_rows[:2, :16])
    out.loss.backward()
    assert out.alignment_loss is None
    assert model.alignment_proj.weight.grad is None


def test_objective_and_plain_forward_agree_under_left_padding(trained_plm, tiny_rows, tokenizer):
    """With a 2-D attention_mask the objective's encoder logits are the plain forward's, and a padded row's equal the
    same tokens unpadded; padded targets are not scored even when labelled."""
    x = rows_without_eos(tiny_rows[1700:], tokenizer, 2, 20)
    ids = torch.cat([torch.full((1, 5), tokenizer.pad_token_id), x[:1]], dim=1)
    ids = torch.cat([ids, x[1:2, :25] if x.shape[1] >= 25 else torch.cat([x[1:2], x[1:2, :5]], 1)])
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    out = trained_plm(input_ids=ids, attention_mask=mask, labels=ids)  # pads labelled on purpose
    plain = trained_plm(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out.logits[0, 5:], plain[0, 5:], atol=1e-5, rtol=0)
    alone = trained_plm(input_ids=x[:1]).logits[0]
    torch.testing.assert_close(out.logits[0, 5:], alone, atol=1e-5, rtol=0)
    labels = ids.clone()
    labels[0, :5] = -100
    torch.testing.assert_close(trained_plm(input_ids=ids, attention_mask=mask, labels=labels).loss, out.loss)


def test_gradient_checkpointing_gives_the_same_gradients(tokenizer, tiny_rows):
    x = tiny_rows[:2, :32]
    grads = []
    for checkpointing in (False, True):
        model = tiny_plm(tokenizer)
        if checkpointing:
            model.activation_checkpointing_enable()
        model.train()
        torch.manual_seed(5)  # same block phase and auxiliary draws
        model(input_ids=x, labels=x).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_block_layout_takes_a_tensor_phase(tokenizer):
    """The training step's phase stays a tensor (no Python int, no graph break under torch.compile)."""
    for stride in (4, 2, 5):
        model = tiny_plm(tokenizer, block_size=4, block_stride=stride)
        for phase in range(stride):
            as_int = model.block_layout(13, phase)
            as_tensor = model.block_layout(13, torch.tensor(phase))
            assert all(torch.equal(a, b) for a, b in zip(as_int, as_tensor)), (stride, phase)
            assert int(as_int[1].max()) < model.num_layout_blocks(13)


def test_eval_objective_is_deterministic_and_training_still_samples(trained_plm, tiny_rows):
    """Eval mode reads no RNG (phase 0, fixed numbers for the auxiliary draws); training draws the phase and the
    auxiliaries from the global RNG, so a seed repeats a step and another seed changes it. (The trained model:
    an untrained one rarely has the target in its top M, so every row would read the mask auxiliary.)"""
    x = tiny_rows[1600:1602, :32]
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        runs.append(trained_plm(input_ids=x, labels=x))
    assert runs[0].mask_auxiliary_fraction < 0.9  # a good share of the rows read a drawn auxiliary
    assert torch.equal(runs[0].loss, runs[1].loss) and torch.equal(runs[0].decoder_logits, runs[1].decoder_logits)
    losses = []
    try:
        trained_plm.train()
        for seed in (1, 1, 2):
            torch.manual_seed(seed)
            losses.append(trained_plm(input_ids=x, labels=x).loss)
    finally:
        trained_plm.eval()
    assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], losses[2])


def test_eval_objective_of_a_row_does_not_depend_on_its_batch(trained_plm, tiny_rows):
    x = tiny_rows[1600:1603, :32]
    batched = trained_plm(input_ids=x, labels=x)
    for b in range(3):
        alone = trained_plm(input_ids=x[b:b + 1], labels=x[b:b + 1])
        torch.testing.assert_close(batched.decoder_logits[b], alone.decoder_logits[0], atol=1e-5, rtol=0)


def test_resize_token_embeddings_keeps_the_checkpoint_consistent(tokenizer, tmp_path):
    """Embedding, LM head and config.vocab_size move together, and the result saves, loads, generates and trains;
    a size below auxiliary_top_m (a config that could not be loaded again) is refused before anything changes."""
    model = tiny_plm(tokenizer).eval()
    with pytest.raises(ValueError, match="auxiliary_top_m"):
        model.resize_token_embeddings(model.config.auxiliary_top_m - 1)
    with pytest.raises(ValueError, match="auxiliary_top_m"):
        model.model.resize_token_embeddings(20, pad_to_multiple_of=8)  # the base model too (AutoModel)
    assert model.config.vocab_size == 4096 == model.lm_head.out_features == model.model.embed_tokens.num_embeddings
    for requested, size in ((4100, 4100), (33, 40)):
        model.resize_token_embeddings(requested, pad_to_multiple_of=8 if requested == 33 else None)
        assert model.config.vocab_size == size == model.lm_head.out_features == model.model.embed_tokens.num_embeddings
        model.save_pretrained(tmp_path / str(size))
        again = PLMForCausalLM.from_pretrained(tmp_path / str(size)).eval()
        x = torch.tensor([[5, 6, 7, 8, 9]]) % size
        torch.testing.assert_close(again(input_ids=x).logits, model(input_ids=x).logits)
        out = again.generate(x, max_new_tokens=6, auxiliary_seeds=[1], eos_token_id=None)
        assert out.shape == (1, 11) and (out < size).all()
        assert torch.isfinite(again(input_ids=out, labels=out).loss)


# ---------------------------------------------------------------------------------------------- decoding

def test_exact_quadratic_decoding_is_lossless(trained_plm, tiny_rows):
    """Same auxiliary draws -> exact quadratic decoding emits exactly the tokens of one-token-per-call
    Voronoi sampling, with fewer model calls."""
    total_tokens, total_calls = 0, 0
    for i, n in enumerate((5, 12, 30)):
        prompt = tiny_rows[1600 + i, :n][None]
        kwargs = dict(max_new_tokens=40, auxiliary_seeds=[100 + i], eos_token_id=None, return_dict_in_generate=True)
        reference = trained_plm.generate(prompt, decoding="voronoi", **kwargs)
        fast = trained_plm.generate(prompt, decoding="quadratic", acceptance="exact", **kwargs)
        assert fast.sequences.tolist() == reference.sequences.tolist()
        assert reference.model_calls.item() == 1 + 40  # prefill + one call per token
        total_tokens += 40
        total_calls += fast.model_calls.item() - 1
    assert total_calls < total_tokens, "exact decoding must accept some proposals after training"


def test_batched_rows_match_running_each_alone(trained_plm, tiny_rows, tokenizer, left_pad):
    prompts = prompts_from(tiny_rows, (3, 17, 9))
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    seeds = [7, 8, 9]
    for decoding in ("quadratic", "voronoi"):
        batched = trained_plm.generate(ids, attention_mask=mask, max_new_tokens=24, auxiliary_seeds=seeds,
                                       eos_token_id=None, decoding=decoding)
        for b, p in enumerate(prompts):
            alone = trained_plm.generate(p[None], max_new_tokens=24, auxiliary_seeds=[seeds[b]], eos_token_id=None,
                                         decoding=decoding)
            assert batched[b, ids.shape[1]:].tolist() == alone[0, p.numel():].tolist(), (decoding, b)


def test_relaxed_acceptance_takes_several_tokens_per_call(trained_plm, tiny_rows):
    prompt = tiny_rows[1600, :10][None]
    out = trained_plm.generate(prompt, max_new_tokens=41, acceptance="epsilon", acceptance_epsilon=1e-12,
                               auxiliary_seeds=[3], eos_token_id=None, return_dict_in_generate=True)
    # Nearly every pending token clears q > 1e-12: the first round commits 1 token, later ones K_pred.
    assert out.num_new_tokens.item() == 41
    assert out.model_calls.item() <= 1 + 1 + 10 + 2  # prefill, first round, then ~K_pred tokens per call


# ---------------------------------------------------------------------------------------------- checkpoints and measurements

def test_reload_restores_bank_and_rotary(trained_plm, tmp_path):
    trained_plm.save_pretrained(tmp_path / "ckpt")
    again = PLMForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert torch.equal(again.model.auxiliary_bank, trained_plm.model.auxiliary_bank)
    assert torch.equal(again.model.rotary.inv_freq, trained_plm.model.rotary.inv_freq)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(again(input_ids=x).logits, trained_plm(input_ids=x).logits)


def test_plm_measurements_match_generate_and_forward(trained_plm, tiny_rows):
    from hf_latentlm.eval.plm import reconstruction, tokens_per_call

    rows = tiny_rows[1600:1604]
    parts = reconstruction(trained_plm, rows, batch_size=2)
    out = trained_plm(input_ids=rows[:2], labels=rows[:2])
    assert 1.0 <= parts["reconstructed_tokens"] <= trained_plm.config.block_size
    assert 0 < parts["encoder_nll"] < 10 and 0.0 <= parts["mask_auxiliary_fraction"] <= 1.0
    torch.manual_seed(0)
    own = trained_plm.generate(rows[:2, :16], max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True)
    assert tokens_per_call(trained_plm, rows[:2, :16], 12, seed=0) == pytest.approx(
        float(own.num_new_tokens.sum() / own.model_calls.sum()))
    assert out.encoder_nll.item() > 0


@pytest.mark.parametrize("rule,expected", [
    # probabilities 0.5 / 0.3 / 0.15 / 0.05; the sampler drew token 0 at every row; pending tokens 0, 1, 2, 3.
    (AcceptanceRule("exact"), [True, False, False, False]),
    (AcceptanceRule("epsilon", epsilon=0.1), [True, True, True, False]),  # q(x) > 0.1
    (AcceptanceRule("epsilon", epsilon=0.01), [True, True, True, True]),
    (AcceptanceRule("nucleus", nucleus=0.94), [True, True, True, False]),  # mass above x: 0, .5, .8, .95
    (AcceptanceRule("nucleus", nucleus=0.7), [True, True, False, False]),
])
def test_acceptance_rules_on_a_known_distribution(rule, expected):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(1, 4, 4)
    pending = torch.tensor([[0, 1, 2, 3]])
    assert rule.accepts(pending, torch.zeros_like(pending), logits)[0].tolist() == expected


@pytest.mark.parametrize("rule,expected", [
    # probabilities 0.5 / 0.3 / 0.15 / 0.05; the sampler drew the unlikely token 3 at every row; pending 0..3.
    (AcceptanceRule("exact"), [False, False, False, True]),
    (AcceptanceRule("epsilon", epsilon=0.1), [True, True, True, True]),  # token 3: q = .05 < .1, but sampled
    (AcceptanceRule("nucleus", nucleus=0.7), [True, True, False, True]),  # token 3: mass above .95, but sampled
])
def test_relaxed_rules_still_accept_the_sampled_token_where_the_relaxation_would_not(rule, expected):
    """The relaxed rules extend exact acceptance: a pending token equal to the Voronoi draw is kept even where its
    probability (or the mass above it) alone would reject it."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(1, 4, 4)
    pending = torch.tensor([[0, 1, 2, 3]])
    assert rule.accepts(pending, torch.full_like(pending, 3), logits)[0].tolist() == expected


def test_bad_acceptance_rules_are_named():
    for kwargs, needle in ((dict(rule="greedy"), "acceptance must be"), (dict(epsilon=0.0), "acceptance_epsilon"),
                           (dict(nucleus=1.0), "acceptance_nucleus")):
        with pytest.raises(ValueError, match=needle):
            AcceptanceRule(**kwargs)
