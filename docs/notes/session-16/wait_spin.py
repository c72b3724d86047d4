# ruff: noqa
# run: torchrun --nproc-per-node 4 docs/notes/session-16/THIS.py (OMP_NUM_THREADS=1, the venv active)
# Session 16: does a gloo process blocked in a receive take CPU from the processes that compute? 4 processes on
# 2 cores: ranks 0 and 1 compute (a fixed matmul loop) then send to ranks 2 and 3, which wait in recv meanwhile.
import os, time, statistics, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
r = dist.get_rank(); W = dist.get_world_size()
a = torch.randn(256, 256); b = torch.randn(256, 256)
buf = torch.zeros(1024)
def work():
    for _ in range(int(os.environ.get("ITERS", 60))):
        a @ b
res = []
for i in range(25):
    dist.barrier()
    t = time.perf_counter(); c = time.process_time()
    if r < 2:
        work()
        tw = time.perf_counter() - t
        dist.send(buf, r + 2)
    else:
        dist.recv(buf, r - 2)
        tw = time.perf_counter() - t
    res.append((tw, time.process_time() - c))
# alone: ranks 0,1 compute while 2,3 sit in a barrier-free sleep
dist.barrier()
alone = []
for i in range(25):
    dist.barrier()
    if r < 2:
        t = time.perf_counter(); work(); alone.append(time.perf_counter() - t)
    else:
        time.sleep(0.05)
out = [None] * W
dist.all_gather_object(out, (res, alone))
if r == 0:
    for k in range(W):
        rs, al = out[k]
        w = statistics.median(x[0] for x in rs[3:]); c = statistics.median(x[1] for x in rs[3:])
        extra = f"  alone (others sleeping) {statistics.median(al[3:])*1e3:.2f} ms" if al else ""
        print(f"rank {k}: {'compute' if k < 2 else 'wait in recv'} wall {w*1e3:.2f} ms cpu {c*1e3:.2f} ms{extra}")
dist.destroy_process_group()
