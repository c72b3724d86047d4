# ruff: noqa
"""torchrun --nproc-per-node 2: tiny-gpt under the runtime's TP (sp=0, sp=1), one micro-batch of (1, 64) tokens,
forward+backward timed, with the time spent *issuing* each functional collective (the call, before its wait) and
waiting for it (wait_tensor), per step. Where does SP's extra compute go on gloo?"""
import os, statistics, sys, time
from collections import defaultdict
import torch, torch.distributed as dist, torch.nn.functional as F
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from autoplan.runtime.parallelize import apply_tp
from autoplan.specs import load_model
from autoplan.zoo.model import build_model

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
spec = load_model("tiny-gpt")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
seq = int(sys.argv[1]) if len(sys.argv) > 1 else 64
x = torch.randint(0, spec.vocab_size, (1, seq))
stats = defaultdict(float)
counts = defaultdict(int)
on = [False]

def wrap(name, fn):
    def w(*a, **k):
        if not on[0]:
            return fn(*a, **k)
        t0 = time.perf_counter()
        out = fn(*a, **k)
        stats[name] += time.perf_counter() - t0
        counts[name] += 1
        return out
    return w

for n in ("all_gather_single", "reduce_scatter_single", "all_gather_tensor", "reduce_scatter_tensor", "all_reduce", "wait_tensor", "all_to_all_single", "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd"):
    if hasattr(funcol, n):
        setattr(funcol, n, wrap(n, getattr(funcol, n)))

for sp in (False, True):
    torch.manual_seed(0)
    m = build_model(spec); apply_tp(m, mesh, sp=sp)
    def step():
        t0 = time.perf_counter()
        with loss_parallel():
            F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        return time.perf_counter() - t0
    for _ in range(5): step()
    stats.clear(); counts.clear(); on[0] = True
    ts = [step() for _ in range(21)]
    on[0] = False
    if rank == 0:
        print(f"sp={int(sp)}: step median {statistics.median(ts)*1e3:.2f} ms; per step:",
              {k: f"{counts[k]/21:.0f} calls {stats[k]/21*1e3:.2f} ms" for k in stats})
dist.destroy_process_group()
