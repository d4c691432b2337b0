"""Tests for the shared transformer core (hf_latentlm/modeling/layers.py). Tiny sizes, CPU only."""


import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicCache

from hf_latentlm.modeling.layers import (
    Attention,
    DecoderBlock,
    DiTBlock,
    OffsetCache,
    ReadOnlyCache,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    apply_rotary,
    block_causal_layout,
    block_causal_mask,
    causal_layout,
    causal_mask,
    dual_stream_mask,
    init_backbone_weights,
    make_padding_position_ids,
    visibility_mask,
)


HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8


def _rotary(pos, head_dim=HEAD_DIM):
    return RotaryEmbedding(head_dim)(pos)


def _attn(num_kv_heads=KV_HEADS, qk_norm=False, seed=0):
    torch.manual_seed(seed)
    return Attention(HIDDEN, HEADS, num_kv_heads, qk_norm=qk_norm, layer_idx=0).eval()


# --------------------------------------------------------------------------------------------------------------------
# Mask builders vs brute force
# --------------------------------------------------------------------------------------------------------------------


def _random_padding(batch, seq, side, gen):
    pad = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        n = int(torch.randint(0, seq, (1,), generator=gen))  # keep at least one real token
        if n:
            if side == "left":
                pad[b, :n] = 0
            else:
                pad[b, seq - n :] = 0
    return pad


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (5, 5), (1, 7), (3, 9), (4, 4)])
def test_causal_mask_brute_force(q_len, kv_len):
    past = kv_len - q_len
    m = causal_mask(q_len, kv_len, device="cpu")
    assert m.dtype == torch.bool and m.shape == (1, 1, q_len, kv_len)
    for i in range(q_len):
        for j in range(kv_len):
            assert bool(m[0, 0, i, j]) == (j <= past + i)


def test_causal_mask_explicit_past_len():
    m = causal_mask(3, 10, device="cpu", past_len=2)  # queries at columns 2,3,4 (keys after them hidden)
    for i in range(3):
        for j in range(10):
            assert bool(m[0, 0, i, j]) == (j <= 2 + i)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("q_len,kv_len", [(6, 6), (2, 7)])
def test_causal_mask_padding_brute_force(side, q_len, kv_len):
    gen = torch.Generator().manual_seed(1)
    pad = _random_padding(3, kv_len, side, gen)
    past = kv_len - q_len
    m = causal_mask(q_len, kv_len, padding_mask=pad)
    assert m.shape == (3, 1, q_len, kv_len)
    for b in range(3):
        for i in range(q_len):
            for j in range(kv_len):
                expected = (j <= past + i and bool(pad[b, j])) or j == past + i
                assert bool(m[b, 0, i, j]) == expected
            assert m[b, 0, i].any()


