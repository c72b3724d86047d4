"""RMSNorm and LayerNorm kernels vs their references, forward and backward, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from autoplan.kernels._triton import KernelUnavailableError
from autoplan.kernels.layer_norm import layer_norm, layer_norm_reference
from autoplan.kernels.rms_norm import rms_norm, rms_norm_reference


def _check_against_truth(run, close, fused, reference, inputs, dtype, *args):
    """Fused op on `dtype` inputs vs the reference on the same values upcast to fp32."""
    out, dy, grads = run(fused, inputs, *args)
    out_ref, _, grads_ref = run(reference, inputs, *args, upcast=True, grad_out=dy)
    assert out.dtype == dtype
    close(out, out_ref, dtype)
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref, strict=True)):
        if g_ref is None:
            assert g is None
            continue
        assert g is not None and g.dtype == dtype and g.shape == inputs[i].shape
        # dx is per element; parameter grads sum over all rows (scale atol by sqrt(rows)).
        rows = inputs[0].numel() // inputs[0].shape[-1]
        close(g, g_ref, dtype, reduced=i > 0, scale=1.0 if i == 0 else rows**0.5)
    return out, grads


def test_rms_norm_1823x781_fp32(run, close):
    x = torch.randn(1823, 781)
    w = torch.rand(781) + 0.5
    _check_against_truth(run, close, rms_norm, rms_norm_reference, [x, w], torch.float32, 1e-6)


def test_layer_norm_1823x781_fp32(run, close):
    x = torch.randn(1823, 781) * 2 + 0.5
    w, b = torch.rand(781) + 0.5, torch.randn(781)
    _check_against_truth(run, close, layer_norm, layer_norm_reference, [x, w, b], torch.float32, 1e-5)


@pytest.mark.parametrize("hidden", [97, 1000, 4096])
def test_rms_norm_bf16_3d(run, close, hidden):
    x = torch.randn(3, 11, hidden).bfloat16()
    w = (torch.rand(hidden) + 0.5).bfloat16()
    _check_against_truth(run, close, rms_norm, rms_norm_reference, [x, w], torch.bfloat16, 1e-6)


@pytest.mark.parametrize("hidden", [97, 1000])
def test_layer_norm_bf16_3d(run, close, hidden):
    x = (torch.randn(3, 11, hidden) + 1.0).bfloat16()
    w, b = (torch.rand(hidden) + 0.5).bfloat16(), torch.randn(hidden).bfloat16()
    _check_against_truth(run, close, layer_norm, layer_norm_reference, [x, w, b], torch.bfloat16, 1e-5)


def test_norms_without_affine_parameters(run, close):
    x = torch.randn(37, 200)
    _check_against_truth(run, close, rms_norm, rms_norm_reference, [x, None], torch.float32, 1e-6)
    _check_against_truth(run, close, layer_norm, layer_norm_reference, [x, None, None], torch.float32, 1e-5)
    # weight without bias
    _check_against_truth(run, close, layer_norm, layer_norm_reference, [x, torch.rand(200), None],
                         torch.float32, 1e-5)


# eps=0: the interpreter also evaluates the masked padding rows (0/0), which are never stored.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_rms_norm_output_is_normalized():
    x = torch.randn(50, 333) * 7
    y = rms_norm(x, None, 0.0)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(50), rtol=1e-5, atol=1e-5)


# eps=0: the interpreter also evaluates the masked padding rows (0/0), which are never stored.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_layer_norm_output_has_zero_mean_unit_variance():
    x = torch.randn(50, 333) * 3 + 4
    y = layer_norm(x, None, None, 0.0)
    torch.testing.assert_close(y.mean(-1), torch.zeros(50), rtol=0, atol=1e-5)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(50), rtol=1e-4, atol=1e-4)


def test_eps_none_matches_torch_rmsnorm_module():
    x = torch.randn(9, 130)
    module = torch.nn.RMSNorm(130)  # eps=None -> finfo(float32).eps
    torch.testing.assert_close(rms_norm(x, module.weight.detach(), None), module(x).detach())


def test_strided_rows_need_no_copy(close):
    base = torch.randn(40, 800)
    x = base[:, :781]  # row stride 800, last dim contiguous: viewable as rows without a copy
    w = torch.rand(781)
    close(rms_norm(x, w), rms_norm_reference(x.contiguous(), w), torch.float32)
    close(layer_norm(x, w, None), layer_norm_reference(x.contiguous(), w, None), torch.float32)


def test_only_weight_grad():
    x = torch.randn(21, 100)
    w = torch.rand(100, requires_grad=True)
    rms_norm(x, w).sum().backward()
    w_ref = w.detach().clone().requires_grad_(True)
    rms_norm_reference(x, w_ref).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise_typed_errors(monkeypatch):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(TypeError, match="dtype int64"):
        rms_norm(torch.ones(4, 8, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="last dimension of x must be contiguous"):
        layer_norm(torch.randn(8, 4).t(), None, None)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        layer_norm(x, None, None, eps=-1.0)
    with pytest.raises(ValueError, match="64 KiB"):
        rms_norm(torch.randn(2, 20000), None)
    # the launchers without autograd check their arguments themselves (the autograd path checks once, at entry)
    from autoplan.kernels.layer_norm import layer_norm_forward
    from autoplan.kernels.rms_norm import rms_norm_forward

    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        rms_norm_forward(x, torch.ones(7))
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        layer_norm_forward(x, None, None, eps=-1.0)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(KernelUnavailableError, match="TRITON_INTERPRET=1"):
        rms_norm(x, None)
