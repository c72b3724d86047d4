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
  tensor tracking does not see), plus what the runtime holds beyond them, at the moment of the peak; ZeRO-3's
  gathered units as FSDP2 keeps them (unsharded parameters are the modules' parameters, all-gather outputs are
  temporaries in backward and activations in forward, as MemTracker books them); the peak is their sum.

Pure functions over data; nothing here imports torch.
"""

from __future__ import annotations

from collections import defaultdict

from .compute import (
    ATTN_BWD_FACTOR,
    VOCAB_PARALLEL_LOSS_ALL_REDUCES,
    Context,
    _attention,
    _cp_mask_elements,
    cp_kv_bytes,
    cp_mask_tensors,
    cp_score_fraction,
    early_stop_skips_last_gemm,
    ep_routed_bytes,
    full_recompute_tp_calls,
    gathered_logits_bytes,
    loss_backward_temporaries,
    sdpa_math_path,
    tp_points,
    tp_units,
    vocab_parallel_loss_bytes,
)
from .estimate import (
    StageCost,
    StageLayout,
    _stages_by_rank,
    block_recompute,
    cached_layer_cost,
    context,
    estimate,
    fsdp_collectives,
    fsdp_units,
    grad_bytes_per_param,
    grads_made_in_backward,
    head_grad_bytes,
    memory_of_rank,
    num_microbatches,
    one_pass_config,
    peak_transient,
    rank_gradients,
    rank_params,
    runtime_dp_units,
    step_scalar_all_reduces,
    tied_copy,
    tied_sync_bytes,
    uses_fsdp2,
)
from .pipeline import in_flight, schedule_actions
from .profile import LayerProfile
from .specs import ClusterSpec, ParallelConfig, TrainingSpec

PHASES = ("forward", "backward", "recompute")
# The phase each moment of the peak (`_moments`) falls in, as runtime.measure names its per-phase peaks.
MOMENT_PHASE = {"block": "backward", "head": "backward", "forward": "forward", "dispatch": "forward",
                "step": "optimizer"}
# Where each moment is, as runtime.measure names its per-moment peaks (`memory_by_moment`): "<phase>/block" inside a
# transformer block's forward or backward, "<phase>/other" outside every block (the head, the loss, the root's hooks).
MOMENT_AT = {"block": "backward/block", "head": "backward/other", "forward": "forward/other",
             "dispatch": "forward/block", "step": "optimizer"}
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


def _stage_layers(stage: StageCost, profiles: list[LayerProfile],
                  rest: str | None = None) -> list[tuple[LayerProfile, str]]:
    """(profile, recompute kind) of each layer of a stage in order: 'full', 'selective' or '' (estimate.
    block_recompute; `rest`: TrainingSpec.partial_rest, where the kinds are used)."""
    out: list[tuple[LayerProfile, str]] = []
    lay = stage.layout
    if stage.has_embedding:
        out.append((profiles[0], ""))
    for i, kind in zip(range(*lay.layers), block_recompute(lay, rest), strict=True):
        out.append((profiles[1 + i], kind))
    if stage.has_head:
        out.append((profiles[-1], ""))
    return out


def _gemm_flops(g, ctx: Context) -> float:
    """Forward FLOPs of one weight GEMM on this GPU. Experts are not split over tp: the runtime keeps them whole
    on every tp rank and feeds them the whole sequence (runtime.parallelize.apply_tp)."""
    n, k = g.n, g.k
    if not g.expert:
        if g.tp in ("col", "vocab"):
            n = -(-n // ctx.tp)
        elif g.tp == "row":
            k = -(-k // ctx.tp)
    return 2.0 * ctx.tokens * g.tokens_per_token * n * k


def _early_stop_skipped(p: LayerProfile, ctx: Context) -> float:
    """Forward FLOPs a full recomputation does not redo: torch.utils.checkpoint stops once every saved tensor is
    back (early stop, its default), so a dense block's last GEMM (w2, whose output nothing saves) is not re-run."""
    return _gemm_flops(p.gemms[-1], ctx) if early_stop_skips_last_gemm(p, ctx.training) else 0.0


def layer_flops(p: LayerProfile, ctx: Context, recompute: str) -> dict[str, float]:
    """FLOPs of one layer for one micro-batch on one GPU, by phase."""
    gemm = sum(_gemm_flops(g, ctx) for g in p.gemms)
    # the FLOP counter counts SDPA by its shapes: under autoplan's context parallelism each query chunk against
    # its key prefix (`cp_score_fraction` of the model FLOPs' s/cp x s scores)
    attn = _attention(p, ctx)[2] * cp_score_fraction(ctx)
    rec = 0.0
    # SDPA's math path (CPU processes, attention dropout): separate bmm, each with two in the backward, and a
    # selective re-run that stops before the PV bmm (compute.sdpa_math_path)
    math = sdpa_math_path(p, ctx)
    if recompute == "full":
        rec = gemm + attn - _early_stop_skipped(p, ctx)
    elif recompute == "selective":
        rec = attn * (0.5 if math else 1.0)
    bwd = 2.0 * gemm + (2.0 if math else ATTN_BWD_FACTOR) * attn
    return {"forward": gemm + attn, "backward": bwd, "recompute": rec}


