# ruff: noqa  (a measurement script kept as the record of a session-10 note, not project code)
# run: torchrun --nproc-per-node 4 docs/notes/session-10/gloo_scalars.py [layouts...]
import time, statistics, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
res = {}
for rnd in range(3):
    for n in (1, 2, 3, 4):
        t = torch.ones(n, dtype=torch.float64)
        ts = []
        for _ in range(40):
            dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(t); ts.append(time.perf_counter() - t0)
        res.setdefault(n, []).append(statistics.median(ts) * 1e3)
    # back to back, no barrier
    t = torch.ones(2, dtype=torch.float64); dist.barrier(); t0 = time.perf_counter()
    for _ in range(40): dist.all_reduce(t)
    res.setdefault("b2b", []).append((time.perf_counter() - t0) / 40 * 1e3)
if r == 0:
    for k, v in res.items(): print(k, " ".join(f"{x:.2f}" for x in v))
