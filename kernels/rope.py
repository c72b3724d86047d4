"""Fused rotary position embedding (RoPE), applied in place to q and k in one launch.

Eager RoPE (the Hugging Face `rotate_half` formulation) builds rotate_half(x) with a slice, a
negation and a concatenation, then x*cos + rotate_half(x)*sin: about six element-wise kernels per
tensor, each reading and writing q or k. Here each program loads one token's cos/sin row once and
rotates all heads of q and of k in registers, reading and writing each element once. GQA/MQA
(k with fewer heads than q) is just a different head count for k. The backward is the same
rotation by -theta applied to the incoming gradients (written out of place: autograd may still
hold them).

Conventions:
* q: [batch, seq, heads_q, head_dim], k: [batch, seq, heads_k, head_dim]; any strides with the
  last dimension contiguous (views into a fused qkv projection work, nothing is copied).
* cos, sin: [max_positions, head_dim // 2] (see `rope_cache`); token s of the chunk uses row
  s + position_offset, so a context-parallel rank passes the global index of its first token.
* interleaved=False pairs element i with i + head_dim/2 (HF Llama, `rotate_half`);
  interleaved=True pairs 2i with 2i+1 (the original Meta Llama / GPT-J complex form).
Math per pair (x1, x2) with angle theta = pos * base^(-2i/head_dim):
    out1 = x1 cos - x2 sin,  out2 = x2 cos + x1 sin   (backward: the same with sin -> -sin)
"""

from __future__ import annotations

import torch

from autoplan.kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor, check_triton_device
from autoplan.kernels._triton import jit, next_power_of_2, num_warps_for, tl

OP = "rope"


# --------------------------------------------------------------------------- kernel


