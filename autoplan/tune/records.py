"""The runtime's log, as tune reads it: step times and the profiled step's measured-vs-predicted counts.

The profile record (`autoplan run ... --profile-step N`, one JSON line written by rank 0) has the shape
`{"event": "profile", "step": N, "ranks": [{"rank": r, "pp_stage": s, "measured": C, "predicted": C}, ...]}`
with C = `{"flops": {"forward": f, "backward": b, "recompute": r}, "comm": [{"collective", "mesh_dim", "count",
"bytes"}], "memory_bytes": {...}, "time_s": {...optional...}}`. Tune reports counts that disagree with the
prediction (constants cannot fix a wrong count, so the fit does not try).

The timing records (`--time-from N`, one per step: `{"event": "timing", "step": N, "ranks": [{"rank",
"pp_stage", "step_s", "time_s": {bucket: seconds}}]}`, autoplan.runtime.timing) split each rank's step into
buckets; `component_seconds` sums them into the components the cost model's breakdown predicts, and tune fits
on those as extra rows.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from autoplan.cost_models.errors import SpecError


class _Rec(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CommCount(_Rec):
    collective: str = Field(description="all_reduce, all_gather, reduce_scatter, all_to_all, send, recv, ...")
    mesh_dim: str = Field(default="", description="Mesh dimension the collective ran over (tp, dp, pp, ...).")
    count: int = Field(default=0, ge=0, description="Calls in the profiled step.")
    bytes: float = Field(default=0.0, ge=0, description="Bytes this rank sent in those calls.")


class Counts(_Rec):
    flops: dict[str, float] = Field(default_factory=dict, description="FLOPs by phase: forward, backward, recompute.")
    comm: list[CommCount] = Field(default_factory=list, description="Collectives by kind and mesh dimension.")
    memory_bytes: dict[str, float] = Field(default_factory=dict, description="Peak bytes by category.")
    time_s: dict[str, float] = Field(default_factory=dict, description="Measured seconds by component, if any.")


class RankProfile(_Rec):
    rank: int = Field(ge=0)
    pp_stage: int = Field(default=0, ge=0)
    measured: Counts
    predicted: Counts


class ProfileRecord(_Rec):
    event: str
    step: int = Field(ge=0)
    ranks: list[RankProfile]

    def time_components(self) -> dict[str, float]:
        """Measured time per component, the slowest rank's (the step waits for it)."""
        out: dict[str, float] = {}
        for r in self.ranks:
            for k, v in r.measured.time_s.items():
                out[k] = max(out.get(k, 0.0), float(v))
        return out

    def count_mismatches(self, tolerance: float = 0.02) -> list[str]:
        """Counts whose measured and predicted values differ by more than `tolerance` (relative), per rank."""
        out = []
        for r in self.ranks:
            m, p = r.measured, r.predicted
            for phase in sorted(set(m.flops) | set(p.flops)):
                _check(out, f"rank {r.rank} flops.{phase}", m.flops.get(phase, 0.0), p.flops.get(phase, 0.0),
                       tolerance)
            mc, pc = _comm_totals(m.comm), _comm_totals(p.comm)
            for key in sorted(set(mc) | set(pc)):
                _check(out, f"rank {r.rank} {key[0]}@{key[1] or '-'} bytes", mc.get(key, 0.0), pc.get(key, 0.0),
                       tolerance)
        return out

    def call_mismatches(self) -> list[str]:
        """Collectives whose measured and predicted number of calls differ, per rank, collective and mesh
        dimension: exactly (a few-byte collective, or one split per FSDP unit, hides in `count_mismatches`'
        tolerance on bytes)."""
        out = []
        for r in self.ranks:
            mc, pc = _comm_totals(r.measured.comm, "count"), _comm_totals(r.predicted.comm, "count")
            out += [f"rank {r.rank} {k[0]}@{k[1] or '-'}: measured {mc.get(k, 0):.0f}, predicted {pc.get(k, 0):.0f}"
                    for k in sorted(set(mc) | set(pc)) if mc.get(k, 0) != pc.get(k, 0)]
        return out


