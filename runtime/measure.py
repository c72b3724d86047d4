"""Measure one training step with torch's own instruments: FLOPs by phase, bytes per collective, tensor memory.

Why this module exists: the cost model predicts FLOPs, communication and memory per rank; this is the other
side of that comparison, taken from the program autoplan actually runs (`Trainer.step`), never from the model.

- FLOPs: `torch.utils.flop_counter`'s formula registry (the table FlopCounterMode uses), applied by a dispatch
  mode that also records the phase of each op: forward (no autograd graph task running), backward (inside the
  autograd engine, grad mode off) or recompute (inside the engine with grad mode on: torch.utils.checkpoint
  re-runs forward ops under enable_grad during backward). DTensor ops are let through (NotImplemented) so the
  local ops they run are counted on their local shapes, as MemTracker does. CPU flash attention
  (`_scaled_dot_product_flash_attention_for_cpu` and its backward) is missing from torch's registry; it is added
  with torch's own SDPA formulas.
- Communication: every c10d collective goes through the dispatcher (`c10d.allreduce_`, `_allgather_base_`,
  `_reduce_scatter_base_`, `alltoall_base_`, `send`, `recv_`, ...; DTensor's functional `_c10d_functional.*`
  ops), so one dispatch mode sees FSDP2, DTensor, pipelining and our own collectives. Each is attributed to the
  mesh dimension whose process group it ran on. Bytes follow the cost model's convention (cost_models/comm.py):
  all-reduce: the buffer; all-gather: the gathered (output) buffer; reduce-scatter: the full (input) buffer;
  all-to-all: what this rank sends; send/recv: the message.
- Memory: `torch.distributed._tools.mem_tracker.MemTracker` (per storage, categorised as parameter, gradient,
  optimizer state, activation, temporary), with the maximum of each category over the step kept beside the
  peak and its breakdown, and the largest moment of each phase (forward, backward, optimizer step) with its
  categories. What exists before the step is registered first: the modules' parameters and buffers, the
  optimizer state, and the pipeline's receive buffers (in the categories the cost model prices them in,
  `track_pipeline_buffers`). On a GPU the allocator's peak (`torch.cuda.max_memory_allocated`) is reported too.
  `SiteMemTracker` (a diagnostic: benchmarks/counts.py --sites) also says which storages make up each category
  at the peak, by the module, phase, op and micro-batch that made them.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, _create_work_from_future, _resolve_process_group
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
c10d = torch.ops.c10d
fc = torch.ops._c10d_functional

# ----------------------------------------------------------------------------------------------- FLOPs


def _cpu_flash_fwd(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_bwd(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


FLOP_FORMULAS: dict[Any, Any] = dict(flop_registry)
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_fwd
    FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_bwd

_SKIP = {aten.is_contiguous.default, aten.size.default, aten.stride.default, aten.numel.default,
         aten.dim.default, aten.sym_size.default, aten.sym_stride.default, aten.sym_numel.default}


def current_phase() -> str:
    """forward | backward | recompute, from the autograd engine's state on this thread."""
    if torch._C._current_graph_task_id() == -1:
        return "forward"
    return "recompute" if torch.is_grad_enabled() else "backward"


