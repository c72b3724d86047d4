# ruff: noqa  (a measurement script kept as the record of a session-10 note, not project code)
# run: torchrun --nproc-per-node 2 docs/notes/session-10/gloo_wait_cpu.py
import time, resource, torch, torch.distributed as dist
dist.init_process_group("gloo"); r = dist.get_rank()
buf = torch.zeros(1024)
dist.barrier()
c0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
if r == 0:
    time.sleep(2.0); dist.send(buf, 1)
else:
    dist.recv(buf, 0)
c1 = resource.getrusage(resource.RUSAGE_SELF); t1 = time.perf_counter()
cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
print(f"rank {r}: wall {t1 - t0:.2f} s, cpu {cpu:.3f} s", flush=True)
# a blocking all_reduce where rank 1 arrives 2 s late
dist.barrier()
c0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
if r == 1: time.sleep(2.0)
dist.all_reduce(buf)
c1 = resource.getrusage(resource.RUSAGE_SELF); t1 = time.perf_counter()
cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
print(f"rank {r} all_reduce: wall {t1 - t0:.2f} s, cpu {cpu:.3f} s", flush=True)
dist.destroy_process_group()