# The runtime's timing buckets (autoplan.runtime.timing: "<phase or section>[/<wait>]") that make up each
# component of the cost model's breakdown (cost_models.estimate: Estimate.breakdown), with "pp_wait" for its
# pp_comm + bubble (a pipeline rank's waits for its neighbours are both).
def component_seconds(buckets: dict[str, float]) -> dict[str, float]:
    """The estimate-keyed components of one rank's timing buckets. Waits outside any known place (c10d waits in
    forward or backward outside FSDP and the pipeline) are returned as "other_wait" (no term predicts them)."""
    out = dict.fromkeys(("compute", "recompute", "tp_cp_ep_comm", "dp_comm", "pp_wait", "optimizer",
                         "other_wait"), 0.0)
    for key, v in buckets.items():
        where, _, wait = key.partition("/")
        if where == "fsdp":
            out["dp_comm"] += v  # FSDP's host work and its collectives' waits
        elif where == "step_tail":
            out["optimizer"] += v  # gradient finalisation, norm, clipping, AdamW, the loss all-reduce
        elif wait == "p2p":
            out["pp_wait"] += v
        elif where == "recompute":
            out["recompute"] += v  # the re-run forward, its tensor-parallel collectives included (as predicted)
        elif wait == "funcol":
            out["tp_cp_ep_comm"] += v
        elif wait:
            out["other_wait"] += v
        else:
            out["compute"] += v
    return out


class TimingRank(_Rec):
    rank: int = Field(ge=0)
    pp_stage: int = Field(default=0, ge=0)
    step_s: float = Field(default=0.0, ge=0, description="The rank's step time (Trainer.step, timed).")
    time_s: dict[str, float] = Field(default_factory=dict, description="Seconds by timing bucket.")
    cpu_s: float | None = Field(
        default=None, ge=0,
        description="CPU time the rank's process used during the step, all its threads (time.process_time); "
        "None in logs written before it was recorded. Against step_s: how much of the step the process ran, which "
        "on a node with more processes than cores says how the cores were shared.")


class TimingRecord(_Rec):
    event: str
    step: int = Field(ge=0)
    ranks: list[TimingRank]

    def by_stage(self) -> dict[int, dict[str, float]]:
        """Components per pipeline stage, each the median over that stage's ranks."""
        groups: dict[int, list[dict[str, float]]] = {}
        for r in self.ranks:
            groups.setdefault(r.pp_stage, []).append(component_seconds(r.time_s))
        return {s: {k: statistics.median(c[k] for c in comps) for k in comps[0]} for s, comps in groups.items()}

    def components(self) -> dict[str, float]:
        """The components of the busiest pipeline stage (the most compute, recompute and optimizer time)."""
        return max(self.by_stage().values(), key=lambda c: c["compute"] + c["recompute"] + c["optimizer"],
                   default={})


def _comm_totals(items: list[CommCount], field: str = "bytes") -> dict[tuple[str, str], float]:
    """(collective, mesh dimension) -> the sum of `field` ("bytes" or "count") over `items`."""
    out: dict[tuple[str, str], float] = {}
    for c in items:
        key = (c.collective, c.mesh_dim)
        out[key] = out.get(key, 0.0) + getattr(c, field)
    return out


def _check(out: list[str], what: str, measured: float, predicted: float, tol: float) -> None:
    scale = max(abs(measured), abs(predicted))
    if scale and abs(measured - predicted) > tol * scale:
        out.append(f"{what}: measured {measured:.4g}, predicted {predicted:.4g}")


def parse_profile_record(obj: dict) -> ProfileRecord:
    """One `{"event": "profile", ...}` object of the run log; SpecError naming the field when malformed."""
    from pydantic import ValidationError

    try:
        return ProfileRecord.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        raise SpecError("malformed profile record in the run log",
                        f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}",
                        "re-run with the runtime of this autoplan version") from None