class PhaseFlopCounter(TorchDispatchMode):
    """FLOPs of local ops by phase and by op, with torch.utils.flop_counter's formulas."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = {"forward": 0, "backward": 0, "recompute": 0}
        self.by_op: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops; they come back here
        if func in _SKIP:
            return func(*args, **kwargs)
        packet = func._overloadpacket
        if packet not in FLOP_FORMULAS:
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        out = func(*args, **kwargs)
        formula = FLOP_FORMULAS.get(packet)
        if formula is not None:
            n = _apply_formula(formula, args, kwargs, out)
            self.flops[current_phase()] += n
            self.by_op[str(packet)] += n
        return out


def _apply_formula(formula, args, kwargs, out) -> int:
    # the registry's entries take the raw arguments (shape_wrapper / get_raw), like FlopCounterMode calls them
    return int(formula(*args, **kwargs, out_val=out))


# ------------------------------------------------------------------------------------------ communication

# op -> (collective name, how to take the bytes from its arguments)
def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _sum_bytes(ts) -> int:
    flat, _ = tree_flatten(ts)
    return sum(_nbytes(t) for t in flat if isinstance(t, torch.Tensor))


_C10D = {
    "allreduce_": ("all_reduce", lambda a: _sum_bytes(a[0]), 1),
    "allreduce_coalesced_": ("all_reduce", lambda a: _sum_bytes(a[0]), 1),
    "allgather_": ("all_gather", lambda a: _sum_bytes(a[0]), 2),
    "_allgather_base_": ("all_gather", lambda a: _nbytes(a[0]), 2),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _sum_bytes(a[0]), 2),
    "reduce_scatter_": ("reduce_scatter", lambda a: _sum_bytes(a[1]), 2),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1]), 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _sum_bytes(a[1]), 2),
    "alltoall_": ("all_to_all", lambda a: _sum_bytes(a[1]), 2),
    "alltoall_base_": ("all_to_all", lambda a: _nbytes(a[1]), 2),
    "broadcast_": ("broadcast", lambda a: _sum_bytes(a[0]), 1),
    "send": ("send", lambda a: _sum_bytes(a[0]), 1),
    "recv_": ("recv", lambda a: _sum_bytes(a[0]), 1),
}
# functional collectives: (name, bytes, index of the group-name argument)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", lambda a, out: _nbytes(a[0]), 2),
    "all_reduce_coalesced": ("all_reduce", lambda a, out: _sum_bytes(a[0]), 2),
    "all_gather_into_tensor": ("all_gather", lambda a, out: _nbytes(out), 2),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a, out: _sum_bytes(out), 2),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, out: _nbytes(a[0]), 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a, out: _sum_bytes(a[0]), 3),
    "all_to_all_single": ("all_to_all", lambda a, out: _nbytes(a[0]), 3),
    "broadcast": ("broadcast", lambda a, out: _nbytes(a[0]), 2),
}


class CommCounter(TorchDispatchMode):
    """Count and bytes of every collective by (collective, mesh dimension), seen at the dispatcher."""

    def __init__(self, group_names: dict[tuple[int, ...], str]) -> None:
        super().__init__()
        self.group_names = group_names  # ranks of a group -> mesh dimension
        self.records: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def _dim(self, group) -> str:
        """The mesh dimension of a collective's group (a functional collective's group name, or the c10d op's
        boxed ProcessGroup), matched by its ranks."""
        try:
            if isinstance(group, str):
                pg = _resolve_process_group(group)
            else:
                pg = group if isinstance(group, ProcessGroup) else ProcessGroup.unbox(group)
            ranks = tuple(dist.get_process_group_ranks(pg))
        except Exception:
            return "other"
        return self.group_names.get(ranks, "other")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns, name = func.namespace, func._overloadpacket.__name__
        if ns == "c10d" and name in _C10D:
            coll, nbytes, gi = _C10D[name]
            self._add(coll, self._dim(args[gi]), nbytes(args))
        elif ns == "_c10d_functional" and name in _FUNCTIONAL:
            coll, nbytes, gi = _FUNCTIONAL[name]
            self._add(coll, self._dim(args[gi]), nbytes(args, out))
        return out

    def _add(self, coll: str, dim: str, nbytes: int) -> None:
        r = self.records[(coll, dim)]
        r[0] += 1
        r[1] += int(nbytes)

    def as_list(self) -> list[dict]:
        return [{"collective": c, "mesh_dim": d, "count": n, "bytes": b}
                for (c, d), (n, b) in sorted(self.records.items())]


def group_names(dims) -> dict[tuple[int, ...], str]:
    """Ranks of a group -> the mesh dimension it belongs to. Where two views share ranks (dp_cp is dp when cp=1,
    tp is the world on a tp-only layout), the more specific name wins: tp, cp, ep, pp, then dp (gradient reduction
    over dp x cp is reported as "dp", over the expert data-parallel ranks as "edp"); any other group is "world"
    (all ranks) or "other" (the tied-embedding group of the first and last pipeline stages)."""
    out: dict[tuple[int, ...], str] = {tuple(range(dist.get_world_size())): "world"}
    order = ["dp_cp", "edp_cp", "edp", "dp", "pp", "ep", "cp", "tp"]  # later wins
    for view in order:
        try:
            mesh = dims[view]
        except KeyError:
            continue
        if mesh.size() > 1:
            label = {"dp_cp": "dp", "edp_cp": "edp"}.get(view, view)
            out[tuple(dist.get_process_group_ranks(mesh.get_group()))] = label
    return out


# ------------------------------------------------------------------------------------------------- memory

_CATEGORIES = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer",
               "Activation": "activations", "Temp": "temporaries", "Buffer": "temporaries",
               "Other": "temporaries", "Input": "activations"}


def _tolerant_pop(get_pop_fn):
    """ModTracker's module-exit hook, without its nesting check. ZeRO-0 runs the model through DDP applied in place
    (runtime.parallelize.apply_ddp: the model's forward enters DDP's wrapper modules, which hold the model), and
    ModTracker then sees a module exit that it did not see enter and raises "The Module hierarchy tracking is
    wrong". The categories measured here come from each tensor's kind, not from the module tree, so a module
    nesting that ModTracker cannot follow changes nothing in them."""
    def get(w_mod, name, is_bw):
        pop = get_pop_fn(w_mod, name, is_bw)

        def fn(*args):
            try:
                pop(*args)
            except RuntimeError as e:
                if "Module hierarchy tracking" not in str(e):
                    raise
        return fn
    return get


# The collectives the measured step runs on private copies of their tensors (`_private_collective`): every c10d
# collective that writes its first argument, except the all-reduces (DDP's reducer takes its bucket back from the
# Work's future, which would then be the copy) and the pipeline's send/recv (not collectives: waiting on a send
# before the peer posts its receive could deadlock); and every functional collective (DTensor's).
_PRIVATE_C10D = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "reduce_scatter_",
                 "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_", "alltoall_base_",
                 "broadcast_"}


def _is_private(func) -> bool:
    ns, name = func.namespace, func._overloadpacket.__name__
    return (ns == "c10d" and name in _PRIVATE_C10D) or (ns == "_c10d_functional" and name in _FUNCTIONAL)


def _private_collective(func):
    """`func`, a collective, run so that the communication backend never holds the program's own tensors: on
    copies of its tensor arguments, waited for at once, its results copied back into the program's tensors (c10d
    ops: the first argument, with a finished Work in place of the backend's) or returned as new tensors (functional
    ops, whose later wait_tensor then finds no work and returns). The values and every tensor the program holds are
    the same as without it.

    Why: gloo's Work keeps the collective's tensors, and gloo's worker thread keeps the Work until it has finished
    with it, a moment *after* the waiting thread is woken. When the program drops a buffer in that window (FSDP2's
    all-gather output after its copy-out, DTensor's all-reduce output), the last reference goes on the worker
    thread whenever the scheduler lets it run. And gloo's reduce-scatter allreduces a clone of the whole input and
    copies this rank's chunk out of it when its Work is waited on (a LambdaWork, on the waiting thread, under its
    dispatch modes): the tracker registered that clone, which the worker thread then freed. So the categories at a
    moment depended on the scheduler (seen: the 195 KiB clone of a tiny-gpt block's reduce-scatter input beside a
    ZeRO-3 block's backward, 16 KiB all-reduce outputs at tp=2's head/block near-tie). NCCL does neither (its
    watchdog keeps the Work without its outputs; its reduce-scatter makes no whole-input copy), so the program's
    own references are what a GPU run holds. The copies are made inside the tracker's dispatch, below every mode,
    so no instrument sees them; the collectives' bytes are counted above it (CommCounter) on the program's
    tensors. Cost: the step's collectives complete where they are issued (no
    overlap on the CPU, which this step does not time) and one copy of each buffer."""
    def run(*args, **kwargs):
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def private(t: torch.Tensor) -> torch.Tensor:
            c = t.clone()
            pairs.append((t, c))
            return c

        if func.namespace == "c10d":
            n_out = sum(isinstance(t, torch.Tensor) for t in tree_flatten(args[0])[0])
            res = func(*tree_map_only(torch.Tensor, private, args), **kwargs)
            for w in tree_flatten(res)[0]:
                if isinstance(w, torch.ScriptObject):
                    w.wait()
            for t, c in pairs[:n_out]:  # the outputs, flattened first
                t.copy_(c)
            back = {id(c): t for t, c in pairs}
            res = tree_map_only(torch.Tensor, lambda x: back.get(id(x), x), res)
            # the program gets a finished Work of its own, not gloo's: waiting on gloo's again would run its
            # continuation again (its reduce-scatter copies its chunk out of a whole-input buffer on every wait)
            fut = torch.futures.Future()
            fut.set_result([t for t, _ in pairs[:n_out]])
            done = _create_work_from_future(fut)
            return tree_map_only(torch.ScriptObject, lambda w: done.boxed(), res)
        res = func(*tree_map_only(torch.Tensor, private, args), **kwargs)
        for o in tree_flatten(res)[0]:
            if isinstance(o, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(o)
        return tree_map_only(torch.Tensor, torch.clone, res)
    return run


# a module of a transformer block (runtime.parallelize: `model.layers[k]`, as ModTracker names it, possibly under
# FSDP's, checkpoint_wrapper's or a pipeline stage's names)
_BLOCK = re.compile(r"(^|\.)layers\.\d+(\.|$)")


class StepMemTracker(MemTracker):
    """MemTracker for a whole training step with several micro-batches: a root module's later forward calls are
    the next micro-batch, not the next iteration (MemTracker's module-wise statistics, which refuse that, are
    not used here), and the maximum of each category over the step is kept beside the peak; and the largest
    moment of each phase and place (`moment_peak`: forward or backward, inside a transformer block or not;
    optimizer), so that a model's moment (a block's backward, the head's) is compared with the same moment.
    `private_collectives` (default): collectives run on private copies (`_private_collective`), so that what is
    alive at a moment does not depend on when gloo's worker thread lets go of a finished collective."""

    def __init__(self, private_collectives: bool = True) -> None:
        super().__init__()
        self.category_max: dict[str, int] = defaultdict(int)
        # the largest total of each phase (forward, backward, optimizer) and the categories then
        self.phase_peak: dict[str, dict] = {}
        # the same by moment: "forward/block", "forward/other", "backward/block", "backward/other", "optimizer"
        self.moment_peak: dict[str, dict] = {}
        self._mod_tracker._get_pop_fn = _tolerant_pop(self._mod_tracker._get_pop_fn)
        self.private_collectives = private_collectives
        self._in_block: dict[str, bool] = {}
        # tracked storages whose last reference went on another thread (a communication backend's): a diagnostic
        # of the race `_private_collective` removes; [count, bytes], then (SiteMemTracker) [category, bytes, *site]
        # of each
        self._main_thread = threading.get_ident()
        self.freed_off_thread = [0, 0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if threading.get_ident() != self._main_thread:
            # an op run on another thread under this thread's modes (a Future's callback runs with the thread-local
            # state of the thread that added it, on whichever thread completes the Future): a communication
            # backend's continuation, not the program's, and whether it comes before or after a moment of the
            # program is the scheduler's choice
            return func(*args, **(kwargs or {}))
        if self.private_collectives and _is_private(func) and active_fake_mode() is None and \
                not any(t is DTensor or issubclass(t, DTensor) for t in types):
            func = _private_collective(func)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _delete_callback(self, winfo, w_st) -> None:
        if winfo.mem_consumed > 0 and threading.get_ident() != self._main_thread:
            self.freed_off_thread[0] += 1
            self.freed_off_thread[1] += winfo.mem_consumed
            site = getattr(winfo, "site", None)  # SiteMemTracker's
            if site is not None:
                self.freed_off_thread.append([_ref_name(winfo.reftype), winfo.mem_consumed, *site])
        super()._delete_callback(winfo, w_st)

    def _moment(self, phase: str) -> str:
        if phase == "optimizer":
            return phase
        for name in self._mod_tracker.parents:
            b = self._in_block.get(name)
            if b is None:
                b = self._in_block[name] = bool(_BLOCK.search(name))
            if b:
                return phase + "/block"
        return phase + "/other"


    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return  # the next micro-batch through an already tracked module
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        for dev_snap in self._curr_mem_snap.values():
            for k, v in dev_snap.items():
                key = _ref_name(k)
                if v > self.category_max[key]:
                    self.category_max[key] = v
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)
        phase = "optimizer" if self._in_opt else ("backward" if self._mod_tracker.is_bw else "forward")
        total = sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())
        for peaks, key in ((self.phase_peak, phase), (self.moment_peak, self._moment(phase))):
            if total > peaks.get(key, {}).get("peak", -1):
                peaks[key] = {"peak": total, **_categories(self._curr_mem_snap.values())}

    def summary(self) -> dict:
        """{category: max bytes over the step, ..., "peak": bytes, "at_peak": {category: bytes at the peak}}."""
        out = {k: 0 for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")}
        for k, v in self.category_max.items():  # buffers and "other" are folded into temporaries: the larger
            cat = _CATEGORIES.get(_ref_name(k))
            if cat is not None:
                out[cat] = max(out[cat], v)
        out["peak"] = max((snap.get(_TOTAL_KEY, 0) for snap in self._peak_mem_snap.values()), default=0)
        out["at_peak"] = _categories(self._peak_mem_snap.values())
        out["by_phase"] = self.phase_peak
        out["by_moment"] = self.moment_peak
        out["freed_off_thread"] = list(self.freed_off_thread)
        return out


def _categories(snaps) -> dict[str, int]:
    """The five categories of MemTracker snapshots (one per device), summed over devices."""
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "temporaries"), 0)
    for snap in snaps:
        for k, v in snap.items():
            cat = _CATEGORIES.get(_ref_name(k))
            if cat is not None:
                out[cat] += v
    return out


