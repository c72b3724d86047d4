"""What one optimizer step executes on each pipeline rank, as data: FLOPs by phase, bytes per collective and
mesh dimension, bytes per memory category.

Why this module exists: the time model is a sum of rooflines and alpha-beta terms over these quantities; exposing
them lets `autoplan show` print them and `autoplan.runtime.measure` check them against what the runtime executes
(benchmarks/counts.py). They are built from the same layer profiles and `LayerCost`s that `estimate` prices, and
describe autoplan's own runtime (DTensor TP, FSDP2, torch.distributed.pipelining, its CP and EP modules):

- FLOPs as executed (torch.utils.flop_counter conventions): forward = the GEMMs and the attention core (causal
  counted in full); backward = 2x the GEMMs and 2.5x the attention core (the SDPA backward recomputes the scores:
  5 batched matmuls against the forward's 2); recompute = the forward of what is recomputed (full: whole blocks;
  selective: the attention core, which the runtime re-runs even with a flash kernel).
- Bytes per collective follow cost_models.comm: all-reduce the buffer, all-gather the gathered buffer,
  reduce-scatter the full buffer, all-to-all what a rank sends, send/recv the message.
- Memory: the categories of `estimate.memory_of_rank` without the framework overhead (a process constant that
  tensor tracking does not see); "temporaries" are ZeRO-3's gathered layers; the peak is their sum.

Pure functions over data; nothing here imports torch.
"""

from __future__ import annotations

from collections import defaultdict

from .compute import Context, _attention, _gemms
from .estimate import (
    GIB,
    StageCost,
    StageLayout,
    _stages_by_rank,
    context,
    estimate,
    num_microbatches,
)
from .pipeline import in_flight
from .profile import LayerProfile
from .specs import ClusterSpec, ParallelConfig, TrainingSpec

PHASES = ("forward", "backward", "recompute")
# The SDPA backward's matmuls relative to its forward's (torch.utils.flop_counter.sdpa_backward_flop_count:
# recompute QK^T, then dV, dP, dQ, dK = 5 bmm against the forward's QK^T and PV = 2).
ATTN_BWD_FACTOR = 2.5
# Bytes of one expert-count entry in the EP split-size exchange (an int64 tensor of num_experts entries).
_COUNT_BYTES = 8


class _Comm:
    """Accumulates (collective, mesh_dim) -> [count, bytes]."""

    def __init__(self) -> None:
        self.d: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])

    def add(self, coll: str, dim: str, nbytes: float, times: float = 1) -> None:
        if times <= 0:
            return
        e = self.d[(coll, dim)]
        e[0] += times
        e[1] += nbytes * times

    def as_list(self) -> list[dict]:
        return [{"collective": c, "mesh_dim": m, "count": int(round(n)), "bytes": int(round(b))}
                for (c, m), (n, b) in sorted(self.d.items())]


def _stage_layers(stage: StageCost, profiles: list[LayerProfile]) -> list[tuple[LayerProfile, bool]]:
    """(profile, recompute kind) of each layer of a stage in order: 'full', 'selective' or ''."""
    out: list[tuple[LayerProfile, str]] = []
    lay = stage.layout
    if stage.has_embedding:
        out.append((profiles[0], ""))
    n_full = lay.recompute_layers if lay.recompute == "full" else 0
    for k, i in enumerate(range(*lay.layers)):
        kind = "full" if k < n_full else ("selective" if lay.recompute in ("selective", "full") else "")
        out.append((profiles[1 + i], kind))
    if stage.has_head:
        out.append((profiles[-1], ""))
    return out


def layer_flops(p: LayerProfile, ctx: Context, recompute: str) -> dict[str, float]:
    """FLOPs of one layer for one micro-batch on one GPU, by phase."""
    gemm = _gemms(p, ctx)[1]
    attn = _attention(p, ctx)[2]
    rec = gemm + attn if recompute == "full" else (attn if recompute == "selective" else 0.0)
    return {"forward": gemm + attn, "backward": 2.0 * gemm + ATTN_BWD_FACTOR * attn, "recompute": rec}