@pytest.mark.parametrize("seq_len,block_size", [(1, 1), (7, 1), (8, 4), (10, 3), (5, 8)])
def test_block_causal_brute_force(seq_len, block_size):
    m = block_causal_mask(seq_len, block_size)
    assert m.dtype == torch.bool and m.shape == (1, 1, seq_len, seq_len)
    for i in range(seq_len):
        for j in range(seq_len):
            assert bool(m[0, 0, i, j]) == (j // block_size <= i // block_size)


@pytest.mark.parametrize("seq_len,block_size", [(9, 2), (8, 4), (6, 1)])
def test_block_causal_padding_brute_force(seq_len, block_size):
    gen = torch.Generator().manual_seed(seq_len)
    pad = _random_padding(4, seq_len, "right", gen)
    m = block_causal_mask(seq_len, block_size, padding_mask=pad)
    assert m.shape == (4, 1, seq_len, seq_len)
    for b in range(4):
        for i in range(seq_len):
            for j in range(seq_len):
                expected = (j // block_size <= i // block_size and bool(pad[b, j])) or i == j
                assert bool(m[b, 0, i, j]) == expected
            assert m[b, 0, i].any()  # no empty rows, padded rows included


@pytest.mark.parametrize("seq_len", [1, 5, 12])
def test_block_size_one_is_causal(seq_len):
    assert torch.equal(block_causal_mask(seq_len, 1), causal_mask(seq_len, seq_len, device="cpu"))
    pad = _random_padding(3, seq_len, "right", torch.Generator().manual_seed(0))
    assert torch.equal(block_causal_mask(seq_len, 1, pad), causal_mask(seq_len, seq_len, padding_mask=pad))


def _visibility_brute(qp, ql, qg, kp, kg, kv):
    B, Tq = qp.shape
    Tk = kp.shape[1]
    out = torch.zeros(B, 1, Tq, Tk, dtype=torch.bool)
    for b in range(B):
        for r in range(Tq):
            for c in range(Tk):
                if not kv[b, c]:
                    continue
                if kg[b, c] < 0:
                    ok = kp[b, c] < ql[b, r]
                else:
                    ok = kg[b, c] == qg[b, r] and kp[b, c] <= qp[b, r]
                out[b, 0, r, c] = bool(ok)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_visibility_mask_random_descriptors(seed):
    gen = torch.Generator().manual_seed(seed)
    B = 1 + seed % 3
    Tq, Tk = 3 + seed, 5 + 2 * seed
    rnd = lambda hi, n, lo=0: torch.randint(lo, hi, (B, n), generator=gen)  # noqa: E731
    qp, ql, qg = rnd(12, Tq), rnd(13, Tq), rnd(3, Tq, lo=-1)
    kp, kg = rnd(12, Tk), rnd(3, Tk, lo=-1)
    kv = torch.rand(B, Tk, generator=gen) > 0.2
    m = visibility_mask(qp, ql, qg, kp, kg, key_valid=kv)
    assert m.dtype == torch.bool and m.shape == (B, 1, Tq, Tk)
    assert torch.equal(m, _visibility_brute(qp, ql, qg, kp, kg, kv))
    # without key_valid = all keys valid
    m2 = visibility_mask(qp, ql, qg, kp, kg)
    assert torch.equal(m2, _visibility_brute(qp, ql, qg, kp, kg, torch.ones(B, Tk, dtype=torch.bool)))


def test_visibility_mask_unbatched_descriptors_broadcast():
    gen = torch.Generator().manual_seed(3)
    qp, ql, qg = torch.randint(0, 8, (5,), generator=gen), torch.randint(0, 9, (5,), generator=gen), torch.tensor(
        [-1, 0, 0, 1, 1]
    )
    kp, kg = torch.randint(0, 8, (2, 7), generator=gen), torch.randint(-1, 2, (2, 7), generator=gen)
    m = visibility_mask(qp, ql, qg, kp, kg)
    assert m.shape == (2, 1, 5, 7)
    ones = torch.ones(2, 7, dtype=torch.bool)
    expected = _visibility_brute(qp.expand(2, 5), ql.expand(2, 5), qg.expand(2, 5), kp, kg, ones)
    assert torch.equal(m, expected)


def test_visibility_mask_plm_layout():
    """Encoder rows causal over tokens; decoder rows of block [i_z, i_z+K) see clean < i_z and own block <= pos."""
    T, K, starts = 8, 3, [1, 4, 7]
    enc_pos = torch.arange(T)
    dec_pos, dec_limit, dec_group = [], [], []
    for z, s in enumerate(starts):
        for j in range(s, min(s + K, T)):
            dec_pos.append(j), dec_limit.append(s), dec_group.append(z)
    dec_pos, dec_limit, dec_group = map(torch.tensor, (dec_pos, dec_limit, dec_group))
    q_pos = torch.cat([enc_pos, dec_pos])
    q_limit = torch.cat([enc_pos + 1, dec_limit])
    q_group = torch.cat([torch.full((T,), -1), dec_group])
    m = visibility_mask(q_pos, q_limit, q_group, q_pos, q_group)[0, 0]
    # encoder block = causal, encoder never sees decoder rows
    assert torch.equal(m[:T, :T], causal_mask(T, T, device="cpu")[0, 0])
    assert not m[:T, T:].any()
    for r in range(len(dec_pos)):
        j, s, z = int(dec_pos[r]), int(dec_limit[r]), int(dec_group[r])
        assert torch.equal(m[T + r, :T], enc_pos < s)
        assert torch.equal(m[T + r, T:], (dec_group == z) & (dec_pos <= j))
        assert m[T + r, T + r]  # sees itself


def test_make_padding_position_ids():
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 0, 0]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [0, 1, 2, 2, 2]])
    pos = make_padding_position_ids(am)
    assert pos.dtype == torch.long and torch.equal(pos, expected)


# --------------------------------------------------------------------------------------------------------------------
# Norm / MLP / rotary
# --------------------------------------------------------------------------------------------------------------------


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(3, 4, 16)
    expected = norm.weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-5)
    # bf16 in -> bf16 out, computed in float32
    y = norm(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, atol=3e-2, rtol=2e-2)


def test_swiglu_matches_formula():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(8, 12)
    assert all(m.bias is None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    x = torch.randn(2, 3, 8)
    g, u = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    expected = (g * torch.sigmoid(g) * u) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=1e-5)


def test_rotary_shapes_buffer_and_formula():
    rope = RotaryEmbedding(HEAD_DIM, base=10000.0)
    assert "inv_freq" not in rope.state_dict()  # non-persistent
    pos = torch.tensor([[0, 1, 2, 10, 11], [3, 3, 7, 0, 100]])
    cos, sin = rope(pos)
    assert cos.shape == sin.shape == (2, 5, HEAD_DIM)
    inv = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    ang = pos[..., None].float() * inv
    torch.testing.assert_close(cos, torch.cat([ang, ang], -1).cos())
    torch.testing.assert_close(sin, torch.cat([ang, ang], -1).sin())
    torch.testing.assert_close(rope.compute_inv_freq(), rope.inv_freq)


