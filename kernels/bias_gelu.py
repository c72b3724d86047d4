"""Fused bias + GeLU: y = gelu(x + bias), tanh approximation (default) or exact erf.

In the MLP of GPT-style models the first linear's bias add and the GeLU are two element-wise
kernels in eager PyTorch, and their backward is two more plus a column reduction for the bias
gradient. Here the forward reads x once and writes y once; the backward reads x and dy once,
writes dx, and reduces dbias from per-program partial sums in the same pass. x + bias is
recomputed in the backward instead of being stored.

GeLU, with u = x + bias (all in fp32):
    tanh: y = 0.5 u (1 + tanh(k0 (u + k1 u^3))),  k0 = sqrt(2/pi), k1 = 0.044715 (Hendrycks & Gimpel
          2016, eq. for the tanh approximation; the same constants as torch's approximate="tanh")
          dy/du = 0.5 (1 + t) + 0.5 u (1 - t^2) k0 (1 + 3 k1 u^2),  t = tanh(...)
    erf:  y = 0.5 u (1 + erf(u / sqrt(2))),  dy/du = 0.5 (1 + erf(u / sqrt(2))) + u exp(-u^2/2) / sqrt(2 pi)
tanh(v) is computed as 2 sigmoid(2v) - 1 with v clamped to [-15, 15], where tanh is +-1.0 in fp32.
"""

from __future__ import annotations

import torch

from autoplan.kernels._checks import (
    as_rows,
    check_same_device,
    check_tensor,
    check_triton_device,
    check_vector,
)
from autoplan.kernels._triton import cdiv, jit, next_power_of_2, num_warps_for, persistent_programs, tl

OP = "bias_gelu"

# Element-wise tile: up to 1024 columns (a 2 KiB bf16 row segment, 16-byte vector loads per
# thread) and 4096 elements per program, 16 per thread at 8 warps.
_MAX_BLOCK_N = 1024
_TILE_ELEMS = 4096
_APPROX = {"none": 0, "tanh": 1}


def _tile(n_cols: int) -> tuple[int, int]:
    block_n = min(_MAX_BLOCK_N, next_power_of_2(n_cols))
    return max(1, _TILE_ELEMS // block_n), block_n


# --------------------------------------------------------------------------- kernels


@jit
def _bias_gelu_fwd_kernel(
    X, B, Y, stride_x, stride_y, n_rows, n_cols,
    HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    u = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u = u + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if APPROX_TANH:
        v = 0.7978845608028654 * (u + 0.044715 * u * u * u)
        v = tl.minimum(tl.maximum(v, -15.0), 15.0)  # tanh(15) is 1.0 in fp32: no exp overflow
        t = 2.0 * tl.sigmoid(2.0 * v) - 1.0
        y = 0.5 * u * (1.0 + t)
    else:
        y = 0.5 * u * (1.0 + tl.math.erf(u * 0.7071067811865476))
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _bias_gelu_bwd_kernel(
    DY, X, B, DX, DB_PARTIAL, stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
    HAS_BIAS: tl.constexpr, COMPUTE_DB: tl.constexpr, APPROX_TANH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Grid: (row ranges, column blocks). Each program walks its row range and keeps the column
    # sums of dx (= dbias contribution) in registers, written once to DB_PARTIAL[pid_m, cols].
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid_m * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for start in range(row_start, row_end, BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        u = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u = u + b[None, :]
        if APPROX_TANH:
            v = 0.7978845608028654 * (u + 0.044715 * u * u * u)
            v = tl.minimum(tl.maximum(v, -15.0), 15.0)  # as in the forward; tanh' there is < 1e-12
            t = 2.0 * tl.sigmoid(2.0 * v) - 1.0
            # 0.134145 = 3 * 0.044715 (derivative of k1 u^3); 0.3989... below is 1 / sqrt(2 pi).
            dgelu = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * u * u)
        else:
            dgelu = 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476)) + u * tl.exp(-0.5 * u * u) * 0.3989422804014327
        dx = tl.where(mask, dy * dgelu, 0.0)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DB:
            db_acc += tl.sum(dx, axis=0)
    if COMPUTE_DB:
        tl.store(DB_PARTIAL + pid_m * n_cols + cols, db_acc, mask=col_mask)


# --------------------------------------------------------------------------- launchers


def _check(x, bias, approximate) -> None:
    check_tensor(OP, "x", x)
    check_vector(OP, "bias", bias, x.shape[-1] if x.dim() else 0)
    check_same_device(OP, x=x, bias=bias)
    if approximate not in _APPROX:
        raise ValueError(f"{OP}: approximate must be 'tanh' or 'none' (exact erf), got {approximate!r}.")


def bias_gelu_forward(x, bias, approximate: str = "tanh", checked: bool = False):
    """Launch the forward kernel (no autograd). Returns y with x's shape and dtype."""
    if not checked:  # the autograd entry point has checked its arguments
        _check(x, bias, approximate)
    check_triton_device(OP, x)
    x2 = as_rows(OP, "x", x)
    n_rows, n_cols = x2.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(n_rows, n_cols)
    block_m, block_n = _tile(n_cols)
    _bias_gelu_fwd_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
        x2, bias if bias is not None else x2, y2, x2.stride(0), y2.stride(0), n_rows, n_cols,
        HAS_BIAS=bias is not None, APPROX_TANH=_APPROX[approximate] == 1, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps_for(block_m * block_n),
    )
    return y


