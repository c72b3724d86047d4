"""Each parallelism applied by one function; `parallelize` composes them in one stated order.

`parallelize(spec, plan, dims)` builds this rank's stages by executing their generated programs
(codegen.emit.stage_source -- the same text `autoplan codegen` writes), which apply, per stage:

  1. pipeline cut      this pipeline rank's (virtual) stages, cut at the plan's layer boundaries by deleting the
                       other layers from a meta-device model (names keep their global keys), then materialised and
                       initialised by name (the same weights as a single-process model); split_stages does
                       the same for direct use
  2. fused kernels     kernels.modules substituted for norms/activations when plan.kernels == "fused"
                                                                                   [codegen.fuse.substitute_kernels]
  3. apply_tp          DTensor tensor parallelism (+ Megatron sequence parallelism, vocab-parallel embedding and LM
                       head for loss_parallel); the layout table is codegen.program.tp_layout
  4. apply_ep          expert parallelism: experts split over the ep group, tokens exchanged by all-to-all
  5. apply_cp          context parallelism: exact causal attention over the cp group (all-gather of K/V in
                       position order, load-balanced chunks r and 2cp-1-r, each against the keys up to its end,
                       positions offset for RoPE / learned positions)
  6. apply_recompute   selective (attention core) or full (whole blocks, `recompute_layers` of a stage)
  7. apply_mixed_precision   bf16 autocast around each stage's forward (fp32 master weights)
  8. apply_dp          torch's DDP (ZeRO-0; `replicate` under tp) or FSDP2 fully_shard (ZeRO-1/2/3) over dp x cp
then here
  9. apply_pipeline    torch.distributed.pipelining stages and the plan's schedule.

Why this order: kernels before TP so the parallel styles wrap the modules that will run; TP before DP because
FSDP2 shards the TP DTensors again (2-D); CP after TP because the attention core it replaces receives TP-local
heads; recompute before DP so FSDP's hooks wrap the checkpointed blocks; the pipeline last because it drives
the finished stage modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autoplan.plan import Plan, StagePlan
from autoplan.zoo.model import MoE, TransformerLM, run_experts

from .parallel_dims import ParallelDims

# Attention-core ops of the selective recompute region. On CPU, SDPA dispatches to the flash kernel named
# here (not the CUDA names), which is why a GPU-only op list would silently recompute nothing.
ATTENTION_CORE_OPS = (
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
)


@dataclass
class StageModule:
    """One (virtual) pipeline stage held by this rank."""

    plan: StagePlan
    module: TransformerLM
    # Human-readable record of what each technique did (codegen emits it).
    notes: dict[str, list[str]] = field(default_factory=dict)


# ------------------------------------------------------------------------------------- 1. stage split


def split_stages(spec, plan: Plan, pp_rank: int, *, seed: int, device: torch.device) -> list[StageModule]:
    """The stages of `plan` that pipeline rank `pp_rank` runs, as pruned copies of the full model."""
    from autoplan.models import build, init_weights
    from autoplan.models.source import runtime_source

    out = []
    for st in plan.stages:
        if st.pp_rank != pp_rank:
            continue
        model = build(runtime_source(plan), device="meta")
        keep = {str(i) for i in range(*st.layers)}
        for key in list(model.layers.keys()):
            if key not in keep:
                del model.layers[key]
        if not st.has_embedding:
            model.tok_embeddings = None
            model.pos_embeddings = None
        if not st.has_head:
            model.norm = None
            model.output = None
        model = model.to_empty(device=device)
        if model.spec.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
            model.output.weight = model.tok_embeddings.weight
        init_weights(model, seed)
        out.append(StageModule(st, model, {"stage": [f"layers {st.layers[0]}..{st.layers[1] - 1}"]}))
    return out


# --------------------------------------------------------------------------------------------- 2. TP


class PositionsSequenceParallel:
    """Learned position embedding under sequence parallelism: weight replicated over tp, each rank looks up the
    positions of its own sequence shard; the weight gradient is a partial sum, reduced like a norm's."""

    @staticmethod
    def apply(module: nn.Embedding, mesh) -> None:
        def partition(_name, mod, mesh_):
            for n, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh_, [Replicate()])))

        def input_fn(_mod, inputs, mesh_):
            (pos,) = inputs  # (s,) positions of this cp rank's tokens, identical on every tp rank
            return DTensor.from_local(pos, mesh_, [Replicate()], run_check=False).redistribute(mesh_, [Shard(0)])

        def output_fn(_mod, out, _mesh):
            return out.to_local()  # (s/tp, h)

        distribute_module(module, mesh, partition, input_fn, output_fn)


