"""The cost model's per-rank counts of one step (cost_models.counts) as `autoplan show` prints them: what the
runtime's --profile-step measures, predicted."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..plan import Plan


def counts_json(plan: Plan) -> list[dict]:
    from autoplan.counts import counts_of_plan

    return [dict(c, pp_rank=r) for r, c in enumerate(counts_of_plan(plan))]


def _si(x: float, unit: str) -> str:
    for div, pre in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {pre}{unit}"
    return f"{x:.3g} {unit}"


def render_counts(con: Console, plan: Plan) -> None:
    """Per pipeline rank: FLOPs by phase, bytes per collective and mesh dimension, memory by category."""
    t = Table(title="one step per GPU, predicted (compare: autoplan run ... -- --profile-step N)",
              title_justify="left")
    for col in ("pp rank", "FLOPs fwd / bwd / recompute", "collectives (count, bytes)", "memory MiB"):
        t.add_column(col, justify="left")
    for r, c in enumerate(counts_json(plan)):
        f = c["flops"]
        comm = "\n".join(f"{x['collective']}@{x['mesh_dim']} x{x['count']} {_si(x['bytes'], 'B')}"
                         for x in c["comm"]) or "-"
        mem = c["memory_bytes"]
        mtxt = "\n".join(f"{k} {mem[k] / 2**20:.3g}" for k in ("parameters", "gradients", "optimizer",
                                                               "activations", "temporaries", "peak"))
        t.add_row(str(r), " / ".join(_si(f[k], "") for k in ("forward", "backward", "recompute")), comm, mtxt)
    con.print(t)
    from autoplan.counts import is_captured_elsewhere

    if is_captured_elsewhere(plan):
        con.print(f"[dim]counted from the analytic profile of {plan.model.name}'s spec: the plan was priced from a "
                  "capture of its module, which reading a plan file never imports (SECURITY.md); `--profile-step` "
                  "compares a run with the capture's counts[/dim]")
    for k, v in plan.runtime_semantics.items():
        con.print(f"[dim]runtime semantics ({k}): {v}[/dim]")
