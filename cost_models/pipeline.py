"""Pipeline schedules as lists of actions, and a simulator that times them with per-stage costs.

A schedule is, for every pipeline rank, the ordered list of actions it runs: `Action(stage, "F"|"B", mb)`,
printed `2F0` (stage 2, forward, micro-batch 0) as in `torch.distributed.pipelining`. Stage s runs on rank
s % pp (virtual stages for the interleaved schedule). The simulator executes every rank's list in order; an
action starts when its rank is free and its input has arrived (forward from stage s-1, backward from stage
s+1, plus the point-to-point time), so uneven stages, the bubble and exposed communication come out of the
timeline rather than a formula. `bubble_fraction` is the closed form (p-1)/m, or (p-1)/(v*m) interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # "F" or "B"
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def bubble_fraction(pp: int, m: int, vp: int = 1) -> float:
    """Idle fraction of an ideal pipeline relative to its busy time: (p-1)/(v*m) (Narayanan et al. 2021)."""
    return (pp - 1) / (vp * m)


def schedule_actions(schedule: str, pp: int, m: int, vp: int = 1) -> list[list[Action]]:
    """Per-rank action lists of GPipe, 1F1B or interleaved 1F1B (Megatron-LM's orders)."""
    if schedule == "gpipe":
        return [[Action(r, "F", j) for j in range(m)] + [Action(r, "B", j) for j in range(m)] for r in range(pp)]
    if schedule == "1f1b" or vp == 1:
        out = []
        for r in range(pp):
            warm = min(pp - r - 1, m)
            acts = [Action(r, "F", j) for j in range(warm)]
            f, b = warm, 0
            while f < m:
                acts.append(Action(r, "F", f))
                f += 1
                acts.append(Action(r, "B", b))
                b += 1
            acts += [Action(r, "B", j) for j in range(b, m)]
            out.append(acts)
        return out
    return _interleaved(pp, m, vp)


@lru_cache(maxsize=64)
def _actions(schedule: str, pp: int, m: int, vp: int) -> tuple[tuple[Action, ...], ...]:
    """`schedule_actions`, frozen and cached: the simulator runs the same schedule with and without messages,
    and the search simulates many layouts of one shape."""
    return tuple(tuple(a) for a in schedule_actions(schedule, pp, m, vp))


def microbatch_group(pp: int, m: int) -> int:
    """Micro-batches the interleaved schedule runs through each model chunk in turn (a round): m split into
    max(1, m // pp) equal rounds, i.e. pp when pp divides m (Narayanan et al. 2021's schedule), else a round of
    between pp and 2 pp - 1. The rule of torch.distributed.pipelining's ScheduleInterleaved1F1B (torch 2.13
    schedules.py: `number_of_rounds = max(1, n_microbatches // pp_group_size)`, which must divide
    n_microbatches) and a legal `--microbatch-group-size-per-virtual-pipeline-stage` of Megatron-Core >= 0.10
    (between pp and m, dividing m); the flexible round of the Llama 3 paper (sec. 3.3.2). `check_config` refuses
    an m it does not split evenly."""
    return m // max(1, m // pp)


def interleaved_rounds_fit(pp: int, m: int, flexible: bool = True) -> bool:
    """Whether m micro-batches split into the interleaved schedule's equal rounds (`microbatch_group`) of at
    least pp each (Megatron-Core's lower bound; with fewer a round's first chunk would wait on its own last);
    not `flexible` (TrainingSpec.flexible_rounds, Megatron-LM before Megatron-Core 0.10): rounds of exactly pp."""
    if not flexible:
        return m >= pp and m % pp == 0
    return m >= pp and m % max(1, m // pp) == 0


def _interleaved_action(r: int, k: int, pp: int, vp: int, group: int, kind: str) -> Action:
    """Rank r's k-th forward (chunks in order) or backward (chunks in reverse) in the interleaved order:
    micro-batches in rounds of `group`, each round through every model chunk of the rank in turn."""
    chunk = (k // group) % vp
    if kind == "B":
        chunk = vp - 1 - chunk
    mb = (k // (group * vp)) * group + k % group
    return Action(chunk * pp + r, kind, mb)


def _interleaved(pp: int, m: int, vp: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (torch's Interleaved1F1B): rounds of `microbatch_group` micro-batches run
    through each model chunk in turn; a rank's warm-up is (vp - 1) rounds plus two forwards per later rank."""
    total, group = m * vp, microbatch_group(pp, m)
    out = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (vp - 1) * group, total)
        acts = [_interleaved_action(r, k, pp, vp, group, "F") for k in range(warm)]
        f, b = warm, 0
        while f < total:
            acts.append(_interleaved_action(r, f, pp, vp, group, "F"))
            f += 1
            acts.append(_interleaved_action(r, b, pp, vp, group, "B"))
            b += 1
        acts += [_interleaved_action(r, k, pp, vp, group, "B") for k in range(b, total)]
        out.append(acts)
    return out


def interleaved_backward_stage(r: int, k: int, pp: int, vp: int, m: int) -> int:
    """The stage of rank r's k-th backward in the interleaved order (`_interleaved`)."""
    return _interleaved_action(r, k, pp, vp, microbatch_group(pp, m), "B").stage


def last_backward_stage(schedule: str, pp: int, m: int, vp: int, r: int) -> int:
    """The stage of rank r's last action (every schedule ends each rank with a backward): stage r for GPipe
    and 1F1B, the chunk of its last backward for the interleaved schedule."""
    if schedule == "gpipe" or schedule == "1f1b" or vp == 1:
        return r
    return interleaved_backward_stage(r, m * vp - 1, pp, vp, m)


def in_flight(schedule: str, pp: int, m: int, vp: int = 1) -> list[float]:
    """Peak micro-batches whose activations a rank holds at once, in units of one rank's full layer set.

    GPipe holds all m; 1F1B holds min(p - r, m) on rank r; interleaved holds its warm-up chunks plus one,
    each 1/v of the rank's layers (so rank 0 holds about p * (1 + (p-1)/(p*v)), Korthikanti et al. 2022, with
    rounds of p micro-batches; a longer round, `microbatch_group`, holds more).
    """
    if schedule == "gpipe":
        return [float(m)] * pp
    if schedule == "1f1b" or vp == 1:
        return [float(min(pp - r, m)) for r in range(pp)]
    group = microbatch_group(pp, m)
    return [min((pp - r - 1) * 2 + (vp - 1) * group + 1, m * vp) / vp for r in range(pp)]


@dataclass
class Timeline:
    """The simulated step: per-rank slices (action, start, end) and summary numbers."""

    slices: list[list[tuple[Action, float, float]]] = field(default_factory=list)
    rank_end: list[float] = field(default_factory=list)
    last_backward_start: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    # per rank, the end times of its backward actions in order; per stage, (index of its last micro-batch's
    # backward in its rank's list, that action's start): when each model chunk's gradients are complete
    backward_ends: list[list[float]] = field(default_factory=list)
    stage_last_backward: list[tuple[int, float]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(self.rank_end) if self.rank_end else 0.0

    def grid(self) -> list[list[str]]:
        """Step x rank grid of action names (`2F0`), one column per rank, for the terminal."""
        depth = max(len(s) for s in self.slices)
        return [[str(s[i][0]) if i < len(s) else "" for s in self.slices] for i in range(depth)]


def simulate(
    schedule: str,
    pp: int,
    m: int,
    vp: int,
    fwd: list[float],
    bwd: list[float],
    p2p_s: float = 0.0,
    keep_slices: bool = False,
) -> Timeline:
    """Run the schedule with per-stage forward/backward times (lists of pp*vp entries, backward including
    recomputation). `p2p_s` is the time a stage's output takes to reach the next rank."""
    n_stages = pp * vp
    acts = _actions(schedule, pp, m, vp)
    # done times, indexed [kind][stage * m + mb]; -1 = not yet run (flat lists: this is the search's hot path)
    done_f = [-1.0] * (n_stages * m)
    done_b = [-1.0] * (n_stages * m)
    waiting: dict[int, int] = {}  # key of the awaited action (2*idx + is_backward) -> rank waiting on it
    ptr = [0] * pp
    free = [0.0] * pp
    busy = [0.0] * pp
    last_b = [0.0] * pp
    b_ends: list[list[float]] = [[] for _ in range(pp)]
    stage_last_b: list[tuple[int, float]] = [(0, 0.0)] * n_stages
    slices: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    work = list(range(pp))
    remaining = sum(len(a) for a in acts)
    last = n_stages - 1
    while work:
        r = work.pop()
        racts = acts[r]
        i = ptr[r]
        t_free = free[r]
        while i < len(racts):
            a = racts[i]
            st, mb = a.stage, a.mb
            if a.kind == "F":
                if st > 0:
                    dep = done_f[(st - 1) * m + mb]
                    if dep < 0:
                        waiting[2 * ((st - 1) * m + mb)] = r
                        break
                    ready = dep + p2p_s
                else:
                    ready = 0.0
                dur = fwd[st]
            else:
                if st < last:
                    dep = done_b[(st + 1) * m + mb]
                    if dep < 0:
                        waiting[2 * ((st + 1) * m + mb) + 1] = r
                        break
                    ready = dep + p2p_s
                else:
                    ready = done_f[st * m + mb]
                    if ready < 0:
                        waiting[2 * (st * m + mb)] = r
                        break
                dur = bwd[st]
                last_b[r] = max(t_free, ready)
            start = t_free if t_free > ready else ready
            end = start + dur
            t_free = end
            busy[r] += dur
            key = st * m + mb
            if a.kind == "F":
                done_f[key] = end
                wkey = 2 * key
            else:
                done_b[key] = end
                wkey = 2 * key + 1
                b_ends[r].append(end)
                if mb == m - 1:
                    stage_last_b[st] = (len(b_ends[r]) - 1, start)
            if keep_slices:
                slices[r].append((a, start, end))
            i += 1
            remaining -= 1
            other = waiting.pop(wkey, None)
            if other is not None and other != r:
                work.append(other)
        ptr[r] = i
        free[r] = t_free
    if remaining:
        raise RuntimeError(f"pipeline schedule {schedule} deadlocked with {remaining} actions left "
                           f"(pp={pp}, m={m}, vp={vp})")
    return Timeline(slices=slices if keep_slices else [], rank_end=free, last_backward_start=last_b, busy=busy,
                    backward_ends=b_ends, stage_last_backward=stage_last_b)


def rank_end_lower_bounds(fwd: list[float], bwd: list[float], pp: int, m: int, vp: int = 1,
                          p2p_s: float = 0.0) -> list[float]:
    """Per rank, a time before which `simulate` (any schedule) cannot finish that rank's work; exact for the
    last rank's chain with even stages, and valid for uneven ones, where `closed_form_makespan` can overstate.

    Rank r starts no earlier than its first input arrives (stage r = its chunk 0, after the forwards of stages
    0..r-1 and r messages) and then runs m * (its stages' f + b). Its last action is a backward of stage r (every
    other action of that micro-batch on rank r precedes it), whose gradient then crosses stages r-1..0 before
    rank 0 can finish: rank 0 ends no earlier than any rank's bound plus that backward chain.
    """
    n = pp * vp
    work = [0.0] * pp
    for s in range(n):
        work[s % pp] += fwd[s] + bwd[s]
    ends = [sum(fwd[:r]) + r * p2p_s + m * work[r] for r in range(pp)]
    ends[0] = max(ends[r] + sum(bwd[:r]) + r * p2p_s for r in range(pp))
    return ends


def closed_form_makespan(fwd: list[float], bwd: list[float], pp: int, m: int, vp: int = 1,
                         p2p_s: float = 0.0) -> float:
    """Fast estimate used by the search: (m-1) * max stage + the sum of all stages, with the interleaved
    schedule's bubble shrunk by v (exact for even stages with no communication)."""
    per_rank = [0.0] * pp
    for s, (f, b) in enumerate(zip(fwd, bwd, strict=True)):
        per_rank[s % pp] += f + b
    worst = max(per_rank)
    fill = sum(f + b for f, b in zip(fwd, bwd, strict=True)) / vp
    return (m - 1 / vp) * worst + fill + 2 * (pp - 1) * p2p_s
