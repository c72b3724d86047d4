"""`autoplan tune`: measure the search's best candidates (and a few deliberately different ones), refit the
cluster's constants to the measurements, and choose the plan by measurement.

The procedure:
1. **Candidates.** The search's `top` best plans, then `diverse` more, each the best plan the search finds with
   one knob pinned away from the leaders (`DIVERSE_PINS`: tensor parallel at two micro-batch sizes,
   data-parallel-only ZeRO-2, pipeline parallel, full recomputation, ZeRO-3, sequence parallel, one sequence per
   micro-batch, pure data parallel), so that every term of the cost model is exercised by a run.
2. **Measure.** Each candidate runs for real (`torchrun -m autoplan.runtime.train`, `--steps N`, `--log`), with
   `--profile-step` when the runtime supports it (detected from its source, without importing torch) on the
   first steady step (`profile_step_for`); the median step time of the steps after it is the measurement.
   Candidates are run until `--budget` seconds would be exceeded by the next (judged from the runs so far);
   Ctrl-C stops the current run and keeps the others.
   With `--repeats R` the measured candidates are launched again, up to R launches each (each pass in the
   reverse order of the one before, while the budget lasts), and each keeps its fastest launch: on a shared
   host, interference from other processes only slows a run down.
3. **Refit.** `autoplan.cost_models.fit.fit_cluster` on the measured runs (and the micro-benchmarks of
   `autoplan calibrate --bench`, when given), starting from the given cluster.
4. **Choose.** The measured fastest candidate; the search is re-run with the refit cluster, and its choice is
   reported beside (a plan nobody measured is flagged as such). Where the refit model prices the search's
   finalists closer together than its own error on the tuned runs, it cannot order them, and tune's
   measurements do (`choose_by_measurement`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from autoplan.cost_models.errors import AutoplanError, ConfigError, DoesNotFitError, SpecError
from autoplan.cost_models.fit import (
    CollectiveSample,
    FitResult,
    GemmSample,
    HostOpSample,
    RegionSample,
    RunSample,
    TimedComponents,
    fit_cluster,
)
from autoplan.cost_models.specs import ClusterSpec, ModelSpec, TrainingSpec

from .records import RunLog, read_run_log, warmup_before

# Knob pins that make a candidate deliberately different from the leaders, in the order they are tried. Each
# is a function of the world size and the plans chosen so far (their ParallelConfigs), returning the pins or None
# (nothing to add). The order covers first what the cost model has separate terms for and the leaders seldom
# exercise: tensor parallelism at two micro-batch counts (its host overhead is paid per micro-batch and per
# step, and one run cannot tell the two apart), data-parallel-only ZeRO (FSDP's per-unit gathers and scatters),
# pipeline parallelism, full recomputation, ZeRO-3, then the rest.
PinFn = Callable[[int, list], "dict[str, str] | None"]


def _tp_other_mbs(world: int, chosen: list) -> dict[str, str] | None:
    """Tensor parallel at a micro-batch size no tensor-parallel plan chosen so far has."""
    seen = {c.mbs for c in chosen if c.tp > 1}
    if not seen:
        return {"tp": "2", "mbs": "1"}
    for mbs in (1, 2, 4, 8):
        if mbs not in seen:
            return {"tp": "2", "mbs": str(mbs)}
    return None


DIVERSE_PINS: tuple[tuple[str, PinFn], ...] = (
    ("tp", lambda w, chosen: {"tp": "2"}),
    ("tp, other mbs", _tp_other_mbs),
    ("zero-2, dp only", lambda w, chosen: {"tp": "1", "pp": "1", "cp": "1", "zero": "2"}),
    ("pp", lambda w, chosen: {"pp": "2"}),
    ("recompute", lambda w, chosen: {"recompute": "full"}),
    ("zero-3, dp only", lambda w, chosen: {"tp": "1", "pp": "1", "cp": "1", "zero": "3"}),
    ("sp", lambda w, chosen: {"tp": "2", "sp": "1"}),
    ("mbs", lambda w, chosen: {"mbs": "1"}),
    ("dp", lambda w, chosen: {"dp": str(w)}),
    ("tp+pp", lambda w, chosen: {"tp": "2", "pp": "2"}),
)


@dataclass
class Candidate:
    """One plan to measure: why it was picked, and what happened when it ran."""

    plan: object  # autoplan.plan.Plan
    why: str
    measured_s: float | None = None
    log: RunLog | None = None
    error: str | None = None
    wall_s: float = 0.0
    predicted_after_s: float | None = None
    launches: list[float] = field(default_factory=list)  # the measured step time of every launch, in order

    @property
    def config(self) -> str:
        return self.plan.parallel.to_string()

    @property
    def predicted_before_s(self) -> float:
        return self.plan.prediction.step_time_s


@dataclass
class TuneResult:
    candidates: list[Candidate]
    fit: FitResult | None
    interrupted: bool = False
    refit_choice: str | None = None  # the configuration the search picks with the refit cluster
    refit_choice_measured_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def measured(self) -> list[Candidate]:
        return [c for c in self.candidates if c.measured_s is not None]

    @property
    def fastest(self) -> Candidate | None:
        return min(self.measured, key=lambda c: c.measured_s, default=None)

    @property
    def spread(self) -> float | None:
        """How far apart launches of one candidate measured: the median over repeated candidates of
        max / min - 1 (`launch_spread`); None when no candidate was launched twice (`--repeats 1`)."""
        return launch_spread([c.launches for c in self.measured])

    def ties(self) -> list[Candidate]:
        """The other measured candidates within the launches' spread of the fastest: on this machine their order
        against it is not measured, only guessed (interference moves one launch by that much). Empty without a
        spread."""
        best, spread = self.fastest, self.spread
        if best is None or spread is None:
            return []
        return [c for c in self.measured if c is not best and c.measured_s <= best.measured_s * (1 + spread)]

    def as_json(self) -> dict:
        fastest = self.fastest
        return {
            "interrupted": self.interrupted,
            "candidates": [{"parallel": c.config, "plan": c.plan.short_hash, "why": c.why,
                            "predicted_before_s": c.predicted_before_s, "predicted_after_s": c.predicted_after_s,
                            "measured_step_time_s": c.measured_s, "launches_s": c.launches, "error": c.error,
                            "wall_s": c.wall_s}
                           for c in self.candidates],
            "fastest": fastest.config if fastest else None,
            "launch_spread": self.spread,
            "ties_with_fastest": [c.config for c in self.ties()],
            "refit_choice": self.refit_choice,
            "refit_choice_measured_s": self.refit_choice_measured_s,
            "fit": None if self.fit is None else {
                "before": self.fit.before, "after": self.fit.after, "undetermined": self.fit.undetermined,
                "collinear": self.fit.collinear, "held": self.fit.held,
                "mean_abs_error_before": self.fit.mean_abs_error("run", "before"),
                "mean_abs_error_after": self.fit.mean_abs_error("run"),
                "count_mismatches": self.fit.count_mismatches},
            "notes": self.notes,
        }


# ------------------------------------------------------------------------------------------ candidates


def select_candidates(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, top: int, diverse: int,
                      profiles=None, fix: dict[str, str] | None = None, kernels: str = "torch",
                      seed_plan=None, source=None) -> list[Candidate]:
    """The search's `top` best plans plus up to `diverse` plans each pinning one knob away from them. `source`:
    the model reference the user gave (autoplan.models.source.attach): each plan records it, so the runs build
    the user's own module or Hugging Face architecture, as `autoplan run` would, not the zoo model of its spec."""
    from autoplan.api import plan_from_estimate
    from autoplan.models.source import attach, with_model_of
    from autoplan.search.core import search

    def planned(est):
        """The plan of a search result, training the user's model: `source`, else the seed plan's."""
        plan = plan_from_estimate(model, cluster, training, est, kernels=kernels)
        if source is not None:
            return attach(plan, source, profiles)
        return with_model_of(plan, seed_plan) if seed_plan is not None else plan

    training = training.model_copy(update={"kernels": kernels})
    out: list[Candidate] = []
    seen: set[str] = set()

    def key(plan) -> str:
        return plan.parallel.to_string() + repr([s.layers for s in plan.stages])

    def add(plan, why: str) -> None:
        if key(plan) not in seen:
            seen.add(key(plan))
            out.append(Candidate(plan=plan, why=why))

    if seed_plan is not None:
        add(seed_plan, "the given plan")
    res = search(model, cluster, training, profiles=profiles, fix=fix, top=max(1, top), kernels=kernels)
    for i, f in enumerate(res.finalists[:top]):
        add(planned(f.estimate), f"search #{i + 1}")
    want = len(out) + diverse
    for name, pin_fn in DIVERSE_PINS:
        if len(out) >= want:
            break
        pin = pin_fn(cluster.num_gpus, [c.plan.parallel for c in out])
        if pin is None:
            continue
        pins = {**(fix or {}), **pin}
        try:
            r = search(model, cluster, training, profiles=profiles, fix=pins, top=3, kernels=kernels)
        except (ConfigError, DoesNotFitError, SpecError):
            continue  # that knob cannot move here (too few GPUs, heads, layers or memory)
        # the best plan with the pin that is not measured already
        for f in r.finalists[:3]:
            plan = planned(f.estimate)
            if key(plan) not in seen:
                add(plan, f"different: {name}")
                break
    return out


