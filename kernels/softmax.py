"""Fused scaled, causally masked softmax over the last dimension of attention scores [b, h, sq, sk].

For attention that materialises its score matrix (the non-flash path), eager PyTorch scales,
masks (masked_fill with a [sq, sk] boolean mask) and runs softmax as three kernels, and autograd
adds more in the backward. Here the forward reads the scores once and writes the probabilities
once, building the causal mask from indices; the backward reads y and dy once and writes dx.

Conventions: y = softmax(scale * x) over the last dim; with causal=True, query i (the index in
dim -2) sees keys j <= i (the top-left aligned mask of torch's scaled_dot_product_attention with
is_causal=True, also for sq != sk); masked probabilities are exactly 0.
Backward: dx = scale * y * (dy - sum(dy * y)) per row.
"""

from __future__ import annotations

import torch

from autoplan.kernels._checks import as_rows, check_tensor, check_triton_device
from autoplan.kernels._triton import cdiv, jit, next_power_of_2, num_warps_for, tl

OP = "softmax"

# One row lives in registers: 16384 fp32 scores at 16 warps is 32 values per thread. Longer rows
# are what flash attention exists for; they go to the torch reference.
_MAX_COLS = 16384
# Short rows share a program: up to 4096 elements (8 warps x 16 values per thread), <= 16 rows.
_TILE_ELEMS = 4096
_MAX_ROWS_PER_PROGRAM = 16


def _tile(n_cols: int) -> tuple[int, int]:
    block_n = next_power_of_2(n_cols)
    return max(1, min(_MAX_ROWS_PER_PROGRAM, _TILE_ELEMS // block_n)), block_n


# --------------------------------------------------------------------------- kernels


@jit
def _softmax_fwd_kernel(
    X, Y, stride_x, stride_y, n_rows, n_cols, seq_q, scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    valid = mask
    if CAUSAL:
        valid = valid & (cols[None, :] <= (rows % seq_q)[:, None])
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.where(valid, x * scale, float("-inf"))
    m = tl.max(x, axis=1)
    m = tl.where(row_mask, m, 0.0)  # padding rows are all -inf; keep their arithmetic finite
    e = tl.where(valid, tl.exp(x - m[:, None]), 0.0)
    s = tl.sum(e, axis=1)
    s = tl.where(s > 0.0, s, 1.0)
    y = e / s[:, None]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _softmax_bwd_kernel(
    DY, Y, DX, stride_dy, stride_y, stride_dx, n_rows, n_cols, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    y = tl.load(Y + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, axis=1)
    dx = scale * y * (dy - dot[:, None])
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers


def _check(x, scale, causal) -> None:
    check_tensor(OP, "x", x, min_dim=2 if causal else 1)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"{OP}: scale must be a Python number, got {type(scale).__name__}.")


def softmax_forward(x: torch.Tensor, scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    """Launch the forward kernel (no autograd). Returns y with x's shape and dtype."""
    _check(x, scale, causal)
    check_triton_device(OP, x)
    x2 = as_rows(OP, "x", x)
    n_rows, n_cols = x2.shape
    if n_cols > _MAX_COLS:
        raise ValueError(
            f"{OP}: rows of {n_cols} keys exceed the {_MAX_COLS} one program holds; use flash attention "
            f"or the torch reference (kernels.get('softmax', impl='torch'))."
        )
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(n_rows, n_cols)
    block_m, block_n = _tile(n_cols)
    seq_q = x.shape[-2] if causal else 1
    _softmax_fwd_kernel[(cdiv(n_rows, block_m),)](
        x2, y2, x2.stride(0), y2.stride(0), n_rows, n_cols, seq_q, float(scale),
        CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps_for(block_m * block_n),
    )
    return y


def softmax_backward(dy: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Launch the backward kernel. Returns dx."""
    y2 = y.view(-1, y.shape[-1])
    n_rows, n_cols = y2.shape
    dy2 = dy.reshape(n_rows, n_cols)
    if dy2.stride(1) != 1:
        dy2 = dy2.contiguous()
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    dx2 = dx.view(n_rows, n_cols)
    block_m, block_n = _tile(n_cols)
    _softmax_bwd_kernel[(cdiv(n_rows, block_m),)](
        dy2, y2, dx2, dy2.stride(0), y2.stride(0), dx2.stride(0), n_rows, n_cols, float(scale),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps_for(block_m * block_n),
    )
    return dx


# --------------------------------------------------------------------------- autograd


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, causal):
        y = softmax_forward(x, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_backward(dy, y, ctx.scale), None, None


def softmax(x: torch.Tensor, scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    """softmax(scale * x) over the last dim (Triton); causal masks keys j > query i (dim -2)."""
    _check(x, scale, causal)
    return SoftmaxFunction.apply(x, scale, causal)


# --------------------------------------------------------------------------- reference


def softmax_reference(x: torch.Tensor, scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    """Plain torch: scale, masked_fill(-inf) above the diagonal, softmax in fp32, one rounding."""
    _check(x, scale, causal)
    xf = x.float() * scale
    if causal:
        sq, sk = x.shape[-2], x.shape[-1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=x.device).tril()
        xf = xf.masked_fill(~keep, float("-inf"))
    return torch.softmax(xf, dim=-1).to(x.dtype)
