"""The Triton kernels compiled for a real GPU, against their torch references, at realistic sizes.

Forward and backward in bf16 (tolerances: 2 bf16 ulps relative, as the interpreter tests) and fp32 (1e-4).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _pair(name):
    from autoplan import kernels

    return kernels.get(name, impl="triton"), kernels.get(name, impl="torch")


def _check(out, ref, dtype):
    import torch

    tol = 1.6e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_norms_forward_backward(name, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    fused, ref = _pair(name)
    x = torch.randn(4099, 4096, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=dtype, requires_grad=True)
    args = (x, w) if name == "rms_norm" else (x, w, torch.randn_like(w, requires_grad=True))
    y = fused(*args)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, args, g)
    y_ref = ref(*args)
    grads_ref = torch.autograd.grad(y_ref, args, g)
    _check(y, y_ref, dtype)
    for a, b in zip(grads, grads_ref, strict=True):
        _check(a, b, dtype)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_cross_entropy_matches_and_saves_memory(dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    fused, ref = _pair("cross_entropy")
    h = torch.randn(4096, 2048, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(32768, 2048, device="cuda", dtype=dtype, requires_grad=True) * 0.02
    w.retain_grad()
    t = torch.randint(0, 32768, (4096,), device="cuda")
    loss = fused(h, w, t)
    gh, gw = torch.autograd.grad(loss, (h, w))
    loss_ref = ref(h, w, t)
    gh_ref, gw_ref = torch.autograd.grad(loss_ref, (h, w))
    _check(loss, loss_ref, dtype)
    _check(gh, gh_ref, dtype)
    _check(gw, gw_ref, dtype)


def test_tiny_gpt_step_on_cuda_with_fused_kernels_matches_torch():
    import torch

    from autoplan.codegen.fuse import substitute_kernels
    from autoplan.specs import load_model
    from autoplan.zoo import build_model

    spec = load_model("tiny-llama")
    tokens = torch.randint(0, spec.vocab_size, (2, 65), device="cuda")
    losses = []
    for fuse in (False, True):
        model = build_model(spec, device="cuda", dtype=torch.float32, seed=0)
        if fuse:
            substitute_kernels(model, "fused")
        logits = model(tokens[:, :-1])
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
