"""Compute and per-layer cost: time of one layer for one micro-batch on one GPU, and what it stores.

Time is a roofline per kind of work:
- GEMMs at `peak * efficiency(m, n, k)`, where efficiency saturates with the GEMM's size: small matmuls and
  thin tensor-parallel shards reach less of the peak (`GPUCalibration.matmul_half_dim`);
- the attention core either as one fused flash kernel (executed FLOPs at `attention_efficiency`; causal
  blocks above the diagonal skipped; backward recomputes the scores, 2.5x the forward's matmuls) or, unfused,
  as two batched GEMMs plus a memory-bound softmax/dropout over the s x s scores;
- elementwise work (norms, activations, bias/dropout/residual, RoPE) as bytes over HBM bandwidth;
- a fixed cost per kernel launch.
Tensor-parallel collectives are added where they sit on the critical path (exposed), or hidden behind the
GEMMs they are chunked with when the runtime overlaps them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import comm
from .kernel_traffic import eager_extra
from .profile import EAGER_CE_BYTES, FUSED_CE_BYTES, Gemm, LayerProfile
from .specs import DTYPE_BYTES, ClusterSpec, TrainingSpec, compute16


@dataclass(frozen=True)
class Context:
    """Everything about a configuration that a single layer's cost depends on."""

    cluster: ClusterSpec
    training: TrainingSpec
    tp: int
    cp: int
    sp: bool
    ep: int
    mbs: int

    @property
    def seq(self) -> int:
        return self.training.seq_length

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one GPU (the sequence is split across cp)."""
        return self.mbs * self.seq // self.cp

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[compute16(self.training.dtype)]

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream, the norms' outputs and their gradients: the activations'
        dtype, except under autocast over fp32 parameters (TrainingSpec.autocast), where the embedding's output,
        the residual adds and the norms stay fp32 and only the matmuls' outputs are 16-bit (measured on the
        wire: benchmarks/counts.py --dtype bf16, tensor and expert parallel collectives)."""
        return 4 if self.training.autocast else self.act_bytes


# Under an fp8 plan with sp a block's two all-gathers move fp8, 1 byte an element: they gather the inputs of fp8
# GEMMs, cast before the gather. Transformer Engine 1.9 (the NeMo 24.07 container): LayerNormLinear's norm writes
# fp8 when the GEMM runs in fp8 (`fp8 and not return_layernorm_output`) and `gather_along_first_dim(ln_out, ...)`
# gathers that; the row-parallel linear's output gradient is cast first ("FP8 case with gather: unfused bgrad,
# cast, transpose for efficient gather", base.py `grad_output_preprocess`), with or without userbuffers. torchao's
# float8 TP (torchtitan): Float8ColwiseParallel casts its input before the redistribute, and Float8RowwiseParallel
# wraps its output in NoopFwToFloat8BwDynamic after the reduce-scatter, so the gradient is cast before that
# collective's backward all-gather. The reduce-scatters sum 16-bit GEMM outputs and gradients: 16 bits.
FP8_GATHER_BYTES = 1


def tp_units(p: LayerProfile, ctx: Context) -> tuple[dict[str, float], dict[str, float]]:
    """A layer's tensor-parallel traffic per reduction point and micro-batch, (forward, backward), each a map
    collective -> bytes. A block's forward reduces its row-parallel linears' outputs (matmul outputs, activation
    dtype) and its backward the gradients of its column-parallel linears' input (a norm's output:
    `residual_bytes`); the embedding's output and the LM head's input gradient are the residual stream. With sp
    each reduction point is a reduce-scatter and an all-gather: a block's forward gathers the norm's output and
    scatters the linear's, its backward the reverse; under fp8 the block's gathers move fp8 (`FP8_GATHER_BYTES`)."""
    unit = ctx.tokens * p.hidden
    e, r = ctx.act_bytes, ctx.residual_bytes
    block = p.kind == "block"
    if ctx.sp:
        if block:
            g = FP8_GATHER_BYTES if ctx.training.dtype == "fp8" else None
            return ({"all_gather": unit * (g or r), "reduce_scatter": unit * e},
                    {"reduce_scatter": unit * r, "all_gather": unit * (g or e)})
        both = {"reduce_scatter": unit * r, "all_gather": unit * r}
        return both, dict(both)
    return {"all_reduce": unit * (e if block else r)}, {"all_reduce": unit * r}


def ep_routed_bytes(p: LayerProfile, ctx: Context) -> tuple[float, float]:
    """Bytes of one MoE layer's (dispatch, combine) all-to-all per micro-batch, forward or backward (the
    backward sends each gradient back the same way): the dispatched tokens are the norm's output
    (`residual_bytes`), the combined ones the experts' matmul outputs."""
    routed = ctx.tokens * p.routed_per_token * p.hidden
    return routed * ctx.residual_bytes, routed * ctx.act_bytes


@dataclass(frozen=True)
class LayerCost:
    """One layer, one micro-batch, one GPU."""

    fwd_s: float  # forward compute, exposed TP/CP/EP communication included
    bwd_s: float  # backward, without recomputation
    recompute_selective_s: float  # extra backward time when the attention core is recomputed
    recompute_full_s: float  # extra backward time when the whole layer is recomputed
    comm_fwd_s: float  # exposed communication inside fwd_s (for the breakdown)
    comm_bwd_s: float
    act_none: float  # bytes kept for backward, no recomputation
    act_selective: float  # ... attention core recomputed
    act_full: float  # ... only the layer input kept
    params_local: float  # parameters held on this GPU (after tp and ep sharding)
    expert_params_local: float  # the expert part of params_local
    model_flops: float  # forward model FLOPs of this layer on this GPU
    recompute_flops_selective: float
    recompute_flops_full: float
    # the part of recompute_*_s that is torch.utils.checkpoint's own host time (CPU clusters), not re-run operators:
    # the runtime times it as backward compute, outside its "recompute" phase (runtime/timing.py)
    checkpoint_selective_s: float = 0.0
    checkpoint_full_s: float = 0.0
    # the head's loss on autoplan's runtime: bytes alive only while the cross-entropy runs (`loss_transient`)
    loss_transient: float = 0.0
    # autocast's 16-bit copies of the layer's weights, held once per rank for the step (`autocast_terms`)
    weight_copies: float = 0.0


def gemm_efficiency(cluster: ClusterSpec, m: float, n: float, k: float) -> float:
    """Fraction of peak a GEMM of shape (m x k) @ (k x n) reaches.

    Saturating in the harmonic mean of its dimensions: a GEMM is as good as its thinnest side allows
    (tile quantisation and too few tiles to fill the SMs; cf. NVIDIA's "Matrix multiplication background"
    guide). Fitted per GPU type.
    """
    cal = cluster.gpu.calibration
    if min(m, n, k) <= 0:
        return cal.matmul_max_efficiency
    size = 3.0 / (1.0 / m + 1.0 / n + 1.0 / k)
    return cal.matmul_max_efficiency * size / (size + cal.matmul_half_dim)


def _gemm_time(ctx: Context, flops: float, m: float, n: float, k: float, fp8: bool = True) -> float:
    """`fp8=False`: a GEMM that runs in 16 bits under an fp8 plan (`float8_gemm`)."""
    peak = ctx.cluster.gpu.peak_flops(ctx.training.dtype if fp8 else compute16(ctx.training.dtype))
    return flops / (peak * gemm_efficiency(ctx.cluster, m, n, k))


# Bytes per element to quantise a 16-bit tensor for an fp8 GEMM: read it once (2) and write its fp8 copy and that
# copy's transpose (1 + 1), which Hopper's fp8 GEMMs need for the backward's operands (Transformer Engine's fused
# cast-transpose kernel, transformer_engine/common/transpose/cast_transpose.cu; torchao's Float8Linear casts and
# transposes the same tensors). A separate amax pass of current (dynamic) scaling is not priced: Transformer
# Engine's delayed scaling takes the amax in the cast kernel, and under torch.compile torchao's fuses into the
# tensor's producer.
FP8_CAST_BYTES = 4.0