# ---------------------------------------------------------------------------------------------- running


def runtime_supports(flag: str = "--profile-step") -> bool:
    """Whether this autoplan's runtime accepts `flag` (read from its source: no torch import)."""
    spec = importlib.util.find_spec("autoplan.runtime.train")
    if spec is None or not spec.origin:
        return False
    try:
        return flag in Path(spec.origin).read_text()
    except OSError:
        return False


def profile_step_for(steps: int) -> int:
    """The step tune profiles (counts, memory): step 3, the first steady one -- during step 2 torch's DDP
    rebuilds its gradient buckets and broadcasts their order from rank 0, a collective of no other step, which
    the counts would report as a mismatch with the model -- when at least two steps follow it; else step 2."""
    return 3 if steps >= 5 else min(2, steps)


def runtime_supports_profile_step() -> bool:
    return runtime_supports("--profile-step")


def run_candidate(c: Candidate, workdir: Path, *, steps: int, profile_step: int | None,
                  timeout_s: float | None = None, time_from: int | None = None,
                  memory_step: int | None = None) -> None:
    """Run `c.plan` under torchrun for `steps` steps; fills `c.measured_s`/`c.log` or `c.error`. `time_from`:
    split the steps from that one on into time components (the runtime's --time-from). `memory_step`: the step
    the runtime measures memory on (CPU; default the profiled step, else step 3); it is left out of the
    measurement like the profiled one."""
    from autoplan.models.source import TRUSTED_MODULE_ENV, plan_module
    from autoplan.runtime.launch import ROOT, torchrun_command

    plan_path = c.plan.save(workdir / f"plan-{c.plan.short_hash}.json")
    log_path = workdir / f"log-{c.plan.short_hash}.jsonl"
    args = ["--steps", str(steps), "--log", str(log_path), "--quiet"]
    if profile_step is not None:
        args += ["--profile-step", str(profile_step)]
    if time_from is not None:
        args += ["--time-from", str(time_from)]
    if memory_step is not None:
        args += ["--memory-step", str(memory_step)]
    cmd = torchrun_command(plan_path, c.plan.world_size, args)
    env = dict(os.environ)
    module = plan_module(c.plan)
    if module:  # the user named it (tune: its --model, or the seed plan checked by check_module_trusted)
        env[TRUSTED_MODULE_ENV] = module
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    # A session of its own, so that Ctrl-C reaches tune first and tune stops the whole launch (torchrun and its
    # workers) by process group.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except (KeyboardInterrupt, subprocess.TimeoutExpired) as e:
        stop_launch(proc)
        c.wall_s = time.perf_counter() - t0
        if isinstance(e, KeyboardInterrupt):
            c.error = "interrupted"
            raise
        c.error = f"timed out after {timeout_s:.0f} s"
        return
    c.wall_s = time.perf_counter() - t0
    if proc.returncode != 0 or not log_path.exists():
        tail = [ln for ln in (err or "").splitlines() if ln.strip()]
        c.error = (tail[-1] if tail else f"exit code {proc.returncode}")[:200]
        return
    try:
        c.log = read_run_log(log_path)
        # the steps before the profiled one are warm-up (DDP's bucket rebuild in step 2 among them); without a
        # profiled step, step 1 alone
        c.measured_s = c.log.measured_step_s(warmup=warmup_before(profile_step))
    except (AutoplanError, ValueError) as e:
        c.error = str(e)[:200]


