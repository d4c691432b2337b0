"""Tests for the shared transformer core (hf_latentlm/modeling/layers.py). Tiny sizes, CPU only."""


import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicCache

from hf_latentlm.modeling.layers import (
    Attention,
    DecoderBlock,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    apply_rotary,
    block_causal_mask,
    causal_mask,
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
