# ruff: noqa
"""Per-micro-batch fixed host cost on this CPU: tiny-gpt forward+backward at batch 1, 2, 4 (seq 64), one process,
one thread; plain module, and under torch's DDP (one-process gloo group) with and without no_sync. t(b) = fixed +
b * per-sample: the intercept is what a micro-batch costs whatever its size."""
import os, statistics, time, contextlib
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from autoplan.specs import load_model
from autoplan.zoo.model import build_model
from autoplan.cost_models.profile import profile_from_spec

torch.set_num_threads(1)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
dist.init_process_group("gloo", rank=0, world_size=1)
spec = load_model("tiny-gpt")
print("ops/micro-batch the model counts (fwd x3):", 3 * sum(p.kernels_fwd for p in profile_from_spec(spec)))
torch.manual_seed(0)
plain = build_model(spec)
ddp = DDP(build_model(spec))

def run(m, b, ctx):
    x = torch.randint(0, spec.vocab_size, (b, 64))
    t0 = time.perf_counter()
    with ctx():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            loss = F.cross_entropy(m(x).flatten(0, 1).float(), x.flatten())
        loss.backward()
    return time.perf_counter() - t0

from autoplan.cost_models.hardware import *  # noqa
for name, m, ctx in (("plain", plain, contextlib.nullcontext), ("ddp no_sync", ddp, ddp.no_sync), ("ddp sync", ddp, contextlib.nullcontext)):
    res = {}
    for b in (1, 2, 4):
        for _ in range(5): run(m, b, ctx)
        res[b] = statistics.median(run(m, b, ctx) for _ in range(41)) * 1e3
    slope = (res[4] - res[1]) / 3
    print(f"{name:12s} t(1)={res[1]:.2f} t(2)={res[2]:.2f} t(4)={res[4]:.2f} ms  intercept {res[1]-slope:.2f} ms, per sample {slope:.2f} ms")
dist.destroy_process_group()
