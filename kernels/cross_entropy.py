"""Chunked linear + cross-entropy over the vocabulary, so fp32 logits are never materialised in full.

The language-model head turns hidden states [N, h] into logits [N, V] and eager PyTorch then
upcasts them to fp32 and runs log_softmax/nll: with V = 128K and N = 8K tokens that is 2 GiB of
bf16 logits plus 4 GiB per fp32 copy, several alive at once in the backward. Here the tokens
are processed in chunks of C rows:

    logits_c = hidden_c @ weight.T                 (torch matmul, [C, V] in the input dtype)
    per row: max, sum(exp(x - max)), x[target]     (Triton, one read of logits_c, online logsumexp)
    loss_c = logsumexp - x[target]
    grad_c = (softmax - onehot(target)) * scale    (Triton, written in place over logits_c)
    grad_hidden_c = grad_c @ weight,  grad_weight += grad_c.T @ hidden_c   (torch matmuls)

so only one [C, V] buffer exists at a time. The gradients are computed during the forward and
scaled by the incoming gradient in the backward (the loss is a scalar for reduction 'mean' or
'sum'; 'none' is supported without gradients).

Vocab-parallel variant: each rank of the tensor-parallel group holds a vocabulary shard
weight[vocab_start : vocab_start + V_local]. The per-row max is all-reduced (MAX), then the
rescaled sum of exponentials and the target logit (found on exactly one rank) are all-reduced
(SUM) together: two small all-reduces of [C] per chunk, never the logits. The input gradient
is summed over the group at the end (`reduce_grad_input`), so the returned gradient equals the
non-parallel one; pass reduce_grad_input=False when the surrounding code already all-reduces it
(Megatron's copy_to_tensor_model_parallel_region before the LM head).
"""

from __future__ import annotations

import torch

from autoplan.kernels._checks import as_rows, check_same_device, check_tensor, check_triton_device
from autoplan.kernels._triton import cdiv, jit, next_power_of_2, num_warps_for, tl

OP = "cross_entropy"

# Vocabulary block per loop iteration: 4096 values = 8 warps x 16 values per thread (see
# num_warps_for). Tests lower it to exercise the online logsumexp across blocks.
_BLOCK_V = 4096
# Default chunk rows: at least 1024 so that grad_weight += grad_c.T @ hidden_c (which reads and
# writes all of grad_weight once per chunk) does ~C/2 flops per byte of grad_weight traffic
# (2*C flops per element, 4 bytes moved in bf16): C >= 1024 keeps it above an H100's
# ~330 flop/byte ridge (989 TFLOP/s bf16 / 3.0 TB/s); beyond that, chunks are sized so the
# logits chunk is no larger than the hidden states (C*V <= N*h), as in Liger-Kernel.
_MIN_CHUNK_ROWS = 1024
_REDUCTIONS = ("mean", "sum", "none")


# --------------------------------------------------------------------------- kernels


@jit
def _ce_stats_kernel(
    LOGITS, TARGET, ROW_MAX, ROW_SUMEXP, TARGET_LOGIT,
    stride_l, n_vocab, vocab_start,
    BLOCK_V: tl.constexpr,
):
    # One program per row: online max / sum(exp) over the row in BLOCK_V pieces (one read).
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, n_vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    local = tl.load(TARGET + row).to(tl.int64) - vocab_start
    in_shard = (local >= 0) & (local < n_vocab)
    target_logit = tl.load(base + local, mask=in_shard, other=0.0).to(tl.float32)
    tl.store(ROW_MAX + row, m)
    tl.store(ROW_SUMEXP + row, s)
    tl.store(TARGET_LOGIT + row, target_logit)


