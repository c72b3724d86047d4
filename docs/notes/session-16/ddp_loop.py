# ruff: noqa
# run: torchrun --nproc-per-node 4 docs/notes/session-16/THIS.py (OMP_NUM_THREADS=1, the venv active)
# Session 16: steady-state period of a dp step loop with no barrier (as the runtime runs it): DDP's all-reduce,
# no gradient sync at all, and each with AdamW and a loss all-reduce (the runtime's step tail).
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
opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
x = torch.randint(0, 100, (int(os.environ.get("MBS", 2)), 64))
def loop(mode, n=25):
    dist.barrier()
    ts = [time.perf_counter()]; c0 = time.process_time()
    for i in range(n):
        if mode.startswith("nosync"):
            with d.no_sync():
                loss = d(x).float().mean(); loss.backward()
        else:
            loss = d(x).float().mean(); loss.backward()
        if mode.endswith("+tail"):
            opt.step(); opt.zero_grad(set_to_none=False)
            l = loss.detach().reshape(1).double(); dist.all_reduce(l)
        ts.append(time.perf_counter())
    per = [b - a for a, b in zip(ts[5:], ts[6:])]
    return statistics.median(per), (time.process_time() - c0) / n
modes = ("sync", "nosync", "sync+tail", "nosync+tail")
res = {k: [] for k in modes}
for rep in range(3):
    for k in modes:
        res[k].append(loop(k))
out = [None] * W
dist.all_gather_object(out, res)
if r == 0:
    for k in modes:
        per = [min(p for p, _ in o[k]) for o in out]; cpu = sum(statistics.median(c for _, c in o[k]) for o in out)
        print(f"{W} ranks {k:12s} period per rank {' '.join(f'{p*1e3:5.2f}' for p in per)} ms; cpu all ranks {cpu*1e3:6.2f} ms/step")
dist.destroy_process_group()
