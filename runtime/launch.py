"""Launch `runtime.train` under torchrun for a plan: what `autoplan run plan.json --nproc-per-node N -- ARGS` calls.

    from runtime.launch import run
    rc = run("plan.json", nproc_per_node=4, train_args=["--steps", "10", "--log", "log.jsonl"])

The launch is checked against the plan first (same check and message as the runtime's start-up), so a wrong
process count fails in the parent without starting torchrun. Training arguments are passed after `--`, which
keeps torchrun from taking `--log` for its own `--log-dir`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun_command(plan_path: str | Path, nproc_per_node: int, train_args: Sequence[str] = (),
                     python: str | None = None) -> list[str]:
    """The command line (single node, rendezvous on a free local port)."""
    python = python or sys.executable
    args = list(train_args)
    if args[:1] == ["--"]:
        args = args[1:]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc_per_node),
            "-m", "runtime.train", "--", "--plan", str(plan_path), *args]


def run(plan_path: str | Path, nproc_per_node: int | None = None, train_args: Sequence[str] = (),
        env: dict[str, str] | None = None) -> int:
    """Check the plan and the process count, then run torchrun in the foreground; returns its exit code.
    Raises PlanError (a bad or tampered plan, or a process count the plan was not made for)."""
    from autoplan.plan import load_plan

    from .parallel_dims import ParallelDims

    plan = load_plan(plan_path)
    nproc = nproc_per_node or plan.world_size
    ParallelDims.from_plan(plan, nproc)
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH", "")]))
    return subprocess.call(torchrun_command(plan_path, nproc, train_args), env=full_env)