def apply_tp(model: TransformerLM, tp_mesh, *, sp: bool, stage: StagePlan | None = None) -> list[str]:
    """Megatron-style TP with DTensor: column-parallel wq/wk/wv/w1/w3 (heads and KV heads split), row-parallel
    wo/w2; vocab-parallel embedding (rows) and LM head (columns, logits stay sharded over the vocabulary for
    `loss_parallel`). With sp the residual stream between blocks is sharded over the sequence (Shard(1)) and
    norms run as SequenceParallel; the all-reduces become all-gather + reduce-scatter. MoE layers keep their
    experts replicated over tp (no expert TP): their input is gathered to the full sequence.

    The layout comes from codegen.program.tp_layout, the same table the emitted stage source is printed from.
    """
    from autoplan.codegen.program import tp_layout

    if stage is None:
        keys = [int(k) for k in model.layers]
        stage = StagePlan(index=0, pp_rank=0, layers=(min(keys), max(keys) + 1) if keys else (0, 0),
                          has_embedding=model.tok_embeddings is not None, has_head=model.output is not None,
                          recompute="none", recompute_layers=0, forward_s=0, backward_s=0)
    notes = []
    from autoplan.models import LayoutSpec

    spec = LayoutSpec(model.arch) if hasattr(model, "arch") else model.spec  # HF families: the real module tree
    for group, styles in tp_layout(spec, stage, sp).items():
        target = model if not group else model.get_submodule(group)
        plain = {k: _make_style(v.code()) for k, v in styles.items() if v.name != "PositionsSequenceParallel"}
        parallelize_module(target, tp_mesh, plain)
        if len(plain) != len(styles):
            PositionsSequenceParallel.apply(model.pos_embeddings, tp_mesh)
        notes += [f"{group + '.' if group else ''}{k}: {v.code()}" for k, v in styles.items()]
    if model.spec.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight  # both Shard(0) over the vocabulary: still one tensor
    return notes


_STYLES = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
           "SequenceParallel": SequenceParallel, "PrepareModuleInput": PrepareModuleInput,
           "PrepareModuleInputOutput": PrepareModuleInputOutput, "PrepareModuleOutput": PrepareModuleOutput,
           "Shard": Shard, "Replicate": Replicate}


def _make_style(code: str):
    """Instantiate a style from its rendered code (generated by codegen.program, never user input)."""
    return eval(code, {"__builtins__": {}}, dict(_STYLES))  # noqa: S307


# --------------------------------------------------------------------------------------------- 3. EP


