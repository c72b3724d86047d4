"""Registry dispatch, lazy imports, the no-triton fallback, the drop-in modules and the traffic table."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autoplan import kernels
from autoplan.kernels import modules, traffic
from autoplan.kernels._triton import KernelUnavailableError

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_available_lists_every_op():
    assert kernels.available() == sorted([
        "bias_gelu", "cross_entropy", "layer_norm", "rms_norm", "rope", "softmax", "swiglu",
        "vocab_parallel_cross_entropy",
    ])
    for name in kernels.available():
        op = kernels.get(name)
        assert callable(op.triton) and callable(op.torch)


def test_get_rejects_unknown_names_and_impls():
    with pytest.raises(ValueError, match="unknown kernel 'rmsnorm'; available: bias_gelu"):
        kernels.get("rmsnorm")
    with pytest.raises(ValueError, match="impl must be None"):
        kernels.get("rms_norm", impl="cuda")


def test_selection_rule(monkeypatch):
    x = torch.randn(4, 8)
    op = kernels.get("rms_norm")
    assert op.impl_for(x) == "triton"  # the fixture sets TRITON_INTERPRET=1
    assert kernels.select_impl(torch.device("cuda", 0)) == "triton"
    assert kernels.select_impl(torch.device("meta")) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert op.impl_for(x) == "torch"
    assert kernels.select_impl("cuda:1") == "triton"
    assert kernels.get("rms_norm", impl="triton").impl_for(x) == "triton"
    # without the interpreter the automatic choice runs the reference; forcing Triton explains itself
    torch.testing.assert_close(op(x, None), kernels.get("rms_norm", impl="torch")(x, None))
    with pytest.raises(KernelUnavailableError, match="TRITON_INTERPRET=1"):
        kernels.get("rms_norm", impl="triton")(x, None)


def test_both_impls_agree_through_the_registry():
    x, w = torch.randn(6, 50, requires_grad=True), torch.rand(50, requires_grad=True)
    outs = []
    for impl in kernels.IMPLS:
        out = kernels.get("layer_norm", impl=impl)(x, w, None, 1e-5)
        (gx, gw) = torch.autograd.grad(out.pow(2).sum(), (x, w))
        outs.append((out, gx, gw))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_import_is_lazy():
    proc = _python("""
        import sys
        from autoplan import kernels
        import autoplan.kernels.traffic
        assert "torch" not in sys.modules, "importing kernels must not import torch"
        kernels.available(); kernels.traffic.bytes_per_element("rms_norm")
        import autoplan.kernels.modules
        op = kernels.get("rms_norm")
        assert "triton" not in sys.modules, sorted(m for m in sys.modules if "triton" in m)
        import torch
        assert not torch.cuda.is_initialized()
        op(torch.randn(2, 4), None)          # CPU without TRITON_INTERPRET: the torch reference
        assert "triton" not in sys.modules
        print("lazy ok")
    """, TRITON_INTERPRET=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lazy ok" in proc.stdout


def test_works_without_triton_installed():
    proc = _python("""
        import sys
        class HideTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError("No module named 'triton' (hidden by the test)")
                return None
        sys.meta_path.insert(0, HideTriton())
        import torch, kernels
        from autoplan.kernels._triton import KernelUnavailableError
        assert not kernels.triton_installed()
        assert kernels.select_impl("cuda") == "torch"
        x = torch.randn(3, 10, requires_grad=True)
        y = kernels.get("rms_norm")(x, None)            # falls back to the reference
        y.sum().backward()
        try:
            kernels.get("rms_norm", impl="triton")(x, None)
        except KernelUnavailableError as exc:
            assert "pip install 'autoplan[kernels]'" in str(exc), exc
        else:
            raise SystemExit("forcing triton without triton must raise")
        print("no-triton ok")
    """, TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no-triton ok" in proc.stdout


# --------------------------------------------------------------------------- modules


def test_fused_norm_modules_match_torch_modules_and_share_state_dicts():
    x = torch.randn(2, 7, 96)
    ln = nn.LayerNorm(96)
    rms = nn.RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        for p in (*ln.parameters(), *rms.parameters()):
            p.normal_()
    fused_ln, fused_rms = modules.FusedLayerNorm(96), modules.FusedRMSNorm(96, eps=1e-6)
    fused_ln.load_state_dict(ln.state_dict())
    fused_rms.load_state_dict(rms.state_dict())
    torch.testing.assert_close(fused_ln(x), ln(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_rms(x), rms(x), rtol=1e-5, atol=1e-5)
    # and back: a fused module's state dict loads into the torch module
    assert nn.LayerNorm(96).load_state_dict(fused_ln.state_dict()) is not None
    assert set(fused_ln.state_dict()) == {"weight", "bias"} and set(fused_rms.state_dict()) == {"weight"}
    assert set(modules.FusedLayerNorm(96, bias=False).state_dict()) == set(nn.LayerNorm(96, bias=False).state_dict())


def test_fuse_module_shares_parameters_and_gradients():
    ln = nn.LayerNorm(40)
    fused = modules.fuse_module(ln)
    assert isinstance(fused, modules.FusedLayerNorm)
    assert fused.weight is ln.weight and fused.bias is ln.bias
    fused(torch.randn(3, 40)).sum().backward()
    assert ln.weight.grad is not None and ln.bias.grad is not None
    assert isinstance(modules.fuse_module(nn.RMSNorm(40)), modules.FusedRMSNorm)
    gelu = modules.fuse_module(nn.GELU(approximate="tanh"))
    assert isinstance(gelu, modules.FusedGELU) and gelu.approximate == "tanh"
    assert modules.fuse_module(nn.LayerNorm([4, 40])) is None  # two normalized dims: not covered
    assert modules.fuse_module(nn.Linear(4, 4)) is None
    with pytest.raises(ValueError, match="normalizes over the last dimension only"):
        modules.FusedLayerNorm((4, 40))


def test_other_modules_run():
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(modules.FusedGELU("tanh")(x), nn.GELU("tanh")(x), rtol=1e-5, atol=1e-5)
    bias_gelu = modules.FusedBiasGELU(64)
    torch.testing.assert_close(bias_gelu(x), nn.functional.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(modules.FusedSwiGLU()(x), nn.functional.silu(x[..., :32]) * x[..., 32:])
    scores = torch.randn(1, 2, 5, 5)
    probs = modules.FusedScaledSoftmax(0.5, causal=True)(scores)
    assert torch.all(probs.triu(1) == 0)
    rotary = modules.RotaryEmbedding(head_dim=16, max_positions=32)
    assert "cos" not in rotary.state_dict()  # tables are rebuilt, not checkpointed
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 1, 16)
    q_ref, k_ref = kernels.get("rope", impl="torch")(q.clone(), k.clone(), rotary.cos, rotary.sin, 3)
    q2, k2 = rotary(q.clone(), k.clone(), position_offset=3)
    torch.testing.assert_close(q2, q_ref)
    torch.testing.assert_close(k2, k_ref)
    head = torch.randn(100, 64)
    target = torch.randint(0, 100, (3, 5))
    loss = modules.FusedLinearCrossEntropy(chunk_size=4)(x, head, target)
    torch.testing.assert_close(loss, nn.functional.cross_entropy((x @ head.t()).view(15, 100), target.view(15)),
                               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- traffic table


def test_traffic_table_covers_every_op_and_fused_moves_less():
    assert set(traffic.TRAFFIC) == set(kernels.available())
    for op in traffic.TRAFFIC:
        for direction in ("fwd", "bwd", "total"):
            fused = traffic.bytes_per_element(op, "fused", direction)
            eager = traffic.bytes_per_element(op, "eager", direction)
            assert 0 <= fused <= eager, (op, direction, fused, eager)
        assert traffic.traffic_ratio(op, "total") > 1.0, op
    # spot checks of the counts: RMSNorm fused fwd reads x and writes y, 2 bytes each in bf16
    assert traffic.bytes_per_element("rms_norm", "fused", "fwd", dtype_bytes=2) == 4
    assert traffic.bytes_per_element("rms_norm", "eager", "fwd", dtype_bytes=2) == 4 * 2 + 7 * 4
    assert traffic.bytes_moved("swiglu", 1000, "fused", "bwd", 2) == 1000 * 5 * 2
    with pytest.raises(ValueError, match="unknown op"):
        traffic.bytes_per_element("flash")
    with pytest.raises(ValueError, match="direction must be one of"):
        traffic.bytes_per_element("rms_norm", direction="up")


def test_cross_entropy_memory_model():
    # 8K tokens, 128K vocabulary, hidden 4096, bf16: the fused peak is well under a quarter of eager
    tokens, vocab, hidden = 8192, 131072, 4096
    eager = traffic.cross_entropy_peak_bytes(tokens, vocab, hidden, "eager")
    fused = traffic.cross_entropy_peak_bytes(tokens, vocab, hidden, "fused")
    assert eager == tokens * vocab * 14
    assert fused < eager / 4
    from autoplan.kernels.cross_entropy import _default_chunk

    for shape in [(8192, 131072, 4096), (100, 50000, 512), (65536, 32000, 16384)]:
        tokens, vocab, hidden = shape
        assert traffic.cross_entropy_default_chunk(tokens, vocab, hidden) == _default_chunk(tokens, hidden, vocab)
