"""Runtime overhead: autoplan's runtime against the plain PyTorch script a competent user would write, per layout.

    python benchmarks/overhead.py [--reps 3] [--steps 10] [--min-run-s S] [--layouts "dp zero=0" "tp" ...] [--json]
                                  [--root DIR]   # import autoplan from DIR (e.g. an export of main: "before")

Why: a planner that picks the fastest layout and then runs it slower than the user's own script loses the
argument it exists to win. For every layout the runtime supports (dp with each ZeRO stage, tp, tp+sp, pp with
each schedule, cp, ep, one process) the worker (this file under torchrun, all 2-rank layouts in one launch and
the one-process layout in another) trains the same model on the same data with the same AdamW and clipping
twice: A = `autoplan.runtime.train.train_loop` on a Plan made by the planner's API (the whole per-step loop:
learning rate, step, metrics, the JSON log), B = a plain script (DDP, FSDP2, DTensor `parallelize_module`,
`torch.distributed.pipelining`, eager). The order alternates per repetition (A B, then B A, ...).

Per side and repetition: startup (call -> ready to step: mesh, model, parallelisation, optimizer), the first
step, and the steady step (median wall time between the ends of consecutive steps after the first, so the
loop's own per-step work counts). Ratio = A / B steady step; reported: the median of the per-repetition ratios,
the same for the process's CPU time per step (gloo's threads included) and the main thread's (the step's own work),
and the largest relative difference of the two sides' per-step losses (must be <= 1e-5; fp32). The last line:
`overhead: worst R× (layout) over N layouts`.

Plain-script shortcuts, named: PyTorch has no CPU context parallelism and no expert-parallel module, so the cp
and ep scripts reuse the runtime's attention core (`ContextParallelAttentionCore`) and token exchange
(`_ep_dispatch`) -- those two pairs compare everything around them (DDP vs the runtime's data parallelism,
clipping, optimizer, loop), not the exchange itself. Timings on this 2-core machine are noisy (other jobs run
beside it): read ratios, not milliseconds, and re-run with more --reps when in doubt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (model preset, parallel configuration, processes). Models: tiny-gpt where the layout needs nothing
# special; tiny-llama (untied, RoPE) for TP/SP and PP so the plain scripts need no tied-weight or learned-position
# plumbing a user would not write; tiny-moe for ep.
LAYOUTS: dict[str, tuple[str, str, int]] = {
    "one process": ("tiny-gpt", "tp=1", 1),
    "dp zero=0": ("tiny-gpt", "dp=2", 2),
    "dp zero=1": ("tiny-gpt", "dp=2,zero=1", 2),
    "dp zero=2": ("tiny-gpt", "dp=2,zero=2", 2),
    "dp zero=3": ("tiny-gpt", "dp=2,zero=3", 2),
    "tp": ("tiny-llama", "tp=2", 2),
    "tp+sp": ("tiny-llama", "tp=2,sp=1", 2),
    "pp 1f1b": ("tiny-llama", "pp=2", 2),
    "pp gpipe": ("tiny-llama", "pp=2,schedule=gpipe", 2),
    "pp interleaved": ("tiny-llama", "pp=2,vp=2,schedule=interleaved", 2),
    "cp": ("tiny-gpt", "cp=2", 2),
    "ep": ("tiny-moe", "dp=2,ep=2", 2),
}
# Same hyper-parameters on both sides; a clip below the gradient norm so clipping really scales.
GBS, SEQ, LR, WD, BETAS, CLIP, SEED = 8, 64, 1e-3, 0.1, (0.9, 0.95), 0.5, 0
LOSS_RTOL = 1e-5


# ============================================================================================ plain scripts


def _plain_common(spec, plan):
    """What every plain script shares: the data (the same synthetic batches) and micro-batching."""
    from autoplan.runtime.data import SyntheticDataset

    data = SyntheticDataset(spec.vocab_size, SEQ, GBS, seed=SEED)
    return data, plan.parallel.mbs


def _adamw(params):
    import torch

    # the runtime's optimizer (engine.make_adamw): fused AdamW, as a competent user writes it on CPU or GPU
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, fused=True)


def _global_mean(loss, world: int, group=None) -> float:
    import torch.distributed as dist

    if world == 1:
        return float(loss)
    t = loss.detach().double().reshape(1).clone()
    dist.all_reduce(t, group=group)
    return float(t[0]) / (world if group is None else dist.get_world_size(group))


def plain_eager(spec, plan, steps: int, on_step) -> None:
    """One process: the model, AdamW, clip_grad_norm_."""
    import torch

    from autoplan.zoo import build_model, cross_entropy_loss

    data, mbs = _plain_common(spec, plan)
    model = build_model(spec, seed=SEED)
    opt = _adamw(model.parameters())
    n_micro = GBS // mbs
    on_step(None)
    for step in range(steps):
        b = data.batch(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(n_micro):
            x, y = b[i * mbs:(i + 1) * mbs, :-1], b[i * mbs:(i + 1) * mbs, 1:]
            loss = cross_entropy_loss(model(x), y)
            (loss / n_micro).backward()
            total += loss.detach() / n_micro
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        on_step(float(total))


def _dp_loop(model, params, data, mbs, steps, on_step, *, no_sync, world, rank, extra_grad_fix=None,
             cp_idx=None, clip=None) -> None:
    """The usual data-parallel loop: rows of this rank, micro-batches, sync on the last, clip, step."""
    import torch

    opt = _adamw(params)
    rows = GBS // (world if cp_idx is None else 1)
    lo = rank * rows if cp_idx is None else 0
    n_micro = rows // mbs
    on_step(None)
    for step in range(steps):
        b = data.batch(step)[lo:lo + rows]
        x, y = b[:, :-1], b[:, 1:]
        if cp_idx is not None:
            x, y = x[:, cp_idx].contiguous(), y[:, cp_idx].contiguous()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i in range(n_micro):
            with no_sync(i == n_micro - 1):
                loss = cross_entropy_loss_(model(x[i * mbs:(i + 1) * mbs]), y[i * mbs:(i + 1) * mbs])
                (loss / n_micro).backward()
            total += loss.detach() / n_micro
        if extra_grad_fix is not None:
            extra_grad_fix()
        if clip is not None:
            clip()
        else:
            torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        on_step(_global_mean(total, world))


def cross_entropy_loss_(logits, labels):
    from autoplan.zoo import cross_entropy_loss

    return cross_entropy_loss(logits, labels)


def plain_ddp(spec, plan, steps: int, on_step) -> None:
    """DDP (one bucketed all-reduce overlapped with backward; no_sync during accumulation)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autoplan.zoo import build_model

    data, mbs = _plain_common(spec, plan)
    model = build_model(spec, seed=SEED)
    ddp = DDP(model)
    params = list(model.parameters())
    _dp_loop(ddp, params, data, mbs, steps, on_step, world=dist.get_world_size(), rank=dist.get_rank(),
             no_sync=lambda last: contextlib.nullcontext() if last else ddp.no_sync())