class _AllToAllSingle(torch.autograd.Function):
    """Autograd-aware uneven all-to-all (rows of a 2-D tensor); the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _ep_dispatch(moe: MoE, group, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Send each routed token copy to the rank that holds its expert, run the local experts, send results back.

    routed (T*k, h) grouped by expert; counts (E,). Two autograd-aware all-to-alls (the backward is the
    reverse exchange); the split sizes are exchanged first with a plain all-to-all of the counts.
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    n_local = moe.num_experts // ep
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts.contiguous(), group=group)  # [src j, my expert e] = counts_j[e]
    send_splits = counts.view(ep, n_local).sum(1).tolist()
    matrix = recv_counts.view(ep, n_local).tolist()  # tokens from source j for my local expert e
    recv_splits = [sum(row) for row in matrix]
    received = _AllToAllSingle.apply(routed, recv_splits, send_splits, group)
    # received is ordered (source, expert); the experts want (expert, source)
    starts, off = [], 0
    for row in matrix:
        starts.append([])
        for n in row:
            starts[-1].append(off)
            off += n
    perm = [i for e in range(n_local) for j in range(ep) for i in range(starts[j][e], starts[j][e] + matrix[j][e])]
    perm_t = torch.tensor(perm, dtype=torch.long, device=routed.device)
    grouped = received.index_select(0, perm_t)
    per_expert = [sum(matrix[j][e] for j in range(ep)) for e in range(n_local)]
    out = run_experts(moe.experts, grouped, per_expert, first_expert=rank * n_local)
    # (source, expert) order again, by the inverse permutation: index_select's backward keeps only the index
    # (index_copy would save `out`, one more routed-token-wide tensor per layer and micro-batch)
    back = out.index_select(0, perm_t.argsort())
    return _AllToAllSingle.apply(back, send_splits, recv_splits, group)


def apply_ep(model: TransformerLM, ep_mesh) -> list[str]:
    """Keep experts [r*E/ep, (r+1)*E/ep) on ep rank r (global keys kept) and route tokens by all-to-all."""
    group, ep, rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
    notes = []
    for key, block in model.layers.items():
        moe = block.mlp
        if not isinstance(moe, MoE):
            continue
        n_local = moe.num_experts // ep
        keep = {str(e) for e in range(rank * n_local, (rank + 1) * n_local)}
        for e in list(moe.experts.keys()):
            if e not in keep:
                del moe.experts[e]
        moe.dispatch = functools.partial(_ep_dispatch, moe, group)
        moe.ep_group = group
        notes.append(f"layers.{key}.mlp: experts {sorted(keep, key=int)} of {moe.num_experts}, all-to-all over ep={ep}")
    return notes


def is_expert_param(name: str) -> bool:
    return ".experts." in name


# --------------------------------------------------------------------------------------------- 4. CP


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions held by cp rank `rank`: chunks r and 2cp-1-r of 2cp equal chunks (equal causal work)."""
    c = seq_len // (2 * cp)
    a, b = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns on every call); a user's older
# CUDA build has only the old one. Resolved once: the CP gather calls it in every attention layer.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None):
    """Gather `inp` from every rank of `group` into `out` (concatenated on dim 0); calibrate_bench times the same
    call."""
    return _ALL_GATHER_SINGLE(out, inp, group=group)