@jit
def _rope_kernel(
    Q, K, Q_OUT, K_OUT, COS, SIN,
    seq_len, n_heads_q, n_heads_k, half_dim, position_offset,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h,
    sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_K: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (batch, token): the token's cos/sin row is loaded once for all heads.
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half_dim
    pos = s + position_offset
    cos = tl.load(COS + pos * half_dim + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(SIN + pos * half_dim + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:
        sin = -sin
    if INTERLEAVED:
        off1 = 2 * d
        off2 = 2 * d + 1
    else:
        off1 = d
        off2 = d + half_dim

    hq = tl.arange(0, BLOCK_HQ)
    mask_q = (hq < n_heads_q)[:, None] & d_mask[None, :]
    src = Q + b * sq_b + s * sq_s + hq[:, None] * sq_h
    dst = Q_OUT + b * sqo_b + s * sqo_s + hq[:, None] * sqo_h
    x1 = tl.load(src + off1[None, :], mask=mask_q, other=0.0).to(tl.float32)
    x2 = tl.load(src + off2[None, :], mask=mask_q, other=0.0).to(tl.float32)
    tl.store(dst + off1[None, :], (x1 * cos - x2 * sin).to(Q_OUT.dtype.element_ty), mask=mask_q)
    tl.store(dst + off2[None, :], (x2 * cos + x1 * sin).to(Q_OUT.dtype.element_ty), mask=mask_q)

    if HAS_K:
        hk = tl.arange(0, BLOCK_HK)
        mask_k = (hk < n_heads_k)[:, None] & d_mask[None, :]
        src = K + b * sk_b + s * sk_s + hk[:, None] * sk_h
        dst = K_OUT + b * sko_b + s * sko_s + hk[:, None] * sko_h
        x1 = tl.load(src + off1[None, :], mask=mask_k, other=0.0).to(tl.float32)
        x2 = tl.load(src + off2[None, :], mask=mask_k, other=0.0).to(tl.float32)
        tl.store(dst + off1[None, :], (x1 * cos - x2 * sin).to(K_OUT.dtype.element_ty), mask=mask_k)
        tl.store(dst + off2[None, :], (x2 * cos + x1 * sin).to(K_OUT.dtype.element_ty), mask=mask_k)


# --------------------------------------------------------------------------- launchers


def rope_cache(max_positions: int, head_dim: int, base: float = 10000.0, device=None):
    """cos and sin tables, each [max_positions, head_dim // 2] fp32, theta = pos * base^(-2i/head_dim).

    The frequencies are those of Su et al. 2021 (RoFormer, eq. 15), as used by Llama with base 10000
    (Llama 3 uses base 500000).
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"{OP}: head_dim must be a positive even number, got {head_dim}.")
    if max_positions <= 0:
        raise ValueError(f"{OP}: max_positions must be positive, got {max_positions}.")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def _check(q, k, cos, sin, position_offset) -> None:
    check_tensor(OP, "q", q)
    check_tensor(OP, "k", k)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"{OP}: q and k must be [batch, seq, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}; "
            "for [batch, heads, seq, head_dim] pass q.transpose(1, 2) (a view)."
        )
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{OP}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, seq and head_dim.")
    if q.dtype != k.dtype:
        raise TypeError(f"{OP}: q and k must have the same dtype, got {q.dtype} and {k.dtype}.")
    head_dim = q.shape[3]
    if head_dim % 2:
        raise ValueError(f"{OP}: head_dim must be even to form rotation pairs, got {head_dim}.")
    for name, t in (("q", q), ("k", k)):
        if t.stride(3) != 1:
            raise ValueError(f"{OP}: the head_dim of {name} must be contiguous (stride 1), got strides "
                             f"{tuple(t.stride())}; pass {name}.contiguous().")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(OP, name, t, dtypes=FLOAT_DTYPES)
        if t.dim() != 2 or t.shape[1] != head_dim // 2 or not t.is_contiguous():
            raise ValueError(
                f"{OP}: {name} must be a contiguous [max_positions, head_dim // 2 = {head_dim // 2}] table, "
                f"got shape {tuple(t.shape)}; build it with kernels.rope.rope_cache(max_positions, {head_dim})."
            )
    if cos.shape != sin.shape:
        raise ValueError(f"{OP}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape.")
    check_same_device(OP, q=q, k=k, cos=cos, sin=sin)
    if not isinstance(position_offset, int) or isinstance(position_offset, bool) or position_offset < 0:
        raise ValueError(f"{OP}: position_offset must be a non-negative int, got {position_offset!r}.")
    if position_offset + q.shape[1] > cos.shape[0]:
        raise ValueError(
            f"{OP}: positions {position_offset}..{position_offset + q.shape[1] - 1} exceed the "
            f"{cos.shape[0]} rows of the cos/sin tables; build them with max_positions >= "
            f"{position_offset + q.shape[1]}."
        )


def rope_apply(q, k, cos, sin, position_offset: int = 0, interleaved: bool = False,
               backward: bool = False, q_out=None, k_out=None):
    """Launch the kernel: rotate q and k (by -theta when `backward`) into q_out/k_out (default: in place).

    k may be None (rotate q only). Returns (q_out, k_out).
    """
    _check(q, q if k is None else k, cos, sin, position_offset)
    check_triton_device(OP, q)
    q_out = q if q_out is None else q_out
    has_k = k is not None
    k, k_out = (k, (k if k_out is None else k_out)) if has_k else (q, q_out)
    batch, seq, n_hq, head_dim = q.shape
    n_hk = k.shape[2]
    half = head_dim // 2
    block_hq, block_hk, block_d = next_power_of_2(n_hq), next_power_of_2(n_hk), next_power_of_2(half)
    _rope_kernel[(batch * seq,)](
        q, k, q_out, k_out, cos, sin,
        seq, n_hq, n_hk, half, position_offset,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        INTERLEAVED=bool(interleaved), BACKWARD=bool(backward), HAS_K=has_k,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
        # x1 and x2 of the larger of q/k are live together: 2 x heads x half_dim fp32 values.
        num_warps=num_warps_for(2 * max(block_hq, block_hk) * block_d),
    )
    return q_out, (k_out if has_k else None)


# --------------------------------------------------------------------------- autograd


class RoPEFunction(torch.autograd.Function):
    """Rotates q (and k, unless None) in place; backward rotates the gradients back.

    The rotated tensors come first in the arguments: when one is a view, autograd's CopySlices
    takes the gradient of the view from the first output of backward.
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_offset, interleaved):
        rope_apply(q, k, cos, sin, position_offset, interleaved)
        ctx.save_for_backward(cos, sin)
        ctx.position_offset, ctx.interleaved = position_offset, interleaved
        if k is None:
            ctx.mark_dirty(q)
            return q
        ctx.mark_dirty(q, k)
        return q, k

    @staticmethod
    def backward(ctx, dq, dk=None):
        cos, sin = ctx.saved_tensors
        dq = dq if dq.stride(-1) == 1 else dq.contiguous()
        dq_in = torch.empty(dq.shape, dtype=dq.dtype, device=dq.device)
        dk_in = None
        if dk is not None:
            dk = dk if dk.stride(-1) == 1 else dk.contiguous()
            dk_in = torch.empty(dk.shape, dtype=dk.dtype, device=dk.device)
        rope_apply(dq, dk, cos, sin, ctx.position_offset, ctx.interleaved, backward=True, q_out=dq_in, k_out=dk_in)
        return dq_in, dk_in, None, None, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         position_offset: int = 0, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [b, s, hq, d] and k [b, s, hk, d] in place (Triton); returns (q, k).

    As with any in-place op, q and k must not be leaf tensors that require grad. One launch
    rotates both; when q or k is a view of another tensor that requires grad (a slice of a fused
    qkv projection), autograd only allows one in-place output per Function, so q and k are
    rotated by one launch each.
    """
    _check(q, k, cos, sin, position_offset)
    grad_views = torch.is_grad_enabled() and any(t._base is not None and t.requires_grad for t in (q, k))
    if grad_views:
        RoPEFunction.apply(q, None, cos, sin, position_offset, interleaved)
        RoPEFunction.apply(k, None, cos, sin, position_offset, interleaved)
        return q, k
    return RoPEFunction.apply(q, k, cos, sin, position_offset, interleaved)


# --------------------------------------------------------------------------- reference


def _rotate_reference(t, cos, sin, interleaved):
    tf = t.float()
    if interleaved:
        x1, x2 = tf[..., 0::2], tf[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    half = t.shape[-1] // 2
    x1, x2 = tf[..., :half], tf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   position_offset: int = 0, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same contract: rotates q and k in place (fp32 math) and returns them."""
    _check(q, k, cos, sin, position_offset)
    seq = q.shape[1]
    c = cos[position_offset:position_offset + seq].float()[None, :, None, :]
    s = sin[position_offset:position_offset + seq].float()[None, :, None, :]
    q_rot, k_rot = _rotate_reference(q, c, s, interleaved), _rotate_reference(k, c, s, interleaved)
    q.copy_(q_rot)
    k.copy_(k_rot)
    return q, k