@jit
def _ce_grad_kernel(
    LOGITS, TARGET, LSE, SCALE,
    stride_l, n_vocab, vocab_start, ignore_index,
    BLOCK_V: tl.constexpr,
):
    # One program per row: overwrite the logits with (softmax - onehot) * scale (read + write).
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    target = tl.load(TARGET + row).to(tl.int64)
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE).to(tl.float32)
    scale = tl.where(target == ignore_index, 0.0, scale)
    local = target - vocab_start
    for start in range(0, n_vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_vocab
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(cols == local, p - 1.0, p)
        tl.store(base + cols, (p * scale).to(LOGITS.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers


def ce_row_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0):
    """Per row of logits [C, V]: (max, sum(exp(x - max)), logit of the target or 0 if not in this shard)."""
    check_triton_device(OP, logits)
    n_rows, n_vocab = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    row_max, row_sumexp, target_logit = (torch.empty(n_rows, **f32) for _ in range(3))
    block_v = min(_BLOCK_V, next_power_of_2(n_vocab))
    _ce_stats_kernel[(n_rows,)](
        logits, target, row_max, row_sumexp, target_logit,
        logits.stride(0), n_vocab, vocab_start,
        BLOCK_V=block_v, num_warps=num_warps_for(block_v),
    )
    return row_max, row_sumexp, target_logit


def ce_grad_inplace(logits, target, lse, scale, vocab_start: int = 0, ignore_index: int = -100):
    """Overwrite logits [C, V] with (softmax - onehot(target)) * scale; scale is a 1-element tensor."""
    check_triton_device(OP, logits)
    n_rows, n_vocab = logits.shape
    block_v = min(_BLOCK_V, next_power_of_2(n_vocab))
    _ce_grad_kernel[(n_rows,)](
        logits, target, lse, scale,
        logits.stride(0), n_vocab, vocab_start, ignore_index,
        BLOCK_V=block_v, num_warps=num_warps_for(block_v),
    )
    return logits


def _default_chunk(n_rows: int, hidden: int, vocab: int) -> int:
    return max(1, min(n_rows, max(_MIN_CHUNK_ROWS, cdiv(n_rows * hidden, vocab))))


def _check(hidden, weight, target, ignore_index, reduction, chunk_size):
    check_tensor(OP, "hidden", hidden)
    check_tensor(OP, "weight", weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{OP}: weight must be [vocab, hidden={hidden.shape[-1]}] (the LM head's nn.Linear.weight), "
            f"got {tuple(weight.shape)}."
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{OP}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype; cast one.")
    check_tensor(OP, "target", target, dtypes=(torch.int64, torch.int32), min_dim=0)
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{OP}: target must have the shape of hidden without its last dimension, "
            f"{tuple(hidden.shape[:-1])}, got {tuple(target.shape)}."
        )
    check_same_device(OP, hidden=hidden, weight=weight, target=target)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{OP}: reduction must be one of {_REDUCTIONS}, got {reduction!r}.")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{OP}: chunk_size must be a positive int or None (automatic), got {chunk_size!r}.")
    if not isinstance(ignore_index, int):
        raise TypeError(f"{OP}: ignore_index must be an int, got {type(ignore_index).__name__}.")


def _check_targets(target, ignore_index, vocab_total):
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_total))
    if bool(bad.any()):
        first = target[bad].flatten()[0].item()
        raise ValueError(
            f"{OP}: target ids must lie in [0, {vocab_total}) or equal ignore_index={ignore_index}; "
            f"found {first}. Check that the tokenizer's vocabulary matches the LM head."
        )


def linear_cross_entropy_forward(
    hidden, weight, target, ignore_index=-100, reduction="mean", chunk_size=None,
    group=None, vocab_start=None, reduce_grad_input=True, grad_hidden=True, grad_weight=True,
):
    """Compute the loss and (optionally) both gradients chunk by chunk. Returns (loss, dhidden, dweight).

    The gradients are those of the returned loss (already divided by the number of valid tokens for
    'mean'); dhidden/dweight are None when not requested.
    """
    _check(hidden, weight, target, ignore_index, reduction, chunk_size)
    check_triton_device(OP, hidden)
    if reduction == "none" and (grad_hidden or grad_weight):
        raise ValueError(
            f"{OP}: reduction='none' is supported for evaluation only (no gradients), because the "
            "gradients are computed in the forward; use 'mean' or 'sum' for training."
        )
    h2 = as_rows(OP, "hidden", hidden)
    tgt = target.reshape(-1)
    n_rows, n_hidden = h2.shape
    v_local = weight.shape[0]
    if group is not None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        vocab_start = rank * v_local if vocab_start is None else int(vocab_start)
        vocab_total = world * v_local
    else:
        vocab_start, vocab_total = 0, v_local
    if tgt.device.type != "meta":  # meta tensors (launch capture) have no values to check
        _check_targets(tgt, ignore_index, vocab_total)

    chunk = chunk_size or _default_chunk(n_rows, n_hidden, vocab_total)
    chunk = min(chunk, n_rows)
    device = hidden.device
    valid = tgt != ignore_index
    n_valid = valid.sum()
    scale = (1.0 / n_valid.to(torch.float32)).reshape(1) if reduction == "mean" else torch.ones(1, device=device)
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    d_hidden = torch.empty_like(h2) if grad_hidden else None
    d_weight = torch.zeros_like(weight) if grad_weight else None
    logits_buf = torch.empty((chunk, v_local), dtype=hidden.dtype, device=device)

    for r0 in range(0, n_rows, chunk):
        r1 = min(r0 + chunk, n_rows)
        h_c, t_c = h2[r0:r1], tgt[r0:r1]
        logits = logits_buf[: r1 - r0]
        torch.mm(h_c, weight.t(), out=logits)
        row_max, row_sumexp, target_logit = ce_row_stats(logits, t_c, vocab_start)
        if group is not None:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            both = torch.stack((row_sumexp * torch.exp(row_max - global_max), target_logit))
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
            row_max, (row_sumexp, target_logit) = global_max, both
        lse = row_max + torch.log(row_sumexp)
        row_loss[r0:r1] = torch.where(valid[r0:r1], lse - target_logit, 0.0)
        if grad_hidden or grad_weight:
            grad_logits = ce_grad_inplace(logits, t_c, lse, scale, vocab_start, ignore_index)
            if grad_hidden:
                torch.mm(grad_logits, weight, out=d_hidden[r0:r1])
            if grad_weight:
                d_weight.addmm_(grad_logits.t(), h_c)

    if grad_hidden and group is not None and reduce_grad_input:
        dist.all_reduce(d_hidden, op=dist.ReduceOp.SUM, group=group)
    if reduction == "none":
        loss = row_loss.view(target.shape)
    elif reduction == "sum":
        loss = row_loss.sum()
    else:
        loss = row_loss.sum() / n_valid
    return loss, (d_hidden.view(hidden.shape) if grad_hidden else None), d_weight


