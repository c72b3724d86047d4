"""The training step for any layout: micro-batches (or the pipeline schedule), gradient synchronisation,
global gradient-norm clipping, AdamW. Shared by `autoplan.runtime.train` and the parity tests.

Loss convention: the loss of a micro-batch is the mean over its tokens; a step's gradient is the mean over
micro-batches (1/n scaling) and over data- and context-parallel ranks (DDP/FSDP/replicate average over dp x cp),
which equals the gradient of the mean loss over the global batch because every micro-batch has the same
number of tokens.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from autoplan.plan import Plan
from autoplan.zoo.model import cross_entropy_loss

from .data import local_batch
from .faults import StopFlag
from .parallel_dims import ParallelDims
from .parallelize import ParallelModel, autocast_dtype, is_expert_param, load_balanced_positions, parallelize
from .timing import STEP_TAIL


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    step_time_s: float
    skipped: bool = False  # the gradient norm was not finite: the update was not applied (runtime.faults)
    stop_signal: int | None = None  # a stop signal (SIGTERM/SIGINT) that any rank had received, agreed by all


def loss_fn(logits, labels):
    return cross_entropy_loss(logits, labels)


def optimizer_groups(params) -> list[dict]:
    """AdamW parameter groups that the multi-tensor (foreach) path can take: one per DTensor (mesh, placements)
    and one for plain tensors, since a foreach call cannot mix them. The loop over parameters (foreach=False) costs
    one dispatch per op per parameter: 60 tp-sharded 64x64 DTensors take 21 ms a step with the loop and 3.5 ms with
    foreach on this CPU (2 gloo ranks); on a GPU the loop is thousands of kernel launches."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list] = {}
    for p in params:
        key = (id(p.device_mesh), p.placements) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    return [{"params": ps} for ps in groups.values()]


# Devices with torch's fused AdamW kernel (torch.optim.adamw: _get_fused_kernels_supported_devices)
_FUSED_ADAMW_DEVICES = ("cpu", "cuda", "xpu", "mps")


