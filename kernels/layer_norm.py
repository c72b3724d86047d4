"""Fused LayerNorm: y = (x - mean) / sqrt(var + eps) * weight + bias, one pass forward, one backward.

The backward computes dx and the weight/bias gradients in the same pass over x and dy: each
program accumulates its rows' share of dweight/dbias in registers and writes one partial row,
and the partials ([programs, hidden], fp32) are summed at the end. PyTorch's own CUDA backward
reads x and dy twice (once for dx, once more for the parameter gradients).

Math (per row, N = hidden size, all in fp32):
    mean = sum(x)/N,  rstd = 1/sqrt(sum((x-mean)^2)/N + eps),  xhat = (x-mean)*rstd,  y = xhat*w + b
    dx = rstd * (w*dy - xhat * sum(xhat*w*dy)/N - sum(w*dy)/N)
    dw = sum over rows of dy*xhat,   db = sum over rows of dy
"""

from __future__ import annotations

import torch

from autoplan.kernels._checks import (
    as_rows,
    check_max_row,
    check_same_device,
    check_tensor,
    check_triton_device,
    check_vector,
)
from autoplan.kernels._triton import (
    cdiv,
    jit,
    num_warps_for,
    num_warps_for_backward,
    persistent_programs,
    tl,
)
from autoplan.kernels.rms_norm import (  # same tiling and register budget (reasons there)
    _MAX_REGISTER_ACCUMULATOR,
    _tile,
)

OP = "layer_norm"

# --------------------------------------------------------------------------- kernels


@jit
def _layer_norm_fwd_kernel(
    X, Y, W, B, MEAN, RSTD,
    stride_x, stride_y, n_rows, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    diff = tl.where(mask, x - mean[:, None], 0.0)  # padding columns must not add to the variance
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / n_cols + eps)
    y = diff * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    ACC_IN_REGISTERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Grid-stride over rows, as in rms_norm.py; the partial parameter gradients of program `pid`
    # go to row `pid` of DW_PARTIAL/DB_PARTIAL, accumulated in registers or in that row itself.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    dw_partial = DW_PARTIAL + pid * n_cols + cols
    db_partial = DB_PARTIAL + pid * n_cols + cols
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for start in range(row_start, row_end, BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if COMPUTE_DW:
            if ACC_IN_REGISTERS:
                dw_acc += tl.sum(dy * xhat, axis=0)
            else:
                tl.store(dw_partial, tl.load(dw_partial, mask=col_mask, other=0.0) + tl.sum(dy * xhat, axis=0),
                         mask=col_mask)
        if COMPUTE_DB:
            if ACC_IN_REGISTERS:
                db_acc += tl.sum(dy, axis=0)
            else:
                tl.store(db_partial, tl.load(db_partial, mask=col_mask, other=0.0) + tl.sum(dy, axis=0),
                         mask=col_mask)
        if HAS_WEIGHT:
            # re-read per row block (an L1/L2 hit), see rms_norm.py
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1) / n_cols
        c2 = tl.sum(wdy, axis=1) / n_cols
        dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if ACC_IN_REGISTERS:
        if COMPUTE_DW:
            tl.store(dw_partial, dw_acc, mask=col_mask)
        if COMPUTE_DB:
            tl.store(db_partial, db_acc, mask=col_mask)


# --------------------------------------------------------------------------- launchers


def _check(x, weight, bias, eps) -> None:
    check_tensor(OP, "x", x)
    n = x.shape[-1] if x.dim() else 0
    check_vector(OP, "weight", weight, n)
    check_vector(OP, "bias", bias, n)
    check_same_device(OP, x=x, weight=weight, bias=bias)
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"{OP}: eps must be a non-negative number, got {eps!r}.")


def layer_norm_forward(x, weight, bias, eps: float = 1e-5, checked: bool = False):
    """Launch the forward kernel (no autograd). Returns (y, mean[rows] fp32, rstd[rows] fp32)."""
    if not checked:  # the autograd entry point has checked its arguments
        _check(x, weight, bias, eps)
    check_triton_device(OP, x)
    x2 = as_rows(OP, "x", x)
    n_rows, n_cols = x2.shape
    check_max_row(OP, n_cols, x.element_size())
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(n_rows, n_cols)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_m, block_n = _tile(n_cols)
    _layer_norm_fwd_kernel[(cdiv(n_rows, block_m),)](
        x2, y2, weight if weight is not None else x2, bias if bias is not None else x2, mean, rstd,
        x2.stride(0), y2.stride(0), n_rows, n_cols, float(eps),
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps_for(block_m * block_n),
    )
    return y, mean, rstd


def _rows(t: torch.Tensor) -> torch.Tensor:
    try:
        return t.view(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().view(-1, t.shape[-1])
    except RuntimeError:
        return t.contiguous().view(-1, t.shape[-1])


def layer_norm_backward(dy, x, weight, bias, mean, rstd, compute_dw: bool = True, compute_db: bool = True):
    """Launch the backward kernel. Returns (dx, dweight or None, dbias or None)."""
    x2 = as_rows(OP, "x", x)
    dy2 = _rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = dx.view(n_rows, n_cols)
    block_m, block_n = _tile(n_cols)
    compute_dw = bool(compute_dw and weight is not None)
    compute_db = bool(compute_db and bias is not None)
    programs = persistent_programs(x.device, cdiv(n_rows, block_m))
    rows_per_program = cdiv(cdiv(n_rows, programs), block_m) * block_m
    programs = cdiv(n_rows, rows_per_program)
    f32 = dict(dtype=torch.float32, device=x.device)
    in_registers = block_n <= _MAX_REGISTER_ACCUMULATOR
    alloc = torch.empty if in_registers else torch.zeros
    dw_partial = alloc((programs, n_cols) if compute_dw else (1,), **f32)
    db_partial = alloc((programs, n_cols) if compute_db else (1,), **f32)
    _layer_norm_bwd_kernel[(programs,)](
        dy2, x2, weight if weight is not None else x2, mean, rstd, dx2, dw_partial, db_partial,
        dy2.stride(0), x2.stride(0), dx2.stride(0), n_rows, n_cols, rows_per_program,
        HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
        ACC_IN_REGISTERS=in_registers, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps_for_backward(block_m * block_n),
    )
    dw = dw_partial.sum(0).to(weight.dtype) if compute_dw else None
    db = db_partial.sum(0).to(bias.dtype) if compute_db else None
    return dx, dw, db


# --------------------------------------------------------------------------- autograd


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = layer_norm_forward(x, weight, bias, eps, checked=True)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(
            dy, x, weight, bias, mean, rstd,
            compute_dw=ctx.needs_input_grad[1], compute_db=ctx.needs_input_grad[2],
        )
        return (dx if ctx.needs_input_grad[0] else None), dw, db, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """Fused LayerNorm over the last dimension of `x` (Triton)."""
    _check(x, weight, bias, eps)
    return LayerNormFunction.apply(x, weight, bias, eps)


# --------------------------------------------------------------------------- reference


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         eps: float = 1e-5) -> torch.Tensor:
    """Plain-torch LayerNorm with the kernel's numerics (fp32 math, one rounding at the end).

    Uses torch's native F.layer_norm when the parameters have the input's dtype, and the composite
    formula otherwise (F.layer_norm rejects mixed dtypes).
    """
    _check(x, weight, bias, eps)
    if all(p is None or p.dtype == x.dtype for p in (weight, bias)):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
