# ruff: noqa
# Session 19: the pipeline schedule's main-thread CPU per action against micro-batches (1F1B and GPipe), two
# processes, one Linear(16,16) stage each. torchrun --nproc-per-node 2 docs/notes/session-19/pp_bench_sweep.py
import os, sys, time, statistics, torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
def main():
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    H = int(os.environ.get("H", 16))
    mod = torch.nn.Sequential(torch.nn.Linear(H, H))
    st = PipelineStage(mod, r, w, torch.device("cpu"))
    res = {}
    for m in (1, 2, 4, 8, 16):
        for cls in ((ScheduleGPipe,) if m < 2 else (Schedule1F1B, ScheduleGPipe)):
            sched = cls(st, m, loss_fn=lambda o, t: o.sum())
            x = torch.randn(m * 2, H); tgt = torch.zeros(m * 2, H)
            def step():
                if r == 0: sched.step(x)
                elif r == w - 1: sched.step(target=tgt, losses=[])
                else: sched.step()
            for _ in range(5): step()
            ws, cs = [], []
            for _ in range(40):
                dist.barrier()
                t, c = time.perf_counter(), time.thread_time()
                step()
                ws.append(time.perf_counter() - t); cs.append(time.thread_time() - c)
            # plain: same module fwd+bwd m times
            ps = []
            for _ in range(40):
                c = time.thread_time()
                for k in range(m):
                    xi = torch.randn(2, H, requires_grad=(r > 0)); mod(xi).sum().backward()
                ps.append(time.thread_time() - c)
            res[(cls.__name__, m)] = (statistics.median(ws)*1e3, statistics.median(cs)*1e3, statistics.median(ps)*1e3)
    for k, v in res.items():
        print(f"rank {r} {k[0]:14s} m={k[1]:2d} wall {v[0]:.2f} cpu {v[1]:.2f} plain {v[2]:.2f} extra/action {(v[1]-v[2])/(2*k[1])*1e3:.0f}us", flush=True)
    dist.destroy_process_group()
main()
