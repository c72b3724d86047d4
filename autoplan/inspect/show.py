"""`autoplan show plan.json`: the mesh, the stages, memory against capacity, the step, the runners-up."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autoplan.cost_models.estimate import memory_moment_note, num_microbatches
from autoplan.cost_models.pipeline import microbatch_group, simulate

from ..plan import Plan
from .common import COMPONENT_SHORT, config_diff, fmt_s, fmt_tflops, mesh_info, short_config

# Memory components in bar order, with the character and colour that draw them (characters differ so the
# bars read without colour too).
MEM_PARTS = (("weights", "█", "blue"), ("gradients", "▓", "magenta"), ("optimizer", "▒", "yellow"),
             ("activations", "░", "green"), ("other", "#", "bright_black"))
HEADROOM = ("headroom", "·", "dim")


# ------------------------------------------------------------------------------------------------ data


def header_lines(plan: Plan) -> list[str]:
    cl, tr, cfg = plan.cluster, plan.training, plan.parallel
    m = num_microbatches(cfg, tr)
    nodes = f"{cl.num_nodes} node{'s' if cl.num_nodes > 1 else ''} x {cl.gpus_per_node}"
    return [
        f"{plan.model.name} on {cl.num_gpus} x {cl.gpu.name} ({cl.name}, {nodes})",
        f"batch {tr.global_batch_size} x {tr.seq_length} tokens, {tr.dtype}, stack {plan.stack or 'autoplan'}, "
        f"{tr.kernels} kernels, {m} micro-batches of {cfg.mbs} per step",
        f"plan {plan.short_hash}: {short_config(cfg)}",
    ]


def stage_rows(plan: Plan) -> list[dict]:
    """One row per pipeline rank: its virtual stages' layers, recomputation and per-micro-batch times."""
    rows = []
    for r in range(plan.parallel.pp):
        st = [s for s in plan.stages if s.pp_rank == r]
        rec = sorted({_rec_label(s) for s in st})
        rows.append({
            "pp_rank": r,
            "stages": [s.index for s in st],
            "layers": [list(s.layers) for s in st],
            "num_layers": sum(s.num_layers for s in st),
            "embedding": any(s.has_embedding for s in st),
            "head": any(s.has_head for s in st),
            "recompute": ", ".join(rec),
            "forward_s": sum(s.forward_s for s in st),
            "backward_s": sum(s.backward_s for s in st),
        })
    return rows


def _rec_label(s) -> str:
    if s.recompute == "full":
        return f"full {s.recompute_layers}/{s.num_layers}" if s.recompute_layers != s.num_layers else "full"
    return s.recompute


def _layers_label(layers: list[list[int]]) -> str:
    # an empty virtual stage (only the embedding or the loss) prints as "-"
    return " ".join(f"{a}-{b - 1}" if b - a > 1 else (f"{a}" if b > a else "-") for a, b in layers)


def timeline_grid(plan: Plan, max_microbatches: int | None = None) -> dict:
    """The step x rank grid of actions (`2F0` = stage 2, forward, micro-batch 0) for a few micro-batches.

    Time runs down in unit ticks (every forward and backward takes one tick, as in torch.distributed.pipelining's
    printed schedules), so an empty cell is an idle slot: the bubble. The real schedule is the same order with
    the predicted durations (see `autoplan trace`)."""
    cfg, tr = plan.parallel, plan.training
    m = num_microbatches(cfg, tr)
    pp, vp = cfg.pp, cfg.vp
    if max_microbatches is None:
        max_microbatches = 2 * pp if pp > 1 else 4
    shown = min(m, max_microbatches)
    if cfg.schedule == "interleaved" and vp > 1:
        # whole rounds of the plan's own length (pipeline.microbatch_group): of pp, or one longer round
        group = microbatch_group(pp, m)
        shown = max(pp, shown - shown % pp) if group == pp else group
    n = pp * vp
    tl = simulate(cfg.schedule, pp, shown, vp, [1.0] * n, [1.0] * n, 0.0, keep_slices=True)
    ticks = int(round(tl.makespan))
    rows = [["" for _ in range(pp)] for _ in range(ticks)]
    for r, slices in enumerate(tl.slices):
        for act, start, _end in slices:
            rows[int(round(start))][r] = str(act)
    bubble = sum(1 for row in rows for c in row if not c) / max(1, ticks * pp)
    return {"microbatches": m, "microbatches_shown": shown, "schedule": cfg.schedule, "pp": pp, "vp": vp,
            "ticks": ticks, "idle_fraction": bubble, "rows": rows}


