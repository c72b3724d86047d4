"""RoPE and the scaled causal softmax vs their references, forward and backward, under the interpreter."""

from __future__ import annotations

import math

import pytest
import torch

from autoplan.kernels.rope import rope, rope_cache, rope_reference
from autoplan.kernels.softmax import softmax, softmax_reference


def _rope_run(fn, q, k, cos, sin, offset, interleaved, dq, dk, upcast=False):
    """Rotate non-leaf copies of q, k in place, back-propagate (dq, dk); return outputs and input grads."""
    q0 = (q.float() if upcast else q).clone().requires_grad_(True)
    k0 = (k.float() if upcast else k).clone().requires_grad_(True)
    qa, ka = q0 * 1, k0 * 1  # in-place ops need non-leaf inputs
    qo, ko = fn(qa, ka, cos, sin, offset, interleaved)
    assert qo is qa and ko is ka, "rope must rotate in place and return its inputs"
    torch.autograd.backward([qo, ko], [dq.to(qo.dtype), dk.to(ko.dtype)])
    return qo.detach(), ko.detach(), q0.grad, k0.grad


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_gqa_with_offset(close, dtype, interleaved):
    # GQA: 6 query heads, 2 key heads; head_dim 48 (half 24, not a power of two); offset 7
    q = torch.randn(2, 13, 6, 48).to(dtype)
    k = torch.randn(2, 13, 2, 48).to(dtype)
    cos, sin = rope_cache(32, 48, base=10000.0)
    dq, dk = torch.randn(q.shape), torch.randn(k.shape)
    got = _rope_run(rope, q, k, cos, sin, 7, interleaved, dq, dk)
    want = _rope_run(rope_reference, q, k, cos, sin, 7, interleaved, dq, dk, upcast=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        close(g, w, dtype)


def test_rope_matches_hf_rotate_half_formula(close):
    # Independent formulation: HF Llama's q*cos + rotate_half(q)*sin with [seq, head_dim] tables.
    b, s, h, d = 1, 9, 3, 16
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, 1, d)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(s).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos_full, sin_full = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)

    q_hf = q * cos_full + rotate_half(q) * sin_full
    k_hf = k * cos_full + rotate_half(k) * sin_full
    cos, sin = rope_cache(s, d)
    q_ours, k_ours = rope(q.clone(), k.clone(), cos, sin)
    close(q_ours, q_hf, torch.float32)
    close(k_ours, k_hf, torch.float32)


def test_rope_backward_is_inverse_rotation(close):
    # A rotation is orthogonal: its gradient map is the inverse rotation, so rotating the rotated
    # tensor "backward" restores it.
    from autoplan.kernels.rope import rope_apply

    q, k = torch.randn(2, 5, 4, 32), torch.randn(2, 5, 1, 32)
    cos, sin = rope_cache(64, 32)
    qr, kr = rope(q.clone(), k.clone(), cos, sin, 11)
    q_back, k_back = rope_apply(qr, kr, cos, sin, 11, backward=True, q_out=torch.empty_like(q),
                                k_out=torch.empty_like(k))
    close(q_back, q, torch.float32)
    close(k_back, k, torch.float32)
    # and the rotation preserves norms of each pair, hence of each head vector
    close(qr.norm(dim=-1), q.norm(dim=-1), torch.float32)


def test_rope_on_views_of_fused_qkv(close):
    # q and k as strided views of one [b, s, (hq + 2 hk) * d] projection: rotated in place, v untouched
    b, s, hq, hk, d = 2, 6, 4, 2, 32
    qkv = torch.randn(b, s, (hq + 2 * hk) * d)
    expect = qkv.clone()
    cos, sin = rope_cache(s, d)
    view = lambda t: (t[..., : hq * d].view(b, s, hq, d), t[..., hq * d:(hq + hk) * d].view(b, s, hk, d))
    rope_reference(*view(expect), cos, sin)
    q, k = view(qkv)
    rope(q, k, cos, sin)
    close(qkv, expect, torch.float32)
    assert torch.equal(qkv[..., (hq + hk) * d:], expect[..., (hq + hk) * d:])