class _AllGatherSequence(torch.autograd.Function):
    """Gather a (b, s_local, ...) tensor from every cp rank along dim 1 into position order: rank j holds chunks j
    and 2cp-1-j of the 2cp chunks (`load_balanced_positions`), so the whole sequence is every rank's first chunk
    in rank order, then every rank's second chunk in reverse rank order. The backward sends each rank the
    gradient of its own two chunks and sums what comes back (an all-to-all: gloo has no reduce-scatter).
    Written here rather than torch.distributed.nn's all_gather because the latter passes non-contiguous
    gradient views to gloo's all-to-all, which gave wrong K/V gradients with GQA. The gather lands in one
    (cp, ...) tensor (all_gather_single; the list form copies every part out of its own flat buffer once
    more: 3.8 against 2.2 ms for 4 MB over 2 gloo ranks here), and one concatenation puts it in position order
    (what cost_models.compute._cp_comm prices)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        parts = x.new_empty((n * x.shape[0], *x.shape[1:]))  # the concatenated form (gloo takes no other)
        all_gather_single(parts, x.contiguous(), group=group)
        parts = parts.view(n, *x.shape)
        c = x.shape[1] // 2
        return torch.cat([parts[j, :, :c] for j in range(n)] + [parts[j, :, c:] for j in reversed(range(n))], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = dist.get_world_size(ctx.group)
        c = grad.shape[1] // (2 * n)
        chunks = [torch.cat([grad.narrow(1, j * c, c), grad.narrow(1, (2 * n - 1 - j) * c, c)], dim=1)
                  for j in range(n)]
        recv = [torch.empty_like(chunks[0]) for _ in range(n)]
        dist.all_to_all(recv, chunks, group=ctx.group)
        return torch.stack(recv).sum(0), None


class ContextParallelAttentionCore(nn.Module):
    """Exact causal attention over a sequence split across the cp group: gather every rank's K/V in position
    order (autograd-aware all-gather; its backward sums the K/V gradients back to their owners), then one SDPA
    per query chunk over the keys up to the chunk's end, masked causally inside the last of them. Each chunk
    skips the keys after it, so a rank computes (2cp+1)/(4cp) of the scores of its queries against the whole
    sequence (the diagonal blocks in full): before session 24 one masked SDPA over the whole gathered sequence
    computed all of them (twice the causal work), a cost the step-time model now prices as run
    (cost_models.compute.cp_score_fraction). On a GPU the mask is torch's lower-right causal bias instead of a
    tensor: flash (or memory-efficient) attention applies it inside the kernel and skips the masked blocks, the
    causal half of the scores (compute.cp_mask_tensors)."""

    def __init__(self, group, q_pos: torch.Tensor, dropout: float = 0.0) -> None:
        super().__init__()
        self.group = group
        self.dropout = dropout
        masks, self.ends = cp_chunk_masks(q_pos)
        self.bias = q_pos.device.type != "cpu"  # torch's CPU kernels have no lower-right causal: it materialises it
        for i, mask in enumerate(masks):
            self.register_buffer(f"mask{i}", None if self.bias else mask, persistent=False)  # (c, end)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = _AllGatherSequence.apply(k, self.group)  # (b, s, nkv, dh), position order
        v = _AllGatherSequence.apply(v, self.group)
        rep = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, n, s, dh)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        p = self.dropout if self.training else 0.0
        out = prefix_attention(q, k, v, None if self.bias else (self.mask0, self.mask1), self.ends, p)
        return out.transpose(1, 2).flatten(2)


def cp_chunk_masks(q_pos: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
    """The two causal masks (bool, chunk x key prefix) and key-prefix lengths of a cp rank's query positions."""
    c = len(q_pos) // 2
    ends = (int(q_pos[c - 1]) + 1, int(q_pos[-1]) + 1)
    masks = tuple(chunk[:, None] >= torch.arange(end, device=q_pos.device)[None, :]
                  for chunk, end in ((q_pos[:c], ends[0]), (q_pos[c:], ends[1])))
    return masks, ends


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks, ends, dropout: float = 0.0):
    """(b, n, 2c, d) queries of two chunks against (b, n, s, d) keys and values in position order: each chunk
    against the keys up to its end, masked causally (one SDPA per chunk). A chunk's queries are the last c
    positions of its key prefix, so its mask is causal aligned to the lower right: with `masks` None it is passed
    as torch's `causal_lower_right` bias (no tensor; flash applies it in the kernel on a GPU), else as the given
    boolean masks (`cp_chunk_masks`: the same mask, kept as buffers on a CPU). benchmarks/gpu/cp_core.py times
    both on a GPU."""
    from torch.nn.attention.bias import causal_lower_right

    c = q.shape[2] // 2
    qs = q.split(c, dim=2)  # split's backward concatenates the chunks' gradients (a slice's zero-fills q)
    outs = [F.scaled_dot_product_attention(qs[i], k[:, :, :end], v[:, :, :end],
                                           attn_mask=causal_lower_right(c, end) if masks is None else masks[i],
                                           dropout_p=dropout)
            for i, end in enumerate(ends)]  # (b, n, c, d) each
    return torch.cat(outs, dim=2)


