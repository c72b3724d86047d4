"""`autoplan explain plan.json [--why-not CONFIG]`: the bottleneck, what each neighbouring choice would cost,
and which rule rules out the ones that would be faster."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autoplan.cost_models.errors import AutoplanError, ConfigError
from autoplan.cost_models.estimate import estimate, even_layout, num_microbatches
from autoplan.cost_models.pipeline import bubble_fraction
from autoplan.cost_models.specs import ParallelConfig

from ..plan import Plan
from .common import (
    COMPONENT_SHORT,
    COMPONENT_WORDS,
    Outcome,
    config_diff,
    evaluate,
    fmt_delta,
    fmt_s,
    gib_pair,
    reestimate,
    short_config,
)

# Relative step-time change below which a neighbour counts as "the same".
SAME = 0.002


@dataclass
class Neighbour:
    label: str
    outcome: Outcome
    hypothetical_s: float | None = None  # predicted time ignoring the rule that forbids it

    def status(self, base_s: float) -> str:
        o = self.outcome
        if o.error is not None:
            return "ruled out"
        if not o.fits:
            return "does not fit"
        d = (o.est.step_time_s - base_s) / base_s
        return "same" if abs(d) < SAME else ("faster" if d < 0 else "slower")

    def time(self) -> float | None:
        if self.outcome.est is not None:
            return self.outcome.est.step_time_s
        return self.hypothetical_s


# ------------------------------------------------------------------------------------------ neighbours


def _variants(plan: Plan) -> list[tuple[str, dict]]:
    """(label, changes) for each neighbouring choice; dp is re-derived unless the change keeps it."""
    c = plan.parallel
    out: list[tuple[str, dict]] = []
    free_dp = {"dp": None}

    def tp_change(new: int) -> dict:
        ch = {"tp": new, **free_dp}
        if new == 1:
            ch["sp"] = False
        return ch

    out.append(("tp x2", tp_change(c.tp * 2)))
    if c.tp > 1:
        out.append(("tp /2", tp_change(c.tp // 2)))
    out.append(("pp x2", {"pp": c.pp * 2, **free_dp}))
    if c.pp > 1:
        half = c.pp // 2
        ch = {"pp": half, **free_dp}
        if half == 1:
            ch.update(vp=1, schedule="1f1b")
        out.append(("pp /2", ch))
    out.append(("mbs x2", {"mbs": c.mbs * 2}))
    if c.mbs > 1:
        out.append(("mbs /2", {"mbs": c.mbs // 2}))
    if c.pp > 1:
        out.append(("vp +1", {"vp": c.vp + 1, "schedule": "interleaved"}))
        if c.vp > 1:
            out.append(("vp -1", {"vp": c.vp - 1, "schedule": "interleaved" if c.vp > 2 else "1f1b"}))
        if c.schedule == "1f1b":
            out.append(("gpipe schedule", {"schedule": "gpipe"}))
        elif c.schedule == "gpipe":
            out.append(("1f1b schedule", {"schedule": "1f1b"}))
        else:
            out.append(("1f1b schedule", {"vp": 1, "schedule": "1f1b"}))
    less = _less_recompute(c)
    if less:
        out.append(("less recompute", less))
    more = _more_recompute(c)
    if more:
        out.append(("more recompute", more))
    if c.tp > 1:
        out.append(("sp off" if c.sp else "sp on", {"sp": not c.sp}))
    if c.zero < 3 and (c.dp or 1) * c.cp > 1:
        out.append((f"zero {c.zero + 1}", {"zero": c.zero + 1}))
    if c.zero > 0:
        out.append((f"zero {c.zero - 1}", {"zero": c.zero - 1}))
    if c.cp > 1 or plan.training.seq_length >= 8192:
        out.append(("cp x2", {"cp": c.cp * 2, **free_dp}))
    if c.cp > 1:
        out.append(("cp /2", {"cp": c.cp // 2, **free_dp}))
    if plan.model.is_moe:
        out.append(("ep x2", {"ep": c.ep * 2}))
        if c.ep > 1:
            out.append(("ep /2", {"ep": c.ep // 2}))
    return out


def _less_recompute(c: ParallelConfig) -> dict | None:
    if c.recompute == "full":
        if c.recompute_layers and c.recompute_layers // 2 > 0:
            return {"recompute_layers": c.recompute_layers // 2}
        return {"recompute": "selective", "recompute_layers": None}
    if c.recompute == "selective":
        return {"recompute": "none"}
    return None


def _more_recompute(c: ParallelConfig) -> dict | None:
    if c.recompute == "none":
        return {"recompute": "selective"}
    if c.recompute == "selective":
        return {"recompute": "full", "recompute_layers": None}
    return None


def _hypothetical(plan: Plan, cfg: ParallelConfig) -> float | None:
    """The cost model's time for a configuration a rule forbids, ignoring that rule (a 'what if'); None
    when the configuration cannot even be laid out."""
    try:
        resolved = cfg.resolve(plan.cluster.num_gpus)
        if resolved.pp * resolved.vp > plan.model.num_layers or (resolved.dp or 1) < 1:
            return None
        if plan.training.global_batch_size < (resolved.dp or 1) * resolved.mbs:
            return None
        from autoplan.counts import plan_profiles

        est = estimate(plan_profiles(plan), plan.cluster, plan.training, resolved,
                       even_layout(plan.model.num_layers, resolved))
        return est.step_time_s
    except Exception:  # noqa: BLE001 - a what-if that the cost model cannot evaluate is simply not shown
        return None


def neighbours(plan: Plan) -> list[Neighbour]:
    out = []
    for label, changes in _variants(plan):
        try:
            cfg = plan.parallel.model_copy(update=changes)
            cfg = ParallelConfig.model_validate(cfg.model_dump())  # re-run the schedule/vp validator
        except Exception as e:  # noqa: BLE001
            out.append(Neighbour(label, Outcome(plan.parallel, error=ConfigError(str(e)))))
            continue
        o = evaluate(plan, cfg, keep_layout=True)
        hyp = _hypothetical(plan, cfg) if isinstance(o.error, ConfigError) else None
        out.append(Neighbour(label, o, hyp))
    return out


# ------------------------------------------------------------------------------------------ bottleneck


def bottleneck(plan: Plan) -> dict:
    """The largest non-compute part of the step, in words, with what would shrink it; plus memory."""
    p, cfg, tr = plan.prediction, plan.parallel, plan.training
    step = p.step_time_s
    parts = {k: v for k, v in p.breakdown.items() if k != "compute"}
    key = max(parts, key=parts.get) if parts else "compute"
    value = parts.get(key, 0.0)
    m = num_microbatches(cfg, tr)
    why = {
        "bubble": (f"pp={cfg.pp} with {m} micro-batches{f' and vp={cfg.vp}' if cfg.vp > 1 else ''}: the ideal "
                   f"bubble is (p-1)/(v*m) = {100 * bubble_fraction(cfg.pp, m, cfg.vp):.1f}% of the busy time; "
                   "more micro-batches, more virtual stages or a smaller pp shrink it"
                   if cfg.pp > 1 else "uneven work between ranks"),
        "tp_cp_ep_comm": (f"tp={cfg.tp}{f', cp={cfg.cp}' if cfg.cp > 1 else ''}"
                          f"{f', ep={cfg.ep}' if cfg.ep > 1 else ''}: collectives inside every layer that "
                          "compute does not hide; a smaller tp (with pp or ZeRO to make room) or "
                          "TP-communication overlap reduce it"),
        "dp_comm": (f"gradient sync over dp={cfg.dp}{f'x cp={cfg.cp}' if cfg.cp > 1 else ''} that the backward "
                    "pass does not hide; fewer, larger data-parallel replicas (more tp/pp) or overlap reduce it"),
        "recompute": (f"recompute={cfg.recompute}: the forward pass is re-run in backward to save activation "
                      "memory; less recomputation needs the memory headroom to hold the activations"),
        "pp_comm": "activations sent between pipeline ranks on the critical path",
        "embedding_comm": (f"pp={cfg.pp} with a tied word embedding: the first and the last pipeline rank each hold "
                           "a copy and sum their gradients once per step, after the data-parallel sync; an "
                           "untied head or fewer pipeline stages avoid it"),
        "optimizer": "the Adam update reads and writes every local parameter and its optimizer state",
    }.get(key, "")
    cap = plan.cluster.gpu.hbm_gib
    peak = p.memory_gib["peak"]
    mem = {"peak_gib": peak, "capacity_gib": cap, "headroom_gib": cap - peak,
           "tight": cap - peak < 0.1 * cap}
    return {"component": key, "words": COMPONENT_WORDS.get(key, key), "seconds": value,
            "share": value / step if step else 0.0, "why": why, "memory": mem,
            "compute_share": p.breakdown.get("compute", 0.0) / step if step else 0.0}


# ------------------------------------------------------------------------------------------------ JSON


def _neighbour_json(n: Neighbour, base_s: float, plan: Plan) -> dict:
    o = n.outcome
    t = n.time()
    d = {"change": n.label, "status": n.status(base_s),
         "parallel": o.config.as_dict(), "step_time_s": o.est.step_time_s if o.est else None,
         "delta_s": (o.est.step_time_s - base_s) if o.est else None,
         "peak_memory_gib": o.est.peak_memory_gib if o.est else None,
         "reason": o.reason(plan.cluster.gpu.hbm_gib)}
    if o.error is not None:
        d["rule"] = o.error.rule
        d["hint"] = o.error.hint
        d["step_time_s_if_allowed"] = t
    if o.note:
        d["note"] = o.note
    return d


def explain_json(plan: Plan) -> dict:
    base = reestimate(plan)
    base_s = base.step_time_s
    ns = neighbours(plan)
    rows = [_neighbour_json(n, base_s, plan) for n in ns]
    return {
        "plan": plan.short_hash,
        "parallel": plan.parallel.as_dict(),
        "step_time_s": base_s,
        "plan_step_time_s": plan.prediction.step_time_s,
        "bottleneck": bottleneck(plan),
        "neighbours": rows,
        "summary": summary(plan, ns, base_s),
    }


def summary(plan: Plan, ns: list[Neighbour], base_s: float) -> list[str]:
    """Sentences: which faster neighbours are ruled out and by what; any that are allowed and faster."""
    cap = plan.cluster.gpu.hbm_gib
    blocked, allowed = [], []
    for n in ns:
        t = n.time()
        if t is None or t >= base_s * (1 - SAME):
            continue
        st = n.status(base_s)
        if st in ("ruled out", "does not fit"):
            blocked.append(f"{n.label} ({fmt_s(base_s - t)} faster{' if allowed' if st == 'ruled out' else ''})"
                           f" is ruled out: {n.outcome.reason(cap)}")
        elif st == "faster":
            allowed.append(f"{n.label} (-{fmt_s(base_s - t)})")
    out = blocked
    if allowed:
        out.append(f"Allowed, fitting and faster: {', '.join(allowed)}. This plan is not locally optimal under the "
                   "cost model (pinned by hand, or missed by the search).")
    if not out:
        out.append("No neighbouring choice is faster: the plan is locally optimal under the cost model.")
    return out


# ------------------------------------------------------------------------------------------- rendering


def render_explain(con: Console, plan: Plan) -> None:
    d = explain_json(plan)
    b = d["bottleneck"]
    base_s = d["step_time_s"]
    con.print(Text(f"Plan {plan.short_hash}: {short_config(plan.parallel)}", style="bold"))
    con.print(Text(f"predicted step {fmt_s(base_s)}, compute {100 * b['compute_share']:.0f}% of it"))
    if abs(base_s - d["plan_step_time_s"]) > 0.01 * base_s:
        from autoplan.counts import is_captured_elsewhere

        why = ("priced from a capture of its module, which reading a plan file never imports: this and the "
               "neighbours below use the analytic profile of its spec" if is_captured_elsewhere(plan)
               else "made with another cost model")
        con.print(Text(f"(the plan file says {fmt_s(d['plan_step_time_s'])}: {why})", style="yellow"))
    con.print()
    if b["compute_share"] >= 0.9:
        con.print(Text(f"The step is compute-bound ({100 * b['compute_share']:.0f}% compute); the largest "
                       "overhead:", style="bold"))
    con.print(Text(f"Bottleneck: {b['words']}, {fmt_s(b['seconds'])} ({100 * b['share']:.1f}% of the step)",
                   style="bold"))
    if b["why"]:
        con.print(Text(f"  {b['why']}."))
    mem = b["memory"]
    need, of = gib_pair(mem["peak_gib"], mem["capacity_gib"])
    line = (f"Memory: peak {need} GiB of {of}, "
            f"{mem['headroom_gib']:.1f} GiB headroom")
    if mem["tight"]:
        line += " - tight: memory is what binds the choices that would need more of it"
    con.print(Text(line))
    con.print()
    t = Table(title="Neighbouring choices", title_justify="left")
    t.add_column("change")
    t.add_column("step", justify="right")
    t.add_column("vs plan", justify="right")
    t.add_column("verdict")
    bracketed = False
    for n in d["neighbours"]:
        st = n["status"]
        tm = n["step_time_s"] if n["step_time_s"] is not None else n.get("step_time_s_if_allowed")
        step = fmt_s(tm) if tm is not None else "-"
        delta = fmt_delta(tm, base_s) if tm is not None else ""
        if st == "ruled out":
            verdict = Text(f"ruled out: {n['reason']}", style="red")
            if tm is not None:
                step, bracketed = f"({step})", True
        elif st == "does not fit":
            verdict = Text(n["reason"], style="red")
        else:
            verdict = Text(st, style={"faster": "green bold", "slower": "", "same": "dim"}[st])
            changes = config_diff(plan.parallel, n["parallel"])
            if changes != "same":
                verdict.append(f" ({changes})", style="dim")
            if n.get("note"):
                verdict.append(f", {n['note']}", style="dim")
        t.add_row(n["change"], step, delta, verdict)
    con.print(t)
    if bracketed:  # the legend only where a row uses it
        con.print(Text("  (step) in brackets: the cost model's time if the rule were lifted", style="dim"))
    con.print()
    for s in d["summary"]:
        con.print(Text(f"- {s}"))


# ------------------------------------------------------------------------------------------------ why-not


def overlay(plan: Plan, text: str) -> ParallelConfig:
    """The user's configuration on top of the plan's: keys given replace the plan's, dp is re-derived
    unless given, and vp/schedule/recompute_layers follow what was given."""
    given = ParallelConfig.parse(text)
    keys = set(given.model_fields_set)
    d = plan.parallel.model_dump()
    for k in keys:
        d[k] = getattr(given, k)
    if "dp" not in keys:
        d["dp"] = None
    if "schedule" not in keys:
        if d["vp"] > 1:
            d["schedule"] = "interleaved"
        elif d["schedule"] == "interleaved":
            d["schedule"] = "1f1b"
    if "recompute" in keys and "recompute_layers" not in keys:
        d["recompute_layers"] = None
    if "tp" in keys and "sp" not in keys and d["tp"] == 1:
        d["sp"] = False
    if "pp" in keys and "vp" not in keys and d["pp"] == 1:
        d["vp"], d["schedule"] = 1, "1f1b" if "schedule" not in keys else d["schedule"]
    try:
        return ParallelConfig(**d)
    except AutoplanError:
        raise
    except Exception as e:  # noqa: BLE001 - pydantic validation -> one line
        raise ConfigError("invalid parallel configuration", f"{text!r}: {e}".splitlines()[0]) from None


def why_not(plan: Plan, text: str) -> dict:
    """Why the plan is not `text`: the rule that forbids it, the memory it would need, or what it costs."""
    cfg = overlay(plan, text)
    base = reestimate(plan)
    base_s = base.step_time_s
    o = evaluate(plan, cfg, keep_layout=True)
    cap = plan.cluster.gpu.hbm_gib
    out: dict = {"asked": text, "parallel": o.config.as_dict(), "config": short_config(o.config),
                 "plan_parallel": plan.parallel.as_dict(), "plan_step_time_s": base_s}
    if o.error is not None:
        out.update(status="ruled out", rule=o.error.rule, detail=o.error.detail, hint=o.error.hint,
                   reason=o.reason(cap), step_time_s_if_allowed=_hypothetical(plan, cfg))
        return out
    est = o.est
    comps = []
    for k, v in est.breakdown.items():
        dv = v - base.breakdown.get(k, 0.0)
        comps.append({"component": k, "words": COMPONENT_WORDS.get(k, k), "plan_s": base.breakdown.get(k, 0.0),
                      "this_s": v, "delta_s": dv})
    comps.sort(key=lambda c: -abs(c["delta_s"]))
    worst = max(range(len(est.memory)), key=lambda r: est.memory[r].total)
    memory = {k: v for k, v in est.memory[worst].gib().items()}
    out.update(step_time_s=est.step_time_s, delta_s=est.step_time_s - base_s, fits=est.fits,
               peak_memory_gib=est.peak_memory_gib, capacity_gib=cap, worst_rank=worst,
               memory_gib=memory, breakdown_delta=comps, note=o.note)
    if not est.fits:
        out.update(status="does not fit", reason=o.reason(cap))
    elif est.step_time_s < base_s * (1 - SAME):
        out.update(status="faster", reason=f"it is {fmt_s(base_s - est.step_time_s)} faster and allowed: the "
                                             "plan was pinned, or the search missed it")
    else:
        top = [c for c in comps if c["delta_s"] > 0][:3]
        why = ", ".join(f"{c['words']} +{fmt_s(c['delta_s'])}" for c in top)
        out.update(status="slower" if est.step_time_s > base_s * (1 + SAME) else "same",
                   reason=f"{fmt_s(est.step_time_s - base_s)} slower per step" + (f": {why}" if why else ""))
    return out


def render_why_not(con: Console, plan: Plan, text: str) -> None:
    d = why_not(plan, text)
    con.print(Text(f"Why not {d['config']}?", style="bold"))
    con.print(Text(f"  (other settings as in plan {plan.short_hash}: {short_config(plan.parallel)})", style="dim"))
    st = d["status"]
    if st == "ruled out":
        con.print(Text(f"Ruled out: {d['reason']}", style="red"))
        if d.get("hint"):
            con.print(Text(f"  fix: {d['hint']}"))
        if d.get("step_time_s_if_allowed"):
            con.print(Text(f"  if the rule were lifted the cost model predicts "
                           f"{fmt_s(d['step_time_s_if_allowed'])} per step "
                           f"(plan: {fmt_s(d['plan_step_time_s'])})"))
        return
    style = {"does not fit": "red", "faster": "green", "slower": "", "same": ""}[st]
    con.print(Text(f"{st.capitalize()}: {d['reason']}", style=style))
    con.print(Text(f"  step {fmt_s(d['step_time_s'])} vs plan {fmt_s(d['plan_step_time_s'])}; peak memory "
                   f"{d['peak_memory_gib']:.1f} GiB of {d['capacity_gib']:g} (rank {d['worst_rank']})"
                   + (f"; {d['note']}" if d.get("note") else "")))
    t = Table(title="Where the time goes", title_justify="left")
    t.add_column("component")
    t.add_column("plan", justify="right")
    t.add_column("this", justify="right")
    t.add_column("delta", justify="right")
    for c in d["breakdown_delta"]:
        t.add_row(COMPONENT_SHORT.get(c["component"], c["words"]), fmt_s(c["plan_s"]), fmt_s(c["this_s"]),
                  ("+" if c["delta_s"] >= 0 else "-") + fmt_s(abs(c["delta_s"])))
    con.print(t)
    m = d["memory_gib"]
    con.print(Text(f"  memory on rank {d['worst_rank']}: weights {m['weights']:.1f}, gradients "
                   f"{m['gradients']:.1f}, optimizer {m['optimizer']:.1f}, activations {m['activations']:.1f}, "
                   f"other {m['other']:.1f} = {m['total']:.1f} GiB"))
