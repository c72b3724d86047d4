"""`search()`: from a model, a cluster and a training setup to the fastest plan that fits.

The procedure (every number is the cost model's; nothing is measured):

1. **Enumerate** legal meshes (tp, cp, ep, pp, dp) with micro-batch sizes and sequence parallelism
   (`space.meshes`), and for each mesh the ZeRO stages, schedules and virtual stages (`space.knob_options`).
   The three benchmark cases have 0.2-0.3 million such candidates; they are never all built. ZeRO-2 is left
   out where it prices exactly as ZeRO-1 (under pipeline parallelism: whole gradients; one micro-batch on
   autoplan's runtime: ZeRO-1 reduce-scatters in its only backward; `distinct_zeros`).
2. **Bound**: best-first branch and bound over one heap. A candidate's key is first a lower bound: its
   perfectly balanced step without recomputation, (m - 1/v) W/pp + W/v + the closed form's point-to-point
   time + the data-parallel tail (W = every layer's work for one micro-batch plus the compute time the
   pipeline messages take from every stage, `estimate.p2p_occupancy`). A mesh enters the heap with
   the least bound of its candidates. Meshes whose memory floor (every block fully recomputed, the largest
   ZeRO stage, one micro-batch in flight, averaged over ranks) exceeds the GPU are *pruned by memory*.
3. **Rank**: a popped candidate gets a feasible layout from `problem.greedy_bound` (rank-level block counts,
   least recomputation that fits; optimal in the max term for identical blocks; each stage's message
   occupancy is a constant of the stage problem, as in the estimate) and is pushed back with that proxy step
   time. Dominated candidates (GPipe by 1F1B, sp=0 by sp=1: same or worse under this model) are
   re-keyed by their twin's proxy and usually never ranked.
4. **Solve**: a popped ranked candidate gets its stage ILP (`ilp.py`, pulp/CBC; identical sub-problems are
   solved once) -- twice where the optimum recomputes a block fully: again with full recomputation forbidden,
   as the closed form cannot see what one long re-run does to the simulated bubble -- and each layout is
   estimated with the cost model's closed-form pipeline (`estimate(..., simulate_pipeline=False)`, exact memory
   and data-parallel tail) and pushed back keyed by what its simulation cannot beat
   (`estimate.step_time_lower_bound`: the closed form overstates uneven pipelines).
5. **Simulate**: a popped closed-form finalist is re-estimated with `autoplan.cost_models.estimate.estimate` and its
   pipeline simulation. The search stops when the smallest key left is no better than the best simulated
   step and `top` finalists are in hand; everything left is *pruned by bound*. The finalists are then ordered
   by their simulated step (or, not simulated, their bound) and the first `top` simulated (`_settle`): the
   plan and its runners-up are the simulation's; finalists further down may stay closed-form and say so
   (`"pipeline": "closed-form"`).

Shortcuts (named so they can be revisited): the mesh and ranked-candidate keys are lower bounds only up to the
cost model's own closed-form vs simulation gap (`benchmarks/search_exactness.py` counts the misses) (the simulated pipeline is usually slower than the closed form, which keeps
the keys optimistic, but not provably so); the ILP's objective is the closed form, so its layout is optimal
for the closed form and then simulated; of one candidate's layouts only the ILP's optimum and its best
without full recomputation are simulated; the data-parallel tail used in keys, the ZeRO-3 exposed traffic
(per block) and the ZeRO-3 gathered-weights buffer (as if a stage held one block plus the embedding or head)
are approximations for an even layout; heterogeneous blocks are ranked by their mean block (the ILP is
exact); a `--fix recompute_layers` pin uses Megatron's even layout instead of the ILP; at most
`max_finalists` pipelines are simulated. Stacks that recompute alike in every stage (TrainingSpec.recompute_per_stage
false) are ranked by the best of their pinned greedy layouts (and the free one where Megatron's block method is
possible) and solved once per mode; stacks with even stages only (uneven_stages false) get the even layout under
each setting, no per-stage recomputation.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autoplan.cost_models.comm import native_reduce_scatter
from autoplan.cost_models.compute import Context, LayerCost, fused_host_priced, layer_cost
from autoplan.cost_models.errors import ConfigError, DoesNotFitError
from autoplan.cost_models.estimate import (
    GIB,
    Estimate,
    StageLayout,
    chunk_sync_launches,
    chunk_sync_window,
    crowded_for,
    dp_exposed,
    dp_sync,
    dtensor_optimizer_time,
    dtensors_of,
    embedding_grad_extra,
    estimate,
    fsdp_unit_time,
    grad_accum_time,
    grads_made_in_backward_of,
    interleaved_cool_down,
    one_pass_zero,
    optimizer_time,
    p2p_occupancy,
    param_gather_exposed,
    parameter_kind,
    pipeline_action_time,
    pipeline_p2p_parts,
    pipeline_p2p_time,
    runtime_per_param,
    sp_grad_reduce_time,
    sp_partial_grads,
    step_scalars_time,
    step_time_lower_bound,
    sync_tied_ranks,
    tied_grad_sync,
    tied_head_params,
    uses_replicate,
    weight_casts_per_step,
    zero3_block_exposed,
)
from autoplan.cost_models.pipeline import in_flight, microbatch_group
from autoplan.cost_models.profile import LayerProfile, profile_from_spec
from autoplan.cost_models.specs import (
    ClusterSpec,
    ModelSpec,
    ParallelConfig,
    TrainingSpec,
    check_config,
    check_recompute_runs,
)

from .ilp import is_cached, solve_stage_problem
from .problem import (
    FULL,
    NONE,
    SELECTIVE,
    BlockCost,
    StageChoice,
    StageProblem,
    StageSolution,
    evaluate,
    feasible,
    greedy_bound,
)
from .space import Knobs, Mesh, knob_options, meshes, parse_fix, to_config

# progress(phase, done, total): total > 0 is an upper bound of `done` for that phase; 0 means open-ended (a
# best-first search stops when its bound says so, so how many candidates it will rank is not known ahead).
Progress = Callable[[str, int, int], None]


@dataclass
class SearchStats:
    meshes: int = 0  # (tp, cp, ep, pp, dp, mbs, sp) combinations
    candidates: int = 0  # meshes x (ZeRO, schedule, vp): the legal configurations enumerated
    pruned_memory: int = 0  # candidates of meshes that cannot fit even with full recomputation and ZeRO
    pruned_bound: int = 0  # candidates whose lower bound could not beat the kept ones
    ranked: int = 0  # candidates given a feasible layout by the greedy (or found not to fit)
    ilp_solved: int = 0  # stage ILPs solved with CBC
    ilp_cached: int = 0  # stage ILPs answered from the cache (identical sub-problems)
    screened: int = 0  # ILP layouts estimated with the closed-form pipeline
    estimated: int = 0  # finalists re-estimated with the pipeline simulation
    pruned_dominated: int = 0  # dominated by a twin that cannot fit (GPipe by 1F1B, sp=0 by sp=1), or priced
    # exactly as a twin that is searched (ZeRO-2 under pp or at one micro-batch, `distinct_zeros`)
    search_time_s: float = 0.0
    kernels_note: str = ""  # why the plan runs torch's kernels where the stack's are autoplan's fused ones

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Finalist:
    config: ParallelConfig
    estimate: Estimate  # closed-form pipeline until `simulated`
    solution: StageSolution
    proxy_s: float
    layout: list[StageLayout] = field(default_factory=list)
    simulated: bool = False
    bound_s: float = 0.0  # what its simulation cannot beat (`estimate.step_time_lower_bound`)

    @property
    def rank_key(self) -> float:
        """Its simulated step, or until simulated the most its simulation is known not to beat: the closed form
        can be below the simulation (and below the best simulated step) while the bound is not."""
        t = self.estimate.step_time_s
        return t if self.simulated else max(t, self.bound_s)


@dataclass
class SearchResult:
    plan: object  # autoplan.plan.Plan
    best: Estimate
    runners_up: list[Estimate]
    stats: SearchStats
    finalists: list[Finalist] = field(default_factory=list)

    @property
    def search_time_s(self) -> float:
        return self.stats.search_time_s

    def as_json(self) -> dict:
        """DESIGN.md's `search --json` object: the best plan's fields, `runners_up`, `search_time_s`."""
        d = estimate_json(self.best)
        d["stages"] = [s.model_dump(mode="json") for s in self.plan.stages]
        d["pipeline"] = "simulated"
        d["runners_up"] = []
        for f in self.finalists[1:len(self.runners_up) + 1]:
            r = estimate_json(f.estimate)
            r["pipeline"] = "simulated" if f.simulated else "closed-form"
            d["runners_up"].append(r)
        d["search_time_s"] = self.stats.search_time_s
        d["stack"] = getattr(self.plan, "stack", None) or "autoplan"
        d["kernels"] = self.plan.kernels  # the stack's, or torch's where they are faster (_choose_kernels)
        d["stats"] = self.stats.as_dict()
        return d


def estimate_json(est: Estimate) -> dict:
    d = est.as_dict()
    d["memory_headroom_gib"] = est.capacity_bytes / GIB - est.peak_memory_gib
    return d


# ----------------------------------------------------------------------------------------------- costs


class CostTable:
    """Per-layer costs for every context, each unique layer profile costed once per context."""

    def __init__(self, profiles: list[LayerProfile], cluster: ClusterSpec, training: TrainingSpec) -> None:
        self.cluster, self.training = cluster, training
        uids: dict[LayerProfile, int] = {}
        self.unique: list[LayerProfile] = []
        self.uid: list[int] = []
        for p in profiles:
            key = p.model_copy(update={"name": ""})
            if key not in uids:
                uids[key] = len(self.unique)
                self.unique.append(p)
            self.uid.append(uids[key])
        self.block_uids = self.uid[1:-1]
        self.block_counts: dict[int, int] = {}
        for u in self.block_uids:
            self.block_counts[u] = self.block_counts.get(u, 0) + 1
        self._layer: dict[tuple, list[LayerCost]] = {}
        self.w_bytes = training.weight_bytes
        self.g_bytes = training.grad_bytes
        self.opt_bytes = training.optimizer_state_bytes
        self.profiles = profiles
        self._static: dict[tuple, tuple[tuple[float, float, float], tuple[float, float, float]]] = {}  # `per_param`
        self._static_sum: dict[tuple, tuple[float, float]] = {}  # `static_per_param`
        self._crowded: dict[tuple, ClusterSpec] = {}  # `cluster_for`
        self._tied: dict[int, float] = {}  # `tied_copy` by tp
        # (tensors, elements) with partial gradients under sp: all blocks, the embedding, the head
        # (`estimate.sp_partial_grads`); the same for every mesh
        blocks = [sp_partial_grads(p) for p in profiles[1:-1]]
        self.sp_grads = ((sum(a for a, _ in blocks), sum(b for _, b in blocks)), sp_partial_grads(profiles[0]),
                         sp_partial_grads(profiles[-1]))

    def cluster_for(self, mesh: Mesh) -> ClusterSpec:
        """The cluster as the estimate prices `mesh` on it (`estimate.crowded_for`: on an oversubscribed CPU node
        a collective's waits depend on the configuration; elsewhere the cluster itself). One copy per
        configuration: the search asks for it per candidate."""
        if self.cluster.cores_per_node is None:  # accelerators (`crowded_for` returns the cluster itself)
            return self.cluster
        key = (mesh.tp, mesh.cp, mesh.dp, mesh.pp, mesh.mbs)
        got = self._crowded.get(key)
        if got is None:
            got = self._crowded[key] = crowded_for(self.cluster, self.training, tp=mesh.tp, cp=mesh.cp, dp=mesh.dp,
                                                   pp=mesh.pp, mbs=mesh.mbs)
        return got

    def layers(self, mesh: Mesh) -> list[LayerCost]:
        cl = self.cluster_for(mesh)
        key = (mesh.ctx_key, cl.crowding)
        got = self._layer.get(key)
        if got is None:
            ctx = Context(cluster=cl, training=self.training, tp=mesh.tp, cp=mesh.cp, sp=mesh.sp,
                          ep=mesh.ep, mbs=mesh.mbs)
            got = [layer_cost(p, ctx) for p in self.unique]
            self._layer[key] = got
        return got

    def per_param(self, mesh: Mesh, zero: int) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """Bytes per dense and per expert parameter, (weights, gradients, optimizer), after ZeRO sharding, as
        `estimate.memory_of_rank` prices them: under pipeline parallelism ZeRO-2/3 keep whole gradients (the
        schedule defers the reduce-scatter to the last micro-batch); on autoplan's runtime
        (`TrainingSpec.runtime_memory`) with what it holds beyond that (`estimate.runtime_per_param`)."""
        key = (mesh.tp, mesh.cp, mesh.ep, mesh.pp, mesh.dp, zero)
        got = self._static.get(key)
        if got is not None:
            return got
        sd = mesh.dp * mesh.cp
        se = max(1, sd // mesh.ep)
        grads_sharded = zero >= 2 and mesh.pp == 1
        out = [(self.w_bytes * (1 / shard if zero >= 3 else 1), self.g_bytes * (1 / shard if grads_sharded else 1),
                self.opt_bytes * (1 / shard if zero >= 1 else 1)) for shard in (sd, se)]
        if self.training.runtime_memory:
            extra = runtime_per_param(dp=mesh.dp, cp=mesh.cp, tp=mesh.tp, pp=mesh.pp, ep=mesh.ep, zero=zero,
                                      training=self.training)
            out = [tuple(a + b for a, b in zip(base, x, strict=True)) for base, x in zip(out, extra, strict=True)]
        got = self._static[key] = (out[0], out[1])
        return got

    def static_per_param(self, mesh: Mesh, zero: int) -> tuple[float, float]:
        """Bytes per dense and per expert parameter (weights + gradients + optimizer), `per_param` summed (cached:
        the search asks for it per candidate)."""
        key = (mesh.tp, mesh.cp, mesh.ep, mesh.pp, mesh.dp, zero)
        got = self._static_sum.get(key)
        if got is None:
            dense, expert = self.per_param(mesh, zero)
            got = self._static_sum[key] = (sum(dense), sum(expert))
        return got

    def grad_per_param(self, mesh: Mesh, zero: int) -> tuple[float, float]:
        """The gradients' part of `static_per_param` (bytes per dense and per expert parameter): what a rank holds
        only from the backward on where gradients are made there (`estimate.grads_made_in_backward`)."""
        dense, expert = self.per_param(mesh, zero)
        return dense[1], expert[1]

    def tied_copy(self, mesh: Mesh) -> float:
        """Elements per tp rank of a tied head's own copy on the last of several pipeline stages
        (`estimate.tied_copy`): 0 without a pipeline or a tied head."""
        if mesh.pp <= 1:
            return 0.0
        got = self._tied.get(mesh.tp)
        if got is None:
            got = self._tied[mesh.tp] = tied_head_params(self.profiles, mesh.tp)
        return got

    def ends_static(self, mesh: Mesh, zero: int) -> tuple[float, float]:
        """Bytes the embedding's and the LM head's stages hold beyond their layers' parameters, as
        `estimate.memory_of_rank` prices them: a tied head's own copy on the last of several pipeline stages
        (`estimate.tied_copy`, a dense parameter, on every stack) and, on autoplan's runtime, the embedding's
        whole-vocabulary gradient at ZeRO-0 (`estimate.embedding_grad_whole`: not where a tied head shares the
        rank)."""
        tied = tied_head_params(self.profiles, mesh.tp)
        head = self.tied_copy(mesh) * self.static_per_param(mesh, zero)[0]
        emb = 0.0
        if self.training.runtime_memory and zero == 0 and not (tied and mesh.pp == 1):
            emb = embedding_grad_extra(self.profiles, mesh.tp) * self.g_bytes
        return emb, head


def _block_cost(c: LayerCost, dense_b: float, expert_b: float, extra_work: float = 0.0,
                extra_static: float = 0.0) -> BlockCost:
    dense = c.params_local - c.expert_params_local
    return BlockCost(work=c.fwd_s + c.bwd_s + extra_work, rec_sel=c.recompute_selective_s, rec_full=c.recompute_full_s,
                     act_none=c.act_none, act_sel=c.act_selective, act_full=c.act_full,
                     static=dense * dense_b + c.expert_params_local * expert_b + extra_static)


# ---------------------------------------------------------------------------------------------- search


@dataclass(frozen=True)
class _Chunk:
    """One model chunk of an even interleaved layout, as `estimate.chunk_sync_launches` reads a stage."""

    index: int
    bwd_s: float
    params: float
    expert_params: float = 0.0
    tied_head: float = 0.0


@dataclass(frozen=True)
class _Agg:
    """Sums over the blocks of one context (per micro-batch, per GPU)."""

    work: float  # every layer, embedding and head included, fwd + bwd
    blk_dense: float
    blk_expert: float
    blk_bwd: float
    blk_act_full: float
    blk_params_max: float
    emb: LayerCost
    head: LayerCost


class _Searcher:
    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                 profiles: list[LayerProfile], fix: dict[str, object], top: int, progress: Progress | None,
                 max_finalists: int = 40):
        self.model, self.cluster, self.training = model, cluster, training
        self.profiles = profiles
        self.fix = fix
        self.top = top
        self.max_finalists = max_finalists
        self.progress = progress
        self.L = len(profiles) - 2
        self.costs = CostTable(profiles, cluster, training)
        self.capacity = cluster.gpu.hbm_gib * GIB
        self.overhead = cluster.gpu.calibration.framework_overhead_gib * GIB
        self.stats = SearchStats()
        self._tail: dict[tuple, float] = {}
        self._dp: dict[tuple, list] = {}
        self._sp_tail: dict[tuple, float] = {}  # `sp_grad_tail`
        self._scalars: dict[tuple, float] = {}  # `step_scalars`
        self._tensors: tuple | None = None  # `_tensor_counts`
        self._agg: dict[tuple, _Agg] = {}
        self._occ: dict[tuple, tuple[float, float, float]] = {}
        self.closest: tuple[float, Mesh, dict] | None = None  # (memory deficit bytes, mesh, parts)
        self.finalists: list[Finalist] = []
        self.misses: list[tuple[Mesh, Knobs, StageProblem]] = []
        self.proxies: dict[tuple[Mesh, Knobs], float] = {}
        self._even: dict[StageProblem, list[StageSolution | None]] = {}  # even_solutions, ranked then finalised

    # ---- per-candidate numbers

    def agg(self, mesh: Mesh) -> _Agg:
        key = (mesh.ctx_key, self.costs.cluster_for(mesh).crowding)
        got = self._agg.get(key)
        if got is None:
            lc = self.costs.layers(mesh)
            cnt = self.costs.block_counts.items()
            emb, head = lc[self.costs.uid[0]], lc[self.costs.uid[-1]]
            acc = self.accum  # the estimate adds it to every stage's backward (estimate.grad_accum_time)
            got = _Agg(
                work=sum(n * (lc[u].fwd_s + lc[u].bwd_s + acc(lc[u])) for u, n in cnt) + emb.fwd_s + emb.bwd_s
                + acc(emb) + head.fwd_s + head.bwd_s + acc(head),
                blk_dense=sum(n * (lc[u].params_local - lc[u].expert_params_local) for u, n in cnt),
                blk_expert=sum(n * lc[u].expert_params_local for u, n in cnt),
                blk_bwd=sum(n * (lc[u].bwd_s + acc(lc[u])) for u, n in cnt),
                blk_act_full=sum(n * lc[u].act_full for u, n in cnt),
                blk_params_max=max(lc[u].params_local for u, _ in cnt), emb=emb, head=head)
            self._agg[key] = got
        return got

    def accum(self, c: LayerCost) -> float:
        """The unfused gradient-accumulation pass of one layer per micro-batch (0 for stacks that fuse it): the
        estimate adds `grad_accum_time` of a stage's parameters to its backward, and it is linear in them."""
        return grad_accum_time(c.params_local, self.cluster, self.training)

    def accum_tied(self, mesh: Mesh) -> float:
        """The same pass over a tied head's own copy, on the last stage of a pipeline (`estimate.estimate`)."""
        return grad_accum_time(self.costs.tied_copy(mesh), self.cluster, self.training)

    def micro_batches(self, mesh: Mesh) -> int:
        return self.training.global_batch_size // (mesh.dp * mesh.mbs)

    def p2p_time(self, mesh: Mesh, sp: bool = True) -> float:
        """One activation message between neighbouring pipeline stages (the cost model's). sp=True leaves out
        the receiver's tp all-gather that only non-sp configurations pay, so bounds built on it stay bounds."""
        return pipeline_p2p_time(self.costs.cluster_for(mesh), self.training, hidden=self.profiles[0].hidden,
                                 pp=mesh.pp, tp=mesh.tp, cp=mesh.cp, dp=mesh.dp, mbs=mesh.mbs, sp=sp)

    def occupancy(self, mesh: Mesh, vp: int) -> tuple[float, ...]:
        """Per (virtual) stage, the compute time its pipeline messages take from it per micro-batch, forward
        and backward (`estimate.p2p_occupancy`, as the estimate adds it to the stage), and the schedule's host
        time per action (`estimate.pipeline_action_time`): depends on the stage's position, not on its blocks.
        Empty without a pipeline."""
        if mesh.pp <= 1:
            return ()
        key = (mesh.tp, mesh.cp, mesh.pp, mesh.dp, mesh.mbs, mesh.sp, vp > 1)
        ends = self._occ.get(key)
        if ends is None:  # a first, a middle and a last stage: every stage is one of the three
            cl = self.costs.cluster_for(mesh)
            t, busy = pipeline_p2p_parts(cl, self.training, hidden=self.profiles[0].hidden, pp=mesh.pp,
                                         tp=mesh.tp, cp=mesh.cp, dp=mesh.dp, mbs=mesh.mbs, sp=mesh.sp)
            action = 2 * pipeline_action_time(cl, self.training, mesh.pp)  # a forward and a backward each
            ends = tuple(sum(p2p_occupancy(s, 3, t, cl, self.training, busy, vp)) + action for s in range(3))
            self._occ[key] = ends
        return (ends[0],) + (ends[1],) * (mesh.pp * vp - 2) + (ends[2],)

    def p2p_proxy(self, mesh: Mesh, kn: Knobs) -> float:
        """Exposed point-to-point time: the closed form's 2 (pp - 1) messages; the interleaved schedule's
        fill and drain cross every virtual stage, 2 (pp vp - 1) messages (close to the simulation's)."""
        return 2 * (mesh.pp * kn.vp - 1) * self.p2p_time(mesh) if mesh.pp > 1 else 0.0

    def tail(self, mesh: Mesh, zero: int, vp: int = 1, sync: str = "last") -> float:
        """Data-parallel gradient sync, parameter gather and optimizer after the pipeline drains (as
        `estimate._dp_sync`, for an even layout; the worst of the first, a middle and the last rank). How much of
        the gradient reduction hides (`sync`): "last", under the rank's last backward (one chunk of 1/vp of its
        layers: 1F1B and GPipe; the tail grows with vp, vp=1 the least); "chunks", the interleaved schedule's
        chunk-by-chunk reduction under the cool-down, as the estimate's closed form prices it (`_chunk_window`);
        "floor", all of it but the last bucket, which no schedule beats (the lower bounds of candidates that may
        interleave, as `estimate.step_time_lower_bound`)."""
        key = (mesh.ctx_key, mesh.pp, mesh.dp, zero, vp)
        got = self._tail.get((*key, sync))
        if got is not None:
            return got
        a = self.agg(mesh)
        cl = self.costs.cluster_for(mesh)
        parts = self._dp_parts(mesh, zero, vp)
        # the first and the last rank meet at the tied embedding's all-reduce (`estimate.sync_tied_ranks`); the
        # closed form ends every rank's pipeline at the same time
        tied_s = tied_grad_sync(self.costs.tied_copy(mesh), pp=mesh.pp, tp=mesh.tp, cp=mesh.cp, dp=mesh.dp, zero=zero,
                                cluster=cl, training=self.training)
        after = [rest + self.sp_grad_tail(mesh, r) for r, (_, _, rest) in parts]
        # "last" and "floor" (asked for at vp=1 only) share everything but the window: both are kept
        for mode in ("last", "floor") if sync != "chunks" and vp == 1 else (sync,):
            ready = []
            for r, (red, tl, _) in parts:
                if mode == "floor":
                    window = red
                elif mode == "chunks" and red > 0:
                    window = self._chunk_window(mesh, r, vp, red)
                else:
                    window = a.blk_bwd / (mesh.pp * vp) + (
                        a.head.bwd_s + self.accum(a.head) + self.accum_tied(mesh) if r == mesh.pp - 1 else 0.0)
                ready.append(dp_exposed(red, tl, window, cl, self.training))
            if tied_s > 0:
                ends = sync_tied_ranks([ready[0], ready[-1]], tied_s)
                ready[0], ready[-1] = ends[0], ends[-1]
            self._tail[(*key, mode)] = max(t + x for t, x in zip(ready, after, strict=True))
        return self._tail[(*key, sync)]

    def _chunk_window(self, mesh: Mesh, r: int, vp: int, red: float) -> float:
        """`estimate.chunk_sync_window` of rank r in an even layout of vp chunks per rank: the interleaved
        cool-down's backwards packed before the rank's end (`estimate.interleaved_cool_down`), each chunk's share
        of `red` (by parameters; the embedding on the first chunk, the head and a tied copy on the last) launched
        as `estimate.chunk_sync_launches` launches it."""
        a, pp = self.agg(mesh), mesh.pp
        chunks = []
        for v in range(vp):
            bwd, params = a.blk_bwd / (pp * vp), (a.blk_dense + a.blk_expert) / (pp * vp)
            if r == 0 and v == 0:
                bwd += a.emb.bwd_s + self.accum(a.emb)
                params += a.emb.params_local
            if r == pp - 1 and v == vp - 1:
                bwd += a.head.bwd_s + self.accum(a.head) + self.accum_tied(mesh)
                params += a.head.params_local + self.costs.tied_copy(mesh)
            chunks.append(_Chunk(v * pp + r, bwd, params))
        m = self.micro_batches(mesh)
        # the rank's end on a clock where its last round of backwards starts at 0 (the window counts from 0)
        end = microbatch_group(pp, m) * sum(c.bwd_s for c in chunks)
        ends, last = interleaved_cool_down(chunks, r, end, pp, vp, m)
        launches = chunk_sync_launches(chunks, r, red, ends, last, end, self.training.align_grad_reduce)
        return chunk_sync_window(red, end, launches)

    def _dp_parts(self, mesh: Mesh, zero: int, vp: int = 1) -> list[tuple[int, tuple[float, float, float]]]:
        """Per representative pipeline rank: (gradient reduction, its last-bucket tail, optimizer + exposed
        parameter gather), with the estimate's functions for an even layout of `vp` stages per rank (`estimate.
        _rank_tails`: the runtime's per-unit reduction at ZeRO-0, FSDP's per-unit work at ZeRO>=1, the step's
        scalar all-reduces). Depends on parameters (tp, ep), groups (cp, dp, pp), micro-batches and vp only."""
        key = (mesh.tp, mesh.cp, mesh.ep, mesh.pp, mesh.dp, mesh.mbs, zero, vp)
        got = self._dp.get(key)
        if got is not None:
            return got
        cl, tr = self.costs.cluster_for(mesh), self.training
        n = mesh.dp * mesh.cp
        a = self.agg(mesh)
        out = []
        kind = parameter_kind(tp=mesh.tp, zero=zero, dp_cp=n)  # `estimate.rank_dtensors`
        emb_dt, blocks_dt, head_dt = (dtensors_of(kind, t, plain) for t, plain in self._tensor_counts())
        for r in sorted({0, mesh.pp // 2, mesh.pp - 1}):
            dense, expert = a.blk_dense / mesh.pp, a.blk_expert / mesh.pp
            n_dt = blocks_dt / mesh.pp
            if r == 0:
                dense += a.emb.params_local - a.emb.expert_params_local
                n_dt += emb_dt
            if r == mesh.pp - 1:  # and a tied head's own copy (`estimate.rank_params`)
                dense += a.head.params_local - a.head.expert_params_local + self.costs.tied_copy(mesh)
                n_dt += head_dt + dtensors_of(kind, 1 if self.costs.tied_copy(mesh) else 0, 0)
            units = len(self.profiles[1:-1]) / mesh.pp + vp  # blocks and stage roots on the rank
            red, gather, tl = dp_sync(dense, expert, dp=mesh.dp, cp=mesh.cp, tp=mesh.tp, ep=mesh.ep, zero=zero,
                                      cluster=cl, training=tr,
                                      units=units if uses_replicate(tp=mesh.tp, zero=zero, dp_cp=n) else vp)
            casts = weight_casts_per_step(pp=mesh.pp, zero=zero, dp_cp=n, tp=mesh.tp, m=self.micro_batches(mesh))
            opt = optimizer_time(dense + expert, n if zero >= 1 else 1, cl, tr, casts) \
                + dtensor_optimizer_time(n_dt, cl) \
                + self.step_scalars(mesh, zero, cl)
            fsdp = fsdp_unit_time(units, dense, dp=mesh.dp, cp=mesh.cp, tp=mesh.tp, pp=mesh.pp, zero=zero,
                                  m=self.micro_batches(mesh), cluster=cl, training=tr)
            out.append((r, (red, tl, opt + param_gather_exposed(gather, cl, tr) + fsdp)))
        self._dp[key] = out
        return out

    def _tensor_counts(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(parameter tensors, of them left plain by tp alone) of the embedding, all blocks and the head
        (LayerProfile.tensors / tp_plain_tensors), counted once per search."""
        if self._tensors is None:
            def count(ps):
                return sum(p.tensors() for p in ps), sum(p.tp_plain_tensors() for p in ps)

            self._tensors = (count(self.profiles[:1]), count(self.profiles[1:-1]), count(self.profiles[-1:]))
        return self._tensors

    def step_scalars(self, mesh: Mesh, zero: int, cl: ClusterSpec) -> float:
        """`estimate.step_scalars_time` for `mesh` (the same for every pipeline rank and micro-batch size)."""
        key = (mesh.tp, mesh.cp, mesh.dp, mesh.pp, mesh.ep, zero, id(cl))
        got = self._scalars.get(key)
        if got is None:
            got = self._scalars[key] = step_scalars_time(tp=mesh.tp, cp=mesh.cp, dp=mesh.dp, pp=mesh.pp, ep=mesh.ep,
                                                         zero=zero, cluster=cl)
        return got

    def sp_grad_tail(self, mesh: Mesh, r: int) -> float:
        """The estimate's `sp_grad_reduce_time` on pipeline rank `r` (its blocks' share spread evenly, as
        `_dp_parts` spreads their parameters; the embedding's on rank 0, the head's on the last)."""
        if not (mesh.sp and mesh.tp > 1):
            return 0.0
        key = (mesh.tp, mesh.cp, mesh.dp, mesh.pp, mesh.mbs, r)
        got = self._sp_tail.get(key)
        if got is None:
            got = self._sp_tail[key] = self._sp_grad_tail(mesh, r)
        return got

    def _sp_grad_tail(self, mesh: Mesh, r: int) -> float:
        (nb, eb), (n0, e0), (nh, eh) = self.costs.sp_grads
        n, e = nb / mesh.pp, eb / mesh.pp
        if r == 0:
            n, e = n + n0, e + e0
        if r == mesh.pp - 1:
            n, e = n + nh, e + eh
        return sp_grad_reduce_time(n, e, tp=mesh.tp, cluster=self.costs.cluster_for(mesh), training=self.training)

    def zero3_extra(self, mesh: Mesh, c: LayerCost) -> float:
        """Exposed ZeRO-3 traffic of one block per micro-batch (the cost model's `zero3_block_exposed`)."""
        return zero3_block_exposed(c.params_local, c.fwd_s, c.bwd_s, dp=mesh.dp, cp=mesh.cp, tp=mesh.tp,
                                   cluster=self.costs.cluster_for(mesh), training=self.training, pp=mesh.pp,
                                   m=self.micro_batches(mesh))

    def distinct_zeros(self, mesh: Mesh, zeros: list[int]) -> list[int]:
        """ZeRO stages that price differently on `mesh`: ZeRO-2 is ZeRO-1 wherever it keeps whole gradients
        (under pipeline parallelism, `static_per_param`) -- the same traffic, optimizer and memory -- and ZeRO-1
        is ZeRO-2 where one micro-batch without a pipeline makes the gradients in the backward on autoplan's
        runtime (`estimate.one_pass_config`), so ZeRO-2 is left out when ZeRO-1 is searched (the tie would go to
        zero=1 anyway, by name)."""
        if 1 in zeros and 2 in zeros and (self.made_in_backward(mesh, 1) or
                                          self.costs.static_per_param(mesh, 2) == self.costs.static_per_param(mesh, 1)):
            return [z for z in zeros if z != 2]
        return zeros

    def pipe_bound(self, mesh: Mesh, vp: int, occ_vp: int) -> float:
        """The closed form at perfect balance without recomputation, (m - 1/v) W'/pp + W'/v + 2 (pp - 1) p2p,
        with W' = every layer's work plus the messages' occupancy of `occ_vp` virtual stages per rank. The
        coefficient of W' falls with v and the occupancy grows with it, so vp = the largest and occ_vp = 1
        bound every vp at once."""
        m = self.micro_batches(mesh)
        work = self.agg(mesh).work + sum(self.occupancy(mesh, occ_vp))
        return (m - 1 / vp) * work / mesh.pp + work / vp + 2 * (mesh.pp - 1) * self.p2p_time(mesh)

    def made_in_backward(self, mesh: Mesh, zero: int) -> bool:
        """Whether `mesh` at `zero` makes its gradients in the backward (`estimate.grads_made_in_backward`)."""
        return grads_made_in_backward_of(pp=mesh.pp, m=self.micro_batches(mesh), tp=mesh.tp, zero=zero,
                                         dp_cp=mesh.dp * mesh.cp, training=self.training)

    def step_memory(self, mesh: Mesh, zero: int, dense_b: float, expert_b: float) -> float:
        """Bytes of the optimizer step where gradients are made in the backward (no pipeline: the one rank holds
        every layer), beside the capacity as `StageProblem.step_memory`: `dense_b`/`expert_b` without the
        gradients, the loss's transient (estimate books it with the overheads at every moment), and the
        gradients as held at the step (`estimate.one_pass_config`: ZeRO-1 with one micro-batch holds ZeRO-2's
        shards), the embedding's whole-vocabulary one included (`ends_static`)."""
        a = self.agg(mesh)
        dense = a.blk_dense + sum(c.params_local - c.expert_params_local for c in (a.emb, a.head))
        expert = a.blk_expert + a.emb.expert_params_local + a.head.expert_params_local
        at_step = one_pass_zero(zero, self.micro_batches(mesh), mesh.pp)
        dg, eg = self.costs.grad_per_param(mesh, at_step)
        return dense * (dense_b + dg) + expert * (expert_b + eg) + self.costs.ends_static(mesh, at_step)[0] \
            + a.head.loss_transient

    def problem(self, mesh: Mesh, kn: Knobs) -> StageProblem:
        lc = self.costs.layers(mesh)
        dense_b, expert_b = self.costs.static_per_param(mesh, kn.zero)
        emb_x, head_x = self.costs.ends_static(mesh, kn.zero)
        head_b = dense_b
        step: tuple[float, ...] = ()
        grads: tuple[float, ...] = ()
        if self.made_in_backward(mesh, kn.zero):
            # the blocks' and the embedding's static bytes without gradients (none exists before their
            # backward), the head's with its own, unsharded (its backward comes first; FSDP2 reduces the root's
            # last); the later blocks' gradients at the first block's backward (`block_grads`, as the step holds
            # them: `estimate.one_pass_config`) and every gradient at the optimizer step (`step_memory`)
            dg, eg = self.costs.grad_per_param(mesh, kn.zero)
            dense_b, expert_b = dense_b - dg, expert_b - eg
            head_b = dense_b + self.costs.g_bytes
            emb_x = 0.0  # the embedding's whole-vocabulary gradient
            step = (self.step_memory(mesh, kn.zero, dense_b, expert_b),)
            sdg, seg = self.costs.grad_per_param(mesh, one_pass_zero(kn.zero, self.micro_batches(mesh), mesh.pp))
            per_uid = {u: (lc[u].params_local - lc[u].expert_params_local) * sdg + lc[u].expert_params_local * seg
                       for u in self.costs.block_counts}
            grads = tuple(per_uid[u] for u in self.costs.block_uids)
        by_uid: dict[int, BlockCost] = {}
        for u in self.costs.block_counts:
            extra = (self.zero3_extra(mesh, lc[u]) if kn.zero >= 3 else 0.0) + self.accum(lc[u])
            by_uid[u] = _block_cost(lc[u], dense_b, expert_b, extra, lc[u].weight_copies)
        e, h = lc[self.costs.uid[0]], lc[self.costs.uid[-1]]
        emb = _block_cost(e, dense_b, expert_b, self.accum(e), emb_x + e.weight_copies)
        # the loss's transient, held once by the head's rank whatever its in-flight micro-batches (estimate books it
        # with that rank's fixed overheads): bytes that do not scale, as the head's static ones
        head = _block_cost(h, head_b, expert_b, self.accum(h) + self.accum_tied(mesh),
                           head_x + h.loss_transient + h.weight_copies)
        m = self.micro_batches(mesh)
        infl = tuple(in_flight(kn.schedule, mesh.pp, m, kn.vp))
        caps = []
        S = mesh.pp * kn.vp
        a = self.agg(mesh)
        for r in range(mesh.pp):
            cap = self.capacity - self.overhead
            if kn.zero >= 3:  # the gathered weights of two layers (conservative: a stage of one block)
                biggest = a.blk_params_max
                if r == 0:
                    biggest += a.emb.params_local
                if r == (S - 1) % mesh.pp:
                    biggest += a.head.params_local
                cap -= 2 * biggest * self.costs.w_bytes
            caps.append(cap)
        pin = self.fix.get("recompute") if "recompute_layers" not in self.fix else None
        if len(by_uid) == 1:
            blocks = (next(iter(by_uid.values())),) * self.L
        else:
            blocks = tuple(by_uid[u] for u in self.costs.block_uids)
        modes = self.training.recompute_modes.split("+")  # what the software stack recomputes
        return StageProblem(blocks=blocks, first=emb, last=head,
                            pp=mesh.pp, vp=kn.vp, m=m, inflight=infl, capacity=tuple(caps), pin=pin,
                            uniform=len(self.costs.block_counts) == 1, stage_extra=self.occupancy(mesh, kn.vp),
                            step_memory=step, block_grads=grads, no_full="full" not in modes,
                            no_selective="selective" not in modes, even=not self.training.uneven_stages,
                            rest_none=self.training.partial_rest == "none",
                            block_method=self.training.partial_recompute == "rest-none")

    def memory_floor(self, mesh: Mesh) -> tuple[float, dict]:
        """A lower bound on the busiest rank's bytes over every knob and layout of `mesh`: the largest ZeRO
        stage allowed, every block fully recomputed, one micro-batch in flight, averaged over the ranks."""
        a = self.agg(mesh)
        zero = int(self.fix["zero"]) if "zero" in self.fix else (3 if mesh.dp * mesh.cp > 1 else 0)
        dense_b, expert_b = self.costs.static_per_param(mesh, zero)
        dense = a.blk_dense + a.emb.params_local - a.emb.expert_params_local + a.head.params_local \
            - a.head.expert_params_local
        expert = a.blk_expert + a.emb.expert_params_local + a.head.expert_params_local
        static = (dense + self.costs.tied_copy(mesh)) * dense_b + expert * expert_b
        act = a.blk_act_full + a.emb.act_none + a.head.act_none
        if self.made_in_backward(mesh, zero):  # no pipeline: the activations' moment or the optimizer step's
            dg, eg = self.costs.grad_per_param(mesh, zero)
            static -= dense * dg + expert * eg
            act = max(act, self.step_memory(mesh, zero, dense_b - dg, expert_b - eg) - static)
        avg = (static + act) / mesh.pp + self.overhead
        return avg, {"static": static / mesh.pp, "activations": act / mesh.pp, "other": self.overhead}

    # ---- the search

    def run(self) -> None:
        """Best-first branch and bound over one heap of meshes (key: their least candidate bound), candidates
        (key: lower bound), ranked candidates (key: greedy proxy) and solved finalists; stops when the
        smallest key left cannot beat the best simulated finalist and `top` finalists are in hand."""
        heap: list[tuple] = []
        counter = 0
        mesh_list = list(meshes(self.model, self.cluster, self.training, self.fix, self.L))
        self.stats.meshes = len(mesh_list)
        for i, mesh in enumerate(mesh_list):
            zeros, scheds = knob_options(mesh, self.fix, self.L, self.training)
            n = len(zeros) * len(scheds)
            if not n:
                continue
            self.stats.candidates += n
            floor, parts = self.memory_floor(mesh)
            if floor > self.capacity:
                self.stats.pruned_memory += n
                if self.closest is None or floor - self.capacity < self.closest[0]:
                    self.closest = (floor - self.capacity, mesh, parts)
                continue
            zeros = self.distinct_zeros(mesh, zeros)
            self.stats.pruned_dominated += n - len(zeros) * len(scheds)
            vmax = max(v for _, v in scheds)
            pipe = self.pipe_bound(mesh, vmax, 1)
            sync = "floor" if any(sc == "interleaved" for sc, _ in scheds) else "last"
            lb = min(pipe + self.tail(mesh, z, 1, sync) for z in zeros)
            heap.append((lb, 0, counter, mesh, (zeros, scheds)))
            counter += 1
            if self.progress and i % 512 == 0:
                self.progress("bounding meshes", i, len(mesh_list))
        heapq.heapify(heap)
        best = math.inf  # best simulated step time so far
        screened = 0  # closed-form finalists waiting in the heap
        while heap:
            if heap[0][0] >= best and len(self.finalists) + screened >= self.top:
                break
            if self.stats.estimated >= self.max_finalists and self.finalists:
                break
            item = heapq.heappop(heap)
            kind = item[1]
            if kind == 0:  # a mesh: expand into its candidates
                _, _, _, mesh, (zeros, scheds) = item
                pipe = {v: self.pipe_bound(mesh, v, v) for _, v in scheds}
                for z in zeros:
                    last, floor = self.tail(mesh, z, 1, "last"), self.tail(mesh, z, 1, "floor")
                    for sched, v in scheds:
                        tz = floor if sched == "interleaved" else last
                        heapq.heappush(heap, (pipe[v] + tz, 1, counter, mesh, Knobs(z, sched, v)))
                        counter += 1
            elif kind == 1:  # a candidate: rank it with the greedy layout
                mesh, kn = item[3], item[4]
                twin = _dominating_twin(mesh, kn, sp_dominates=native_reduce_scatter(self.cluster))
                if twin is not None and twin in self.proxies and len(item) == 5:
                    # dominated: its proxy is at least its twin's (or it cannot fit when the twin cannot)
                    tp_ = self.proxies[twin]
                    if tp_ < math.inf:
                        heapq.heappush(heap, (max(item[0], tp_), 1, item[2], mesh, kn, "twin-checked"))
                    else:
                        self.stats.pruned_dominated += 1
                    continue
                prob = self.problem(mesh, kn)
                self.stats.ranked += 1
                if "recompute_layers" in self.fix:
                    sol = self.pinned_layers_solution(prob, int(self.fix["recompute_layers"]))
                    score = sol.objective if sol else math.inf
                elif prob.even:
                    score = min((sol.objective for sol in self.even_solutions(prob) if sol), default=math.inf)
                elif prob.pin is None and not self.training.recompute_per_stage:
                    modes, block = uniform_modes(prob)
                    # the block method's layouts are ranked by the free layout's proxy (cheap, and no worse)
                    score = min([greedy_bound(replace(prob, pin=m)) for m in modes]
                                + ([greedy_bound(prob)] if block else []))
                else:
                    score = greedy_bound(prob)
                if score == math.inf:
                    self.proxies[(mesh, kn)] = math.inf
                    self.note_miss(mesh, kn, prob)
                    continue
                sync = "chunks" if kn.schedule == "interleaved" else "last"
                proxy = score + self.p2p_proxy(mesh, kn) + self.tail(mesh, kn.zero, kn.vp, sync)
                self.proxies[(mesh, kn)] = proxy
                heapq.heappush(heap, (proxy, 2, counter, mesh, kn, prob))
                counter += 1
                if self.progress and self.stats.ranked % 64 == 0:
                    self.progress("ranking candidates", self.stats.ranked, 0)  # best-first: most are never ranked
            elif kind == 2:  # a ranked candidate: solve its stage ILP(s), estimate the layouts in closed form
                _, _, _, mesh, kn, prob = item
                for fin in self.finalise(mesh, kn, prob, item[0]):
                    # keyed by what its simulation cannot beat: the closed form overstates uneven pipelines
                    key = fin.estimate.step_time_s if fin.simulated else step_time_lower_bound(
                        fin.estimate, self.cluster, self.training, self.p2p_time(mesh, fin.estimate.config.sp))
                    fin.bound_s = key
                    heapq.heappush(heap, (key, 3, counter, fin))
                    counter += 1
                    screened += 1
                if self.progress:
                    self.progress("solving stage ILPs", self.stats.ilp_solved, 0)  # open-ended, like ranking
            else:  # a screened finalist: simulate its pipeline
                fin = item[3]
                screened -= 1
                fin.estimate = estimate(self.profiles, self.cluster, self.training, fin.config, fin.layout)
                fin.simulated = True
                self.stats.estimated += 1
                if fin.estimate.fits:
                    self.finalists.append(fin)
                    best = min(best, fin.estimate.step_time_s)
                if self.progress:
                    self.progress("simulating pipelines", self.stats.estimated, self.max_finalists)  # the cap, at most
        self.finalists += [item[3] for item in heap if item[1] == 3]
        for item in heap:  # whatever is left was pruned by its bound
            if item[1] == 0:
                self.stats.pruned_bound += len(item[4][0]) * len(item[4][1])
            elif item[1] < 3:
                self.stats.pruned_bound += 1

    def finalise(self, mesh: Mesh, kn: Knobs, prob: StageProblem, proxy: float) -> list[Finalist]:
        """The candidate's layouts, estimated in closed form: the stage ILP's optimum and, where that recomputes
        some block fully, the optimum with full recomputation forbidden. The ILP's objective sees ranks' totals;
        the simulated pipeline also sees one stage's backward grown by a whole block's re-run, which widens the
        interleaved schedule's bubble (llama3-405b on 16384 H100: the ILP's one-full-block layout is 0.02 s
        ahead in closed form and 0.13 s behind simulated). Both go on the heap; the simulation decides. A stack
        with even stages only (`even_solutions`) or one recomputation setting for every stage
        (`uniform_solutions`) has its own layouts."""
        if "recompute_layers" in self.fix:
            sols = [self.pinned_layers_solution(prob, int(self.fix["recompute_layers"]))]
        elif prob.even:
            sols = self.even_solutions(prob)
        elif prob.pin is None and not self.training.recompute_per_stage:
            sols = self.uniform_solutions(prob)
        else:
            sols = [self.solve(prob)]
            if sols[0] is not None and prob.pin is None and any(c.recompute == FULL for c in sols[0].stages):
                sols.append(self.solve(replace(prob, no_full=True)))
        if all(sol is None for sol in sols):
            self.note_miss(mesh, kn, prob)
        return [f for f in (self._finalist(mesh, kn, sol, proxy) for sol in sols if sol is not None) if f]

    def uniform_solutions(self, prob: StageProblem) -> list[StageSolution | None]:
        """One recomputation setting for every stage (TrainingSpec.recompute_per_stage false: Megatron,
        torchtitan): the ILP's optimum with each mode the stack has pinned and, where a stage's other blocks
        recompute nothing (the stack's partial_recompute=rest-none, or selective recomputation free and saving
        nothing: flash attention), the even layout that recomputes the fewest first blocks of every stage in full
        and fits (Megatron's block method). All go on the heap; the simulation decides."""
        modes, block = uniform_modes(prob)
        sols = [self.solve(replace(prob, pin=m)) for m in modes]
        if block:
            sols.append(self.block_solution(prob))
        return sols

    def block_solution(self, prob: StageProblem) -> StageSolution | None:
        """Megatron's block method: the even layout recomputing the fewest first blocks of every stage in full that
        fits (more recomputation is only slower)."""
        most = -(-self.L // prob.num_stages)
        return next((sol for k in range(1, most) if (sol := self.pinned_layers_solution(prob, k * prob.vp))), None)

    def solve(self, prob: StageProblem) -> StageSolution | None:
        if is_cached(prob):
            self.stats.ilp_cached += 1
        else:
            self.stats.ilp_solved += 1
        return solve_stage_problem(prob)

    def _finalist(self, mesh: Mesh, kn: Knobs, sol: StageSolution, proxy: float) -> Finalist | None:
        mode, rl = _label(sol.stages, mesh.pp, kn.vp, self.L)
        if "recompute_layers" in self.fix:
            rl = int(self.fix["recompute_layers"])
        cfg = check_config(to_config(mesh, kn, mode, rl), self.model, self.cluster, self.training,
                           stage_layers=False)
        layout = [StageLayout((c.start, c.stop), c.recompute, c.recompute_layers) for c in sol.stages]
        est = estimate(self.profiles, self.cluster, self.training, cfg, layout, simulate_pipeline=False)
        self.stats.screened += 1
        if not est.fits:  # the search's memory model is the estimate's; guard anyway
            return None
        # with one pipeline stage the estimate has no pipeline to simulate: the closed form is its answer
        return Finalist(cfg, est, sol, proxy, layout, simulated=cfg.pp == 1)

    def note_miss(self, mesh: Mesh, kn: Knobs, prob: StageProblem) -> None:
        self.misses.append((mesh, kn, prob))

    def closest_miss(self) -> None:
        """For the error message: how far the even layout with every block fully recomputed is from fitting,
        for every candidate that did not fit (the closest is kept)."""
        for mesh, kn, prob in self.misses:
            self._closest(mesh, kn, prob)

    def _closest(self, mesh: Mesh, kn: Knobs, prob: StageProblem) -> None:
        S = prob.num_stages
        base, extra = divmod(self.L, S)
        stages, start = [], 0
        for i in range(S):
            n = base + (1 if i < extra else 0)
            stages.append(StageChoice(start, start + n, FULL, n))
            start += n
        _, mem = evaluate(prob, tuple(stages))
        r = max(range(mesh.pp), key=lambda r: mem[r] - prob.capacity[r])
        deficit = mem[r] - prob.capacity[r]
        if self.closest is None or deficit < self.closest[0]:
            static = sum(b.static for b in prob.blocks) / mesh.pp
            self.closest = (deficit, mesh, {"static": static, "activations": max(mem[r] - static, 0.0),
                                            "other": self.capacity - prob.capacity[r], "knobs": kn})

    def even_solutions(self, prob: StageProblem) -> list[StageSolution | None]:
        """A stack without uneven stages (TrainingSpec.uneven_stages false: Megatron-LM before 2024-09): the even
        layout with one recomputation setting for every stage, each the stack has (or the pinned one), and the
        block method where `uniform_modes` allows it. The stacks without uneven stages also recompute alike in
        every stage; per-stage recomputation on an even layout is not searched (a shortcut)."""
        if prob in self._even:
            return self._even[prob]
        modes, block = ([prob.pin], False) if prob.pin else uniform_modes(prob)
        n = self.L // prob.num_stages
        sols: list[StageSolution | None] = []
        for m in modes:
            stages = tuple(StageChoice(s * n, (s + 1) * n, m, n if m == FULL else 0) for s in range(prob.num_stages))
            obj, mem = evaluate(prob, stages)
            sols.append(StageSolution(stages, obj, mem, "even") if feasible(prob, mem) else None)
        if block:
            sols.append(self.block_solution(prob))
        self._even[prob] = sols
        return sols

    def pinned_layers_solution(self, prob: StageProblem, R: int) -> StageSolution | None:
        """Megatron's even layout, R layers per rank recomputed in full (R/vp per stage; `--fix recompute_layers`,
        or the block method of `uniform_solutions`)."""
        S = prob.num_stages
        base, extra = divmod(self.L, S)
        stages, start = [], 0
        for s in range(S):
            n = base + (1 if s < extra else 0)
            stages.append(StageChoice(start, start + n, FULL, min(n, -(-R // prob.vp))))
            start += n
        obj, mem = evaluate(prob, tuple(stages))
        return StageSolution(tuple(stages), obj, mem, "even") if feasible(prob, mem) else None


def uniform_modes(prob: StageProblem) -> tuple[list[str], bool]:
    """The recomputation settings a stack with one setting for every stage may choose for `prob`: the modes it
    has, pinned (selective left out where it is free and saves nothing: flash attention), and whether the block
    method (the first k blocks of every stage in full, the rest nothing) is among them: where the stack runs it
    (`block_method`), or where the rest would recompute nothing under autoplan's partial full recomputation too
    (`_Searcher.uniform_solutions`)."""
    free = all(b.rec_sel == 0 and b.act_sel >= b.act_none for b in prob.blocks)
    modes = [m for m in prob.allowed_modes() if not (m == SELECTIVE and free)]
    return modes, FULL in modes and not prob.full_whole and (prob.block_method or free)


def _dominating_twin(mesh: Mesh, kn: Knobs, *, sp_dominates: bool = True) -> tuple[Mesh, Knobs] | None:
    """A candidate that is never worse under the search's model: 1F1B has GPipe's closed-form time with fewer
    micro-batches in flight; sequence parallelism (sp=1) has sp=0's communication with less elementwise work
    and fewer activations -- except on gloo, whose reduce-scatter costs a whole all-reduce (`sp_dominates`
    False). A dominated candidate is ranked only if its twin's proxy leaves it a chance."""
    if kn.schedule == "gpipe":
        return mesh, Knobs(kn.zero, "1f1b", 1)
    if sp_dominates and not mesh.sp and mesh.tp > 1:
        twin = Mesh(mesh.tp, mesh.cp, mesh.ep, mesh.pp, mesh.dp, mesh.mbs, True)
        return twin, kn
    return None


def _label(stages: tuple[StageChoice, ...], pp: int, vp: int, L: int) -> tuple[str, int | None]:
    """The configuration-level recompute knob that summarises per-stage choices."""
    modes = {s.recompute for s in stages}
    if FULL in modes:
        if all(s.recompute == FULL and s.recompute_layers == s.stop - s.start for s in stages):
            return FULL, None
        per_rank = [0] * pp
        for i, s in enumerate(stages):
            per_rank[i % pp] += s.recompute_layers if s.recompute == FULL else 0
        rl = max(per_rank)
        return FULL, (rl if rl <= L // (pp * vp) * vp else None)
    if SELECTIVE in modes:
        return SELECTIVE, None
    return NONE, None


def search(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *,
           profiles: list[LayerProfile] | None = None, fix: dict[str, str] | None = None, top: int = 5,
           progress: Progress | None = None, command: str = "", kernels: str | None = None) -> SearchResult:
    """The fastest plan that fits (by the cost model), with `top - 1` runners-up.

    `fix` pins knobs (`{"tp": "8", "recompute": "full"}`, the keys of the parallel configuration string).
    Deterministic: the same inputs give the same plan, byte for byte (the plan carries no timing; the search
    time is in `SearchResult.stats`). Raises DoesNotFitError when no configuration fits, ConfigError when the
    pins leave no legal configuration.
    """
    from autoplan.api import plan_from_estimate
    from autoplan.plan import RunnerUp

    t0 = time.perf_counter()
    choose_kernels = kernels is None  # the stack's kernel set, unless torch's are faster (_choose_kernels)
    if kernels is not None and kernels != training.kernels:  # predict with the kernels the plan will run
        training = training.model_copy(update={"kernels": kernels})
    kernels = "torch" if training.kernels == "torch" else "fused"
    fixd = parse_fix(fix)
    _check_recompute_pins(fixd, training)
    top = max(1, int(top))
    profiles = profiles or profile_from_spec(model)
    s = _Searcher(model, cluster, training, profiles, fixd, top, progress)
    s.run()
    if s.stats.candidates == 0:
        _explain_no_candidate(model, cluster, training, fixd)
    finalists = s.finalists
    if not finalists:
        raise _does_not_fit(s, model, cluster, training, fixd)
    _settle(s, finalists, top)
    if choose_kernels and _choose_kernels(s, finalists, top):
        training, kernels = s.training, "torch"
    best, others = finalists[0], finalists[1:top]
    runners = [RunnerUp(parallel=f.config.as_dict(), step_time_s=f.estimate.step_time_s, mfu=f.estimate.mfu,
                        peak_memory_gib=f.estimate.peak_memory_gib,
                        note=_why_slower(f.estimate, best.estimate)
                        + ("" if f.simulated else " (closed-form pipeline, not simulated)"))
               for f in others]
    plan = plan_from_estimate(model, cluster, training, best.estimate, kernels=kernels, runners_up=runners,
                              search_time_s=None, command=command,
                              extra={"search": {"fix": {k: str(v) for k, v in sorted((fix or {}).items())},
                                                "top": top}})
    s.stats.search_time_s = time.perf_counter() - t0
    return SearchResult(plan=plan, best=best.estimate, runners_up=[f.estimate for f in others], stats=s.stats,
                        finalists=finalists)


def _settle(s: _Searcher, finalists: list[Finalist], top: int) -> None:
    """Order the finalists by `Finalist.rank_key` and simulate those among the first `top` that are not yet
    (the best one only when the simulation cap stopped the search early; runners-up pruned by their bound),
    until the first `top` are all simulated: the plan and its runners-up are the simulation's."""
    order = lambda f: (round(f.rank_key, 12), f.config.to_string())  # noqa: E731
    finalists.sort(key=order)
    while True:
        pending = [f for f in finalists[:top] if not f.simulated]
        if not pending:
            return
        f = pending[0]
        f.estimate = estimate(s.profiles, s.cluster, s.training, f.config, f.layout)
        f.simulated = True
        s.stats.estimated += 1
        finalists.sort(key=order)


def _choose_kernels(s: _Searcher, finalists: list[Finalist], top: int) -> bool:
    """autoplan's own runtime on a GPU: its fused Triton modules save memory traffic but cost host time per call
    (GPUCalibration.fused_call_us), so where a step is bound by the host, torch's kernels are faster (session 17,
    one H200: GPT-1.3B at 2 x 2048 tokens, 0.382 s with torch's, 0.429 with the fused ones). Re-estimate the
    first `top` finalists with torch's kernels; where the fastest of them beats the best fused plan, they
    replace the finalists (s.training too) and the plan runs torch's kernels. True when it did."""
    t = s.training
    if not fused_host_priced(t, s.cluster):
        return False
    eager = t.model_copy(update={"kernels": "torch"})
    alt = [estimate(s.profiles, s.cluster, eager, f.config, f.layout) for f in finalists[:top]]
    s.stats.estimated += len(alt)
    best = finalists[0].estimate.step_time_s
    faster = min((a.step_time_s for a in alt if a.fits), default=best)
    if faster >= best:
        return False
    s.stats.kernels_note = (f"torch's kernels: {faster:.4f} s a step against {best:.4f} with autoplan's fused "
                            "ones, whose host time per call the step cannot hide here (--kernels fused to keep them)")
    kept = [replace(f, estimate=a) for f, a in zip(finalists[:top], alt, strict=True) if a.fits]
    kept.sort(key=lambda f: (round(f.estimate.step_time_s, 12), f.config.to_string()))
    finalists[:] = kept
    s.training = eager
    return True


def _why_slower(est: Estimate, best: Estimate) -> str:
    diff = est.step_time_s - best.step_time_s
    pct = 100 * diff / best.step_time_s
    deltas = sorted(((est.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0), k) for k in est.breakdown),
                    reverse=True)
    worst, name = deltas[0]
    if diff <= 0:
        return "ties with the best plan"
    head = f"+{pct:.1f}% step time; "
    if worst > diff * (1 + 1e-9):  # other parts got cheaper: name the largest saving too
        saved, other = deltas[-1]
        return head + f"{name.replace('_', ' ')} +{worst:.3f} s, {other.replace('_', ' ')} {saved:.3f} s"
    if worst >= 0.5 * diff:
        return head + f"most of it {name.replace('_', ' ')} (+{worst:.3f} s)"
    return head + f"largest part {name.replace('_', ' ')} (+{worst:.3f} s)"


def _check_recompute_pins(fixd: dict, training: TrainingSpec) -> None:
    """`--fix recompute=...` pins only what the software stack recomputes (TrainingSpec.recompute_modes)."""
    if fixd.get("recompute") is None:
        return
    check_recompute_runs(str(fixd["recompute"]), None, None, training)
    if fixd.get("recompute_layers") is not None and training.partial_rest is None:
        raise ConfigError(
            "--fix recompute_layers recomputes some of a stage's layers in full, which this software stack does not "
            "run", f"the stack recomputes with: {training.recompute_modes}, partial_recompute="
            f"{training.partial_recompute}",
            "pin recompute=full alone (every layer), or --stack-set partial_recompute=rest-none for a stack "
            "that has Megatron's block method")


def _explain_no_candidate(model, cluster, training, fixd) -> None:
    """No legal configuration at all: let check_config name the rule the pins (or the sizes) break."""
    cfg = ParallelConfig(**{k: v for k, v in fixd.items() if k in ParallelConfig.model_fields})
    check_config(cfg, model, cluster, training, stage_layers=False)
    raise ConfigError("no legal parallel configuration", f"{model.name} on {cluster.num_gpus} GPUs with "
                      f"batch {training.global_batch_size}, pins {fixd or 'none'}",
                      "relax --fix pins, or use a global batch divisible by more data-parallel degrees")


def _does_not_fit(s: _Searcher, model, cluster, training, fixd) -> DoesNotFitError:
    s.closest_miss()
    cap = s.capacity / GIB
    if s.closest is not None:
        deficit, mesh, parts = s.closest
        need = deficit / GIB
        kn = parts.get("knobs") or Knobs(3 if mesh.dp * mesh.cp > 1 else 0, "1f1b", 1)
        cfg = to_config(mesh, kn, "full").to_string()
        static, act = parts["static"] / GIB, parts["activations"] / GIB
        if static + parts["other"] / GIB > cap:
            factor = 2 ** max(1, math.ceil(math.log2((static) / max(cap - parts["other"] / GIB - act, 1e-9))))
            hint = (f"more GPUs: weights, gradients and optimizer state alone need {static:.1f} GiB per GPU here; "
                    f"try --gpus {cluster.num_gpus * factor}")
        else:
            frac = min(0.9, need / max(act, 1e-9))
            seq = max(1, int(training.seq_length * (1 - frac)) // 2 ** 7 * 2 ** 7) or training.seq_length // 2
            hint = (f"shorter sequence: activations take {act:.1f} GiB per GPU; try --seq-len {seq} "
                    f"(or more GPUs, or a smaller global batch)")
        return DoesNotFitError(
            "no configuration fits in GPU memory",
            f"{model.name} on {cluster.num_gpus}x {cluster.gpu.name} ({cap:.1f} GiB): the closest candidate, {cfg}, "
            f"needs at least {cap + need:.1f} GiB per GPU and misses by {need:.1f} GiB", hint)
    return DoesNotFitError(
        "no configuration fits in GPU memory",
        f"{model.name} on {cluster.num_gpus}x {cluster.gpu.name} ({cap:.1f} GiB): no candidate layout fits",
        f"more GPUs (try --gpus {cluster.num_gpus * 2}), a shorter --seq-len, or fewer --fix pins")