def apply_cp(model: TransformerLM, cp_mesh, seq_len: int, device: torch.device) -> list[str]:
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    q_pos = load_balanced_positions(seq_len, cp, rank).to(device)
    model.positions = q_pos
    for block in model.layers.values():
        block.attention.core = ContextParallelAttentionCore(cp_mesh.get_group(), q_pos, block.attention.core.dropout)
    c = seq_len // (2 * cp)
    first, second = cp_chunk_masks(q_pos)[1]
    return [f"cp rank {rank}/{cp}: positions [{rank * c}, {(rank + 1) * c}) + "
            f"[{(2 * cp - 1 - rank) * c}, {(2 * cp - rank) * c}); attention core: all-gather K/V, each query chunk "
            f"against the keys up to its end ({first} and {second} of {seq_len}), causal mask"]


# -------------------------------------------------------------------------------------- 5. recompute


def apply_recompute(model: TransformerLM, stage: StagePlan, rest: str | None = "selective") -> list[str]:
    """full: the first `stage.recompute_layers` blocks of the stage are checkpointed whole, and the stage's other
    blocks recompute selectively, or (`rest` 'none': TrainingSpec.partial_recompute=rest-none, Megatron's block
    method) run plainly, as the stage ILP and the estimate price a partly full stage (autoplan.search.ilp,
    cost_models.estimate.stage_cost); selective: the attention core (GQA + SDPA, i.e. ATTENTION_CORE_OPS; with CP
    also the K/V gather) of every block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    notes = []
    keys = list(model.layers.keys())
    n_full, n_sel = stage.recompute_split(rest)
    if n_full:
        for k in keys[:n_full]:
            model.layers[k] = checkpoint_wrapper(model.layers[k], preserve_rng_state=True)
        notes.append(f"full: layers {keys[:n_full]}")
    for k in keys[n_full:n_full + n_sel]:
        block = model.layers[k]
        block.attention.core = checkpoint_wrapper(block.attention.core, preserve_rng_state=True)
        notes.append(f"selective: layers.{k}.attention.core")
    return notes


def canonical_name(name: str) -> str:
    """Parameter name without wrapper prefixes (checkpoint, compile): the single-process model's name."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


# ----------------------------------------------------------------------------------- 6. mixed precision


def autocast_dtype(dtype: str) -> torch.dtype | None:
    """The 16-bit type a plan's forward computes in under autocast (bf16, fp16); None: fp32, no autocast.
    fp8 is refused (launch.check_dtype refuses such plans first): autocast has no fp8, and running the plan in
    fp32 would be another program than the one priced."""
    if dtype == "fp8":
        raise ValueError("autoplan's runtime does not train in fp8 (launch.check_dtype refuses such plans)")
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)


def apply_mixed_precision(model: nn.Module, dtype: str, device_type: str) -> list[str]:
    """bf16/fp16: autocast around the forward; parameters (the master weights) and optimizer state stay fp32."""
    amp = autocast_dtype(dtype)
    if amp is None:
        return ["fp32 (no autocast)"]
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=amp):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    return [f"autocast {dtype}, fp32 master weights"]


# --------------------------------------------------------------------------------------------- 7. DP


