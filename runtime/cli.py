"""`autoplan run plan.json [--nproc-per-node N] [-- training args]`: train a plan under torchrun."""

from __future__ import annotations

import argparse


def cmd_run(args: argparse.Namespace) -> int:
    from .launch import run

    return run(args.plan, nproc_per_node=args.nproc_per_node, train_args=list(args.extra_args))


def register(sub) -> None:
    p = sub.add_parser("run", help="train a plan with torchrun (checks the plan and process count first)")
    p.add_argument("plan", help="plan.json from `autoplan search -o` or `autoplan estimate -o`")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes to launch (default: the plan's world size, on one node)")
    p.epilog = "Arguments after -- go to runtime.train: --steps N --data FILE --log FILE --lr ..."
    p.set_defaults(func=cmd_run)
