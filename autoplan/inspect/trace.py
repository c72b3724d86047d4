"""`autoplan trace plan.json -o trace.json`: the simulated step as a Chrome / Perfetto trace.

One process per pipeline rank (pid = rank) with four threads: compute (forward `F<mb>`, recomputation
`R<mb>`, backward `B<mb>`), point-to-point sends to the neighbouring rank, the exposed TP/CP/EP
communication inside each compute slice, and the data-parallel gradient sync and optimizer at the end of the
step. Times are the cost model's predictions; open the file in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

from autoplan.cost_models.estimate import Estimate, num_microbatches, pipeline_p2p_time
from autoplan.cost_models.pipeline import simulate

from ..plan import Plan
from .common import reestimate

TID_COMPUTE, TID_P2P, TID_COMM, TID_DP = 0, 1, 2, 3
THREADS = {TID_COMPUTE: "compute", TID_P2P: "p2p send", TID_COMM: "tp/cp/ep comm (exposed, inside compute)",
           TID_DP: "dp sync + optimizer"}
US = 1e6


def p2p_seconds(plan: Plan) -> float:
    """Time of one activation (or gradient) message between neighbouring pipeline ranks, as the cost model
    charges it."""
    cfg = plan.parallel
    return pipeline_p2p_time(plan.cluster, plan.training, hidden=plan.model.hidden_size, pp=cfg.pp, tp=cfg.tp,
                             cp=cfg.cp, dp=cfg.dp or 1, mbs=cfg.mbs, sp=cfg.sp)


def _slices(plan: Plan, est: Estimate):
    cfg = plan.parallel
    if est.timeline is not None and est.timeline.slices:
        return est.timeline.slices, est.timeline.rank_end
    m = num_microbatches(cfg, plan.training)
    fwd = [s.fwd_s for s in est.stages]
    bwd = [s.bwd_s for s in est.stages]
    tl = simulate(cfg.schedule if cfg.pp > 1 else "1f1b", cfg.pp, m, cfg.vp, fwd, bwd, p2p_seconds(plan),
                  keep_slices=True)
    return tl.slices, tl.rank_end


def _x(name: str, cat: str, pid: int, tid: int, start: float, dur: float, args: dict) -> dict:
    ts = round(start * US, 3)
    end = round((start + max(dur, 0.0)) * US, 3)  # rounded at both ends so back-to-back slices tile exactly
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": round(end - ts, 3),
            "args": args}


def trace_events(plan: Plan) -> dict:
    """The Chrome trace object ({"traceEvents": [...]}) of one simulated optimizer step."""
    est = reestimate(plan, keep_timeline=True)
    cfg = plan.parallel
    slices, rank_end = _slices(plan, est)
    n_stages = len(est.stages)
    p2p = p2p_seconds(plan)
    ev: list[dict] = []
    for r in range(cfg.pp):
        ev.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"pp rank {r}"}})
        ev.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for tid, name in THREADS.items():
            ev.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}})
    for r, rank_slices in enumerate(slices):
        for act, start, end in rank_slices:
            sc = est.stages[act.stage]
            args = {"stage": act.stage, "microbatch": act.mb, "layers": list(sc.layout.layers)}
            pure_bwd = sc.bwd_s - sc.recompute_s
            if act.kind == "F":
                ev.append(_x(f"F{act.mb}", "forward", r, TID_COMPUTE, start, end - start, args))
                comm_part = sc.comm_s * sc.fwd_s / max(sc.fwd_s + pure_bwd, 1e-30)
            else:
                rec = min(sc.recompute_s, end - start)
                if rec > 0:
                    ev.append(_x(f"R{act.mb}", "recompute", r, TID_COMPUTE, start, rec, args))
                ev.append(_x(f"B{act.mb}", "backward", r, TID_COMPUTE, start + rec, end - start - rec, args))
                comm_part = sc.comm_s * pure_bwd / max(sc.fwd_s + pure_bwd, 1e-30)
            if comm_part > 0:
                ev.append(_x(f"comm {act.kind}{act.mb}", "tp_cp_ep_comm", r, TID_COMM, end - comm_part,
                             comm_part, {**args, "placement": "total of the slice, drawn at its end"}))
            to = act.stage + 1 if act.kind == "F" else act.stage - 1
            if p2p > 0 and 0 <= to < n_stages and to % cfg.pp != r:
                ev.append(_x(f"send {act.kind}{act.mb}", "p2p", r, TID_P2P, end, p2p,
                             {**args, "to_rank": to % cfg.pp, "to_stage": to}))
    # The step's tail: gradient sync and optimizer. The breakdown gives them for the critical rank; they are
    # drawn on every rank after its last backward (other ranks' values differ only by their parameter count).
    dp_s, opt_s = est.breakdown.get("dp_comm", 0.0), est.breakdown.get("optimizer", 0.0)
    emb_s = est.breakdown.get("embedding_comm", 0.0)  # the first and the last rank only
    for r in range(cfg.pp):
        t0 = rank_end[r]
        if dp_s > 0:
            ev.append(_x("dp grad sync", "dp_comm", r, TID_DP, t0, dp_s, {"exposed_s": dp_s}))
        tied = emb_s if r in (0, cfg.pp - 1) else 0.0
        if tied > 0:
            ev.append(_x("tied embedding all-reduce", "embedding_comm", r, TID_DP, t0 + dp_s, tied, {}))
        ev.append(_x("optimizer", "optimizer", r, TID_DP, t0 + dp_s + tied, opt_s, {}))
    return {
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {"plan": plan.short_hash, "model": plan.model.name, "parallel": cfg.to_string(),
                      "step_time_s": est.step_time_s, "microbatches": num_microbatches(cfg, plan.training),
                      "p2p_s": p2p, "breakdown": est.breakdown},
    }


def slice_counts(trace: dict) -> dict[int, dict[str, int]]:
    """Per pid, how many compute slices of each category (forward, backward, recompute) the trace holds."""
    out: dict[int, dict[str, int]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["tid"] == TID_COMPUTE:
            d = out.setdefault(e["pid"], {})
            d[e["cat"]] = d.get(e["cat"], 0) + 1
    return out
