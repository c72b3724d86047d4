"""The step: per-stage costs, memory per GPU, the simulated pipeline, data-parallel sync and the optimizer.

`estimate()` is the one entry point: a model (as layer profiles), a cluster, a training setup and a resolved
parallel configuration (optionally with an explicit, possibly uneven, stage layout and per-stage
recomputation) give the predicted step time with its breakdown, memory per pipeline rank with its
breakdown, and MFU/HFU. The search calls the same pieces (`stage_costs`, `memory_of_rank`) many times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from . import comm
from .compute import Context, LayerCost, layer_cost
from .errors import ConfigError
from .pipeline import (
    Timeline,
    closed_form_makespan,
    in_flight,
    interleaved_backward_stage,
    last_backward_stage,
    microbatch_group,
    rank_end_lower_bounds,
    simulate,
)
from .profile import LayerProfile
from .specs import ClusterSpec, ParallelConfig, TrainingSpec

GIB = 1024**3
# Adam step bytes per parameter: read fp32 master, m, v and the fp32 grad, write master, m, v and the
# 16-bit copy (4*4 + 3*4 + 2 = 30), plus reading the grad again for the clipping norm (4).
_ADAM_BYTES_PER_PARAM = 34.0
# With the moments in bf16 (`TrainingSpec.optimizer_dtype`) m and v are read and written at 2 bytes, not 4.
_ADAM_BF16_MOMENTS_SAVING = 2 * 2 + 2 * 2
# Bytes the master copy's update moves beside the moments (`TrainingSpec.master_kind`), the 34 above holding
# fp32's: read and write the fp32 master, write the 16-bit weights (4 + 4 + 2); a 16-bit master 2 + 2 + 2;
# remainders: read and write the bf16 weights and their 16-bit remainders, no separate copy (apex's
# distributed_fused_adam and TE's FusedAdam rebuild the fp32 value from the two halves) 2 + 2 + 2 + 2; in place:
# read and write the 16-bit weights. fp32 parameters (None) are stepped as the fp32 master is.
_ADAM_MASTER_BYTES = {None: 10, "fp32": 10, "bf16": 6, "remainders": 8, "in-place": 4}
# Megatron-LM's DDP bucket: max(40M, 1M * dp) parameters (distributed.py, bucket_size default).
_BUCKET_PARAMS = 40e6


@dataclass(frozen=True)
class StageLayout:
    """Stage i holds blocks [start, stop); recompute mode and, for full, how many of its blocks recompute."""

    layers: tuple[int, int]
    recompute: str = "none"
    recompute_layers: int = 0


@dataclass
class MemoryParts:
    """Bytes on one pipeline rank."""

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.other

    def gib(self) -> dict[str, float]:
        d = {k: getattr(self, k) / GIB for k in ("weights", "gradients", "optimizer", "activations", "other")}
        d["total"] = self.total / GIB
        return d


@dataclass
class StageCost:
    index: int
    layout: StageLayout
    has_embedding: bool
    has_head: bool
    fwd_s: float
    bwd_s: float  # recomputation included
    recompute_s: float  # the re-run operators (inside bwd_s; the checkpoint's own host time is not: it is compute)
    comm_s: float  # exposed TP/CP/EP communication in fwd+bwd
    act_per_mb: float  # activation bytes of one micro-batch
    act_peak_extra: float  # transient bytes during one backward (a recomputed layer's, less its input)
    params: float
    expert_params: float
    model_flops: float  # per micro-batch forward
    recompute_flops: float
    zero3_s: float = 0.0  # exposed ZeRO-3 gathers and reduce-scatters per micro-batch (inside bwd_s)
    p2p_s: float = 0.0  # compute time lost to its pipeline messages per micro-batch (inside fwd_s + bwd_s)
    tied_head: float = 0.0  # a tied LM head's weight elements on this (head) stage, not in params (`tied_head_params`)
    head_params: float = 0.0  # the head layer's own parameters on this (head) stage (final norm, an untied LM head)
    # the stage's blocks after its first: their kept activation bytes per micro-batch and (dense, expert) parameters,
    # for the moment of the first block's backward where gradients are made in the backward (`memory_of_rank`)
    later_blocks_act: float = 0.0
    later_blocks_params: tuple[float, float] = (0.0, 0.0)
    vocab_grad_extra: float = 0.0  # the embedding's whole-vocabulary gradient beyond its shard (`embedding_grad_extra`)
    sp_grads: tuple[int, float] = (0, 0.0)  # (tensors, elements) whose gradient is a partial sum over tp (`sp_partial_grads`)
    loss_transient: float = 0.0  # the loss's transient on the head's stage (compute.loss_transient)
    weight_copies: float = 0.0  # autocast's 16-bit weight copies, once per rank for the step (compute.autocast_terms)
    tensors: int = 0  # parameter tensors of its layers (LayerProfile.tensors), what the optimizer steps one by one
    tp_plain_tensors: int = 0  # of those, the ones tensor parallelism alone leaves plain (LayerProfile.tp_plain_tensors)
    # act_peak_extra less what the stage's later blocks kept and have released by then (their backward runs first):
    # what the runtime holds beyond the kept activations at a partly full stage's recompute (cost_models.counts,
    # the estimate: `peak_transient`); the search's ILP prices act_peak_extra, at most one layer's transient more
    act_peak_extra_net: float = 0.0


@dataclass
class Estimate:
    config: ParallelConfig
    stages: list[StageCost]
    memory: list[MemoryParts]
    step_time_s: float
    breakdown: dict[str, float]
    model_flops: float
    hardware_flops: float
    num_gpus: int
    peak_flops: float
    tokens: int
    capacity_bytes: float
    timeline: Timeline | None = None
    notes: list[str] = field(default_factory=list)
    critical_rank: int = 0  # the pipeline rank that finishes last: the one `breakdown` describes

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time_s / self.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_time_s / self.num_gpus / self.peak_flops

    @property
    def hfu(self) -> float:
        return self.hardware_flops / self.step_time_s / self.num_gpus / self.peak_flops

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s

    @property
    def peak_memory_gib(self) -> float:
        return max(m.total for m in self.memory) / GIB

    @property
    def fits(self) -> bool:
        return max(m.total for m in self.memory) <= self.capacity_bytes

    def as_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "tokens_per_s": self.tokens_per_s,
            "memory_gib": {"per_stage": [m.total / GIB for m in self.memory], "peak": self.peak_memory_gib},
            "breakdown": dict(self.breakdown),
            "parallel": self.config.as_dict(),
            "fits": self.fits,
        }


def num_microbatches(cfg: ParallelConfig, training: TrainingSpec) -> int:
    return training.global_batch_size // (cfg.dp * cfg.mbs)


def context(cluster: ClusterSpec, training: TrainingSpec, cfg: ParallelConfig) -> Context:
    return Context(cluster=cluster, training=training, tp=cfg.tp, cp=cfg.cp, sp=cfg.sp, ep=cfg.ep, mbs=cfg.mbs)


@lru_cache(maxsize=200_000)
def cached_layer_cost(p: LayerProfile, ctx: Context) -> LayerCost:
    return layer_cost(p, ctx)


def even_layout(num_layers: int, cfg: ParallelConfig) -> list[StageLayout]:
    """The configuration's stages: its explicit `layout` if it has one, else blocks spread evenly over pp*vp
    stages (any remainder on the first stages)."""
    n = cfg.pp * cfg.vp
    if cfg.layout is not None:
        from .layout import counts

        sizes = counts(cfg.layout)
    else:
        base, extra = divmod(num_layers, n)
        sizes = [base + (1 if i < extra else 0) for i in range(n)]
    out, start = [], 0
    for i in range(n):
        stop = start + sizes[i]
        nrec = stop - start if cfg.recompute == "full" else 0
        if cfg.recompute == "full" and cfg.recompute_layers is not None:
            nrec = min(stop - start, -(-cfg.recompute_layers // cfg.vp))
        out.append(StageLayout((start, stop), cfg.recompute, nrec))
        start = stop
    return out


def block_recompute(layout: StageLayout, rest: str | None) -> list[str]:
    """Recomputation of each block of a stage, in order: 'full' (the first `recompute_layers` under full),
    'selective' (under selective, and a partly full stage's other blocks where `rest` is 'selective':
    TrainingSpec.partial_rest) or ''."""
    n = layout.layers[1] - layout.layers[0]
    n_full = min(n, layout.recompute_layers) if layout.recompute == "full" else 0
    rest_kind = "selective" if layout.recompute == "selective" or (layout.recompute == "full" and rest == "selective") \
        else ""
    return ["full"] * n_full + [rest_kind] * (n - n_full)


def _stage_layer_costs(stage: StageCost, profiles: list[LayerProfile], ctx: Context,
                       n_stages: int) -> list[LayerCost]:
    start, stop = stage.layout.layers
    out = [cached_layer_cost(profiles[1 + i], ctx) for i in range(start, stop)]
    if stage.index == 0:
        out.append(cached_layer_cost(profiles[0], ctx))
    if stage.index == n_stages - 1:
        out.append(cached_layer_cost(profiles[-1], ctx))
    return out


def stage_cost(index: int, layout: StageLayout, profiles: list[LayerProfile], ctx: Context,
               n_stages: int) -> StageCost:
    """Cost of one (virtual) stage for one micro-batch."""
    blocks = profiles[1:-1]
    parts: list[tuple[LayerCost, bool]] = []  # (cost, is a block)
    has_emb, has_head = index == 0, index == n_stages - 1
    if has_emb:
        parts.append((cached_layer_cost(profiles[0], ctx), False))
    start, stop = layout.layers
    for i in range(start, stop):
        parts.append((cached_layer_cost(blocks[i], ctx), True))
    if has_head:
        parts.append((cached_layer_cost(profiles[-1], ctx), False))
    fwd = sum(c.fwd_s for c, _ in parts)
    bwd = sum(c.bwd_s for c, _ in parts)
    comm_s = sum(c.comm_fwd_s + c.comm_bwd_s for c, _ in parts)
    rec, rec_flops, act, extra, ckpt = 0.0, 0.0, 0.0, 0.0, 0.0
    kinds = iter(block_recompute(layout, ctx.training.partial_rest))
    block_acts: list[float] = []  # kept bytes of each block, in order
    transients: list[float] = []  # each block's recompute transient, in order (0 where not fully recomputed)
    for c, is_block in parts:
        before = act
        kind = next(kinds) if is_block else ""
        if kind == "full":
            rec += c.recompute_full_s
            ckpt += c.checkpoint_full_s
            rec_flops += c.recompute_flops_full
            act += c.act_full
            # while its backward runs, the layer's recomputed activations are alive beside the kept ones; its
            # input is the checkpoint itself (torch.utils.checkpoint), already counted in act_full
            extra = max(extra, c.act_none - c.act_full)
        elif kind == "selective":
            rec += c.recompute_selective_s
            ckpt += c.checkpoint_selective_s
            rec_flops += c.recompute_flops_selective
            act += c.act_selective
        else:
            act += c.act_none
        if is_block:
            block_acts.append(act - before)
            transients.append(c.act_none - c.act_full if kind == "full" else 0.0)
    net = max((t - sum(block_acts[j + 1:]) for j, t in enumerate(transients) if t > 0), default=0.0)
    later = [c for c, is_block in parts if is_block][1:]
    mine = [profiles[i] for i in ([0] if has_emb else []) + list(range(1 + start, 1 + stop))
            + ([len(profiles) - 1] if has_head else [])]
    return StageCost(
        tensors=sum(p.tensors() for p in mine), tp_plain_tensors=sum(p.tp_plain_tensors() for p in mine),
        index=index, layout=layout, has_embedding=has_emb, has_head=has_head, fwd_s=fwd, bwd_s=bwd + rec,
        recompute_s=rec - ckpt, comm_s=comm_s, act_per_mb=act, act_peak_extra=extra,
        act_peak_extra_net=max(0.0, net),
        params=sum(c.params_local for c, _ in parts), expert_params=sum(c.expert_params_local for c, _ in parts),
        model_flops=sum(c.model_flops for c, _ in parts), recompute_flops=rec_flops,
        tied_head=tied_head_params(profiles, ctx.tp) if has_head else 0.0,
        head_params=cached_layer_cost(profiles[-1], ctx).params_local if has_head else 0.0,
        later_blocks_act=sum(block_acts[1:]),
        later_blocks_params=(sum(c.params_local - c.expert_params_local for c in later),
                             sum(c.expert_params_local for c in later)),
        vocab_grad_extra=embedding_grad_extra(profiles, ctx.tp) if has_emb else 0.0,
        sp_grads=_sum_pairs([sp_partial_grads(profiles[1 + i]) for i in range(start, stop)]
                            + ([sp_partial_grads(profiles[0])] if has_emb else [])
                            + ([sp_partial_grads(profiles[-1])] if has_head else []))
        if ctx.sp and ctx.tp > 1 else (0, 0.0),
        loss_transient=sum(c.loss_transient for c, _ in parts),  # the head's, where the stage has it
        weight_copies=sum(c.weight_copies for c, _ in parts),
    )


def sp_partial_grads(p: LayerProfile) -> tuple[int, float]:
    """(tensors, elements) of layer `p`'s weights that are replicated over tp but see sequence-sharded inputs under
    sequence parallelism, so that each rank's gradient is a partial sum to be all-reduced over tp: the norms'
    weights (and LayerNorm's biases), the biases of the row-parallel layers (added after the reduce-scatter), a
    learned position embedding. Each is `hidden` elements except the position table (one tensor)."""
    if not p.params_replicated:
        return 0, 0.0
    if p.kind == "embedding":
        return 1, float(p.params_replicated)
    norms = (2 if p.kind == "block" else 1) * (2 if p.norm_kind == "layernorm" else 1) if p.norm_kind else 0
    rest = p.params_replicated - norms * p.hidden  # row-parallel biases: attention's, and the MLP's unless MoE
    biases = (1 if p.moe_top_k else 2) if rest > 0 and p.kind == "block" else 0
    return norms + biases, float(p.params_replicated)


def _sum_pairs(pairs) -> tuple[int, float]:
    n, e = 0, 0.0
    for a, b in pairs:
        n, e = n + a, e + b
    return n, e


def sp_grad_reduce_time(tensors: int, elems: float, *, tp: int, cluster: ClusterSpec,
                        training: TrainingSpec) -> float:
    """Once per step under sequence parallelism, the tp all-reduce of the gradients `sp_partial_grads` names
    (`tensors` of them, `elems` elements on the rank). Megatron coalesces them into one flat buffer and one
    all-reduce (`sp_grads_coalesced`: finalize_model_grads' `_allreduce_layernorm_grads`, `_flatten_dense_tensors`);
    autoplan's runtime redistributes each DTensor gradient from Partial to Replicate on its own (FSDP2's
    post-backward, or Trainer._finalize_grads without data parallelism): one collective, with its latency, per
    tensor."""
    if tensors <= 0 or tp <= 1:
        return 0.0
    grp = comm.group_of(cluster, tp, 1)
    nbytes = elems * training.grad_bytes
    if training.sp_grads_coalesced:
        return comm.all_reduce(cluster, grp, nbytes)
    return tensors * comm.all_reduce(cluster, grp, nbytes / tensors)


def tied_head_params(profiles: list[LayerProfile], tp: int) -> float:
    """Elements per tp rank of a tied LM head's weight, 0 if the head is untied (the profile counts a tied head's
    weight once, on the embedding: its head GEMM has count 0)."""
    head = profiles[-1]
    if head.gemms and head.gemms[0].count == 0:
        return head.gemms[0].n * head.gemms[0].k / tp
    return 0.0


def embedding_grad_extra(profiles: list[LayerProfile], tp: int) -> float:
    """Elements a vocabulary-parallel embedding's gradient holds beyond its shard in autoplan's runtime. DTensor runs
    the embedding's backward (embedding_dense_backward) for the whole vocabulary and hands AccumulateGrad this rank's
    rows as a view of it, so the first micro-batch's .grad keeps the whole-vocabulary storage for the rest of the
    step (later micro-batches add into it). Where it applies: `embedding_grad_whole`."""
    emb, head = profiles[0], profiles[-1]
    if tp == 1 or emb.kind != "embedding":
        return 0.0
    return head.logits_per_token * emb.hidden * (1 - 1 / tp)


def uses_replicate(*, tp: int, zero: int, dp_cp: int) -> bool:
    """Whether autoplan's runtime runs data parallelism as FSDP2's `replicate` (ZeRO-0 over dp x cp > 1 ranks
    where parameters are DTensors, i.e. tp > 1: torch's DDP reducer takes plain tensors only): a second, sharded
    copy beside each parameter, one all-reduce per block and stage root, FSDP2's hooks on every unit. Otherwise
    ZeRO-0 is torch's DDP (one copy of parameters and of gradients, the gradients views of its 25 MiB buckets,
    no hooks), pipelined stages included: torch.distributed.pipelining syncs a DDP stage in the last
    micro-batch's backward. The runtime's choice: runtime.parallelize.apply_dp. The one place the cost model,
    the search and the fit spell the rule."""
    return zero == 0 and dp_cp > 1 and tp > 1


def uses_fsdp2(*, tp: int, zero: int, dp_cp: int) -> bool:
    """Whether FSDP2 manages the parameters in autoplan's runtime: `fully_shard` at ZeRO >= 1 or `replicate`
    (`uses_replicate`), over dp x cp > 1 ranks (runtime.parallelize.apply_dp): DTensor parameters, FSDP2's hooks on
    every unit."""
    return (zero >= 1 and dp_cp > 1) or uses_replicate(tp=tp, zero=zero, dp_cp=dp_cp)


def uses_torch_ddp(*, tp: int, zero: int, dp_cp: int) -> bool:
    """Whether autoplan's runtime runs data parallelism as torch's DDP (ZeRO-0 over dp x cp > 1 ranks without
    `uses_replicate`), with or without a pipeline."""
    return zero == 0 and dp_cp > 1 and not uses_replicate(tp=tp, zero=zero, dp_cp=dp_cp)


def grads_made_in_backward(cfg: ParallelConfig, m: int, training: TrainingSpec) -> bool:
    """Whether no gradient exists on a rank before its step's backward makes it, so that the activations' peak and
    the gradients' do not meet: on autoplan's runtime (`TrainingSpec.runtime_memory`), one micro-batch, no
    pipeline, and not torch's DDP. runtime.engine.Trainer.step sets every gradient to None at the start of a step
    except DDP's (views of its buckets, allocated once); AccumulateGrad then allocates each gradient in the
    backward as the activations it was computed from are freed, and FSDP2 (`replicate`, `fully_shard`) reduces each
    unit's in its post-backward. With a second micro-batch the first one's gradients are alive through the
    second's forward and backward; under a pipeline the schedule's micro-batches overlap on a rank (both priced as
    before: every gradient at the peak). Measured (benchmarks/counts.py, tiny-gpt, one micro-batch): tp=4, dp=2 x
    tp=2 (`replicate`) and dp=4 at ZeRO-1/2/3 hold no gradient at the forward's and the head's peak, the head's
    own at the last block's backward, every one at the optimizer step."""
    return grads_made_in_backward_of(pp=cfg.pp, m=m, tp=cfg.tp, zero=cfg.zero, dp_cp=cfg.dp * cfg.cp,
                                     training=training)