def float8_gemm(g: Gemm) -> bool:
    """Whether a weight GEMM runs in fp8 under an fp8 plan: the block and expert linears do; the LM head stays
    16-bit on both stacks that train in fp8 (torchtitan's llama3 train configs leave it out of the Float8
    converter: llama3_8b.toml's `filter_fqns = ["output"]`, 0.3's llama3_405b config `filter_fqns=["lm_head"]`;
    Megatron-Core's output layer is a plain ColumnParallelLinear outside Transformer Engine), and so does the
    attention core (neither converts SDPA / DotProductAttention by default: `_attention`)."""
    return g.tp != "vocab"


def fp8_cast_bytes(p: LayerProfile, ctx: Context) -> tuple[float, float]:
    """(forward, backward) bytes this GPU moves per micro-batch quantising the fp8 GEMMs' operands: each input and
    weight in the forward, each output gradient in the backward (FP8_CAST_BYTES per element); 0 unless fp8."""
    if ctx.training.dtype != "fp8":
        return 0.0, 0.0
    fwd = bwd = 0.0
    for g, (m, n, k, copies) in zip(p.gemms, _gemm_shapes(p, ctx)):
        if float8_gemm(g):
            fwd += copies * (m * k + k * n) * FP8_CAST_BYTES
            bwd += copies * m * n * FP8_CAST_BYTES
    return fwd, bwd


def _mem_time(ctx: Context, nbytes: float) -> float:
    gpu = ctx.cluster.gpu
    return nbytes / (gpu.hbm_gbps * 1e9 * gpu.calibration.memory_efficiency)


