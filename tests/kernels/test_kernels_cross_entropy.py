"""Chunked linear + cross-entropy vs eager F.cross_entropy, under the interpreter."""

from __future__ import annotations

import pytest
import torch

import autoplan.kernels.cross_entropy as ce
from autoplan.kernels.cross_entropy import cross_entropy, cross_entropy_reference


def _loss_and_grads(fn, hidden, weight, target, upcast=False, grad_scale=1.0, **kwargs):
    h = (hidden.float() if upcast else hidden).clone().requires_grad_(True)
    w = (weight.float() if upcast else weight).clone().requires_grad_(True)
    loss = fn(h, w, target, **kwargs)
    (loss * grad_scale).backward()
    return loss.detach(), h.grad, w.grad


def _problem(n=37, hidden=48, vocab=1531, dtype=torch.float32, ignored=(3, 20)):
    h = torch.randn(n, hidden).to(dtype)
    w = (torch.randn(vocab, hidden) * 0.3).to(dtype)
    t = torch.randint(0, vocab, (n,))
    t[list(ignored)] = -100
    return h, w, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_eager(close, monkeypatch, dtype):
    # 37 rows in chunks of 16 (3 chunks, the last partial); vocab 1531 in blocks of 512 (3 blocks,
    # the last partial) so the online logsumexp merges across blocks.
    monkeypatch.setattr(ce, "_BLOCK_V", 512)
    h, w, t = _problem(dtype=dtype)
    loss, gh, gw = _loss_and_grads(cross_entropy, h, w, t, chunk_size=16)
    loss_ref, gh_ref, gw_ref = _loss_and_grads(cross_entropy_reference, h, w, t, upcast=True)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert gh.dtype == dtype and gw.dtype == dtype
    # The loss is computed in fp32 from logits rounded to the input dtype by the matmul: for bf16,
    # logits carry 2^-8 relative error, the loss (a mean of ~7.5) about 1e-2 absolute.
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5 if dtype == torch.float32 else 2e-3,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)
    close(gh, gh_ref, dtype, reduced=True)
    close(gw, gw_ref, dtype, reduced=True)
    assert torch.all(gh[[3, 20]] == 0), "ignored rows get no gradient"


def test_sum_reduction_and_upstream_gradient(close):
    h, w, t = _problem(n=21, vocab=700)
    loss, gh, gw = _loss_and_grads(cross_entropy, h, w, t, grad_scale=2.5, reduction="sum", chunk_size=8)
    loss_ref, gh_ref, gw_ref = _loss_and_grads(cross_entropy_reference, h, w, t, grad_scale=2.5, reduction="sum")
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-4)
    close(gh, gh_ref, torch.float32, reduced=True)
    close(gw, gw_ref, torch.float32, reduced=True)


def test_reduction_none_without_grad():
    h, w, t = _problem(n=2 * 9, vocab=300, ignored=(3, 11))
    with torch.no_grad():
        per_token = cross_entropy(h.view(2, 9, -1), w, t.view(2, 9), reduction="none", chunk_size=7)
    ref = cross_entropy_reference(h.view(2, 9, -1), w, t.view(2, 9), reduction="none")
    assert per_token.shape == (2, 9)
    torch.testing.assert_close(per_token, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reduction='none' is supported for evaluation only"):
        cross_entropy(h.requires_grad_(True), w, t, reduction="none")


def test_3d_hidden_default_chunk_and_weight_only_grad(close):
    h, w, t = _problem(n=2 * 11, vocab=513)
    h3, t3 = h.view(2, 11, -1), t.view(2, 11)
    w1 = w.clone().requires_grad_(True)
    loss = cross_entropy(h3, w1, t3)  # hidden does not require grad: only dweight is computed
    loss.backward()
    w2 = w.clone().requires_grad_(True)
    cross_entropy_reference(h3, w2, t3).backward()
    close(w1.grad, w2.grad, torch.float32, reduced=True)


def test_never_materialises_full_fp32_logits(monkeypatch):
    # Record every tensor allocated through torch.empty/zeros in the op: none may be as large as
    # the full [N, V] logits, in any dtype.
    n, vocab = 64, 1000  # hidden 16: the weight and its gradient (16K elements) stay under N*V/2
    h, w, t = _problem(n=n, hidden=16, vocab=vocab, ignored=())
    sizes = []
    for name in ("empty", "zeros", "empty_like", "zeros_like"):
        real = getattr(torch, name)

        def spy(*args, _real=real, **kwargs):
            out = _real(*args, **kwargs)
            sizes.append(out.numel())
            return out

        monkeypatch.setattr(torch, name, spy)
    loss = cross_entropy(h.requires_grad_(True), w.requires_grad_(True), t, chunk_size=16)
    loss.backward()
    assert sizes and max(sizes) < n * vocab // 2, sizes


def test_backward_twice_is_refused():
    h, w, t = _problem(n=5, vocab=64, ignored=())
    loss = cross_entropy(h.requires_grad_(True), w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_bad_inputs():
    h, w, t = _problem(n=5, vocab=64, ignored=())
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 64\)"):
        cross_entropy(h, w, torch.full((5,), 64))
    with pytest.raises(ValueError, match="must be \\[vocab, hidden=48\\]"):
        cross_entropy(h, w.t(), t)
    with pytest.raises(TypeError, match="must share a dtype"):
        cross_entropy(h, w.bfloat16(), t)
    with pytest.raises(ValueError, match="shape of hidden without its last dimension"):
        cross_entropy(h, w, t[:4])
    with pytest.raises(TypeError, match="dtype float32"):
        cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="needs a process group"):
        ce.vocab_parallel_cross_entropy(h, w, t, None)