def relaunch(c: Candidate, workdir: Path, **kw) -> None:
    """Launch measured candidate `c` once more (`run_candidate`'s keywords); it keeps the faster launch's step
    time and log, so its time components stay those of the run its time is. A failed relaunch changes nothing
    but is noted in `c.launches` as nothing."""
    again = Candidate(plan=c.plan, why=c.why)
    sub = workdir / f"launch-{len(c.launches) + 1}"
    sub.mkdir(parents=True, exist_ok=True)
    try:
        run_candidate(again, sub, **kw)
    finally:
        c.wall_s = again.wall_s
    if again.measured_s is None:
        return
    c.launches.append(again.measured_s)
    if c.measured_s is None or again.measured_s < c.measured_s:
        c.measured_s, c.log = again.measured_s, again.log


def launch_spreads(groups) -> list[float]:
    """For each group of launch times of one plan with at least two (None entries, failed launches, left out),
    max / min - 1: how far apart repeated launches measured."""
    return [max(g) / min(g) - 1 for g in ([t for t in g if t] for g in groups) if len(g) >= 2]


def launch_spread(groups) -> float | None:
    """The machine's run-to-run noise as repeated launches show it: the median of `launch_spreads`; None when no
    plan was launched twice."""
    spreads = launch_spreads(groups)
    return statistics.median(spreads) if spreads else None