def layer_comm(p: LayerProfile, ctx: Context, recompute: str, comm: _Comm, times: float) -> None:
    """TP, CP and EP collectives of one layer, forward and backward, `times` micro-batches."""
    if ctx.tp > 1:
        # Per block: the two row-parallel outputs in forward, the two column-parallel inputs' gradients in
        # backward. The vocab-parallel embedding reduces its output in forward; the LM head (column-parallel over
        # the vocabulary) reduces its input's gradient in backward. With sp each becomes a reduce-scatter and an
        # all-gather (forward and backward swap them). Bytes per point: compute.tp_units.
        # A MoE block's experts are not tensor-parallel: only its attention reduces.
        # (An embedding or head the layout leaves replicated -- a user module's table read by an F.linear head --
        # has tp_allreduces 0: nothing at either end, and no vocab-parallel loss.)
        n_f, n_b = tp_points(p, ctx.training)
        fwd, bwd = tp_units(p, ctx)
        # the recomputed forward runs them again, but for what follows the last GEMM (early stop)
        again = full_recompute_tp_calls(p, ctx) if recompute == "full" else {}
        for coll, nbytes in fwd.items():
            comm.add(coll, "tp", nbytes, times * (n_f + again.get(coll, 0)))
        for coll, nbytes in bwd.items():
            comm.add(coll, "tp", nbytes, times * n_b)
        if p.kind == "head" and p.vocab_split(ctx.tp) > 1:  # the vocab-parallel cross-entropy (compute.VOCAB_...)
            comm.add("all_reduce", "tp", vocab_parallel_loss_bytes(ctx), times * VOCAB_PARALLEL_LOSS_ALL_REDUCES)
        if gathered_logits_bytes(p, ctx):  # logits the forward transforms, gathered whole
            comm.add("all_gather", "tp", gathered_logits_bytes(p, ctx), times)
    if ctx.cp > 1 and p.attention is not None:
        kv_full = cp_kv_bytes(p, ctx)
        gathers = 2 * (2 if recompute else 1)  # K and V, again when the attention core is recomputed
        comm.add("all_gather", "cp", kv_full, times * gathers)
        comm.add("all_to_all", "cp", kv_full, times * 2)  # their gradients back to the owners
    if ctx.ep > 1 and p.moe_top_k:
        passes = 2 if recompute == "full" else 1  # forward passes; one backward sends both gradients back
        comm.add("all_to_all", "ep", p.moe_experts * _COUNT_BYTES, times * passes)
        for routed in ep_routed_bytes(p, ctx):  # dispatch, combine
            comm.add("all_to_all", "ep", routed, times * (passes + 1))


def boundary_bytes(profiles: list[LayerProfile], ctx: Context, cfg: ParallelConfig, training: TrainingSpec,
                   element_bytes: int | None = None) -> float:
    """One micro-batch's tensor at a pipeline stage boundary: a stage's output, the next stage's input (the
    residual stream, sequence-sharded over tp with sp), at `element_bytes` per element (default the
    activations')."""
    e = ctx.act_bytes if element_bytes is None else element_bytes
    act = ctx.mbs * training.seq_length // cfg.cp * profiles[0].hidden * e
    return act / (cfg.tp if cfg.sp else 1)


def rank_counts(stages: list[StageCost], profiles: list[LayerProfile], ctx: Context, cfg: ParallelConfig,
                m: int, n_stages: int, training: TrainingSpec) -> tuple[dict, _Comm]:
    """FLOPs by phase and the per-micro-batch collectives (TP/CP/EP/PP) of one pipeline rank, for the step."""
    flops = dict.fromkeys(PHASES, 0.0)
    comm = _Comm()
    for s in stages:
        for p, rec in _stage_layers(s, profiles, training.partial_rest):
            for k, v in layer_flops(p, ctx, rec).items():
                flops[k] += m * v
            layer_comm(p, ctx, rec, comm, m)
        if cfg.pp > 1:
            # on the wire the residual stream's own dtype: fp32 under autocast over fp32 parameters (measured:
            # benchmarks/counts.py --dtype bf16; estimate.pipeline_p2p_parts times it at weight_bytes, the same)
            act = boundary_bytes(profiles, ctx, cfg, training, ctx.residual_bytes)
            if s.index > 0:
                comm.add("recv", "pp", act, m)
                comm.add("send", "pp", act, m)
            if s.index < n_stages - 1:
                comm.add("send", "pp", act, m)
                comm.add("recv", "pp", act, m)
    return flops, comm


def dp_dim(cfg: ParallelConfig) -> str:
    """The mesh dimension named for gradient reduction over dp x cp: "dp", or "cp" when dp is 1, or "ep" when
    expert parallelism spans all of dp x cp (the group is then the cp or the ep group, and a measurement cannot tell
    the roles apart: runtime.measure.group_names names a shared group by its most specific dimension)."""
    if cfg.dp == 1 and cfg.cp > 1:
        return "cp"
    return "ep" if cfg.ep > 1 and cfg.ep == cfg.dp * cfg.cp else "dp"


