# ruff: noqa
"""What torch.utils.checkpoint costs a GPU host per region, in the forward and the backward, apart from the
re-run operators: 24 attention cores (SDPA, bf16 autocast, b=2 s=2048 nh=16 dh=128: GPT-3 1.3B's) plain and under
checkpoint_wrapper (as runtime.parallelize.apply_recompute wraps them) with and without preserve_rng_state: the
host time of the forward loop (no sync), its wall, and the backward's wall. Session 20 (one H200): plain 0.05 ms
host / 0.10 wall forward, checkpointed 0.52-0.62 ms forward (host-bound) and +0.16-0.20 ms backward per core;
reading the CUDA generator's state does not wait for the device (0.06 ms behind 0.4 s of queued GEMMs).

    python benchmarks/gpu/checkpoint_host.py      (CUDA only)
"""
import time, torch, torch.nn as nn, torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

class Core(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

def run(name, cores, n=5):
    q = torch.randn(2, 16, 2048, 128, device="cuda", requires_grad=True)
    k = torch.randn_like(q, requires_grad=True); v = torch.randn_like(q, requires_grad=True)
    res = []
    for it in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            outs = [c(q, k, v) for c in cores]
        t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        loss = sum(o.float().sum() for o in outs)
        loss.backward(); torch.cuda.synchronize(); t3 = time.perf_counter()
        res.append((t1 - t0, t2 - t0, t3 - t2))
    h, f, b = [min(r[i] for r in res[1:]) * 1e3 / len(cores) for i in range(3)]
    print(f"{name:28s} per core: fwd host {h:.3f} ms, fwd wall {f:.3f} ms, bwd wall {b:.3f} ms", flush=True)

for name, wrap in [("plain", lambda m: m), ("ckpt rng", lambda m: checkpoint_wrapper(m, preserve_rng_state=True)),
                   ("ckpt no-rng", lambda m: checkpoint_wrapper(m, preserve_rng_state=False)), ("plain again", lambda m: m)]:
    run(name, [wrap(Core()) for _ in range(24)])

# does reading the CUDA generator's state wait for the device?
x = torch.randn(8192, 8192, device="cuda"); torch.cuda.synchronize()
for _ in range(3):
    t0 = time.perf_counter(); [x @ x for _ in range(20)]; t1 = time.perf_counter()
    s = torch.cuda.get_rng_state(); t2 = time.perf_counter(); torch.cuda.synchronize(); t3 = time.perf_counter()
    print(f"20 GEMMs queued in {1e3*(t1-t0):.2f} ms; get_rng_state {1e3*(t2-t1):.2f} ms; remaining device {1e3*(t3-t2):.2f} ms", flush=True)
