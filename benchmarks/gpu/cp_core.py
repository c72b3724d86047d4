"""The context-parallel attention core's rate on this device, against the causal kernel the cost model calibrates.

autoplan's runtime runs context parallelism's attention as two SDPA calls per rank, each query chunk against the
keys up to its end (runtime.parallelize.prefix_attention). On a GPU each chunk's mask is torch's lower-right
causal bias (a chunk's queries are the last positions of its key prefix), which flash attention applies inside
the kernel: the cost model prices the calls as the causal kernel's half of the rank's scores at the flash
kernel's calibrated `attention_efficiency` (`compute.cp_mask_tensors` is false on a GPU). This times, on one
device and without communication, the core's forward and backward for the first and the last cp rank (the two
extremes of the key prefixes) at a few cp degrees, beside the causal kernel over the whole sequence, and prints
the rate per computed score of each against the causal kernel's (1.00 = the cost model's assumption); the same
calls with boolean masks (what a CPU runs, and the GPU runtime before session 25) are timed beside them.

Usage: python benchmarks/gpu/cp_core.py [--seq 16384] [--heads 8] [--head-dim 128] [--dtype bf16]
(on a CPU, --seq 1024 --heads 2 --head-dim 32 --dtype fp32 runs it in seconds)
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _time(fn, sync, repeat: int = 5) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F

    from autoplan.runtime.parallelize import cp_chunk_masks, load_balanced_positions, prefix_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8, help="query heads on the rank (after tp)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--cp", default="2,4,8")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    s, n, d = args.seq, args.heads, args.head_dim

    def rand(length: int) -> torch.Tensor:
        return torch.randn(1, n, length, d, device=device, dtype=dtype, requires_grad=True)

    k, v = rand(s), rand(s)
    q = rand(s)
    grad = torch.randn(1, n, s, d, device=device, dtype=dtype)

    def causal():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    t_causal = _time(causal, sync)
    causal_scores = s * s / 2  # what a causal kernel computes, per head
    base = causal_scores / t_causal
    print(f"{device} {args.dtype} seq {s} heads {n} head_dim {d}: causal SDPA forward + backward "
          f"{t_causal * 1e3:.2f} ms")
    for cp in (int(x) for x in args.cp.split(",")):
        for rank in (0, cp - 1):
            masks, ends = cp_chunk_masks(load_balanced_positions(s, cp, rank).to(device))
            ql = rand(s // cp)
            g = torch.randn(1, n, s // cp, d, device=device, dtype=dtype)

            def core(ql=ql, masks=masks, ends=ends, g=g):
                prefix_attention(ql, k, v, masks, ends).backward(g)

            def biased(ql=ql, ends=ends, g=g):
                prefix_attention(ql, k, v, None, ends).backward(g)

            c = s // (2 * cp)
            t_bias, t_mask = _time(biased, sync), _time(core, sync)
            causal = c * sum(ends) - c * c  # lower-right causal: each chunk's diagonal block is half computed
            print(f"  cp {cp} rank {rank}: causal bias {t_bias * 1e3:8.2f} ms, rate per computed score "
                  f"{causal / t_bias / base:.2f} x the causal kernel's (the cost model assumes 1.00 on a GPU); "
                  f"boolean masks {t_mask * 1e3:8.2f} ms ({c * sum(ends) / t_mask / base:.2f} x per score)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
