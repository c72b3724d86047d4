# ruff: noqa
# run: torchrun --nproc-per-node 4 docs/notes/session-16/THIS.py (OMP_NUM_THREADS=1, the venv active)
# Session 16: when do dp=4 ranks reach the gradient all-reduce, and how long does it take after the last arrives?
import os, time, statistics, torch, torch.distributed as dist
from autoplan.zoo.model import build_model
from autoplan.specs import load_model
torch.set_num_threads(1)
dist.init_process_group("gloo")
r = dist.get_rank(); W = dist.get_world_size()
torch.manual_seed(0)
m = build_model(load_model("tiny-gpt"))
x = torch.randint(0, 100, (int(os.environ.get("MBS", 2)), 64))
rows = []
for i in range(40):
    dist.barrier()
    t0 = time.perf_counter(); c0 = time.process_time()
    m(x).float().mean().backward()
    t1 = time.perf_counter(); c1 = time.process_time()
    flat = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    dist.all_reduce(flat)
    t2 = time.perf_counter(); c2 = time.process_time()
    rows.append((t0, t1, t2, c1 - c0, c2 - c1))
out = [None] * W
dist.all_gather_object(out, rows)
if r == 0:
    agg = {k: [] for k in ("first_done", "last_done", "ar_after_last", "ar_after_first", "cpu_fb", "cpu_ar")}
    for i in range(5, 40):
        t0 = min(o[i][0] for o in out); d1 = sorted(o[i][1] for o in out); t2 = max(o[i][2] for o in out)
        agg["first_done"].append(d1[0] - t0); agg["last_done"].append(d1[-1] - t0)
        agg["ar_after_last"].append(t2 - d1[-1]); agg["ar_after_first"].append(t2 - d1[0])
        agg["cpu_fb"].append(statistics.mean(o[i][3] for o in out)); agg["cpu_ar"].append(statistics.mean(o[i][4] for o in out))
    print(W, "ranks:", "  ".join(f"{k} {statistics.median(v)*1e3:.2f}" for k, v in agg.items()), "ms (medians)")
dist.destroy_process_group()