class SiteMemTracker(StepMemTracker):
    """StepMemTracker that also says *which* tensors make up each category at the peak: every storage is tagged
    at creation with its site (the innermost module running, the phase -- forward, backward or recompute -- and
    the op that made it, with its shape and dtype), live bytes are kept per (category, site), and the table at the
    moment of the peak is kept. A diagnostic (benchmarks/counts.py --sites), not used by the training loop."""

    def __init__(self) -> None:
        super().__init__()
        self._site = None
        self.site_live: dict[tuple[str, tuple], list[int]] = defaultdict(lambda: [0, 0])
        self.site_at_peak: dict[tuple[str, tuple], list[int]] = {}
        self._micro_batch = -1  # forward calls of a root module so far (the micro-batch a storage belongs to)

    def _pre_fw_hook(self, module, inputs) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if name is not None and "." not in name and not self._mod_tracker.is_bw:
            self._micro_batch += 1
        super()._pre_fw_hook(module, inputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t == DTensor for t in types):
            return NotImplemented
        if threading.get_ident() != self._main_thread:
            return super().__torch_dispatch__(func, types, args, kwargs)  # a backend thread's op (not tracked)
        parents = [p for p in self._mod_tracker.parents if p != "Global"]
        mod = max(parents, key=lambda n: (n.count("."), n), default="Global")
        self._site = (mod, current_phase(), func._overloadpacket.__name__, self._micro_batch)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._site = None

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        from torch.distributed._tools.mem_tracker import _UpdateType

        site = getattr(winfo, "site", None)
        if site is None:
            site = winfo.site = self._site or ("<hook>", "", "", self._micro_batch)
        cat = _ref_name(winfo.reftype)
        if u_type == _UpdateType.ADD:
            e = self.site_live[(cat, site)]
            e[0] += winfo.mem_consumed
            e[1] += 1
        elif u_type == _UpdateType.DEL:
            e = self.site_live[(cat, site)]
            e[0] -= winfo.mem_consumed
            e[1] -= 1
        elif u_type == _UpdateType.REF:
            old = self.site_live[(_ref_name(old_reftype), site)]
            old[0] -= winfo.mem_consumed
            old[1] -= 1
            e = self.site_live[(cat, site)]
            e[0] += winfo.mem_consumed
            e[1] += 1
        elif u_type == _UpdateType.SIZE:
            self.site_live[(cat, site)][0] += winfo.mem_consumed - old_mem_consumed
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    def _update_peak_stats(self, peak_state) -> None:
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        if self._peak_mem != before:
            self.site_at_peak = {k: list(v) for k, v in self.site_live.items() if v[0]}

    def sites(self, categories=("Activation",)) -> list[dict]:
        """The storages of `categories` live at the peak, by site, largest first."""
        rows = [{"category": c, "module": s[0], "phase": s[1], "op": s[2], "micro_batch": s[3], "bytes": b,
                 "count": n}
                for (c, s), (b, n) in self.site_at_peak.items() if c in categories and b]
        return sorted(rows, key=lambda r: -r["bytes"])


