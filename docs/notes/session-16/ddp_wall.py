# ruff: noqa
# run: torchrun --nproc-per-node 4 docs/notes/session-16/THIS.py (OMP_NUM_THREADS=1, the venv active)
# Session 16: wall time of a dp=4 step's fwd+bwd (first rank's start to last rank's end) with DDP's gradient
# all-reduce, without it (no_sync), and with a plain all-reduce of the flattened gradients after a no_sync backward.
import os, time, statistics, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from autoplan.zoo.model import build_model
from autoplan.specs import load_model
torch.set_num_threads(1)
dist.init_process_group("gloo")
r = dist.get_rank(); W = dist.get_world_size()
torch.manual_seed(0)
m = build_model(load_model("tiny-gpt"))
d = DDP(m)
x = torch.randint(0, 100, (int(os.environ.get("MBS", 2)), 64))
def fb():
    d(x).float().mean().backward()
def step(mode):
    dist.barrier()
    t0 = time.perf_counter(); c0 = time.process_time()
    if mode == "sync":
        fb()
    elif mode == "nosync":
        with d.no_sync():
            fb()
    else:
        with d.no_sync():
            fb()
        flat = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        dist.all_reduce(flat)
    return t0, time.perf_counter(), time.process_time() - c0
modes = ("sync", "nosync", "nosync+ar")
rows = {k: [] for k in modes}
for rep in range(4):
    for k in modes:
        for i in range(15):
            rows[k].append(step(k))
out = [None] * W
dist.all_gather_object(out, rows)
if r == 0:
    for k in modes:
        n = len(rows[k]); walls = []; cpus = []
        for i in range(n):
            if i % 15 < 3: continue
            walls.append(max(o[k][i][1] for o in out) - min(o[k][i][0] for o in out))
            cpus.append(sum(o[k][i][2] for o in out))
        print(f"{W} ranks {k:10s} wall {statistics.median(walls)*1e3:6.2f} ms  cpu(all ranks) {statistics.median(cpus)*1e3:6.2f} ms")
dist.destroy_process_group()
