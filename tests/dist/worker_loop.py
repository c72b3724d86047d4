"""The body every parity worker shares under torchrun: run each case on every rank, keep going past a failed
case only when the ranks are still in step (they are not after an exception: stop), print one line per case on
rank 0 and write the results there as JSON. The workers (tests/dist/parity_worker.py, tests/models/*_worker.py)
supply only how one case runs."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def worker_main(make_runner: Callable[[int, int], Callable[[str], dict]],
                describe: Callable[[dict], str] = lambda r: "") -> int:
    """`make_runner(world, rank)` returns the function that runs one case (its result dict has "ok", "seconds"
    and, for the summary line, "max_loss_rel_err" / "max_grad_rel_err"); `describe` adds to that line."""
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results: list[dict] = []
    try:
        run = make_runner(world, rank)
        for case in args.cases:
            try:
                r = run(case)
            except Exception as e:  # one broken layout must not hide the others
                r = {"case": case, "ok": False, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()[-3000:]}
                print(f"[rank {rank}] {case}: {r['error']}", file=sys.stderr, flush=True)
                results.append(r)
                break  # ranks may now be out of step; stop here, the test reports the rest as not run
            results.append(r)
            if rank == 0:
                print(f"{case}: ok={r.get('ok')} loss_err={r.get('max_loss_rel_err')} "
                      f"grad_err={r.get('max_grad_rel_err')}{describe(r)} ({r['seconds']:.1f}s)", flush=True)
        if rank == 0:
            Path(args.out).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    return 0