def test_apply_rotary_rotate_half_convention():
    """Pair (x[i], x[i + D/2]) is rotated by angle pos * inv_freq[i] (Llama / HF convention)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 3, 4, HEAD_DIM), torch.randn(1, 1, 4, HEAD_DIM)
    pos = torch.tensor([[0, 5, 2, 9]])
    qr, kr = apply_rotary(q, k, *_rotary(pos))
    half = HEAD_DIM // 2
    inv = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    ang = (pos[0, :, None].float() * inv)  # [T, D/2]
    for x, xr in ((q, qr), (k, kr)):
        a, b = x[..., :half], x[..., half:]
        expected = torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1)
        torch.testing.assert_close(xr, expected)


def test_rotary_noncontiguous_positions_differ():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 5, HEAD_DIM), torch.randn(1, 2, 5, HEAD_DIM)
    gap = torch.tensor([[0, 1, 2, 10, 11]])
    dense = torch.arange(5)[None]
    qa, ka = apply_rotary(q, k, *_rotary(gap))
    qb, kb = apply_rotary(q, k, *_rotary(dense))
    torch.testing.assert_close(qa[:, :, :3], qb[:, :, :3])  # same positions, same rotation
    assert not torch.allclose(qa[:, :, 3:], qb[:, :, 3:], atol=1e-3)
    assert not torch.allclose(ka[:, :, 3:], kb[:, :, 3:], atol=1e-3)
    # rotation preserves norms
    torch.testing.assert_close(qa.norm(dim=-1), q.norm(dim=-1))


def test_rotary_scores_depend_only_on_relative_offset():
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 5, HEAD_DIM), torch.randn(2, 2, 5, HEAD_DIM)
    pos = torch.tensor([[0, 1, 2, 10, 11], [4, 2, 9, 9, 30]])
    qa, ka = apply_rotary(q, k, *_rotary(pos))
    qb, kb = apply_rotary(q, k, *_rotary(pos + 37))
    torch.testing.assert_close(qa @ ka.transpose(-1, -2), qb @ kb.transpose(-1, -2), atol=1e-4, rtol=1e-4)


def test_attention_shift_invariant_but_position_sensitive():
    attn = _attn()
    torch.manual_seed(1)
    x = torch.randn(2, 5, HIDDEN)
    mask = causal_mask(5, 5, device="cpu")
    pos = torch.tensor([[0, 1, 2, 10, 11]]).expand(2, 5)
    with torch.no_grad():
        a = attn(x, *_rotary(pos), mask)
        b = attn(x, *_rotary(pos + 123), mask)
        c = attn(x, *_rotary(torch.arange(5)[None].expand(2, 5)), mask)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(a[:, :3], c[:, :3], atol=1e-6, rtol=1e-5)  # rows 0..2 see identical positions
    assert not torch.allclose(a[:, 3:], c[:, 3:], atol=1e-4)


# --------------------------------------------------------------------------------------------------------------------
# Attention: cache, GQA, masked rows
# --------------------------------------------------------------------------------------------------------------------


def _full_pass(attn, x, pos):
    T = x.shape[1]
    with torch.no_grad():
        return attn(x, *_rotary(pos), causal_mask(T, T, device="cpu"))


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("num_kv_heads", [HEADS, KV_HEADS])
def test_attention_cache_two_chunks_matches_full(qk_norm, num_kv_heads):
    attn = _attn(num_kv_heads, qk_norm)
    torch.manual_seed(2)
    B, T, P = 2, 9, 4
    x = torch.randn(B, T, HIDDEN)
    pos = torch.arange(T)[None].expand(B, T)
    full = _full_pass(attn, x, pos)

    cache = DynamicCache()
    with torch.no_grad():
        first = attn(x[:, :P], *_rotary(pos[:, :P]), causal_mask(P, P, device="cpu"), cache=cache)
        assert cache.get_seq_length() == P
        second = attn(x[:, P:], *_rotary(pos[:, P:]), causal_mask(T - P, T, device="cpu"), cache=cache)
    assert cache.get_seq_length() == T
    torch.testing.assert_close(first, full[:, :P], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, full[:, P:], atol=1e-5, rtol=1e-5)


def test_attention_cache_token_by_token_matches_full():
    attn = _attn()
    torch.manual_seed(3)
    B, T = 2, 7
    x = torch.randn(B, T, HIDDEN)
    pos = torch.arange(T)[None].expand(B, T)
    full = _full_pass(attn, x, pos)
    cache = DynamicCache()
    outs = []
    with torch.no_grad():
        for t in range(T):
            outs.append(attn(x[:, t : t + 1], *_rotary(pos[:, t : t + 1]), causal_mask(1, t + 1, device="cpu"), cache))
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_decoder_blocks_with_cache_match_full():
    torch.manual_seed(4)
    blocks = [DecoderBlock(HIDDEN, HEADS, KV_HEADS, 48, layer_idx=i).eval() for i in range(2)]
    B, T, P = 2, 8, 5
    x = torch.randn(B, T, HIDDEN)
    pos = torch.arange(T)[None].expand(B, T)

    def run(h, p, mask, cache=None):
        cos, sin = _rotary(p)
        for blk in blocks:
            h = blk(h, cos, sin, mask, cache=cache)
        return h

    with torch.no_grad():
        full = run(x, pos, causal_mask(T, T, device="cpu"))
        cache = DynamicCache()
        run(x[:, :P], pos[:, :P], causal_mask(P, P, device="cpu"), cache)
        cont = run(x[:, P:], pos[:, P:], causal_mask(T - P, T, device="cpu"), cache)
    torch.testing.assert_close(cont, full[:, P:], atol=1e-5, rtol=1e-5)


def _reference_attention(attn, x, cos, sin, mask):
    """Explicit GQA reference: repeat_interleave kv heads, softmax(QK^T/sqrt(d) masked) V."""
    B, T, _ = x.shape
    q = (x @ attn.q_proj.weight.T).view(B, T, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary(q, k, cos, sin)
    rep = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / attn.head_dim**0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(B, T, -1) @ attn.o_proj.weight.T


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("use_mask", [True, False])
def test_gqa_matches_repeat_interleave_reference(num_kv_heads, use_mask):
    attn = _attn(num_kv_heads)
    torch.manual_seed(5)
    B, T = 2, 6
    x = torch.randn(B, T, HIDDEN)
    cos, sin = _rotary(torch.arange(T)[None].expand(B, T))
    mask = block_causal_mask(T, 2) if use_mask else None
    with torch.no_grad():
        out = attn(x, cos, sin, mask)
        ref = _reference_attention(attn, x, cos, sin, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_head_specific_mask_and_head_dim_override():
    torch.manual_seed(6)
    attn = Attention(HIDDEN, HEADS, KV_HEADS, head_dim=6, layer_idx=0).eval()
    B, T = 1, 5
    x = torch.randn(B, T, HIDDEN)
    cos, sin = RotaryEmbedding(6)(torch.arange(T)[None])
    mask = torch.rand(B, HEADS, T, T, generator=torch.Generator().manual_seed(0)) > 0.4
    mask |= torch.eye(T, dtype=torch.bool)
    with torch.no_grad():
        out, ref = attn(x, cos, sin, mask), _reference_attention(attn, x, cos, sin, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fully_masked_row_gives_zeros_and_finite_grads():
    attn = _attn()
    attn.train()
    torch.manual_seed(7)
    B, T = 2, 5
    x = torch.randn(B, T, HIDDEN, requires_grad=True)
    cos, sin = _rotary(torch.arange(T)[None].expand(B, T))
    mask = causal_mask(T, T, device="cpu").expand(B, 1, T, T).clone()
    mask[0, 0, 2] = False  # row 2 of batch 0 sees nothing
    mask[1, 0, 0] = False
    out = attn(x, cos, sin, mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 2], torch.zeros(HIDDEN))
    assert torch.equal(out[1, 0], torch.zeros(HIDDEN))
    # other rows unaffected
    ref = _reference_attention(attn, x, cos, sin, causal_mask(T, T, device="cpu"))
    torch.testing.assert_close(out[0, [0, 1, 3, 4]], ref[0, [0, 1, 3, 4]], atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters())


def _naive_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, enable_gqa=False, **kwargs):
    """Textbook SDPA: a fully masked row is softmax over all -inf = NaN (what some GPU kernels return)."""
    if enable_gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return scores.softmax(-1) @ v


def test_fully_masked_row_guard_with_nan_producing_backend(monkeypatch):
    """torch's CPU kernels already give 0 for empty rows; the guard must also hold for a backend that gives NaN."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _naive_sdpa)
    attn = _attn().train()
    torch.manual_seed(10)
    B, T = 2, 4
    x = torch.randn(B, T, HIDDEN, requires_grad=True)
    cos, sin = _rotary(torch.arange(T)[None].expand(B, T))
    mask = causal_mask(T, T, device="cpu").expand(B, 1, T, T).clone()
    mask[1, 0, 3] = False
    out = attn(x, cos, sin, mask)
    assert torch.isfinite(out).all() and torch.equal(out[1, 3], torch.zeros(HIDDEN))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters())


