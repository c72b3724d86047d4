"""Shared pieces: re-running the cost model on a plan or a variant of it, the rank mesh, formatting."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.cost_models.errors import AutoplanError, ConfigError
from autoplan.cost_models.estimate import GIB, Estimate, StageLayout, even_layout
from autoplan.cost_models.specs import ParallelConfig, check_config

from ..estimate_api import estimate_config
from ..plan import Plan


class InspectError(AutoplanError):
    """A plan cannot be shown, exported or compared the way it was asked."""

    kind = "cannot inspect"


# ------------------------------------------------------------------------------------------ estimates


def layout_of(plan: Plan) -> list[StageLayout]:
    """The plan's own (possibly uneven, per-stage recompute) stage layout."""
    return [StageLayout(tuple(s.layers), s.recompute, s.recompute_layers) for s in plan.stages]


def reestimate(plan: Plan, *, keep_timeline: bool = False) -> Estimate:
    """The cost model on exactly this plan (its stage layout included); used for timelines and as the
    baseline of `explain`. From the profiles the plan was priced from (autoplan.counts.plan_profiles: a user
    module's capture when the plan records it, never by importing the module)."""
    from autoplan.counts import plan_profiles

    return estimate_config(plan.model, plan.cluster, plan.training, plan.parallel, layout=layout_of(plan),
                           keep_timeline=keep_timeline, profiles=plan_profiles(plan))


@dataclass
class Outcome:
    """What the cost model says about one configuration: an estimate, or the rule that rules it out."""

    config: ParallelConfig
    est: Estimate | None = None
    error: AutoplanError | None = None
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.est is not None and self.est.fits

    @property
    def legal(self) -> bool:
        return self.error is None

    def reason(self, capacity_gib: float) -> str:
        """Why it is ruled out ('' when it is allowed)."""
        if self.error is not None:
            e = self.error
            return f"{e.rule}: {e.detail}" if e.detail else e.rule
        if self.est is not None and not self.est.fits:
            worst = max(range(len(self.est.memory)), key=lambda r: self.est.memory[r].total)
            where = f" on pipeline rank {worst}" if len(self.est.memory) > 1 else ""
            need, of = gib_pair(self.est.peak_memory_gib, capacity_gib)
            return f"does not fit: needs {need} GiB of {of}{where}"
        return ""


def evaluate(plan: Plan, cfg: ParallelConfig, *, keep_layout: bool = False) -> Outcome:
    """Estimate `cfg` for the plan's model, cluster and training setup.

    `keep_layout`: reuse the plan's stage boundaries when pp*vp is unchanged (and its per-stage recomputation
    when the variant does not change recomputation), so a knob that does not move layers is compared fairly
    on an uneven plan. Otherwise stages are even; when the layers do not divide evenly into pp*vp, the
    near-even split (remainder on the first stages) is used and the note says so."""
    model, cluster, training = plan.model, plan.cluster, plan.training
    note = ""
    layout = None
    if cfg.layout is not None:
        from autoplan.cost_models.layout import counts

        if len(counts(cfg.layout)) != cfg.pp * cfg.vp:  # a variant with other pp/vp cannot keep the layout
            cfg = cfg.model_copy(update={"layout": None})
            note = "even stages (the plan's layout has another stage count)"
    try:
        if keep_layout and cfg.pp * cfg.vp == len(plan.stages):
            resolved = check_config(cfg, model, cluster, training, stage_layers=False)
            layout = _layout_like(plan, resolved)
        else:
            try:
                resolved = check_config(cfg, model, cluster, training)
            except ConfigError as e:
                if "divide evenly" not in e.rule:
                    raise
                resolved = check_config(cfg, model, cluster, training, stage_layers=False)
                layout = even_layout(model.num_layers, resolved)
                note = "near-even stages"
        from autoplan.counts import plan_profiles

        est = estimate_config(model, cluster, training, resolved, layout=layout, profiles=plan_profiles(plan))
        return Outcome(resolved, est=est, note=note)
    except AutoplanError as e:
        return Outcome(cfg, error=e, note=note)