def dp_comm(dense: float, expert: float, cfg: ParallelConfig, training: TrainingSpec, m: int, comm: _Comm,
            units: int = 1) -> None:
    """Gradient reduction and parameter gathers over dp x cp of one rank's `dense`/`expert` parameters, as FSDP2
    (zero 1-3) and torch's DDP or replicate (zero 0, `estimate.uses_replicate`: the same bytes, in buckets or per
    unit) run them: zero 0/1 reduce once per step, zero 2/3 after every micro-batch
    (once under pipeline parallelism, which defers the sync to the last micro-batch); zero 1/2 gather parameters
    once per step, zero 3 per unit for every forward and backward. Each of FSDP2's and replicate's `units` (one
    per block and stage root: `estimate.fsdp_units`) issues its own collectives, so the calls are `units` times
    those, the bytes the same; torch's DDP is counted as one bucket per stage (`estimate.runtime_dp_units`: a
    floor, its 25 MiB buckets split larger models further)."""
    n = cfg.dp * cfg.cp
    g, w = training.grad_bytes, training.weight_bytes
    edp = n // cfg.ep
    dim = dp_dim(cfg)
    units = max(1, units)
    if n > 1:
        if cfg.zero == 0:
            comm.add("all_reduce", dim, dense * g / units, units)
        else:
            fwd_g, bwd_g, syncs = fsdp_collectives(cfg.zero, cfg.pp, m)
            gathers = fwd_g + bwd_g
            comm.add("reduce_scatter", dim, dense * g / units, syncs * units)
            comm.add("all_gather", dim, dense * w / units, gathers * units)
    if expert and edp > 1:
        # one bucketed all-reduce over the ranks holding the same experts (runtime.engine._all_reduce_bucketed):
        # the edp group, which without expert parallelism is the data-parallel group itself
        comm.add("all_reduce", "edp" if cfg.ep > 1 else dim, expert * g)