def stop_launch(proc: subprocess.Popen) -> None:
    """Stop a torchrun launch we started in its own session (`start_new_session`): SIGTERM to its process group,
    which torchrun forwards to its workers (each in a session of its own, out of reach of the group), then SIGKILL
    to the group if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -------------------------------------------------------------------------------------------------- fit


def run_sample(c: Candidate) -> RunSample:
    """The fit's view of a measured candidate (its time components when the profile recorded some)."""
    plan = c.plan
    comps = None
    if c.log is not None:
        t = c.log.time_components()
        comps = TimedComponents(seconds=t, by_stage=c.log.stage_components()) if t else None
    layout = [((s.layers[0], s.layers[1]), s.recompute, s.recompute_layers) for s in plan.stages]
    training = plan.training.model_copy(update={"kernels": "torch" if plan.kernels == "torch" else "fused"})
    return RunSample(model=plan.model, training=training, parallel=plan.parallel, world=plan.world_size,
                     layout=layout, measured_step_s=c.measured_s or 1.0,  # 1.0: not measured (prediction only)
                     components=comps, label=c.config)


# the device `autoplan calibrate` measures on for each backend a cluster runs (calibrate.run_bench's "device")
BENCH_DEVICE = {"gloo": "cpu", "nccl": "cuda"}
# a GPU family in a name: torch's device names ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB") and the presets'
# ("h100-sxm", "a100-80g", "h200") both carry it
_GPU_FAMILY = re.compile(r"(?<![a-z0-9])([abhlv]\d{2,3})(?![0-9])")


def gpu_family(name: str | None) -> str | None:
    """'h100' from 'NVIDIA H100 80GB HBM3' or 'h100-sxm'; None where no family can be read."""
    m = _GPU_FAMILY.search((name or "").lower())
    return m.group(1) if m else None