def make_adamw(groups: list[dict], device: torch.device, **kwargs) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel (one kernel per group, no temporaries: the foreach path allocates
    a parameter-sized sqrt(v) of every group during the step, which the cost model's optimizer memory, like
    Megatron's fused Adam, does not hold), else foreach. DTensor parameters take the fused op too
    (torch.distributed.tensor shards `_fused_adamw_` like a pointwise op)."""
    if device.type in _FUSED_ADAMW_DEVICES:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


class Trainer:
    def __init__(self, plan: Plan, dims: ParallelDims, *, device: torch.device, seed: int = 0, lr: float = 3e-4,
                 weight_decay: float = 0.1, betas=(0.9, 0.95), max_grad_norm: float = 1.0,
                 init_from: str | None = None, stop_flag: StopFlag | None = None) -> None:
        self.plan, self.dims, self.device = plan, dims, device
        cfg = plan.parallel
        self.gbs = plan.training.global_batch_size
        self.mbs = cfg.mbs
        self.n_micro = self.gbs // (dims.dp * cfg.mbs)
        self.max_grad_norm = max_grad_norm
        if dims.pp_enabled and cfg.schedule == "1f1b" and self.n_micro < cfg.pp:
            from autoplan.cost_models.errors import PlanError

            raise PlanError("the 1F1B schedule needs at least pp micro-batches per step",
                            f"global batch {self.gbs} / (dp {dims.dp} x mbs {cfg.mbs}) = {self.n_micro} < pp={cfg.pp}",
                            "raise the global batch, lower mbs, or use schedule=gpipe")
        self.pm: ParallelModel = parallelize(plan.model, plan, dims, seed=seed, device=device,
                                             n_microbatches=self.n_micro, loss_fn=loss_fn)
        if init_from is not None:  # Hugging Face weights, each rank reading only its slices
            from .hf_init import load_hf_checkpoint

            load_hf_checkpoint(self.pm, init_from, plan)
        self.optimizer = make_adamw(optimizer_groups(p for _, p in self.pm.named_parameters()), device, lr=lr,
                                    betas=betas, weight_decay=weight_decay)
        self.cp_positions = (load_balanced_positions(plan.training.seq_length, dims.cp, dims.rank("cp"))
                             if dims.cp_enabled else None)
        self.tied_group = _tied_group(plan, dims)
        self._params = list(self.pm.named_parameters())  # fixed after parallelize: walked once, not every step
        self._expert_params = [p for n, p in self._params if is_expert_param(n)]  # left out of DDP/FSDP
        self._synced: bool | None = None  # the gradient-sync flag last set on the (unpipelined) model
        # DDP's gradients are views of its buckets; zeroing them in place keeps them so (set to None, the next
        # step's first micro-batches would accumulate into new tensors beside the buckets: two copies at the peak)
        self._grads_to_none = not any(hasattr(m, "_autoplan_ddp") for m in self.pm.modules)
        # what the gradient norm sums: (parameter, is an expert's); a tied head on a later stage is not counted
        # twice (its gradient equals the embedding's after _finalize_grads)
        tied_later = plan.model.tie_embeddings and not self.pm.has_first
        self._reduce_group_cache: dict[tuple, tuple[tuple, tuple]] = {}  # `_reduce_groups`
        self._norm_params = [(p, is_expert_param(n)) for n, p in self._params
                             if not (tied_later and n == "output.weight")]
        # no DTensor parameter (DDP, pipelining without TP/FSDP, one process): the gradients are plain tensors, so
        # the per-step walk that sorts them by mesh and placement (and the partial-sum check) has nothing to do
        self._plain = not any(isinstance(p, DTensor) for _, p in self._params)
        self._plain_dense = [p for p, expert in self._norm_params if not expert]
        self._plain_expert = [p for p, expert in self._norm_params if expert]
        self.last_grads_hook = None  # tests: called with the ParallelModel after clipping, before the update
        # the run's stop flag: its signal travels in the loss's all-reduce, so every rank learns of a stop request
        # without a collective of its own each step
        self.stop_flag = stop_flag
        # One autocast weight cache for the step (_context), except where FSDP2 (fully_shard, or replicate)
        # manages the parameters of an unpipelined model: there a cast cached in one micro-batch's forward was
        # reused by the next one's, and part of the gradients never reached FSDP2's reduction (session 13: bf16
        # ZeRO-1/2/3 and replicate trained apart from DDP from the second step on; tests/dist/
        # test_autocast_parity.py). Pipelined stages, which torch.distributed.pipelining keeps unsharded over
        # the schedule, measured equal to DDP with it. The cost model spells the same rule:
        # cost_models.estimate.casts_once_per_step.
        fsdp = any(isinstance(m, FSDPModule) for part in self.pm.modules for m in part.modules())
        self.step_cast_cache = dims.pp_enabled or not fsdp

    # ------------------------------------------------------------------ one step

    def _context(self):
        stack = contextlib.ExitStack()
        if self.dims.tp_enabled:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        if autocast_dtype(self.plan.training.dtype) is not None and self.step_cast_cache:
            # One autocast weight cache for the whole step. Each forward runs under its own autocast region
            # (parallelize.apply_mixed_precision), and autocast drops its cache of 16-bit weight copies when the
            # outermost region exits: alone, every micro-batch cast every weight again and kept its own copy for
            # its backward (one per in-flight micro-batch under a pipeline schedule; measured on an H200, session
            # 12). Inside this disabled outer region the forwards share one copy per weight, cast once per step;
            # backward runs with autocast off as before, and the copies go when the region closes, before the
            # optimizer changes the weights. (Not under unpipelined FSDP2: see __init__.)
            stack.enter_context(torch.autocast(device_type=self.device.type, enabled=False))
        return stack

    def step(self, global_batch: torch.Tensor) -> StepResult:
        t0 = time.perf_counter()
        dims, pm = self.dims, self.pm
        dp_rank = dims.rank("dp") if dims.dp > 1 else 0
        inputs, labels = local_batch(global_batch, dp=dims.dp, dp_rank=dp_rank, cp_positions=self.cp_positions)
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        if self._grads_to_none:
            self.optimizer.zero_grad(set_to_none=True)
        else:  # DDP's bucket views (plain tensors, no graph): one foreach zero, not zero_grad's per-parameter walk
            grads = [p.grad for _, p in self._params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)
        local_loss = torch.zeros((), device=self.device)
        with self._context():
            if pm.schedule is not None:
                losses: list = []
                kwargs = {}
                if pm.has_last:
                    kwargs = {"target": labels, "losses": losses}
                args = (inputs,) if pm.has_first else ()
                pm.schedule.step(*args, **kwargs)
                if pm.has_last:
                    local_loss = torch.stack([_local(x).detach() for x in losses]).mean()
            else:
                model = pm.modules[0]
                mb = self.mbs
                for i in range(self.n_micro):
                    last = i == self.n_micro - 1
                    if last is not self._synced:  # the setters walk every FSDP module: only on a change
                        _set_sync(model, self.plan.parallel.zero, last)
                        self._synced = last
                    # the logits are not bound to a name: a reference here would keep this micro-batch's
                    # logits through its backward and the next micro-batch's forward (the loss's graph saves
                    # only what cross-entropy needs)
                    loss = loss_fn(model(inputs[i * mb : (i + 1) * mb]), labels[i * mb : (i + 1) * mb])
                    (loss / self.n_micro).backward()
                    local_loss += _local(loss).detach() / self.n_micro
        # the step's tail, marked for profilers and autoplan.runtime.timing (a no-op op when nobody listens)
        with record_function(STEP_TAIL):
            self._finalize_grads()
            norm = self._clip_grads()
            if self.last_grads_hook is not None:
                self.last_grads_hook(pm)
            skipped = not math.isfinite(norm)  # every rank sees the same global norm: never apply a NaN update
            if not skipped:
                self.optimizer.step()
            loss, stop = self._reduce_loss(local_loss)
        return StepResult(loss=loss, grad_norm=norm, step_time_s=time.perf_counter() - t0, skipped=skipped,
                          stop_signal=stop)

    # ------------------------------------------------------------------ gradient plumbing

    def _finalize_grads(self) -> None:
        """Make every gradient the full-batch mean gradient in its parameter's own layout."""
        dims, pm = self.dims, self.pm
        # (a) DTensor grads left as partial sums (e.g. replicated weights fed sequence-sharded inputs) -> reduce
        for _, p in () if self._plain else self._params:
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)
        # (b) experts, which DDP and FSDP leave out (parallelize.apply_dp): each ep rank's experts got the gradient
        #     of every ep rank's local mean loss (all-to-all backward); sum over the ranks holding the same
        #     experts, divide by all dp x cp ranks. Without ep every dp x cp rank holds every expert and got its
        #     own local mean loss's gradient: the same sum, over all of them.
        grads = [p.grad for p in self._expert_params if p.grad is not None]
        if grads and dims.dp_cp > 1:
            holders = dims.dp_cp // dims.ep if dims.ep_enabled else dims.dp_cp  # ranks holding the same experts
            if holders > 1:
                _all_reduce_bucketed(grads, dims["edp_cp" if dims.ep_enabled else "dp_cp"].get_group())
            torch._foreach_div_(grads, float(dims.dp_cp))
        # (c) tied embedding / LM head on the first and last pipeline stages: sum the two contributions
        if self.tied_group is not None:
            for s in pm.stages:
                m = s.module
                for mod in (m.tok_embeddings, m.output):
                    if mod is not None and mod.weight.grad is not None:
                        g = mod.weight.grad
                        dist.all_reduce(_local(g), group=self.tied_group)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient: DTensor grads reduce over their mesh; experts sum over ep; stages
        sum over pp. A tied head on a later stage is not counted twice.

        The gradients are grouped by how their squares must be summed across ranks (plain tensors: not at all;
        DTensor shards: over each non-replicated mesh dim, once per group instead of once per parameter), and
        each group's squares are summed with one `torch._foreach_norm` call (the per-tensor norms are squared
        and added in float64), not a Python loop over parameters."""
        dims = self.dims
        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        expert = torch.zeros((), dtype=torch.float64, device=self.device)
        # ((dimension names, their groups' ranks), is expert) -> (process groups to sum over, local tensors)
        groups: dict[tuple, tuple[tuple, list[torch.Tensor]]] = {}
        if self._plain:  # one group of plain tensors per kind, no mesh to reduce over
            for expert_param, ps in ((False, self._plain_dense), (True, self._plain_expert)):
                grads = [p.grad for p in ps if p.grad is not None]
                if grads:
                    groups[(((), ()), expert_param)] = ((), grads)
        for p, expert_param in () if self._plain else self._norm_params:
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):
                if any(pl.is_partial() for pl in g.placements):  # squares of partial sums do not add up
                    sq = g.to(torch.float64).pow(2).sum().full_tensor()
                    if expert_param:
                        expert += sq
                    else:
                        dense += sq
                    continue
                # every non-replicated mesh dim splits the tensor (Shard, and FSDP2's _StridedShard under TP,
                # which is not a Shard subclass)
                dims_ = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
                key, pgs = self._reduce_groups(g.device_mesh, dims_)
                groups.setdefault((key, expert_param), (pgs, []))[1].append(_local(g))
            else:
                groups.setdefault((((), ()), expert_param), ((), []))[1].append(g)
        for (_, expert_param), (pgs, tensors) in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0][:1])):
            total_sq = _sum_of_squares(tensors)
            for pg in pgs:  # summing over each sharded mesh dim in turn sums over all of them
                dist.all_reduce(total_sq, group=pg)
            if expert_param:
                expert += total_sq
            else:
                dense += total_sq
        if dims.ep_enabled:
            dist.all_reduce(expert, group=dims["ep"].get_group())
        total = dense + expert
        if dims.pp_enabled:
            dist.all_reduce(total, group=dims["pp"].get_group())
        return total.sqrt()

    def _reduce_groups(self, mesh, dims_: tuple[int, ...]) -> tuple[tuple, tuple]:
        """(key, process groups) over which squares sharded on `dims_` of `mesh` are summed. The key is the
        groups' ranks, not the mesh object: FSDP2 builds its own 2-D mesh per `fully_shard`/`replicate` call, so
        one logical (dp, tp) mesh arrives as several objects (7 on tiny-gpt at tp=2,dp=2), and keying by object
        made one tp all-reduce per object instead of one per step. Cached per (mesh object, dims)."""
        ck = (id(mesh), dims_)
        got = self._reduce_group_cache.get(ck)
        if got is None:
            pgs = tuple(mesh.get_group(d) for d in dims_)
            names = tuple(mesh.mesh_dim_names[d] if mesh.mesh_dim_names else str(d) for d in dims_)
            # the dimension names first: every rank must issue the groups' all-reduces in one order, and the
            # names (unlike the ranks) are the same on every rank
            got = ((names, tuple(tuple(dist.get_process_group_ranks(pg)) for pg in pgs)), pgs)
            self._reduce_group_cache[ck] = got
        return got

    def _clip_grads(self) -> float:
        norm = float(self.grad_norm())
        coef = self.max_grad_norm / (norm + 1e-6)
        if self.max_grad_norm > 0 and coef < 1.0:  # 0: clipping off
            grads = ([p.grad for _, p in self._params if p.grad is not None] if self._plain
                     else [_local(p.grad) for _, p in self._params if p.grad is not None])
            # in place on each local shard (the same as p.grad.mul_(coef)). On the CPU torch's foreach falls back
            # to one mul_ per tensor, and with a Python float each wraps the scalar into a tensor first: a 0-dim
            # tensor factor (as clip_grads_with_norm_ passes) is 3x cheaper there (68 tensors: 0.05 vs 0.15 ms)
            factor = torch.tensor(coef, dtype=grads[0].dtype) if grads and grads[0].device.type == "cpu" else coef
            torch._foreach_mul_(grads, factor)
        return norm

    def _reduce_loss(self, local_loss: torch.Tensor) -> tuple[float, int | None]:
        """(mean loss over the global batch, the stop signal any rank received) on every rank, from one world
        all-reduce: the stop request rides along with the loss (one flag per signal, summed)."""
        dims, pm = self.dims, self.pm
        mine = self.stop_flag.signum if self.stop_flag is not None else None
        if dims.world_size == 1:
            return float(local_loss), mine
        contributes = pm.has_last and (not dims.tp_enabled or dims.rank("tp") == 0)
        loss = (local_loss.double() / dims.dp_cp) if contributes else torch.zeros((), dtype=torch.float64,
                                                                                   device=self.device)
        t = torch.cat([loss.reshape(1), torch.tensor(StopFlag.encode(mine), dtype=torch.float64,
                                                     device=self.device)])
        dist.all_reduce(t)
        values = t.tolist()  # one device-to-host copy
        return values[0], StopFlag.decode(values[1:])


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by dtype (foreach ops and flat buffers take one dtype), in first-seen order."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum(t.square().sum() for t in tensors) in float64, from one foreach norm per dtype (an empty shard adds 0)."""
    return sum(torch.stack(torch._foreach_norm(ts)).to(torch.float64).square().sum() for ts in _by_dtype(tensors))


