"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, forward and backward in one pass each.

Eager PyTorch (the Llama/HF formulation in `rms_norm_reference`) runs five or six element-wise
kernels with fp32 intermediates; the fused forward reads x once and writes y once, and the fused
backward reads x and dy once and writes dx once, with the weight gradient reduced from per-program
partial sums. Traffic counts are in `kernels/traffic.py`.

Math (per row, N = hidden size, all in fp32):
    rstd = 1 / sqrt(sum(x^2) / N + eps),  xhat = x * rstd,  y = xhat * w
    dx = rstd * (w*dy - xhat * sum(xhat * w*dy) / N),   dw = sum over rows of dy * xhat
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
    next_power_of_2,
    num_warps_for,
    num_warps_for_backward,
    persistent_programs,
    tl,
)

OP = "rms_norm"

# Elements one program holds (BLOCK_M x BLOCK_N). 4096 fp32 values = 8 warps at 16 values per
# thread (see num_warps_for); narrow rows get several rows per program instead of idle lanes.
_TILE_ELEMS = 4096
# Cap on rows per program, so that short rows (hidden 64) still spread over many programs.
_MAX_ROWS_PER_PROGRAM = 16
# Widest row whose weight-gradient accumulator stays in registers in the backward. Compiled for
# sm_90, BLOCK_N 16384 spilled 80-360 bytes per thread at 16 or 32 warps; 8192 did not
# (tests/kernels/test_kernels_compile_sm90.py checks this).
_MAX_REGISTER_ACCUMULATOR = 8192


def _tile(n_cols: int) -> tuple[int, int]:
    block_n = next_power_of_2(n_cols)
    block_m = max(1, min(_MAX_ROWS_PER_PROGRAM, _TILE_ELEMS // block_n))
    return block_m, block_n


# --------------------------------------------------------------------------- kernels


@jit
def _rms_norm_fwd_kernel(
    X, Y, W, RSTD,
    stride_x, stride_y, n_rows, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, DW_IN_REGISTERS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Grid-stride over rows: program `pid` owns rows [pid * rows_per_program, ... + rows_per_program)
    # and accumulates its share of dw in DW_PARTIAL[pid, :]: in registers, written once at the end
    # (DW_IN_REGISTERS), or, for rows too wide to keep another row of registers, added to its
    # own (zero-initialised) partial row after each row block, which stays in L1/L2.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    partial = DW_PARTIAL + pid * n_cols + cols
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for start in range(row_start, row_end, BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = x * rstd[:, None]
        if COMPUTE_DW:
            if DW_IN_REGISTERS:
                dw_acc += tl.sum(dy * xhat, axis=0)
            else:
                tl.store(partial, tl.load(partial, mask=col_mask, other=0.0) + tl.sum(dy * xhat, axis=0),
                         mask=col_mask)
        if HAS_WEIGHT:
            # re-read per row block (an L1/L2 hit) rather than holding a row of registers across
            # the loop, which made the kernel spill at hidden 8192
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c = tl.sum(xhat * wdy, axis=1) / n_cols
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if COMPUTE_DW and DW_IN_REGISTERS:
        tl.store(partial, dw_acc, mask=col_mask)


# --------------------------------------------------------------------------- launchers


def _resolve_eps(eps, dtype) -> float:
    # Same default as torch.nn.RMSNorm: eps=None means the machine epsilon of the input dtype.
    return float(torch.finfo(dtype).eps if eps is None else eps)


def _check(x, weight, eps) -> None:
    check_tensor(OP, "x", x)
    check_vector(OP, "weight", weight, x.shape[-1] if x.dim() else 0)
    check_same_device(OP, x=x, weight=weight)
    if eps is not None and not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"{OP}: eps must be a non-negative number or None, got {eps!r}.")


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None = 1e-6, checked: bool = False):
    """Launch the forward kernel (no autograd). Returns (y, rstd[rows] fp32)."""
    if not checked:  # the autograd entry point has checked its arguments
        _check(x, weight, eps)
    check_triton_device(OP, x)
    x2 = as_rows(OP, "x", x)
    n_rows, n_cols = x2.shape
    check_max_row(OP, n_cols, x.element_size())
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(n_rows, n_cols)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_m, block_n = _tile(n_cols)
    _rms_norm_fwd_kernel[(cdiv(n_rows, block_m),)](
        x2, y2, weight if weight is not None else x2, rstd,
        x2.stride(0), y2.stride(0), n_rows, n_cols, _resolve_eps(eps, x.dtype),
        HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps_for(block_m * block_n),
    )
    return y, rstd


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Rows view of an internal tensor (a gradient), copying only when no view exists."""
    try:
        return t.view(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().view(-1, t.shape[-1])
    except RuntimeError:
        return t.contiguous().view(-1, t.shape[-1])


def rms_norm_backward(dy, x, weight, rstd, compute_dw: bool = True):
    """Launch the backward kernel. Returns (dx, dweight or None)."""
    x2 = as_rows(OP, "x", x)
    dy2 = _rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = dx.view(n_rows, n_cols)
    block_m, block_n = _tile(n_cols)
    compute_dw = bool(compute_dw and weight is not None)
    programs = persistent_programs(x.device, cdiv(n_rows, block_m))
    rows_per_program = cdiv(cdiv(n_rows, programs), block_m) * block_m  # whole row blocks each
    programs = cdiv(n_rows, rows_per_program)
    in_registers = block_n <= _MAX_REGISTER_ACCUMULATOR
    alloc = torch.empty if in_registers else torch.zeros
    partial = alloc((programs, n_cols) if compute_dw else (1,), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        dy2, x2, weight if weight is not None else x2, rstd, dx2, partial,
        dy2.stride(0), x2.stride(0), dx2.stride(0), n_rows, n_cols, rows_per_program,
        HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, DW_IN_REGISTERS=in_registers,
        BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps_for_backward(block_m * block_n),
    )
    dw = partial.sum(0).to(weight.dtype) if compute_dw else None
    return dx, dw


# --------------------------------------------------------------------------- autograd


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps, checked=True)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd, compute_dw=ctx.needs_input_grad[1])
        return (dx if ctx.needs_input_grad[0] else None), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = 1e-6) -> torch.Tensor:
    """Fused RMSNorm over the last dimension of `x` (Triton). `eps=None` takes finfo(x.dtype).eps."""
    _check(x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)


# --------------------------------------------------------------------------- reference


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = 1e-6):
    """Plain-torch RMSNorm with the kernel's numerics: fp32 math, one rounding to x.dtype at the end.

    Uses torch's native F.rms_norm (same numerics) when the weight has the input's dtype, and the
    composite formula otherwise (F.rms_norm rejects mixed dtypes).
    """
    _check(x, weight, eps)
    if weight is None or weight.dtype == x.dtype:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, _resolve_eps(eps, x.dtype))
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _resolve_eps(eps, x.dtype))
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
