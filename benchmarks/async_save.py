"""How long a checkpoint stalls training: a synchronous save against `--async-save` (issue 14).

    python benchmarks/async_save.py [--model gpt3-125m] [--steps 4] [--dir /tmp/ckpt-bench]

One process (a gloo group of one), the runtime's Trainer on the model (fp32, dp=1, batch 1 x 64 tokens),
AdamW state initialised by a first step. Then, alternately, a synchronous `checkpoint.save` and an
`AsyncSaver.start` followed by training steps until the background write is committed. Reported per kind:
the time training is stopped (sync: the whole save; async: the copy to host memory), the time until the
checkpoint is complete, the checkpoint size, and the median step time with a write in flight against without
(the write competes with training for the CPU and the disk). As in the runtime, the host buffer is allocated
after the first step and its pages touched in the background (runtime.checkpoint._host_stager). Last line:
`async save: stall X s vs sync Y s (Z× less), steps during the write R× slower`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-125m")
    ap.add_argument("--steps", type=int, default=4, help="plain steps for the reference step time")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    from autoplan.api import make_plan
    from autoplan.runtime import checkpoint
    from autoplan.runtime.engine import Trainer
    from autoplan.runtime.parallel_dims import ParallelDims
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    torch.set_num_threads(1)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    store = tempfile.mktemp(prefix="ckpt-bench-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    plan = make_plan(load_model(args.model), load_cluster("local-cpu").with_gpus(1),
                     TrainingSpec(global_batch_size=1, seq_length=64, dtype="fp32"), "dp=1", kernels="torch")
    dims = ParallelDims.from_plan(plan, world_size=1)
    dims.build_mesh()
    trainer = Trainer(plan, dims, device=torch.device("cpu"))
    vocab = plan.model.vocab_size
    batch = lambda s: torch.randint(0, vocab, (1, 65), generator=torch.Generator().manual_seed(s))

    def step(s: int) -> float:
        t = time.perf_counter()
        trainer.step(batch(s))
        return time.perf_counter() - t

    step(0)  # AdamW state exists from here on
    saver = checkpoint.AsyncSaver()
    saver.prepare(trainer)  # what the runtime does after its first step: the host copy, filled in the background
    plain = [step(s) for s in range(1, 1 + args.steps)]
    sync_stall, async_stall, async_total, during, size = [], [], [], [], 0
    s = 100
    for rep in range(args.reps):
        t = time.perf_counter()
        path = checkpoint.save(trainer, root, 2 * rep + 1)
        sync_stall.append(time.perf_counter() - t)
        size = sum(f.stat().st_size for f in path.iterdir())
        t = time.perf_counter()
        saver.start(trainer, root, 2 * rep + 2)
        async_stall.append(time.perf_counter() - t)
        while saver.writing():
            during.append(step(s))
            s += 1
        saver.wait()
        async_total.append(time.perf_counter() - t)
    print(f"model {args.model}: {sum(p.numel() for _, p in trainer.pm.named_parameters()) / 1e6:.1f}M parameters, "
          f"checkpoint {size / 2**30:.2f} GiB in {root}")
    print(f"  synchronous save:   training stopped {statistics.median(sync_stall):6.2f} s")
    print(f"  --async-save:       training stopped {statistics.median(async_stall):6.2f} s (each save: "
          f"{', '.join(f'{x:.2f}' for x in async_stall)} s), checkpoint complete "
          f"after {statistics.median(async_total):.2f} s ({len(during)} steps trained meanwhile)")
    slow = statistics.median(during) / statistics.median(plain) if during else float("nan")
    print(f"  step time {statistics.median(plain):.3f} s, {statistics.median(during) if during else float('nan'):.3f} s "
          f"with a write in flight")
    ratio = statistics.median(sync_stall) / statistics.median(async_stall)
    print(f"async save: stall {statistics.median(async_stall):.2f} s vs sync {statistics.median(sync_stall):.2f} s "
          f"({ratio:.1f}x less), steps during the write {slow:.2f}x slower")
    dist.destroy_process_group()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    os.unlink(store) if os.path.exists(store) else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