def plain_fsdp(spec, plan, steps: int, on_step) -> None:
    """FSDP2 fully_shard per block and at the root; ZeRO-1 = no gradient sync / reshard until the last micro-batch,
    ZeRO-2 = reshard_after_forward=False, ZeRO-3 = reshard_after_forward=True."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from autoplan.zoo import build_model

    data, mbs = _plain_common(spec, plan)
    zero = plan.parallel.zero
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(spec, seed=SEED)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=zero == 3)

    @contextlib.contextmanager
    def no_sync(last):
        if zero == 1:
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        yield

    _dp_loop(model, list(model.parameters()), data, mbs, steps, on_step, world=world, rank=dist.get_rank(),
             no_sync=no_sync)


def plain_tp(spec, plan, steps: int, on_step) -> None:
    """DTensor tensor parallelism with parallelize_module, the torchtitan Llama plan (vocab-parallel embedding,
    column-parallel head with loss_parallel; with sp, sequence-parallel norms and residual stream)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    from autoplan.zoo import build_model

    data, mbs = _plain_common(spec, plan)
    sp = bool(plan.parallel.sp)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(spec, seed=SEED)
    resid = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=resid),
        **({"norm": SequenceParallel()} if sp else {}),
        "output": ColwiseParallel(input_layouts=resid, output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            **({"attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel()} if sp else {}),
            "attention": PrepareModuleInput(input_layouts=(resid, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=resid),
            "mlp": PrepareModuleInput(input_layouts=(resid,), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=resid),
        })
    dtensors = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    opt = _adamw([{"params": ps} for ps in (dtensors, plain) if ps])  # foreach cannot mix the two kinds
    n_micro = GBS // mbs
    on_step(None)
    for step in range(steps):
        b = data.batch(step)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        with loss_parallel():
            for i in range(n_micro):
                x, y = b[i * mbs:(i + 1) * mbs, :-1], b[i * mbs:(i + 1) * mbs, 1:]
                loss = cross_entropy_loss_(model(x), y)
                (loss / n_micro).backward()
                total += loss.detach().to_local() / n_micro
        clip_mixed(dtensors, plain, CLIP)
        opt.step()
        on_step(float(total))


def clip_mixed(dtensors: list, plain: list, max_norm: float) -> None:
    """clip_grad_norm_ over DTensor and plain parameters (without sequence parallelism the norms stay plain
    tensors, and one foreach call cannot mix them): one norm per kind, combined, one multiply per kind."""
    import torch

    norms = []
    if dtensors:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in dtensors], foreach=True).full_tensor())
    if plain:
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in plain], foreach=True))
    total = torch.stack(norms).norm()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([p.grad.to_local() for p in dtensors] + [p.grad for p in plain], coef)