def _rows(t: torch.Tensor) -> torch.Tensor:
    try:
        return t.view(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().view(-1, t.shape[-1])
    except RuntimeError:
        return t.contiguous().view(-1, t.shape[-1])


def bias_gelu_backward(dy, x, bias, approximate: str = "tanh", compute_db: bool = True):
    """Launch the backward kernel. Returns (dx, dbias or None)."""
    x2 = as_rows(OP, "x", x)
    dy2 = _rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = dx.view(n_rows, n_cols)
    block_m, block_n = _tile(n_cols)
    col_blocks = cdiv(n_cols, block_n)
    compute_db = bool(compute_db and bias is not None)
    # Spread the persistent programs over column blocks first, then over row ranges.
    row_programs = max(1, persistent_programs(x.device, cdiv(n_rows, block_m) * col_blocks) // col_blocks)
    rows_per_program = cdiv(cdiv(n_rows, row_programs), block_m) * block_m
    row_programs = cdiv(n_rows, rows_per_program)
    partial = torch.empty((row_programs, n_cols) if compute_db else (1,), dtype=torch.float32, device=x.device)
    _bias_gelu_bwd_kernel[(row_programs, col_blocks)](
        dy2, x2, bias if bias is not None else x2, dx2, partial,
        dy2.stride(0), x2.stride(0), dx2.stride(0), n_rows, n_cols, rows_per_program,
        HAS_BIAS=bias is not None, COMPUTE_DB=compute_db, APPROX_TANH=_APPROX[approximate] == 1,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps_for(block_m * block_n),
    )
    db = partial.sum(0).to(bias.dtype) if compute_db else None
    return dx, db


# --------------------------------------------------------------------------- autograd


class BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        y = bias_gelu_forward(x, bias, approximate, checked=True)
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, db = bias_gelu_backward(dy, x, bias, ctx.approximate, compute_db=ctx.needs_input_grad[1])
        return (dx if ctx.needs_input_grad[0] else None), db, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """gelu(x + bias) over the last dimension (Triton). approximate: 'tanh' (default) or 'none' (erf)."""
    _check(x, bias, approximate)
    return BiasGeluFunction.apply(x, bias, approximate)


# --------------------------------------------------------------------------- reference


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh"):
    """Plain torch: F.gelu(x + bias) computed in fp32 and rounded once, like the kernel."""
    _check(x, bias, approximate)
    u = x.float() if bias is None else x.float() + bias.float()
    return torch.nn.functional.gelu(u, approximate=approximate).to(x.dtype)