def load_bench(paths, backend: str | None = None, gpu_name: str | None = None) -> tuple[
        list[GemmSample], list[CollectiveSample], list[RegionSample], list[HostOpSample]]:
    """Micro-benchmarks written by `autoplan calibrate --bench-out FILE` (JSON: {"gemm": [...], "collectives":
    [...], "recompute": [...], "host_op": [...]}); `paths` is one file, several (e.g. one per process count), or
    None. With `backend` and `gpu_name` (the cluster's), a file measured on another kind of device, or on another
    GPU family where both names say one, is refused: its GEMM rates and host times would be fitted into this
    cluster's constants (session 23: a GPU's file on local-cpu set matmul_max_efficiency to its bound, 1000)."""
    if paths is None:
        return [], [], [], []
    gemms: list[GemmSample] = []
    colls: list[CollectiveSample] = []
    regions: list[RegionSample] = []
    host_ops: list[HostOpSample] = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        p = Path(path)
        if not p.exists():
            raise SpecError(f"no micro-benchmark file {str(p)!r}", "",
                            "write one with `autoplan calibrate --bench-out FILE`")
        try:
            data = json.loads(p.read_text())
            measured_on = data.get("device") if isinstance(data, dict) else None
            expected = BENCH_DEVICE.get(backend or "")
            if expected is not None and measured_on is not None and measured_on != expected:
                raise SpecError(f"micro-benchmark file {str(p)!r} was measured on {measured_on!r}",
                                f"the cluster runs {backend}, on {expected!r} devices",
                                "measure on this cluster's own hardware with `autoplan calibrate --bench-out FILE`, "
                                "or leave --bench out")
            chip, want = gpu_family(data.get("device_name") if isinstance(data, dict) else None), gpu_family(gpu_name)
            if chip is not None and want is not None and chip != want:
                raise SpecError(f"micro-benchmark file {str(p)!r} was measured on a {data['device_name']}",
                                f"the cluster's GPUs are {gpu_name!r}",
                                "measure on this cluster's own GPUs with `autoplan calibrate --bench-out FILE`, "
                                "or leave --bench out")
            gemms += [GemmSample.model_validate(g) for g in data.get("gemm", [])]
            colls += [CollectiveSample.model_validate(c) for c in data.get("collectives", [])]
            regions += [RegionSample.model_validate(r) for r in data.get("recompute", [])]
            host_ops += [HostOpSample.model_validate(h) for h in data.get("host_op", [])]
        except (ValueError, TypeError, AttributeError) as e:
            raise SpecError("malformed micro-benchmark file", f"{p}: {str(e).splitlines()[0]}",
                            "re-run `autoplan calibrate --bench-out FILE`") from None
    return gemms, colls, regions, host_ops


def prepare_cluster(cluster: ClusterSpec) -> ClusterSpec:
    """On a gloo cluster of one node whose cores are not given, take this machine's cores (tune runs here)."""
    if cluster.backend == "gloo" and cluster.cores_per_node is None and cluster.num_nodes == 1:
        return cluster.model_copy(update={"cores_per_node": len(os.sched_getaffinity(0))})
    return cluster


def refit(cluster: ClusterSpec, candidates: list[Candidate],
          bench: tuple[list, list, list, list] = ([], [], [], []), profiles=None) -> FitResult | None:
    """Fit the cluster to the measured candidates (and micro-benchmark rows); fills each candidate's
    predicted-after."""
    from autoplan.cost_models.fit import predict_run

    measured = [c for c in candidates if c.measured_s is not None]
    gemms, colls, regions, host_ops = bench  # load_bench's rows
    if not measured and not (gemms or colls or regions or host_ops):
        return None
    samples = [run_sample(c) for c in measured]
    prof = {measured[0].plan.model.name: profiles} if profiles and measured else None
    res = fit_cluster(cluster, samples, gemms, colls, regions, host_ops=host_ops, profiles=prof)
    for c in measured:
        if c.log is not None and c.log.profile is not None:
            res.count_mismatches.extend(f"{c.config}: {routing_note(m, c.plan)}"
                                        for m in c.log.profile.count_mismatches())
    for c in candidates:
            c.predicted_after_s = predict_run(res.cluster, run_sample(c), profiles).step_time_s
    return res


