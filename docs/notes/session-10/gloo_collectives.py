# ruff: noqa  (a measurement script kept as the record of a session-10 note, not project code)
# run: torchrun --nproc-per-node 4 docs/notes/session-10/gloo_collectives.py [layouts...]
import os, time, statistics, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
res = {}
for rnd in range(3):
    for nbytes in (4096, 65536, 1 << 20):
        n = nbytes // 4
        full = torch.ones(n); shard = torch.ones(n // w); out = torch.empty(n)
        ops = {"ar": lambda: dist.all_reduce(full), "ag": lambda: dist.all_gather_into_tensor(full, shard),
               "rs": lambda: dist.reduce_scatter_tensor(shard, full), "a2a": lambda: dist.all_to_all_single(out, full)}
        for k, f in ops.items():
            f(); ts = []
            for _ in range(30):
                dist.barrier(); t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
            res.setdefault((k, nbytes), []).append(statistics.median(ts) * 1e3)
if r == 0:
    for k, v in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(k, " ".join(f"{x:.2f}" for x in v))
dist.destroy_process_group()
