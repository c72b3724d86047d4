# ruff: noqa  (a measurement script kept as the record of a session-14 note, not project code)
# does a rank waiting in gloo recv / irecv.wait / all_reduce burn CPU? run: torchrun --nproc-per-node 2 spin.py
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
t = torch.zeros(1000)
for mode in ("recv", "irecv.wait", "all_reduce"):
    dist.barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    if r == 0:
        if mode == "recv": dist.recv(t, 1)
        elif mode == "irecv.wait": dist.irecv(t, 1).wait()
        else: dist.all_reduce(t)
    else:
        x = 0.0
        tt = time.perf_counter()
        while time.perf_counter() - tt < 1.0: x += 1
        if mode == "all_reduce": dist.all_reduce(t)
        else: dist.send(t, 0)
    print(f"rank {r} {mode}: wall {time.perf_counter()-w0:.2f} s cpu {time.process_time()-c0:.2f} s", flush=True)
dist.destroy_process_group()
