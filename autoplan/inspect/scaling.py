"""`autoplan scaling --gpus 64,128,...`: the best plan at each cluster size in one table (and a PNG plot), to
answer "how many GPUs should I buy or rent?"."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autoplan.cost_models.errors import AutoplanError
from autoplan.cost_models.specs import ClusterSpec, ModelSpec, TrainingSpec

from .common import InspectError, fmt_s, short_config


def default_search() -> Callable:
    """`autoplan.search.search` (or `autoplan.search.core.search` while the package does not re-export it)."""
    try:
        from .. import search as pkg
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("autoplan.search"):
            raise InspectError("scaling needs the planner's search", "autoplan.search is not installed",
                               "use `autoplan estimate` per size until it is") from None
        raise
    fn = getattr(pkg, "search", None)
    if not callable(fn):
        from ..search.core import search as fn
    return fn


def plan_of(result):
    """The Plan of a search result (`.plan`; `.best` when that is the Plan)."""
    from ..plan import Plan

    for attr in ("plan", "best"):
        p = getattr(result, attr, None)
        if isinstance(p, Plan):
            return p
    raise InspectError("the search returned no plan", f"got {type(result).__name__}", "")


def parse_fix(items: list[str] | dict | None) -> dict[str, str]:
    """`["tp=8", "pp=2,mbs=1"]` -> {"tp": "8", "pp": "2", "mbs": "1"} (what `search(fix=...)` takes)."""
    from autoplan.search.cli import parse_fix_args

    if items is None or isinstance(items, dict):
        return dict(items or {})
    return parse_fix_args(items)


def scaling_rows(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, gpus: list[int], *,
                 fix: list[str] | dict | None = None, search: Callable | None = None, **search_kw) -> list[dict]:
    """One row per GPU count with the search's best plan there (or why there is none).

    `search(model, cluster, training, fix={...}, top=1, **search_kw)` returns a result holding the Plan
    (`.plan`, or `.best` if that is the Plan); it defaults to the planner's search."""
    search = search or default_search()
    fixd = parse_fix(fix)
    rows = []
    for n in gpus:
        row: dict = {"gpus": n}
        try:
            cl = cluster.with_gpus(n)
            kw = dict(search_kw)
            if fixd:
                kw["fix"] = fixd
            plan = plan_of(search(model, cl, training, top=1, **kw))
        except AutoplanError as e:
            row.update(error=e.one_line(), kind=e.kind)
            rows.append(row)
            continue
        p = plan.prediction
        row.update(nodes=cl.num_nodes, parallel=plan.parallel.as_dict(), config=short_config(plan.parallel),
                   plan=plan.short_hash, step_time_s=p.step_time_s, tokens_per_s=p.tokens_per_s,
                   tokens_per_s_per_gpu=p.tokens_per_s / n, tflops_per_gpu=p.tflops_per_gpu, mfu=p.mfu,
                   peak_memory_gib=p.memory_gib["peak"],
                   gpu_hours_per_billion_tokens=n * 1e9 / p.tokens_per_s / 3600)
        rows.append(row)
    ok = [r for r in rows if "error" not in r]
    if ok:
        ref = ok[0]
        for r in ok:
            r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"]
            r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"]
    return rows


def render_scaling(con: Console, rows: list[dict], *, title: str = "") -> None:
    t = Table(title=title or "Best plan per cluster size", title_justify="left")
    t.add_column("GPUs", justify="right")
    t.add_column("best configuration")
    t.add_column("step", justify="right")
    t.add_column("tok/s", justify="right")
    t.add_column("MFU", justify="right")
    t.add_column("eff", justify="right")
    t.add_column("GPU-h /Btok", justify="right")
    for r in rows:
        if "error" in r:
            t.add_row(str(r["gpus"]), Text(f"{r['kind']}: {r['error']}", style="red"), "", "", "", "", "")
            continue
        t.add_row(str(r["gpus"]), r["config"].replace(",", " "), fmt_s(r["step_time_s"]),
                  _k(r["tokens_per_s"]), f"{100 * r['mfu']:.1f}%", f"{100 * r['scaling_efficiency']:.0f}%",
                  f"{r['gpu_hours_per_billion_tokens']:.1f}")
    con.print(t)
    con.print(Text("  eff: tokens/s per GPU relative to the smallest size that fits; GPU-h /Btok: GPU-hours "
                   "per billion tokens (what the run costs)", style="dim"))
    ok = [r for r in rows if "error" not in r]
    if len(ok) >= 2:
        cheapest = min(ok, key=lambda r: r["gpu_hours_per_billion_tokens"])
        fastest = max(ok, key=lambda r: r["tokens_per_s"])
        con.print(Text(f"Cheapest per token: {cheapest['gpus']} GPUs; fastest: {fastest['gpus']} GPUs "
                       f"({fastest['speedup']:.2f}x the throughput of {ok[0]['gpus']})."))


def _k(v: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if v >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}"


def plot_scaling(rows: list[dict], path: str | Path, *, title: str) -> Path:
    from .plots import plot_scaling as draw

    return draw(rows, path, title=title)
