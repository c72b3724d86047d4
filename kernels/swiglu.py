"""Fused SwiGLU: y = silu(gate) * up, from two tensors or one concatenated [gate | up] tensor.

Llama-style MLPs compute silu(x W_gate) * (x W_up). Eager PyTorch runs silu and the product as two
kernels (writing and re-reading silu(gate)), and four or more in the backward. Here the forward
reads gate and up once and writes y; the backward reads gate, up and dy once and writes both
gradients. With a fused gate/up projection the input is one tensor [..., 2F] whose first half is
the gate (the order of Megatron-LM's `torch.chunk(x, 2, dim=-1)`); its gradient is written into
one [..., 2F] tensor the same way, so no split or concatenation copies are made.

Math (fp32): s = sigmoid(g),  y = g s u,  dg = dy u s (1 + g (1 - s)),  du = dy g s
"""

from __future__ import annotations

import torch

from autoplan.kernels._checks import as_rows, check_same_device, check_tensor, check_triton_device
from autoplan.kernels._triton import cdiv, jit, next_power_of_2, num_warps_for, tl

OP = "swiglu"

# Element-wise tile as in bias_gelu.py: <= 1024 columns, 4096 elements (16 per thread at 8 warps).
_MAX_BLOCK_N = 1024
_TILE_ELEMS = 4096


def _tile(n_cols: int) -> tuple[int, int]:
    block_n = min(_MAX_BLOCK_N, next_power_of_2(n_cols))
    return max(1, _TILE_ELEMS // block_n), block_n


# --------------------------------------------------------------------------- kernels


@jit
def _swiglu_fwd_kernel(
    G, U, Y, stride_g, stride_u, stride_y, n_rows, n_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(
    DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, n_rows, n_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(DG + rows[:, None] * stride_dg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + rows[:, None] * stride_du + cols[None, :], du.to(DU.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers


def _split(gate, up):
    """Check the inputs and return (gate_rows, up_rows) 2-D views sharing storage with the inputs."""
    check_tensor(OP, "gate", gate)
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(
                f"{OP}: with one input, its last dimension holds [gate | up] and must be even, got "
                f"{gate.shape[-1]} (shape {tuple(gate.shape)}); pass gate and up as two tensors instead."
            )
        x2 = as_rows(OP, "x", gate)
        f = x2.shape[1] // 2
        return x2[:, :f], x2[:, f:]
    check_tensor(OP, "up", up)
    check_same_device(OP, gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"{OP}: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}.")
    if gate.dtype != up.dtype:
        raise TypeError(f"{OP}: gate and up must have the same dtype, got {gate.dtype} and {up.dtype}.")
    return as_rows(OP, "gate", gate), as_rows(OP, "up", up)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the forward kernel (no autograd). Returns y of shape gate.shape[:-1] + (F,)."""
    g2, u2 = _split(gate, up)
    check_triton_device(OP, gate)
    n_rows, n_cols = g2.shape
    y = torch.empty((*gate.shape[:-1], n_cols), dtype=gate.dtype, device=gate.device)
    y2 = y.view(n_rows, n_cols)
    block_m, block_n = _tile(n_cols)
    _swiglu_fwd_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
        g2, u2, y2, g2.stride(0), u2.stride(0), y2.stride(0), n_rows, n_cols,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps_for(block_m * block_n),
    )
    return y


def swiglu_backward(dy, gate, up=None):
    """Launch the backward kernel. Returns (dgate, dup); with one [gate | up] input, (dx, None)."""
    g2, u2 = _split(gate, up)
    n_rows, n_cols = g2.shape
    dy2 = dy.reshape(n_rows, n_cols)
    if dy2.stride(1) != 1:
        dy2 = dy2.contiguous()
    if up is None:
        dx = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        dx2 = dx.view(n_rows, 2 * n_cols)
        dg2, du2, result = dx2[:, :n_cols], dx2[:, n_cols:], (dx, None)
    else:
        dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        dg2, du2, result = dg.view(n_rows, n_cols), du.view(n_rows, n_cols), (dg, du)
    block_m, block_n = _tile(n_cols)
    _swiglu_bwd_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
        dy2, g2, u2, dg2, du2,
        dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0), n_rows, n_cols,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps_for(block_m * block_n),
    )
    return result


# --------------------------------------------------------------------------- autograd


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        y = swiglu_forward(gate, up)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dy, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up (Triton). With `up=None`, `gate` is one tensor [..., 2F] laid out [gate | up]."""
    _split(gate, up)
    return SwiGLUFunction.apply(gate, up)


# --------------------------------------------------------------------------- reference


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: F.silu(gate) * up in fp32, rounded once to the input dtype."""
    _split(gate, up)
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
