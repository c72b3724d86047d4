"""The stage sub-problem: for one candidate (mesh, micro-batch, schedule, ZeRO), place the blocks on stages
and choose each stage's recomputation.

This module holds the problem's data (`StageProblem`), its solution (`StageSolution`), the evaluation of a
given layout under the search's model (`evaluate`), an exhaustive solver for tests (`brute_force`) and the fast
rank-level local search (`greedy_bound`) the search uses to rank candidates before the ILP (`ilp.py`) solves the
best of them exactly. The model mirrors `autoplan.cost_models.estimate.stage_cost` and `memory_of_rank`:

- stage s holds blocks [a_s, a_{s+1}); stage 0 also the embedding, stage S-1 the LM head; stage s runs on
  pipeline rank s % pp; S = pp * vp;
- a stage recomputes nothing, or selectively (every block: attention core), or fully its first k blocks and
  selectively the rest (`StageLayout(recompute="full", recompute_layers=k)`), or nothing for the rest where the
  stack runs Megatron's block method (`rest_none`); a software stack may lack a mode (`no_full`, `no_selective`:
  then, unless `rest_none`, a fully recomputing stage recomputes every block);
- stage work W_s (forward + backward + recomputation of one micro-batch, plus `stage_extra[s]`: the compute
  time its pipeline messages take from it, `estimate.p2p_occupancy`, which depends on the stage's position
  only), rank work R_r = sum of its stages;
- objective: the closed-form makespan (m - 1/v) * max_r R_r + (sum_s W_s) / v  (`closed_form_makespan`,
  constants such as point-to-point time and the data-parallel tail are the candidate's, not the layout's);
- rank memory: sum over its stages of (static bytes + inflight_r * activation bytes) + the largest transient
  of a fully recomputed block, or the bytes of its optimizer step where larger (`step_memory`: gradients made in
  the backward, when the blocks' static bytes hold none), at most the rank's capacity.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from functools import cached_property

NONE, SELECTIVE, FULL = "none", "selective", "full"


@dataclass(frozen=True)
class BlockCost:
    """One layer, one micro-batch, one GPU, as the search sees it (seconds and bytes)."""

    work: float  # forward + backward, no recomputation
    rec_sel: float = 0.0  # extra backward time when selectively recomputed
    rec_full: float = 0.0  # extra backward time when fully recomputed
    act_none: float = 0.0  # activation bytes kept, no recomputation
    act_sel: float = 0.0
    act_full: float = 0.0
    static: float = 0.0  # weights + gradients + optimizer state bytes (after sharding)

    @property
    def transient(self) -> float:
        """Bytes a fully recomputed layer materialises again during its backward, beyond its checkpointed input
        (already in act_full): `estimate.stage_cost`'s act_peak_extra, which the OOM check prices."""
        return max(0.0, self.act_none - self.act_full)


