# ruff: noqa
"""Host time of the fused modules' forward and forward+backward launchers without their kernels: meta tensors
under `capture_launches()` (the kernel launch is recorded, not run), against torch's module on 1-row CPU
tensors (its kernel ~1 us). What the Python around a Triton launch costs, on this host.

    python docs/notes/session-17/launcher_host.py
"""
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.kernels._triton import capture_launches
from autoplan.kernels.modules import FusedGELU, FusedLayerNorm, FusedRMSNorm, FusedSwiGLU

torch.set_num_threads(1)
H = 256


def per_call(fn, calls=2000, repeats=7):
    for _ in range(200):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts) * 1e6


def cases(device):
    x = torch.randn(1, H, device=device, requires_grad=True)
    up = torch.randn(1, H, device=device, requires_grad=True)
    ln = nn.LayerNorm(H).to(device)
    rms = nn.RMSNorm(H).to(device)
    return {
        "layer_norm": (lambda m=FusedLayerNorm.from_torch(ln, impl="triton"): m(x), lambda: ln(x)),
        "rms_norm": (lambda m=FusedRMSNorm.from_torch(rms, impl="triton"): m(x), lambda: rms(x)),
        "gelu": (lambda m=FusedGELU("tanh", impl="triton"): m(x), lambda: F.gelu(x, approximate="tanh")),
        "swiglu": (lambda m=FusedSwiGLU(impl="triton"): m(x, up), lambda: F.silu(x) * up),
    }


meta, cpu = cases("meta"), cases("cpu")
with capture_launches() as launches:
    for name in meta:
        fused = per_call(meta[name][0])
        launches.clear()
        eager = per_call(cpu[name][1])
        print(f"{name:11s} fused launcher (no kernel) {fused:6.1f} us   torch op {eager:6.1f} us   extra {fused - eager:6.1f}")
        launches.clear()
