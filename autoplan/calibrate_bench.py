"""Micro-benchmarks for `autoplan calibrate --bench-out FILE`: the primitives the cost model is built from,
measured where the model will run, as rows for `autoplan.cost_models.fit` (GemmSample, CollectiveSample,
RegionSample).

- GEMMs at the model's own shapes: every GEMM of a transformer block, embedding and head, for one micro-batch of
  `--seq-len` tokens, unsharded and sharded as tensor parallelism of each degree up to the node's size would
  shard it (column-parallel N/tp, row-parallel K/tp).
- The host time of one checkpointed region (torch.utils.checkpoint, as the runtime's recompute uses it), the
  host time DTensor adds per operator of a tensor-parallel step, and the host time the pipeline schedule
  (torch.distributed.pipelining) adds per action.
- Collectives at several sizes on each level of the hierarchy: all-reduce, all-gather, reduce-scatter,
  all-to-all among the processes of one node ("intra"), and among one process per node ("inter") when the
  benchmark runs on several nodes under torchrun; send/recv between two processes of a node, and between two
  nodes. Each is timed as the median of several repeats after a warm-up, between barriers.

Single node: processes are started here (torch.multiprocessing, gloo on CPU or NCCL on GPUs). Several nodes: run
the same command on every node under torchrun (see docs/calibrate.md); rank 0 writes the file.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

CPU_SIZES = (4 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)
GPU_SIZES = (64 * 1024, 1024 * 1024, 16 * 1024 * 1024, 256 * 1024 * 1024)
_REPEATS = 7


def model_gemm_shapes(model_ref: str, seq: int, mbs: int, max_tp: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of the model's GEMMs for one micro-batch, at each tensor-parallel degree that divides them."""
    from autoplan.cost_models.profile import profile_from_spec
    from autoplan.workload import resolve_model

    model, profiles = resolve_model(model_ref)
    profiles = profiles or profile_from_spec(model)
    shapes: set[tuple[int, int, int]] = set()
    tps = [t for t in (1, 2, 4, 8) if t <= max(1, max_tp)]
    for p in profiles:
        for g in p.gemms:
            rows = int(mbs * seq * g.tokens_per_token)
            if rows <= 0:
                continue
            for t in tps:
                n, k = g.n, g.k
                if g.tp in ("col", "vocab"):
                    if n % t:
                        continue
                    n //= t
                elif g.tp == "row":
                    if k % t:
                        continue
                    k //= t
                elif t > 1:
                    continue
                shapes.add((rows, int(n), int(k)))
    return sorted(shapes)


def calls_per_sync(device: str) -> int:
    """Calls a timing makes back to back before it synchronises: on a GPU 10, as a training step makes them, so
    the ~20 us of a launch plus a synchronisation (session 12, H200) stays out of each call's time; on the CPU,
    which runs each call as it is made, 1."""
    return 1 if device == "cpu" else 10