def show_json(plan: Plan, *, timeline: bool = False) -> dict:
    p = plan.prediction
    cap = plan.cluster.gpu.hbm_gib
    out = {
        "plan": plan.short_hash,
        "model": plan.model.name,
        "cluster": plan.cluster.name,
        "gpu": plan.cluster.gpu.name,
        "num_gpus": plan.cluster.num_gpus,
        "global_batch_size": plan.training.global_batch_size,
        "seq_length": plan.training.seq_length,
        "dtype": plan.training.dtype,
        "stack": plan.stack or "autoplan",
        "microbatches": num_microbatches(plan.parallel, plan.training),
        "parallel": plan.parallel.as_dict(),
        "step_time_s": p.step_time_s,
        "tflops_per_gpu": p.tflops_per_gpu,
        "mfu": p.mfu,
        "hfu": p.hfu,
        "tokens_per_s": p.tokens_per_s,
        "memory_gib": p.memory_gib,
        "capacity_gib": cap,
        "fits": p.fits,
        "memory_breakdown_gib": [dict(m.model_dump(), headroom=max(0.0, cap - m.total), pp_rank=r)
                                 for r, m in enumerate(p.memory_breakdown)],
        "breakdown": p.breakdown,
        "mesh": mesh_info(plan),
        "stages": stage_rows(plan),
        "runners_up": [dict(r.model_dump(), delta_s=r.step_time_s - p.step_time_s) for r in plan.runners_up],
    }
    if timeline:
        out["timeline"] = timeline_grid(plan)
    from .counts_view import counts_json

    out["counts"] = counts_json(plan)  # per pp rank: FLOPs by phase, collectives, memory by category (bytes)
    out["runtime_semantics"] = dict(plan.runtime_semantics)
    return out


# ------------------------------------------------------------------------------------------- rendering