def test_attention_rejects_float_mask():
    attn = _attn()
    x = torch.randn(1, 3, HIDDEN)
    with pytest.raises(TypeError):
        attn(x, *_rotary(torch.arange(3)[None]), torch.zeros(1, 1, 3, 3))


# --------------------------------------------------------------------------------------------------------------------
# Decoder block: mid residual, gradient checkpointing
# --------------------------------------------------------------------------------------------------------------------


def test_decoder_block_return_mid():
    torch.manual_seed(8)
    blk = DecoderBlock(HIDDEN, HEADS, KV_HEADS, 48, layer_idx=0).eval()
    x = torch.randn(2, 4, HIDDEN)
    cos, sin = _rotary(torch.arange(4)[None].expand(2, 4))
    mask = causal_mask(4, 4, device="cpu")
    with torch.no_grad():
        out, mid = blk(x, cos, sin, mask, return_mid=True)
        expected_mid = x + blk.self_attn(blk.input_layernorm(x), cos, sin, mask)
        torch.testing.assert_close(mid, expected_mid)
        torch.testing.assert_close(out, mid + blk.mlp(blk.post_attention_layernorm(mid)))
        torch.testing.assert_close(out, blk(x, cos, sin, mask))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_same_grads(use_reentrant):
    torch.manual_seed(9)
    stack = torch.nn.ModuleList(DecoderBlock(HIDDEN, HEADS, KV_HEADS, 48, qk_norm=True, layer_idx=i) for i in range(2))
    stack.train()
    B, T = 2, 6
    x = torch.randn(B, T, HIDDEN, requires_grad=True)
    cos, sin = _rotary(torch.arange(T)[None].expand(B, T))
    mask = block_causal_mask(T, 2)

    def loss_and_grads():
        for p in stack.parameters():
            p.grad = None
        x.grad = None
        h = x
        for i, blk in enumerate(stack):
            if i == 0:
                h, mid = blk(h, cos, sin, mask, return_mid=True)
            else:
                h = blk(h, cos, sin, attention_mask=mask)
        loss = (h**2).mean() + mid.sum() * 1e-2
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in stack.parameters()], x.grad.clone()

    ref_loss, ref_grads, ref_xgrad = loss_and_grads()

    calls = []

    def counting_checkpoint(fn, *args, **kwargs):
        calls.append(1)
        return checkpoint(fn, *args, use_reentrant=use_reentrant, **kwargs)

    # What PreTrainedModel._set_gradient_checkpointing does for each GradientCheckpointingLayer.
    for blk in stack:
        blk.gradient_checkpointing = True
        blk._gradient_checkpointing_func = counting_checkpoint
    ck_loss, ck_grads, ck_xgrad = loss_and_grads()
    assert len(calls) == 2  # the checkpoint path was really taken
    torch.testing.assert_close(ck_loss, ref_loss, atol=1e-6, rtol=0)
    for g_ref, g_ck in zip(ref_grads, ck_grads):
        torch.testing.assert_close(g_ck, g_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ck_xgrad, ref_xgrad, atol=1e-6, rtol=0)

    # eval mode or no_grad bypasses checkpointing
    calls.clear()
    stack.eval()
    with torch.no_grad():
        stack[0](x, cos, sin, mask)
    assert not calls


