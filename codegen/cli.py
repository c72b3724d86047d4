"""`autoplan codegen plan.json -o DIR`: write each stage's program as readable Python source."""

from __future__ import annotations

import argparse


def cmd_codegen(args: argparse.Namespace) -> int:
    from autoplan.cli import print_json
    from autoplan.plan import load_plan

    from .emit import write_program

    plan = load_plan(args.plan)
    paths = write_program(plan, args.output)
    if args.json:
        print_json({"plan_hash": plan.short_hash, "files": [str(p) for p in paths]})
    else:
        print(f"plan {plan.short_hash}: wrote {len(paths)} files to {args.output}")
        for p in paths:
            print(f"  {p}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("codegen", help="emit each pipeline stage's program as readable source")
    p.add_argument("plan", help="plan file (from `autoplan search -o`)")
    p.add_argument("-o", "--output", required=True, help="directory to write")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_codegen)