def plain_pp(spec, plan, steps: int, on_step) -> None:
    """torch.distributed.pipelining: each rank builds its stages by deleting the other layers (torchtitan's
    manual split), PipelineStage + the schedule; the gradient norm summed over the pipeline ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from autoplan.zoo import build_model, init_weights

    data, mbs = _plain_common(spec, plan)
    world, rank = dist.get_world_size(), dist.get_rank()
    stages_plan = plan.stages  # the same layer split as the runtime (the plan's)
    n = len(stages_plan)
    modules, pstages = [], []
    for st in stages_plan:
        if st.pp_rank != rank:
            continue
        m = build_model(spec, device="meta")
        for key in list(m.layers.keys()):
            if not st.layers[0] <= int(key) < st.layers[1]:
                del m.layers[key]
        if not st.has_embedding:
            m.tok_embeddings = m.pos_embeddings = None
        if not st.has_head:
            m.norm = m.output = None
        m = m.to_empty(device="cpu")
        init_weights(m, SEED)
        modules.append(m)
        pstages.append(PipelineStage(m, st.index, n, torch.device("cpu")))
    n_micro = GBS // mbs
    kind = plan.parallel.schedule
    if kind == "interleaved":
        sched = ScheduleInterleaved1F1B(pstages, n_micro, loss_fn=cross_entropy_loss_)
    else:
        sched = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(pstages[0], n_micro, loss_fn=cross_entropy_loss_)
    params = [p for m in modules for p in m.parameters()]
    opt = _adamw(params)
    first, last = rank == stages_plan[0].pp_rank, rank == stages_plan[-1].pp_rank
    on_step(None)
    for step in range(steps):
        b = data.batch(step)
        opt.zero_grad(set_to_none=True)
        losses: list = []
        if first:
            sched.step(b[:, :-1], target=b[:, 1:], losses=losses) if last else sched.step(b[:, :-1])
        else:
            sched.step(target=b[:, 1:], losses=losses)
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True) ** 2
        dist.all_reduce(norm)
        torch.nn.utils.clip_grads_with_norm_(params, CLIP, norm.sqrt(), foreach=True)
        opt.step()
        local = torch.stack(losses).mean() if last else torch.zeros(())
        on_step(_global_mean(local, world) * world)  # only the last stage holds the loss


def plain_cp(spec, plan, steps: int, on_step) -> None:
    """Context parallelism: DDP over the cp ranks, each rank holding load-balanced chunks of every sequence.
    Shortcut: the attention core is the runtime's (PyTorch's context parallel does not run on CPU)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autoplan.runtime.parallelize import ContextParallelAttentionCore, load_balanced_positions
    from autoplan.zoo import build_model

    data, mbs = _plain_common(spec, plan)
    world, rank = dist.get_world_size(), dist.get_rank()
    q_pos = load_balanced_positions(SEQ, world, rank)
    model = build_model(spec, seed=SEED)
    model.positions = q_pos
    for block in model.layers.values():
        block.attention.core = ContextParallelAttentionCore(dist.group.WORLD, q_pos)
    ddp = DDP(model, broadcast_buffers=False)  # each rank's causal mask buffer is its own
    _dp_loop(ddp, list(model.parameters()), data, mbs, steps, on_step, world=world, rank=rank, cp_idx=q_pos,
             no_sync=lambda last: contextlib.nullcontext() if last else ddp.no_sync())