def _gemm_shapes(p: LayerProfile, ctx: Context) -> list[tuple[float, float, float, int]]:
    """(m, n, k, copies) on this GPU of each of the layer's weight GEMMs, in `p.gemms` order: copies are the
    local experts of an expert GEMM (each sees an equal share of the tokens routed to this rank: balanced
    routing), else 1."""
    t, out = ctx.tp, []
    for g in p.gemms:
        n, k = g.n, g.k
        if g.tp in ("col", "vocab"):
            n = -(-n // t)
        elif g.tp == "row":
            k = -(-k // t)
        rows = ctx.tokens * g.tokens_per_token
        copies = max(1, g.count // ctx.ep) if g.expert and g.count else 1
        out.append((rows / copies, n, k, copies))
    return out


def _gemm_parts(p: LayerProfile, ctx: Context) -> list[tuple[float, float]]:
    """(forward time, forward FLOPs) on this GPU of each of the layer's weight GEMMs, in `p.gemms` order."""
    out = []
    for g, (m, n, k, copies) in zip(p.gemms, _gemm_shapes(p, ctx)):
        flops = 2.0 * m * copies * n * k
        out.append((_gemm_time(ctx, flops, m, n, k, fp8=float8_gemm(g)), flops))
    return out


def op_sac_reruns(p: LayerProfile) -> list[bool]:
    """Per GEMM of a block (forward order), whether torchtitan's per-op selective checkpointing re-runs it in the
    backward (`TrainingSpec.selective_policy` 'every_other_matmul'). SelectiveAC's policy (torchtitan/distributed/
    activation_checkpoint.py) saves the outputs of torch's compute-intensive ops (torch._functorch.partitioners.
    get_default_op_list: mm, addmm, bmm, the SDPA kernels, ...) "except every second mm/linear", counting the
    block's mm calls in order; the MoE router's gate is always re-run (`force_recompute_mm_shapes_by_fqns`
    default "moe.router.gate"); the experts' grouped GEMMs (aten._grouped_mm, not in that list) are re-run too.
    Shortcut: every dense GEMM is counted as an aten.mm, as a bias-free (Llama-style) linear runs; a linear with a
    bias runs as addmm, which the policy saves without counting."""
    out, count = [], 0
    for g in p.gemms:
        if g.name == "router" or g.expert:
            out.append(True)
            continue
        count += 1
        out.append(count % 2 == 0)
    return out


# The operators SDPA's math path issues in the forward beyond the one fused call it replaces (aten's
# _scaled_dot_product_attention_math with dropout, torch 2.x, listed under a dispatch mode in session 23: the two
# scalings, the causal mask's ones/tril/scalar_tensor x2/where, the QK^T bmm, the mask add, _safe_softmax,
# empty_like/bernoulli_/div_ for the mask, its mul, the PV bmm; views left out).
SDPA_MATH_EXTRA_OPS = 14
# Bytes it keeps per score, in units of the activation width: the softmax's output, the dropout mask (a float
# tensor, not bytes) and the dropped probabilities the PV bmm saves.
SDPA_MATH_SAVED_PER_SCORE = 3


def sdpa_math_path(p: LayerProfile, ctx: Context) -> bool:
    """Whether autoplan's runtime runs `p`'s attention core through SDPA's math path: on CPU processes with
    attention dropout, which torch's CPU flash kernel does not take. The core is then separate operators: the
    full s x s probabilities are made and kept, the backward is two bmm per forward bmm (not the fused
    kernel's 2.5x), and a checkpoint's early stop leaves the PV bmm out of a selective re-run."""
    # the runtime runs gloo on CPU processes only (own_gpu_runtime)
    return (p.attention is not None and p.attention.dropout and ctx.training.runtime_memory
            and ctx.cluster.backend == "gloo")


def fused_attention(p: LayerProfile, ctx: Context) -> bool:
    """Whether `p`'s attention core runs as one fused kernel (flash): the stack's choice, unless the runtime falls
    back to SDPA's math path (`sdpa_math_path`)."""
    return ctx.training.flash_attention and not sdpa_math_path(p, ctx)


def _attention_flops(p: LayerProfile, ctx: Context) -> float:
    """Forward model FLOPs of the attention core on this GPU: QK^T and AV, causal counted in full (eq. 7)."""
    a = p.attention
    return 4.0 * ctx.mbs * ctx.seq * ctx.seq * (a.heads / ctx.tp) * a.head_dim / ctx.cp


def _attention_gemm_time(p: LayerProfile, ctx: Context) -> float:
    """The two batched GEMMs of an unfused attention core (QK^T and PV, causal computed in full), forward."""
    return _gemm_time(ctx, _attention_flops(p, ctx) * cp_score_fraction(ctx), ctx.seq / ctx.cp, ctx.seq,
                      p.attention.head_dim, fp8=False)


# The SDPA backward's matmuls relative to its forward's (torch.utils.flop_counter.sdpa_backward_flop_count:
# recompute QK^T, then dV, dP, dQ, dK = 5 bmm against the forward's QK^T and PV = 2): the FLOP counter's ratio
# (counts.layer_flops) and the fused kernel's backward time against its forward (`_attention`).
ATTN_BWD_FACTOR = 2.5


def _attention(p: LayerProfile, ctx: Context) -> tuple[float, float, float]:
    """(forward time, backward time, forward model FLOPs) of the attention core on this GPU."""
    a = p.attention
    if a is None:
        return 0.0, 0.0, 0.0
    heads = a.heads / ctx.tp
    b, s = ctx.mbs, ctx.seq
    model_flops = _attention_flops(p, ctx)
    cal = ctx.cluster.gpu.calibration
    peak = ctx.cluster.gpu.peak_flops(compute16(ctx.training.dtype))  # 16-bit under fp8 too (float8_gemm)
    if fused_attention(p, ctx):
        # a causal kernel skips the masked half of the scores; autoplan's context-parallel core computes its
        # query chunks against their key prefixes in full where it passes masks (`cp_mask_tensors`: CPU
        # processes), and the causal half on a GPU (the lower-right causal bias inside the kernel)
        masked = cp_mask_tensors(ctx)
        executed = model_flops * (cp_score_fraction(ctx) if masked else 0.5 if a.causal else 1.0)
        fwd = executed / (peak * cal.attention_efficiency)
        bwd = ATTN_BWD_FACTOR * fwd
        if masked:
            mask = _cp_mask_elements(ctx)
            fwd += _mem_time(ctx, mask * CP_MASK_FWD_BYTES)
            bwd += _mem_time(ctx, mask * CP_MASK_BWD_BYTES)
        return fwd, bwd, model_flops
    # Unfused: batched GEMMs [s x d] @ [d x s] and [s x s] @ [s x d] per head, causal computed in full,
    # plus scale-mask-softmax and dropout over b*heads*s*s scores (read + write, 2-byte, 1-byte masks).
    sq = s / ctx.cp
    gemm = _attention_gemm_time(p, ctx)
    e = ctx.act_bytes
    scores = b * heads * sq * s * cp_score_fraction(ctx)
    soft_bytes = scores * (2 * e + (2 * e + 1 if a.dropout else 0))
    fwd = gemm + _mem_time(ctx, soft_bytes)
    bwd = 2 * gemm + _mem_time(ctx, 1.5 * soft_bytes + scores * e)
    if a.score_bias:
        # ALiBi, unfused (Megatron-DeepSpeed, bigscience-workshop fork, megatron/model/transformer.py
        # ParallelAttention.forward): `matmul_result = alibi[:output_size[0]*output_size[1], :, :output_size[3]]`
        # (a [b*np, 1, sk] tensor), then `torch.baddbmm(matmul_result, q, k^T, beta=beta, alpha=1/norm_factor)`
        # with beta = 1 (or 1/layer_number), where without ALiBi it is `torch.empty(...)` and beta=0.0. PyTorch's
        # CUDA baddbmm (aten/src/ATen/native/cuda/Blas.cpp, 1.10-1.11) expands the [*, 1, sk] input to the output
        # shape and, "if (beta != 0.0) result.copy_(self)", writes it into the output, then runs bgemm with that
        # beta, which reads the output back: one write and one read of the b*np*sq*sk scores more per forward
        # (and per recompute). The bias has no gradient (a buffer), so the backward is unchanged.
        fwd += _mem_time(ctx, 2 * scores * e)
    return fwd, bwd, model_flops


# A cross-entropy over vocabulary-sharded logits all-reduces over tp, per token of the micro-batch, the logits' max,
# the target's logit and the sum of exponentials: torch's loss_parallel (torch.distributed.tensor.parallel.loss,
# which autoplan's runtime uses under tp) and Megatron's _VocabParallelCrossEntropy alike. In fp32 (autocast runs
# the softmax in fp32; Megatron casts the logits to float first).
VOCAB_PARALLEL_LOSS_ALL_REDUCES = 3


def vocab_parallel_loss_bytes(ctx: Context) -> float:
    """Bytes of each of the vocab-parallel loss's all-reduces for one micro-batch: a float per token on the rank."""
    return 4.0 * ctx.tokens


def _vocab_parallel_loss_comm(ctx: Context, grp) -> float:
    """The vocab-parallel cross-entropy's all-reduces for one micro-batch, back to back: the first finds the
    tp ranks arriving from their heads' GEMMs and pays what any collective inside a step pays; the others follow
    it with nothing in between, their peers already there (on an oversubscribed CPU node: no step or skew wait,
    as for the step's scalar all-reduces, estimate.step_scalars_time; elsewhere the same)."""
    nbytes = vocab_parallel_loss_bytes(ctx)
    return comm.all_reduce(ctx.cluster, grp, nbytes) \
        + (VOCAB_PARALLEL_LOSS_ALL_REDUCES - 1) * comm.all_reduce(comm.peers_present(ctx.cluster), grp, nbytes)


def gathered_logits_bytes(p: LayerProfile, ctx: Context) -> float:
    """Bytes of the all-gather that makes a vocabulary-parallel head's logits whole on every tp rank for one
    micro-batch when the forward transforms them (LayerProfile.logits_gathered: ColwiseParallel with a
    Replicate output, codegen.program.factory_tp_layout), counted as the gathered tensor (runtime.measure's
    convention): the GEMM's output, at the activation width. Its backward takes the rank's slice: no collective.
    0 where the logits stay split or the head is replicated."""
    if p.kind != "head" or ctx.tp <= 1 or not p.logits_gathered or not p.tp_allreduces:
        return 0.0
    return ctx.tokens * p.logits_per_token * ctx.act_bytes


def _head_logits_comm(p: LayerProfile, ctx: Context, grp) -> float:
    """What the head's logits cost on the wire after its GEMM, one micro-batch: the vocab-parallel loss's
    all-reduces where the logits reach the loss split (`LayerProfile.vocab_split`), or their all-gather where the
    forward transforms them first."""
    if p.vocab_split(ctx.tp) > 1:
        return _vocab_parallel_loss_comm(ctx, grp)
    gathered = gathered_logits_bytes(p, ctx)
    return comm.all_gather(ctx.cluster, grp, gathered) if gathered else 0.0


def tp_points(p: LayerProfile, training) -> tuple[int, int]:
    """A layer's tensor-parallel reduction points per micro-batch, (forward, backward): a block's row-parallel
    outputs forward and column-parallel input gradients backward, the vocab-parallel embedding's output forward,
    the LM head's input gradient backward (`tp_units` has the bytes of each). autoplan's runtime (`runtime_memory`)
    does not tensor-parallelise a MoE block's experts: only its attention reduces (cost_models.counts.layer_comm,
    measured by benchmarks/counts.py on tiny-moe with tp=2)."""
    per_block = 1 if p.moe_top_k and training.runtime_memory else p.tp_allreduces
    return {"block": (per_block, per_block), "embedding": (p.tp_allreduces, 0), "head": (0, p.tp_allreduces)}[p.kind]


def early_stop_skips_last_gemm(p: LayerProfile, training) -> bool:
    """Whether a full recomputation of `p` under torch.utils.checkpoint, non-reentrant, early stop (autoplan's
    runtime and torchtitan: `TrainingSpec.recompute_stops_early`) leaves out its last GEMM: a dense block's w2, whose
    output nothing saves, so the recomputation is over once w2's input is back (measured: benchmarks/counts.py's
    recompute FLOPs). What follows it (its row-parallel reduction, the residual add) is not run either. Megatron's
    reentrant checkpoint re-runs the whole forward, and so does an early stop where an op after w2 keeps a tensor
    for the backward (`LayerProfile.saves_after_last_gemm`: the hidden dropout's mask, a post-norm's input)."""
    last = p.gemms[-1] if p.gemms else None
    return (training.recompute_stops_early and p.kind == "block" and last is not None and not last.expert
            and not p.moe_top_k and not p.saves_after_last_gemm)


def full_recompute_tp_calls(p: LayerProfile, ctx: Context) -> dict[str, int]:
    """The forward tensor-parallel collectives a full recomputation of `p` runs again, per micro-batch: collective
    -> calls (the collectives of `tp_units`' forward unit). autoplan's runtime checkpoints a block with
    torch.utils.checkpoint (non-reentrant, early stop: runtime.parallelize.apply_recompute), whose recomputation
    stops once the last tensor the backward saved is back, after the block's last GEMM's input: a dense block's
    last point's reduction (the MLP's row-parallel all-reduce, or with sp its reduce-scatter) is not run again,
    while with sp the all-gather before the MLP's column-parallel GEMMs is (measured by benchmarks/counts.py:
    tp=2, sp=1, full recompute, 2 all-gathers and 1 reduce-scatter a block). A MoE block's one point (its
    attention's) is re-run, the experts following it. Megatron's reentrant checkpoint re-runs every point."""
    n_fwd = tp_points(p, ctx.training)[0]
    skipped = 1 if n_fwd and early_stop_skips_last_gemm(p, ctx.training) else 0
    return {c: n_fwd - (skipped if c != "all_gather" else 0) for c in tp_units(p, ctx)[0]}


# The collectives of `tp_units`, by name.
_TP_COLLECTIVE = {"all_reduce": comm.all_reduce, "reduce_scatter": comm.reduce_scatter, "all_gather": comm.all_gather}


def _skipped_tp_share(p: LayerProfile, ctx: Context) -> float:
    """The share of the forward's TP time (`_tp_comm`) a full recomputation does not run again
    (`full_recompute_tp_calls`), by the collectives' prices."""
    n_fwd = tp_points(p, ctx.training)[0]
    if ctx.tp <= 1 or not n_fwd:
        return 0.0
    grp = comm.group_of(ctx.cluster, ctx.tp, 1)
    units = tp_units(p, ctx)[0]
    price = {c: _TP_COLLECTIVE[c](ctx.cluster, grp, b) for c, b in units.items()}
    total = n_fwd * sum(price.values())
    calls = full_recompute_tp_calls(p, ctx)
    return sum((n_fwd - calls[c]) * t for c, t in price.items()) / total if total > 0 else 0.0


def _tp_comm(p: LayerProfile, ctx: Context, gemm_fwd: float) -> tuple[float, float]:
    """Exposed tensor-parallel communication (forward, backward) for one micro-batch."""
    if ctx.tp <= 1 or p.tp_allreduces == 0:
        return 0.0, 0.0
    grp = comm.group_of(ctx.cluster, ctx.tp, 1)
    # With sp, each all-reduce becomes a reduce-scatter + all-gather pair: the same bytes and hops on an NCCL
    # ring, but more on gloo (whose reduce-scatter is a whole all-reduce, see comm.reduce_scatter).
    units = tp_units(p, ctx)
    one_f, one_b = (sum(_TP_COLLECTIVE[c](ctx.cluster, grp, b) for c, b in u.items()) for u in units)
    n_fwd, n_bwd = tp_points(p, ctx.training)
    fwd, bwd = n_fwd * one_f, n_bwd * one_b
    # after the head's GEMM, not beside it: no overlap below applies to it
    loss = _head_logits_comm(p, ctx, grp) if p.kind == "head" else 0.0
    if ctx.training.tp_comm_overlap:
        # Chunked overlap (Megatron userbuffers): only the first of tp chunks is exposed, plus whatever
        # the GEMMs it pipelines with cannot hide.
        k = ctx.cluster.gpu.calibration.overlap_interference
        fwd_exp = fwd / ctx.tp + max(0.0, fwd * (1 - 1 / ctx.tp) - gemm_fwd)
        bwd_exp = bwd / ctx.tp + max(0.0, bwd * (1 - 1 / ctx.tp) - 2 * gemm_fwd)
        # the hidden part still slows the GEMMs it runs under (SMs and HBM taken by the comm kernels)
        fwd, bwd = fwd_exp + k * (fwd - fwd_exp), bwd_exp + k * (bwd - bwd_exp)
    elif ctx.training.tp_bwd_comm_overlap:
        # Megatron-LM's async TP communication (megatron/mpu/layers.py, 2022-03, ColumnParallelLinearWithAsync-
        # Allreduce.backward): "grad_input = grad_output.matmul(weight) # Asyncronous all-reduce handle =
        # torch.distributed.all_reduce(grad_input, group=get_tensor_model_parallel_group(), async_op=True)", then
        # the wgrad GEMM, then `handle.wait()` (with sp: `_reduce_scatter_base(..., async_op=True)` in its place,
        # commit 02bb1f5c): issued before the weight-gradient GEMM, waited on after it. Without sp that all-reduce
        # is the only backward collective of a linear pair (the row-parallel linear's backward needs none), so
        # all of it runs beside the wgrad GEMMs. With sp the row-parallel output's reduce-scatter has
        # an all-gather as its backward, synchronous before the row-parallel dgrad: half of each pair's traffic
        # stays exposed. (Session 7: before, the no-sp case also left half exposed, which put Korthikanti et al.
        # Table 4's 22B backward at 13.3 ms per layer against the paper's 11.9 ms.)
        k = ctx.cluster.gpu.calibration.overlap_interference
        # the all-gathers of sp's backward, not overlapped (fp8 ones are half the reduce-scatters' bytes)
        sync = n_bwd * comm.all_gather(ctx.cluster, grp, units[1]["all_gather"]) if ctx.sp else 0.0
        async_part = bwd - sync
        bwd_exp = sync + max(0.0, async_part - gemm_fwd / 2)  # the wgrad GEMMs of the column-parallel linears
        bwd = bwd_exp + k * (bwd - bwd_exp)
    return fwd + loss, bwd


# The boolean masks of autoplan's context-parallel core (runtime.parallelize.ContextParallelAttentionCore: one per
# query chunk, over its key prefix) are turned into additive fp32 masks by SDPA at every call (`where`: read 1
# byte, write 4) and read by the kernel (4), whose backward reads the saved one again (4): bytes per mask element,
# once per layer and micro-batch (broadcast over the batch and the heads).
CP_MASK_FWD_BYTES = 1 + 4 + 4
CP_MASK_BWD_BYTES = 4


def cp_masked_attention(ctx: Context) -> bool:
    """Whether the attention core runs as autoplan's runtime runs it under context parallelism
    (`TrainingSpec.cp_attention`): K and V gathered, then one masked SDPA per query chunk over the keys up to the
    chunk's end, every score of it computed (on a GPU the flash kernel cannot take a mask: SDPA runs its
    memory-efficient kernel)."""
    return ctx.cp > 1 and ctx.training.cp_style == "all_gather_masked"


def cp_mask_tensors(ctx: Context) -> bool:
    """Whether autoplan's context-parallel core hands SDPA its causal masks as tensors, so every score of a query
    chunk against its key prefix is computed: on CPU processes (gloo; torch's CPU kernels have no lower-right
    causal bias and materialise it). On a GPU each chunk's mask is torch's `causal_lower_right` bias (the chunk's
    queries are the last positions of its key prefix), which flash or memory-efficient attention applies inside
    the kernel, skipping the masked blocks: the rank computes the causal half of its s/cp x s scores, as any
    causal kernel, and keeps no mask (runtime.parallelize.prefix_attention)."""
    return cp_masked_attention(ctx) and ctx.cluster.backend == "gloo"


def cp_score_fraction(ctx: Context) -> float:
    """Of the scores of the rank's queries against the whole sequence (s/cp x s, the model FLOPs' count), the
    fraction autoplan's context-parallel core computes: its two query chunks of c = s/(2cp) tokens (chunks r and
    2cp-1-r) against the keys up to their ends, (r+1)c and (2cp-r)c, together c^2 (2cp+1) of 4cp c^2 on every
    rank. The FLOP counter counts those calls by their shapes, so the counts take it too. 1 without it (a causal
    kernel's skipped half is the time model's, `_attention`)."""
    if not cp_masked_attention(ctx):
        return 1.0
    return (2 * ctx.cp + 1) / (4 * ctx.cp)


def _cp_mask_elements(ctx: Context) -> float:
    """Elements of the rank's two causal masks, one per query chunk over its key prefix: c^2 (2cp+1)."""
    return (ctx.seq / (2 * ctx.cp)) ** 2 * (2 * ctx.cp + 1)


def cp_kv_bytes(p: LayerProfile, ctx: Context) -> float:
    """K (or V) of one micro-batch over the whole sequence, as this tp rank holds its heads: what the all-gather
    of `all_gather` context parallelism assembles (counts books its calls with the same bytes)."""
    a = p.attention
    return ctx.mbs * ctx.seq * (a.kv_heads / min(ctx.tp, a.kv_heads)) * a.head_dim * ctx.act_bytes


def _cp_comm(p: LayerProfile, ctx: Context, attn_fwd: float) -> tuple[float, float]:
    """Context parallelism's K/V traffic of one micro-batch, forward and backward, as `cp_attention` runs it."""
    if ctx.cp <= 1 or p.attention is None:
        return 0.0, 0.0
    grp = comm.group_of(ctx.cluster, ctx.cp, ctx.tp)
    if ctx.training.cp_style != "ring":
        # K and V gathered before the attention, nothing to hide them behind (Llama 3: "the all-gather
        # communication latency is exposed in the critical path"); their gradients scattered back after it
        kv = cp_kv_bytes(p, ctx)
        fwd = 2 * comm.all_gather(ctx.cluster, grp, kv)
        if ctx.training.cp_style == "all_gather":
            return fwd, 2 * comm.reduce_scatter(ctx.cluster, grp, kv)
        # autoplan's runtime (parallelize._AllGatherSequence): the gathered parts are concatenated in position
        # order (read and write the whole); the backward concatenates each rank's two chunks of the gradient
        # (read, write), sends them with an all-to-all (gloo has no reduce-scatter) and sums what comes back with
        # a stack and a sum (read and write cp slices, read them again, write one)
        fwd += 2 * _mem_time(ctx, 2 * kv)
        bwd = 2 * (comm.all_to_all(ctx.cluster, grp, kv) + _mem_time(ctx, (2 + 3 + 1 / ctx.cp) * kv))
        return fwd, bwd
    # ring attention: K and V travel round the cp ring, each step's transfer overlapped with the attention
    a = p.attention
    kv_bytes = 2 * ctx.tokens * (a.kv_heads / min(ctx.tp, a.kv_heads)) * a.head_dim * ctx.act_bytes
    link = ctx.cluster.intra_node if grp.nodes == 1 else ctx.cluster.inter_node
    step = comm.p2p(ctx.cluster, kv_bytes, cross_node=link is ctx.cluster.inter_node)
    k = ctx.cluster.gpu.calibration.overlap_interference
    total_f, total_b = (ctx.cp - 1) * step, 2 * (ctx.cp - 1) * step
    fwd = max(step, total_f - attn_fwd * (ctx.cp - 1) / ctx.cp)
    bwd = max(step, total_b - ATTN_BWD_FACTOR * attn_fwd * (ctx.cp - 1) / ctx.cp)
    return fwd + k * max(0.0, total_f - fwd), bwd + k * max(0.0, total_b - bwd)


def _ep_comm(p: LayerProfile, ctx: Context) -> tuple[float, float]:
    """Token dispatch and combine all-to-alls of a MoE layer."""
    if not p.moe_top_k or ctx.ep <= 1:
        return 0.0, 0.0
    grp = comm.group_of(ctx.cluster, ctx.ep, ctx.tp * ctx.cp)
    one = sum(comm.all_to_all(ctx.cluster, grp, b / (ctx.tp if ctx.sp else 1)) for b in ep_routed_bytes(p, ctx))
    return one, one


# Squared ReLU run eagerly as `F.relu(x).square()` (autoplan.zoo.model.Activation, models.blocks.Activation)
# beyond the profile's one-pass activation count (read x, write y; backward twice that): forward relu (r x, w r) and
# square (r r, w y) move one tensor-sized read and write more, 4 bytes an element at 2-byte activations; backward
# square's (r dy, r r, w dr) and relu's threshold_backward (r dr, r r, w dx) move 6 passes against the counted 4,
# 4 bytes more. Megatron jit-fuses it (megatron/core/activations.py: `@jit_fuser def squared_relu`), so its
# kernels price the one pass.
RELU2_EAGER_EXTRA = (4.0, 4.0)


def _eager_extra_bytes(p: LayerProfile, ctx: Context, seq_div: int) -> tuple[float, float]:
    """Bytes eager PyTorch moves beyond fused kernels for the norms, activation and RoPE of one micro-batch
    (the profile's elementwise counts are those of fused kernels; `autoplan.kernels.traffic` has the counts): all
    three with torch's kernels, RoPE alone with autoplan's (the runtime has no RoPE substitution), none with
    Megatron's."""
    if ctx.training.kernels == "megatron":
        return 0.0, 0.0
    f = b = 0.0
    scale = ctx.act_bytes / 2.0
    parts = []
    eager = ctx.training.kernels == "torch"
    if p.norm_kind and eager:
        parts.append(("rms_norm" if p.norm_kind == "rmsnorm" else "layer_norm", p.norm_elems / seq_div))
    if p.act_kind in ("gelu", "swiglu") and eager:
        parts.append(("bias_gelu" if p.act_kind == "gelu" else "swiglu", p.act_elems / ctx.tp))
    if p.rope_elems:  # autoplan's runtime substitutes norms and activations only (codegen.fuse): RoPE runs eager
        parts.append(("rope", p.rope_elems / ctx.tp))
    for op, elems in parts:
        xf, xb = eager_extra(op)
        f += ctx.tokens * elems * xf * scale
        b += ctx.tokens * elems * xb * scale
    if p.act_kind == "relu2":  # no fused kernel on either set of autoplan's kernels: two eager ops
        f += ctx.tokens * p.act_elems / ctx.tp * RELU2_EAGER_EXTRA[0] * scale
        b += ctx.tokens * p.act_elems / ctx.tp * RELU2_EAGER_EXTRA[1] * scale
    return f, b


def _head_softmax_units(p: LayerProfile) -> float:
    """The cross-entropy's fp32 log-softmax in a head's act_tp, per token in the profile's units (bytes at 2-byte
    activations: 4 per logit). It is fp32 whatever the activation width -- the loss upcasts the logits
    (zoo.model.cross_entropy_loss: `logits.float()`; profile_from_spec's head counts it so) and in fp32 training
    they already are -- so it keeps its 4 bytes per logit where the rest of a profile scales with the width.
    0 where the head's act_tp holds less (a loss reading the logits at the model's width)."""
    if p.kind != "head" or not p.logits_per_token:
        return 0.0
    fp32 = 4.0 * p.logits_per_token
    return fp32 if p.act_tp >= fp32 else 0.0


def fused_calls(p: LayerProfile) -> int:
    """Calls of autoplan's fused Triton modules in one forward of layer `p` as the runtime substitutes them
    (codegen.fuse: every LayerNorm / RMSNorm, and a block's GeLU or SwiGLU activation; RoPE and the loss stay
    eager)."""
    return p.norms() + (1 if p.kind == "block" and p.act_kind in ("gelu", "swiglu") else 0)


def own_gpu_runtime(training, cluster) -> bool:
    """autoplan's own runtime (`runtime_memory`) on a GPU host (nccl, no cores given: the runtime runs gloo on CPU
    processes only), where its fused modules' and checkpoint's host time is priced (layer_cost)."""
    return training.runtime_memory and cluster.backend == "nccl" and cluster.cores_per_node is None


def fused_host_priced(training, cluster) -> bool:
    """Whether the fused modules' host time is priced for this run (layer_cost): autoplan's own runtime with its
    fused kernels on a GPU cluster that has a measured fused_call_us. Only then can torch's kernels be the faster
    set (search.core._choose_kernels, the estimate command's hint)."""
    return (training.kernels == "fused" and own_gpu_runtime(training, cluster)
            and cluster.gpu.calibration.fused_call_us > 0)


def runtime_saved_extra(p: LayerProfile, ctx: Context) -> tuple[float, float]:
    """Activation bytes of one micro-batch that autoplan's runtime's eager modules save beyond the profile's
    (Megatron's) counts, as (kept unless the layer is fully recomputed, kept unless its attention core is
    recomputed too). Checked against the runtime by benchmarks/counts.py (fp32 and bf16 on CPU processes) and on
    an H200 (session 17: Llama-3.2-1B's block keeps 42 bf16 bytes per token and hidden unit with the fused kernels,
    50 with torch's; the profile counts 39):
    - eager SwiGLU keeps silu(w1 x) as well as w1 x (a fused kernel recomputes it);
    - the MoE combine keeps the k expert outputs of each token for the gradient of the router weights, and
      experts are whole on every tp rank (the profile divides their saved activations by tp);
    - torch runs rms_norm as its composite except on CUDA (`_norm_composite`);
    - with sequence parallelism the column-parallel GEMMs save their gathered input (`_sp_gathered`);
    - SDPA saves the K and V it is given: query-head-wide under GQA, whole-sequence under cp (`_core_saved`)."""
    if p.kind != "block":
        return 0.0, 0.0
    per_token = 0.0
    if p.act_kind == "swiglu" and ctx.training.kernels == "torch":
        per_token += p.act_elems / (1 if p.moe_top_k else ctx.tp)
    if p.moe_top_k:
        per_token += p.routed_per_token * p.hidden
    extra = ctx.tokens * per_token * ctx.act_bytes
    if p.moe_top_k and ctx.tp > 1:
        # 2-byte units as in profile._block: fc1 outputs, fc2 input, dispatched tokens, router probabilities
        k, gated = p.routed_per_token, p.act_kind == "swiglu"
        moe_act = 2 * p.act_elems * (2 if gated else 1) + 2 * p.act_elems + 2 * p.hidden * k + 4 * p.moe_experts
        extra += ctx.tokens * moe_act * (1 - 1 / ctx.tp) * ctx.act_bytes / 2.0
    return extra + _norm_composite(p, ctx) + _sp_gathered(p, ctx), _core_saved(p, ctx)


def _sp_gathered(p: LayerProfile, ctx: Context) -> float:
    """With sequence parallelism, DTensor's SequenceParallel -> ColwiseParallel all-gathers a norm's output over
    the sequence before the column-parallel GEMMs, and those GEMMs save the gathered (whole-sequence) input; the
    profile counts the sharded norm output (Megatron keeps the shard and gathers again in backward). Once before
    the attention, once before a dense MLP (a MoE block's experts are not tensor-parallel)."""
    if not ctx.sp or ctx.tp == 1:
        return 0.0
    gathers = 1 if p.moe_top_k else 2
    return gathers * ctx.tokens * p.hidden * (1 - 1 / ctx.tp) * ctx.act_bytes


def _core_saved(p: LayerProfile, ctx: Context) -> float:
    """What the runtime's attention core saves beyond the profile's local Q, K, V. SDPA saves the K and V it is
    given: the eager core repeats K/V heads to the query heads for GQA (repeat_interleave before SDPA,
    zoo.model.AttentionCore) and, with context parallelism, gathers them over the whole sequence
    (runtime.parallelize.ContextParallelAttentionCore), so it saves cp x seq/cp tokens of a query-head-wide K and
    V instead of the local kv-head-wide ones (which nothing else keeps). With cp the core passes a boolean
    (s/cp, s) mask on CPU processes (`cp_mask_tensors`) that SDPA turns into an additive fp32 mask (`where`),
    saved for the backward."""
    a = p.attention
    if a is None:
        return 0.0
    d_tp = a.head_dim / ctx.tp
    extra = ctx.tokens * 2 * d_tp * (ctx.cp * a.heads - a.kv_heads) * ctx.act_bytes
    if cp_mask_tensors(ctx):
        extra += _cp_mask_elements(ctx) * 4
    return extra


def _norm_composite(p: LayerProfile, ctx: Context) -> float:
    """torch runs rms_norm as its composite (x * rsqrt(mean(x^2) + eps) * w) except on CUDA, where
    `_fused_rms_norm` saves only the input and the rstd: the composite also saves the normalised x (for the
    weight's gradient), one more residual-stream-wide tensor per norm (two per block)."""
    if p.norm_kind != "rmsnorm" or ctx.cluster.gpu.name != "cpu":
        return 0.0
    return 2 * ctx.tokens * p.hidden / (ctx.tp if ctx.sp else 1) * ctx.act_bytes


def _core_kernels(p: LayerProfile) -> int:
    """Kernels of the selective recompute region, the attention core (autoplan.zoo.model.AttentionCore): the
    SDPA, plus the two repeat_interleaves that expand K and V under grouped-query attention. (The profile's
    kernels_fwd counts the core as one kernel; the expansion is small next to it on a GPU, not on a CPU host.)"""
    a = p.attention
    return 1 + (2 if a is not None and a.kv_heads < a.heads else 0)


@dataclass(frozen=True)
class AutocastTerms:
    """What autoplan's runtime adds to a layer's 16-bit count per micro-batch by computing under torch.autocast
    over fp32 parameters (TrainingSpec.autocast_fp32_params): bytes moved in forward and backward, bytes kept for
    backward, and bytes kept when the whole layer is recomputed."""

    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    saved: float = 0.0
    saved_full: float = 0.0
    weight_copies: float = 0.0  # held once per rank for the whole step, whatever the micro-batches in flight


# Linears that read each norm's output in the zoo's blocks (autoplan.zoo.model): wq, wk, wv after the attention
# norm; w1 (and w3 under SwiGLU; a MoE's router and its routed token copies) after the MLP norm; the LM head
# after the final norm.
def _norm_readers(p: LayerProfile) -> tuple[int, ...]:
    if p.kind == "head":
        return (1,)
    if p.kind != "block" or not p.norm_kind:
        return ()
    return (3, 2 if p.act_kind == "swiglu" or p.moe_experts else 1)


def autocast_terms(p: LayerProfile, ctx: Context, seq_div: int) -> AutocastTerms:
    """Per micro-batch, on one GPU, what torch.autocast over fp32 parameters costs beyond 16-bit weights and
    activations (runtime.parallelize.apply_mixed_precision). Measured on an H200 (session 12, benchmarks/gpu/:
    saved.py counts what a micro-batch keeps, kernel_time.py where the step's time goes):
    - weights: each GEMM weight is cast to 16 bits once per step (read 4, write 2 bytes: in
      estimate.optimizer_time, a per-step pass) and the copy is kept for the whole step (2 bytes per parameter,
      `weight_copies`: Trainer._context holds one autocast cache over the step's forwards; before it, every
      micro-batch made and kept its own, 1.99-2.00 bytes per parameter per micro-batch measured). Under
      unpipelined FSDP2 the runtime casts in every micro-batch's forward instead (estimate.casts_once_per_step:
      a cache across micro-batches lost gradients there); priced as `m` casts, and the copy as held once (one
      micro-batch is in flight at a time; under full recompute the checkpoint drops it, so this over-counts by
      up to 2 bytes per parameter, the safe way); each 16-bit
      weight gradient is cast to an fp32 temporary (read 2, write 4) that AccumulateGrad adds into .grad (read 4 +
      4, write 4): 18 bytes per parameter per micro-batch in backward;
    - activations: the residual stream is fp32 (the embedding's output and every residual add are), so a norm
      reads and writes 4-byte elements and keeps its fp32 input (2 bytes more per element than the profile's
      16-bit count: 8.0-8.1 bytes per token and hidden unit measured for a block's two norms), and every linear
      that reads a norm's output casts it to 16 bits itself (autocast caches only casts of leaves) and keeps its
      own copy: 2 bytes per element per reader beyond the first (GPT-1.3B's block: 42.0 measured against the
      profile's 34 + 4 + 4); in backward each cast's gradient is cast back (read 2, write 4) and the readers'
      gradients are summed in fp32; the two residual adds read and write fp32;
    - a fully recomputed block keeps its fp32 input (2 bytes more per element than act_input counts)."""
    if not ctx.training.autocast:
        return AutocastTerms()
    weights = 0.0
    for g in p.gemms:
        # a tied LM head (count 0: its weight is the embedding's) casts the embedding's weight all the same
        n = g.n * g.k * max(1, g.count) / (ctx.ep if g.expert else 1)
        weights += n if g.tp == "replicated" else n / ctx.tp
    tok = ctx.tokens / seq_div
    h = p.hidden
    readers = _norm_readers(p)
    n_norms, n_reads = len(readers), sum(readers)
    adds = 2 if p.kind == "block" else 0
    fwd = tok * h * (6 * n_reads + 4 * n_norms + 6 * adds)
    bwd = 18 * weights + tok * h * (6 * n_reads + 12 * (n_reads - n_norms) + 8 * n_norms)
    saved_act = tok * h * (2 * n_norms + 2 * (n_reads - n_norms))
    return AutocastTerms(fwd_bytes=fwd, bwd_bytes=bwd, saved=saved_act, weight_copies=2 * weights,
                         saved_full=tok * (p.act_input / 2) * 2 if p.kind == "block" else 0.0)


# Bytes per token of the index tensors loss_parallel's backward makes beside its three logit-sized ones
# (torch.distributed.tensor.parallel.loss._nll_loss_and_log_softmax_backward): the safe target (where, int64),
# the masked target (int64), arange (int64), grad_update (fp32), the masked output gradient (where, fp32) and the
# mask (bool): 8 + 8 + 8 + 4 + 4 + 1.
LOSS_PARALLEL_INDEX_BYTES = 33


def loss_backward_temporaries(p: LayerProfile, ctx: Context) -> float:
    """Bytes the loss's backward holds beside the kept log-softmax, one micro-batch: the gradient of the
    log-softmax and then of the logits (nll_loss_backward, _log_softmax_backward_data), two fp32 tensors of the
    local logits. Under tensor parallelism the engine runs the loss in `loss_parallel`, whose fused backward
    (torch.distributed.tensor.parallel.loss._nll_loss_and_log_softmax_backward) holds three at its widest:
    grad_input (zeros_like), exp(x) and their sum, and per token the index tensors (LOSS_PARALLEL_INDEX_BYTES).
    The same with autoplan's fused kernels (the loss is eager): on an H200 (session 17, benchmarks/gpu/saved.py)
    the step's allocator peak exceeds the forward's by 2 bytes per logit (8 here against the forward's 6),
    0.39 GiB for GPT-1.3B at V 51,200 and 0.98 for Llama-3.2-1B at V 128,256, 2 x 2048 tokens."""
    if p.kind != "head" or not p.logits_per_token:
        return 0.0
    split = p.vocab_split(ctx.tp)  # loss_parallel's backward where the logits reach it split
    tmp = (3 if split > 1 else 2) * ctx.tokens * p.logits_per_token / split * 4
    return tmp + (ctx.tokens * LOSS_PARALLEL_INDEX_BYTES if split > 1 else 0.0)


def loss_transient(p: LayerProfile, ctx: Context) -> float:
    """Bytes the runtime's loss holds beyond the head's kept activations while it runs, one micro-batch (autoplan's
    stack, `runtime_memory`), the wider of its forward and its backward (both come while every kept activation
    of the micro-batch is alive). Forward: zoo.model.cross_entropy_loss upcasts the logits (`logits.float()`) and
    log-softmax writes its fp32 output (the kept softmax, in act_tp) while the logits and their fp32 copy are
    alive: 2 + 4 bytes per logit from 16-bit logits, 4 from fp32 ones (the upcast is then the same tensor).
    Measured on an H200 (session 12, benchmarks/gpu/saved.py): the forward's allocator peak is the kept tensors
    plus 2.9 GiB for Llama-3.2-1B-shaped at V 128,256 and mbs 2 x 2048 tokens (6 bytes x 4096 x 128,256 = 2.94
    GiB). Backward: `loss_backward_temporaries`, 8 bytes per logit (12 under loss_parallel)."""
    if p.kind != "head" or not p.logits_per_token or not ctx.training.runtime_memory:
        return 0.0
    per_logit = ctx.act_bytes + 4 if ctx.act_bytes < 4 else 4
    forward = ctx.tokens * p.logits_per_token / p.vocab_split(ctx.tp) * per_logit
    return max(forward, loss_backward_temporaries(p, ctx))


def _op_sac_recompute(p: LayerProfile, ctx: Context, parts: list[tuple[float, float]], elementwise_f: float,
                      host_fwd: float, cpu_host: bool, region: Callable[[int], float],
                      tp_fwd: float) -> tuple[float, float, float]:
    """(time, FLOPs, checkpoint bookkeeping time) of re-running a block under torchtitan's per-op selective
    checkpointing (`op_sac_reruns`), one micro-batch: the re-run GEMMs, every elementwise op of the forward (norms,
    activations, RoPE, residual adds: `elementwise_f`), the host time of every re-run kernel (all but the saved
    GEMMs and the attention kernel), and the forward's tensor-parallel collectives except the reduce-scatters
    (SelectiveAC saves reduce_scatter_tensor outputs; an all-gather or an all-reduce runs again), exposed as the
    forward's are (`tp_fwd`). The attention kernel is saved, and with it context parallelism's exchange; the
    expert-parallel all-to-alls are saved. On a CPU host the block is one torch.utils.checkpoint region
    (`region`). `parts`: the layer's `_gemm_parts`."""
    reruns = op_sac_reruns(p)
    gemm_t = sum(x for (x, _), r in zip(parts, reruns, strict=True) if r)
    flops = sum(f for (_, f), r in zip(parts, reruns, strict=True) if r)
    kept_kernels = sum(1 for r in reruns if not r) + (1 if p.attention is not None else 0)
    frac = max(0.0, p.kernels_fwd - kept_kernels) / p.kernels_fwd if p.kernels_fwd else 0.0
    dev = gemm_t + elementwise_f
    host = host_fwd * frac
    comm_t = 0.0
    if ctx.tp > 1 and p.tp_allreduces and tp_fwd > 0:
        # the forward's exposed TP time (overlap included, as the forward pays it), the share of it that is not a
        # reduce-scatter
        grp = comm.group_of(ctx.cluster, ctx.tp, 1)
        times = {c: _TP_COLLECTIVE[c](ctx.cluster, grp, b) for c, b in tp_units(p, ctx)[0].items()}
        total = sum(times.values())
        comm_t = tp_fwd * (total - times.get("reduce_scatter", 0.0)) / total if total > 0 else 0.0
    if cpu_host:
        ckpt = region(p.kernels_fwd)
        return dev + host + comm_t + ckpt, flops, ckpt
    return max(dev, host) + comm_t, flops, 0.0


def _op_sac_kept(p: LayerProfile, ctx: Context, attention_saved: float) -> float:
    """Bytes a block keeps per micro-batch under torchtitan's per-op selective checkpointing beyond the region's
    input: the outputs of the GEMMs it saves (a column-parallel GEMM's n/tp features, a row-parallel one's whole
    pre-reduction output, over every token of the micro-batch with sequence parallelism too), the reduce-scatters'
    outputs under sp (saved as communication results), and the attention kernel's outputs: its context (heads x
    head_dim / tp) and `attention_saved` (flash: the fp32 log-sum-exp; unfused: the scores)."""
    e, t = ctx.act_bytes, ctx.tp
    kept = 0.0
    for g, rerun in zip(p.gemms, op_sac_reruns(p), strict=True):
        if rerun:
            continue
        width = -(-g.n // t) if g.tp in ("col", "vocab") else g.n
        kept += ctx.tokens * g.tokens_per_token * width * e
    if ctx.sp and t > 1:
        kept += p.tp_allreduces * ctx.tokens * p.hidden / t * e
    if p.attention is not None:
        kept += ctx.tokens * p.attention.heads / t * p.attention.head_dim * e + attention_saved
    return kept


def selective_is_free(training: TrainingSpec) -> bool:
    """Selective recomputation (Megatron's attention-core policy) re-runs and saves nothing on a GPU: the flash
    kernel recomputes its scores anyway and the stack keeps the kernel's outputs (autoplan's runtime checkpoints the
    core, so it re-runs the flash forward: `runtime_memory`). Then a partial full recomputation, whose other layers
    recompute selectively, is Megatron's block method (the others recompute nothing)."""
    return training.flash_attention and not training.runtime_memory and training.selective_policy == "attention_core"


def layer_cost(p: LayerProfile, ctx: Context) -> LayerCost:
    """Time, memory and FLOPs of layer `p` for one micro-batch on one GPU."""
    cal = ctx.cluster.gpu.calibration
    t, e = ctx.tp, ctx.act_bytes
    parts = _gemm_parts(p, ctx)
    gemm_fwd, gemm_flops = sum(x for x, _ in parts), sum(f for _, f in parts)
    attn_fwd, attn_bwd, attn_flops = _attention(p, ctx)
    seq_div = t if ctx.sp else 1
    # The loss is eager cross-entropy on every stack that uses autoplan's kernels: the runtime's loss_fn
    # (runtime.engine) never calls the chunked Triton cross-entropy (kernels/cross_entropy.py), so the head's fp32
    # softmax is read, written and kept as the profile counts it (session 12: the H200's saved-tensor census,
    # benchmarks/gpu/saved.py, finds 4 bytes per logit kept with the fused kernels too).
    ew_tp = p.elementwise_tp
    if p.kind == "head" and ctx.training.loss_fusion:  # Megatron-Core's fused cross-entropy (its backward: twice)
        ew_tp *= FUSED_CE_BYTES / EAGER_CE_BYTES
    ew_elems = ctx.tokens * (ew_tp / t + p.elementwise_seq / seq_div)
    ew_fwd = _mem_time(ctx, ew_elems * e)
    xf, xb = _eager_extra_bytes(p, ctx, seq_div)
    ew_extra_f, ew_extra_b = _mem_time(ctx, xf), _mem_time(ctx, xb)
    # Host-side cost of issuing the layer's kernels (Python, dispatch, launch). The GPU runs ahead of the
    # host, so a layer takes the longer of the two: small layers become launch-bound.
    launch_us = cal.kernel_launch_us + (cal.tp_op_overhead_us if t > 1 else 0.0)
    cpu_host = ctx.cluster.cores_per_node is not None
    # autoplan's own runtime on a GPU host: its fused Triton modules cost host time beyond the eager ops they
    # replace (fused_call_us), torch.utils.checkpoint's hooks too (below)
    own_gpu = own_gpu_runtime(ctx.training, ctx.cluster)
    host_fwd = p.kernels_fwd * launch_us * 1e-6 + (fused_calls(p) * cal.fused_call_us * 1e-6
                                                   if own_gpu and ctx.training.kernels == "fused" else 0.0)
    math = sdpa_math_path(p, ctx)  # SDPA's math path: its operators, the selective re-run, the kept scores
    if math:
        host_fwd += SDPA_MATH_EXTRA_OPS * launch_us * 1e-6
    tp_f, tp_b = _tp_comm(p, ctx, gemm_fwd)
    cp_f, cp_b = _cp_comm(p, ctx, attn_fwd)
    ep_f, ep_b = _ep_comm(p, ctx)
    comm_f, comm_b = tp_f + cp_f + ep_f, tp_b + cp_b + ep_b
    ac = autocast_terms(p, ctx, seq_div)
    q8_f, q8_b = fp8_cast_bytes(p, ctx)
    dev_f = gemm_fwd + attn_fwd + ew_fwd + ew_extra_f + _mem_time(ctx, ac.fwd_bytes + q8_f)
    dev_b = 2 * gemm_fwd + attn_bwd + 2 * ew_fwd + ew_extra_b + _mem_time(ctx, ac.bwd_bytes + q8_b)
    if cpu_host:
        # CPU processes (a cluster whose cores are given): the thread that issues an operator also runs it, so
        # nothing of the host time hides under the kernels
        fwd, bwd = dev_f + host_fwd + comm_f, dev_b + 2 * host_fwd + comm_b
    else:
        fwd, bwd = max(dev_f, host_fwd) + comm_f, max(dev_b, 2 * host_fwd) + comm_b
    # Selective recomputation re-runs the attention core (and its softmax) in backward. A flash kernel recomputes
    # its scores anyway, so a stack that keeps the kernel's outputs has nothing extra to do; autoplan's runtime
    # (`runtime_memory`: the stack is autoplan's own) checkpoints the core, so the flash forward runs again
    # (runtime.parallelize.apply_recompute; counts.layer_flops books it as recompute FLOPs), and so does any run
    # on CPU processes (below).
    reruns_core = not ctx.training.flash_attention or ctx.training.runtime_memory or cpu_host
    # SDPA's math path: the core's re-run stops once the dropped probabilities are back, before the PV bmm
    sel = (attn_fwd - (0.5 * _attention_gemm_time(p, ctx) if math else 0.0)) if reruns_core else 0.0
    if reruns_core and cp_masked_attention(ctx):
        sel += cp_f  # the checkpointed core gathers K and V again (counts.layer_comm books the calls)
    # the whole forward, its TP communication included, but for what a checkpoint stopping early leaves out: the
    # last GEMM (its kernel and its operator's host time) and the reduction after it
    stops_early = early_stop_skips_last_gemm(p, ctx.training)
    rerun_dev = dev_f - (parts[-1][0] if stops_early else 0.0)
    rerun_host = host_fwd - (launch_us * 1e-6 if stops_early else 0.0)
    rerun_comm = comm_f - _skipped_tp_share(p, ctx) * tp_f
    full = max(rerun_dev, rerun_host) + rerun_comm
    rec_sel_flops = attn_flops * (0.5 if math else 1.0) if reruns_core else 0.0
    ckpt_sel = ckpt_full = 0.0

    def region(ops: int) -> float:
        return (cal.recompute_region_us + ops * cal.recompute_op_us) * 1e-6

    if cpu_host:
        # On CPU processes the host is the critical path, and the runtime's recompute is torch.utils.checkpoint
        # (runtime.parallelize.apply_recompute: checkpoint_wrapper, non-reentrant, preserve_rng_state): each
        # checkpointed region costs its bookkeeping once per micro-batch (recompute_region_us) and a saved-tensor
        # hook per operator (recompute_op_us), and the selective region (the block's attention core: GQA expand
        # + SDPA) issues its kernels again (session 9: measured on local-cpu, selective cost most of what full did).
        ckpt_full = region(p.kernels_fwd)
        full = rerun_dev + rerun_host + rerun_comm + ckpt_full
        if p.attention is not None:
            core = _core_kernels(p)
            ckpt_sel = region(core)
            sel += core * launch_us * 1e-6 + ckpt_sel
    elif own_gpu:
        # The same checkpoint on a GPU host: its hooks are host time, which the region's kernels hide only where
        # they outlast it. Session 17, one H200 (docs/notes/session-17): GPT-1.3B's block forward took 2.2 ms under
        # full recompute against 1.6 without, and the recompute 2.6 ms: the host, not the GPU, bounds it there.
        # The increase over the plain re-run is booked as checkpoint time, as on a CPU host.
        plain = full  # the re-run without the checkpoint's hooks
        full = max(rerun_dev, rerun_host + region(p.kernels_fwd)) + rerun_comm
        ckpt_full = full - plain
        if p.attention is not None:
            core = _core_kernels(p)
            plain = sel
            sel = max(plain, core * launch_us * 1e-6 + region(core))
            ckpt_sel = sel - plain
    op_sac = ctx.training.selective_policy == "every_other_matmul" and p.kind == "block"
    if op_sac:
        sel, rec_sel_flops, ckpt_sel = _op_sac_recompute(
            p, ctx, parts, ew_fwd + ew_extra_f + _mem_time(ctx, ac.fwd_bytes), host_fwd, cpu_host, region, tp_f)
    # Activations (bytes) of one micro-batch: Korthikanti et al. 2022 Table 2 generalised.
    tok = ctx.tokens
    scale = e / 2.0  # profiles count 2-byte activations
    # the head's fp32 log-softmax is fp32 at any activation width: only the rest of act_tp scales with it
    softmax = _head_softmax_units(p)
    base = tok * ((p.act_tp - softmax) / t * scale + softmax / t + p.act_seq / seq_div * scale)
    scores = 0.0
    if math:
        # the full s x s scores (causal masked, not skipped), SDPA_MATH_SAVED_PER_SCORE tensors of them, in place
        # of the flash kernel's log-sum-exp
        scores = tok * p.attention.heads / t * ctx.seq * cp_score_fraction(ctx) * SDPA_MATH_SAVED_PER_SCORE * e
    elif p.attention is not None and not ctx.training.flash_attention:
        scores = tok * p.act_scores_per_seq * (ctx.seq) / t * scale
    elif p.attention is not None:
        scores = tok * p.attention.heads / t * 4.0  # flash keeps the fp32 log-sum-exp per row and head
    # what autoplan's runtime saves beyond the profile's counts: all of it kept without recompute, the attention
    # core's part dropped by selective recompute (the core is the checkpointed region), none under full
    mlp_x, core_x = runtime_saved_extra(p, ctx) if ctx.training.runtime_memory else (0.0, 0.0)
    act_none = base + scores + ac.saved + mlp_x + core_x
    act_sel = base + (scores if ctx.training.flash_attention and not math else 0.0) + ac.saved + mlp_x
    act_full = tok * p.act_input / seq_div * scale + ac.saved_full if p.kind == "block" else act_none
    if op_sac:
        act_sel = act_full + _op_sac_kept(p, ctx, scores)
    params = 0.0
    expert = 0.0
    for g in p.gemms:
        n = g.params / (ctx.ep if g.expert else 1)
        n = n if g.tp == "replicated" else n / t
        params += n
        if g.expert:
            expert += n
    params += p.params_replicated + p.params_sharded / t
    return LayerCost(
        fwd_s=fwd, bwd_s=bwd, recompute_selective_s=sel, recompute_full_s=full,
        comm_fwd_s=comm_f, comm_bwd_s=comm_b,
        act_none=act_none, act_selective=act_sel, act_full=act_full,
        params_local=params, expert_params_local=expert,
        model_flops=gemm_flops + attn_flops, recompute_flops_selective=rec_sel_flops,
        recompute_flops_full=gemm_flops + attn_flops - (parts[-1][1] if stops_early else 0.0),
        checkpoint_selective_s=ckpt_sel, checkpoint_full_s=ckpt_full,
        loss_transient=loss_transient(p, ctx), weight_copies=ac.weight_copies,
    )