def test_no_global_imports_beyond_torch_transformers():
    """The file is copied into checkpoints: only torch / transformers / relative sibling imports are allowed."""
    import ast
    import hf_latentlm.modeling.layers as layers

    tree = ast.parse(open(layers.__file__).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] in {"torch", "transformers"}, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                assert node.module.split(".")[0] in {"torch", "transformers", "__future__"}, node.module
            else:
                assert node.level == 1 and node.module and "." not in node.module, node.module


def test_inv_freq_restored_by_init_weights_recipe(tmp_path):
    """from_pretrained refills non-persistent buffers with torch.empty; the documented `_init_weights` recipe
    (init.copy_(module.inv_freq, module.compute_inv_freq())) must restore the real frequencies."""
    from transformers import PreTrainedConfig, PreTrainedModel
    from transformers import initialization as init

    class TinyConfig(PreTrainedConfig):
        model_type = "hf_latentlm_layers_test"

    class TinyModel(PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.rotary_emb = RotaryEmbedding(HEAD_DIM, base=500.0)
            self.proj = torch.nn.Linear(4, 4)
            self.post_init()

        def _init_weights(self, module):
            super()._init_weights(module)
            if isinstance(module, RotaryEmbedding):
                init.copy_(module.inv_freq, module.compute_inv_freq(module.inv_freq.device))

    TinyModel(TinyConfig()).save_pretrained(tmp_path)
    reloaded = TinyModel.from_pretrained(tmp_path)
    expected = 1.0 / 500.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    torch.testing.assert_close(reloaded.rotary_emb.inv_freq, expected)


# --------------------------------------------------------------------------------------------------------------------
# Latent-diffusion pieces: dual_stream_mask, block_causal_layout, DiTBlock, ReadOnlyCache, OffsetCache
# --------------------------------------------------------------------------------------------------------------------


def _dual_stream_brute(length, block_size, visible, padding, batch):
    """The rule of dual_stream_mask's docstring, one (row, column) at a time."""
    out = torch.zeros(batch, 1, 2 * length, 2 * length, dtype=torch.bool)
    for b in range(batch):
        for r in range(2 * length):
            for c in range(2 * length):
                i, j = r % length, c % length
                bi, bj = i // block_size, j // block_size
                if r < length:  # clean row: block-causal over clean keys, never a noisy key
                    ok = c < length and bj <= bi
                elif c >= length:  # noisy row, noisy key: own block only
                    ok = bj == bi
                else:  # noisy row, clean key: earlier blocks, if this block keeps its history
                    ok = bj < bi and (visible is None or bool(visible[b, bi]))
                if padding is not None:
                    ok = (ok and bool(padding[b, j])) or r == c
                out[b, 0, r, c] = ok
    return out


@pytest.mark.parametrize("length,block_size", [(8, 4), (10, 4), (7, 3), (5, 1), (3, 8), (1, 1)])
def test_dual_stream_mask_brute_force(length, block_size):
    gen = torch.Generator().manual_seed(length * 10 + block_size)
    num_blocks = -(-length // block_size)
    batch = 3
    visible = torch.rand(batch, num_blocks, generator=gen) < 0.5
    visible[0] = True  # one row keeps every history, one (below, row 1) drops at least its last block's
    visible[1, -1] = False
    padding = _random_padding(batch, length, "right", gen)
    for vis, pad in ((None, None), (visible, None), (None, padding), (visible, padding)):
        m = dual_stream_mask(length, block_size, vis, pad)
        assert m.dtype == torch.bool
        rows = 1 if vis is None and pad is None else batch
        assert m.shape == (rows, 1, 2 * length, 2 * length)
        assert torch.equal(m.expand(batch, -1, -1, -1), _dual_stream_brute(length, block_size, vis, pad, batch))
        assert m.any(-1).all(), "no row may be empty"


def _block_layout_brute(attention_mask, batch, length, past, block_size, position_ids=None):
    """Positions counted by hand from each row's first real item; visibility by position blocks."""
    total = past + length
    key_pos, real = [], []
    for b in range(batch):
        row_real = [True] * total if attention_mask is None else [bool(v) for v in attention_mask[b]]
        count, positions = 0, []
        for c in range(total):
            positions.append(count)
            count += row_real[c]
        if position_ids is not None:  # the new items (queries and their own keys) are at the given positions
            positions[past:] = [int(position_ids[b if position_ids.shape[0] > 1 else 0, i]) for i in range(length)]
        key_pos.append(positions), real.append(row_real)
    query_pos = [[key_pos[b][past + i] for i in range(length)] for b in range(batch)]
    visible = [[[real[b][c] and key_pos[b][c] // block_size <= query_pos[b][i] // block_size for c in range(total)]
                for i in range(length)] for b in range(batch)]
    return query_pos, visible, real


def _check_block_layout(attention_mask, batch, length, past, block_size, position_ids=None):
    positions, mask = block_causal_layout(attention_mask, batch, length, past, block_size, position_ids=position_ids)
    assert mask.dtype == torch.bool and mask.shape[1:] == (1, length, past + length)
    mask = mask.expand(batch, -1, -1, -1)
    positions = positions.expand(batch, -1)
    query_pos, visible, real = _block_layout_brute(attention_mask, batch, length, past, block_size, position_ids)
    for b in range(batch):
        for i in range(length):
            if not real[b][past + i]:
                assert mask[b, 0, i, past + i], "a padded query row sees its own column"
                continue
            assert int(positions[b, i]) == query_pos[b][i], (b, i)
            assert mask[b, 0, i].tolist() == visible[b][i], (b, i)


@pytest.mark.parametrize("length,past,block_size", [(7, 0, 2), (9, 0, 4), (3, 5, 2), (1, 6, 4), (5, 3, 3)])
def test_block_causal_layout_left_padding_and_cache_brute_force(length, past, block_size):
    gen = torch.Generator().manual_seed(length + 7 * past + 31 * block_size)
    total = past + length
    pad = _random_padding(4, total, "left", gen)
    pad[0] = 1  # an unpadded row next to padded ones
    _check_block_layout(None, 4, length, past, block_size)
    _check_block_layout(pad, 4, length, past, block_size)


def test_block_causal_layout_left_padded_row_matches_the_row_alone():
    """Blocks start at each row's first real item: the real part of a left-padded row is the row alone."""
    pad = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 10])
    _, mask = block_causal_layout(pad, 2, 10, 0, 4)
    _, alone = block_causal_layout(None, 1, 7, 0, 4)
    assert torch.equal(mask[0, 0, 3:, 3:], alone[0, 0])
    assert torch.equal(alone[0, 0], block_causal_mask(7, 4)[0, 0])
    assert not mask[0, 0, 3:, :3].any()


def test_block_causal_layout_given_position_ids_brute_force():
    # No mask: cached keys at 0..past-1, the new items at their given positions (here the ones a mask would give).
    position_ids = torch.tensor([[5, 6, 7], [5, 6, 7]])
    _check_block_layout(None, 2, 3, 5, 4, position_ids)
    positions, _ = block_causal_layout(None, 2, 3, 5, 4, position_ids=position_ids)
    assert torch.equal(positions, position_ids)
    # With a left-padding mask, keys are counted from the first real item; the given positions are kept.
    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    _check_block_layout(pad, 2, 3, 5, 2, torch.tensor([[3, 4, 5], [5, 6, 7]]))


def test_block_causal_layout_new_keys_take_the_given_positions():
    # Items at positions 2..9 in blocks of 4: the item at position 2 (block 0) must not see those at 4 and 5 (block 1).
    position_ids = torch.arange(2, 10)[None]
    _check_block_layout(None, 1, 8, 0, 4, position_ids)


@pytest.mark.parametrize("length,past", [(6, 0), (2, 5), (1, 7)])
def test_block_causal_layout_block_one_is_causal_layout(length, past):
    gen = torch.Generator().manual_seed(length + past)
    pad = _random_padding(3, past + length, "left", gen)
    pos_b, mask_b = block_causal_layout(None, 3, length, past, 1)
    pos_c, mask_c = causal_layout(None, 3, length, past)
    assert torch.equal(pos_b, pos_c) and torch.equal(mask_b, mask_c.expand_as(mask_b))
    pos_b, mask_b = block_causal_layout(pad, 3, length, past, 1)
    pos_c, mask_c = causal_layout(pad, 3, length, past)
    real_query = pad[:, past:].bool()
    # Padded query rows are meaningless (each sees at least its own column): compare the real ones.
    assert torch.equal(pos_b[real_query], pos_c[real_query])
    assert torch.equal(mask_b[:, 0][real_query], mask_c[:, 0][real_query])


def _dit_block(seed=0):
    torch.manual_seed(seed)
    return DiTBlock(HIDDEN, HEADS, KV_HEADS, 48, layer_idx=0).eval()


def test_dit_block_is_the_identity_at_init_and_its_gates_get_gradient():
    block = _dit_block()
    block.apply(lambda module: init_backbone_weights(module, 0.02))
    assert not block.modulation[1].weight.any() and not block.modulation[1].bias.any()
    torch.manual_seed(1)
    x, cond = torch.randn(2, 6, HIDDEN, requires_grad=True), torch.randn(2, 6, HIDDEN)
    out = block(x, cond, *_rotary(torch.arange(6)[None].expand(2, 6)), block_causal_mask(6, 2))
    assert torch.equal(out, x)
    out.pow(2).sum().backward()
    # adaLN-Zero: the gates start at zero yet learn (their gradient is not zero); the sublayers get none yet.
    assert block.modulation[1].weight.grad.abs().sum() > 0
    assert not block.self_attn.q_proj.weight.grad.any() and not block.mlp.up_proj.weight.grad.any()


def _plain_layer_norm(x, eps=1e-6):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def test_dit_block_matches_hand_written_adaln():
    block = _dit_block(2)
    torch.manual_seed(3)
    with torch.no_grad():
        block.modulation[1].weight.normal_(0.0, 0.3)
        block.modulation[1].bias.normal_(0.0, 0.3)
    B, T, d = 2, 7, HIDDEN
    x, cond = torch.randn(B, T, d), torch.randn(B, T, d)  # a conditioning vector per position
    cos, sin = _rotary(torch.arange(T)[None].expand(B, T))
    mask = block_causal_mask(T, 3)
    weight, bias = block.modulation[1].weight, block.modulation[1].bias
    with torch.no_grad():
        out = block(x, cond, cos, sin, mask)
        # Chunks of the 6d modulation, in the docstring's order: shift, scale, gate of attention, then of the MLP.
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = (
            torch.nn.functional.silu(cond) @ weight[k * d:(k + 1) * d].T + bias[k * d:(k + 1) * d] for k in range(6))
        h = x + gate_a * block.self_attn(_plain_layer_norm(x) * (1 + scale_a) + shift_a, cos, sin, mask)
        expected = h + gate_m * block.mlp(_plain_layer_norm(h) * (1 + scale_m) + shift_m)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (out - x).abs().max() > 1e-2  # not the identity any more


def _backbone_config(num_layers):
    from hf_latentlm.modeling.configuration_backbone import BackboneConfig

    return BackboneConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                          intermediate_size=48, num_hidden_layers=num_layers)


