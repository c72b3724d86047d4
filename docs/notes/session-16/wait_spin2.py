# ruff: noqa
# run: torchrun --nproc-per-node 4 docs/notes/session-16/THIS.py (OMP_NUM_THREADS=1, the venv active)
# Session 16: do gloo processes waiting inside an all-reduce take CPU? ranks 0,1 compute first, then all four
# all-reduce; ranks 2,3 enter the all-reduce at once and wait for 0 and 1.
import os, time, statistics, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
r = dist.get_rank(); W = dist.get_world_size()
a = torch.randn(256, 256); b = torch.randn(256, 256)
buf = torch.zeros(int(os.environ.get("N", 212352)))
def work():
    for _ in range(int(os.environ.get("ITERS", 60))):
        a @ b
res = []
for i in range(25):
    dist.barrier()
    t = time.perf_counter(); c = time.process_time()
    if r < 2:
        work()
    t1 = time.perf_counter(); c1 = time.process_time()
    dist.all_reduce(buf)
    res.append((t1 - t, c1 - c, time.perf_counter() - t1, time.process_time() - c1))
out = [None] * W
dist.all_gather_object(out, res)
if r == 0:
    for k in range(W):
        rs = out[k]
        med = [statistics.median(x[j] for x in rs[3:]) * 1e3 for j in range(4)]
        print(f"rank {k}: before all-reduce wall {med[0]:.2f} cpu {med[1]:.2f}; all-reduce wall {med[2]:.2f} cpu {med[3]:.2f} ms")
dist.destroy_process_group()
