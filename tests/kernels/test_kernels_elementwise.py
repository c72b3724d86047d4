"""bias+GeLU and SwiGLU kernels vs their references, forward and backward, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from autoplan.kernels.bias_gelu import bias_gelu, bias_gelu_reference
from autoplan.kernels.swiglu import swiglu, swiglu_reference

DTYPES = [torch.float32, torch.bfloat16]


def _compare(run, close, fused, reference, inputs, dtype, *args, reduced=()):
    out, dy, grads = run(fused, inputs, *args)
    out_ref, _, grads_ref = run(reference, inputs, *args, upcast=True, grad_out=dy)
    assert out.dtype == dtype
    close(out, out_ref, dtype)
    rows = inputs[0].numel() // inputs[0].shape[-1]
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref, strict=True)):
        if g_ref is None:
            assert g is None
            continue
        assert g.dtype == dtype and g.shape == inputs[i].shape
        close(g, g_ref, dtype, reduced=i in reduced, scale=rows**0.5 if i in reduced else 1.0)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(run, close, dtype, approximate):
    x = (torch.randn(67, 781) * 3).to(dtype)  # 781 = one partial column block of 1024
    b = torch.randn(781).to(dtype)
    _compare(run, close, bias_gelu, bias_gelu_reference, [x, b], dtype, approximate, reduced=(1,))


def test_bias_gelu_wide_rows_and_3d(run, close):
    # 2500 columns = 3 column blocks of 1024 (two full, one partial); 3-D input
    x = torch.randn(2, 5, 2500) * 2
    b = torch.randn(2500)
    _compare(run, close, bias_gelu, bias_gelu_reference, [x, b], torch.float32, "tanh", reduced=(1,))


def test_gelu_without_bias_matches_torch_gelu(run, close):
    x = torch.randn(33, 130) * 4
    for approximate in ("tanh", "none"):
        out, dy, (g, _) = run(bias_gelu, [x, None], approximate)
        ref = torch.nn.functional.gelu(x, approximate=approximate)
        close(out, ref, torch.float32)
        xr = x.clone().requires_grad_(True)
        torch.nn.functional.gelu(xr, approximate=approximate).backward(dy)
        close(g, xr.grad, torch.float32)


def test_bias_gelu_extreme_values_are_finite():
    x = torch.tensor([[-1e4, -60.0, -5.0, 0.0, 5.0, 60.0, 1e4]])
    for approximate in ("tanh", "none"):
        x_ = x.clone().requires_grad_(True)
        y = bias_gelu(x_, None, approximate)
        y.sum().backward()
        assert torch.isfinite(y).all() and torch.isfinite(x_.grad).all()
        torch.testing.assert_close(y, torch.nn.functional.gelu(x, approximate=approximate).detach())
        torch.testing.assert_close(x_.grad, torch.tensor([[0.0, 0.0, -7.0e-6, 0.5, 1.0, 1.0, 1.0]]),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_two_tensors(run, close, dtype):
    g = (torch.randn(3, 23, 781) * 3).to(dtype)
    u = torch.randn(3, 23, 781).to(dtype)
    _compare(run, close, swiglu, swiglu_reference, [g, u], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_concatenated(run, close, dtype):
    x = (torch.randn(41, 2 * 1100) * 3).to(dtype)  # F = 1100: two column blocks
    out, dy, (gx,) = run(swiglu, [x])
    assert out.shape == (41, 1100)
    out_ref, _, (gx_ref,) = run(swiglu_reference, [x], upcast=True, grad_out=dy)
    close(out, out_ref, dtype)
    assert gx.shape == x.shape
    close(gx, gx_ref, dtype)


def test_swiglu_concatenated_equals_split(close):
    x = torch.randn(9, 2 * 300)
    gate, up = x.chunk(2, dim=-1)
    close(swiglu(x), swiglu(gate.contiguous(), up.contiguous()), torch.float32)


def test_swiglu_on_views_of_a_fused_projection(run, close):
    # gate and up as strided views (row stride 2F) of one tensor, as after a fused gate/up matmul
    x = torch.randn(17, 2 * 200)
    gate, up = x[:, :200], x[:, 200:]
    close(swiglu(gate, up), swiglu_reference(gate, up), torch.float32)


def test_elementwise_bad_inputs():
    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.randn(4, 7))
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(TypeError, match="same dtype"):
        swiglu(torch.randn(4, 8), torch.randn(4, 8).bfloat16())
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        bias_gelu(torch.randn(4, 8), None, "erf")
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        bias_gelu(torch.randn(4, 8), torch.randn(4, 8))
    from autoplan.kernels.bias_gelu import bias_gelu_forward  # the launcher without autograd checks too

    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        bias_gelu_forward(torch.randn(4, 8), torch.randn(4, 8))
