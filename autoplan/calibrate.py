"""`autoplan calibrate -o cluster.yaml`: measure this machine and write a cluster spec for it.

With `--bench-out FILE` it also runs micro-benchmarks (`autoplan.calibrate_bench`: GEMMs at the model's shapes,
collectives per level and size), fits the primitives' constants to them (`autoplan.cost_models.fit`) and writes the
rows to FILE for `autoplan tune --bench FILE`; see docs/calibrate.md for a multi-node GPU cluster.

It measures what the cost model needs, on whatever device torch sees (CUDA if present, else the CPU):
matmul throughput at several sizes (giving the peak and the GEMM half-efficiency size), the causal flash
attention's rate against it, memory bandwidth (a large copy), the host time per eager op (on a CPU, per operator of a training step's forward and backward) and
what DTensor adds to it per operator of a tensor-parallel layer,
and the all-reduce bandwidth and latency between `--nproc` processes on the default backend (gloo on CPU, NCCL on
GPUs). On a CPU it measures with one thread, as each of the runtime's processes computes, and the spec is each
process's share when they outnumber the cores (`per_process`), with the cores
recorded. The result loads with `--cluster cluster.yaml`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

_SIZES = (128, 256, 512, 1024)
# On a GPU: from where a GEMM is still launch-bound to where it saturates (an H200 reaches 718 TFLOP/s at 4096^3
# and 767 at 8192^3 in bf16, session 12)
_GPU_SIZES = (1024, 2048, 4096, 8192)
# A fitted large-GEMM rate above the best one measured by more than this is a fit gone wrong, not a faster GPU
# (timing noise between the square GEMMs is a few percent)
_PEAK_SLACK = 1.15


def _timeit(fn, repeat: int = 5, sync=lambda: None, batch: int = 1) -> float:
    """Best time of one call of `fn` over `repeat` timings of `batch` calls each, one synchronisation per timing.
    On a GPU a batch keeps the synchronisation's and the launch's latency (~20 us on an H200) out of the kernel
    time: timed one call at a time, a 1024^3 GEMM measured 23 us for 5 of work, the small sizes read as
    inefficiency and the half-efficiency size came out at 7,169 (session 12, H200)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / batch)
    return best


def half_efficiency_dim(rates: dict[int, float], peak: float) -> float:
    """The size at half efficiency in eff(n) = n / (n + half) (cost_models.compute.gemm_efficiency), from every
    size below the peak's: the median of n (1 - r) / r, r = rate / peak. One size alone (the smallest, as
    before) made the whole curve hang on its timing error."""
    import statistics

    halves = [n * (1 - r) / r for n, rate in rates.items() if (r := min(0.999, rate / peak)) < 0.999]
    return max(0.0, statistics.median(halves)) if halves else 0.0


