"""Shared setup for the kernel tests: run the Triton kernels on the CPU interpreter.

TRITON_INTERPRET is set per test (not at import), which works because kernels/_triton.py picks
the interpreter at launch time, and does not leak into other packages' tests.
"""

from __future__ import annotations

import pytest
import torch

# Stated tolerances (elementwise |actual - expected| <= atol + rtol * |expected|), against a
# reference computed in fp32 from the same inputs:
#  * fp32: kernels and references differ only in summation order (row reductions of <= 4096
#    terms): 1e-5 relative; gradients that sum over rows (dweight, dbias) get 1e-4.
#  * bf16: the interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest), so outputs
#    may be 1 ulp = 2^-7 relative away: 1.6e-2 (2 ulp), with atol 1e-2 for values near zero.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    "float32_reduced": dict(rtol=1e-4, atol=1e-4),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype, reduced: bool = False, scale: float = 1.0):
    """Compare in fp32 with the tolerance for `dtype`; `scale` widens atol for large-magnitude sums."""
    key = "float32_reduced" if (reduced and dtype == torch.float32) else dtype
    tol = TOL[key]
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two busy cores made small steps 30x slower
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def close():
    return assert_close


def fwd_bwd(fn, inputs, *args, upcast: bool = False, grad_out: torch.Tensor | None = None, **kwargs):
    """Run fn(*inputs, *args, **kwargs) on fresh leaf copies of `inputs` (floating ones require grad),
    back-propagate `grad_out` (default: a fixed random tensor) and return (out, grad_out, grads).

    With upcast=True the inputs and grad_out are converted to fp32 first (the "truth" for bf16 runs).
    """
    leaves = []
    for t in inputs:
        if t is None or not t.is_floating_point():
            leaves.append(t)
            continue
        t = t.detach().float() if upcast else t.detach()
        leaves.append(t.clone().requires_grad_(True))
    out = fn(*leaves, *args, **kwargs)
    if grad_out is None:
        gen = torch.Generator().manual_seed(1234)
        grad_out = torch.randn(out.shape, generator=gen).to(out.dtype)
    out.backward(grad_out.float() if upcast else grad_out.to(out.dtype))
    grads = [None if (t is None or not t.is_floating_point()) else t.grad for t in leaves]
    return out.detach(), grad_out, grads


@pytest.fixture
def run():
    return fwd_bwd
