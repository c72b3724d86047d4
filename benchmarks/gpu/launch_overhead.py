"""Host time per call against device time per call, fused modules vs torch's, at a training step's shapes.

    python benchmarks/gpu/launch_overhead.py [--tokens 4096] [--hidden 2048]

Session 12 measured GPT-1.3B's forward 26 ms slower with the fused kernels than with torch's on an H200 while
`benchmarks/kernels.py` put the kernels themselves within a few percent: this times the modules the runtime
substitutes (codegen.fuse: FusedLayerNorm, FusedRMSNorm, FusedGELU, FusedSwiGLU) and the torch modules they
replace, forward and forward+backward, as host time per call (N calls queued, no synchronisation inside) and
device time per call (CUDA events around the same N calls after a synchronisation). Host time above device
time means the launcher, not the kernel, sets the pace when the GPU has no queue to hide it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn


def _modules(h: int):
    from autoplan.kernels import modules as km
    from autoplan.zoo.model import Activation

    ln, rms = nn.LayerNorm(h), nn.RMSNorm(h)
    return {
        "layer_norm": (ln, km.FusedLayerNorm.from_torch(ln), 1, torch.float32),
        "rms_norm": (rms, km.FusedRMSNorm.from_torch(rms), 1, torch.float32),
        "gelu": (Activation("gelu"), km.FusedGELU(approximate="tanh"), 1, torch.bfloat16),
        "swiglu": (Activation("swiglu"), km.FusedSwiGLU(), 2, torch.bfloat16),
    }


def _time(fn, n: int, device: str) -> tuple[float, float]:
    """(host seconds per call, device seconds per call)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    sync()
    if device != "cuda":
        return host, host
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    sync()
    return host, start.elapsed_time(end) / 1e3 / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("-n", type=int, default=100)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name, (eager, fused, n_in, dtype) in _modules(a.hidden).items():
        width = a.hidden if "norm" in name else 4 * a.hidden
        for impl, mod in (("torch", eager), ("fused", fused)):
            mod = mod.to(device)
            xs = [torch.randn(a.tokens, width, device=device, dtype=dtype, requires_grad=True) for _ in range(n_in)]
            g = torch.randn(a.tokens, width, device=device, dtype=dtype)

            def fwd(mod=mod, xs=xs):
                with torch.no_grad():
                    mod(*xs)

            def fwd_bwd(mod=mod, xs=xs, g=g):
                mod(*xs).backward(g)

            hf, df = _time(fwd, a.n, device)
            hb, db = _time(fwd_bwd, a.n, device)
            rows.append({"op": name, "impl": impl, "fwd_host_us": hf * 1e6, "fwd_device_us": df * 1e6,
                         "fwdbwd_host_us": hb * 1e6, "fwdbwd_device_us": db * 1e6})
    print(f"{'op':11s} {'impl':6s} {'fwd host':>9s} {'fwd dev':>8s} {'f+b host':>9s} {'f+b dev':>8s}  (us per call)")
    for r in rows:
        print(f"{r['op']:11s} {r['impl']:6s} {r['fwd_host_us']:9.1f} {r['fwd_device_us']:8.1f} "
              f"{r['fwdbwd_host_us']:9.1f} {r['fwdbwd_device_us']:8.1f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
