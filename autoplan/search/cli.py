"""`autoplan search`: find the fastest plan, show the top candidates, write the plan file."""

from __future__ import annotations

import argparse
import sys

from autoplan.cost_models.errors import ConfigError
from autoplan.inspect.common import fmt_gib_of, fmt_tflops, short_config


def register(subparsers) -> None:
    from autoplan.cli import add_json, add_workload_args

    p = subparsers.add_parser("search", help="find the fastest parallel plan that fits")
    add_workload_args(p)
    p.add_argument("--top", type=int, default=5, help="plans to show (the best and its runners-up)")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VAL",
                   help="pin a knob, e.g. --fix tp=8 --fix recompute=selective (repeatable; commas allowed)")
    p.add_argument("-o", "--output", help="write the best plan to this file")
    # not an option of search (it chooses the layout): taken only to say what to write instead
    p.add_argument("--parallel", help=argparse.SUPPRESS)
    add_json(p)
    p.set_defaults(func=cmd_search)


def parse_fix_args(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ConfigError("--fix takes KEY=VAL", f"got {part!r}", "write e.g. --fix tp=8")
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def cmd_search(args: argparse.Namespace) -> int:
    from autoplan.cli import console, load_workload, print_json

    from .core import search

    if args.parallel is not None:
        raise ConfigError("search chooses the parallel layout: it has no --parallel",
                          f"got --parallel {args.parallel}",
                          f"pin knobs with --fix {args.parallel} (the others are searched), or price exactly this "
                          f"layout with `autoplan estimate --parallel {args.parallel}`")
    model, cluster, training, profiles = load_workload(args)
    fix = parse_fix_args(args.fix)
    from autoplan.models.source import planner_pins

    pinned = {k: v for k, v in planner_pins(args.model).items() if k not in fix}
    if pinned:  # a user module: only the layouts `autoplan run` can apply to it
        fix.update(pinned)
        print(f"autoplan: note: {args.model}: pinned {','.join(f'{k}={v}' for k, v in pinned.items())} (what the "
              "runtime can shard in this module; docs/models.md); --fix overrides", file=sys.stderr)
    show_progress = not args.json and sys.stderr.isatty()
    if show_progress:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                      TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("searching", total=None, count="")

            def progress(phase: str, done: int, total: int) -> None:
                # a known total gives a bar and "done/total"; an open-ended phase (total 0) a pulsing bar and
                # the count so far
                if total > 0:
                    bar.update(task, description=phase, completed=min(done, total), total=total,
                               count=f"{min(done, total)}/{total}")
                else:
                    bar.update(task, description=phase, completed=0, total=None, count=f"{done} so far")

            result = search(model, cluster, training, profiles=profiles, fix=fix, top=args.top,
                            progress=progress, command=" ".join(["autoplan", *sys.argv[1:]]),
                            kernels=args.kernels)
    else:
        result = search(model, cluster, training, profiles=profiles, fix=fix, top=args.top,
                        command=" ".join(["autoplan", *sys.argv[1:]]), kernels=args.kernels)
    from autoplan.cli import with_stack
    from autoplan.models.source import attach

    # the plan as written, model source included: the hash printed and the JSON's are the file's
    result.plan = attach(with_stack(result.plan, args), args.model, profiles)
    if args.output:
        result.plan.save(args.output)
    if args.json:
        print_json(result.as_json())
        return 0
    render_search(console(None if sys.stdout.isatty() else 200), result, model, cluster, training, args.output)
    return 0


_WIDE_COLUMNS = 150  # below this width the knobs go into one configuration column


def _recompute_label(e) -> str:
    c = e.config
    rec = c.recompute + (f"({c.recompute_layers})" if c.recompute_layers is not None else "")
    if any(s.layout.recompute != e.stages[0].layout.recompute for s in e.stages):
        rec += " per-stage"
    return rec


def _wide_table(title: str, ests, notes, cap: float):
    """One column per knob."""
    from rich.table import Table

    t = Table(title=title)
    cols = ("#", "step s", "TF/s/GPU", "MFU", "peak GiB", "headroom", "tp", "pp", "dp", "cp", "ep", "vp", "mbs", "sp",
            "zero", "recompute", "schedule", "why not #1")
    for c in cols:
        t.add_column(c, justify="left" if c in ("recompute", "schedule", "why not #1") else "right")
    for i, (e, note) in enumerate(zip(ests, notes, strict=True)):
        c = e.config
        t.add_row(str(i + 1), f"{e.step_time_s:.3f}", fmt_tflops(e.tflops_per_gpu), f"{100 * e.mfu:.1f}%",
                  f"{e.peak_memory_gib:.1f}", f"{cap - e.peak_memory_gib:.1f}", str(c.tp), str(c.pp), str(c.dp),
                  str(c.cp), str(c.ep), str(c.vp), str(c.mbs), str(int(c.sp)), str(c.zero), _recompute_label(e),
                  c.schedule, note)
    return t


def _narrow_table(title: str, ests, cap: float):
    """80 columns: the knobs at non-default values in one column, headroom only (the peak follows the table for
    the best plan); why each runner-up loses is printed after the table."""
    from rich.table import Table

    t = Table(title=title)
    for c in ("#", "step s", "MFU", "GiB free", "configuration"):
        t.add_column(c, justify="left" if c == "configuration" else "right",
                     overflow="fold" if c == "configuration" else "ellipsis")
    for i, e in enumerate(ests):
        cfg = short_config(e.config).replace(",", " ")  # wraps between knobs
        if "per-stage" in _recompute_label(e):
            cfg += " (recompute per stage)"
        t.add_row(str(i + 1), f"{e.step_time_s:.3f}", f"{100 * e.mfu:.1f}%", f"{cap - e.peak_memory_gib:.1f}", cfg)
    return t


def render_search(con, result, model, cluster, training, output: str | None) -> None:

    from autoplan.cost_models.estimate import GIB

    st = result.stats
    cap = cluster.gpu.hbm_gib
    title = (f"autoplan search: {model.name} on {cluster.num_gpus}x {cluster.gpu.name}, "
             f"batch {training.global_batch_size} x {training.seq_length} ({training.dtype})")
    ests = [result.best, *result.runners_up]
    notes = [""] + [r.note for r in result.plan.runners_up]
    t = _wide_table(title, ests, notes, cap) if con.width >= _WIDE_COLUMNS else _narrow_table(title, ests, cap)
    con.print(t)
    if con.width < _WIDE_COLUMNS:
        for i, note in enumerate(notes[1:], start=2):
            if note:
                con.print(f"#{i} loses by: {note}")
    best = result.best
    sizes = [s.layout.layers[1] - s.layout.layers[0] for s in best.stages]
    if len(set(sizes)) > 1:
        con.print(f"stages (blocks per stage): {sizes}  (embedding on stage 0, LM head on stage {len(sizes) - 1})")
    con.print(f"best: {best.config.to_string() if con.width >= _WIDE_COLUMNS else short_config(best.config)}  peak {fmt_gib_of(best.peak_memory_gib, best.capacity_bytes / GIB)} GiB")
    if st.kernels_note:
        con.print(st.kernels_note)
    con.print(f"searched {st.candidates} candidates on {st.meshes} meshes: {st.pruned_memory} cannot fit, "
              f"{st.pruned_bound} pruned by bound, {st.ranked} ranked, {st.ilp_solved} ILPs solved "
              f"(+{st.ilp_cached} cached), {st.estimated} simulated, in {st.search_time_s:.2f} s")
    if output:
        con.print(f"plan written to {output} ({result.plan.short_hash})")