def apply_dp(model: TransformerLM, dp_mesh, zero: int, *, pipelined: bool = False) -> list[str]:
    """Data parallelism over the dp x cp ranks, one unit per block plus the root (embedding, norm, head).

    zero=0: DistributedDataParallel when no parameter is a DTensor (apply_ddp: one bucketed all-reduce overlapped
            with backward, as a plain DDP script), pipelined stages included: torch.distributed.pipelining drives a
            DDP stage module itself (forwards and all but the last backward under no_sync, then
            reducer.prepare_for_backward before the last backward, whose buckets are all-reduced as it runs).
            With DTensor parameters (tp > 1) `replicate` per block and at the root instead (FSDP2-based DDP: works
            with DTensor TP, classic DDP does not -- its reducer takes plain tensors; one all-reduce per block).
            The cost model prices the same choice (cost_models.estimate.uses_replicate).
    zero=1: fully_shard(reshard_after_forward=False) and the runtime skips gradient sync and resharding until the
            last micro-batch: full parameters and gradients during accumulation, sharded optimizer states and
            master weights -- ZeRO-1 within a step (between steps parameters are sharded, a bit less memory).
    zero=2: fully_shard(reshard_after_forward=False), reduce-scatter after every micro-batch: sharded gradients.
    zero=3: fully_shard(reshard_after_forward=True): parameters gathered per unit for forward and backward.
    Exact in all cases (same sums, different order). Expert parameters are ignored here: engine.Trainer.
    _finalize_grads reduces them (over the ranks holding the same experts; every dp x cp rank without ep).
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    ignored = {p for n, p in model.named_parameters() if is_expert_param(n)} or None
    if zero == 0 and not any(isinstance(p, DTensor) for p in model.parameters()):
        return apply_ddp(model, dp_mesh, ignored, pipelined=pipelined)
    if zero == 0:
        for block in model.layers.values():
            replicate(block, mesh=dp_mesh, ignored_params=ignored)
        replicate(model, mesh=dp_mesh, ignored_params=ignored)
        return [f"replicate over dp_cp={dp_mesh.size()} (ZeRO-0)"]
    reshard = zero == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored)
    return [f"fully_shard over dp_cp={dp_mesh.size()}, ZeRO-{zero}, reshard_after_forward={reshard}"]


class _DDPSync:
    """Gradient-sync switch of a model made data parallel in place by apply_ddp (the method FSDP2 modules have,
    so the engine's accumulation logic treats both alike)."""

    def __init__(self, ddp) -> None:
        self.ddp = ddp

    def __call__(self, requires_gradient_sync: bool) -> None:
        self.ddp.require_backward_grad_sync = requires_gradient_sync


class _Forward(nn.Module):
    """What DDP wraps: calls the model's forward as it was (autocast included), sharing its parameters."""

    def __init__(self, model: nn.Module, forward: Callable) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "_forward", forward)

    def forward(self, *args, **kwargs):
        return self._forward(*args, **kwargs)