def _track_trainer(mem: MemTracker, trainer) -> None:
    """Register what exists before the step: the stages' parameters and buffers, the optimizer state, and the
    pipeline's receive buffers (`track_pipeline_buffers`)."""
    for s in trainer.pm.stages:
        mem.track_external(s.module)
    mem.track_external(trainer.optimizer)
    track_pipeline_buffers(mem, trainer.pm.schedule)


def track_pipeline_buffers(mem: MemTracker, schedule) -> None:
    """Register the pipeline's receive buffers before the step, in the categories the cost model prices them in
    (cost_models.counts: `pipeline_act`, the gradient receive buffers): one activation buffer per micro-batch
    for every stage after the first (PipelineStage._prepare_forward_infra, `args_recv_info`) as activations, one
    gradient buffer per micro-batch for every stage before the last (`_create_grad_recv_info`,
    `grad_recv_info`) as temporaries. They are made in step 1 and reused by every step, so they exist
    throughout the measured one; MemTracker would otherwise register each only when an op of the step first
    touches it, in that op's category, and a stage's peak would see only the buffers touched so far."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    if schedule is None:
        return
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for st in (s for s in stages if s is not None):
        for infos, reftype in ((st.args_recv_info, _MemRefType.ACT), (st.grad_recv_info, _MemRefType.TEMP)):
            for recv in (r for tup in infos.values() for r in tup):
                if not getattr(recv, "is_root_arg", False) and isinstance(recv.buffer, torch.Tensor):
                    mem._update_and_maybe_create_winfos(recv.buffer, reftype)


def _ref_name(k) -> str:
    return str(getattr(k, "value", k))


# ------------------------------------------------------------------------------------------- one step


def measure_step(trainer, batch: torch.Tensor, sites: bool = False) -> tuple[Any, dict]:
    """Run `trainer.step(batch)` under the three instruments: (its StepResult, this rank's measured counts, the
    `measured` part of the run log's profile record). `sites`: also list the activation and temporary storages
    live at the peak by where they were made (SiteMemTracker), under "memory_sites"."""
    dims = trainer.dims
    flops = PhaseFlopCounter()
    comm = CommCounter(group_names(dims))
    mem = SiteMemTracker() if sites else StepMemTracker()
    _track_trainer(mem, trainer)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)
    t0 = time.perf_counter()
    with mem, comm, flops:
        res = trainer.step(batch)
    wall = time.perf_counter() - t0
    m = mem.summary()
    out = {
        "flops": dict(flops.flops),
        "comm": comm.as_list(),
        # the categories at the moment of the peak (they add up to it); each category's own maximum over the step
        # (e.g. optimizer state plus the foreach step's temporaries) beside them
        "memory_bytes": {**m["at_peak"], "peak": m["peak"]},
        "memory_max_bytes": {k: m[k] for k in ("parameters", "gradients", "optimizer", "activations",
                                               "temporaries")},
        # the largest total inside each phase (forward, backward, optimizer step) and its categories: a model
        # that prices a moment in one phase is compared with the measurement's largest moment in that phase
        "memory_by_phase": m["by_phase"],
        # the same by moment (StepMemTracker.moment_peak): forward or backward, inside a transformer block or not
        "memory_by_moment": m["by_moment"],
        # tracked storages freed on a communication backend's thread (count, bytes): with private collectives only
        # what the all-reduces and send/recv leave there (scalars on the benchmark's matrix)
        "memory_freed_off_thread": m["freed_off_thread"],
        "time_s": {"step": wall},
    }
    if sites:
        out["memory_sites"] = mem.sites(("Activation", "Temp", "Other", "Buffer", "Parameter", "Gradient"))
    if trainer.device.type == "cuda":
        out["memory_bytes"]["allocator_peak"] = int(torch.cuda.max_memory_allocated(trainer.device))
    return res, out


def profile_record(trainer, step: int, batch: torch.Tensor, sites: bool = False) -> tuple[Any, dict | None]:
    """Measure this step on every rank, gather to rank 0: (the StepResult, the run log's profile record on rank 0,
    None on the others): {"event": "profile", "step": N, "ranks": [{"rank", "pp_stage", "measured",
    "predicted"}]}. Every rank must call it (it gathers)."""
    from autoplan.counts import counts_of_plan

    dims = trainer.dims
    res, measured = measure_step(trainer, batch, sites)
    pp_rank = dims.rank("pp") if dims.pp_enabled else 0
    predicted = counts_of_plan(trainer.plan, module_loaded=True)[pp_rank]  # this process runs the plan's module
    mine = {"rank": dist.get_rank(), "pp_stage": pp_rank, "measured": measured, "predicted": predicted}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return res, None
    return res, {"event": "profile", "step": step, "ranks": gathered}


def memory_step(trainer, batch: torch.Tensor) -> tuple[Any, dict]:
    """Run one step under MemTracker alone (cheaper than the full profile): (StepResult, memory categories)."""
    mem = StepMemTracker()
    _track_trainer(mem, trainer)
    with mem:
        res = trainer.step(batch)
    m = mem.summary()
    return res, {**m["at_peak"], "peak": m["peak"]}


class StepMemory:
    """The tensor-memory figures of every run-log line. On a GPU, the allocator's peak of each step
    (torch.cuda.max_memory_allocated, reset before the step). On the CPU there is no allocator to ask, so the
    tensor peak is measured with MemTracker on one step (`memory_step`, by default step 3: the first steady step --
    step 1 creates the optimizer state, DDP rebuilds its buckets in step 2 -- or the profiled step) and carried on the lines after it, with
    the step it was measured on; the process RSS is logged beside it as `rss_gib`."""

    def __init__(self, device: torch.device, measure_at: int | None) -> None:
        self.device = device
        self.measure_at = measure_at
        self.peak_bytes: float | None = None
        self.measured_step: int | None = None

    def before(self, step: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def wants(self, step: int) -> bool:
        return self.device.type != "cuda" and step == self.measure_at

    def record(self, step: int, peak_bytes: float) -> None:
        self.peak_bytes, self.measured_step = float(peak_bytes), step

    def fields(self, step: int) -> dict:
        if self.device.type == "cuda":
            self.record(step, torch.cuda.max_memory_allocated(self.device))
        gib = None if self.peak_bytes is None else self.peak_bytes / 2**30
        return {"peak_memory_gib": gib, "memory_measured_step": self.measured_step, "rss_gib": rss_gib()}


def rss_gib() -> float | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux): the process's RSS
    except Exception:
        return None


def render_profile(record: dict, console=None) -> None:
    """A readable table of a profile record: per rank, measured vs predicted FLOPs, bytes and memory."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"profile of step {record['step']}: measured / predicted", title_justify="left")
    for col in ("rank", "stage", "FLOPs fwd", "FLOPs bwd", "FLOPs recompute", "comm bytes", "peak MiB",
                "params MiB", "grads MiB", "optim MiB", "activ MiB"):
        t.add_column(col, justify="right")
    for r in record["ranks"]:
        m, p = r["measured"], r["predicted"]

        def pair(a, b, scale=1.0, fmt="{:.3g}"):
            return f"{fmt.format(a / scale)} / {fmt.format(b / scale)}"

        mb, pb = sum(c["bytes"] for c in m["comm"]), sum(c["bytes"] for c in p["comm"])
        mm, pm = m["memory_bytes"], p["memory_bytes"]
        t.add_row(str(r["rank"]), str(r["pp_stage"]),
                  *(pair(m["flops"][k], p["flops"][k]) for k in ("forward", "backward", "recompute")),
                  pair(mb, pb),
                  *(pair(mm[k], pm[k], 2**20, "{:.2f}") for k in ("peak", "parameters", "gradients", "optimizer",
                                                                 "activations")))
    console.print(t)
    comm = Table(title="collectives (all ranks): count and bytes, measured / predicted", title_justify="left")
    for col in ("collective", "mesh dim", "count", "bytes"):
        comm.add_column(col, justify="right")
    agg: dict = {}
    for r in record["ranks"]:
        for side, off in (("measured", 0), ("predicted", 2)):
            for c in r[side]["comm"]:
                e = agg.setdefault((c["collective"], c["mesh_dim"]), [0, 0, 0, 0])
                e[off] += c["count"]
                e[off + 1] += c["bytes"]
    for (c, d), (mn, mbytes, pn, pbytes) in sorted(agg.items()):
        comm.add_row(c, d, f"{mn} / {pn}", f"{mbytes:.4g} / {pbytes:.4g}")
    console.print(comm)