def _pick(n: int, limit: int, keep: set[int] | None = None) -> list[int | None]:
    """Indices to show out of n: all when n <= limit, else the head, the tail and `keep`, None = a gap."""
    if n <= limit:
        return list(range(n))
    half = max(1, (limit - 1) // 2)
    chosen = sorted(set(range(half)) | set(range(n - half, n)) | (keep or set()))
    out: list[int | None] = []
    prev = -1
    for i in chosen:
        if i != prev + 1:
            out.append(None)
        out.append(i)
        prev = i
    return out


def memory_bar(parts: dict, capacity: float, width: int) -> Text:
    """One bar: the components in GiB, then headroom up to the capacity; '!' past the capacity."""
    total = max(parts["total"], sum(parts[k] for k, _, _ in MEM_PARTS))
    scale = max(capacity, total)
    t = Text()
    acc, drawn = 0.0, 0
    for key, ch, style in MEM_PARTS:
        acc += parts[key]
        upto = int(round(acc / scale * width))
        if upto > drawn:
            t.append(ch * (upto - drawn), style=style)
            drawn = upto
    cap_at = int(round(capacity / scale * width))
    if cap_at > drawn:
        t.append(HEADROOM[1] * (cap_at - drawn), style=HEADROOM[2])
    elif total > capacity:
        # over capacity: overwrite the tail past the capacity mark with '!'
        t = t[:cap_at]
        t.append("!" * (width - cap_at), style="bold red")
    return t


def render_header(con: Console, plan: Plan) -> None:
    lines = header_lines(plan)
    con.print(Text(lines[0], style="bold"))
    for line in lines[1:]:
        con.print(Text(line))
    p = plan.prediction
    cap = plan.cluster.gpu.hbm_gib
    peak = p.memory_gib["peak"]
    head = Table(show_header=False, box=None, pad_edge=False)
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_column()
    head.add_row("step time", fmt_s(p.step_time_s), "")
    head.add_row("tokens/s", f"{p.tokens_per_s:,.0f}", f"{p.tokens_per_s / plan.cluster.num_gpus:,.0f} per GPU")
    head.add_row("TFLOP/s per GPU", fmt_tflops(p.tflops_per_gpu), "")
    head.add_row("MFU / HFU", f"{100 * p.mfu:.1f}%", f"/ {100 * p.hfu:.1f}%")
    room = cap - peak
    state = "[red]DOES NOT FIT[/]" if not p.fits else (
        f"{room:.1f} GiB headroom" + (" [yellow](tight)[/]" if room < 0.05 * cap else ""))
    head.add_row("peak memory", f"{peak:.1f} GiB", f"of {cap:g} GiB, {state}")
    con.print(head)


def render_mesh(con: Console, plan: Plan) -> None:
    info = mesh_info(plan)
    t = Table(title=f"Mesh: {info['world_size']} ranks, {info['num_nodes']} nodes x {info['gpus_per_node']} "
                    "GPUs (tp innermost, then cp, dp, pp)", title_justify="left")
    for c, j in (("axis", "left"), ("size", "right"), ("rank stride", "right"), ("one group uses", "left")):
        t.add_column(c, justify=j)
    for a in info["axes"]:
        t.add_row(a["axis"], str(a["size"]), str(a["stride"]), a["link"])
    con.print(t)
    ranks = info["pp_ranks"]
    lines = []
    for i in _pick(len(ranks), 8):
        if i is None:
            lines.append("  ...")
            continue
        r = ranks[i]
        nodes = r["nodes"]
        nd = f"node {nodes[0]}" if nodes[0] == nodes[1] else f"nodes {nodes[0]}-{nodes[1]}"
        lines.append(f"  pp rank {r['pp_rank']}: ranks {r['ranks'][0]}-{r['ranks'][1]}, {nd}")
    if "ep" in info:
        lines.append(f"  ep={info['ep']['size']}: {info['ep']['note']}")
    con.print(Text("\n".join(lines)))


def render_stages(con: Console, plan: Plan) -> None:
    rows = stage_rows(plan)
    cfg = plan.parallel
    title = f"Pipeline: {cfg.pp} rank{'s' if cfg.pp > 1 else ''}"
    if cfg.vp > 1:
        title += f" x {cfg.vp} virtual stages, interleaved"
    elif cfg.pp > 1:
        title += f", {cfg.schedule}"
    counts = {s.num_layers for s in plan.stages}
    if len(counts) > 1:
        title += " (uneven stages)"
    t = Table(title=title, title_justify="left")
    t.add_column("rank", justify="right")
    t.add_column("layers" if cfg.vp == 1 else "layers per virtual stage")
    t.add_column("n", justify="right")
    t.add_column("recompute")
    t.add_column("fwd", justify="right")
    t.add_column("bwd", justify="right")
    keep = {r["pp_rank"] for r in rows if r["num_layers"] != rows[len(rows) // 2]["num_layers"]}
    for i in _pick(len(rows), 12, keep if len(keep) <= 4 else None):
        if i is None:
            t.add_row("...", "", "", "", "", "")
            continue
        r = rows[i]
        label = _layers_label(r["layers"])
        extra = [x for x, on in (("emb", r["embedding"]), ("head", r["head"])) if on]
        if extra:
            label += " +" + "+".join(extra)
        t.add_row(str(r["pp_rank"]), label, str(r["num_layers"]), r["recompute"], fmt_s(r["forward_s"]),
                  fmt_s(r["backward_s"]))
    con.print(t)
    con.print(Text("  fwd/bwd: predicted time of one micro-batch through the rank's stages "
                   "(bwd includes recomputation)", style="dim"))


def render_memory(con: Console, plan: Plan) -> None:
    p = plan.prediction
    cap = plan.cluster.gpu.hbm_gib
    mem = [m.model_dump() for m in p.memory_breakdown]
    width = max(10, min(44, (con.width or 80) - 30))
    con.print(Text(f"Memory per pipeline rank against {cap:g} GiB", style="italic"))
    legend = Text("  ")
    for key, ch, style in (*MEM_PARTS, HEADROOM):
        legend.append(ch, style=style)
        legend.append(f" {key}  ")
    con.print(legend)
    g = Table.grid(padding=(0, 1))
    g.add_column(justify="right")
    g.add_column()
    g.add_column(justify="right")
    peak_rank = max(range(len(mem)), key=lambda r: mem[r]["total"])
    for i in _pick(len(mem), 12, {peak_rank}):
        if i is None:
            g.add_row("...", "", "")
            continue
        m = mem[i]
        style = "red" if m["total"] > cap else ("yellow" if cap - m["total"] < 0.05 * cap else "")
        g.add_row(f"rank {i}", memory_bar(m, cap, width), Text(f"{m['total']:.1f} GiB", style=style))
    con.print(g)
    r = mem[peak_rank]
    con.print(Text(f"  peak (rank {peak_rank}): weights {r['weights']:.1f}, gradients {r['gradients']:.1f}, "
                   f"optimizer {r['optimizer']:.1f}, activations {r['activations']:.1f}, "
                   f"other {r['other']:.1f} GiB", style="dim"))
    note = memory_moment_note(plan.parallel, plan.training)
    if note:
        con.print(Text(f"  {note}", style="dim"))


def render_breakdown(con: Console, plan: Plan) -> None:
    p = plan.prediction
    t = Table(title=f"Step time {fmt_s(p.step_time_s)}", title_justify="left")
    t.add_column("component")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    t.add_column("")
    for k, v in p.breakdown.items():
        share = v / p.step_time_s if p.step_time_s else 0.0
        t.add_row(COMPONENT_SHORT.get(k, k), fmt_s(v), f"{100 * share:.1f}%", "█" * int(round(20 * share)))
    con.print(t)


def render_runners_up(con: Console, plan: Plan) -> None:
    if not plan.runners_up:
        return
    base = plan.prediction.step_time_s
    t = Table(title="Runners-up (what they change)", title_justify="left")
    t.add_column("change")
    t.add_column("step", justify="right")
    t.add_column("vs plan", justify="right")
    t.add_column("peak GiB", justify="right")
    t.add_column("why it lost")
    for r in plan.runners_up:
        pct = 100 * (r.step_time_s - base) / base if base else 0.0
        t.add_row(config_diff(plan.parallel, r.parallel), fmt_s(r.step_time_s), f"{pct:+.1f}%",
                  f"{r.peak_memory_gib:.1f}", r.note)
    con.print(t)


def render_timeline(con: Console, plan: Plan, max_microbatches: int | None = None, max_rows: int = 48) -> None:
    g = timeline_grid(plan, max_microbatches)
    rows, pp = g["rows"], g["pp"]
    con.print(Text(f"Schedule ({g['schedule']}): first {g['microbatches_shown']} of {g['microbatches']} "
                   f"micro-batches, one row per tick; empty = idle ({100 * g['idle_fraction']:.0f}% here)",
                   style="italic"))
    cell = max([len(c) for row in rows for c in row] + [len(f"r{pp - 1}")]) + 1
    width = (con.width or 80) - 6
    ncols = max(2, width // cell)
    cols: list[int | None] = list(range(pp)) if pp <= ncols else [*range(ncols - 2), None, pp - 1]
    lines = ["tick  " + "".join(f"{'..' if c is None else f'r{c}':>{cell}}" for c in cols)]
    for i in _pick(len(rows), max_rows):
        if i is None:
            lines.append(" ...")
            continue
        row = rows[i]
        lines.append(f"{i:>4}  " + "".join(f"{'' if c is None else row[c]:>{cell}}" for c in cols))
    con.print(Text("\n".join(lines)), overflow="crop", no_wrap=True)


def render_show(con: Console, plan: Plan, *, timeline: bool = False, max_microbatches: int | None = None) -> None:
    render_header(con, plan)
    con.print()
    render_mesh(con, plan)
    con.print()
    render_stages(con, plan)
    con.print()
    render_memory(con, plan)
    con.print()
    render_breakdown(con, plan)
    con.print()
    from .counts_view import render_counts

    render_counts(con, plan)
    if plan.runners_up:
        con.print()
        render_runners_up(con, plan)
    if timeline:
        con.print()
        render_timeline(con, plan, max_microbatches)
