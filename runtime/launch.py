"""Launch `autoplan.runtime.train` under torchrun for a plan: what `autoplan run plan.json --nproc-per-node N -- ARGS` calls.

    from autoplan.runtime.launch import run
    rc = run("plan.json", nproc_per_node=4, train_args=["--steps", "10", "--log", "log.jsonl"])

One node: `--standalone` rendezvous on a free local port. Several nodes: the same command on every node,
`--nnodes N --rdzv-endpoint HOST:PORT` (torchrun's c10d rendezvous; the first node to arrive hosts it), e.g.
from a SLURM script; `--print-command` prints it instead of running it.

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
                     python: str | None = None, *, nnodes: int = 1, rdzv_endpoint: str | None = None,
                     rdzv_id: str = "autoplan") -> list[str]:
    """The command line: single node with a local rendezvous, or one node of `nnodes` meeting at `rdzv_endpoint`."""
    python = python or sys.executable
    args = list(train_args)
    if args[:1] == ["--"]:
        args = args[1:]
    if nnodes == 1 and rdzv_endpoint is None:
        rendezvous = ["--standalone"]
    else:
        rendezvous = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", str(rdzv_endpoint),
                      "--rdzv-id", rdzv_id]
    return [python, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(nproc_per_node),
            "-m", "autoplan.runtime.train", "--", "--plan", str(plan_path), *args]


def check_launch(plan, nproc_per_node: int | None, nnodes: int, rdzv_endpoint: str | None) -> tuple[int, list[str]]:
    """The processes per node to start, and warnings; raises PlanError for a launch the plan cannot run."""
    from autoplan.cost_models.errors import PlanError

    from .parallel_dims import ParallelDims

    if nnodes < 1:
        raise PlanError("--nnodes must be at least 1", f"got {nnodes}", "pass --nnodes N")
    if nnodes > 1 and not rdzv_endpoint:
        raise PlanError(f"--nnodes {nnodes} needs a rendezvous address", "every node must meet at one HOST:PORT",
                        "pass --rdzv-endpoint HOST:PORT (the same on every node, e.g. the first node's address)")
    if nproc_per_node is None:
        if plan.world_size % nnodes:
            raise PlanError(f"plan {plan.short_hash} has {plan.world_size} ranks, not a multiple of --nnodes {nnodes}",
                            "", "pass --nproc-per-node explicitly or another --nnodes")
        nproc_per_node = plan.world_size // nnodes
    ParallelDims.from_plan(plan, nnodes * nproc_per_node)
    warnings = []
    gpn = plan.cluster.gpus_per_node
    if nnodes > 1 and nproc_per_node != gpn:
        warnings.append(f"the plan was made for {gpn} GPUs per node ({plan.cluster.name}) but {nproc_per_node} are "
                        "launched per node: groups it placed inside a node may now cross nodes, and its predicted "
                        "step time no longer applies")
    return nproc_per_node, warnings


def run(plan_path: str | Path, nproc_per_node: int | None = None, train_args: Sequence[str] = (),
        env: dict[str, str] | None = None, *, nnodes: int = 1, rdzv_endpoint: str | None = None,
        rdzv_id: str = "autoplan", print_command: bool = False) -> int:
    """Check the plan and the process count, then run torchrun in the foreground (or print its command); returns
    its exit code. Raises PlanError (a bad or tampered plan, or a launch the plan was not made for)."""
    import shlex

    from autoplan.plan import load_plan

    plan = load_plan(plan_path)
    from autoplan.models import check_plan_model

    check_plan_model(plan)  # the recorded architecture builds as planned: refused before launch, not in torchrun
    nproc, warnings = check_launch(plan, nproc_per_node, nnodes, rdzv_endpoint)
    for w in warnings:
        print(f"autoplan run: warning: {w}", file=sys.stderr)
    cmd = torchrun_command(plan_path, nproc, train_args, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
    if print_command:
        print(f"PYTHONPATH={shlex.quote(str(ROOT))} OMP_NUM_THREADS=1 " + shlex.join(cmd))
        return 0
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH", "")]))
    return subprocess.call(cmd, env=full_env)