def step_comm(stages: list[StageCost], profiles: list[LayerProfile], ctx: Context, cfg: ParallelConfig,
              training: TrainingSpec, comm: _Comm) -> None:
    """Once-per-step collectives besides data parallelism: with sp, the gradients of the weights that see
    sequence-sharded inputs (norms, learned positions) are partial sums reduced over tp; a tied embedding/LM head
    on the first and last pipeline stages sums its two gradients; and the step's scalar all-reduces
    (`scalar_comm`)."""
    scalar_comm(cfg, comm)
    g = training.grad_bytes
    if ctx.sp and ctx.tp > 1:
        for s in stages:
            for p, _ in _stage_layers(s, profiles):
                if p.norm_kind:
                    per_norm = p.hidden * (2 if p.norm_kind == "layernorm" else 1)
                    norms = 2 if p.kind == "block" else 1
                    comm.add("all_reduce", "tp", p.hidden * g, norms * per_norm // p.hidden)
                if p.kind == "embedding" and p.params_replicated:
                    comm.add("all_reduce", "tp", p.params_replicated * g)
    head = profiles[-1]
    tied = head.gemms and head.gemms[0].count == 0
    if cfg.pp > 1 and tied and any(s.has_head or s.has_embedding for s in stages):
        # the local gradient (under ZeRO >= 1 FSDP2's 1/(dp*cp) shard: `estimate.tied_sync_bytes`)
        comm.add("all_reduce", "pp" if cfg.pp == 2 else "other",
                 tied_sync_bytes(head.gemms[0].n * head.gemms[0].k / ctx.tp, dp=cfg.dp, cp=cfg.cp, zero=cfg.zero,
                                 training=training))


# The loss all-reduce carries the loss and one flag per stop signal the run listens for (runtime.faults.StopFlag:
# SIGTERM, SIGINT), in float64; the gradient norm's partial sums of squares are float64 scalars.
_LOSS_ALL_REDUCE_BYTES = 8 * (1 + 2)
_NORM_BYTES = 8


def _world(cfg: ParallelConfig) -> int:
    return cfg.tp * cfg.cp * cfg.dp * cfg.pp


def world_dim(cfg: ParallelConfig) -> str:
    """The name a measurement gives the group of all ranks (runtime.measure.group_names): the most specific mesh
    dimension spanning every rank (tp, cp, ep, pp, then dp for dp x cp), else "world"."""
    world = _world(cfg)
    for name, size in (("tp", cfg.tp), ("cp", cfg.cp), ("ep", cfg.ep), ("pp", cfg.pp), ("dp", cfg.dp * cfg.cp)):
        if size == world:
            return name
    return "world"


def scalar_comm(cfg: ParallelConfig, comm: _Comm) -> None:
    """Counts of the step's scalar all-reduces (`step_scalar_all_reduces`), named as a measurement names their
    groups: the loss's by `world_dim` (and 24 bytes: the float64 loss and two stop flags), the norm's 8 bytes
    each, over dp x cp by `dp_dim`."""
    names = {"world": world_dim(cfg), "dp": dp_dim(cfg)}
    for role, _, _, n in step_scalar_all_reduces(tp=cfg.tp, cp=cfg.cp, dp=cfg.dp, pp=cfg.pp, ep=cfg.ep,
                                                 zero=cfg.zero):
        comm.add("all_reduce", names.get(role, role), _LOSS_ALL_REDUCE_BYTES if role == "world" else _NORM_BYTES,
                 n)


def _block_backward(p: LayerProfile, ctx: Context, training: TrainingSpec,
                    residual: bool = True) -> tuple[float, float]:
    """(temporaries, activations already released) at the widest point of a block's backward.

    Dense block: its last GEMM's backward, holding the gradient of the residual stream, the gradient of w2's
    input and w2's weight gradient (made before it is added to .grad); nothing of the block is released yet.
    `residual=False`: the residual stream's gradient is a pipeline stage's gradient receive buffer (the stage
    does not hold the head, and its last block's output gradient arrives from the next stage; the residual add
    passes it through), already counted among the temporaries.
    MoE block: an expert's SwiGLU backward, on its rows (its share of the routed tokens of every ep rank):
    by then the combine's backward has released the k expert outputs it saved and the expert's w2 and product
    backward have released w2's input, silu(w1 x) and w3 x; alive are the residual gradient, the gradient of the
    routed tokens and the eager SwiGLU backward's intermediates -- grad*b and grad*silu(a) of the product, and
    silu's backward (sigmoid(a) and its products) -- eight rows x ffn tensors at the widest, as SiteMemTracker
    counts them (benchmarks/counts.py --sites, tiny-moe)."""
    w2 = p.gemms[-1] if p.gemms else None
    e = ctx.act_bytes
    tmp = ctx.tokens * p.hidden / (ctx.tp if ctx.sp else 1) * e if residual else 0.0
    if w2 is None:
        return tmp, 0.0
    if p.moe_top_k:
        rows = ctx.tokens * p.routed_per_token * ctx.ep / p.moe_experts
        routed = ctx.tokens * p.routed_per_token * p.hidden * e
        return tmp + routed + 8 * rows * w2.k * e, routed + 3 * rows * w2.k * e
    if ctx.sp and ctx.tp > 1:
        # sequence parallelism: w2 (RowwiseParallel, its output reduce-scattered over the sequence) needs its
        # output's gradient whole again: DTensor all-gathers it (all_gather_into_tensor), alive through w2's backward
        tmp += ctx.tokens * p.hidden * e
    return tmp + ctx.tokens * w2.k / ctx.tp * e + fresh_weight_grad(p, ctx, training), 0.0


def fresh_weight_grad(p: LayerProfile, ctx: Context, training: TrainingSpec) -> float:
    """Bytes of the weight gradient a dense block's last GEMM (w2) makes at the widest point of its backward
    (`_block_backward`): a temporary that AccumulateGrad adds into .grad, or, where no .grad exists yet
    (`estimate.grads_made_in_backward`) and the block is not the first to run its backward, already the .grad
    itself (`memory_bytes`). 0 for MoE blocks and blocks without GEMMs."""
    w2 = p.gemms[-1] if p.gemms else None
    if w2 is None or p.moe_top_k:
        return 0.0
    return w2.n * w2.k / ctx.tp * training.grad_bytes


def _moe_dispatch_transients(p: LayerProfile, ctx: Context) -> float:
    """Forward transients of a MoE block's dispatch, booked as activations (made in a forward): when the return
    all-to-all's output is allocated, runtime.parallelize._ep_dispatch still holds the routed token copies
    (x[order // k], in MoE.forward), the received tokens, the experts' outputs (cat), those in (source, expert)
    order and the returned tokens -- five routed-token-wide tensors beside what the block saves. Without ep:
    the routed copies and the experts' outputs."""
    if not p.moe_top_k:
        return 0.0
    return (5 if ctx.ep > 1 else 2) * ctx.tokens * p.routed_per_token * p.hidden * ctx.act_bytes


def pipeline_act(stages: list[StageCost], profiles: list[LayerProfile], ctx: Context, cfg: ParallelConfig,
                 training: TrainingSpec, m: int, in_flight: float) -> float:
    """Activation bytes that torch.distributed.pipelining keeps on a rank beyond its in-flight micro-batches'
    saved tensors (the profile's counts, in which a stage's first block counts its input):
    - receive buffers: PipelineStage._prepare_forward_infra allocates one activation buffer per micro-batch
      (`args_recv_info[chunk]`) for every stage after the first, and keeps them across steps. The in-flight
      micro-batches' buffers are the first block's inputs, already counted; the other m - in_flight are extra.
    - stage outputs: a stage that sends its output keeps it in `fwd_cache` until that micro-batch's backward
      (counted nowhere by the profile: it is the next stage's input). Schedule1F1B also holds the warm-up's last
      fired send (`send_work`: the Work keeps the tensor) through the steady phase, one output more once that
      micro-batch's backward is done (w >= 2 warm-up forwards and m >= 2w - 1). The interleaved schedule
      (_PipelineScheduleRuntime) waits on its sends only at the end of the step: all m outputs of every stage
      that sends stay alive until then.
    `in_flight` is pipeline.in_flight's (units of the rank's whole layer set); in micro-batch x stage pairs it is
    in_flight x len(stages), split evenly over the rank's stages (exact without virtual stages)."""
    if cfg.pp == 1 or not stages:
        return 0.0
    x = boundary_bytes(profiles, ctx, cfg, training)
    n_stages = cfg.pp * cfg.vp
    receiving = sum(1 for s in stages if s.index > 0)
    sending = sum(1 for s in stages if s.index < n_stages - 1)
    per_stage = in_flight  # micro-batches in flight on each of the rank's stages (in_flight x len / len)
    out = receiving * (m - per_stage) * x
    if cfg.vp > 1:
        out += sending * m * x
    elif sending:
        w = int(in_flight)  # 1F1B: the warm-up forwards; GPipe: all m, waited before the backward
        held = 1 if cfg.schedule == "1f1b" and w >= 2 and m >= 2 * w - 1 else 0
        out += (in_flight + held) * x
    return out


def _cp_mask_buffers(stages: list[StageCost], profiles: list[LayerProfile], ctx: Context) -> float:
    """With context parallelism every attention core keeps its causal masks by true positions as module buffers
    (runtime.parallelize.ContextParallelAttentionCore: a bool mask per query chunk over its key prefix,
    `compute._cp_mask_elements`), booked as buffers, which runtime.measure counts among the temporaries."""
    if not cp_mask_tensors(ctx):  # none on a GPU: the lower-right causal bias is no tensor
        return 0.0
    cores = sum(1 for p in _stage_blocks(stages, profiles) if p.attention is not None)
    return cores * _cp_mask_elements(ctx)


def token_ids_bytes(cfg: ParallelConfig, training: TrainingSpec) -> float:
    """The step's token ids on every rank (int64): the global batch of gbs x (seq + 1) that every rank reads
    (runtime.data: each rank slices its part out of it) and this rank's inputs and labels."""
    local = training.global_batch_size // cfg.dp * training.seq_length // cfg.cp
    return 8.0 * (training.global_batch_size * (training.seq_length + 1) + 2 * local)


def _head_parts(stages: list[StageCost], profiles: list[LayerProfile], ctx: Context) -> tuple[float, float]:
    """(the head's saved activations per micro-batch, as estimate counts them, the temporaries of its backward:
    compute.loss_backward_temporaries) on a rank holding the head, else zeros."""
    if not any(s.has_head for s in stages):
        return 0.0, 0.0
    head = profiles[-1]
    return cached_layer_cost(head, ctx).act_none, loss_backward_temporaries(head, ctx)


def memory_bytes(mem, stages: list[StageCost], profiles: list[LayerProfile], ctx: Context, cfg: ParallelConfig,
                 cluster: ClusterSpec, training: TrainingSpec, m: int, in_flight: float) -> tuple[dict[str, float], str]:
    """(the memory categories at the peak, the moment of the peak: a `_moments` key). The categories of
    `estimate.memory_of_rank` under `TrainingSpec.runtime_memory` (`mem`), which already hold what autoplan's
    runtime keeps beyond Megatron's count (`estimate.runtime_extra`: FSDP2's unsharded copies, experts whole on
    every tp rank and unsharded by ZeRO, a tied LM head's own copy on the last of several pipeline stages, a
    vocabulary-parallel embedding's whole gradient at zero 0), plus the moment-dependent rest:
    - the pipeline schedule keeps the last stage's output (the logits) of every micro-batch until the step ends,
      one activation receive buffer per micro-batch and stage, each sending stage's outputs (`pipeline_act`)
      and one gradient receive buffer per micro-batch and stage;
    - (in `mem`'s activations: compute.runtime_saved_extra, what the runtime's eager modules save beyond the
      profile's (Megatron's) counts: SwiGLU, MoE combine, GQA/CP K and V, composite RMSNorm, SP's gathered GEMM
      inputs);
    - the step's token ids;
    - under ZeRO-3 the root unit stays gathered, and a block's unit is gathered or prefetched (`_moments`);
    - the categories at the moment of the peak (`_moments`): a block's backward at its widest, the head's
      backward, the end of the model's forward (with FSDP2's last all-gather output) or a MoE dispatch in a
      forward, whichever holds most (tensors released by then are not counted); where the gradients are made in
      the backward (`estimate.grads_made_in_backward`) the forward's and the head's hold none, a block's those
      made before it (the fullest of the last block's, the one before it and the first block's backward), and
      the optimizer step ("step": every gradient, no activation but the token ids) is one more.
    Without the framework overhead (a process constant that tensor tracking does not see). Each term's source
    in torch or the runtime: docs/notes/session-5/issue-12-activations.md."""
    if not training.runtime_memory:
        raise ValueError("counts.memory_bytes describes autoplan's runtime: `mem` must be priced with "
                         "TrainingSpec.runtime_memory (predict_counts does)")
    n = cfg.dp * cfg.cp
    # ZeRO-3's gathered units (estimate.memory_of_rank's `other` beyond the overhead: two of the largest layer)
    # are priced as FSDP2 holds them: the root unit and the running block's unsharded parameters, the prefetched
    # or kept all-gather output (the root unit below, the rest in `_moments`)
    out = {"parameters": mem.weights, "gradients": mem.gradients, "optimizer": mem.optimizer,
           "activations": mem.activations, "temporaries": 0.0}
    head = profiles[-1]
    if cfg.pp > 1 and any(s.has_head for s in stages):
        # fp32 logits kept per micro-batch
        out["activations"] += m * ctx.tokens * head.logits_per_token / head.vocab_split(ctx.tp) * 4
    out["activations"] += pipeline_act(stages, profiles, ctx, cfg, training, m, in_flight)
    # the gradient receive buffers: one per micro-batch for every stage before the last
    # (PipelineStage._create_grad_recv_info), kept across steps. MemTracker sees a buffer once this step touches
    # it (m - in_flight + 1 of them at a 1F1B stage's peak); all m exist.
    if cfg.pp > 1:
        n_stages = cfg.pp * cfg.vp
        out["temporaries"] += sum(1 for s in stages if s.index < n_stages - 1) * m * \
            boundary_bytes(profiles, ctx, cfg, training)
    out["activations"] += token_ids_bytes(cfg, training)
    out["temporaries"] += _cp_mask_buffers(stages, profiles, ctx)
    # the recomputed layer's transient (estimate's peak_transient) exists only at a block's backward (`_moments`)
    out["activations"] -= peak_transient(stages)
    # estimate counts the head's activations for every in-flight micro-batch; at most one micro-batch has them at
    # the peak (the head's stage runs each backward right after its forward): each moment adds what it holds
    out["activations"] -= in_flight * _head_parts(stages, profiles, ctx)[0]
    # ZeRO-3: FSDP2 leaves the root unit (what no block holds: embeddings, final norm, head) unsharded between
    # forward and backward (FSDPState._lazy_init: the root does not reshard after forward), and the unsharded
    # parameters are the modules' own parameter tensors, booked as parameters
    if cfg.zero >= 3 and n > 1:
        out["parameters"] += _root_unit(stages, profiles, ctx, cfg) * training.weight_bytes
    # The peak's moment: the categories each candidate adds (a tie goes to the first, the block: tiny-gpt
    # tp=2,pp=2's last stage measures the block at 80 KiB either way)
    moments = _moments(stages, profiles, ctx, one_pass_config(cfg, m), training)
    if grads_made_in_backward(cfg, m, training):
        # Gradients only from the backward on (estimate.grads_made_in_backward): none in the forward nor at the
        # loss. As the backward goes from the last block to the first, each finished block has made its gradients
        # (as the step holds them: one_pass_config) and released its kept activations, and under FSDP2 that
        # reshards after backward (fully_shard at ZeRO-1/2, here one pass; `replicate`: end zero 0) its
        # unsharded parameters; fully_shard holds the latest unit's reduce-scatter input (its unsharded
        # gradients, flat: FSDPParamGroup's reduce_scatter_state, kept until the next reduce-scatter;
        # SiteMemTracker sees it as the unit's `empty`) from the first finished unit on; and w2's fresh weight
        # gradient is already the .grad there (at the last block's widest point it is not yet: a temporary,
        # `_block_backward`). So the fullest block moment is the last block's (the head's gradients), the one
        # before it (one block's change and the held input) or the first block's (every change). At the
        # optimizer step every gradient, and no activation but the token ids (the autocast region's weight
        # copies closed before it).
        out["gradients"] = 0.0
        end_cfg = one_pass_config(cfg, m)
        head = head_grad_bytes(stages, training)
        gd, ge = grad_bytes_per_param(end_cfg, training)
        blocks = _stage_blocks(stages, profiles)
        fresh = max((fresh_weight_grad(p, ctx, training) for p in blocks), default=0.0)
        last = {**moments["block"], "gradients": head}
        later = len(blocks) - len(stages)  # blocks after each stage's first (one stage: no pipeline)
        if later > 0:
            dense = sum(s.later_blocks_params[0] for s in stages)
            fsdp = uses_fsdp2(tp=cfg.tp, zero=end_cfg.zero, dp_cp=cfg.dp * cfg.cp)
            freed = dense * training.weight_bytes if fsdp and end_cfg.zero in (0, 2) else 0.0
            change = {"gradients": dense * gd + sum(s.later_blocks_params[1] for s in stages) * ge,
                      "activations": -in_flight * sum(s.later_blocks_act for s in stages), "parameters": -freed}
            held = max((_fsdp_unit(p, ctx) for p in blocks), default=0.0) * training.grad_bytes \
                if end_cfg.zero >= 1 and cfg.dp * cfg.cp > 1 else 0.0
            candidates = [last]
            for share in (1 / later, 1.0):  # the block before the last, the first block
                moment = {k: last.get(k, 0.0) + share * change.get(k, 0.0) for k in {*last, *change}}
                moment["temporaries"] += held - fresh
                moment["gradients"] += fresh
                candidates.append(moment)
            last = max(candidates, key=lambda k: sum(k.values()))
        moments["block"] = last
        ends = rank_gradients(stages, end_cfg, training)
        moments["step"] = {"gradients": ends, "activations": token_ids_bytes(cfg, training) - out["activations"]}
    moment = max(moments, key=lambda k: sum(moments[k].values()))
    for k, v in moments[moment].items():
        out[k] += v
    out["peak"] = sum(out.values())
    return out, moment


def _stage_blocks(stages: list[StageCost], profiles: list[LayerProfile]) -> list[LayerProfile]:
    return [p for s in stages for p, _ in _stage_layers(s, profiles) if p.kind == "block"]


def _fsdp_unit(p: LayerProfile, ctx: Context) -> float:
    """Parameters of a block's FSDP2 unit on this rank (fully_shard per block, runtime.parallelize.apply_dp):
    its local parameters without the experts, which FSDP2 ignores. Its all-gather output (one flat buffer) and
    its unsharded parameters are each this many elements."""
    c = cached_layer_cost(p, ctx)
    return c.params_local - c.expert_params_local


def _root_unit(stages: list[StageCost], profiles: list[LayerProfile], ctx: Context, cfg: ParallelConfig) -> float:
    """Parameters of a rank's root FSDP2 unit: its embedding and head layers (a tied head counts once, on the
    embedding, as in the profile; its own copy on a later pipeline stage is `tied_copy`)."""
    out = 0.0
    for s in stages:
        for p, _ in _stage_layers(s, profiles):
            if p.kind != "block":
                c = cached_layer_cost(p, ctx)
                out += c.params_local - c.expert_params_local
    return out + tied_copy(stages, cfg)


def _forward_gather(cfg: ParallelConfig) -> bool:
    """Whether FSDP2 all-gathers a block's parameters again in the forward of the micro-batch that holds most:
    zero 3 gathers for every forward; zero 2 without pipeline parallelism reshards after every micro-batch's
    backward (its reduce-scatter) and gathers again; zero 1 and zero 2 under the pipeline schedule gather once
    per step, in the first micro-batch's forward (when no gradient exists yet)."""
    return cfg.zero >= 3 or (cfg.zero == 2 and cfg.pp == 1)


def _moments(stages: list[StageCost], profiles: list[LayerProfile], ctx: Context, cfg: ParallelConfig,
             training: TrainingSpec) -> dict[str, dict[str, float]]:
    """The moments at which a rank can peak, each as the bytes it adds per category to what every moment holds
    (parameters, gradients and optimizer state, the in-flight micro-batches' saved tensors without the head's):
    - block: a block's backward at its widest (`_block_backward`), less what it has released by then; under
      ZeRO-3 the block's unit is gathered (its unsharded parameters) and FSDP2 has already prefetched the next
      unit's all-gather output (FSDPState._backward_prefetch; a temporary, made in backward) if the rank has
      another block;
    - head: the cross-entropy's backward (its saved tensors and two fp32 logit gradients); under ZeRO-3 the last
      block's all-gather is prefetched;
    - forward: the end of the root module's forward (FSDPState._post_forward, which frees the last all-gather
      output): the head's saved tensors up to the LM head and the logits, and, where FSDP2 gathered the blocks
      again in this forward (`_forward_gather`), the last block's all-gather output, which FSDP2 keeps for the
      next copy-in until then (FSDPParamGroup.wait_for_unshard, AllGatherState; booked as an activation);
    - dispatch: a MoE block's forward dispatch (`_moe_dispatch_transients`); under ZeRO-3 with the block's unit
      gathered and its all-gather output kept.
    Each term names the torch or runtime code that makes the tensor."""
    blocks = _stage_blocks(stages, profiles)
    zero3 = cfg.zero >= 3 and cfg.dp * cfg.cp > 1
    w = training.weight_bytes
    unit = max((_fsdp_unit(p, ctx) for p in blocks), default=0.0) * w
    head = profiles[-1]
    has_head = any(s.has_head for s in stages)
    residual = has_head or cfg.pp == 1
    block_tmp, released = max((_block_backward(p, ctx, training, residual) for p in blocks),
                              key=lambda tr: tr[0] - tr[1], default=(0.0, 0.0))
    if has_head and profiles[0] in [p for s in stages for p, _ in _stage_layers(s, profiles)] and \
            head.gemms and head.gemms[0].count == 0:
        # a tied LM head's weight gradient waits in the autograd engine for the embedding's to be added to it
        block_tmp += head.gemms[0].n * head.gemms[0].k / ctx.tp * training.grad_bytes
    head_act, head_tmp = _head_parts(stages, profiles, ctx)
    # full recomputation: the recomputed layer's activations (without its input, the checkpoint) are alive only
    # while that layer's backward runs, when the stage's later blocks have released what they kept (a partly full
    # stage: estimate's peak_transient, as the estimate prices it)
    recomputed = peak_transient(stages)
    held = _held_grad_send(stages, profiles, ctx, cfg, training)
    out = {
        "block": {"activations": recomputed - released, "temporaries": block_tmp + held},
        "head": {"activations": head_act, "temporaries": head_tmp + held},
        "forward": {"activations": _head_forward(head, ctx) if has_head else 0.0, "temporaries": held},
        "dispatch": {"activations": max((_moe_dispatch_transients(p, ctx) for p in blocks), default=0.0),
                     "temporaries": held},
    }
    if zero3:
        out["block"]["parameters"] = unit
        out["block"]["temporaries"] += unit if len(blocks) > 1 else 0.0
        out["head"]["temporaries"] += unit if blocks else 0.0
        if out["dispatch"]["activations"]:
            out["dispatch"]["parameters"] = unit
            out["dispatch"]["activations"] += unit
    if _forward_gather(cfg) and cfg.dp * cfg.cp > 1:
        out["forward"]["activations"] += unit
    return out


def _held_grad_send(stages: list[StageCost], profiles: list[LayerProfile], ctx: Context, cfg: ParallelConfig,
                    training: TrainingSpec) -> float:
    """Input gradients a pipeline rank is still sending at its peak. 1F1B: a stage after the first holds the
    previous micro-batch's while it runs the next forward or backward (Schedule1F1B keeps each backward's send
    ops in `bwd_sends`, a P2POp holds its tensor, until the next backward replaces them; in the cool-down it waits
    on the fired `send_work` only after the next backward); the first stage sends none. Interleaved:
    _PipelineScheduleRuntime waits on its sends only at the end of the step, so every gradient a stage after the
    first has sent is alive; `_interleaved_held_sends` counts them at the peak."""
    if cfg.pp == 1 or num_microbatches(cfg, training) < 2 or not stages:
        return 0.0
    x = boundary_bytes(profiles, ctx, cfg, training)
    if cfg.vp > 1 and cfg.schedule == "interleaved":
        return _interleaved_held_sends(stages[0].index % cfg.pp, cfg, num_microbatches(cfg, training)) * x
    if cfg.vp > 1 or cfg.schedule != "1f1b":
        return 0.0
    return x if any(s.index > 0 for s in stages) else 0.0


def _interleaved_held_sends(rank: int, cfg: ParallelConfig, m: int) -> int:
    """Gradient sends a rank has made before its peak under the interleaved schedule (pipeline.schedule_actions'
    order): the peak is the last backward at which the most model chunks are in flight (a chunk's saved
    activations outweigh a residual-stream-wide gradient many times over, and later backwards of that plateau
    hold more sends); the sends are the backwards before it on stages after the first."""
    acts = schedule_actions("interleaved", cfg.pp, m, cfg.vp)[rank]
    in_flight, best, held, best_held = 0, -1, 0, 0
    for a in acts:
        if a.kind == "F":
            in_flight += 1
            continue
        if in_flight >= best:
            best, best_held = in_flight, held
        in_flight -= 1
        held += a.stage > 0
    return best_held


def _head_forward(head: LayerProfile, ctx: Context) -> float:
    """What the head holds when the root module's forward returns: its saved tensors up to the LM head (the final
    norm's and the LM head's inputs, the profile's act_seq) and the logits (the LM head's output, in the model's
    dtype: the engine upcasts them for the loss after the forward, zoo.model.cross_entropy_loss)."""
    saved = ctx.tokens * head.act_seq / (ctx.tp if ctx.sp else 1) * ctx.act_bytes / 2.0
    return saved + ctx.tokens * head.logits_per_token / head.vocab_split(ctx.tp) * ctx.act_bytes


def predict_counts(profiles: list[LayerProfile], cluster: ClusterSpec, training: TrainingSpec,
                   cfg: ParallelConfig, layout: list[StageLayout] | None = None) -> list[dict]:
    """Per pipeline rank: {"flops": {phase: n}, "comm": [{collective, mesh_dim, count, bytes}],
    "memory_bytes": {category: bytes, "peak": bytes}, "memory_moment": the peak's moment, "memory_phase": its
    phase, "memory_at": its phase and place (`MOMENT_AT`)} for one optimizer step of `cfg` (dp resolved)."""
    # the counts describe autoplan's runtime, whatever stack `training` came from: its memory as the runtime holds
    # it (the knob changes no time)
    training = training.model_copy(update={"runtime_memory": True})
    est = estimate(profiles, cluster, training, cfg, layout, simulate_pipeline=False)
    ctx = context(cluster, training, cfg)
    m = num_microbatches(cfg, training)
    n_stages = cfg.pp * cfg.vp
    out = []
    fl = in_flight(cfg.schedule, cfg.pp, m, cfg.vp)
    for r, stages in enumerate(_stages_by_rank(est.stages, cfg.pp)):
        flops, comm = rank_counts(stages, profiles, ctx, cfg, m, n_stages, training)
        dense, expert = rank_params(stages, cfg)
        units = fsdp_units(stages) if cfg.zero >= 1 else runtime_dp_units(stages, cfg)
        dp_comm(dense, expert, cfg, training, m, comm, units)
        step_comm(stages, profiles, ctx, cfg, training, comm)
        # every gradient counted: memory_bytes places them by moment (est.memory has taken the larger moment)
        base = memory_of_rank(stages, fl[r], cfg, cluster, training)
        mem, moment = memory_bytes(base, stages, profiles, ctx, cfg, cluster, training, m, fl[r])
        out.append({"flops": {k: int(round(v)) for k, v in flops.items()}, "comm": comm.as_list(),
                    "memory_bytes": {k: int(round(v)) for k, v in mem.items()}, "in_flight": fl[r],
                    "memory_moment": moment, "memory_phase": MOMENT_PHASE[moment], "memory_at": MOMENT_AT[moment]})
    return out


def runtime_semantics(cfg: ParallelConfig) -> dict[str, str]:
    """Knobs that autoplan's runtime executes differently from their textbook form, and how the cost model prices
    them (recorded in the plan)."""
    out = {}
    if cfg.pp > 1 and cfg.zero >= 2:
        out["zero"] = (f"ZeRO-{cfg.zero} under pipeline parallelism: the pipeline schedule defers FSDP2's gradient "
                       "reduce-scatter to the last micro-batch, so gradients stay whole during the step; priced as "
                       f"run (whole gradients; parameters and optimizer state sharded as ZeRO-{cfg.zero})")
    if cfg.cp > 1:
        out["cp"] = ("context-parallel attention all-gathers K and V (backward: an all-to-all of their gradients), "
                     "then one SDPA per query chunk against the keys up to the chunk's end, causally masked (on "
                     "a GPU by torch's lower-right causal bias: the causal half; on CPU processes by boolean "
                     "masks: every score of the chunk's prefix); priced as run (cp_attention all_gather_masked)")
    if cfg.ep > 1 and cfg.tp > 1:
        out["ep"] = ("experts are whole on every tp rank (no expert tensor parallelism): the runtime's FLOPs are "
                     "tp times the step-time model's (cost_models.counts prices what runs); their memory is "
                     "priced as run (estimate.runtime_per_param)")
    if cfg.ep > 1 and cfg.zero >= 1:
        out["ep_zero"] = ("ZeRO does not shard expert parameters, gradients or optimizer state (FSDP2 ignores "
                          "them; they are reduced over the expert data-parallel ranks); priced as run "
                          "(estimate.runtime_per_param)")
    return out