class RunLog(BaseModel):
    """What tune keeps of one run's log: step times (all steps) and the profile record, if any."""

    step_times_s: list[float] = Field(default_factory=list)
    steps: list[int] = Field(default_factory=list, description="The step number of each time.")
    predicted_step_time_s: float | None = None
    profile: ProfileRecord | None = None
    timings: list[TimingRecord] = Field(default_factory=list, description="Timing records (--time-from).")
    final_loss: float | None = None
    instrumented_steps: list[int] = Field(
        default_factory=list, description="Steps the runtime measured memory on (MemTracker, CPU: the step rows' "
        "memory_measured_step): instrumented like the profiled step, so not a step time.")

    def time_components(self) -> dict[str, float]:
        """Measured seconds per component: the median over the timed steps (after the first step) of each
        component of `TimingRecord.components`; else the profile record's own time_s, if any."""
        recs = self._timed_after_first()
        if not recs:
            return self.profile.time_components() if self.profile is not None else {}
        comps = [t.components() for t in recs]
        return {k: statistics.median(c.get(k, 0.0) for c in comps) for k in comps[0]}

    def _timed_after_first(self) -> list[TimingRecord]:
        """The timing records of the steps after the first (its caches and allocator warm up), or all of them."""
        return [t for t in self.timings if t.step > 1] or self.timings

    def cpu_fraction(self) -> float | None:
        """The CPU time the ranks' processes used per second of their step (`TimingRank.cpu_s / step_s`), the mean
        over ranks of the median over the timed steps after the first; None without recorded CPU times. Above 1
        a process ran more than one thread at once."""
        recs = self._timed_after_first()
        per_rank: dict[int, list[float]] = {}
        for t in recs:
            for r in t.ranks:
                if r.cpu_s is not None and r.step_s > 0:
                    per_rank.setdefault(r.rank, []).append(r.cpu_s / r.step_s)
        if not per_rank:
            return None
        return statistics.mean(statistics.median(v) for v in per_rank.values())

    def stage_components(self) -> dict[int, dict[str, float]]:
        """`time_components` per pipeline stage (median over the timed steps after the first)."""
        recs = self._timed_after_first()
        per = [t.by_stage() for t in recs]
        stages = sorted({s for p in per for s in p})
        return {s: {k: statistics.median(p[s].get(k, 0.0) for p in per if s in p)
                    for k in next(p[s] for p in per if s in p)} for s in stages}

    def measured_step_s(self, warmup: int = 1) -> float:
        """Median step time after `warmup` steps (shape inference, DTensor caches, the allocator's first use),
        leaving out the profiled step and the memory-measured one (their instruments slow them down: on CPU the
        runtime's MemTracker step, step 3 by default when nothing is profiled, ran 5-10x a plain step here)."""
        if not self.step_times_s:
            raise SpecError("the run logged no steps", "empty log", "check the run's stderr")
        skip = set(self.instrumented_steps) | ({self.profile.step} if self.profile is not None else set())
        pairs = list(zip(self.steps or range(1, len(self.step_times_s) + 1), self.step_times_s, strict=False))
        times = [t for i, (n, t) in enumerate(pairs) if i >= warmup and n not in skip] or self.step_times_s
        return statistics.median(times)


def warmup_before(profile_step: int | None) -> int:
    """Steps a tuned run's time leaves out as warm-up: those before its profiled step (DDP's bucket rebuild in
    step 2 among them), or the first when nothing was profiled. `autoplan tune` times its runs so, and a replay of
    a saved run must too (`log.profile.step`)."""
    return profile_step - 1 if profile_step else 1


def read_run_log(path: str | Path) -> RunLog:
    """Parse a runtime log (JSON lines): step rows and an optional profile record; other events are skipped."""
    log = RunLog()
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        obj = json.loads(line)
        if obj.get("event") == "profile":
            log.profile = parse_profile_record(obj)
        elif obj.get("event") == "timing":
            log.timings.append(TimingRecord.model_validate(obj))
        elif "step_time_s" in obj and obj.get("event") in (None, "step"):
            log.step_times_s.append(float(obj["step_time_s"]))
            log.steps.append(int(obj.get("step", len(log.steps) + 1)))
            if obj.get("predicted_step_time_s") is not None:
                log.predicted_step_time_s = float(obj["predicted_step_time_s"])
            if obj.get("loss") is not None:
                log.final_loss = float(obj["loss"])
            mem_step = obj.get("memory_measured_step")
            if mem_step is not None and int(mem_step) not in log.instrumented_steps:
                log.instrumented_steps.append(int(mem_step))
    return log