def measure_compute(device: str, dtype_name: str, attn_shape: tuple[int, int, int] | None = None) -> dict:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    from .calibrate_bench import calls_per_sync

    batch = calls_per_sync(device)
    rates = {}
    for n in _SIZES if device == "cpu" else _GPU_SIZES:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = _timeit(lambda a=a, b=b: torch.mm(a, b), sync=sync, batch=batch)
        rates[n] = 2 * n**3 / t
    peak = max(rates.values())
    half = half_efficiency_dim(rates, peak)
    x = torch.empty(64 * 1024 * 1024 // 4, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    t = _timeit(lambda: y.copy_(x), sync=sync)
    bw = 2 * x.numel() * 4 / t
    tiny = torch.ones(8, device=device)
    t_op = _timeit(lambda: [tiny.add_(1) for _ in range(200)], sync=sync) / 200
    return {"peak_flops": peak, "half_dim": half, "mem_bw": bw, "op_us": t_op * 1e6, "rates": rates,
            "train_op_us": training_op_us(device, sync, training_autocast(dtype_name)) * 1e6,
            "attention_efficiency": attention_efficiency(device, dtype, peak, sync, batch, attn_shape)}


# The attention core timed by `attention_efficiency`: (heads, sequence, head dim) of one sequence. On a GPU a
# GPT-3-sized head at 4096 tokens (the flash kernel's rate is near its plateau there); on a CPU a smaller one, so
# that the timing stays around a tenth of a second (the rate per score varies little with the size there: session
# 24, fp32, 2 cores: 1 x 4 x 2048 x 32 causal forward + backward 43 ms).
_ATTN_SHAPE = {"cuda": (16, 4096, 128), "cpu": (8, 1024, 64)}


def attention_efficiency(device: str, dtype, peak: float, sync=lambda: None, batch: int = 1,
                         shape: tuple[int, int, int] | None = None) -> float:
    """The fused attention core's rate as a fraction of `peak` (the best GEMM rate), in the cost model's units
    (compute._attention: a causal flash kernel executes half of the model FLOPs 4 s^2 h d, its backward 2.5 x its
    forward): SDPA's causal forward and backward on one sequence of `shape` (heads, seq, head_dim). Until session
    24 calibrate wrote 0.5 without measuring; on this 2-core CPU that priced a 2048-token model's step at 0.063 s
    where it ran in 0.17 s (the attention is most of it there)."""
    import torch
    import torch.nn.functional as F

    heads, seq, dim = shape or _ATTN_SHAPE["cuda" if device == "cuda" else "cpu"]
    q, k, v = (torch.randn(1, heads, seq, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, seq, dim, device=device, dtype=dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    from .cost_models.compute import ATTN_BWD_FACTOR

    t = _timeit(step, repeat=3, sync=sync, batch=batch)
    executed = 4.0 * seq * seq * heads * dim * 0.5 * (1 + ATTN_BWD_FACTOR)  # the causal half, forward + backward
    # (a core faster than the best GEMM would be a timing error, not a faster kernel: capped at the peak)
    return round(min(1.0, executed / t / peak), 4)


def training_autocast(dtype_name: str):
    """The torch dtype the runtime's autocast runs a `dtype_name` training in (16-bit trains under autocast over
    fp32 parameters), or None for fp32: what the host-time benchmarks must run under to time what it runs."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype_name)


def training_op_us(device: str, sync=lambda: None, autocast=None) -> float:
    """Host seconds per operator as a training step pays it, in the cost model's units: the built-in tiny-gpt's
    forward and backward at one token (device time ~0, so what is left is Python, autograd and dispatch) over
    3 x its profiled operators (the model charges `kernel_launch_us` once per forward operator and twice in
    backward: compute.py), under torch.autocast to `autocast` when given (fp32 parameters, as the runtime runs
    16-bit training: its casts are host time too). About 6 us on this machine's CPU in fp32 (session 14; session
    10's median read 9.5), where a bare op costs ~2 (docs/notes/session-10/host_ops.py, whose measurement this
    is)."""
    import contextlib

    import torch

    from .cost_models.profile import profile_from_spec
    from .specs import load_model
    from .zoo.model import build_model

    spec = load_model("tiny-gpt")
    model = build_model(spec).to(device)
    ops = 3 * sum(p.kernels_fwd for p in profile_from_spec(spec))
    x = torch.randint(0, spec.vocab_size, (1, 1), device=device)

    def step():
        region = torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with region:
            loss = model(x).float().sum()
        loss.backward()

    return _timeit(step, repeat=20, sync=sync) / ops


def per_process(spec: dict, nproc: int, cores: int) -> dict:
    """A CPU cluster spec in the cost model's units when `nproc` processes share `cores` cores: every rate measured
    by one process alone (FLOP/s, bytes/s) is what each of them gets while all compute at once, cores / nproc of it,
    and every host time grows by the inverse (the convention of the local-cpu preset, which prices every layout's
    compute so: session 18 found the runtime's pipelines no faster per unit of work when their stages take turns,
    `estimate.crowded_for`); and the cores are recorded, which turns on the oversubscription terms. Unchanged with
    a core per process."""
    out = {**spec, "cores_per_node": cores}
    share = min(1.0, cores / nproc)
    if share >= 1.0:
        return out
    gpu = dict(spec["gpu"])
    gpu["peak_tflops"] = {k: round(v * share, 5) for k, v in gpu["peak_tflops"].items()}
    gpu["hbm_gbps"] = round(gpu["hbm_gbps"] * share, 2)
    cal = dict(gpu["calibration"])
    for k in ("kernel_launch_us", "tp_op_overhead_us", "dtensor_param_us", "pipeline_action_us"):
        if k in cal:
            cal[k] = round(cal[k] / share, 2)
    gpu["calibration"] = cal
    out["gpu"] = gpu
    return out


def _allreduce_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {}
    for nbytes in (4 * 1024, 16 * 1024 * 1024):
        t = torch.ones(nbytes // 4)
        dist.all_reduce(t)
        dist.barrier()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            best = min(best, time.perf_counter() - t0)
        res[nbytes] = best
    if rank == 0:
        Path(out).write_text(yaml.safe_dump({int(k): float(v) for k, v in res.items()}))
    dist.destroy_process_group()
    from .calibrate_bench import leave_spawned

    leave_spawned()


def measure_allreduce(nproc: int) -> tuple[float, float]:
    """(bus bandwidth GB/s, latency us) of a ring all-reduce among `nproc` local processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".yaml")
    mp.spawn(_allreduce_worker, args=(nproc, port, out), nprocs=nproc, join=True)
    res = yaml.safe_load(Path(out).read_text())
    small, large = res[4 * 1024], res[16 * 1024 * 1024]
    n = nproc
    hops = 2 * (n - 1)
    latency = small / hops
    bus = 2 * (n - 1) / n * 16 * 1024 * 1024 / max(large - hops * latency, 1e-9)
    return bus / 1e9, latency * 1e6


def model_attention_shape(model: str, seq_len: int, device: str) -> tuple[int, int, int]:
    """(heads, sequence, head dim) of `model`'s attention core for `attention_efficiency`, whose rate depends on
    the shape (the kernel's tiles, the sequence's length against them). On a CPU the sequence is capped at 2048 to
    keep the timing to a second or so."""
    from .specs import load_model

    spec = load_model(model)
    seq = min(seq_len, 2048) if device == "cpu" else seq_len
    return spec.num_attention_heads, seq, spec.dhead


def calibrate(nproc: int, dtype: str = "fp32", attn_model: str | None = None, seq_len: int = 2048) -> dict:
    """The cluster spec of this machine; with `attn_model` the attention is timed at that model's shape."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = model_attention_shape(attn_model, seq_len, device) if attn_model else None
    c = measure_compute(device, dtype, shape)
    from .calibrate_bench import bench_fused_calls, bench_tp_ops, pipeline_action_row

    tp_ops = bench_tp_ops(device)
    # the pipeline schedule's host time per action: priced only where the host is the critical path (CPU
    # processes: estimate.pipeline_action_time)
    action_s = pipeline_action_row()["seconds"] if device == "cpu" else 0.0
    # the fused modules' host time per call: only where the runtime substitutes them (a GPU; codegen.fuse)
    fused = bench_fused_calls(device) if device == "cuda" else {"fused_call_us": 0.0}
    bus, lat = measure_allreduce(nproc) if nproc > 1 else (100.0, 1.0)
    if device == "cpu":
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3 / nproc
        gpu_name = "cpu"
    else:
        mem_gib = torch.cuda.get_device_properties(0).total_memory / 1024**3
        gpu_name = torch.cuda.get_device_name(0)
    peak_tf = c["peak_flops"] / 1e12
    spec = {
        "name": f"calibrated-{gpu_name.replace(' ', '-').lower()}",
        "gpu": {
            "name": gpu_name,
            "peak_tflops": {dtype: round(peak_tf, 5)},
            "hbm_gib": round(mem_gib, 2),
            "hbm_gbps": round(c["mem_bw"] / 1e9, 2),
            "calibration": {
                "matmul_max_efficiency": 1.0,  # the measured peak is the best achieved rate
                "matmul_half_dim": round(c["half_dim"], 1),
                # the causal flash attention's rate over the best GEMM's (`attention_efficiency`)
                "attention_efficiency": c["attention_efficiency"],
                "memory_efficiency": 1.0,  # the measured bandwidth is achieved bandwidth
                # the host time per operator of a training step, on a GPU too: the host launches ahead of the
                # kernels, and the cost model takes the longer of the two per layer (compute.layer_cost), so
                # what it needs is the host's own time per operator, not the bare launch (session 17: the
                # runtime's forward on an H200 is bound by its host at GPT-1.3B's size)
                "kernel_launch_us": round(c["train_op_us"], 2),
                # DTensor's sharding propagation and dispatch per operator of a tensor-parallel layer (the
                # runtime's tp layout on a one-process mesh, against the plain model: calibrate_bench)
                "tp_op_overhead_us": round(tp_ops["seconds"] / tp_ops["ops"] * 1e6, 2),
                # and the optimizer step's per parameter tensor over DTensors (the same model's AdamW step)
                "dtensor_param_us": round(tp_ops["optimizer_seconds"] / tp_ops["optimizer_tensors"] * 1e6, 2),
                # the pipeline schedule's host time per action, two processes (calibrate_bench.bench_pipeline_actions)
                "pipeline_action_us": round(action_s * 1e6, 2),
                # a fused Triton module's forward call beyond torch's op (calibrate_bench.bench_fused_calls)
                "fused_call_us": round(fused["fused_call_us"], 2),
                "framework_overhead_gib": 0.3 if device == "cpu" else 2.0,
            },
        },
        "gpus_per_node": nproc,
        "num_nodes": 1,
        "intra_node": {"bandwidth_gbps": round(bus, 3), "latency_us": round(lat, 1), "efficiency": 1.0},
        "inter_node": {"bandwidth_gbps": round(bus, 3), "latency_us": round(lat, 1), "efficiency": 1.0},
        "backend": "gloo" if device == "cpu" else "nccl",
    }
    return per_process(spec, nproc, len(os.sched_getaffinity(0))) if device == "cpu" else spec


def run_bench(args: argparse.Namespace, spec: dict) -> tuple[dict, dict, list[str]]:
    """Micro-benchmarks (`--bench-out`): GEMMs at the model's shapes and collectives per level, then the
    primitives' constants fitted to them, starting from `spec`. Returns (bench rows, refit spec, header)."""
    import torch

    from autoplan.cost_models.fit import CollectiveSample, GemmSample, RegionSample, fit_cluster

    from .calibrate_bench import (
        bench_gemms,
        bench_recompute_region,
        bench_tp_ops,
        model_gemm_shapes,
        pipeline_action_row,
        run_collectives,
    )
    from .specs import cluster_from_mapping

    device = "cuda" if torch.cuda.is_available() else "cpu"
    colls = run_collectives(args.nproc, device)
    if int(os.environ.get("RANK", 0)) != 0:
        return {}, spec, []
    # square GEMMs show where the efficiency saturates; the model's own shapes are what it will run
    shapes = [(n, n, n) for n in (_SIZES if device == "cpu" else _GPU_SIZES)]
    if args.model:
        shapes += model_gemm_shapes(args.model, args.seq_len, args.mbs, spec["gpus_per_node"])
    gemms = bench_gemms(shapes, device, args.dtype)
    autocast = training_autocast(args.dtype)
    regions = bench_recompute_region(device, autocast=autocast)
    # the measurement `calibrate` wrote as tp_op_overhead_us (calibrate_bench.bench_tp_ops), kept for the record
    tp_ops = bench_tp_ops(device)
    # the host time per operator of a training step (what kernel_launch_us prices), one process: tune's fit takes
    # it as a row, so that it cannot trade this constant for the compute rates (cost_models.fit.HostOpSample)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    host_op = {"seconds": training_op_us(device, sync, autocast), "processes": 1}
    # and per action of the runtime's pipeline schedule (what pipeline_action_us prices, on CPU processes), two
    # processes: a row of the fit too, which the pipelined runs would otherwise trade for the compute rates
    host_ops = [host_op] + ([pipeline_action_row()] if device == "cpu" else [])
    # which chip: tune refuses a file from another GPU family than the cluster's (tune.core.load_bench)
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    bench = {"device": device, "device_name": device_name, "model": args.model, "seq_len": args.seq_len, "mbs": args.mbs,
             "gemm": gemms, "collectives": colls, "recompute": regions, "tp_ops": [tp_ops], "host_op": host_ops}
    cluster = cluster_from_mapping(spec, where="calibrate")
    if device == "cpu":
        cluster = cluster.model_copy(update={"cores_per_node": len(os.sched_getaffinity(0))})
    levels = {c["level"] for c in colls}
    free = ["matmul_max_efficiency", "matmul_half_dim"]
    free += [f"{lv}_{k}" for lv in sorted(levels) for k in ("latency_us", "bandwidth_gbps")]
    # the checkpoint's host time: priced on CPU hosts and for autoplan's runtime on a GPU host (compute.layer_cost)
    free += ["recompute_region_us", "recompute_op_us"]
    res = fit_cluster(cluster, gemms=[GemmSample(**g) for g in gemms],
                      collectives=[CollectiveSample(**c) for c in colls],
                      regions=[RegionSample(**r) for r in regions], free=free)
    warn = peak_warning(cluster.gpu.peak_flops(args.dtype),
                        res.cluster.gpu.peak_flops(args.dtype) * res.cluster.gpu.calibration.matmul_max_efficiency)
    header = [*warn, f"primitives fitted to {len(gemms)} GEMMs, {len(colls)} collective and {len(regions)} "
              "checkpoint timings "
              "(autoplan calibrate --bench-out)", *res.summary_lines()]
    return bench, res.cluster.model_dump(mode="json", exclude_none=True), header


def peak_warning(measured: float, fitted: float) -> list[str]:
    """A one-line warning (in a list, empty when fine) when the fitted large-GEMM rate exceeds the best measured
    one by more than _PEAK_SLACK: the GEMM fit has compensated for timings its curve cannot follow (session 12:
    launch-bound small GEMMs on an H200 fitted to 3.0x the measured peak)."""
    if fitted <= _PEAK_SLACK * measured:
        return []
    return [f"warning: the GEMM fit puts the large-GEMM rate at {fitted / 1e12:.0f} TFLOP/s, {fitted / measured:.2f}x "
            f"the best measured ({measured / 1e12:.0f}): the GEMM timings do not follow the cost model's curve; "
            "check them in the bench file before using this cluster"]


@contextlib.contextmanager
def runtime_threads():
    """Measure as a rank of the runtime computes: on a CPU with one intra-op thread, which is what `autoplan run`
    gives each process (OMP_NUM_THREADS=1, runtime/launch.py; tune's launches too). Until session 24 calibrate
    timed with torch's default, every core: on this 2-core machine the GEMM peak came out 0.38 TFLOP/s against
    0.17 for one thread, the copy bandwidth 99 GB/s against 31, and a 2-process step of a 2048-token model was
    priced 0.063 s where it ran 0.17 s. `per_process` then scales the one-thread rates by the core share."""
    import torch

    before = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cmd_calibrate(args: argparse.Namespace) -> int:
    with runtime_threads():
        return _calibrate_command(args)


def _calibrate_command(args: argparse.Namespace) -> int:
    import json

    from .cli import print_json

    spec = calibrate(args.nproc if "RANK" not in os.environ else 1, args.dtype, args.model, args.seq_len)
    header = ["measured by `autoplan calibrate`"]
    if "RANK" in os.environ:  # under torchrun: the launch's shape is the cluster's
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        spec.update(gpus_per_node=local, num_nodes=max(1, int(os.environ["WORLD_SIZE"]) // local))
        if "cores_per_node" in spec:  # CPU processes: the launch's own share of the cores (measured alone above)
            spec = per_process(spec, local, spec["cores_per_node"])
    if args.bench_out:
        bench, spec, extra = run_bench(args, spec)
        if int(os.environ.get("RANK", 0)) != 0:
            return 0  # rank 0 of a torchrun launch writes everything
        Path(args.bench_out).write_text(json.dumps(bench, indent=1))
        header += extra
        for line in extra:
            if line.startswith("warning:"):
                print(line, file=sys.stderr)
    text = yaml.safe_dump(spec, sort_keys=False)
    if args.output:
        Path(args.output).write_text("".join(f"# {h}\n" for h in header) + text)
    if args.json:
        print_json(spec)
    else:
        print(text, end="")
    return 0
