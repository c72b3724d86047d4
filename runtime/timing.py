"""Where a training step's time goes on one rank: compute by phase, host time blocked in collectives by kind,
FSDP's own host work, and the step's tail (gradient norm, optimizer, loss).

Why this module exists: `autoplan tune` refits the cost model's constants on the *components* of a step, so
that GEMM and host-overhead knobs are fitted on compute time and collective knobs on collective time, not all of
them on one total. `measure.py`'s profiled step counts FLOPs and bytes, but its instruments (a dispatch mode on
every op, MemTracker) slow the step down several-fold, so its times are not the step's. This timer is cheap: it
wraps only the boundaries between components, with torch's own markers where they exist, and no per-op hook:

- backward: `torch.autograd.backward` / `torch.autograd.grad` (what `Tensor.backward` and the pipeline stages
  call);
- recompute: `torch.utils.checkpoint._recomputation_hook`, the context the non-reentrant checkpoint re-runs a
  forward under inside backward (entered and exited even when recomputation stops early);
- FSDP's host work: its `record_function("FSDP::...")` regions (unshard, copy-in/out, reduce-scatter, reshard);
- the step tail: the runtime's `record_function("autoplan::step_tail")` (Trainer.step);
- blocked in a collective: `Work.wait` (c10d: FSDP, dist.*), `_functional_collectives.wait_tensor` (DTensor's
  tensor, context and expert parallel collectives) and the pipeline schedule's `_wait_batch_p2p` (send/recv).

Time between two boundaries goes to the bucket the stack of open regions names: "<phase or section>[/<wait>]",
phase in forward/backward/recompute, section in fsdp/step_tail, wait in funcol/work/p2p. A collective's issue
(enqueueing it, microseconds) stays in the phase that issued it; the wait for it is its own bucket. What the
timer cannot see: waits made from C++ (DDP's reducer waits for its all-reduces inside backward, so ZeRO-0's
gradient reduction lands in "backward").
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import ExitStack

import torch

STEP_TAIL = "autoplan::step_tail"


class StepTimer:
    """Context manager: while open, this thread's step time is split into buckets (seconds, `buckets`)."""

    def __init__(self, sync=None) -> None:
        """`sync`: called before every clock read (`torch.cuda.synchronize` on a GPU, where kernels run after
        their launch returns: without it a bucket would hold launch time, and the device time would land in
        whichever bucket next waits on the device, the step tail's `.item()` mostly)."""
        self.buckets: dict[str, float] = defaultdict(float)
        self._sync = sync
        self._stack: list[tuple[str, str]] = []  # (kind: phase | section | wait, label)
        self._tid = threading.get_ident()
        self._last = 0.0
        self._patches = ExitStack()

    # ---------------------------------------------------------------------------- the bucket stack

    def _key(self) -> str:
        phase, section, wait = "forward", None, None
        for kind, label in self._stack:
            if kind == "phase":
                phase = label
            elif kind == "section":
                section = label
            else:
                wait = wait or label  # the outermost wait names it (a Work waited inside a p2p batch is p2p)
        base = section or phase
        return f"{base}/{wait}" if wait else base

    def _flush(self) -> None:
        if self._sync is not None:
            self._sync()
        now = time.perf_counter()
        self.buckets[self._key()] += now - self._last
        self._last = now

    def push(self, kind: str, label: str) -> int | None:
        """Open a region (None off this thread: other threads' time is not this step's host time)."""
        if threading.get_ident() != self._tid:
            return None
        self._flush()
        self._stack.append((kind, label))
        return len(self._stack) - 1

    def pop(self, token: int | None) -> None:
        if token is None:
            return
        self._flush()
        del self._stack[token:]

    def wrap(self, kind: str, label: str, fn):
        """`fn` with its call inside a region."""
        def timed(*args, **kwargs):
            token = self.push(kind, label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.pop(token)
        return timed

    # ---------------------------------------------------------------------------- the patches

    def _patch(self, owner, name: str, new) -> None:
        old = getattr(owner, name)
        setattr(owner, name, new)
        self._patches.callback(setattr, owner, name, old)

    def __enter__(self) -> StepTimer:
        import torch.distributed._functional_collectives as funcol
        import torch.utils.checkpoint as ckpt
        from torch._C._distributed_c10d import Work
        from torch.autograd.profiler import record_function
        from torch.distributed.pipelining import schedules

        self._patch(torch.autograd, "backward", self.wrap("phase", "backward", torch.autograd.backward))
        self._patch(torch.autograd, "grad", self.wrap("phase", "backward", torch.autograd.grad))
        self._patch(ckpt, "_recomputation_hook", _recompute_region(self, ckpt._recomputation_hook))
        self._patch(Work, "wait", self.wrap("wait", "work", Work.wait))
        self._patch(funcol, "wait_tensor", self.wrap("wait", "funcol", funcol.wait_tensor))
        self._patch(schedules, "_wait_batch_p2p", self.wrap("wait", "p2p", schedules._wait_batch_p2p))
        self._patch(record_function, "__enter__", _rf_enter(self, record_function.__enter__))
        self._patch(record_function, "__exit__", _rf_exit(self, record_function.__exit__))
        if self._sync is not None:
            self._sync()
        self._last = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._flush()
        self._stack.clear()
        self._patches.close()


def _section_of(name: str) -> str | None:
    if name.startswith("FSDP::"):
        return "fsdp"
    if name == STEP_TAIL:
        return "step_tail"
    return None


def _rf_enter(timer: StepTimer, old):
    def enter(rf):
        section = _section_of(rf.name)
        rf._autoplan_token = timer.push("section", section) if section else None
        return old(rf)
    return enter


def _rf_exit(timer: StepTimer, old):
    def exit_(rf, *exc):
        try:
            return old(rf, *exc)
        finally:
            timer.pop(getattr(rf, "_autoplan_token", None))
    return exit_


def _recompute_region(timer: StepTimer, hook_cls):
    """The checkpoint's recomputation context, opening a "recompute" phase for as long as it is entered."""
    class Timed(hook_cls):
        def __enter__(self):
            self._autoplan_token = timer.push("phase", "recompute")
            return super().__enter__()

        def __exit__(self, *exc):
            try:
                return super().__exit__(*exc)
            finally:
                timer.pop(self._autoplan_token)
    return Timed


def timed_step(trainer, batch: torch.Tensor):
    """Run `trainer.step(batch)` under a StepTimer: (its StepResult, {bucket: seconds} on this rank, the CPU time
    the process used meanwhile, every thread's: `time.process_time`)."""
    cpu0 = time.process_time()
    # on a GPU every boundary waits for the device, so the buckets hold device time (this serialises what the
    # untimed steps overlap across boundaries, e.g. a bucketed all-reduce with the next layer's backward)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else None
    with StepTimer(sync) as t:
        res = trainer.step(batch)
    return res, dict(t.buckets), time.process_time() - cpu0


def timing_record(trainer, step: int, batch: torch.Tensor):
    """Time this step on every rank and gather to rank 0: (the StepResult, the run log's timing record on rank 0,
    None on the others): {"event": "timing", "step": N, "ranks": [{"rank", "pp_stage", "step_s", "time_s", "cpu_s"}]}.
    Every rank must call it (it gathers, after the step)."""
    import torch.distributed as dist

    res, buckets, cpu_s = timed_step(trainer, batch)
    dims = trainer.dims
    mine = {"rank": dist.get_rank(), "pp_stage": dims.rank("pp") if dims.pp_enabled else 0,
            "step_s": res.step_time_s, "time_s": buckets, "cpu_s": cpu_s}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return res, None
    return res, {"event": "timing", "step": step, "ranks": gathered}