def plain_ep(spec, plan, steps: int, on_step) -> None:
    """Expert parallelism carved out of dp: DDP on the dense parameters (experts ignored), each rank's experts
    averaged by hand. Shortcut: the token exchange is the runtime's `_ep_dispatch` (no PyTorch module for it)."""
    import functools

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autoplan.runtime.parallelize import _ep_dispatch
    from autoplan.zoo import build_model
    from autoplan.zoo.model import MoE

    data, mbs = _plain_common(spec, plan)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_model(spec, seed=SEED)
    for block in model.layers.values():
        if isinstance(block.mlp, MoE):
            moe = block.mlp
            n_local = moe.num_experts // world
            for e in list(moe.experts.keys()):
                if not rank * n_local <= int(e) < (rank + 1) * n_local:
                    del moe.experts[e]
            moe.dispatch = functools.partial(_ep_dispatch, moe, dist.group.WORLD)
    expert_names = [n for n, _ in model.named_parameters() if ".experts." in n]
    DDP._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    ddp = DDP(model)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]

    def average_experts():  # the all-to-all backward summed every rank's (local-mean) loss gradient
        import torch

        grads = [p.grad for p in experts if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, world)

    dense = [p for n, p in model.named_parameters() if ".experts." not in n]

    def clip_global():  # the norm of the whole model's gradient: the dense one (the same on every rank) and every
        # rank's own experts summed over ranks; clip_grad_norm_ alone would clip each rank by its own experts'
        # norm and the replicas of the dense weights would drift apart
        import torch
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        dense_sq = get_total_norm([p.grad for p in dense if p.grad is not None]).double() ** 2
        expert_sq = get_total_norm([p.grad for p in experts if p.grad is not None]).double() ** 2
        dist.all_reduce(expert_sq)
        clip_grads_with_norm_(list(model.parameters()), CLIP, torch.sqrt(dense_sq + expert_sq).float(), foreach=True)

    _dp_loop(ddp, list(model.parameters()), data, mbs, steps, on_step, world=world, rank=rank,
             no_sync=lambda last: contextlib.nullcontext() if last else ddp.no_sync(), extra_grad_fix=average_experts,
             clip=clip_global)


def plain_for(plan):
    c = plan.parallel
    if c.pp > 1:
        return plain_pp
    if c.tp > 1:
        return plain_tp
    if c.cp > 1:
        return plain_cp
    if c.ep > 1:
        return plain_ep
    if (c.dp or 1) > 1:
        return plain_ddp if c.zero == 0 else plain_fsdp
    return plain_eager


