"""`autoplan tune`: the command line of `autoplan.tune.core` (candidates, real runs, refit, choice)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers) -> None:
    from autoplan.cli import add_json, add_workload_args

    p = subparsers.add_parser(
        "tune", help="run the best candidates for real, refit the cluster, choose the plan by measurement",
        description="Measure the search's best plans and a few deliberately different ones with the runtime, "
        "refit the cluster's constants to what was measured, and report the measured fastest plan.")
    add_workload_args(p)
    for action in p._actions:  # the workload may come from --plan instead
        if action.dest in ("model", "cluster", "global_batch"):
            action.required = False
    p.set_defaults(kernels="torch")  # what the runtime executes on this machine
    p.add_argument("--plan", help="tune around this plan file (its model, cluster and training) instead")
    p.add_argument("--top", type=int, default=3, help="the search's best plans to measure (default 3)")
    p.add_argument("--diverse", type=int, default=3,
                   help="extra plans, each pinning one knob away from the leaders (tp, pp, dp, zero, recompute)")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VAL", help="pin a knob, as in search")
    p.add_argument("--steps", type=int, default=8,
                   help="training steps per candidate (from 5 on: steps 1-2 warm up, step 3 is profiled, the rest "
                        "are timed)")
    p.add_argument("--budget", type=float, default=600.0, metavar="SECONDS",
                   help="stop launching candidates when the next would end past this (default 600)")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="launch each measured candidate up to R times within --budget and keep its fastest launch "
                   "(on a shared host other processes only slow a run down; default 1)")
    p.add_argument("--bench", action="append", default=None, metavar="FILE",
                   help="micro-benchmarks from `autoplan calibrate --bench-out FILE` (fit rows for GEMMs and "
                   "collectives); repeatable")
    p.add_argument("--cluster-out", default=None, metavar="FILE", help="write the refit cluster YAML here")
    p.add_argument("--workdir", default=None, help="keep plans and run logs here (default: a temporary folder)")
    p.add_argument("-o", "--output", help="write the measured fastest plan (re-predicted with the refit cluster)")
    add_json(p)
    p.set_defaults(func=cmd_tune)


def _workload(args: argparse.Namespace):
    from autoplan.cli import load_workload
    from autoplan.cost_models.errors import SpecError

    if args.plan:
        from autoplan.plan import load_plan

        plan = load_plan(args.plan)
        # a plan of a user module: priced from the profiles it records (data), else from a capture of the module
        # when the user names it (--model); a plan file alone never imports it (tune refuses to run it then)
        from autoplan.models.source import plan_module, same_module

        profiles, module = plan.profiles, plan_module(plan)
        if profiles is None and args.model and module and same_module(args.model, module):
            profiles = _captured(args.model)
        return plan.model, plan.cluster, plan.training, profiles, plan
    missing = [f"--{n.replace('_', '-')}" for n in ("model", "cluster", "global_batch") if getattr(args, n) is None]
    if missing:
        raise SpecError("autoplan tune needs a workload", f"missing {', '.join(missing)}",
                        "pass --model M --cluster C --global-batch B (as for search), or --plan plan.json")
    model, cluster, training, profiles = load_workload(args)
    return model, cluster, training, profiles, None


def _captured(ref: str):
    from autoplan.workload import resolve_model

    return resolve_model(ref)[1]


def cmd_tune(args: argparse.Namespace) -> int:
    from autoplan.cli import console, print_json
    from autoplan.cost_models.errors import SpecError
    from autoplan.search.cli import parse_fix_args

    from .core import fastest_plan, tune

    for name, val, lo in (("--top", args.top, 0), ("--diverse", args.diverse, 0), ("--steps", args.steps, 2),
                          ("--budget", args.budget, 1), ("--repeats", args.repeats, 1)):
        if val < lo:
            raise SpecError(f"{name} must be at least {lo}", f"got {val}", f"pass {name} {lo} or more")
    if args.top + args.diverse < 1 and not args.plan:
        raise SpecError("nothing to measure", "--top 0 and --diverse 0", "pass --top 1 or more")
    model, cluster, training, profiles, seed = _workload(args)
    kernels = seed.kernels if seed is not None else args.kernels
    from autoplan.models import is_factory

    trusted = args.model if args.model and is_factory(args.model) else None
    kw = dict(top=args.top, diverse=args.diverse, steps=args.steps, budget_s=args.budget, profiles=profiles,
              fix=parse_fix_args(args.fix), kernels=kernels, seed_plan=seed, bench=args.bench, repeats=args.repeats,
              workdir=Path(args.workdir) if args.workdir else None, trusted_module=trusted,
              # the runs build what `autoplan run` of the searched plan would: the user's own module or HF family
              source=None if seed is not None else args.model)
    if not args.json and sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description:<44}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("choosing candidates", total=1)
            result = tune(model, cluster, training, **kw,
                          progress=lambda d, i, n: bar.update(task, description=d, completed=i, total=n))
    else:
        result = tune(model, cluster, training, **kw)
    if result.fit is not None and args.cluster_out:
        from autoplan.cost_models.fit import cluster_yaml

        header = [f"refit by `autoplan tune` on {len(result.measured)} measured runs of {model.name}",
                  *result.fit.summary_lines()]
        Path(args.cluster_out).write_text(cluster_yaml(result.fit.cluster, header))
    best = fastest_plan(result, profiles)
    if best is not None and args.output:
        best.save(args.output)
    if args.json:
        print_json(result.as_json())
    else:
        render_tune(console(None if sys.stdout.isatty() else 160), result, args)
    if result.interrupted:
        return 130
    return 0 if best is not None else 1


def render_tune(con, result, args) -> None:
    from rich.table import Table

    t = Table(title="autoplan tune: predicted before / after the refit, and measured")
    for col, just in (("#", "right"), ("configuration", "left"), ("why", "left"), ("before ms", "right"),
                      ("after ms", "right"), ("measured ms", "right"), ("after err", "right")):
        t.add_column(col, justify=just)
    fastest = result.fastest
    for i, c in enumerate(result.candidates, 1):
        cfg = c.config.split(",schedule")[0] if "pp=1," in c.config else c.config
        after = f"{c.predicted_after_s * 1e3:.1f}" if c.predicted_after_s else "-"
        if c.measured_s is None:
            meas, err = f"[dim]{c.error or '-'}[/dim]", ""
        else:
            meas = f"{c.measured_s * 1e3:.1f}" + (f" (best of {len(c.launches)})" if len(c.launches) > 1 else "") \
                + (" *" if c is fastest else "")
            err = f"{100 * (c.predicted_after_s / c.measured_s - 1):+.0f}%" if c.predicted_after_s else ""
        t.add_row(str(i), cfg, c.why, f"{c.predicted_before_s * 1e3:.1f}", after, meas, err)
    con.print(t)
    fit = result.fit
    if fit is not None:
        con.print(f"fit: mean |error| over measured runs {100 * fit.mean_abs_error('run', 'before'):.0f}% before, "
                  f"{100 * fit.mean_abs_error('run'):.0f}% after ({fit.evaluations} model evaluations)")
        for k in fit.free:
            note = fit.knob_note(k)
            tag = f"  [dim]({note})[/dim]" if note else ""
            con.print(f"  {k:<26} {fit.before[k]:>12.5g} -> {fit.after[k]:<12.5g}{tag}")
        for g in fit.collinear:
            held = [k for k in g if k in fit.held]
            how = (f"{', '.join(held)} held at its start" if held else
                   "holding either fitted the runs worse, so their separate values are not measurements")
            con.print(f"  [dim]only the combination of {' and '.join(g)} is determined by these runs ({how})[/dim]")
        for m in fit.count_mismatches[:10]:
            con.print(f"  [yellow]count mismatch[/yellow] {m}")
    for n in result.notes:
        con.print(f"note: {n}")
    if result.interrupted:
        con.print("[yellow]interrupted: results so far kept[/yellow]")
    if fastest is not None:
        con.print(f"measured fastest: {fastest.config} at {fastest.measured_s * 1e3:.1f} ms/step"
                  + (f" -> {args.output}" if args.output else ""))
        con.print(spread_note(result))
    if result.refit_choice:
        m = result.refit_choice_measured_s
        con.print(f"search with the refit cluster picks {result.refit_choice}"
                  + (f" (measured {m * 1e3:.1f} ms)" if m else " (not measured by this tune)"))
    if args.cluster_out and fit is not None:
        con.print(f"refit cluster -> {args.cluster_out} (use it with --cluster)")


def spread_note(result) -> str:
    """What the measurements can tell apart: the launches' spread and the candidates it leaves tied with the
    fastest, or how to learn the spread when every candidate ran once."""
    spread = result.spread
    if spread is None:
        return ("[dim]each candidate launched once: launches of one plan can differ by 10-30% on a shared host; "
                "--repeats 2 or more shows how much here[/dim]")
    ties = result.ties()
    line = f"launches of one candidate differ by {100 * spread:.0f}% (median max/min - 1)"
    if not ties:
        return line + "; the fastest leads every other candidate by more than that"
    names = ", ".join(c.config.split(",schedule")[0] for c in ties)
    return (f"[yellow]{line}; within that of the fastest, so not told apart from it by these runs: {names}"
            "[/yellow] (more --repeats to separate them: a launch keeps its level over its steps)")