# --------------------------------------------------------------------------- autograd


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, reduction, chunk_size, group, vocab_start,
                reduce_grad_input):
        loss, d_hidden, d_weight = linear_cross_entropy_forward(
            hidden, weight, target, ignore_index, reduction, chunk_size, group, vocab_start,
            reduce_grad_input, grad_hidden=ctx.needs_input_grad[0], grad_weight=ctx.needs_input_grad[1],
        )
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError(f"{OP}: backward ran twice through the same loss; the gradients are "
                               "scaled in place, so recompute the loss instead of retain_graph=True.")
        ctx.used = True
        d_hidden, d_weight = ctx.saved_tensors
        # In place: a second copy of grad_weight ([V, h]) would double this op's peak memory.
        if d_hidden is not None:
            d_hidden.mul_(grad_loss.to(d_hidden.dtype))
        if d_weight is not None:
            d_weight.mul_(grad_loss.to(d_weight.dtype))
        return d_hidden, d_weight, None, None, None, None, None, None, None


def cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", chunk_size: int | None = None) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, target) computed in row chunks (Triton softmax part).

    hidden [..., h], weight [V, h] (the LM head), target [...] int. reduction 'mean' | 'sum' |
    'none' (no gradients with 'none'). chunk_size rows per chunk (None: automatic).
    """
    _check(hidden, weight, target, ignore_index, reduction, chunk_size)
    return LinearCrossEntropyFunction.apply(hidden, weight, target, ignore_index, reduction, chunk_size,
                                            None, None, True)


def vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group,
                                 ignore_index: int = -100, reduction: str = "mean", chunk_size: int | None = None,
                                 vocab_start: int | None = None, reduce_grad_input: bool = True) -> torch.Tensor:
    """Cross-entropy with the vocabulary sharded over `group` (a torch.distributed process group).

    weight is this rank's shard [V_local, h] holding ids [vocab_start, vocab_start + V_local)
    (default: rank * V_local, equal shards); hidden and target are the same on every rank.
    Every rank returns the full loss; see the module docstring for reduce_grad_input.
    """
    _check(hidden, weight, target, ignore_index, reduction, chunk_size)
    if group is None:
        raise ValueError(f"{OP}: vocab_parallel_cross_entropy needs a process group; use cross_entropy without one.")
    return LinearCrossEntropyFunction.apply(hidden, weight, target, ignore_index, reduction, chunk_size,
                                            group, vocab_start, reduce_grad_input)


# --------------------------------------------------------------------------- references


def cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                            ignore_index: int = -100, reduction: str = "mean", chunk_size: int | None = None):
    """Eager PyTorch: full logits, upcast to fp32, F.cross_entropy. chunk_size is accepted and ignored."""
    _check(hidden, weight, target, ignore_index, reduction, chunk_size)
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()
    loss = torch.nn.functional.cross_entropy(logits, target.reshape(-1), ignore_index=ignore_index,
                                             reduction=reduction)
    return loss.view(target.shape) if reduction == "none" else loss


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (SUM) forward, identity backward: every rank's copy of the result is the same
    value, and each rank back-propagates only its own shard's contribution."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce (SUM) backward: the input is replicated over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def vocab_parallel_cross_entropy_reference(hidden, weight, target, group, ignore_index: int = -100,
                                           reduction: str = "mean", chunk_size: int | None = None,
                                           vocab_start: int | None = None, reduce_grad_input: bool = True):
    """Plain-torch vocab-parallel cross-entropy (full local logits in fp32), same contract as the kernel."""
    import torch.distributed as dist

    _check(hidden, weight, target, ignore_index, reduction, chunk_size)
    v_local = weight.shape[0]
    vocab_start = dist.get_rank(group) * v_local if vocab_start is None else int(vocab_start)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if reduce_grad_input:
        h2 = _CopyToGroup.apply(h2, group)
    tgt = target.reshape(-1)
    logits = (h2 @ weight.t()).float()
    row_max = logits.detach().max(dim=-1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sumexp = _SumOverGroup.apply(torch.exp(logits - row_max[:, None]).sum(-1), group)
    local = tgt - vocab_start
    in_shard = (local >= 0) & (local < v_local)
    picked = logits.gather(1, local.clamp(0, v_local - 1)[:, None]).squeeze(1)
    target_logit = _SumOverGroup.apply(torch.where(in_shard, picked, 0.0), group)
    valid = tgt != ignore_index
    row_loss = torch.where(valid, torch.log(sumexp) + row_max - target_logit, 0.0)
    if reduction == "none":
        return row_loss.view(target.shape)
    if reduction == "sum":
        return row_loss.sum()
    return row_loss.sum() / valid.sum()

