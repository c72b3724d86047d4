"""Where a training step's GPU time goes, by kernel family, for autoplan's runtime on one GPU.

    python benchmarks/gpu/kernel_time.py PLAN.json [--steps 3]

Builds the plan's runtime (runtime.train's own Trainer, so the step is exactly what `autoplan run` executes) and
profiles `--steps` steps after two warm-ups with torch.profiler: each CUDA kernel's time goes to a family by its
name (GEMM, flash attention, Triton, elementwise, reductions, casts and copies, optimizer, other). Printed with
the step's wall time, the GPU's busy time (the sum; kernels of one stream do not overlap) and the cost model's
prediction for the same plan, so a gap between prediction and measurement can be placed: device work the model
does not price (which family), or time the GPU sits idle waiting for the host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

FAMILIES = (  # first match wins; lower-case substrings of kernel names
    ("attention", ("flash", "fmha", "attention")),
    ("triton", ("triton",)),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("cast/copy", ("copy", "cast", "convert")),
    ("reduction", ("reduce", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def _annotation(name: str) -> bool:
    """record_function ranges mirrored on the GPU timeline (autoplan::step_tail, Optimizer.step#AdamW.step): they
    span kernels counted on their own (session 12's first profile counted them twice, 29 ms a step)."""
    return name.startswith(("autoplan::", "ProfilerStep")) or "#" in name


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-ops", type=int, default=0, help="also list the N host operators with most self CPU time")
    a = ap.parse_args()
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from autoplan.plan import load_plan
    from autoplan.runtime.data import SyntheticDataset
    from autoplan.runtime.engine import Trainer
    from autoplan.runtime.parallel_dims import ParallelDims

    plan = load_plan(a.plan)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    dims = ParallelDims.from_plan(plan, 1, device_type=device.type)
    dims.build_mesh()
    trainer = Trainer(plan, dims, device=device, seed=0)
    t = plan.training
    data = SyntheticDataset(plan.model.vocab_size, t.seq_length, t.global_batch_size, seed=0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(2):
        trainer.step(data.batch(step))
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for step in range(2, 2 + a.steps):
            trainer.step(data.batch(step))
        sync()
        wall = (time.perf_counter() - t0) / a.steps
    dist.destroy_process_group()
    by: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name != "CUDA" or _annotation(ev.name):
            continue
        us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        by[family(ev.name)] += us / a.steps
        top[ev.name[:90]] += us / a.steps
    busy = sum(by.values()) / 1e6
    out = {"plan": Path(a.plan).name, "predicted_s": plan.prediction.step_time_s, "wall_s": wall, "gpu_busy_s": busy,
           "families_ms": {k: round(v / 1e3, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
           "top_kernels_ms": {k: round(v / 1e3, 2) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:25]},
           "predicted_breakdown_s": dict(plan.prediction.breakdown)}
    if a.host_ops:  # where the host's time goes: self CPU time and calls per step of each operator
        avg = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:a.host_ops]
        out["host_ops_ms"] = {e.key[:60]: [round(e.self_cpu_time_total / 1e3 / a.steps, 2), e.count // a.steps]
                              for e in avg}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