def test_rope_autograd_through_views_of_fused_qkv(close):
    # the common training layout: qkv = x @ W (non-leaf), q and k are views rotated in place,
    # and the loss reads the whole qkv tensor (so v and the rotated q, k all get gradients)
    b, s, hq, hk, d = 1, 5, 2, 1, 16
    x, w = torch.randn(b, s, 8), torch.randn(8, (hq + 2 * hk) * d)
    cos, sin = rope_cache(s, d)
    target = torch.randn(b, s, (hq + 2 * hk) * d)
    grads = []
    for fn in (rope, rope_reference):
        w_ = w.clone().requires_grad_(True)
        qkv = x @ w_
        q = qkv[..., : hq * d].view(b, s, hq, d)
        k = qkv[..., hq * d:(hq + hk) * d].view(b, s, hk, d)
        fn(q, k, cos, sin)
        ((qkv - target) ** 2).sum().backward()
        grads.append(w_.grad)
    close(grads[0], grads[1], torch.float32, reduced=True)


def test_rope_bad_inputs():
    cos, sin = rope_cache(8, 16)
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 1, 16)
    with pytest.raises(ValueError, match="exceed the 8 rows"):
        rope(q, k, cos, sin, position_offset=1)
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        rope(q[0], k[0], cos, sin)
    with pytest.raises(ValueError, match="head_dim // 2"):
        rope(q, k, *rope_cache(8, 8))
    with pytest.raises(ValueError, match="must agree on batch, seq and head_dim"):
        rope(q, torch.randn(1, 7, 1, 16), cos, sin)
    with pytest.raises(ValueError, match="non-negative int"):
        rope(q, k, cos, sin, position_offset=-1)
    with pytest.raises(ValueError, match="positive even"):
        rope_cache(8, 15)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax(run, close, dtype, causal):
    x = (torch.randn(2, 3, 9, 37) * 4).to(dtype)  # sk = 37: non-power-of-two row
    scale = 1 / math.sqrt(64)
    out, dy, (gx,) = run(softmax, [x], scale, causal)
    out_ref, _, (gx_ref,) = run(softmax_reference, [x], scale, causal, upcast=True, grad_out=dy)
    close(out, out_ref, dtype)
    close(gx, gx_ref, dtype)


def test_causal_softmax_structure():
    sq, sk = 7, 12  # sq != sk: query i sees keys 0..i (top-left aligned, like SDPA is_causal)
    y = softmax(torch.randn(1, 2, sq, sk), 0.5, True)
    keep = torch.ones(sq, sk, dtype=torch.bool).tril()
    assert torch.all(y[..., ~keep] == 0)
    assert torch.all(y[..., keep] > 0)
    torch.testing.assert_close(y.sum(-1), torch.ones(1, 2, sq))


def test_softmax_matches_sdpa_probabilities_and_long_rows(close):
    # the probabilities that scaled_dot_product_attention uses, recovered with an identity value
    # matrix; then rows of 1500 keys (BLOCK 2048, one row per program).
    torch.manual_seed(1)
    sq = sk = 24
    qh, kh = torch.randn(1, 1, sq, 16), torch.randn(1, 1, sk, 16)
    scores = qh @ kh.transpose(-1, -2)
    probs = softmax(scores, 0.25, True)
    eye = torch.eye(sk)[None, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(qh, kh, eye, is_causal=True, scale=0.25)
    close(probs, sdpa, torch.float32)
    x = torch.randn(3, 1500)
    close(softmax(x, 2.0), torch.softmax(2.0 * x, -1), torch.float32)


def test_softmax_bad_inputs():
    with pytest.raises(ValueError, match="exceed the 16384"):
        softmax(torch.randn(1, 20000))
    with pytest.raises(TypeError, match="scale must be a Python number"):
        softmax(torch.randn(2, 4), torch.tensor(1.0))
    with pytest.raises(ValueError, match="at least 2 dimension"):
        softmax(torch.randn(4), 1.0, True)