def grads_made_in_backward_of(*, pp: int, m: int, tp: int, zero: int, dp_cp: int, training: TrainingSpec) -> bool:
    """`grads_made_in_backward` of the degrees (the search's form)."""
    return training.runtime_memory and m == 1 and pp == 1 and not uses_torch_ddp(tp=tp, zero=zero, dp_cp=dp_cp)


def memory_moment_note(cfg: ParallelConfig, training: TrainingSpec) -> str:
    """One line for a memory table where its gradients and activations are not all held at once
    (`grads_made_in_backward`): what its categories are; else ""."""
    if not grads_made_in_backward(cfg, num_microbatches(cfg, training), training):
        return ""
    return ("one micro-batch: gradients are made in the backward, so the columns are those of the fullest moment: "
            "the last block's backward (every activation, the head's gradients), the first block's (its and the "
            "embedding's activations, every later layer's gradients) or the optimizer step (every gradient, no "
            "activation)")


def grad_bytes_per_param(cfg: ParallelConfig, training: TrainingSpec) -> tuple[float, float]:
    """Gradient bytes a rank holds per dense and per expert parameter (`memory_of_rank`'s gradients, less the
    embedding's whole-vocabulary extra): whole, or ZeRO-2/3's shards without a pipeline, and on autoplan's runtime
    what it holds beyond them (`runtime_per_param`)."""
    shard_d = cfg.dp * cfg.cp
    shard_e = max(1, shard_d // cfg.ep)
    g = training.grad_bytes
    dense, expert = (g / shard_d, g / shard_e) if cfg.zero >= 2 and cfg.pp == 1 else (g, g)
    if training.runtime_memory:
        (_, dg, _), (_, eg, _) = runtime_per_param(dp=cfg.dp, cp=cfg.cp, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep,
                                                   zero=cfg.zero, training=training)
        dense, expert = dense + dg, expert + eg
    return dense, expert


def head_grad_bytes(stages: list[StageCost], training: TrainingSpec) -> float:
    """Gradient bytes a rank holds at its last block's backward when gradients are made in the backward
    (`grads_made_in_backward`): the head layer's own (final norm, an untied LM head: the layers after the last
    block; a tied head's weight gradient waits in the autograd engine for the embedding's, a temporary:
    counts._moments)."""
    return sum(s.head_params for s in stages) * training.grad_bytes


def one_pass_config(cfg: ParallelConfig, m: int) -> ParallelConfig:
    """The configuration whose memory a rank holds under `cfg` with `m` micro-batches: ZeRO-1 with one micro-batch
    and no pipeline is ZeRO-2. The runtime syncs FSDP2 in the last micro-batch (runtime.engine `_set_sync`), here
    the only one: it reduce-scatters in that backward (gradients: ZeRO-2's shards at the optimizer step) after
    gathering the parameters in that forward (the gather's last output kept to the forward's end, as ZeRO-2's:
    counts._forward_gather)."""
    zero = one_pass_zero(cfg.zero, m, cfg.pp)
    return cfg if zero == cfg.zero else cfg.model_copy(update={"zero": zero})


def one_pass_zero(zero: int, m: int, pp: int) -> int:
    """`one_pass_config`'s ZeRO stage, from the degrees (the search's form)."""
    return 2 if zero == 1 and m == 1 and pp == 1 else zero


def runtime_per_param(*, dp: int, cp: int, tp: int, pp: int, ep: int, zero: int,
                      training: TrainingSpec) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Bytes per dense and per expert parameter (weights, gradients, optimizer state) that autoplan's runtime holds
    beyond `memory_of_rank`'s Megatron-style count (`runtime_extra`; the search's `CostTable.static_per_param` adds
    the same):
    - dense: FSDP2 keeps each sharded parameter beside its unsharded copy: a full second copy under `replicate`
      (zero 0 with dp x cp > 1 and tp > 1, where DDP cannot be used: `uses_replicate`), a 1/(dp x cp) shard under
      zero 1/2; DDP (zero 0 otherwise, pipelined or not) keeps one copy of parameters and one of gradients (views
      of its buckets);
    - expert: experts are whole on every tp rank (not split over tp: tp - 1 more copies, with their gradients and
      optimizer state), and FSDP2 ignores them, so ZeRO does not shard the rank's own experts (what
      `memory_of_rank` divides by dp x cp / ep is whole)."""
    n = dp * cp
    w, g = training.weight_bytes, training.grad_bytes
    opt = training.optimizer_state_bytes
    if uses_replicate(tp=tp, zero=zero, dp_cp=n):
        dense_w = float(w)
    elif n > 1 and zero in (1, 2):
        dense_w = w / n
    else:
        dense_w = 0.0
    shard_e = max(1, n // ep) if zero >= 1 else 1
    grads_sharded = zero >= 2 and pp == 1
    unshard = 1 - 1 / shard_e
    # the tp - 1 more copies are whole like the rank's own experts (FSDP2 and replicate ignore every expert
    # parameter: runtime.parallelize.apply_dp's ignored_params), whatever the ZeRO stage
    expert = ((tp - 1) * w + (unshard * w if zero >= 3 else 0.0),
              (tp - 1) * g + (unshard * g if grads_sharded else 0.0),
              (tp - 1) * opt + unshard * opt)
    return (dense_w, 0.0, 0.0), expert


def tied_copy(stages: list[StageCost], cfg: ParallelConfig) -> float:
    """Parameters of a tied LM head's own copy on the last of several pipeline stages (kept equal to the
    embedding by an all-reduce, `tied_grad_sync`; the profile counts the tied head once, on the embedding, which
    is right only where one rank holds both). The rank holds it as any dense parameter: 16-bit weight, gradient,
    optimizer state (and on autoplan's runtime FSDP2's copies), its gradient reduced over data parallelism with
    the stage's others, its update in the optimizer step. On every stack that pipelines a tied model:
    - Megatron-LM (2021-22, megatron/model/module.py `initialize_word_embeddings`): "In a pipelined setup with more
      than one stage, the initial embedding layer and the head are on different workers, so we do the following:
      1. Create a second copy of word_embeddings on the last stage, with initial parameters of 0.0. [...] 3. In the
      training loop, before an all-reduce between the grads of the two word_embeddings layers to ensure that every
      applied weight update is the same on both stages." -- a `VocabParallelEmbedding` parameter of the last
      stage's module, so in its DDP buffer and optimizer groups (Megatron-Core: `shared_embedding_or_output_weight`,
      the output layer's own weight on the last stage);
    - Megatron-DeepSpeed's GPTModelPipe: `TiedLayerSpec('embed', EmbeddingPipe, ..., forward_fn=_logits_helper,
      tied_weight_attr='word_embeddings_weight')` at both ends; DeepSpeed's PipelineModule builds the tied module on
      every stage that holds one of its specs (deepspeed/runtime/pipe/module.py `_build`, `tied_modules`);
    - autoplan's runtime: the last stage's `output.weight` (runtime/parallelize.py ties it only where the stage
      also holds the embedding)."""
    return sum(s.tied_head for s in stages) if cfg.pp > 1 else 0.0


def parameter_kind(*, tp: int, zero: int, dp_cp: int) -> Literal["fsdp2", "tp", "plain"]:
    """How autoplan's runtime holds the parameters (runtime.parallelize.apply_tp / apply_dp): "fsdp2", every one a
    DTensor (`fully_shard` at ZeRO >= 1 over dp x cp > 1, or `replicate`: `uses_replicate`); "tp", tensor
    parallelism alone, which leaves the norms and a learned position table plain; "plain" (torch's DDP, one
    process)."""
    if uses_fsdp2(tp=tp, zero=zero, dp_cp=dp_cp):
        return "fsdp2"
    return "tp" if tp > 1 else "plain"


def dtensors_of(kind: str, tensors: float, tp_plain: float) -> float:
    """Of `tensors` parameter tensors (`tp_plain` of them left plain by tp alone), the DTensors under `kind`
    (`parameter_kind`)."""
    return 0.0 if kind == "plain" else tensors - (tp_plain if kind == "tp" else 0.0)


def rank_dtensors(stages: list[StageCost], cfg: ParallelConfig) -> float:
    """DTensor parameters the optimizer of a pipeline rank holding `stages` steps (`dtensors_of`): its layers'
    tensors and a tied head's own copy (`tied_copy`)."""
    kind = parameter_kind(tp=cfg.tp, zero=cfg.zero, dp_cp=cfg.dp * cfg.cp)
    n = sum(s.tensors for s in stages) + (1 if tied_copy(stages, cfg) else 0)
    return dtensors_of(kind, n, sum(s.tp_plain_tensors for s in stages))


def dtensor_optimizer_time(dtensors: float, cluster: ClusterSpec) -> float:
    """Host time the optimizer step spends on DTensor parameters beyond plain ones: the fused AdamW op takes every
    parameter, gradient and moment of a group as DTensors and DTensor's dispatch unwraps each in Python, so it goes
    per tensor (`GPUCalibration.dtensor_param_us`), over the rank's `dtensors` (`rank_dtensors`). Measured on this
    CPU in one process (session 14): 4.7 us a tensor plain, 16 us as DTensors; inside a 4-process step 2.4 ms
    against 0.55 for tiny-gpt's 68 tensors."""
    return dtensors * cluster.gpu.calibration.dtensor_param_us * 1e-6


def rank_params(stages: list[StageCost], cfg: ParallelConfig) -> tuple[float, float]:
    """(dense, expert) parameters a pipeline rank holding `stages` keeps, reduces over data parallelism and steps:
    its layers' and a tied head's own copy (`tied_copy`)."""
    dense = sum(s.params - s.expert_params for s in stages) + tied_copy(stages, cfg)
    return dense, sum(s.expert_params for s in stages)


def tied_sync_group(cluster: ClusterSpec, *, pp: int, tp: int, cp: int, dp: int) -> comm.Group:
    """The embedding group: the first and the last pipeline rank with the same tp/cp/dp coordinates, pp-1 pipeline
    strides of tp*cp*dp ranks apart (pipeline outermost: Megatron's rank order, DeepSpeed's PipeModelDataParallel
    topology ['pipe', 'data', 'model'], autoplan's (pp, dp, cp, tp) mesh): two nodes once that distance fills one."""
    return comm.group_of(cluster, 2, (pp - 1) * tp * cp * dp)


def tied_sync_bytes(tied: float, *, dp: int, cp: int, zero: int, training: TrainingSpec) -> float:
    """Bytes of the embedding group's all-reduce of a tied word embedding's gradient (`tied` elements per tp rank).
    The gradient as the rank holds it after its data-parallel reduction, in the gradient-reduction dtype
    (`TrainingSpec.grad_bytes`):
    - Megatron-LM 2021 (training.py, train_step, after `model_module.allreduce_gradients()`): "grad =
      word_embeddings_weight.main_grad [...] torch.distributed.all_reduce(grad, group=mpu.get_embedding_group())";
      2022 the same in optimizer.py `allreduce_word_embedding_grads`; Megatron-Core's finalize_model_grads.py
      `_allreduce_word_embedding_grads` all-reduces the weight's whole `main_grad` (its grad buffer's dtype:
      fp32 with accumulate_allreduce_grads_in_fp32 / grad_reduce_in_fp32), also with the distributed optimizer;
    - DeepSpeed's PipelineEngine `_exec_reduce_tied_grads`: "grad = weight._hp_grad if self.bfloat16_enabled() else
      weight.grad; dist.all_reduce(grad, group=group)" -- the BF16_Optimizer's whole fp32 gradient (2022; today
      `self.using_bf16_optimizer`), ZeRO-1 or not;
    - autoplan's runtime (runtime/engine.py `_finalize_grads`, (c)): `dist.all_reduce(_local(g), group=self.
      tied_group)` after FSDP2 has reduced the gradients: under ZeRO >= 1 the local gradient is the rank's
      1/(dp*cp) shard. `TrainingSpec.runtime_memory` marks autoplan's runtime (the one FSDP2 stack here that ties:
      torchtitan's models are untied, stacks.py)."""
    shard = dp * cp if training.runtime_memory and zero >= 1 else 1
    return tied / shard * training.grad_bytes


def tied_grad_sync(tied: float, *, pp: int, tp: int, cp: int, dp: int, zero: int, cluster: ClusterSpec,
                   training: TrainingSpec) -> float:
    """Time of the all-reduce that sums a tied word embedding's two gradients, on the first and the last pipeline
    rank, once per step after the data-parallel reduction and before the optimizer, not overlapped with anything
    (Megatron-LM: "backward-embedding-all-reduce" between the DP all-reduce and `optimizer.step()`; Megatron-Core:
    finalize_model_grads after `finish_grad_sync`; autoplan: `_finalize_grads` in the step tail. DeepSpeed issues
    ReduceTiedGrads just before ReduceGrads (pipe/schedule.py TrainSchedule): the same two collectives in the
    other order, priced in Megatron's). 0 without a pipeline or a tied head (`tied`: `tied_copy` elements)."""
    if pp <= 1 or tied <= 0:
        return 0.0
    grp = tied_sync_group(cluster, pp=pp, tp=tp, cp=cp, dp=dp)
    return comm.all_reduce(cluster, grp, tied_sync_bytes(tied, dp=dp, cp=cp, zero=zero, training=training))


def sync_tied_ranks(ready: list[float], tied_s: float) -> list[float]:
    """When each pipeline rank may start its optimizer step, from when its own gradient reduction ends (`ready`):
    the first and the last rank wait for each other at the embedding group's all-reduce (`tied_grad_sync`,
    `tied_s`), then both spend it."""
    if tied_s <= 0 or len(ready) < 2:
        return list(ready)
    out = list(ready)
    out[0] = out[-1] = max(ready[0], ready[-1]) + tied_s
    return out


def embedding_grad_whole(stages: list[StageCost], cfg: ParallelConfig) -> float:
    """Gradient elements a rank's vocabulary-parallel embedding holds beyond its shard (`embedding_grad_extra`).
    Where the rank also holds a tied LM head the head's gradient (its own shard) arrives first and becomes the
    .grad, and the embedding's is added to it and freed. Measured without data parallelism (tiny-gpt tp=2,pp=2)
    and under FSDP2's `replicate` (zero 0: tiny-moe dp=2,tp=2,ep=2, untied); not priced under ZeRO, where FSDP2
    reduce-scatters the unsharded gradient and frees it (unmeasured)."""
    if cfg.zero > 0 or any(s.tied_head for s in stages):
        return 0.0
    return sum(s.vocab_grad_extra for s in stages)


def runtime_extra(stages: list[StageCost], cfg: ParallelConfig, training: TrainingSpec,
                  dense: float, expert: float) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes autoplan's runtime holds on a rank beyond `memory_of_rank`'s base
    count of `dense` (the tied copy included) and `expert` parameters: `runtime_per_param` and the embedding's
    whole-vocabulary gradient. Verified with the rest of the runtime's memory against tensor-level measurement
    (cost_models.counts.memory_bytes, benchmarks/counts.py)."""
    (dw, dg, do), (ew, eg, eo) = runtime_per_param(dp=cfg.dp, cp=cfg.cp, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep,
                                                   zero=cfg.zero, training=training)
    vocab = embedding_grad_whole(stages, cfg) * training.grad_bytes
    return dense * dw + expert * ew, dense * dg + expert * eg + vocab, dense * do + expert * eo


def rank_gradients(stages: list[StageCost], cfg: ParallelConfig, training: TrainingSpec) -> float:
    """Gradient bytes a rank holding `stages` has once every gradient exists: `grad_bytes_per_param` over its
    parameters, and on autoplan's runtime the embedding's whole-vocabulary gradient (`embedding_grad_whole`)."""
    dense, expert = rank_params(stages, cfg)
    gd, ge = grad_bytes_per_param(cfg, training)
    vocab = embedding_grad_whole(stages, cfg) * training.grad_bytes if training.runtime_memory else 0.0
    return dense * gd + expert * ge + vocab


def peak_transient(stages: list[StageCost]) -> float:
    """A rank's recompute transient at its fullest moment, beyond every in-flight micro-batch's kept activations:
    a fully recomputed block's re-run activations less what the same micro-batch's later blocks kept and have
    released by then (their backward runs first; `StageCost.act_peak_extra_net`). Measured so on autoplan's
    runtime (benchmarks/counts.py, the partly full layouts); the search's stage ILP prices the whole transient
    (`act_peak_extra`: conservative by at most one layer's transient on a partly full stage)."""
    return max((s.act_peak_extra_net for s in stages), default=0.0)


def memory_of_rank(stages: list[StageCost], rank_inflight: float, cfg: ParallelConfig, cluster: ClusterSpec,
                   training: TrainingSpec, m: int | None = None) -> MemoryParts:
    """Memory of one pipeline rank holding `stages` (its virtual stages) with `rank_inflight` micro-batches:
    Megatron's count (a tied head's own copy on the last of several stages included, `tied_copy`), plus
    (`TrainingSpec.runtime_memory`, the autoplan stack) what autoplan's runtime holds on top of it
    (`runtime_extra`, the tied copy as a dense parameter). Every gradient is counted beside the activations,
    unless the step's `m` micro-batches make them in the backward (`grads_made_in_backward`): then the fullest of
    three moments, each with the rest (counts.memory_bytes has them apart):
    - the last block's backward: every activation, the head's gradients (`head_grad_bytes`);
    - the first block's backward: its and the embedding's activations and the transients, every later layer's
      gradients as the step holds them (`one_pass_config`, each unit reduced in its post-backward) and the
      head's, not yet reduced (FSDP2 reduces the root unit last). The moments between are linear in the blocks
      done, so these two bound them;
    - the optimizer step: every gradient, no activation."""
    if m is not None and grads_made_in_backward(cfg, m, training):
        out = memory_of_rank(stages, rank_inflight, cfg, cluster, training)
        end_cfg = one_pass_config(cfg, m)
        ends = rank_gradients(stages, end_cfg, training)
        head = head_grad_bytes(stages, training)
        gd, ge = grad_bytes_per_param(end_cfg, training)
        # the first block's moment: every later block released, its recompute transient whole beside the rest
        # (`out` holds the transients net of the micro-batch's later blocks, act_peak_extra_net)
        gross = max((s.act_peak_extra for s in stages), default=0.0)
        first = (out.activations - peak_transient(stages) + gross
                 - rank_inflight * sum(s.later_blocks_act for s in stages),
                 head + sum(s.later_blocks_params[0] * gd + s.later_blocks_params[1] * ge for s in stages))
        out.activations, out.gradients = max([(out.activations, head), first, (0.0, ends)], key=sum)
        return out
    runtime = training.runtime_memory
    dense, expert = rank_params(stages, cfg)  # a tied head's own copy (pp > 1) on every stack
    shard_d = cfg.dp * cfg.cp
    shard_e = max(1, shard_d // cfg.ep)
    w_bytes = training.weight_bytes
    opt_bytes = training.optimizer_state_bytes  # master copy + Adam first and second moments
    params_eff = dense + expert
    sharded = dense / shard_d + expert / shard_e
    m = MemoryParts()
    m.weights = (sharded if cfg.zero >= 3 else params_eff) * w_bytes
    # Under pipeline parallelism the runtime's schedule (torch.distributed.pipelining) defers FSDP's gradient
    # reduce-scatter to the last micro-batch, so ZeRO-2/3 keep whole gradients during the step: priced as run
    # (the plan's runtime_semantics says so; cost_models.counts.runtime_semantics). `rank_gradients`.
    m.gradients = rank_gradients(stages, cfg, training)
    m.optimizer = (sharded if cfg.zero >= 1 else params_eff) * opt_bytes
    if runtime:
        w, _, o = runtime_extra(stages, cfg, training, dense, expert)
        m.weights += w
        m.optimizer += o
    per_mb = sum(s.act_per_mb for s in stages) / max(1, len(stages))  # one chunk's worth, averaged
    chunks = len(stages)
    m.activations = rank_inflight * per_mb * chunks + peak_transient(stages)
    m.activations += sum(s.weight_copies for s in stages)  # kept by autocast once for the step, every layer's
    other = cluster.gpu.calibration.framework_overhead_gib * GIB
    # the loss's transient (autoplan's runtime): booked with the fixed overheads, so the peak adds it to the largest
    # backward transient rather than taking the larger (conservative by the smaller of the two; the search's
    # capacity does the same: search.core)
    other += max((s.loss_transient for s in stages), default=0.0)
    if cfg.zero >= 3:  # all-gathered weights of the current and the prefetched layer
        biggest = max((s.params / max(1, s.layout.layers[1] - s.layout.layers[0]) for s in stages), default=0.0)
        other += 2 * biggest * w_bytes
    m.other = other
    return m


def dp_sync(dense: float, expert: float, *, dp: int, cp: int, tp: int, ep: int, zero: int, cluster: ClusterSpec,
            training: TrainingSpec, units: int = 0) -> tuple[float, float, float]:
    """(gradient reduction, parameter all-gather after the step, last-bucket tail) of one pipeline rank holding
    `dense` and `expert` parameters. Gradients reduce over dp*cp (expert ones over dp*cp/ep), as Megatron.
    `units`: the all-reduces ZeRO-0 sends on the rank (runtime_dp_units): per block and root under `replicate`,
    one or more per local stage under DDP; those beyond the bucket count add their latency."""
    n = dp * cp
    if n <= 1:
        return 0.0, 0.0, 0.0
    g_bytes = training.grad_bytes
    w_bytes = training.weight_bytes
    grp_d = comm.group_of(cluster, n, tp)
    grp_e = comm.group_of(cluster, max(1, n // ep), tp * ep)
    if zero == 0:
        red = comm.all_reduce(cluster, grp_d, dense * g_bytes) + comm.all_reduce(cluster, grp_e, expert * g_bytes)
        # The runtime's per-block `replicate` (tp > 1) sends one all-reduce per unit where bucketed DDP (every
        # other ZeRO-0 layout, pipelined or not) sends one per bucket: the extra collectives' latency (bytes are
        # the same).
        buckets = math.ceil((dense + expert) / _BUCKET_PARAMS)
        red += max(0, units - buckets) * comm.all_reduce(cluster, grp_d, 1.0)
        gather = 0.0
    elif zero <= 2 and training.grad_sync_all_reduce:
        # DeepSpeed's BF16_Optimizer: the whole fp32 gradient is all-reduced, then each rank steps its shard and
        # the 16-bit parameters are all-gathered (TrainingSpec.grad_sync_all_reduce; sources in stacks.py).
        red = comm.all_reduce(cluster, grp_d, dense * g_bytes) + comm.all_reduce(cluster, grp_e, expert * g_bytes)
        gather = comm.all_gather(cluster, grp_d, dense * w_bytes) + comm.all_gather(cluster, grp_e, expert * w_bytes)
    else:
        red = comm.reduce_scatter(cluster, grp_d, dense * g_bytes) + comm.reduce_scatter(cluster, grp_e,
                                                                                          expert * g_bytes)
        gather = 0.0 if zero >= 3 else (
            comm.all_gather(cluster, grp_d, dense * w_bytes) + comm.all_gather(cluster, grp_e, expert * w_bytes))
    bucket = max(_BUCKET_PARAMS, 1e6 * dp)
    tail = red * min(1.0, bucket / max(dense + expert, 1.0))
    return red, gather, tail


def runtime_dp_units(stages: list[StageCost], cfg: ParallelConfig) -> int:
    """Gradient all-reduces of a pipeline rank holding `stages` at ZeRO-0, for dp_sync to charge the latency of
    those beyond one rank-wide bucketing: under `replicate` (tp > 1: `uses_replicate`) one per block plus one per
    stage root; under torch's DDP (runtime.parallelize.apply_ddp) one DDP per local stage, each at least one
    bucket of its own (interleaved schedules: vp of them; Megatron-Core also wraps each model chunk in its own
    DDP), so the floor is the rank's stage count."""
    if uses_replicate(tp=cfg.tp, zero=cfg.zero, dp_cp=cfg.dp * cfg.cp):
        return fsdp_units(stages)
    return len(stages)


def interference(cluster: ClusterSpec, hidden_s: float) -> float:
    """Compute time lost to communication that runs under it: NCCL kernels take SMs and memory bandwidth
    from the GEMMs they overlap (`GPUCalibration.overlap_interference` of the hidden time)."""
    return cluster.gpu.calibration.overlap_interference * max(0.0, hidden_s)


def _stages_by_rank(stages: list[StageCost], pp: int) -> list[list[StageCost]]:
    """The (virtual) stages each pipeline rank holds: stage s runs on rank s mod pp."""
    by_rank: list[list[StageCost]] = [[] for _ in range(pp)]
    for s in stages:
        by_rank[s.index % pp].append(s)
    return by_rank


def _rank_tails(by_rank: list[list[StageCost]], cfg: ParallelConfig, cluster: ClusterSpec,
                training: TrainingSpec, m: int = 1) -> list[tuple[float, float, float, float]]:
    """Per pipeline rank, what follows its last backward: (gradient reduction, its last-bucket tail, optimizer,
    exposed parameter gather and FSDP's per-unit extra, `fsdp_unit_time`)."""
    out = []
    for stages in by_rank:
        dense, expert = rank_params(stages, cfg)  # a tied head's copy is reduced and stepped with the rest
        red, gather, tail = dp_sync(dense, expert, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, zero=cfg.zero,
                                    cluster=cluster, training=training, units=runtime_dp_units(stages, cfg))
        casts = weight_casts_per_step(pp=cfg.pp, zero=cfg.zero, dp_cp=cfg.dp * cfg.cp, tp=cfg.tp, m=m)
        opt = optimizer_time(dense + expert, cfg.dp * cfg.cp if cfg.zero >= 1 else 1, cluster, training, casts) \
            + dtensor_optimizer_time(rank_dtensors(stages, cfg), cluster) \
            + step_scalars_time(tp=cfg.tp, cp=cfg.cp, dp=cfg.dp, pp=cfg.pp, ep=cfg.ep, zero=cfg.zero,
                                cluster=cluster)
        fsdp = fsdp_unit_time(fsdp_units(stages), dense, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp, pp=cfg.pp,
                              zero=cfg.zero, m=m, cluster=cluster, training=training)
        n_sp, e_sp = _sum_pairs(s.sp_grads for s in stages)
        sp_red = sp_grad_reduce_time(n_sp, e_sp, tp=cfg.tp, cluster=cluster, training=training)
        # FSDP2 (replicate or fully_shard, over dp x cp > 1) reduces them in its post-backward, else the step tail
        if cfg.dp * cfg.cp > 1:
            fsdp += sp_red
        else:
            opt += sp_red
        out.append((red, tail, opt, param_gather_exposed(gather, cluster, training) + fsdp))
    return out


def step_scalar_all_reduces(*, tp: int, cp: int, dp: int, pp: int, ep: int, zero: int) -> list[tuple[str, int, int, int]]:
    """The step's scalar all-reduces as autoplan's runtime issues them (runtime.engine.Trainer), as (role, group
    size, stride, count) with tp innermost, then cp, dp, pp (comm.group_of): the loss (with the stop flags) over
    every rank ("world"); the gradient norm's sums of squares once per group of DTensor gradients that shares a
    sharding, over each sharded mesh dimension of it (none for plain tensors: torch's DDP or a pipeline stage
    without TP or FSDP) -- under FSDP2 and TP the TP-sharded weights over dp and tp and the tp-replicated ones
    (norms) over dp, under TP alone (with or without `replicate`) the sharded weights over tp, under FSDP2 alone
    everything over dp x cp --; then the experts' over ep (whenever ep > 1, experts on the rank or not) and the
    total over pp. A few bytes each, but collectives the runtime runs: `counts.scalar_comm` counts them and
    `step_scalars_time` prices them, both from this one list."""
    if tp * cp * dp * pp <= 1:
        return []
    out = [("world", tp * cp * dp * pp, 1, 1)]
    if zero >= 1 and dp * cp > 1:  # FSDP2's fully_shard (runtime.parallelize.apply_dp)
        out.append(("dp", dp * cp, tp, 2 if tp > 1 else 1))
    if tp > 1:
        out.append(("tp", tp, 1, 1))
    if ep > 1:
        out.append(("ep", ep, tp, 1))
    if pp > 1:
        out.append(("pp", pp, tp * cp * dp, 1))
    return out


def step_scalars_time(*, tp: int, cp: int, dp: int, pp: int, ep: int, zero: int, cluster: ClusterSpec) -> float:
    """The scalar all-reduces each step of the runtime makes on the optimizer's path
    (`step_scalar_all_reduces`: the loss over every rank, the gradient norm's sums of squares over each
    dimension that shards a gradient, then ep and pp). A few bytes each, so latency only -- nothing on NVLink, but
    on an oversubscribed CPU node each waits for descheduled peers."""
    # they follow the gradient reduction, which has already brought the ranks together
    idle = comm.peers_present(cluster)
    return sum(n * comm.scalar_all_reduce(idle, comm.group_of(idle, size, stride))
               for _, size, stride, n in step_scalar_all_reduces(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, zero=zero))


def fsdp_units(stages: list[StageCost]) -> int:
    """FSDP units of a pipeline rank holding `stages`: one per block and one per stage root
    (runtime.parallelize.apply_fsdp)."""
    return sum(s.layout.layers[1] - s.layout.layers[0] + 1 for s in stages)


def fsdp_unit_time(units: float, dense: float, *, dp: int, cp: int, tp: int, pp: int, zero: int, m: int,
                   cluster: ClusterSpec, training: TrainingSpec) -> float:
    """What dp_sync's one-bucket pricing leaves out of ZeRO-1/2/3 as autoplan's runtime runs it: FSDP2
    `fully_shard` per block and per stage root (runtime.parallelize.apply_fsdp), so each unit reduce-scatters and
    all-gathers on its own and every collective pays its own latency hops; FSDP2 reshards after every backward
    unless the sync is deferred, so without a pipeline ZeRO-2 reduce-scatters and re-gathers every micro-batch
    (the collective counts are cost_models.counts.dp_comm's, measured by runtime.measure); and around each
    collective FSDP2 does host work (copy-in, copy-out, DTensor views: `fsdp_collective_overhead_us`); and its
    hooks run on every unit in every micro-batch (`fsdp_hook_us`), also under `replicate`, which the runtime uses
    at ZeRO-0 with tensor parallelism (`uses_replicate`; one all-reduce per unit, its latency priced by dp_sync).
    Torch's DDP (ZeRO-0 otherwise, pipelined stages included) has no hooks and no per-unit collectives: 0.
    The extra latency and repeats are charged where the host runs the collectives (gloo). ZeRO-3's
    per-micro-batch bytes and latency are zero3_block_exposed's; its host work is added here, and on gloo the
    latencies of the units' last reductions (dp_sync prices that reduction as one collective). `units`: the
    rank's FSDP units (`fsdp_units`)."""
    n = dp * cp
    replicate = uses_replicate(tp=tp, zero=zero, dp_cp=n)  # runtime.parallelize: else torch's DDP (no hooks)
    if (zero == 0 and not replicate) or n <= 1 or dense <= 0 or units <= 0:
        return 0.0
    cal = cluster.gpu.calibration
    # FSDP2's hooks on every unit in every micro-batch. Under the pipeline schedule (torch.distributed.pipelining,
    # stage.py) every backward but the last runs with reshard-after-backward and gradient sync off, so the units
    # stay unsharded and the hooks of the later micro-batches find nothing to do: measured (session 7, set A)
    # FSDP's host time at pp=2,dp=2 was 6.2 ms at 2 and at 4 micro-batches, while at tp=2,dp=2 it went from 7.7
    # to 22.6 ms from 1 to 4.
    passes = 1 if pp > 1 else m
    hooks = units * passes * cal.fsdp_hook_us * 1e-6
    if replicate:  # one all-reduce per unit, its latency priced by dp_sync (`units`); its host work here
        return hooks + units * cal.fsdp_collective_overhead_us * 1e-6
    fwd_gathers, bwd_gathers, syncs = fsdp_collectives(zero, pp, m)
    gathers = fwd_gathers + bwd_gathers
    host = units * (syncs + gathers) * cal.fsdp_collective_overhead_us * 1e-6 + hooks
    if comm.native_reduce_scatter(cluster):
        # NCCL runs the per-unit collectives on the device, prefetched and overlapped with compute (dp_sync's
        # overlap accounting stands for them); gloo runs them on the host that computes, one after another.
        return host
    grp = comm.group_of(cluster, n, tp)
    g_bytes, w_bytes = dense * training.grad_bytes, dense * training.weight_bytes
    if zero >= 3:
        # zero3_block_exposed prices the gathers and the earlier micro-batches' reductions unit by unit; the
        # step's last reduction is dp_sync's, one collective of the rank's gradients: its units' latencies here
        return host + max(0.0, units * comm.reduce_scatter(cluster, grp, g_bytes / units)
                          - comm.reduce_scatter(cluster, grp, g_bytes))
    per_unit = units * (syncs * comm.reduce_scatter(cluster, grp, g_bytes / units)
                        + gathers * comm.all_gather(cluster, grp, w_bytes / units))
    return host + max(0.0, per_unit - comm.reduce_scatter(cluster, grp, g_bytes) - comm.all_gather(cluster, grp, w_bytes))


def step_time_lower_bound(est: Estimate, cluster: ClusterSpec, training: TrainingSpec, p2p_s: float) -> float:
    """A time the simulated estimate of `est`'s configuration and layout cannot beat, from its stage costs
    (which the closed form and the simulation share): each rank's `rank_end_lower_bounds`, then its gradient
    sync, optimizer and parameter gather. The gradient sync overlaps the rank's last action, a backward of a
    stage the schedule fixes (`last_backward_stage`), exactly as in the simulation (`estimate`'s window is
    rank_end - last_backward_start, that action's duration); under interleaving, where each chunk's share goes
    once the chunk is done (`chunk_sync_window`), it takes all of the reduction as hidden but the last bucket.
    The search keys closed-form finalists by this, so
    an uneven pipeline the closed form overstates is still simulated before it is ruled out."""
    cfg = est.config
    cluster = crowded(cluster, training, cfg)  # as `estimate` priced the stages
    m = num_microbatches(cfg, training)
    by_rank = _stages_by_rank(est.stages, cfg.pp)
    bwd = [s.bwd_s for s in est.stages]
    ends = rank_end_lower_bounds([s.fwd_s for s in est.stages], bwd, cfg.pp, m, cfg.vp,
                                 p2p_s if cfg.pp > 1 else 0.0)
    tails = _rank_tails(by_rank, cfg, cluster, training, m)
    windows = [bwd[last_backward_stage(cfg.schedule, cfg.pp, m, cfg.vp, r)] for r in range(cfg.pp)]
    if cfg.vp > 1 and cfg.schedule == "interleaved":
        # the chunks' reductions can hide under the whole cool-down (`chunk_sync_window`): only the last bucket
        # is certain to be exposed, so the bound takes all of `red` as hidden
        windows = [red for red, _, _, _ in tails]
    ready = [end + dp_exposed(red, tail, window, cluster, training)
             for end, window, (red, tail, _, _) in zip(ends, windows, tails, strict=True)]
    tied_s = tied_grad_sync(tied_copy(by_rank[-1], cfg), pp=cfg.pp, tp=cfg.tp, cp=cfg.cp, dp=cfg.dp, zero=cfg.zero,
                            cluster=cluster, training=training)
    return max(t + opt + g_exp for t, (_, _, opt, g_exp) in zip(sync_tied_ranks(ready, tied_s), tails, strict=True))


def chunk_sync_window(red: float, rank_end: float, launches: list[tuple[float, float]]) -> float:
    """The overlap window (`dp_exposed`'s) a rank's interleaved gradient reduction has when each model chunk's
    share is reduced once that chunk's gradients are complete, not all of it at the rank's end: the shares,
    (launch time, duration), go over the data-parallel network one after another; the window is whatever of `red`
    finished before `rank_end`. Megatron-Core (schedules.py `forward_backward_pipelining_with_interleaving`,
    core_r0.8.0 to today) calls each chunk's `grad_sync_func` once its last micro-batch's backward is done, and
    torch.distributed.pipelining enables FSDP's gradient sync on each stage's last backward (stage.py
    `backward_maybe_with_nosync`, or a REDUCE_GRAD action right after it)."""
    t = 0.0
    for t0, d in sorted(launches):
        t = max(t, t0) + d
    return red - (t - rank_end)


def chunk_sync_launches(rank_stages: list[StageCost], r: int, red: float, backward_ends: list[float],
                        last_backward: Mapping[int, tuple[int, float]] | Sequence[tuple[int, float]],
                        rank_end: float, align: bool) -> list[tuple[float, float]]:
    """(launch, duration) of each of rank r's model chunks' share of its gradient reduction `red` (by parameters):
    at the start of the chunk's last backward (`last_backward[stage]` = its index among the rank's backwards, whose
    end times are `backward_ends`, and its start; a timeline's per-stage list or a map), as the reduction of a
    one-chunk stage is (its buckets fill during it); with `align` (TrainingSpec.align_grad_reduce, Megatron-Core's default) once the rank's backward r
    actions later has ended ("we launch asynchronous communication at the same time across the pipeline-parallel
    group": `grad_sync_microbatch_id = microbatch_id - pipeline_parallel_rank`), or at the rank's end where it has
    none."""
    weights = [s.params + s.expert_params + s.tied_head for s in rank_stages]
    total = sum(weights) or 1.0
    out = []
    for s, w in zip(rank_stages, weights, strict=True):
        idx, start = last_backward[s.index]
        if align:
            j = idx + r
            start = backward_ends[j] if j < len(backward_ends) else rank_end
        out.append((start, red * w / total))
    return out


@lru_cache(maxsize=4096)
def _cool_down_order(r: int, pp: int, vp: int, m: int) -> tuple[int, ...]:
    """The stages of rank r's last round of backwards under the interleaved schedule, in order (the search asks
    for the same few thousand)."""
    n = m * vp
    first = max(0, n - vp * microbatch_group(pp, m))
    return tuple(interleaved_backward_stage(r, k, pp, vp, m) for k in range(first, n))


def interleaved_cool_down(rank_stages: list[StageCost], r: int, rank_end: float, pp: int, vp: int,
                          m: int) -> tuple[list[float], dict[int, tuple[int, float]]]:
    """`chunk_sync_launches`' timeline inputs without a simulation (the closed form): rank r's backwards in
    Megatron's interleaved order (`interleaved_backward_stage`), packed back to back before `rank_end` as its
    cool-down runs them (only backwards: the warm-up's forwards are done). Only the last round, `microbatch_group`
    backwards of each chunk: it holds every chunk's last one (the rounds are equal, check_config), and indices
    count from its start, which leaves `chunk_sync_launches`' "r actions later" as it is."""
    order = _cool_down_order(r, pp, vp, m)
    bwd = {s.index: s.bwd_s for s in rank_stages}
    ends, t = [0.0] * len(order), rank_end
    for k in range(len(order) - 1, -1, -1):
        ends[k] = t
        t -= bwd[order[k]]
    return ends, {stage: (k, ends[k] - bwd[stage]) for k, stage in enumerate(order)}


def dp_exposed(red: float, tail: float, window: float, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Gradient-reduction time past the end of the pipeline: with overlap, buckets reduce during the last
    micro-batch's backward (`window`), leaving at least the last bucket; without, all of it."""
    if not training.overlap_grad_reduce:
        return red
    exposed = max(tail, red - window)
    return exposed + interference(cluster, red - exposed)


def param_gather_exposed(gather: float, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """ZeRO-1/2 parameter all-gather after the optimizer: overlapped with the next forward when the runtime
    does (Megatron's --overlap-param-gather leaves about the first bucket, ~10%), else exposed."""
    if not training.overlap_param_gather:
        return gather
    return 0.1 * gather + interference(cluster, 0.9 * gather)


def casts_once_per_step(*, pp: int, zero: int, dp_cp: int, tp: int) -> bool:
    """Whether autoplan's runtime, computing under autocast over fp32 parameters, casts each weight once per step
    (one autocast cache over the step's forwards, runtime.engine.Trainer) or once per micro-batch: the latter
    where FSDP2 manages the parameters of an unpipelined model (ZeRO >= 1, or `replicate` at ZeRO-0 with tp > 1,
    over dp x cp > 1 ranks), where a cast cached across micro-batches lost gradients (session 13). The runtime
    decides it from its modules (Trainer.step_cast_cache); tests/dist/test_autocast_parity.py checks the two
    agree."""
    return pp > 1 or not uses_fsdp2(tp=tp, zero=zero, dp_cp=dp_cp)


def weight_casts_per_step(*, pp: int, zero: int, dp_cp: int, tp: int, m: int) -> int:
    """How often a step casts the weights under autocast (`optimizer_time`'s `casts`): once, or in each of its
    `m` micro-batches (`casts_once_per_step`)."""
    return 1 if casts_once_per_step(pp=pp, zero=zero, dp_cp=dp_cp, tp=tp) else m


def optimizer_time(params: float, shards: int, cluster: ClusterSpec, training: TrainingSpec | None = None,
                   casts: int = 1) -> float:
    """Adam over the parameters this GPU updates (`shards` = dp*cp with ZeRO>=1, else 1): memory-bound. With
    `training.optimizer_separate_passes` (Megatron-LM's Float16OptimizerWithFloat16Params), the passes around the
    Adam kernel that Megatron runs separately are added. `casts`: how many times per step autoplan's runtime
    casts the weights to 16 bits under autocast (`casts_once_per_step`: 1, or the micro-batches)."""
    gpu = cluster.gpu
    per, whole = _ADAM_BYTES_PER_PARAM, 0.0
    if training is not None:
        per += _ADAM_MASTER_BYTES[training.master_kind] - _ADAM_MASTER_BYTES["fp32"]
        if training.optimizer_dtype == "bf16":
            per -= _ADAM_BF16_MOMENTS_SAVING
    if training is not None and training.optimizer_separate_passes:
        # Megatron-LM MixedPrecisionOptimizer.step() (megatron/optimizer/optimizer.py at de593298, 2022-05-24;
        # the same passes in FP16OptimizerWithFP16Params.step at 50a4b5fa, 2021-04-08), in order:
        # `_copy_model_grads_to_main_grads`: "main_param.grad = model_param.main_grad.float()" -- a cast (read
        # the 16-bit main_grad, write fp32) when main_grad is 16-bit (fp16 without
        # accumulate_allreduce_grads_in_fp32), free when it is already fp32 (bf16 runs);
        # `_unscale_main_grads_and_check_for_nan` (fp16's grad scaler only): "torch._amp_foreach_non_finite_
        # check_and_unscale_(main_grads, ...)", read and write the fp32 grads (8 B);
        # clip_grad_norm (read 4 B: already in _ADAM_BYTES_PER_PARAM);
        # `self.optimizer.step()`: apex FusedAdam over the fp32 master, 28 B, no 16-bit write;
        # `_copy_main_params_to_model_params`: "_multi_tensor_copy_this_to_that(this=main_data, that=model_data"
        # -- reads the master again (4 B; the 16-bit write is already in _ADAM_BYTES_PER_PARAM).
        # And train_step's "partition.zero_grad_buffer()" (megatron/training.py) zeroes the whole main_grad
        # buffer, every local parameter, sharded or not.
        g = training.grad_bytes
        per += (g + 4 if g < 4 else 0) + (8 if training.dtype == "fp16" else 0) + 4
        whole = g
    if training is not None and training.autocast:
        # autoplan's runtime casts every (unsharded) weight to 16 bits once per step, in the first forward, or in
        # every micro-batch's forward under unpipelined FSDP2 (`casts`; compute.autocast_terms): read 4, write 2
        # bytes. Counted over all the rank's parameters; the norms and an untied embedding are not cast (a few
        # percent of them, a ms at 8B). Booked here, with the per-step passes, in both cases.
        whole += 6 * casts
    return (params / shards * per + params * whole) / (gpu.hbm_gbps * 1e9 * gpu.calibration.memory_efficiency)


def fsdp_collectives(zero: int, pp: int, m: int) -> tuple[int, int, int]:
    """FSDP2's collectives per unit in one step of `m` micro-batches as autoplan's runtime runs ZeRO-`zero` (>= 1),
    (forward all-gathers, backward all-gathers, reduce-scatters). FSDP2 reshards after every backward unless the
    sync is deferred (ZeRO-1, or the pipeline schedule, which turns the sync and reshard-after-backward off but for
    the last micro-batch): ZeRO-1 reduces and gathers once a step; ZeRO-2 reduces after every micro-batch and
    gathers again for every forward; ZeRO-3 (reshard after forward) also gathers for every backward -- under a
    pipeline once a step each but its forwards' gathers (`counts.dp_comm`, measured by benchmarks/counts.py)."""
    if zero >= 3:
        return (m, m, m) if pp == 1 else (m, 1, 1)
    if zero == 2 and pp == 1:
        return m, 0, m
    return 1, 0, 1


def zero3_shares(pp: int, m: int) -> tuple[float, float]:
    """Per micro-batch, the backward all-gathers and reduce-scatters `zero3_block_exposed` prices (averaged over
    the step's micro-batches, `fsdp_collectives`): the step's last reduction is the gradient sync `dp_sync`
    prices (overlapped with the last backward like any other), so it is left out here."""
    _, gathers, reduces = fsdp_collectives(3, pp, m)
    return gathers / m, (reduces - 1) / m


def zero3_block_exposed(params_local: float, fwd_s: float, bwd_s: float, *, dp: int, cp: int, tp: int,
                        cluster: ClusterSpec, training: TrainingSpec, pp: int = 1, m: int = 1) -> float:
    """ZeRO-3 per block and micro-batch: its weights are all-gathered for the forward, and, as often as the
    runtime does (`zero3_shares`), again for the backward, and its gradients reduce-scattered; each is prefetched
    behind the neighbouring block's compute (FSDP's one-unit prefetch), so only what compute cannot hide is
    exposed, plus interference. (Before session 22 every micro-batch was priced with a backward gather and a
    reduction, on top of `dp_sync`'s: one reduction too many a step, and m - 1 gathers and m reductions too many
    under a pipeline.)"""
    grp = comm.group_of(cluster, dp * cp, tp)
    w_bytes = training.weight_bytes
    bwd_gathers, reduces = zero3_shares(pp, m)
    ag = comm.all_gather(cluster, grp, params_local * w_bytes)
    rs = comm.reduce_scatter(cluster, grp, params_local * training.grad_bytes)
    bwd = bwd_gathers * ag + reduces * rs
    exposed = max(0.0, ag - fwd_s) + max(0.0, bwd - bwd_s)
    hidden = min(ag, fwd_s) + min(bwd, bwd_s)
    return exposed + interference(cluster, hidden)


def grad_accum_time(params_local: float, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Per micro-batch, the pass that adds this stage's fresh 16-bit gradients into an fp32 accumulation buffer
    when the weight-gradient GEMMs do not accumulate in place (DeepSpeed's BF16_Optimizer and ZeRO hooks;
    Megatron fuses it, gradient_accumulation_fusion): read the 16-bit gradient and the fp32 buffer, write the
    buffer. Memory-bound."""
    if training.grad_accum_fused:
        return 0.0
    gpu = cluster.gpu
    # the buffer is in the gradient-reduction dtype (Megatron's main_grad: fp32 with
    # accumulate_allreduce_grads_in_fp32, else the parameters' dtype; DeepSpeed's bf16 optimizer: fp32)
    per_param = training.weight_bytes + 2 * training.grad_bytes
    if training.grad_accum_cast_copy:
        # DeepSpeed's BF16_Optimizer.update_hp_grads (runtime/bf16_optimizer.py, from "bf16+pipeline parallelism"
        # #1801, 56c52238, 2022-04-19, to 2025): `hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype).view(
        # hp_grad.shape))`. `.to(torch.float32)` materialises an fp32 copy of the bf16 gradient (read 2 B, write
        # 4 B), then `add_` reads it and the buffer and writes the buffer (4 + 4 + 4 B): 2 + 4 * 4 = 18 B per
        # parameter instead of a fused add's 2 + 2 * 4 = 10 B. The pipeline engine calls it after every
        # micro-batch's backward (`_exec_backward_pass`: "self.optimizer.update_hp_grads(clear_lp_grads=False)",
        # and on the last stage through `BF16_Optimizer.backward`).
        per_param += 2 * training.grad_bytes
    nbytes = params_local * per_param
    return nbytes / (gpu.hbm_gbps * 1e9 * gpu.calibration.memory_efficiency)


def pipeline_p2p_parts(cluster: ClusterSpec, training: TrainingSpec, *, hidden: int, pp: int, tp: int, cp: int,
                       dp: int, mbs: int, sp: bool = False) -> tuple[float, float]:
    """One activation (or gradient) message between neighbouring pipeline stages, (its time, the part of it
    that moves bytes): a micro-batch's hidden states, split across tp (sequence-parallel / scatter-gather),
    across nodes once tp*cp*dp fills a node. The rest of the time is latency (waiting, not working)."""
    if pp <= 1:
        return 0.0, 0.0
    e = training.weight_bytes  # activations share the weights' dtype
    # Under sequence parallelism each tp rank holds (and every runtime sends) its sequence shard. Without it,
    # Megatron splits the replicated message over the tp ranks (scatter/gather, SC21 sec. 4.1), and so does
    # DeepSpeed's PipelineEngine (is_pipe_partitioned / is_grad_partitioned, PartitionedTensor);
    # p2p_scatter_gather=false (torch.distributed.pipelining: autoplan, torchtitan) sends each tp rank's whole
    # hidden states to its peer and gathers nothing (cost_models.counts.boundary_bytes, measured by
    # benchmarks/counts.py).
    split = tp if sp or training.p2p_scatter_gather else 1
    full = mbs * training.seq_length // cp * hidden * e
    cross = tp * cp * dp >= cluster.gpus_per_node and cluster.num_nodes > 1
    t = comm.p2p(cluster, full / split, cross)
    busy = comm.transfer_time(cluster.inter_node if cross else cluster.intra_node, full / split)
    if split > 1 and not sp:
        # ... and the receiving stage all-gathers the pieces over the tp group (NVLink) before it can use them
        # (SC21 sec. 4.1; DeepSpeed's PartitionedTensor.full()). With sequence parallelism the next stage
        # consumes the sequence-sharded piece as it is (Megatron sends the SP shard): nothing to gather.
        grp = comm.group_of(cluster, tp, 1)
        t += comm.all_gather(cluster, grp, full)
        busy += comm.all_gather(cluster, grp, full) \
            - (grp.per_node - 1) * comm.hop_latency(cluster, cluster.intra_node, grp.per_node) \
            - (grp.nodes - 1) * comm.hop_latency(cluster, cluster.inter_node, grp.per_node)
    return t, busy


def pipeline_p2p_time(cluster: ClusterSpec, training: TrainingSpec, *, hidden: int, pp: int, tp: int, cp: int,
                      dp: int, mbs: int, sp: bool = False) -> float:
    """One activation (or gradient) message between neighbouring pipeline stages (`pipeline_p2p_parts`)."""
    return pipeline_p2p_parts(cluster, training, hidden=hidden, pp=pp, tp=tp, cp=cp, dp=dp, mbs=mbs, sp=sp)[0]


def p2p_occupancy(index: int, n_stages: int, p2p_s: float, cluster: ClusterSpec,
                  training: TrainingSpec, busy_s: float | None = None, vp: int = 1) -> tuple[float, float]:
    """Compute time a (virtual) stage loses per micro-batch to its pipeline messages, (forward, backward).

    The simulated schedule charges a message on the edge it travels (the receiver cannot start before it
    arrives), which hides it whenever the message was sent long before the receiver is free. With blocking
    p2p (`p2p_overlap=false`: Megatron-LM 2021-22 and Megatron-Core's 1F1B post send and receive together and
    wait on them, then synchronise; DeepSpeed's engine broadcasts synchronously) a transfer starts only when both
    ends have posted it, and a receiver posts when it is about to compute: every received message, its input
    activation (forward) or output gradient (backward), is on that stage's critical path. In the steady state
    the sender's blocking send completes with the receive it is waiting for anyway, so nothing is added there.
    (Fill and drain messages are then counted on the edge and here: 2(p-1) of them, a small overcount.)
    With asynchronous p2p (torch.distributed.pipelining, Megatron-Core's --overlap-p2p-communication, Llama 3's
    async p2p) the NCCL send and receive kernels run beside the compute and cost `overlap_interference` of the
    time they move bytes (`busy_s`, default all of it) on both ends: SMs and HBM taken, as for every hidden
    collective; waiting out the latency takes nothing. Interleaving multiplies the stages a rank holds, so its
    messages per micro-batch grow with vp (`vp` also decides Megatron-Core's overlap: TrainingSpec.p2p_overlapped)."""
    if p2p_s <= 0 or n_stages <= 1:
        return 0.0, 0.0
    has_prev, has_next = index > 0, index < n_stages - 1
    if not training.p2p_overlapped(vp):
        return p2p_s * has_prev, p2p_s * has_next  # forward receives from before, backward from after
    k = cluster.gpu.calibration.overlap_interference
    per_phase = k * (p2p_s if busy_s is None else busy_s) * (has_prev + has_next)  # one in, one out per phase
    return per_phase, per_phase


def pipeline_action_time(cluster: ClusterSpec, training: TrainingSpec, n_stages: int) -> float:
    """Host time autoplan's pipeline schedule adds to every action of a (virtual) stage, its forward or its
    backward of one micro-batch (`GPUCalibration.pipeline_action_us`): torch.distributed.pipelining's bookkeeping
    and the posting of the action's receives and sends, beyond the stage's operators. On CPU processes it is on
    the critical path (the thread that runs the schedule runs the operators), and the runtime times it as
    compute (autoplan.tune.records: the schedule's time outside its waits). On a GPU host the schedule runs
    ahead of the kernels and it is not priced. 0 without a pipeline or on another program's stack."""
    if n_stages <= 1 or not training.runtime_memory or cluster.cores_per_node is None:
        return 0.0
    return cluster.gpu.calibration.pipeline_action_us * 1e-6


def crowded(cluster: ClusterSpec, training: TrainingSpec, cfg: ParallelConfig) -> ClusterSpec:
    """`cluster` with configuration `cfg`'s `crowding` on an oversubscribed CPU node (`crowded_for`)."""
    return crowded_for(cluster, training, tp=cfg.tp, cp=cfg.cp, dp=cfg.dp, pp=cfg.pp, mbs=cfg.mbs)


def crowded_for(cluster: ClusterSpec, training: TrainingSpec, *, tp: int, cp: int, dp: int, pp: int,
                mbs: int) -> ClusterSpec:
    """`cluster` with a configuration's `crowding` on an oversubscribed CPU node (ClusterSpec.crowded_fraction):
    the processes of one pipeline stage (tp x cp x dp) and the fraction of the step a stage computes,
    m/(m + pp - 1) (each stage idles for pp - 1 micro-batch slots of fill and drain). Unchanged elsewhere.

    Compute itself does not follow the crowding: the CPU calibration's rates (every process of the node computing
    at once) price every layout's compute. Session 18 compared the runtime's measured compute (`--time-from`,
    17 saved tune sets of tiny-gpt on this 2-core machine, 4 processes) with the estimate's, per unit of work:
    unpipelined layouts 0.74-1.04 of it, pipelines with one micro-batch (stages taking turns) 0.74-0.82, with two
    or more 1.13-1.38; the turn-taking model this replaced (a stage computing alone on whole cores) predicted
    0.5 and 0.75-0.88 of it for those, too fast on every pipelined class, and made the tune's search pick
    pipelines that ran slower than plain DDP (chosen / fastest within 1.05 in 7 of 17 replayed sets; 13 of 17
    without it, docs/notes/session-18)."""
    if not cluster.oversubscribed:
        return cluster
    m = training.global_batch_size // (dp * mbs)
    frac = m / (m + pp - 1) if pp > 1 else 1.0
    return cluster.model_copy(update={"crowding": (tp * cp * dp, frac)})


def estimate(profiles: list[LayerProfile], cluster: ClusterSpec, training: TrainingSpec, cfg: ParallelConfig,
             layout: list[StageLayout] | None = None, *, simulate_pipeline: bool = True,
             keep_timeline: bool = False) -> Estimate:
    """Predict one optimizer step of `cfg` (dp resolved) on `cluster`."""
    if cfg.dp is None:
        raise ConfigError("the configuration's dp is not resolved", cfg.to_string(),
                          "validate it with check_config (which derives dp from the world size) first")
    n_blocks = len(profiles) - 2
    layout = layout or even_layout(n_blocks, cfg)
    cluster = crowded(cluster, training, cfg)
    ctx = context(cluster, training, cfg)
    n_stages = cfg.pp * cfg.vp
    stages = [stage_cost(i, lay, profiles, ctx, n_stages) for i, lay in enumerate(layout)]
    m = num_microbatches(cfg, training)
    # ZeRO-3 per-micro-batch traffic lengthens each stage's slot, block by block.
    if cfg.zero >= 3:
        for s in stages:
            for c in _stage_layer_costs(s, profiles, ctx, n_stages):
                s.zero3_s += zero3_block_exposed(c.params_local, c.fwd_s, c.bwd_s, dp=cfg.dp, cp=cfg.cp,
                                                 tp=cfg.tp, cluster=cluster, training=training, pp=cfg.pp, m=m)
            s.bwd_s += s.zero3_s
    action = pipeline_action_time(cluster, training, n_stages)  # the schedule's host time per action (compute)
    for s in stages:  # unfused gradient accumulation: a memory-bound pass per micro-batch (compute time), over a
        # tied head's own copy too (its gradient is accumulated like every other parameter's)
        s.bwd_s += grad_accum_time(s.params + (s.tied_head if cfg.pp > 1 else 0.0), cluster, training) + action
        s.fwd_s += action
    p2p_s, p2p_busy = pipeline_p2p_parts(cluster, training, hidden=profiles[0].hidden, pp=cfg.pp, tp=cfg.tp,
                                         cp=cfg.cp, dp=cfg.dp, mbs=cfg.mbs, sp=cfg.sp)
    if cfg.pp > 1:  # what the messages cost the ranks at either end (blocking sends, or interference)
        for s in stages:
            pf, pb = p2p_occupancy(s.index, n_stages, p2p_s, cluster, training, p2p_busy, cfg.vp)
            s.fwd_s += pf
            s.bwd_s += pb
            s.p2p_s = pf + pb
    fwd = [s.fwd_s for s in stages]
    bwd = [s.bwd_s for s in stages]
    timeline = None
    if simulate_pipeline and cfg.pp > 1:
        timeline = simulate(cfg.schedule, cfg.pp, m, cfg.vp, fwd, bwd, p2p_s, keep_slices=keep_timeline)
        no_comm = simulate(cfg.schedule, cfg.pp, m, cfg.vp, fwd, bwd, 0.0).makespan
        rank_end, last_b, busy = timeline.rank_end, timeline.last_backward_start, timeline.busy
        makespan = timeline.makespan
    else:
        per_rank = [0.0] * cfg.pp
        for s in stages:
            per_rank[s.index % cfg.pp] += s.fwd_s + s.bwd_s
        no_comm = closed_form_makespan(fwd, bwd, cfg.pp, m, cfg.vp, 0.0)
        makespan = closed_form_makespan(fwd, bwd, cfg.pp, m, cfg.vp, p2p_s)
        busy = [m * t for t in per_rank]
        rank_end = [makespan] * cfg.pp
        last_b = [makespan - (stages[-1].bwd_s if cfg.pp == 1 else per_rank[r] / 2 / cfg.vp) for r in range(cfg.pp)]
    # Data-parallel gradient sync and the optimizer, per pipeline rank.
    by_rank = _stages_by_rank(stages, cfg.pp)
    ready, dp_times, opt_time, gather_times = [], [], [], []
    for r, (red, tail, opt, g_exp) in enumerate(_rank_tails(by_rank, cfg, cluster, training, m)):
        window = rank_end[r] - last_b[r]
        if cfg.vp > 1 and cfg.schedule == "interleaved" and red > 0:
            # each model chunk's gradients reduce once complete, during the cool-down's later chunks
            if timeline is not None:
                ends, last = timeline.backward_ends[r], timeline.stage_last_backward
            else:
                ends, last = interleaved_cool_down(by_rank[r], r, rank_end[r], cfg.pp, cfg.vp, m)
            launches = chunk_sync_launches(by_rank[r], r, red, ends, last, rank_end[r], training.align_grad_reduce)
            window = chunk_sync_window(red, rank_end[r], launches)
        dp_t = dp_exposed(red, tail, window, cluster, training)
        ready.append(rank_end[r] + dp_t)
        dp_times.append(dp_t)
        opt_time.append(opt)
        gather_times.append(g_exp)
    # a tied word embedding's two gradients, on the first and the last rank, summed before the step
    tied_s = tied_grad_sync(tied_copy(by_rank[-1], cfg), pp=cfg.pp, tp=cfg.tp, cp=cfg.cp, dp=cfg.dp, zero=cfg.zero,
                            cluster=cluster, training=training)
    finish = [t + opt + g for t, opt, g in zip(sync_tied_ranks(ready, tied_s), opt_time, gather_times, strict=True)]
    step = max(finish)
    crit = max(range(cfg.pp), key=lambda r: finish[r])
    rank_stages = by_rank[crit]
    compute = m * sum(s.fwd_s + s.bwd_s - s.recompute_s - s.comm_s - s.zero3_s - s.p2p_s for s in rank_stages)
    p2p_held = m * sum(s.p2p_s for s in rank_stages)
    zero3 = m * sum(s.zero3_s for s in rank_stages)
    recompute = m * sum(s.recompute_s for s in rank_stages)
    exposed_comm = m * sum(s.comm_s for s in rank_stages)
    breakdown = {
        "compute": compute,
        "recompute": recompute,
        "tp_cp_ep_comm": exposed_comm,
        "pp_comm": max(0.0, makespan - no_comm) + p2p_held,
        "bubble": max(0.0, no_comm - busy[crit]),
        "dp_comm": dp_times[crit] + gather_times[crit] + zero3,
        "embedding_comm": tied_s if crit in (0, cfg.pp - 1) else 0.0,
        "optimizer": opt_time[crit],
    }
    # Attribute any rounding remainder (and the wait of one end rank for the other at the embedding group's
    # all-reduce) to the bubble so the parts add up to the step.
    breakdown["bubble"] += step - sum(breakdown.values())
    # FLOPs for the whole step, all GPUs (model: no recompute; hardware: recompute added).
    per_mb_model = sum(s.model_flops for s in stages)
    per_mb_rec = sum(s.recompute_flops for s in stages)
    gpus_per_replica = cfg.tp * cfg.cp  # model FLOPs above are per GPU of a tp x cp group
    model_flops = 3.0 * per_mb_model * gpus_per_replica * m * cfg.dp
    hw_flops = model_flops + per_mb_rec * gpus_per_replica * m * cfg.dp
    memory = []
    fl = in_flight(cfg.schedule, cfg.pp, m, cfg.vp)
    for r in range(cfg.pp):
        memory.append(memory_of_rank(by_rank[r], fl[r], cfg, cluster, training, m))
    return Estimate(
        config=cfg, stages=stages, memory=memory, step_time_s=step, breakdown=breakdown,
        model_flops=model_flops, hardware_flops=hw_flops, num_gpus=cluster.num_gpus,
        peak_flops=cluster.gpu.peak_flops(training.dtype),
        tokens=training.global_batch_size * training.seq_length,
        capacity_bytes=cluster.gpu.hbm_gib * GIB, timeline=timeline, critical_rank=crit,
    )