@dataclass(frozen=True)
class StageProblem:
    """Everything the layout/recompute choice depends on; equal problems have equal solutions (cache key)."""

    blocks: tuple[BlockCost, ...]
    first: BlockCost  # embedding (no recomputation)
    last: BlockCost  # LM head (no recomputation)
    pp: int
    vp: int
    m: int
    inflight: tuple[float, ...]  # per pipeline rank, in micro-batches (cost_models.pipeline.in_flight)
    capacity: tuple[float, ...]  # bytes per rank left for static + activations (overheads already taken)
    pin: str | None = None  # None, or "none" | "selective" | "full" (every block of every stage)
    uniform: bool | None = None  # all blocks identical (None: find out)
    # per stage, work that does not depend on its blocks (seconds per micro-batch): the compute time its
    # pipeline messages take (cost_models.estimate.p2p_occupancy); empty = none
    stage_extra: tuple[float, ...] = ()
    # no block recomputed fully (`pin` None): the search's second layout per candidate (`_Searcher.finalise`), or
    # a software stack without full recomputation (TrainingSpec.recompute_modes)
    no_full: bool = False
    # no block recomputed selectively: a software stack without selective recomputation (TrainingSpec.recompute_modes),
    # where a stage that recomputes fully recomputes every block it holds (a partial one would recompute the rest
    # selectively)
    no_selective: bool = False
    # a partly full stage's other blocks recompute nothing (TrainingSpec.partial_rest 'none': Megatron's block
    # method, torchtitan's layer SAC); false = selectively (autoplan's runtime)
    rest_none: bool = False
    # the stack recomputes the first k blocks of every stage (Megatron's block method, partial_recompute=rest-none):
    # a layout the search of a stack with one recomputation setting proposes (`_Searcher.block_solution`)
    block_method: bool = False
    # the layers split evenly over the stages (a software stack without uneven stages, TrainingSpec.uneven_stages):
    # only the recomputation is chosen (`_Searcher.even_solutions`), no ILP
    even: bool = False
    # Gradients made in the backward (cost_models.estimate.grads_made_in_backward: no pipeline, one stage holding
    # every layer), else empty: the blocks' static bytes hold no gradient and the rank's memory is the fullest of
    # the last block's backward (the usual sum), the first block's (the later blocks' activations released, their
    # gradients made: `block_grads`, bytes per block as the step holds them) and the optimizer step
    # (`step_memory`, per rank).
    step_memory: tuple[float, ...] = ()
    block_grads: tuple[float, ...] = ()

    @property
    def num_stages(self) -> int:
        return self.pp * self.vp

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @cached_property
    def identical_blocks(self) -> bool:
        if self.uniform is not None:
            return self.uniform
        b0 = self.blocks[0]
        return all(b == b0 for b in self.blocks)

    @cached_property
    def empty_end_stages(self) -> bool:
        """Whether the first virtual stage may hold only the embedding and the last only the head, no block
        (Megatron-Core's `E|...` and `...|L` layouts, Llama 3's 405B run): under interleaving, where such a rank
        keeps its other chunks' blocks."""
        return self.vp > 1 and self.pp > 1

    def min_blocks(self, r: int) -> int:
        """The fewest blocks pipeline rank r holds: one per virtual stage, one fewer on the ranks of the first and
        the last stage where those may be empty (`empty_end_stages`)."""
        return self.vp - (1 if self.empty_end_stages and r in (0, self.pp - 1) else 0)

    def extra_work(self, s: int) -> float:
        return self.stage_extra[s] if self.stage_extra else 0.0

    @cached_property
    def rank_extra(self) -> tuple[float, ...]:
        """`stage_extra` summed over each rank's stages."""
        return tuple(sum(self.stage_extra[r::self.pp]) for r in range(self.pp)) if self.stage_extra \
            else (0.0,) * self.pp

    def allowed_modes(self) -> tuple[str, ...]:
        if self.pin:
            return (self.pin,)
        return tuple(m for m in (NONE, SELECTIVE, FULL)
                     if not (m == FULL and self.no_full or m == SELECTIVE and self.no_selective))

    @property
    def full_whole(self) -> bool:
        """A stage that recomputes fully recomputes all its blocks (pinned full, or no selective mode for the
        rest of a stage that would recompute it selectively)."""
        return self.pin == FULL or (self.no_selective and not self.rest_none)


@dataclass(frozen=True)
class StageChoice:
    start: int
    stop: int
    recompute: str = NONE
    recompute_layers: int = 0  # with FULL: the first k blocks of the stage are fully recomputed


@dataclass(frozen=True)
class StageSolution:
    stages: tuple[StageChoice, ...]
    objective: float  # closed-form makespan of the layout (seconds)
    memory: tuple[float, ...]  # bytes per rank (static + activations + transient)
    method: str = ""  # "ilp", "ilp-compact", "brute-force", "even"


# ------------------------------------------------------------------------------------------ evaluation


def rest_selective(p: StageProblem, ch: StageChoice) -> bool:
    """Whether the blocks of a stage beyond its fully recomputed prefix recompute selectively (SELECTIVE, or
    FULL unless `rest_none`)."""
    return ch.recompute == SELECTIVE or (ch.recompute == FULL and not p.rest_none)


def block_act(b: BlockCost, j: int, ch: StageChoice, rest_sel: bool) -> float:
    """Kept activation bytes of a stage's `j`-th block under choice ch: its first k blocks fully recomputed, the
    rest selectively where `rest_sel` (`rest_selective`), else none."""
    if ch.recompute == FULL and j < ch.recompute_layers:
        return b.act_full
    return b.act_sel if rest_sel else b.act_none


