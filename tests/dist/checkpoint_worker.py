"""Checkpoint worker, run under torchrun by tests/dist/test_checkpoint.py: several `autoplan.runtime.train` runs (each a
full argument list, e.g. a resume under another layout) in one launch, sharing one process group.

    torchrun --nproc-per-node 2 tests/dist/checkpoint_worker.py --out results.json "ARGS" ["ARGS" ...]

Each run goes through the same start-up checks and training loop as `python -m autoplan.runtime.train ARGS`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autoplan.plan import load_plan  # noqa: E402
from autoplan.runtime.parallel_dims import ParallelDims  # noqa: E402
from autoplan.runtime.train import check_checkpoint_args, parse_args, train_loop  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    opts = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = []
    try:
        for run in opts.runs:
            try:
                args = parse_args(shlex.split(run))
                plan = load_plan(args.plan)
                dims = ParallelDims.from_plan(plan, dist.get_world_size())
                check_checkpoint_args(args, plan)
                rc = train_loop(args, plan, dims, torch.device("cpu"))
                results.append({"run": run, "rc": rc})
            except Exception as e:  # later runs may depend on this one's checkpoint: stop here
                results.append({"run": run, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()[-3000:]})
                print(f"[rank {dist.get_rank()}] {run}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                break
        if dist.get_rank() == 0:
            Path(opts.out).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from autoplan.runtime.train import exit_process

    exit_process(main())
