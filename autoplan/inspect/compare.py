"""`autoplan compare a.json b.json`: what differs between two plans and what each difference costs."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..plan import Plan
from .common import COMPONENT_SHORT, COMPONENT_WORDS, fmt_s, short_config


def _workload(plan: Plan) -> dict:
    cl, tr = plan.cluster, plan.training
    return {"model": plan.model.name, "cluster": cl.name, "gpu": cl.gpu.name, "num_gpus": cl.num_gpus,
            "global_batch_size": tr.global_batch_size, "seq_length": tr.seq_length, "dtype": tr.dtype,
            "kernels": tr.kernels, "stack": plan.stack or "autoplan"}


def _metrics(plan: Plan) -> dict:
    p = plan.prediction
    return {"step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s, "tflops_per_gpu": p.tflops_per_gpu,
            "mfu": p.mfu, "hfu": p.hfu, "peak_memory_gib": p.memory_gib["peak"], "fits": p.fits}


def _stage_sizes(plan: Plan) -> list[int]:
    return [s.num_layers for s in plan.stages]


def compare_json(a: Plan, b: Plan) -> dict:
    wa, wb = _workload(a), _workload(b)
    da, db = a.parallel.as_dict(), b.parallel.as_dict()
    ma, mb = _metrics(a), _metrics(b)
    metrics = {k: {"a": ma[k], "b": mb[k], "delta": (mb[k] - ma[k]) if k != "fits" else None} for k in ma}
    comps = list(dict.fromkeys([*a.prediction.breakdown, *b.prediction.breakdown]))
    breakdown = {}
    for k in comps:
        va, vb = a.prediction.breakdown.get(k, 0.0), b.prediction.breakdown.get(k, 0.0)
        breakdown[k] = {"a": va, "b": vb, "delta": vb - va}
    differs = {k: [da.get(k), db.get(k)] for k in db if da.get(k) != db.get(k)}
    if _stage_sizes(a) != _stage_sizes(b):
        differs["stage_layers"] = [_stage_sizes(a), _stage_sizes(b)]
    return {
        "a": {"plan": a.short_hash, "parallel": da, **ma},
        "b": {"plan": b.short_hash, "parallel": db, **mb},
        "workload_differs": {k: [wa[k], wb[k]] for k in wa if wa[k] != wb[k]},
        "differs": differs,
        "metrics": metrics,
        "breakdown": breakdown,
        "verdict": verdict(a, b),
    }


def verdict(a: Plan, b: Plan) -> str:
    """One sentence: which is faster, by how much, and which components make the difference."""
    ta, tb = a.prediction.step_time_s, b.prediction.step_time_s
    if abs(tb - ta) <= 1e-9 * max(ta, tb):
        head = "A and B take the same predicted time per step"
    else:
        faster, slower, tf, ts = ("A", "B", ta, tb) if ta < tb else ("B", "A", tb, ta)
        head = f"{faster} is faster: {fmt_s(ts - tf)} per step ({100 * (ts - tf) / ts:.1f}% less than {slower})"
    deltas = []
    for k in dict.fromkeys([*a.prediction.breakdown, *b.prediction.breakdown]):
        d = b.prediction.breakdown.get(k, 0.0) - a.prediction.breakdown.get(k, 0.0)
        if abs(d) >= 0.01 * max(ta, tb):
            deltas.append((abs(d), f"{COMPONENT_WORDS.get(k, k)} {'+' if d > 0 else '-'}{fmt_s(abs(d))}"))
    deltas.sort(reverse=True)
    if deltas:
        head += "; B vs A: " + ", ".join(s for _, s in deltas[:3])
    fits = [n for n, p in (("A", a), ("B", b)) if not p.prediction.fits]
    if fits:
        head += f". {' and '.join(fits)} does not fit in memory"
    return head + "."


def render_compare(con: Console, a: Plan, b: Plan) -> None:
    d = compare_json(a, b)
    con.print(Text(f"A = {a.short_hash}: {short_config(a.parallel)}"))
    con.print(Text(f"B = {b.short_hash}: {short_config(b.parallel)}"))
    if d["workload_differs"]:
        w = ", ".join(f"{k} {x} vs {y}" for k, (x, y) in d["workload_differs"].items())
        con.print(Text(f"Different workloads ({w}): the numbers below are not like for like.", style="yellow"))
    con.print()
    t = Table(title="What differs", title_justify="left")
    t.add_column("setting")
    t.add_column("A", justify="right")
    t.add_column("B", justify="right")
    if d["differs"]:
        for k, (x, y) in d["differs"].items():
            if k == "stage_layers":
                x, y = _sizes_label(x), _sizes_label(y)
            t.add_row(k, str(x), str(y))
    else:
        t.add_row("(parallel configuration)", "same", "same")
    con.print(t)
    con.print()
    t = Table(title="What it costs", title_justify="left")
    t.add_column("")
    t.add_column("A", justify="right")
    t.add_column("B", justify="right")
    t.add_column("B - A", justify="right")
    m = d["metrics"]
    t.add_row("step time", fmt_s(m["step_time_s"]["a"]), fmt_s(m["step_time_s"]["b"]),
              _signed_s(m["step_time_s"]["delta"], m["step_time_s"]["a"]))
    t.add_row("tokens/s", f"{m['tokens_per_s']['a']:,.0f}", f"{m['tokens_per_s']['b']:,.0f}",
              f"{100 * m['tokens_per_s']['delta'] / m['tokens_per_s']['a']:+.1f}%")
    t.add_row("MFU", f"{100 * m['mfu']['a']:.1f}%", f"{100 * m['mfu']['b']:.1f}%",
              f"{100 * m['mfu']['delta']:+.1f} pt")
    t.add_row("peak memory", f"{m['peak_memory_gib']['a']:.1f} GiB", f"{m['peak_memory_gib']['b']:.1f} GiB",
              f"{m['peak_memory_gib']['delta']:+.1f} GiB")
    t.add_row("fits", "yes" if m["fits"]["a"] else "NO", "yes" if m["fits"]["b"] else "NO", "")
    t.add_section()
    for k, v in d["breakdown"].items():
        t.add_row(COMPONENT_SHORT.get(k, k), fmt_s(v["a"]), fmt_s(v["b"]), _signed_s(v["delta"], None))
    con.print(t)
    con.print(Text(d["verdict"], style="bold"))


def _signed_s(delta: float, base: float | None) -> str:
    s = ("+" if delta >= 0 else "-") + fmt_s(abs(delta))
    if base:
        s += f" ({100 * delta / base:+.1f}%)"
    return s


def _sizes_label(sizes: list[int]) -> str:
    """Layers per stage, run-length compressed: `13 11x6 13` style."""
    out, i = [], 0
    while i < len(sizes):
        j = i
        while j < len(sizes) and sizes[j] == sizes[i]:
            j += 1
        out.append(f"{sizes[i]}" if j - i == 1 else f"{sizes[i]}x{j - i}")
        i = j
    return " ".join(out)