def stage_work_act(p: StageProblem, s: int, ch: StageChoice) -> tuple[float, float, float, float]:
    """(work, activation bytes, static bytes, transient bytes) of stage s under choice ch."""
    work, act, static, extra = p.extra_work(s), 0.0, 0.0, 0.0
    if s == 0:
        work += p.first.work
        act += p.first.act_none
        static += p.first.static
    if s == p.num_stages - 1:
        work += p.last.work
        act += p.last.act_none
        static += p.last.static
    k_full = ch.recompute_layers if ch.recompute == FULL else 0
    rest_sel = rest_selective(p, ch)
    for j, i in enumerate(range(ch.start, ch.stop)):
        b = p.blocks[i]
        work += b.work + (b.rec_full if j < k_full else b.rec_sel if rest_sel else 0.0)
        static += b.static
        act += block_act(b, j, ch, rest_sel)
        if j < k_full:
            extra = max(extra, b.transient)
    return work, act, static, extra


def evaluate(p: StageProblem, stages: tuple[StageChoice, ...]) -> tuple[float, tuple[float, ...]]:
    """(objective, memory per rank) of a layout; the layout must be a contiguous cover of the blocks."""
    rank_work = [0.0] * p.pp
    rank_act = [0.0] * p.pp
    rank_static = [0.0] * p.pp
    rank_extra = [0.0] * p.pp
    total = 0.0
    for s, ch in enumerate(stages):
        w, a, st, ex = stage_work_act(p, s, ch)
        r = s % p.pp
        rank_work[r] += w
        rank_act[r] += a
        rank_static[r] += st
        rank_extra[r] = max(rank_extra[r], ex)
        total += w
    v = p.vp
    obj = (p.m - 1 / v) * max(rank_work) + total / v
    mem = tuple(rank_static[r] + p.inflight[r] * rank_act[r] + rank_extra[r] for r in range(p.pp))
    if p.step_memory:  # one stage (no pipeline): the first block's backward and the optimizer step
        (ch,) = stages
        later = range(ch.start + 1, ch.stop)
        first = mem[0] + sum(p.block_grads[i] for i in later) \
            - p.inflight[0] * sum(block_act(p.blocks[i], j, ch, rest_selective(p, ch))
                                  for j, i in enumerate(later, start=1))
        mem = (max(mem[0], first, p.step_memory[0]),)
    return obj, mem


def feasible(p: StageProblem, mem: tuple[float, ...], tol: float = 1e-6) -> bool:
    return all(x <= c * (1 + tol) + tol for x, c in zip(mem, p.capacity, strict=True))


# ------------------------------------------------------------------------------------------ brute force


def _stage_modes(p: StageProblem, n: int) -> list[tuple[str, int]]:
    out = []
    for mode in p.allowed_modes():
        if mode == FULL:
            ks = [n] if p.full_whole else range(1, n + 1)
            out += [(FULL, k) for k in ks]
        else:
            out.append((mode, 0))
    return out