def apply_ddp(model: TransformerLM, dp_mesh, ignored: set | None = None, *, pipelined: bool = False) -> list[str]:
    """ZeRO-0 without DTensors: torch's DistributedDataParallel, applied in place so that names, state dicts
    and the emitted program keep the model itself: `model(x)` runs through DDP (its reducer buckets the
    gradients, 25 MiB buckets all-reduced as backward produces them), `model.set_requires_gradient_sync(flag)`
    is DDP's no_sync switch. Buffers are not broadcast (context parallelism keeps a per-rank causal mask; the
    weights are already identical on every rank because init is by name, hence init_sync=False too). Gradients
    are views of the buckets (gradient_as_bucket_view): one copy of the gradients, not two, as the cost model
    prices it (cost_models.counts).

    `pipelined`: the pipeline stage is the DDP itself (`stage_submodule`), which torch.distributed.pipelining
    drives: no_sync around every forward and every backward but the last, reducer.prepare_for_backward before
    the last. Gradient sync starts off here, so that the forwards the stage runs outside the schedule's no_sync
    (PipelineStage's shape inference, whose backward computes input gradients only) leave no reduction pending
    in the reducer: DDP would then refuse the last backward's prepare_for_backward ("Expected to have finished
    reduction in the prior iteration")."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner = _Forward(model, model.forward)
    if ignored:
        names = [f"model.{n}" for n, p in model.named_parameters() if p in ignored]
        DDP._set_params_and_buffers_to_ignore_for_model(inner, names)
    ddp = DDP(inner, process_group=dp_mesh.get_group(), forward_sync_buffers=False, init_sync=False,
              gradient_as_bucket_view=True)
    if pipelined:
        ddp.require_backward_grad_sync = False  # what no_sync() sets; the schedule's last backward syncs
    object.__setattr__(model, "forward", ddp.__call__)  # not a submodule: no cycle, no new names
    object.__setattr__(model, "set_requires_gradient_sync", _DDPSync(ddp))
    object.__setattr__(model, "_autoplan_ddp", ddp)
    where = ", synced in the pipeline's last backward" if pipelined else ""
    return [f"DistributedDataParallel over dp_cp={dp_mesh.size()} (ZeRO-0, bucketed all-reduce{where})"]


def stage_submodule(model: nn.Module) -> nn.Module:
    """The module a PipelineStage must drive: the DDP that apply_ddp put around `model`, if any (pipelining
    recognises DDP by `isinstance(submod, DistributedDataParallel)` and then syncs gradients once per step, in
    the last micro-batch's backward), else the model (FSDP2 modules are recognised by their own class)."""
    return getattr(model, "_autoplan_ddp", model)


# --------------------------------------------------------------------------------------- 8. pipeline


def apply_pipeline(stages: list[StageModule], plan: Plan, dims: ParallelDims, n_microbatches: int,
                   loss_fn: Callable, device: torch.device):
    """PipelineStage per local stage (shapes inferred from the first micro-batch) and the plan's schedule.
    Gradients are scaled by 1/n_microbatches by the schedule (loss_fn returns the micro-batch mean)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    group = dims["pp"].get_group()
    n = len(plan.stages)
    pstages = [PipelineStage(stage_submodule(s.module), s.plan.index, n, device, group=group) for s in stages]
    kind = plan.parallel.schedule
    if kind == "interleaved":
        return ScheduleInterleaved1F1B(pstages, n_microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return cls(pstages[0], n_microbatches, loss_fn=loss_fn)


# ------------------------------------------------------------------------------------------ compose


@dataclass
class ParallelModel:
    plan: Plan
    dims: ParallelDims
    stages: list[StageModule]
    schedule: object | None
    device: torch.device

    @property
    def modules(self) -> list[TransformerLM]:
        return [s.module for s in self.stages]

    @property
    def has_first(self) -> bool:
        return any(s.plan.has_embedding for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.plan.has_head for s in self.stages)

    def named_parameters(self):
        """(canonical name, parameter) of every local stage; a tied LM head counts once (on its first stage)."""
        seen = set()
        for s in self.stages:
            for n, p in s.module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                yield canonical_name(n), p


def load_stage_program(program) -> Callable:
    """Compile the emitted source of one stage (codegen.emit.stage_source) and return its `build` function.
    The source is registered with linecache so tracebacks show the generated lines."""
    import linecache

    from autoplan.codegen.emit import stage_source

    src = stage_source(program)
    filename = f"<autoplan {program.plan.short_hash} stage_{program.stage.index}.py>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace: dict = {"__name__": f"autoplan_stage_{program.stage.index}"}
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102
    return namespace["build"]


def parallelize(spec, plan: Plan, dims: ParallelDims, *, seed: int, device: torch.device,
                n_microbatches: int, loss_fn: Callable) -> ParallelModel:
    """Build this rank's stages by running their generated programs, then the pipeline schedule.

    Each program (codegen.emit) applies, in this order: 1 pipeline cut, 2 fused kernels, 3 apply_tp-equivalent
    parallelize_module calls, 4 apply_ep, 5 apply_cp, 6 apply_recompute, 7 apply_mixed_precision, 8 apply_dp;
    then 9 apply_pipeline here. `spec` must be the plan's model (checked at start-up by the runtime).
    """
    from autoplan.codegen.program import stage_programs

    pp_rank = dims.rank("pp") if dims.pp_enabled else 0
    stages = []
    for program in stage_programs(plan):
        if program.stage.pp_rank != pp_rank:
            continue
        module = load_stage_program(program)(dims, seed=seed, device=device)
        module.train()
        notes = {
            "tp": [f"{g + '.' if g else ''}{k}: {v.code()}" for g, st in program.tp.items() for k, v in st.items()],
            "recompute": program.recompute,
            "kernels": [f"{k} -> {v}" for k, v in program.kernels.items()],
        }
        stages.append(StageModule(program.stage, module, notes))
    schedule = None
    if dims.pp_enabled:
        schedule = apply_pipeline(stages, plan, dims, n_microbatches, loss_fn, device)
    return ParallelModel(plan, dims, stages, schedule, device)