def routing_note(mismatch: str, plan) -> str:
    """A count mismatch of `plan` (an autoplan.plan.Plan), marked where a mixture of experts makes it expected: a
    rank's FLOPs and its expert all-to-all bytes follow how many tokens the router sent its experts in the
    profiled step, and the model assumes an even share (measured up to ~4% apart per rank on tiny-moe, session
    14)."""
    routed = plan.model.moe is not None and (" flops." in mismatch or "all_to_all@ep " in mismatch)
    return mismatch + " (expert routing: the model assumes an even share per expert)" if routed else mismatch


def tune(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, top: int = 3, diverse: int = 3,
         steps: int = 8, budget_s: float = 600.0, profiles=None, fix: dict[str, str] | None = None,
         kernels: str = "torch", seed_plan=None, bench: str | Path | None = None, workdir: Path | None = None,
         progress: Callable[[str, int, int], None] | None = None, run_timeout_s: float | None = None,
         repeats: int = 1, source=None, trusted_module: str | None = None) -> TuneResult:
    """The whole loop (see the module docstring). Ctrl-C while measuring keeps what was measured. `source`: the
    model reference the user gave (`select_candidates`); `trusted_module`: the module:factory they named, the only
    one a run may import (a seed plan naming another is refused: autoplan.models.source.check_module_trusted)."""
    from autoplan.models.source import check_module_trusted, plan_module, planner_pins

    bench_rows = load_bench(bench, cluster.backend, cluster.gpu.name)  # a bad or foreign file fails now
    cluster = prepare_cluster(cluster)
    if seed_plan is not None:  # before anything imports the module it names
        check_module_trusted(seed_plan, trusted_module, "name the module with --model as well, if you trust that code")
    pin_ref = source if source is not None else (plan_module(seed_plan) if seed_plan is not None else None)
    if pin_ref is not None:  # what the runtime would refuse for this module, as search pins it
        fix = {**{k: v for k, v in planner_pins(pin_ref).items() if k not in (fix or {})}, **(fix or {})}
    # every candidate trains `source` (the user's own --model) or the checked seed plan's model
    cands = select_candidates(model, cluster, training, top=top, diverse=diverse, profiles=profiles, fix=fix,
                              kernels=kernels, seed_plan=seed_plan, source=source)
    profile_step = profile_step_for(steps) if runtime_supports_profile_step() else None
    # the steps after the warm-up and the profiled one are split into time components (cheap: they run at speed)
    time_from = (profile_step or 1) + 1 if runtime_supports("--time-from") and steps > 2 else None
    result = TuneResult(candidates=cands, fit=None)
    if time_from is None:
        result.notes.append("no timed steps (--time-from): the fit uses step times and micro-benchmarks only")
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="autoplan-tune-")
        workdir = Path(tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    old_term = _term_as_interrupt()
    try:
        walls: list[float] = []  # seconds per launch so far: the next launch is expected to take the longest

        def over_budget() -> bool:
            return len(walls) >= 2 and time.perf_counter() - t_start + max(walls) > budget_s

        for i, c in enumerate(cands):
            if over_budget():
                for rest in cands[i:]:
                    rest.error = "skipped: over --budget"
                break
            if progress:
                progress(f"running {c.config.split(',schedule')[0]}", i, len(cands))
            run_candidate(c, workdir, steps=steps, profile_step=profile_step, timeout_s=run_timeout_s,
                          time_from=time_from)
            walls.append(c.wall_s)
            if c.measured_s is not None:
                c.launches.append(c.measured_s)
        for rep in range(1, repeats):
            again = [c for c in cands if c.measured_s is not None]
            for c in (again[::-1] if rep % 2 else again):
                if over_budget():
                    break
                if progress:
                    progress(f"again ({rep + 1}/{repeats}) {c.config.split(',schedule')[0]}", rep, repeats)
                relaunch(c, workdir, steps=steps, profile_step=profile_step, timeout_s=run_timeout_s,
                         time_from=time_from)
                walls.append(c.wall_s)
    except KeyboardInterrupt:
        result.interrupted = True
        for c in cands:
            if c.measured_s is None and c.error is None:
                c.error = "not run: interrupted"
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if tmp is not None:
            tmp.cleanup()
    result.fit = refit(cluster, cands, bench_rows, profiles)
    if result.fit is not None:
        note = peak_raise_note(result.fit, cluster, training.dtype, bool(bench_rows[0]))
        if note:
            result.notes.append(note)
        _refit_choice(result, model, training, profiles, fix, kernels)
    return result


# A refit peak this many times the start's is not a rate the runs measured: tune's launches differ by 10-30% and a
# calibrated peak is the best GEMM rate measured, so 1.5x is beyond both.
PEAK_RAISE_WARN = 1.5


def peak_raise_note(fit: FitResult, cluster: ClusterSpec, dtype: str, had_gemm_bench: bool) -> str | None:
    """Say so when the refit raised the compute peak far past the start's: a GEMM efficiency above 1 (often the
    collinear pair matmul_max_efficiency / matmul_half_dim fitted to small GEMMs only, which the step times cannot
    tell apart) becomes a peak no run measured. Predictions for the measured layouts are fine; MFU against that
    peak is not comparable, and GEMMs larger than the runs' are priced by extrapolation."""
    factor = fit.peak_raise
    if factor < PEAK_RAISE_WARN:
        return None
    start = cluster.gpu.peak_flops(dtype) / 1e12
    fix = ("the GEMM micro-benchmarks given (--bench) did not pin it: calibrate them at the model's shapes "
           "(`autoplan calibrate --model M --bench-out bench.json`)" if had_gemm_bench else
           "GEMM micro-benchmarks pin it: `autoplan calibrate --model M --bench-out bench.json`, then tune with "
           "--bench bench.json")
    return (f"the refit raises the {dtype} peak {factor:.1f}x ({start:g} -> {start * factor:.3g} TF/s), a rate "
            f"these runs do not measure: their step times fit it, but MFU against the refit spec is not comparable "
            f"and GEMMs larger than the runs' are priced by extrapolation; {fix}")


def _term_as_interrupt():
    """While measuring, SIGTERM (a job scheduler, `kill`) stops like Ctrl-C: the current launch is stopped by
    process group rather than left running without its parent. Returns the previous handler (None off the main
    thread, where signals cannot be handled)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


# The search's finalists whose refit predictions are within the tie tolerance of its best are compared by
# measurement. The tolerance is the refit model's mean error on the tuned runs themselves (two plans it prices
# closer than it predicts the runs it was fitted to are not ordered by it), clamped: below 2% a measured
# difference is within one launch's noise on any host (session 19: launches of one layout 16-24% apart here);
# above 10% the fit failed and measurement alone, not a tie-break, should decide (`fastest`).
TIE_FLOOR, TIE_CAP = 0.02, 0.10
CHOICE_FINALISTS = 5  # the search's best and its runners-up considered for a tie


@dataclass
class Choice:
    config: str
    predicted_s: float  # the refit prediction
    measured_s: float | None  # tune's measurement of it (None: not run)
    why: str  # "model", or the tie-break's sentence


def tie_tolerance(fit: FitResult) -> float:
    """How close two refit predictions can be and still be ordered by the model (see TIE_FLOOR)."""
    return min(max(fit.mean_abs_error("run"), TIE_FLOOR), TIE_CAP)


Layers = tuple[tuple[int, int], ...]  # a plan's stages' [start, stop) blocks


def choose_by_measurement(ranked: list[tuple[str, float, Layers]],
                          measured: dict[str, tuple[float, float, Layers]], tolerance: float) -> Choice:
    """The plan to choose from the search's finalists `ranked` ((configuration, refit prediction, stage layers),
    best first) and tune's measurements `measured` ({configuration: (measured s, refit prediction s, stage
    layers)}; a measurement counts for a finalist of the same configuration and stage layers): among the
    finalists predicted within `tolerance` of the best, the measured ones compete with the best at their
    measurements (the best, if tune did not run it, at its prediction times the median measured/predicted of the
    tuned runs: the two on one scale); the least wins. An unmeasured runner-up never displaces the best: the
    model's order is all that is known of it. Held-out measurements must not be passed: only what tune ran."""
    def timed(c: str, layers: Layers) -> float | None:
        m = measured.get(c)
        return m[0] if m is not None and m[2] == layers else None

    best_cfg, best_pred, best_layers = ranked[0]
    window = [(c, t, lay) for c, t, lay in ranked
              if t <= best_pred * (1 + tolerance) and (timed(c, lay) is not None or c == best_cfg)]
    if len(window) == 1:
        return Choice(best_cfg, best_pred, timed(best_cfg, best_layers), "model")
    scale = statistics.median(m / p for m, p, _ in measured.values() if p > 0)

    def expected(c: str, t: float, lay: Layers) -> float:
        m = timed(c, lay)
        return m if m is not None else t * scale

    cfg, pred, layers = min(window, key=lambda w: expected(*w))
    m = timed(cfg, layers)
    if cfg == best_cfg:
        return Choice(cfg, pred, m, "model")
    others = ", ".join(c.split(",schedule")[0] for c, _, _ in window if c != cfg)
    why = (f"the refit model prices {cfg.split(',schedule')[0]} within {100 * (pred / best_pred - 1):.1f}% of "
           f"{others} (its error on the tuned runs: {100 * tolerance:.0f}%); measured faster: "
           f"{m * 1e3:.1f} ms against {expected(best_cfg, best_pred, best_layers) * 1e3:.1f}")
    return Choice(cfg, pred, m, why)