def bench_gemms(shapes, device: str, dtype_name: str) -> list[dict]:
    """Each shape's median time over a few calls, with `call_s`: the median time of a 1x1x1 GEMM in the same
    loop, i.e. what the loop itself costs per call (Python, dispatcher, launch, synchronisation). The fit adds it
    to the roofline of each shape rather than reading it as the host time per operator of a training step,
    which also pays autograd, module calls and hooks (GPUCalibration.kernel_launch_us)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    batch = calls_per_sync(device)

    def median_call(a, b) -> float:
        torch.mm(a, b)
        sync()
        times = []
        for _ in range(_REPEATS):
            t0 = time.perf_counter()
            for _ in range(batch):
                torch.mm(a, b)
            sync()
            times.append((time.perf_counter() - t0) / batch)
        return statistics.median(times)

    one = torch.ones(1, 1, device=device, dtype=dtype)
    call_s = median_call(one, one)
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append({"m": m, "n": n, "k": k, "dtype": dtype_name, "seconds": median_call(a, b), "call_s": call_s})
    return out


def bench_recompute_region(device: str, repeats: int = 41, seq: int = 16, autocast=None) -> list[dict]:
    """What one checkpointed region costs the host beyond re-running its operators (GPUCalibration.
    recompute_region_us per region, recompute_op_us per operator in it), measured on the runtime's own regions:
    the attention core (selective recompute) and a whole block (full recompute) of tiny-gpt at `seq` tokens, so
    that their device time is negligible. Each is wrapped as runtime.parallelize.apply_recompute wraps it
    (checkpoint_wrapper, non-reentrant, preserve_rng_state=True); one row per region: its forward+backward
    minus the unwrapped one's minus one more forward (the recompute), medians over `repeats`, the two
    alternating so that a shared host's drifts hit both. `ops` is the region's operator count as the cost model
    counts it (cost_models.compute: the core's kernels; a block's kernels_fwd). One process (as the GEMMs: the
    fit rescales to a run's share of the cores). Torch's checkpoint runs a saved-tensor hook per tensor each
    operator saves, in the forward and again in the recompute, hence a cost per operator besides the fixed one
    (session 9, local-cpu: about 220 us per region and 40 us per operator). Under torch.autocast to `autocast`
    (a torch dtype) when given, as the runtime trains 16-bit: the recompute re-runs the casts and copies too
    (session 20: a bf16 step on an H200 issued ~10 more operators per checkpointed core than without
    checkpointing, `docs/notes/session-20`; this machine's CPU: a block's region +25% under bf16 autocast)."""
    import contextlib
    import copy

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from autoplan.cost_models.compute import _core_kernels
    from autoplan.cost_models.profile import profile_from_spec
    from autoplan.specs import load_model
    from autoplan.zoo.model import Block

    spec = load_model("tiny-gpt")
    block_profile = profile_from_spec(spec)[1]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    block = Block(spec, 0).to(device).train()
    h, n, kv, dh = spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.dhead
    x = torch.randn(1, seq, h, device=device, requires_grad=True)
    qkv = [torch.randn(1, seq, heads, dh, device=device, requires_grad=True) for heads in (n, kv, kv)]
    cases = [(block.attention.core, lambda m: m(*qkv), _core_kernels(block_profile)),
             (block, lambda m: m(x), block_profile.kernels_fwd)]
    rows = []
    for plain, call, ops in cases:
        wrapped = checkpoint_wrapper(copy.deepcopy(plain), preserve_rng_state=True)

        def step(m, backward=True, call=call):
            t0 = time.perf_counter()
            with torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext():
                y = call(m).float()
            if backward:
                y.sum().backward()
            sync()
            return time.perf_counter() - t0

        for _ in range(5):
            step(plain)
            step(wrapped)
        t_plain, t_ckpt, t_fwd = [], [], []
        for _ in range(repeats):
            t_plain.append(step(plain))
            t_ckpt.append(step(wrapped))
            t_fwd.append(step(plain, backward=False))
        med = statistics.median
        rows.append({"ops": int(ops), "seconds": max(med(t_ckpt) - med(t_plain) - med(t_fwd), 1e-7),
                     "processes": 1})
    return rows


def bench_fused_calls(device: str, calls: int = 50, repeats: int = 7, tokens: int = 64, hidden: int = 256) -> dict:
    """Host time one call of autoplan's fused modules adds in the forward over the eager op it replaces
    (GPUCalibration.fused_call_us): LayerNorm, RMSNorm, GeLU (tanh) and SwiGLU, the runtime's substitutions
    (codegen.fuse), each as the Triton module and as torch's op at `tokens` x `hidden` (kernels too short to
    matter, inputs requiring grad as in training), `calls` forwards queued back to back and then synchronised,
    medians over `repeats`, the two alternating. Returns {"ops": {name: [fused_us, torch_us]}, "fused_call_us":
    the mean of fused - torch}. Meaningful on a GPU (session 12 measured 64-124 us more per call on an H200's
    host at a training shape, benchmarks/gpu/launch_overhead.py); under TRITON_INTERPRET it times the
    interpreter."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from autoplan.kernels.modules import FusedGELU, FusedLayerNorm, FusedRMSNorm, FusedSwiGLU

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    up = torch.randn(tokens, hidden, device=device, requires_grad=True)
    ln, rms = nn.LayerNorm(hidden).to(device), nn.RMSNorm(hidden).to(device)
    pairs = {
        "layer_norm": (lambda m=FusedLayerNorm.from_torch(ln, impl="triton"): m(x), lambda: ln(x)),
        "rms_norm": (lambda m=FusedRMSNorm.from_torch(rms, impl="triton"): m(x), lambda: rms(x)),
        "gelu": (lambda m=FusedGELU("tanh", impl="triton"): m(x), lambda: F.gelu(x, approximate="tanh")),
        "swiglu": (lambda m=FusedSwiGLU(impl="triton"): m(x, up), lambda: F.silu(x) * up),
    }

    def per_call(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - t0) / calls

    ops = {}
    for name, (fused, eager) in pairs.items():
        for _ in range(2):  # compile and warm both
            per_call(fused), per_call(eager)
        tf, te = [], []
        for _ in range(repeats):
            tf.append(per_call(fused))
            te.append(per_call(eager))
        ops[name] = [statistics.median(tf) * 1e6, statistics.median(te) * 1e6]
    extra = statistics.mean(f - e for f, e in ops.values())
    return {"ops": ops, "fused_call_us": max(extra, 0.0)}


