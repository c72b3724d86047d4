# ruff: noqa
"""Session 21: how much faster do 2 of 4 processes on this 2-core machine compute while the other 2 wait in a gloo
recv, against all 4 computing at once? Ideal processor sharing says 2x (ClusterSpec.core_sharing = 1).

    python docs/notes/session-21/core_sharing_probe.py [--dim 64] [--iters 400] [--repeats 5]
"""
import argparse, os, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(dim, iters):
    a = torch.randn(dim * 4, dim)
    w1 = torch.randn(dim, dim * 4)
    w2 = torch.randn(dim * 4, dim)
    t = time.perf_counter()
    for _ in range(iters):  # a block's worth of small GEMMs and elementwise ops, like tiny-gpt's
        h = torch.nn.functional.gelu(a @ w1)
        a = torch.layer_norm(h @ w2, (dim,)) 
    return time.perf_counter() - t


def proc(rank, world, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {"all": [], "half": []}
    for _ in range(args.repeats):
        dist.barrier()
        res["all"].append(work(args.dim, args.iters))  # everyone computes
        dist.barrier()
        flag = torch.zeros(1)
        if rank < world // 2:  # the first half computes, the second waits in a recv for it
            res["half"].append(work(args.dim, args.iters))
            dist.send(flag, rank + world // 2)
        else:
            dist.recv(flag, rank - world // 2)
        dist.barrier()
    out[rank] = res
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    out = mp.Manager().dict()
    mp.spawn(proc, args=(args.world, args, out), nprocs=args.world)
    import statistics as st
    all_t = st.median(t for r in range(args.world // 2) for t in out[r]["all"])
    half_t = st.median(t for r in range(args.world // 2) for t in out[r]["half"])
    cores = os.cpu_count()
    ideal = min(1, cores / (args.world // 2)) / min(1, cores / args.world)
    f = (all_t / half_t - 1) / (ideal - 1)
    print(f"all {args.world} computing: {all_t * 1e3:.1f} ms; half computing, half in recv: {half_t * 1e3:.1f} ms; "
          f"speed-up {all_t / half_t:.2f} (ideal {ideal:.2f}) -> core_sharing {f:.2f}")