def _layout_like(plan: Plan, cfg: ParallelConfig) -> list[StageLayout]:
    p = plan.parallel
    same_rec = cfg.recompute == p.recompute and cfg.recompute_layers == p.recompute_layers
    out = []
    for s in plan.stages:
        if same_rec:
            out.append(StageLayout(tuple(s.layers), s.recompute, s.recompute_layers))
            continue
        n = s.layers[1] - s.layers[0]
        k = 0
        if cfg.recompute == "full":
            k = n if cfg.recompute_layers is None else min(n, -(-cfg.recompute_layers // cfg.vp))
        out.append(StageLayout(tuple(s.layers), cfg.recompute, k))
    return out


# ------------------------------------------------------------------------------------------------ mesh


AXES = ("tp", "cp", "dp", "pp")  # innermost first, as the cost model and the runtime lay ranks out


def mesh_info(plan: Plan) -> dict:
    """The rank mesh: per axis its size, stride, how many nodes one group spans and which link it uses,
    and for each pipeline rank which global ranks and nodes it owns."""
    cfg, cl = plan.parallel, plan.cluster
    sizes = {"tp": cfg.tp, "cp": cfg.cp, "dp": cfg.dp or 1, "pp": cfg.pp}
    gpn = cl.gpus_per_node
    axes, stride = [], 1
    for ax in AXES:
        n = sizes[ax]
        nodes = len({(k * stride) // gpn for k in range(n)})
        link = "-" if n == 1 else ("NVLink (intra-node)" if nodes == 1 else f"network, {nodes} nodes")
        axes.append({"axis": ax, "size": n, "stride": stride, "nodes_per_group": nodes, "link": link})
        stride *= n
    per_pp = cfg.tp * cfg.cp * (cfg.dp or 1)
    ranks = []
    for r in range(cfg.pp):
        first, last = r * per_pp, (r + 1) * per_pp - 1
        ranks.append({"pp_rank": r, "ranks": [first, last], "nodes": [first // gpn, last // gpn]})
    out = {"world_size": cl.num_gpus, "gpus_per_node": gpn, "num_nodes": cl.num_nodes, "order": list(AXES),
           "axes": axes, "pp_ranks": ranks}
    if cfg.ep > 1:
        out["ep"] = {"size": cfg.ep, "note": f"expert groups are {cfg.ep} consecutive dp ranks (carved out of dp)"}
    return out


# ------------------------------------------------------------------------------------------ formatting


_DEFAULTS = {"cp": 1, "ep": 1, "vp": 1, "sp": False, "zero": 0, "recompute": "none", "recompute_layers": None,
             "schedule": "1f1b"}


def short_config(cfg: ParallelConfig | dict) -> str:
    """The configuration string without keys at their defaults (tp, pp, dp and mbs always shown)."""
    d = cfg.as_dict() if isinstance(cfg, ParallelConfig) else dict(cfg)
    if d.get("vp", 1) > 1 and d.get("schedule") == "interleaved":
        d["schedule"] = "1f1b"  # implied by vp>1
    parts = []
    for k, v in d.items():
        if k in _DEFAULTS and v == _DEFAULTS[k]:
            continue
        if v is None:
            continue
        parts.append(f"{k}={_text(v)}")
    return ",".join(parts)


def _text(v) -> str:
    """A value as the configuration string writes it (a bool as 1/0)."""
    return str(int(v)) if isinstance(v, bool) else str(v)


def config_diff(a: ParallelConfig | dict, b: ParallelConfig | dict) -> str:
    """What b changes relative to a, e.g. `tp 8->4, pp 8->16`."""
    da = a.as_dict() if isinstance(a, ParallelConfig) else dict(a)
    db = b.as_dict() if isinstance(b, ParallelConfig) else dict(b)
    parts = [f"{k} {_text(da.get(k))}->{_text(db.get(k))}" for k in db if da.get(k) != db.get(k)]
    return ", ".join(parts) or "same"


def gib_pair(need: float, capacity: float) -> tuple[str, str]:
    """Two GiB amounts with as many decimals (1 to 3) as tell them apart: 79.64 and 79.60, not 79.6 and 79.6
    (which reads as an exact fit whether the plan fits or not)."""
    digits = next((d for d in (1, 2, 3) if round(need, d) != round(capacity, d)), 3)
    return f"{need:.{digits}f}", f"{capacity:.{digits}f}"


def fmt_gib_of(need: float, capacity: float) -> str:
    """"N of C" (`gib_pair`)."""
    return "{} of {}".format(*gib_pair(need, capacity))


def fmt_tflops(x: float) -> str:
    """TFLOP/s readable at any scale: hundreds on a GPU, hundredths on a CPU core (where a fixed decimal printed
    0)."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 1:
        return f"{x:.1f}"
    return f"{x:.2g}" if x > 0 else "0"


def fmt_s(t: float) -> str:
    """Seconds, with a unit that keeps 3-4 significant digits."""
    if t is None or (isinstance(t, float) and math.isnan(t)):
        return "-"
    a = abs(t)
    if a >= 100:
        return f"{t:.0f} s"
    if a >= 1:
        return f"{t:.2f} s"
    if a >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    if a == 0:
        return "0 s"
    return f"{t * 1e6:.0f} us"


def fmt_delta(new: float, base: float) -> str:
    d = new - base
    pct = 100 * d / base if base else 0.0
    sign = "+" if d >= 0 else "-"
    return f"{sign}{fmt_s(abs(d))} ({pct:+.1f}%)"


def gib(x_bytes: float) -> float:
    return x_bytes / GIB


COMPONENT_WORDS = {
    "compute": "compute",
    "recompute": "recomputation",
    "tp_cp_ep_comm": "exposed TP/CP/EP communication",
    "pp_comm": "pipeline point-to-point communication",
    "bubble": "pipeline bubble",
    "dp_comm": "exposed data-parallel gradient sync",
    "embedding_comm": "tied word-embedding gradient all-reduce (first and last pipeline ranks)",
    "optimizer": "optimizer step",
}

# Short labels for table rows (80 columns).
COMPONENT_SHORT = {
    "compute": "compute",
    "recompute": "recomputation",
    "tp_cp_ep_comm": "TP/CP/EP comm (exposed)",
    "pp_comm": "pipeline p2p comm",
    "bubble": "pipeline bubble",
    "dp_comm": "DP grad sync (exposed)",
    "embedding_comm": "tied embedding all-reduce",
    "optimizer": "optimizer step",
}
