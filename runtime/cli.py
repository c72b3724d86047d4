"""`autoplan run plan.json [--nproc-per-node N] [--nnodes N --rdzv-endpoint HOST:PORT] [-- training args]`: train a
plan under torchrun."""

from __future__ import annotations

import argparse


def cmd_run(args: argparse.Namespace) -> int:
    from .launch import run

    extra = list(args.extra_args)
    if args.init_from:
        from autoplan.plan import load_plan

        from .hf_init import check_init_from

        check_init_from(load_plan(args.plan), args.init_from)  # before launch: a wrong checkpoint stops here
        extra += ["--init-from", str(args.init_from)]
    return run(args.plan, nproc_per_node=args.nproc_per_node, train_args=extra, nnodes=args.nnodes,
               rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, print_command=args.print_command,
               max_restarts=args.max_restarts, term_timeout=args.term_timeout, force=args.force,
               trusted_module=args.model)


def register(sub) -> None:
    p = sub.add_parser("run", help="train a plan with torchrun (checks the plan and process count first)")
    p.add_argument("plan", help="plan.json from `autoplan search -o` or `autoplan estimate -o`")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes to launch per node (default: the plan's world size / --nnodes)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes taking part; run the same command on each")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="where the nodes meet (torchrun c10d rendezvous); needed with --nnodes > 1")
    p.add_argument("--rdzv-id", default="autoplan", help="job id shared by the nodes (default: autoplan)")
    p.add_argument("--print-command", action="store_true",
                   help="print the torchrun command for this node instead of running it (SLURM scripts)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart every worker when one fails, up to N times, resuming from the newest complete "
                        "checkpoint in --save (needs -- --save DIR --save-every K)")
    p.add_argument("--term-timeout", type=float, default=60.0, metavar="S",
                   help="after SIGTERM/SIGINT, seconds the workers get to save and exit before they are killed")
    p.add_argument("--force", action="store_true",
                   help="run a plan that does not suit this machine (too many processes, another GPU type, "
                        "predicted not to fit) with a warning instead of an error")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from a Hugging Face checkpoint directory (safetensors + config.json of the planned "
                        "model); each rank reads only its slices")
    p.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                   help="for a plan of your own module (planned with --model pkg.mod:factory): name that module "
                        "again to run it; a plan file alone never imports code (SECURITY.md)")
    p.epilog = "Arguments after -- go to runtime.train: --steps N --data FILE --log FILE --lr ..."
    p.set_defaults(func=cmd_run)