def plan_layers(plan) -> Layers:
    """A Plan's stage layers, as choose_by_measurement compares them."""
    return tuple(tuple(s.layers) for s in plan.stages)


def tuned_measurements(candidates: list[Candidate]) -> dict[str, tuple[float, float, Layers]]:
    """What choose_by_measurement takes of tune's runs: {configuration: (measured s, refit prediction s, stage
    layers)} of the measured candidates the refit predicted."""
    return {c.config: (c.measured_s, c.predicted_after_s, plan_layers(c.plan)) for c in candidates
            if c.measured_s is not None and c.predicted_after_s}


def search_choice(model, cluster: ClusterSpec, training, measured: dict[str, tuple[float, float, Layers]],
                  tolerance: float, **search_kw):
    """The search with `cluster` (refit), its finalists tie-broken by `measured` (choose_by_measurement):
    (Choice, the search's best plan)."""
    from autoplan.search.core import search

    r = search(model, cluster, training, top=CHOICE_FINALISTS, **search_kw)
    ranked = [(e.config.to_string(), e.step_time_s, tuple(tuple(st.layout.layers) for st in e.stages))
              for e in [r.best, *r.runners_up]]
    # the best as its plan states it (its own string and stage layers)
    ranked[0] = (r.plan.parallel.to_string(), ranked[0][1], plan_layers(r.plan))
    return choose_by_measurement(ranked, measured, tolerance), r.plan