def layer_comm(p: LayerProfile, ctx: Context, recompute: str, comm: _Comm, times: float) -> None:
    """TP, CP and EP collectives of one layer, forward and backward, `times` micro-batches."""
    e = ctx.act_bytes
    tok = ctx.tokens
    if ctx.tp > 1 and p.tp_allreduces:
        nbytes = tok * p.hidden * e
        n_f = p.tp_allreduces if p.kind != "head" else 0
        n_b = p.tp_allreduces if p.kind != "embedding" else 0
        if recompute == "full":
            n_f *= 2
        for coll in (("reduce_scatter", "all_gather") if ctx.sp else ("all_reduce",)):
            comm.add(coll, "tp", nbytes, times * (n_f + n_b))
    if ctx.cp > 1 and p.attention is not None:
        a = p.attention
        kv_full = ctx.mbs * ctx.seq * (a.kv_heads / min(ctx.tp, a.kv_heads)) * a.head_dim * e
        gathers = 2 * (2 if recompute else 1)  # K and V, again when the attention core is recomputed
        comm.add("all_gather", "cp", kv_full, times * gathers)
        comm.add("all_to_all", "cp", kv_full, times * 2)  # their gradients back to the owners
    if ctx.ep > 1 and p.moe_top_k:
        routed = tok * p.moe_top_k * p.hidden * e
        n_fwd = 2 * (2 if recompute == "full" else 1)
        comm.add("all_to_all", "ep", p.moe_experts * _COUNT_BYTES, times * (n_fwd // 2))
        comm.add("all_to_all", "ep", routed, times * (n_fwd + 2))


def rank_counts(stages: list[StageCost], profiles: list[LayerProfile], ctx: Context, cfg: ParallelConfig,
                m: int, n_stages: int, training: TrainingSpec) -> tuple[dict, _Comm]:
    """FLOPs by phase and the per-micro-batch collectives (TP/CP/EP/PP) of one pipeline rank, for the step."""
    flops = dict.fromkeys(PHASES, 0.0)
    comm = _Comm()
    for s in stages:
        for p, rec in _stage_layers(s, profiles):
            for k, v in layer_flops(p, ctx, rec).items():
                flops[k] += m * v
            layer_comm(p, ctx, rec, comm, m)
        if cfg.pp > 1:
            act = ctx.mbs * training.seq_length // cfg.cp * profiles[0].hidden * ctx.act_bytes
            act /= cfg.tp if cfg.sp else 1
            if s.index > 0:
                comm.add("recv", "pp", act, m)
                comm.add("send", "pp", act, m)
            if s.index < n_stages - 1:
                comm.add("send", "pp", act, m)
                comm.add("recv", "pp", act, m)
    return flops, comm


def dp_comm(dense: float, expert: float, cfg: ParallelConfig, training: TrainingSpec, m: int, comm: _Comm,
            unit_params: list[float]) -> None:
    """Gradient reduction and parameter gathers over dp x cp of one rank's `dense`/`expert` parameters, as FSDP2
    (zero 1-3) and replicate (zero 0) run them: zero 0/1 reduce once per step, zero 2/3 after every micro-batch
    (once under pipeline parallelism, which defers the sync to the last micro-batch); zero 1/2 gather parameters
    once per step, zero 3 per unit for every forward and backward."""
    n = cfg.dp * cfg.cp
    g, w = training.grad_bytes, training.weight_bytes
    edp = n // cfg.ep
    if n > 1:
        if cfg.zero == 0:
            comm.add("all_reduce", "dp", dense * g)
        else:
            syncs = m if cfg.zero >= 2 and cfg.pp == 1 else 1
            comm.add("reduce_scatter", "dp", dense * g, syncs)
            gathers = 1 if cfg.zero < 3 else (2 * m if cfg.pp == 1 else m + 1)
            comm.add("all_gather", "dp", dense * w, gathers)
    if expert and edp > 1:
        comm.add("all_reduce", "edp", expert * g)


def memory_bytes(mem, cluster: ClusterSpec) -> dict[str, float]:
    overhead = cluster.gpu.calibration.framework_overhead_gib * GIB
    out = {"parameters": mem.weights, "gradients": mem.gradients, "optimizer": mem.optimizer,
           "activations": mem.activations, "temporaries": max(0.0, mem.other - overhead)}
    out["peak"] = sum(out.values())
    return out


def predict_counts(profiles: list[LayerProfile], cluster: ClusterSpec, training: TrainingSpec,
                   cfg: ParallelConfig, layout: list[StageLayout] | None = None) -> list[dict]:
    """Per pipeline rank: {"flops": {phase: n}, "comm": [{collective, mesh_dim, count, bytes}],
    "memory_bytes": {category: bytes, "peak": bytes}} for one optimizer step of `cfg` (dp resolved)."""
    est = estimate(profiles, cluster, training, cfg, layout, simulate_pipeline=False)
    ctx = context(cluster, training, cfg)
    m = num_microbatches(cfg, training)
    n_stages = cfg.pp * cfg.vp
    out = []
    fl = in_flight(cfg.schedule, cfg.pp, m, cfg.vp)
    for r, stages in enumerate(_stages_by_rank(est.stages, cfg.pp)):
        flops, comm = rank_counts(stages, profiles, ctx, cfg, m, n_stages, training)
        dense = sum(s.params - s.expert_params for s in stages)
        expert = sum(s.expert_params for s in stages)
        dp_comm(dense, expert, cfg, training, m, comm, [])
        out.append({"flops": {k: int(round(v)) for k, v in flops.items()}, "comm": comm.as_list(),
                    "memory_bytes": {k: int(round(v)) for k, v in memory_bytes(est.memory[r], cluster).items()},
                    "in_flight": fl[r]})
    return out