def bench_tp_ops(device: str, repeats: int = 31) -> dict:
    """The host time DTensor adds per operator of a tensor-parallel step (GPUCalibration.tp_op_overhead_us):
    tiny-gpt at one token (device time ~0), its forward and backward with the runtime's tensor-parallel layout
    (runtime.parallelize.apply_tp on a one-process mesh, the loss under loss_parallel) against the same model
    unsharded, the two alternating, medians over `repeats`; the difference over 3 x the model's operators, the
    units the cost model charges it in (compute.layer_cost: once per forward operator, twice in backward). On a
    one-process mesh no collective runs: what is left is DTensor's sharding propagation and dispatch, which a
    mesh of any size pays per operator (the collectives themselves are priced as communication). Run in a
    process of its own, with its own one-process group, so that it works beside any process group of the caller
    (torchrun). Returns {"ops", "seconds" (the step's extra time), "processes": 1}; about 60 us per operator on
    this machine's CPU (session 15), against ~6 for the plain operator. Also the optimizer step's extra host time
    over the same parameters as DTensors (GPUCalibration.dtensor_param_us): {"optimizer_tensors",
    "optimizer_seconds"}."""
    return spawn_for_json(_tp_ops_worker, 1, device, repeats)


def spawn_for_json(worker, nprocs: int, *args) -> dict:
    """Run `worker(rank, port, out, *args)` in `nprocs` processes of its own (torch.multiprocessing, a free local
    port for their process group, so that it works beside any group of the caller) and return the JSON its rank 0
    wrote to the file `out`."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.spawn(worker, args=(port, out, *args), nprocs=nprocs, join=True)
        return json.loads(Path(out).read_text())
    finally:
        Path(out).unlink(missing_ok=True)


def _tp_ops_worker(rank: int, port: int, out: str, device: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from autoplan.cost_models.profile import profile_from_spec
    from autoplan.runtime.parallelize import apply_tp
    from autoplan.specs import load_model
    from autoplan.zoo.model import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":  # under torchrun, each rank's own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        spec = load_model("tiny-gpt")
        ops = 3 * sum(p.kernels_fwd for p in profile_from_spec(spec))
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        plain = build_model(spec).to(device)
        sharded = build_model(spec).to(device)
        apply_tp(sharded, init_device_mesh(device, (1,), mesh_dim_names=("tp",)), sp=False)
        x = torch.randint(0, spec.vocab_size, (1, 1), device=device)

        def step(m) -> float:
            t0 = time.perf_counter()
            with loss_parallel():
                F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
            sync()
            return time.perf_counter() - t0

        for _ in range(5):
            step(plain)
            step(sharded)
        t_plain, t_tp = [], []
        for _ in range(repeats):
            t_plain.append(step(plain))
            t_tp.append(step(sharded))
        extra = max(statistics.median(t_tp) - statistics.median(t_plain), 1e-7)
        # the optimizer step over the same parameters plain and as DTensors: every parameter FSDP2-sharded on a
        # one-process mesh (what ZeRO >= 1 steps; tensor parallelism alone leaves the norms plain), the runtime's
        # AdamW (fused where torch has the kernel) with its groups, alternating, medians
        from torch.distributed.fsdp import fully_shard

        from autoplan.runtime.engine import make_adamw, optimizer_groups

        dmodel = build_model(spec).to(device)
        fully_shard(dmodel, mesh=init_device_mesh(device, (1,), mesh_dim_names=("dp",)))
        F.cross_entropy(dmodel(x).flatten(0, 1), x.flatten()).backward()
        opts = [make_adamw(optimizer_groups(m.parameters()), torch.device(device), lr=1e-12) for m in (plain, dmodel)]

        def opt_step(o) -> float:
            t0 = time.perf_counter()
            o.step()
            sync()
            return time.perf_counter() - t0

        for _ in range(3):
            opt_step(opts[0])
            opt_step(opts[1])
        t_opt: tuple[list[float], list[float]] = ([], [])
        for _ in range(repeats):
            for o, ts in zip(opts, t_opt, strict=True):
                ts.append(opt_step(o))
        tensors = len(list(plain.parameters()))
        opt_extra = max(statistics.median(t_opt[1]) - statistics.median(t_opt[0]), 1e-9)
        Path(out).write_text(json.dumps({"ops": int(ops), "seconds": extra, "processes": 1,
                                         "optimizer_tensors": tensors, "optimizer_seconds": opt_extra}))
    finally:
        dist.destroy_process_group()
    leave_spawned()


def bench_pipeline_actions(microbatches: int = 8, repeats: int = 41, hidden: int = 16) -> dict:
    """The host time torch.distributed.pipelining's schedule adds per action, one stage's forward or backward of
    one micro-batch (GPUCalibration.pipeline_action_us): two processes, one stage each (a `hidden`-wide Linear,
    device time ~0), the runtime's 1F1B schedule over `microbatches` micro-batches, against the same module's
    forward and backward run `microbatches` times in a plain loop; the difference in the main thread's CPU time
    (time.thread_time: the schedule's Python and the posting of its receives and sends, not gloo's transfer
    threads nor the waits for the peer) over the 2 x `microbatches` actions, the median over `repeats` steps,
    the mean of the two ranks. gloo on CPU tensors on any host: it is the schedule's host time, which a GPU host
    pays the same way, and the two processes may then share one GPU-less pair of cores. Returns {"actions",
    "seconds" (per step, beyond the plain loop), "processes": 2}; ~90-100 us per action on this machine's CPU
    (session 19)."""
    return spawn_for_json(_pipeline_actions_worker, 2, microbatches, repeats, hidden)


def pipeline_action_row() -> dict:
    """`bench_pipeline_actions` as a fit row (cost_models.fit.HostOpSample, `"host_op"` in a bench file): seconds
    per action, its processes, the knob it measures."""
    r = bench_pipeline_actions()
    return {"seconds": r["seconds"] / r["actions"], "processes": r["processes"], "knob": "pipeline_action_us"}


def _pipeline_actions_worker(rank: int, port: int, out: str, m: int, repeats: int, hidden: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)
        module = torch.nn.Linear(hidden, hidden)
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        schedule = Schedule1F1B(stage, m, loss_fn=lambda out, target: out.sum())
        x, target = torch.randn(m, hidden), torch.zeros(m, hidden)

        def step() -> float:
            dist.barrier()
            t0 = time.thread_time()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=target)
            return time.thread_time() - t0

        def plain() -> float:
            t0 = time.thread_time()
            for k in range(m):
                module(x[k:k + 1].requires_grad_(rank > 0)).sum().backward()
            return time.thread_time() - t0

        for _ in range(5):
            step()
            plain()
        t_step, t_plain = [], []
        for _ in range(repeats):
            t_step.append(step())
            t_plain.append(plain())
        extra = max(statistics.median(t_step) - statistics.median(t_plain), 0.0)
        both: list = [None, None]
        dist.all_gather_object(both, extra)
        if rank == 0:
            Path(out).write_text(json.dumps({"actions": 2 * m, "seconds": sum(both) / 2, "processes": 2}))
    finally:
        dist.destroy_process_group()
    leave_spawned()


def leave_spawned() -> None:
    """End a process mp.spawn started, once its work has succeeded, without the interpreter's finalisation. A
    spawned child finalises like a script, and there gloo's worker thread can abort a process whose collectives all
    finished ("terminate called without an active exception", see `autoplan.runtime.train.exit_process`): mp.spawn
    would report the finished benchmark as failed and `autoplan calibrate` would stop. A failure still raises
    before this, so mp.spawn shows its traceback."""
    from autoplan.runtime.train import exit_process

    exit_process(0)


def _timed(fn, sync, barrier) -> float:
    fn()
    sync()
    times = []
    for _ in range(_REPEATS):
        barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _reduce_scatter(out, inp, group):
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, inp, group=group)


def _bench_group(group, ranks: int, level: str, ppn: int, sizes, device: str) -> list[dict]:
    """All-reduce, all-gather, reduce-scatter and all-to-all over `group` at each size (fp32 buffers)."""
    import torch
    import torch.distributed as dist

    from autoplan.runtime.parallelize import all_gather_single

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    barrier = lambda: dist.barrier(group=group)  # noqa: E731
    rows = []
    for nbytes in sizes:
        numel = max(ranks, nbytes // 4 // ranks * ranks)
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // ranks, device=device)
        out = torch.empty_like(full)
        ops = {
            "all_reduce": lambda f=full: dist.all_reduce(f, group=group),
            "all_gather": lambda f=full, s=shard: all_gather_single(f, s, group=group),
            "reduce_scatter": lambda f=full, s=shard: _reduce_scatter(s, f, group=group),
            "all_to_all": lambda f=full, o=out: dist.all_to_all_single(o, f, group=group),
        }
        for name, fn in ops.items():
            t = _timed(fn, sync, barrier)
            rows.append({"collective": name, "level": level, "ranks": ranks, "processes_per_node": ppn,
                         "nbytes": float(numel * 4), "seconds": t})
    return rows


def _bench_p2p(peer_a: int, peer_b: int, rank: int, level: str, ppn: int, sizes, device: str) -> list[dict]:
    """One-way send/recv time between two ranks: half a ping-pong."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, device=device)
        times = []
        for i in range(_REPEATS + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == peer_a:
                dist.send(buf, peer_b)
                dist.recv(buf, peer_b)
            elif rank == peer_b:
                dist.recv(buf, peer_a)
                dist.send(buf, peer_a)
            sync()
            if i:
                times.append((time.perf_counter() - t0) / 2)
        if rank == peer_a:
            rows.append({"collective": "send_recv", "level": level, "ranks": 2, "processes_per_node": ppn,
                         "nbytes": float(nbytes), "seconds": statistics.median(times)})
    return rows


def bench_collectives(rank: int, world: int, local_world: int, device: str, sizes=None) -> list[dict]:
    """Every process calls this; returns the rows (complete on rank 0)."""
    import torch.distributed as dist

    sizes = sizes or (GPU_SIZES if device == "cuda" else CPU_SIZES)
    nodes = world // local_world
    node, local = divmod(rank, local_world)
    rows: list[dict] = []
    # intra: the processes of each node (every node measures; rank 0 reports node 0's)
    intra_groups = [dist.new_group(list(range(n * local_world, (n + 1) * local_world))) for n in range(nodes)]
    if local_world > 1:
        r = _bench_group(intra_groups[node], local_world, "intra", local_world, sizes, device)
        if node == 0:
            rows += r
    dist.barrier()
    # inter: one process per node (the local rank 0s)
    leaders = [n * local_world for n in range(nodes)]
    inter = dist.new_group(leaders)
    if nodes > 1 and local == 0:
        rows += _bench_group(inter, nodes, "inter", local_world, sizes, device)
    dist.barrier()
    if local_world > 1:
        rows += _bench_p2p(0, 1, rank, "intra", local_world, sizes, device)
    if nodes > 1:
        rows += _bench_p2p(0, local_world, rank, "inter", local_world, sizes, device)
    return rows


def _spawned(rank: int, world: int, port: int, out: str, device: str, sizes) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        import torch

        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    rows = bench_collectives(rank, world, world, device, sizes)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    leave_spawned()


def run_collectives(nproc: int, device: str, sizes: tuple[int, ...] | None = None) -> list[dict]:
    """Collective rows: under torchrun (RANK in the environment) on the launched processes, else `nproc`
    processes started here on this node."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch
        import torch.distributed as dist

        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        return bench_collectives(dist.get_rank(), dist.get_world_size(), local, device, sizes)
    if nproc < 2:
        return []
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(_spawned, args=(nproc, port, out, device, sizes), nprocs=nproc, join=True)
        return json.loads(Path(out).read_text())