# Bytes per all-reduce when gradients are reduced in buckets: torch DDP's default bucket_cap_mb (25 MiB).
_BUCKET_BYTES = 25 * 2**20


def _all_reduce_bucketed(grads: list[torch.Tensor], group) -> None:
    """Sum `grads` over `group` in place, a few flat buckets of up to 25 MiB each (per dtype) rather than one
    collective per tensor: the cost model prices the experts' reduction as one bucketed collective (counts:
    `all_reduce@edp`), and per-tensor calls pay a latency each."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    buckets: list[list[torch.Tensor]] = []
    for same in _by_dtype(grads):
        size = _BUCKET_BYTES  # start a new bucket for each dtype
        for g in same:
            nbytes = g.numel() * g.element_size()
            if size + nbytes > _BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += nbytes
    for bucket in buckets:
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            dst.copy_(src)


def _local(x):
    """This rank's shard of a DTensor as a plain tensor, for gradients and detached values only. Not `to_local()`:
    that is an autograd Function (about 5 us a call) and the step calls this once per parameter for the norm and
    again for clipping (136 calls on tiny-gpt under FSDP, 3% of the step's Python calls). `_local_tensor` is the
    same storage (what `to_local` returns a view of), with no autograd node."""
    return x._local_tensor if isinstance(x, DTensor) else x


def _set_sync(model, zero: int, last: bool) -> None:
    """Gradient accumulation: reduce once at the last micro-batch, except ZeRO-2/3 which shard gradients
    after every micro-batch; ZeRO-1 also keeps parameters unsharded until the last backward."""
    if not hasattr(model, "set_requires_gradient_sync"):
        return
    if zero in (0, 1):
        model.set_requires_gradient_sync(last)
    if zero == 1:
        model.set_reshard_after_backward(last)


def _tied_group(plan: Plan, dims: ParallelDims):
    """The process group of the first and last pipeline ranks (same dp/cp/tp coordinates) for tied weights."""
    from autoplan.models import layout_spec

    if not (layout_spec(plan).tie_embeddings and dims.pp_enabled):
        return None
    if dims.pp == 2:
        return dims["pp"].get_group()
    mesh = dims.mesh.mesh  # (pp, dp, cp, tp) ranks
    mine = None
    me = dist.get_rank()
    for d in range(dims.dp):
        for c in range(dims.cp):
            for t in range(dims.tp):
                ranks = [int(mesh[0, d, c, t]), int(mesh[dims.pp - 1, d, c, t])]
                g = dist.new_group(ranks)
                if me in ranks:
                    mine = g
    return mine


def tokens_per_step(plan: Plan) -> int:
    return plan.training.global_batch_size * plan.training.seq_length


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux); process RSS
    except Exception:
        return math.nan