def test_read_only_cache_attends_over_cached_then_new_keys_and_stores_nothing():
    attn = _attn()
    torch.manual_seed(5)
    B, P, T = 2, 5, 3
    x = torch.randn(B, P + T, HIDDEN)
    cos, sin = _rotary(torch.arange(P + T)[None].expand(B, P + T))
    # Reference over the concatenated keys: the first P rows causal, the last T see every key.
    full_mask = causal_mask(P + T, P + T, device="cpu").clone()
    full_mask[..., P:, :] = True
    expected = _reference_attention(attn, x, cos, sin, full_mask)[:, P:]
    cache = DynamicCache()
    with torch.no_grad():
        attn(x[:, :P], cos[:, :P], sin[:, :P], causal_mask(P, P, device="cpu"), cache=cache)
        keys, values = cache.layers[0].keys.clone(), cache.layers[0].values.clone()
        view = ReadOnlyCache(cache)
        assert view.get_seq_length() == P
        new_mask = torch.ones(1, 1, T, P + T, dtype=torch.bool)
        first = attn(x[:, P:], cos[:, P:], sin[:, P:], new_mask, cache=view)
        second = attn(x[:, P:], cos[:, P:], sin[:, P:], new_mask, cache=view)
    torch.testing.assert_close(first, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(first, second), "a read-only view must not accumulate keys"
    assert cache.get_seq_length() == P and len(cache.layers) == 1
    assert torch.equal(cache.layers[0].keys, keys) and torch.equal(cache.layers[0].values, values)


def test_read_only_cache_of_an_empty_cache_is_no_cache():
    attn = _attn()
    torch.manual_seed(6)
    x = torch.randn(2, 4, HIDDEN)
    cos, sin = _rotary(torch.arange(4)[None].expand(2, 4))
    for cache in (DynamicCache(), DynamicCache(config=_backbone_config(2))):
        with torch.no_grad():
            out = attn(x, cos, sin, None, cache=ReadOnlyCache(cache))
            torch.testing.assert_close(out, attn(x, cos, sin, None), atol=0, rtol=0)
        assert cache.get_seq_length() == 0


def test_offset_cache_writes_at_offset_layers_and_grows_a_fixed_cache():
    torch.manual_seed(7)
    cache = DynamicCache(config=_backbone_config(2))
    assert len(cache.layers) == 2
    view = OffsetCache(cache, 2)
    assert view.get_seq_length() == 0 and view.get_seq_length(1) == 0
    k1, v1, k2, v2 = (torch.randn(1, KV_HEADS, n, HEAD_DIM) for n in (3, 3, 2, 2))
    keys, values = view.update(k1, v1, 1)  # the view's layer 1 = the cache's layer 3
    assert torch.equal(keys, k1) and torch.equal(values, v1)
    assert len(cache.layers) == 4
    assert torch.equal(cache.layers[3].keys, k1) and torch.equal(cache.layers[3].values, v1)
    keys, _ = view.update(k2, v2, 1)
    assert torch.equal(keys, torch.cat([k1, k2], dim=-2)) and torch.equal(cache.layers[3].keys, keys)
    assert view.get_seq_length(1) == 5 and view.get_seq_length(0) == 0
    assert cache.get_seq_length(0) == 0 and cache.get_seq_length(1) == 0  # the backbone's layers untouched

    # Through attention: a block with layer_idx 0 writes the cache's layer `offset`, the same keys as alone.
    attn = _attn()
    x = torch.randn(2, 4, HIDDEN)
    cos, sin = _rotary(torch.arange(4)[None].expand(2, 4))
    plain, shared = DynamicCache(), DynamicCache()
    with torch.no_grad():
        a = attn(x, cos, sin, None, cache=plain)
        b = attn(x, cos, sin, None, cache=OffsetCache(shared, 1))
    assert torch.equal(a, b)
    assert len(shared.layers) == 2 and torch.equal(shared.layers[1].keys, plain.layers[0].keys)
    assert shared.get_seq_length(0) == 0


def test_block_conditions_draw_at_their_rates_with_times_per_block():
    """draw_block_conditions at rates neither 0 nor 1 (prompt blocks 0.3, history dropout 0.2; 20000 blocks of
    Q = 4): a block gets a clean prefix with frequency 0.3 and its length k is uniform on 1..Q−1, a block loses its
    history with frequency 0.2, every position of a block shares the block's drawn time (0 on the clean prefix,
    which is exactly the leading k positions)."""
    from hf_latentlm.modeling.flow import make_time_sampler
    from hf_latentlm.modeling.layers import draw_block_conditions

    torch.manual_seed(0)
    Q, batch, length = 4, 2000, 40
    times, clean, visible = draw_block_conditions(make_time_sampler("uniform"), batch, length, Q, 0.3, 0.2)
    blocks = clean.view(batch, -1, Q)
    prefix = blocks.sum(-1)
    assert (blocks == (torch.arange(Q) < prefix[..., None])).all()  # the clean positions lead their block
    assert abs((prefix > 0).float().mean().item() - 0.3) < 0.015
    lengths = prefix[prefix > 0]
    assert set(lengths.unique().tolist()) == {1, 2, 3}
    torch.testing.assert_close(torch.bincount(lengths, minlength=4)[1:].float() / lengths.numel(),
                               torch.full((3,), 1 / 3), atol=0.02, rtol=0)
    assert abs((~visible).float().mean().item() - 0.2) < 0.015
    noisy_times = times.view(batch, -1, Q)
    assert (noisy_times[clean.view(batch, -1, Q)] == 0).all()
    last = noisy_times[..., -1:]  # never clean (k ≤ Q − 1): the block's time
    assert (torch.where(blocks, last, noisy_times) == last).all() and (last > 0).all()
    assert abs(last.mean().item() - 0.5) < 0.01  # the uniform sampler's mean
