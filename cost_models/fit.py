"""Refit a cluster's constants to measurements: the half of `autoplan tune` that learns from what it ran.

The cost model's constants (GEMM and attention efficiency, memory efficiency, host time per operator and its
extra under tensor parallelism, FSDP's host time per collective, latency and bandwidth of each network level,
and the wait for descheduled peers on an oversubscribed node) are fitted once per GPU type on published runs.
On a cluster the model has not seen they can be far off; this module fits them to that cluster's own measurements by nonlinear least squares *through the cost model itself*, so a
refit cluster predicts with exactly the code the search uses.

The residuals are on components, not on total step time alone:
- micro-benchmarks (`autoplan calibrate --bench`): one row per GEMM shape and per collective, level and size,
  predicted by `compute.gemm_efficiency` and the `comm` functions alone — they pin the efficiency curve and each
  level's alpha and beta directly;
- measured runs: one row per run (step time), plus one row per time component the runtime's timed steps
  measured (`autoplan run --time-from N`, autoplan.runtime.timing: compute, recompute, tensor/context/expert
  collective waits, FSDP's work and waits, pipeline waits, the optimizer tail), each against the estimate's
  breakdown entry that predicts it (`COMPONENTS`), so that compute knobs are pinned by compute time and
  collective knobs by collective time, not all of them by one total;
- a weak prior pulls each constant towards its starting value (the calibrated or preset one), so that a
  constant the data cannot see stays where the primitives put it instead of drifting; `FitResult.undetermined`
  names those.
Residuals are log-ratios (predicted / measured), so a 10 ms GEMM and a 1 s step weigh alike. The constants
are fitted in log space within physical bounds (scipy.optimize.least_squares, trust-region reflective).

Measured counts (FLOPs, bytes per collective) are not something constants can fix: where a profile record's
measured counts disagree with the predicted ones the fit says so (`FitResult.count_mismatches`) rather than
bending a constant to hide a wrong count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from . import comm
from .compute import gemm_efficiency
from .errors import SpecError
from .estimate import StageLayout, estimate, parameter_kind, uses_fsdp2, uses_torch_ddp
from .profile import LayerProfile, profile_from_spec
from .specs import ClusterSpec, ModelSpec, ParallelConfig, TrainingSpec

# ------------------------------------------------------------------------------------------- the knobs


@dataclass(frozen=True)
class Knob:
    """One fitted constant: where it lives in the cluster spec and its physical bounds."""

    name: str
    path: tuple[str, ...]
    lower: float
    upper: float
    description: str


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("matmul_max_efficiency", ("gpu", "calibration", "matmul_max_efficiency"), 1e-4, 1e3,
         "fraction of peak a large GEMM reaches (above 1 the peak is raised instead)"),
    Knob("matmul_half_dim", ("gpu", "calibration", "matmul_half_dim"), 1e-2, 1e5,
         "GEMM size at half efficiency"),
    Knob("attention_efficiency", ("gpu", "calibration", "attention_efficiency"), 1e-4, 1e3,
         "fraction of peak the fused attention reaches"),
    Knob("memory_efficiency", ("gpu", "calibration", "memory_efficiency"), 1e-4, 1e3,
         "fraction of memory bandwidth an elementwise kernel reaches"),
    Knob("kernel_launch_us", ("gpu", "calibration", "kernel_launch_us"), 1e-2, 1e5,
         "host time per operator (Python, dispatch, launch), us"),
    Knob("tp_op_overhead_us", ("gpu", "calibration", "tp_op_overhead_us"), 1e-2, 1e6,
         "extra host time per operator of a tensor-parallel (DTensor) layer, us"),
    Knob("dtensor_param_us", ("gpu", "calibration", "dtensor_param_us"), 1e-2, 1e6,
         "extra host time per parameter tensor of the optimizer step over DTensor parameters, us"),
    Knob("fused_call_us", ("gpu", "calibration", "fused_call_us"), 1e-2, 1e6,
         "host time one fused Triton module call adds in the forward over the eager op (GPU hosts), us"),
    Knob("fsdp_collective_overhead_us", ("gpu", "calibration", "fsdp_collective_overhead_us"), 1e-2, 1e6,
         "host time FSDP2 spends around each per-unit all-gather / reduce-scatter (ZeRO-1/2/3), us"),
    Knob("intra_latency_us", ("intra_node", "latency_us"), 1e-2, 1e6, "intra-node hop latency (alpha), us"),
    Knob("intra_bandwidth_gbps", ("intra_node", "bandwidth_gbps"), 1e-4, 1e5,
         "intra-node bandwidth (1/beta), GB/s"),
    Knob("inter_latency_us", ("inter_node", "latency_us"), 1e-2, 1e6, "inter-node hop latency (alpha), us"),
    Knob("inter_bandwidth_gbps", ("inter_node", "bandwidth_gbps"), 1e-4, 1e5,
         "inter-node bandwidth (1/beta), GB/s"),
    Knob("oversubscription_wait_us", ("oversubscription_wait_us",), 1e-2, 1e6,
         "wait per hop for a descheduled peer when processes outnumber cores, us"),
    Knob("step_wait_us", ("step_wait_us",), 1e-2, 1e6,
         "further wait per hop inside a training step, where the descheduled peer is computing, us"),
    Knob("skew_wait_us", ("skew_wait_us",), 1e-2, 1e6,
         "wait per collective inside a training step for its last member on an oversubscribed node, us"),
    Knob("fsdp_hook_us", ("gpu", "calibration", "fsdp_hook_us"), 1e-2, 1e6,
         "host time of FSDP2's hooks per unit and micro-batch (replicate and fully_shard), us"),
    Knob("pipeline_action_us", ("gpu", "calibration", "pipeline_action_us"), 1e-2, 1e6,
         "host time of the runtime's pipeline schedule per action (a stage's forward or backward of one "
         "micro-batch) on CPU processes, us"),
    Knob("recompute_region_us", ("gpu", "calibration", "recompute_region_us"), 1e-2, 1e6,
         "host time of one checkpointed region per micro-batch (torch.utils.checkpoint bookkeeping), us"),
    Knob("recompute_op_us", ("gpu", "calibration", "recompute_op_us"), 1e-2, 1e6,
         "further host time per operator of a checkpointed region (saved-tensor hooks), us"),
)}


def knob_values(cluster: ClusterSpec) -> dict[str, float]:
    """The current value of every knob in `cluster` (efficiencies as effective rates against its peak)."""
    d = cluster.model_dump()
    out = {}
    for k in KNOBS.values():
        v = d
        for part in k.path:
            v = v[part]
        out[k.name] = float(v)
    return out


def with_knobs(cluster: ClusterSpec, values: dict[str, float]) -> ClusterSpec:
    """`cluster` with some knobs replaced. Efficiencies above 1 (the measured rate beats the spec's peak) raise
    the peak (or the memory bandwidth) and keep the efficiency at 1, which predicts the same times."""
    d = cluster.model_dump()
    for name, val in values.items():
        if name not in KNOBS:
            raise SpecError(f"unknown fit knob {name!r}", "", "known knobs: " + ", ".join(KNOBS))
        target = d
        path = KNOBS[name].path
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = float(val)
    cal, gpu = d["gpu"]["calibration"], d["gpu"]
    raise_peak = max(1.0, cal["matmul_max_efficiency"], cal["attention_efficiency"])
    if raise_peak > 1.0:
        gpu["peak_tflops"] = {k: (v * raise_peak if v else v) for k, v in gpu["peak_tflops"].items()}
        cal["matmul_max_efficiency"] /= raise_peak
        cal["attention_efficiency"] /= raise_peak
    if cal["memory_efficiency"] > 1.0:
        gpu["hbm_gbps"] *= cal["memory_efficiency"]
        cal["memory_efficiency"] = 1.0
    return ClusterSpec.model_validate(d)


# --------------------------------------------------------------------------------------- observations


class _Obs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GemmSample(_Obs):
    """One GEMM micro-benchmark: (m x k) @ (k x n) took `seconds` (best of several)."""

    m: int = Field(gt=0, description="Rows of the left operand.")
    n: int = Field(gt=0, description="Columns of the right operand.")
    k: int = Field(gt=0, description="Contraction size.")
    dtype: str = Field(default="fp32", description="Compute dtype.")
    seconds: float = Field(gt=0, description="Measured time of one GEMM.")
    call_s: float = Field(default=0.0, ge=0, description="Measured time of a 1x1x1 GEMM in the same loop: what "
                          "the benchmark's own call costs (0 in files written before it was recorded).")
    processes: int = Field(default=1, ge=1, description="Processes sharing the node's cores while it was measured "
                           "(calibrate's GEMM benchmark runs in one).")


Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]


class CollectiveSample(_Obs):
    """One collective micro-benchmark among `ranks` processes at one level of the hierarchy."""

    collective: Collective = Field(description="Which collective.")
    level: Literal["intra", "inter"] = Field(description="intra: ranks share a node; inter: one rank per node.")
    ranks: int = Field(ge=2, description="Processes in the group.")
    processes_per_node: int = Field(ge=1, description="Processes running on each node during the measurement.")
    nbytes: float = Field(gt=0, description="Buffer size: the full buffer for all-reduce/gather/scatter, "
                          "the per-rank send buffer for all-to-all, the message for send/recv.")
    seconds: float = Field(gt=0, description="Measured time (median over repeats).")


class RegionSample(_Obs):
    """One checkpoint micro-benchmark (autoplan.calibrate_bench.bench_recompute_region): the host time one
    checkpointed region of `ops` operators adds to a forward+backward beyond re-running them."""

    ops: int = Field(default=1, ge=0, description="Operators in the region, as the cost model counts them.")
    seconds: float = Field(gt=0, description="Measured time of one region (median over repeats).")
    processes: int = Field(default=1, ge=1, description="Processes sharing the node's cores while it was measured "
                           "(calibrate's benchmark runs in one).")


class HostOpSample(_Obs):
    """The host time of one operator as a training step pays it (autoplan.calibrate.training_op_us: tiny-gpt's
    forward and backward at one token over 3 x its counted operators): what `GPUCalibration.kernel_launch_us`
    prices. The runs see it only in combination with the compute rates (a layer's time is its operators' host
    time plus its FLOPs and bytes), so without this row the fit trades one for the other (session 18: a live tune
    ended at kernel_launch_us 0.01, its lower bound, and priced the pipelines' small actions 20-30% fast)."""

    seconds: float = Field(gt=0, description="Measured host time per operator, or per pipeline action (median over "
                           "repeats).")
    processes: int = Field(default=1, ge=1, description="Processes sharing the node's cores while it was measured "
                           "(calibrate's benchmark runs in one).")
    knob: Literal["kernel_launch_us", "pipeline_action_us"] = Field(
        default="kernel_launch_us",
        description="The host time measured: per operator (kernel_launch_us), or per action of the runtime's "
        "pipeline schedule (pipeline_action_us: calibrate_bench.bench_pipeline_actions, two processes; the runs "
        "see it only beside the pipelined stages' compute).")


class TimedComponents(_Obs):
    """Measured time of some components of a step, keyed like `Estimate.breakdown` (others are ignored)."""

    seconds: dict[str, float] = Field(default_factory=dict)
    by_stage: dict[int, dict[str, float]] = Field(
        default_factory=dict, description="The same per pipeline stage; the fit compares the stage the "
        "estimate's breakdown describes (its critical rank), else `seconds`.")


class RunSample(BaseModel):
    """One measured run: the configuration as planned and its measured step time (and profile, if any)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    model: ModelSpec = Field(description="The model that ran.")
    training: TrainingSpec = Field(description="Batch, sequence, dtype and kernels as planned.")
    parallel: ParallelConfig = Field(description="The configuration (dp resolved).")
    world: int = Field(gt=0, description="Processes launched.")
    layout: list[tuple[tuple[int, int], str, int]] | None = Field(
        default=None, description="Stage layout (layers, recompute, recompute_layers) as planned; None = even.")
    measured_step_s: float = Field(gt=0, description="Median measured step time after warm-up.")
    components: TimedComponents | None = Field(default=None, description="Measured time components, if any.")
    label: str = Field(default="", description="Shown in reports (the plan hash or configuration).")

    def stage_layout(self) -> list[StageLayout] | None:
        if self.layout is None:
            return None
        return [StageLayout(tuple(r), rec, n) for r, rec, n in self.layout]


# ------------------------------------------------------------------------------------------ prediction


def predict_gemm(cluster: ClusterSpec, g: GemmSample) -> float:
    """Time of one GEMM by the cost model's roofline, plus the benchmark loop's own cost per call (measured,
    `call_s`). Not kernel_launch_us: that is a training step's host time per operator (autograd, module calls,
    hooks on top of the dispatch), and pinning it to a bare call made the fit explain host-bound steps by
    absurdly slow attention instead (session 5: attention_efficiency 0.008)."""
    peak = cluster.gpu.peak_flops(g.dtype)
    roofline = 2.0 * g.m * g.n * g.k / (peak * gemm_efficiency(cluster, g.m, g.n, g.k))
    return roofline * _bench_scale(cluster, g.processes) + g.call_s


def _bench_scale(cluster: ClusterSpec, processes: int) -> float:
    """A run's time over a benchmark's run in `processes` processes on one node: the run's share of a core over
    the benchmark's (`_core_share`; 1 on accelerators)."""
    return _core_share(cluster, cluster.gpus_per_node) / _core_share(cluster, processes)


def _core_share(cluster: ClusterSpec, processes: int) -> float:
    """The share of a core each of `processes` compute processes gets on a node of `cluster.cores_per_node`
    cores (1 on accelerators, where the cores are not given). The cost model's rates are those a process of a
    run reaches (the cluster's gpus_per_node processes per node); a GEMM benchmarked with fewer processes had
    more of a core and ran faster by the ratio. (Without this, the fit raised the CPU's GEMM rate to the
    benchmark's single-process one, matmul_max_efficiency 2.1-2.8, and priced the runs' GEMMs at it.)"""
    cores = cluster.cores_per_node
    if cores is None:
        return 1.0
    return min(1.0, cores / max(1, processes))


def predict_region(cluster: ClusterSpec, r: RegionSample) -> float:
    """Host time of one checkpointed region (GPUCalibration.recompute_region_us), as a process of a run has it,
    rescaled to the benchmark's share of a core like a GEMM's (`predict_gemm`)."""
    cal = cluster.gpu.calibration
    us = cal.recompute_region_us + r.ops * cal.recompute_op_us
    return us * 1e-6 * _bench_scale(cluster, r.processes)


def predict_host_op(cluster: ClusterSpec, h: HostOpSample) -> float:
    """Host time per operator (GPUCalibration.kernel_launch_us) or per pipeline action (pipeline_action_us), as a
    process of a run has it, rescaled to the benchmark's share of a core like a GEMM's (`predict_gemm`)."""
    us = getattr(cluster.gpu.calibration, h.knob)
    return us * 1e-6 * _bench_scale(cluster, h.processes)


def predict_collective(cluster: ClusterSpec, c: CollectiveSample) -> float:
    """Time of one collective by the cost model's alpha-beta formulas, on the group the sample describes."""
    # a micro-benchmark is not a training step: its peers idle in the same loop
    cluster = comm.peers_present(cluster)
    if c.level == "intra":
        node = cluster.model_copy(update={"gpus_per_node": c.processes_per_node, "num_nodes": 1})
        grp = comm.Group(c.ranks, c.ranks)
    else:
        node = cluster.model_copy(update={"gpus_per_node": c.processes_per_node, "num_nodes": c.ranks})
        grp = comm.Group(c.ranks, 1)
    fn: dict[str, Callable[[ClusterSpec, comm.Group, float], float]] = {
        "all_reduce": comm.all_reduce, "all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter,
        "all_to_all": comm.all_to_all,
    }
    if c.collective == "send_recv":
        return comm.p2p(node, c.nbytes, cross_node=c.level == "inter")
    return fn[c.collective](node, grp, c.nbytes)


def predict_run(cluster: ClusterSpec, r: RunSample, profiles: list[LayerProfile] | None = None):
    """The cost model's Estimate of run `r` on `cluster` (resized to the run's world)."""
    profiles = profiles or profile_from_spec(r.model)
    return estimate(profiles, cluster.with_gpus(r.world), r.training, r.parallel, r.stage_layout())


# ------------------------------------------------------------------------------------------------ fit


@dataclass
class FitResult:
    """The refit cluster and how well it explains the data."""

    cluster: ClusterSpec
    before: dict[str, float]
    after: dict[str, float]
    free: list[str]
    undetermined: list[str]  # knobs the data hardly see (held at their starting value)
    collinear: list[list[str]] = field(default_factory=list)  # knobs only whose combination the data determines
    held: list[str] = field(default_factory=list)  # held at their start: undetermined, or collinear with a better-seen one
    rows: list[dict] = field(default_factory=list)  # one per residual: kind, label, measured, before, after
    count_mismatches: list[str] = field(default_factory=list)
    cost: float = 0.0
    evaluations: int = 0

    def rms_log_error(self, kind: str | None = None, when: str = "after") -> float:
        rows = [r for r in self.rows if kind is None or r["kind"] == kind]
        if not rows:
            return 0.0
        return math.sqrt(sum(math.log(r[when] / r["measured"]) ** 2 for r in rows) / len(rows))

    def mean_abs_error(self, kind: str | None = None, when: str = "after") -> float:
        rows = [r for r in self.rows if kind is None or r["kind"] == kind]
        if not rows:
            return 0.0
        return sum(abs(r[when] / r["measured"] - 1) for r in rows) / len(rows)

    @property
    def peak_raise(self) -> float:
        """How many times the refit spec's compute peak exceeds the start's (`with_knobs` turns a fitted GEMM or
        attention efficiency above 1 into a raised peak): 1 when the fit kept them at or below 1."""
        return max(1.0, *(self.after[k] for k in ("matmul_max_efficiency", "attention_efficiency")
                          if k in self.after))

    @property
    def at_bounds(self) -> dict[str, str]:
        """Fitted knobs that ended on one of their physical bounds (`KNOBS`): "lower" or "upper". Such a value is
        not a measurement: the data pushed the knob as far as allowed and the other knobs absorbed the rest
        (typically two knobs the runs can hardly tell apart)."""
        out = {}
        for name in self.free:
            if name in self.held or name not in KNOBS:
                continue
            k, v = KNOBS[name], self.after[name]
            if v <= k.lower * (1 + 1e-3):
                out[name] = "lower"
            elif v >= k.upper * (1 - 1e-3):
                out[name] = "upper"
        return out

    def knob_note(self, name: str) -> str:
        """What to know about fitted knob `name`'s value: held at its start, or ended on a bound."""
        if name in self.held:
            return "held at its start: the data do not determine it"
        side = self.at_bounds.get(name)
        if side:
            bound = KNOBS[name].lower if side == "lower" else KNOBS[name].upper
            return f"at its {side} bound {bound:g}: not a measured value, the other knobs absorb the rest"
        return ""

    def summary_lines(self) -> list[str]:
        """Human-readable residuals, for the refit cluster file's comment header."""
        lines = []
        for kind in ("gemm", "collective", "run", "component"):
            rows = [r for r in self.rows if r["kind"] == kind]
            if rows:
                lines.append(f"{kind}: {len(rows)} rows, mean |error| {100 * self.mean_abs_error(kind, 'before'):.1f}% "
                             f"before -> {100 * self.mean_abs_error(kind):.1f}% after")
        for r in self.rows:
            if r["kind"] in ("run", "component"):
                lines.append(f"  {r['label']}: measured {r['measured'] * 1e3:.2f} ms, predicted "
                             f"{r['before'] * 1e3:.2f} -> {r['after'] * 1e3:.2f} ms")
        for name in self.free:
            note = self.knob_note(name)
            lines.append(f"{name}: {self.before[name]:.6g} -> {self.after[name]:.6g}" + (f" ({note})" if note else ""))
        lines.extend("only the combination of " + " and ".join(g) + " is determined (they trade off)"
                     for g in self.collinear)
        lines.extend(f"count mismatch: {m}" for m in self.count_mismatches)
        return lines


def default_free_knobs(cluster: ClusterSpec, runs: Sequence[RunSample],
                       collectives: Sequence[CollectiveSample] = (), regions: Sequence[RegionSample] = (),
                       host_ops: Sequence[HostOpSample] = ()) -> list[str]:
    """The knobs the data can plausibly inform: the inter-node level only when some run or sample spans nodes,
    the oversubscription wait only when the cluster's cores are known and some run oversubscribes them, the
    checkpoint region's host time when it was benchmarked or some run on a CPU cluster recomputes."""
    free = ["matmul_max_efficiency", "matmul_half_dim", "attention_efficiency", "memory_efficiency",
            "kernel_launch_us", "intra_latency_us", "intra_bandwidth_gbps"]
    if any(r.parallel.tp > 1 for r in runs):
        free.append("tp_op_overhead_us")
    if any(parameter_kind(tp=r.parallel.tp, zero=r.parallel.zero, dp_cp=r.parallel.dp * r.parallel.cp) != "plain"
           for r in runs):
        free.append("dtensor_param_us")
    if any(r.parallel.zero >= 1 and r.parallel.dp * r.parallel.cp > 1 for r in runs):
        free.append("fsdp_collective_overhead_us")
    if any(_fsdp_hooked(r.parallel) for r in runs):
        free.append("fsdp_hook_us")
    if (cluster.cores_per_node is not None and any(r.parallel.pp > 1 for r in runs)) \
            or any(h.knob == "pipeline_action_us" for h in host_ops):
        free.append("pipeline_action_us")  # priced where the host is the critical path (estimate.pipeline_action_time)
    if regions or (cluster.cores_per_node is not None and any(_recomputes(r) for r in runs)):
        free += ["recompute_region_us", "recompute_op_us"]
    if any(r.world > cluster.gpus_per_node for r in runs) or any(c.level == "inter" for c in collectives):
        free += ["inter_latency_us", "inter_bandwidth_gbps"]
    cores = cluster.cores_per_node
    if cores is not None and (any(min(r.world, cluster.gpus_per_node) > cores for r in runs)
                              or any(c.processes_per_node > cores for c in collectives)):
        free.append("oversubscription_wait_us")
        if runs:
            free += ["step_wait_us", "skew_wait_us"]
    return free


def _recomputes(r: RunSample) -> bool:
    """Whether run `r` checkpoints anything (its layout's stages, else its configuration)."""
    if r.layout is not None:
        return any(rec != "none" for _, rec, _ in r.layout)
    return r.parallel.recompute != "none"


def _fsdp_hooked(cfg: ParallelConfig) -> bool:
    """Whether the runtime puts FSDP2 hooks on the model: fully_shard at ZeRO>=1, replicate at ZeRO-0 under
    tensor parallelism (`uses_replicate`; runtime.parallelize.apply_dp), over more than one data-parallel rank.
    Pipelined ZeRO-0 stages without tp are torch's DDP: no hooks."""
    return uses_fsdp2(tp=cfg.tp, zero=cfg.zero, dp_cp=cfg.dp * cfg.cp)


def fit_cluster(cluster: ClusterSpec, runs: Sequence[RunSample] = (), gemms: Sequence[GemmSample] = (),
                collectives: Sequence[CollectiveSample] = (), regions: Sequence[RegionSample] = (), *,
                host_ops: Sequence[HostOpSample] = (), free: Sequence[str] | None = None,
                prior_weight: float = 1e-3, profiles: dict[str, list[LayerProfile]] | None = None,
                max_evaluations: int = 400, hold_undetermined: bool = True) -> FitResult:
    """Least-squares refit of `free` knobs of `cluster` to the measurements (see the module docstring).

    `profiles` maps a model name to its captured LayerProfiles (models that are not analytic specs); others are
    profiled from their spec. With `hold_undetermined` (the default) a knob the data hardly see, and all but the
    best-seen member of a group the data see only in combination, are held at their starting values and the
    rest refit: a knob no measurement constrains would otherwise wander to wherever the optimiser stopped
    (session 5 saw memory_efficiency 961 and attention_efficiency 0.008 from 7 runs for 9 knobs), and the held-out
    layouts that do use it would pay. Raises SpecError when there is nothing to fit.
    """
    if not (runs or gemms or collectives or regions or host_ops):
        raise SpecError("nothing to fit", "no runs and no micro-benchmarks", "measure some runs first")
    free = list(free if free is not None else default_free_knobs(cluster, runs, collectives, regions, host_ops))
    problem = _Problem(cluster, runs, gemms, collectives, prior_weight, profiles, max_evaluations, regions, host_ops)
    first = problem.solve(free)
    undetermined, collinear = first.undetermined, first.collinear
    fitted, held = first, []
    while hold_undetermined:
        hold = set(fitted.undetermined) | {k for g in fitted.collinear for k in _all_but_best(g, fitted.sens)}
        if not hold:
            break
        keep = [k for k in fitted.free if k not in hold]
        if not keep:
            break
        refitted = problem.solve(keep)
        if not _explains_as_well(refitted, fitted):
            break  # the identifiability test is linear at the solution; the data did need one of these knobs
        held += sorted(hold)
        fitted = refitted
    start = knob_values(cluster)
    after = {k: fitted.after.get(k, start[k]) for k in free}
    refit = with_knobs(cluster, {k: fitted.after[k] for k in fitted.free})
    rows = problem.rows(fitted)
    return FitResult(cluster=refit, before={k: start[k] for k in free}, after=after, free=free,
                     undetermined=undetermined, collinear=collinear, held=held, rows=rows, cost=fitted.cost,
                     evaluations=first.evaluations + (fitted.evaluations if fitted is not first else 0))


# Residuals (log-ratios) beyond this are weighed linearly, not squared (`_Problem.solve`): about the launch-to-launch
# spread of one run on a shared host, so that one disturbed run does not set the constants.
ROBUST_SCALE = 0.1

# Holding knobs may worsen the fit by at most this fraction of its cost (plus a floor of about 1% rms log error
# over a few rows): an undetermined or collinear knob moves no prediction, so holding it costs (almost) nothing.
_HOLD_COST_SLACK, _HOLD_COST_FLOOR = 0.1, 1e-4


def _explains_as_well(refitted: _Solved, fitted: _Solved) -> bool:
    """Whether the fit with knobs held explains the data (nearly) as well as the one without. The hold test is
    the Jacobian at the solution, and the model takes the longer of host and device time per layer: at such a kink
    a knob can look unseen at the solution yet be the one the data need (a 2-run tune held kernel_launch_us
    that way in 1 of 6 runs, and its step-time error went from 3% to 34%)."""
    return refitted.cost <= fitted.cost * (1 + _HOLD_COST_SLACK) + _HOLD_COST_FLOOR


def _all_but_best(group: list[str], sens: dict[str, float]) -> list[str]:
    """The members of a collinear group to hold: all but the one the data move most (it carries the
    combination the data determine)."""
    best = max(group, key=lambda k: sens.get(k, 0.0))
    return [k for k in group if k != best]


@dataclass
class _Solved:
    free: list[str]
    x0: object  # numpy array: the start, log space
    x: object  # the solution, log space
    after: dict[str, float]
    sens: dict[str, float]
    undetermined: list[str]
    collinear: list[list[str]]
    cost: float
    evaluations: int


class _Problem:
    """The measurements and the cost model's predictions of them, for any set of free knobs (the others keep
    `cluster`'s values)."""

    def __init__(self, cluster, runs, gemms, collectives, prior_weight, profiles, max_evaluations, regions=(),
                 host_ops=()):
        import numpy as np

        self.cluster, self.runs, self.gemms, self.collectives = cluster, list(runs), list(gemms), list(collectives)
        self.regions, self.host_ops = list(regions), list(host_ops)
        self.prior_weight, self.max_evaluations = prior_weight, max_evaluations
        self.profs = {r.model.name: (profiles or {}).get(r.model.name) or profile_from_spec(r.model) for r in runs}
        measured = [g.seconds for g in gemms] + [c.seconds for c in collectives] + [r.seconds for r in self.regions]
        measured += [h.seconds for h in self.host_ops]
        self.n_micro = len(measured)
        # A component the cost model has no term for in this run (predicted 0: e.g. a flash attention core
        # recomputed under selective recomputation) is left out: no knob can move it.
        self.comp_keys: list[list[str]] = []
        # The pipeline stage compared is the one the starting cluster's estimate describes (its critical rank).
        for r in self.runs:
            start = predict_run(cluster, r, self.profs[r.model.name])
            comps = _components(r, start.critical_rank)
            self.comp_keys.append([k for k in comps if predicted_component(start.breakdown, k, r.parallel) > 0])
            measured.append(r.measured_step_s)
            measured.extend(comps[k] for k in self.comp_keys[-1])
        self.measured = measured
        self.meas = np.array(measured)
        self.n_data = len(measured)

    def predictions(self, values: dict[str, float], with_runs: bool = True) -> list[float]:
        cl = with_knobs(self.cluster, values)
        out = [predict_gemm(cl, g) for g in self.gemms]
        out += [predict_collective(cl, c) for c in self.collectives]
        out += [max(predict_region(cl, r), 1e-12) for r in self.regions]  # 0 where the cluster has no value
        out += [max(predict_host_op(cl, h), 1e-12) for h in self.host_ops]
        for i, r in enumerate(self.runs if with_runs else ()):
            est = predict_run(cl, r, self.profs[r.model.name])
            out.append(est.step_time_s)
            out.extend(max(predicted_component(est.breakdown, k, r.parallel), 1e-12) for k in self.comp_keys[i])
        return out

    def solve(self, free: list[str]) -> _Solved:
        """Fit `free` (stage 1 on the micro-benchmarks, stage 2 on everything from a few starts)."""
        import numpy as np
        from scipy.optimize import least_squares

        start = knob_values(self.cluster)
        # Knobs stuck at 0 (e.g. the oversubscription wait of a preset) start from a small physical value.
        starts = {"oversubscription_wait_us": 100.0, "tp_op_overhead_us": 10.0, "dtensor_param_us": 10.0,
                  "fsdp_collective_overhead_us": 1000.0,
                  "step_wait_us": 500.0, "skew_wait_us": 500.0, "fsdp_hook_us": 100.0, "recompute_region_us": 200.0,
                  "recompute_op_us": 30.0, "pipeline_action_us": 100.0}
        x0_vals = {k: start[k] if start[k] > 0 else starts.get(k, 1.0) for k in free}
        lo = np.array([math.log(KNOBS[k].lower) for k in free])
        hi = np.array([math.log(KNOBS[k].upper) for k in free])
        x0 = np.clip(np.array([math.log(x0_vals[k]) for k in free]), lo + 1e-9, hi - 1e-9)
        w = self.prior_weight

        def values(x):
            return {k: math.exp(v) for k, v in zip(free, x, strict=True)}

        def run(x_start, with_runs: bool):
            m = self.meas if with_runs else self.meas[: self.n_micro]

            def residuals(x):
                pred = np.array(self.predictions(values(x), with_runs))
                return np.concatenate([np.log(np.maximum(pred, 1e-15) / m), w * (x - x0)])

            # A robust loss (soft L1 beyond a 10% log-ratio): one run's launches differ by 12-22% here (session 18's
            # live sets), and under squares one slow run moved every constant it touches (S18c: a DDP run at 35 ms
            # where others read 19-27 raised every 4-member collective's latency; held-out error 21.7%, 17.4% so).
            return least_squares(residuals, x_start, bounds=(lo, hi), method="trf", x_scale="jac", diff_step=1e-6,
                                 ftol=1e-12, xtol=1e-10, gtol=1e-12, max_nfev=self.max_evaluations,
                                 loss="soft_l1", f_scale=ROBUST_SCALE)

        # Stage 1: the primitives alone (GEMM curve, alpha/beta per level) from the micro-benchmarks.
        x1, nfev, sol = x0, 0, None
        if self.n_micro:
            sol = run(x0, with_runs=False)
            x1, nfev = sol.x, sol.nfev
        # Stage 2: everything, from a few starts. The model takes the longer of host and device time per layer
        # and simulates the pipeline, so the objective has kinks where a trust region can stall; restarting with
        # the host-side and device-side knobs scaled apart finds the basin the data point to.
        if self.runs:
            sol = None
            for start_scale in _STARTS:
                xs = np.array(x1, dtype=float)
                for i, k in enumerate(free):
                    if k in start_scale:
                        xs[i] = min(max(xs[i] + math.log(start_scale[k]), lo[i] + 1e-9), hi[i] - 1e-9)
                cand = run(xs, with_runs=True)
                nfev += cand.nfev
                if sol is None or cand.cost < sol.cost - 1e-15:
                    sol = cand
                if sol.cost < 1e-10 + 0.5 * (w**2) * float(((sol.x - x0) ** 2).sum()) * 1.01:
                    break  # the data are explained exactly: no other start can do better
        # Identifiability: how much the data rows (not the prior) move with each knob, in log units.
        jac = np.asarray(sol.jac)[: self.n_data]
        sens = np.sqrt((jac**2).sum(axis=0)) if self.n_data else np.zeros(len(free))
        undetermined = [k for k, s in zip(free, sens, strict=True) if s < _MIN_SENSITIVITY]
        collinear = _collinear_groups(jac, sens, free, undetermined)
        return _Solved(free=free, x0=x0, x=sol.x, after=values(sol.x), sens=dict(zip(free, sens, strict=True)),
                       undetermined=undetermined, collinear=collinear, cost=float(sol.cost), evaluations=int(nfev))

    def rows(self, s: _Solved) -> list[dict]:
        before = self.predictions({})  # the cluster as given
        after = self.predictions(s.after)
        return _rows(self.gemms, self.collectives, self.runs, self.comp_keys, self.measured, before, after,
                     self.regions, self.host_ops)


# A knob whose data rows move by less than this (root-sum-square of d log(predicted) / d log(knob)) is reported
# as undetermined: a 10% change of it would move the predictions by under 0.1% in total.
_MIN_SENSITIVITY = 0.01


def _collinear_groups(jac, sens, free: list[str], undetermined: list[str]) -> list[list[str]]:
    """Knobs the data see only in combination: directions of the column-normalised Jacobian with a small
    singular value (a change along them moves no prediction), named by the knobs that make them up."""
    import numpy as np

    keep = [i for i, k in enumerate(free) if k not in undetermined]
    if len(keep) < 2 or jac.shape[0] == 0:
        return []
    jn = jac[:, keep] / sens[keep]
    # full_matrices: with fewer rows than knobs the null space is not among the reduced SVD's directions; its
    # directions move no prediction at all (singular value 0)
    _, sv, vt = np.linalg.svd(jn, full_matrices=True)
    sv = np.concatenate([sv, np.zeros(vt.shape[0] - len(sv))])
    groups = []
    for value, vec in zip(sv, vt, strict=True):
        if value < _MIN_SINGULAR:
            names = [free[keep[j]] for j in np.flatnonzero(np.abs(vec) > 0.3)]
            if len(names) >= 2:
                groups.append(names)
    return groups


# A direction of the normalised Jacobian whose singular value is below this is not determined by the data.
_MIN_SINGULAR = 0.02

# Starting points of stage 2, as factors on the stage-1 values: as measured, host-bound, device-bound.
_STARTS: tuple[dict[str, float], ...] = (
    {},
    {"kernel_launch_us": 3.0, "attention_efficiency": 3.0, "memory_efficiency": 3.0, "tp_op_overhead_us": 3.0},
    {"kernel_launch_us": 1 / 3, "attention_efficiency": 1 / 3, "memory_efficiency": 1 / 3,
     "tp_op_overhead_us": 1 / 3},
    {"kernel_launch_us": 3.0},
    {"kernel_launch_us": 1 / 3},
)


# The components a run's measured time is split into (autoplan.tune.records.component_seconds), each the sum of
# the estimate's breakdown entries that predict it: a pipeline rank's waits for its neighbours are its pp_comm
# and its bubble at once.
COMPONENTS: dict[str, tuple[str, ...]] = {
    "compute": ("compute",), "recompute": ("recompute",), "tp_cp_ep_comm": ("tp_cp_ep_comm",),
    "dp_comm": ("dp_comm",), "pp_wait": ("pp_comm", "bubble"),
    # the runtime all-reduces a tied embedding's gradients in the step tail it times as "optimizer"
    # (runtime/engine.py _finalize_grads inside STEP_TAIL; autoplan.tune.records.component_seconds)
    "optimizer": ("optimizer", "embedding_comm"),
}
# A component below this share of its run's measured step is not a row: a few milliseconds of a wait or a tail
# are mostly scheduling noise on a shared host, and a log-ratio would weigh them like the step itself.
_MIN_COMPONENT_SHARE = 0.03


def predicted_component(breakdown: dict[str, float], name: str, cfg: ParallelConfig | None = None) -> float:
    """The estimate's prediction of measured component `name` of a run of `cfg`. Under torch's DDP (the runtime's
    data parallelism without ZeRO or tensor parallelism, pipelined or not: runtime.parallelize.apply_ddp) the
    gradient all-reduces are waited for from C++ inside backward (under a pipeline, the last micro-batch's), where
    the step timer cannot tell them apart: the measured compute holds the exposed gradient reduction too (dp_comm
    is measured 0 there)."""
    keys = COMPONENTS[name]
    if name == "compute" and cfg is not None and _torch_ddp(cfg):
        keys = keys + ("dp_comm",)
    return sum(breakdown.get(k, 0.0) for k in keys)


def _torch_ddp(cfg: ParallelConfig) -> bool:
    return uses_torch_ddp(tp=cfg.tp, zero=cfg.zero, dp_cp=(cfg.dp or 1) * cfg.cp)  # dp: None before resolution


def _components(r: RunSample, stage: int = 0) -> dict[str, float]:
    """The measured time components of a run that the cost model predicts, above _MIN_COMPONENT_SHARE: those of
    pipeline stage `stage` when they were recorded per stage."""
    if r.components is None:
        return {}
    floor = _MIN_COMPONENT_SHARE * r.measured_step_s
    seconds = r.components.by_stage.get(stage, r.components.seconds)
    return {k: v for k, v in sorted(seconds.items()) if k in COMPONENTS and v > floor}


def _rows(gemms, collectives, runs, comp_keys, measured, before, after, regions=(), host_ops=()) -> list[dict]:
    labels = [("gemm", f"gemm {g.m}x{g.n}x{g.k}") for g in gemms]
    labels += [("collective", f"{c.collective} {c.level} x{c.ranks} {c.nbytes / 1024:.0f} KiB") for c in collectives]
    labels += [("region", f"checkpoint region of {r.ops} ops, {r.processes} process(es)") for r in regions]
    labels += [("host", f"host time per {'operator' if h.knob == 'kernel_launch_us' else 'pipeline action'}, "
                        f"{h.processes} process(es)") for h in host_ops]
    for r, keys in zip(runs, comp_keys, strict=True):
        labels.append(("run", r.label or r.parallel.to_string()))
        labels.extend(("component", f"{r.label or r.parallel.to_string()} {k}") for k in keys)
    return [{"kind": kind, "label": label, "measured": m, "before": b, "after": a}
            for (kind, label), m, b, a in zip(labels, measured, before, after, strict=True)]


# ----------------------------------------------------------------------------------- the cluster file


def cluster_yaml(cluster: ClusterSpec, header: Sequence[str] = ()) -> str:
    """The cluster as a YAML file that `--cluster FILE` loads, with `header` as a comment block."""
    import yaml

    body = yaml.safe_dump(cluster.model_dump(mode="json", exclude_none=True), sort_keys=False)
    head = "".join(f"# {line}\n" for line in header)
    return head + body