def _refit_choice(result: TuneResult, model, training, profiles, fix, kernels) -> None:
    """What the search picks with the refit cluster (ties broken by tune's measurements), and its measurement if
    tune ran it."""
    try:
        choice, _ = search_choice(model, result.fit.cluster, training, tuned_measurements(result.candidates),
                                  tie_tolerance(result.fit),
                                  profiles=profiles, fix=fix, kernels=kernels)
    except AutoplanError as e:
        result.notes.append(f"search with the refit cluster failed: {e.one_line()}")
        return
    result.refit_choice = choice.config
    result.refit_choice_measured_s = choice.measured_s
    if choice.why != "model":
        result.notes.append(f"chosen by measurement: {choice.why}")


def fastest_plan(result: TuneResult, profiles=None):
    """The measured fastest candidate's plan, re-predicted with the refit cluster from `profiles` (those the
    candidates were priced with: a user module's capture; None: the spec's analytic profile), its model source
    kept (what `-o` writes)."""
    from autoplan.api import make_plan

    best = result.fastest
    if best is None:
        return None
    if result.fit is None:
        return best.plan
    p = best.plan
    try:
        plan = make_plan(p.model, result.fit.cluster.with_gpus(p.world_size), p.training, p.parallel,
                         kernels=p.kernels, stage_layers=[tuple(s.layers) for s in p.stages], profiles=profiles)
    except AutoplanError:
        return best.plan
    from autoplan.models.source import with_model_of

    return with_model_of(plan, p)
