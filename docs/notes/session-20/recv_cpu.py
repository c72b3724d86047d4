# ruff: noqa
"""Session 20: CPU a rank uses while blocked in a gloo recv (torchrun --standalone --nproc-per-node 2 THIS)."""
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
x = torch.zeros(1024)
for wait in (0.05, 0.2, 1.0):
    dist.barrier()
    if r == 0:
        time.sleep(wait)  # the peer computes (here: sleeps) while rank 1 waits in recv
        dist.send(x, 1)
    else:
        c0, t0 = time.process_time(), time.perf_counter()
        dist.recv(x, 0)
        c1, t1 = time.process_time(), time.perf_counter()
        print(f"recv waited {t1-t0:.3f} s, used {c1-c0:.4f} s CPU ({(c1-c0)/(t1-t0):.2f} of a core)", flush=True)
dist.destroy_process_group()