def compositions(total: int, parts: int):
    """Every way to write `total` as `parts` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def layouts(p: StageProblem):
    """Every contiguous split of the blocks into the stages (block counts per stage): each stage at least one
    block, the first and the last possibly none where `empty_end_stages`."""
    S, L = p.num_stages, p.num_blocks
    ends = (0, 1) if p.empty_end_stages else (0,)
    for e0 in ends:
        for e1 in ends:
            if S - e0 - e1 >= 1:
                for sizes in compositions(L, S - e0 - e1):
                    yield (0,) * e0 + sizes + (0,) * e1


def brute_force(p: StageProblem) -> StageSolution | None:
    """Exhaustive: every contiguous layout with every per-stage recomputation. For tests (tiny problems)."""
    best: StageSolution | None = None
    for sizes in layouts(p):
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        options = [_stage_modes(p, n) for n in sizes]
        for modes in itertools.product(*options):
            stages = tuple(StageChoice(starts[s], starts[s + 1], md, k) for s, (md, k) in enumerate(modes))
            obj, mem = evaluate(p, stages)
            if not feasible(p, mem):
                continue
            if best is None or obj < best.objective - 1e-12:
                best = StageSolution(stages, obj, mem, "brute-force")
    return best


# -------------------------------------------------------------------------------------- greedy (ranking)


def _mean_block(blocks: tuple[BlockCost, ...]) -> BlockCost:
    n = len(blocks)
    return BlockCost(*(sum(getattr(b, f) for b in blocks) / n for f in BlockCost.__dataclass_fields__))


def greedy_bound(p: StageProblem) -> float:
    """A feasible objective (upper bound, inf if none found) from rank-level block counts.

    Start from the even split (at least `min_blocks` per rank); while the busiest rank has a block to give and
    some other rank would still be below the current maximum after taking one more block, move one block
    there. At the stop every other rank r has w_r(N_r + 1) >= max, so no allocation has a smaller maximum:
    the max term is optimal for identical blocks (each rank uses the least recomputation that fits, uniform
    over its blocks). Heterogeneous blocks are replaced by their mean (a ranking heuristic only: the ILP
    decides the chosen candidates)."""
    b = p.blocks[0] if p.identical_blocks else _mean_block(p.blocks)
    L, v, pp = p.num_blocks, p.vp, p.pp
    floor = [p.min_blocks(r) for r in range(pp)]
    counts = [L // pp + (1 if r >= pp - L % pp else 0) for r in range(pp)]
    if any(c < f for c, f in zip(counts, floor, strict=True)):  # (an even split below the floor: too few blocks)
        return math.inf
    f = rank_work_fn(p, b)
    work = [f(r, counts[r]) for r in range(pp)]
    nxt = [f(r, counts[r] + 1) for r in range(pp)]
    hi = [(-work[r], r) for r in range(pp)]
    lo = [(nxt[r], r) for r in range(pp)]
    heapq.heapify(hi)
    heapq.heapify(lo)
    for _ in range(2 * L if pp > 1 else 0):
        while -hi[0][0] != work[hi[0][1]]:
            heapq.heappop(hi)
        wmax, rmax = -hi[0][0], hi[0][1]
        if counts[rmax] <= floor[rmax]:
            break
        held = []
        while lo and (lo[0][0] != nxt[lo[0][1]] or lo[0][1] == rmax):
            item = heapq.heappop(lo)
            if item[1] == rmax and item[0] == nxt[rmax]:
                held.append(item)
        if not lo:
            break
        nmin, rmin = lo[0]
        for item in held:
            heapq.heappush(lo, item)
        if not nmin < wmax:
            break
        for r, d in ((rmax, -1), (rmin, 1)):
            counts[r] += d
            work[r] = f(r, counts[r])
            nxt[r] = f(r, counts[r] + 1)
            heapq.heappush(hi, (-work[r], r))
            heapq.heappush(lo, (nxt[r], r))
    if any(w == math.inf for w in work):
        return math.inf
    return (p.m - 1 / v) * max(work) + sum(work) / v


def rank_work_fn(p: StageProblem, b: BlockCost):
    """f(r, n): the least work of rank r holding n blocks like `b` within its memory (inf if none fits);
    least recomputation first (none, selective, then the fewest fully recomputed blocks, the others selective or,
    under `rest_none`, plain: then the cheaper of selective and the fewest full blocks)."""
    S, pp = p.num_stages, p.pp
    last = (S - 1) % pp
    modes = p.allowed_modes()
    consts = []
    for r in range(pp):
        bw = (p.first.work if r == 0 else 0.0) + (p.last.work if r == last else 0.0) + p.rank_extra[r]
        ba = (p.first.act_none if r == 0 else 0.0) + (p.last.act_none if r == last else 0.0)
        bs = (p.first.static if r == 0 else 0.0) + (p.last.static if r == last else 0.0)
        infl = p.inflight[r]
        consts.append((bw, p.capacity[r] - bs - infl * ba, infl))
    none_ok, sel_ok, full_ok = NONE in modes, SELECTIVE in modes, FULL in modes
    pin_full = p.full_whole
    w, rs, rf = b.work, b.rec_sel, b.rec_full
    an, asel, af, e, st = b.act_none, b.act_sel, b.act_full, b.transient, b.static

    # a partly full rank's other blocks: selective (autoplan's runtime), or plain under `rest_none`
    a_rest, w_rest = (an, 0.0) if p.rest_none else (asel, rs)

    def f(r: int, n: int) -> float:
        bw, room0, infl = consts[r]
        room = room0 - n * st
        if none_ok and infl * n * an <= room:
            return bw + n * w
        sel = bw + n * (w + rs) if sel_ok and infl * n * asel <= room else math.inf
        if sel < math.inf and not p.rest_none:  # the first k full and the rest selective is never cheaper
            return sel
        if full_ok:
            if pin_full:
                k = n
            else:
                gain = infl * (a_rest - af)
                need = infl * n * a_rest + e - room
                k = 1 if need <= 0 else (math.ceil(need / gain - 1e-9) if gain > 0 else n + 1)
            if k <= n and infl * (k * af + (n - k) * a_rest) + e <= room * (1 + 1e-9):
                return min(sel, bw + n * w + k * rf + (n - k) * w_rest)
        return sel

    return f