# ============================================================================================== worker


class _Clock:
    """Per-step wall-clock marks: None = ready to step, then one mark (and loss) per finished step."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.ready = None
        self.marks: list[float] = []
        self.cpu_marks: list[float] = []  # process CPU time (all threads, gloo's included): less load-sensitive
        self.thread_marks: list[float] = []  # the main thread's CPU time: the step's own work, not gloo's threads
        self.losses: list[float] = []
        self.first_step_hint = 0.0  # the runtime's own measure of its first step (no ready mark there)

    def __call__(self, loss) -> None:
        now = time.perf_counter()
        if loss is None:
            self.ready = now
            return
        self.marks.append(now)
        self.cpu_marks.append(time.process_time())
        self.thread_marks.append(time.thread_time())
        self.losses.append(float(loss))

    def summary(self) -> dict:
        ready = self.ready if self.ready is not None else self.marks[0] - self.first_step_hint
        gaps = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
        cpu = [b - a for a, b in zip(self.cpu_marks, self.cpu_marks[1:], strict=False)]
        thread = [b - a for a, b in zip(self.thread_marks, self.thread_marks[1:], strict=False)]
        return {"startup_s": ready - self.t0, "first_step_s": self.marks[0] - ready,
                "step_s": statistics.median(gaps), "cpu_step_s": statistics.median(cpu),
                "thread_step_s": statistics.median(thread), "losses": self.losses}


def run_autoplan(spec, plan, steps: int, workdir: Path) -> dict:
    """The runtime's whole training loop (train.train_loop, as `autoplan run` calls it), with --log on."""
    import torch
    import torch.distributed as dist

    from autoplan.runtime import engine
    from autoplan.runtime.parallel_dims import ParallelDims
    from autoplan.runtime.train import parse_args, train_loop

    path = workdir / f"plan-{plan.short_hash}.json"
    if dist.get_rank() == 0:
        plan.save(path)
    dist.barrier()
    args = parse_args(["--plan", str(path), "--steps", str(steps), "--log", str(workdir / "log.jsonl"), "--quiet",
                       "--lr", str(LR), "--weight-decay", str(WD), "--max-grad-norm", str(CLIP),
                       "--seed", str(SEED)])
    clock = _Clock()
    original = engine.Trainer.step

    def timed_step(self, batch):  # observe each step's end (and its loss); nothing else changes
        res = original(self, batch)
        if not clock.marks:
            clock.first_step_hint = res.step_time_s
        clock(res.loss)
        return res

    engine.Trainer.step = timed_step
    try:
        dims = ParallelDims.from_plan(plan, dist.get_world_size())
        if train_loop(args, plan, dims, torch.device("cpu")) != 0:
            raise RuntimeError("train_loop failed")
    finally:
        engine.Trainer.step = original
    return clock.summary()


def run_plain(spec, plan, steps: int) -> dict:
    clock = _Clock()
    plain_for(plan)(spec, plan, steps, clock)
    return clock.summary()


def _steps_for(args, spec, plan) -> int:
    """Steps per run: --steps, or more where a step is short, so that each run lasts about --min-run-s. A run of
    25 steps of 25 ms is 0.6 s, shorter than the load swings of this shared machine: its per-repetition ratios
    spread by +-15% (session 6, dp zero=0) though the two sides' steps differ by ~1%. The step time comes from a
    short untimed run of the plain script (3 steps); rank 0's count is broadcast so every rank runs as many."""
    import math

    import torch
    import torch.distributed as dist

    if args.min_run_s <= 0:
        return args.steps
    probe = run_plain(spec, plan, 3)["step_s"]
    n = torch.tensor([max(args.steps, math.ceil(args.min_run_s / max(probe, 1e-4)))])
    if dist.get_world_size() > 1:
        dist.broadcast(n, src=0)
    return int(n)


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from autoplan.api import make_plan
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if world > 1:  # one directory for all ranks: rank 0's
            box = [str(workdir)]
            dist.broadcast_object_list(box)
            workdir = Path(box[0])
        warm = False
        for name in args.layouts:
            model, config, nproc = LAYOUTS[name]
            spec = load_model(model).model_copy(update={"dropout": 0.0})
            training = TrainingSpec(global_batch_size=GBS, seq_length=SEQ, dtype="fp32")
            # kernels="torch": the plain scripts run the zoo model's own modules. (The default, "fused", runs the
            # kernels' torch references where Triton is absent, as here: a different model, see the report.)
            plan = make_plan(spec, load_cluster("local-cpu").with_gpus(nproc), training, config, kernels="torch")
            reps = []
            try:
                if not warm and args.warmup:  # the process's first run pays imports and lazy initialisation: untimed, both sides
                    run_autoplan(spec, plan, 2, workdir)
                    run_plain(spec, plan, 2)
                    warm = True
                steps = _steps_for(args, spec, plan)
                for r in range(args.reps):
                    order = ("autoplan", "plain") if r % 2 == 0 else ("plain", "autoplan")
                    rep = {}
                    for side in order:
                        dist.barrier()
                        rep[side] = (run_autoplan(spec, plan, steps, workdir) if side == "autoplan"
                                     else run_plain(spec, plan, steps))
                    reps.append(rep)
                results.append(_summarise(name, plan, reps))
            except Exception as e:  # report and go on with the next layout
                import traceback

                results.append({"layout": name, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()})
            if rank == 0:
                print(json.dumps({k: v for k, v in results[-1].items() if k != "reps"}), file=sys.stderr, flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _summarise(name: str, plan, reps: list[dict]) -> dict:
    ratios = [r["autoplan"]["step_s"] / r["plain"]["step_s"] for r in reps]
    cpu_ratios = [r["autoplan"]["cpu_step_s"] / r["plain"]["cpu_step_s"] for r in reps]
    thread_ratios = [r["autoplan"]["thread_step_s"] / r["plain"]["thread_step_s"] for r in reps]
    loss_err = max(abs(a - b) / abs(b) for r in reps
                   for a, b in zip(r["autoplan"]["losses"], r["plain"]["losses"], strict=True))
    med = {side: {k: statistics.median(r[side][k] for r in reps)
                  for k in ("startup_s", "first_step_s", "step_s", "cpu_step_s")}
           for side in ("autoplan", "plain")}
    return {"layout": name, "parallel": plan.parallel.to_string(), "model": plan.model.name,
            "ratio": statistics.median(ratios), "ratios": ratios, "cpu_ratio": statistics.median(cpu_ratios),
            "cpu_ratios": cpu_ratios, "thread_ratio": statistics.median(thread_ratios), "loss_rel_diff": loss_err,
            "losses_agree": loss_err <= LOSS_RTOL, "autoplan": med["autoplan"], "plain": med["plain"],
            "first_step_ratio": med["autoplan"]["first_step_s"] / med["plain"]["first_step_s"],
            "final_loss": reps[-1]["plain"]["losses"][-1], "steps": len(reps[0]["plain"]["losses"]), "reps": reps}


# ============================================================================================== driver


def launch(names: list[str], nproc: int, args, root: Path) -> list[dict]:
    out = Path(tempfile.mkdtemp()) / "overhead.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), str(Path(__file__).resolve()),
           "--worker", "--out", str(out), "--reps", str(args.reps), "--steps", str(args.steps),
           "--min-run-s", str(args.min_run_s),
           *([] if args.warmup else ["--no-warmup"]), "--layouts", *names]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    if not out.exists():
        return [{"layout": n, "error": f"launch failed (rc {proc.returncode}): {proc.stderr[-2000:]}"}
                for n in names]
    return json.loads(out.read_text())


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="autoplan runtime vs plain PyTorch (median step; ratio = median of per-repetition ratios)")
    for col in ("layout", "model", "steps", "autoplan ms", "plain ms", "ratio", "per rep", "CPU ratio", "main thread",
                "startup ms A/B",
                "first step ms A/B", "loss diff"):
        t.add_column(col, justify="left" if col in ("layout", "model") else "right")
    for r in results:
        if "error" in r:
            t.add_row(r["layout"], "", "", "", "", "FAILED", r["error"][:60], "", "", "", "", "")
            continue
        a, b = r["autoplan"], r["plain"]
        t.add_row(r["layout"], r["model"], str(r["steps"]), f"{a['step_s'] * 1e3:.1f}", f"{b['step_s'] * 1e3:.1f}",
                  f"{r['ratio']:.2f}x", " ".join(f"{x:.2f}" for x in r["ratios"]), f"{r['cpu_ratio']:.2f}x", f"{r['thread_ratio']:.2f}x",
                  f"{a['startup_s'] * 1e3:.0f}/{b['startup_s'] * 1e3:.0f}",
                  f"{a['first_step_s'] * 1e3:.0f}/{b['first_step_s'] * 1e3:.0f}",
                  f"{r['loss_rel_diff']:.1e}" + ("" if r["losses_agree"] else " DIFFER"))
    Console(width=160).print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions per layout (>= 3 for a median)")
    ap.add_argument("--steps", type=int, default=10, help="steps per run (the first is reported apart)")
    ap.add_argument("--min-run-s", type=float, default=0.0,
                    help="lengthen short runs to about this many seconds each (more steps; 0: --steps exactly)")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--root", default=str(ROOT), help="import autoplan from this tree (e.g. an export of main)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", metavar="FILE", help="also write every result (per repetition) as JSON")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the untimed first run of each side (tests: only the losses matter)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # a torchrun worker leaves without the interpreter's finalisation (see exit_process)
        from autoplan.runtime.train import exit_process

        exit_process(worker(args))
    root = Path(args.root).resolve()
    results = []
    # One launch per layout: fresh processes, so no layout is timed in a process that earlier layouts left with
    # their process groups, DDP reducers and allocator state (as `autoplan run` runs one layout per process).
    # Sharing one launch made later layouts' steps several times slower on both sides and their ratios noise.
    for i, name in enumerate(args.layouts):
        print(f"[{i + 1}/{len(args.layouts)}] {name}", file=sys.stderr, flush=True)
        results += launch([name], LAYOUTS[name][2], args, root)
    order = {n: i for i, n in enumerate(args.layouts)}
    results.sort(key=lambda r: order[r["layout"]])
    if args.json:
        for r in results:
            print(json.dumps({k: v for k, v in r.items() if k != "reps"}))
    else:
        print_table(results)
    ok = [r for r in results if "error" not in r]
    if not ok:
        print("overhead: no layout ran")
        return 1
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=1))
    worst = max(ok, key=lambda r: r["ratio"])
    worst_cpu = max(ok, key=lambda r: r["cpu_ratio"])
    worst_thread = max(ok, key=lambda r: r["thread_ratio"])
    failed = len(results) - len(ok)
    slow_first = [r["layout"] for r in ok if r["first_step_ratio"] > 2.0]
    print(f"first step > 2x the plain script's: {', '.join(slow_first) or 'none'}")
    print(f"CPU time: worst {worst_cpu['cpu_ratio']:.2f}× ({worst_cpu['layout']}); main thread only: worst "
          f"{worst_thread['thread_ratio']:.2f}× ({worst_thread['layout']})")
    print(f"overhead: worst {worst['ratio']:.2f}× ({worst['layout']}) over {len(ok)} layouts"
          + (f", {failed} failed" if failed else ""))
    return 0 if not failed and all(r["losses_agree"] for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
