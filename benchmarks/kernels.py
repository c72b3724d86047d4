"""Fused kernels vs eager PyTorch and torch.compile: time and achieved bandwidth, forward and backward.

    python benchmarks/kernels.py                 # CUDA: realistic shapes, eager + torch.compile
    python benchmarks/kernels.py --ops rms_norm,cross_entropy --no-compile
    python benchmarks/kernels.py --json out.json # also write the rows as JSON

Without CUDA it runs a tiny smoke version on the CPU (the Triton kernels through the interpreter,
TRITON_INTERPRET=1), skipping torch.compile unless --compile is given; CPU times say nothing
about GPU speed. The device it ran on is printed first.

Columns: `fwd` is a forward under no_grad; `bwd` is (forward + backward) minus a forward with
autograd recording. GB/s divides the bytes the fused kernel must move (kernels/traffic.py, the
same numerator for every implementation, so GB/s ratios are speed ratios) by the time; `%peak` is
that over the GPU's HBM bandwidth. Cross-entropy includes the LM-head matmuls, so it reports time
and peak memory (for a 128K vocabulary) instead of bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from autoplan import kernels
from autoplan.kernels import traffic

# HBM bandwidth in GB/s by device-name fragment (NVIDIA datasheets, as in cost_models/hardware.py:
# H100 SXM 3.35 TB/s, H200 4.8 TB/s, A100 80GB 2.04 TB/s, A100 40GB 1.56 TB/s, B200 8 TB/s).
HBM_GBPS = {"H100": 3350, "H200": 4800, "A100-SXM4-80GB": 2039, "A100 80GB": 2039, "A100": 1555, "B200": 8000}


# --------------------------------------------------------------------------- eager baselines
# The eager code whose kernels kernels/traffic.py counts.


def eager_rms_norm(x, w, eps):
    # Hugging Face LlamaRMSNorm.forward
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def eager_layer_norm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def eager_bias_gelu(x, b):
    return F.gelu(x + b, approximate="tanh")


def eager_swiglu(gate, up):
    return F.silu(gate) * up


def eager_rope(q, k, cos_full, sin_full):
    # Hugging Face apply_rotary_pos_emb with [seq, head_dim] tables broadcast over batch and heads
    def rotate_half(t):
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)

    return q * cos_full + rotate_half(q) * sin_full, k * cos_full + rotate_half(k) * sin_full


def eager_softmax(x, scale, mask):
    return (x * scale).masked_fill(mask, float("-inf")).softmax(-1)


def eager_cross_entropy(h, w, t):
    # Hugging Face causal-LM loss: logits upcast to fp32, then F.cross_entropy
    return F.cross_entropy((h @ w.t()).float(), t)


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    op: str
    label: str
    # make() -> {"fused": (fn, args), "eager": (fn, args), "numel": elements for kernels/traffic.py,
    #            optional "inplace": bool, "grad_args": indices of args that require grad}
    make: Callable[[], dict]
    bandwidth: bool = True


@dataclass
class Row:
    op: str
    shape: str
    impl: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_gbps: float | None = None
    bwd_gbps: float | None = None
    peak_mib: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _cases(device: str, dtype: torch.dtype, smoke: bool) -> list[Case]:
    dev = dict(device=device, dtype=dtype)
    cases: list[Case] = []
    norm_shapes = [(64, 781)] if smoke else [(16384, 4096), (16384, 8192), (8192, 16384), (65536, 4096)]
    for tokens, hidden in norm_shapes:
        def rms(tokens=tokens, hidden=hidden):
            x, w = torch.randn(tokens, hidden, **dev), torch.rand(hidden, **dev) + 0.5
            return {"fused": (kernels.get("rms_norm", "triton"), (x, w, 1e-6)),
                    "eager": (eager_rms_norm, (x, w, 1e-6)), "numel": x.numel()}

        def ln(tokens=tokens, hidden=hidden):
            x, w, b = torch.randn(tokens, hidden, **dev), torch.rand(hidden, **dev), torch.randn(hidden, **dev)
            return {"fused": (kernels.get("layer_norm", "triton"), (x, w, b, 1e-5)),
                    "eager": (eager_layer_norm, (x, w, b, 1e-5)), "numel": x.numel()}

        cases += [Case("rms_norm", f"{tokens}x{hidden}", rms), Case("layer_norm", f"{tokens}x{hidden}", ln)]

    tokens, ffn = (64, 781) if smoke else (8192, 16384)

    def gelu():
        x, b = torch.randn(tokens, ffn, **dev), torch.randn(ffn, **dev)
        return {"fused": (kernels.get("bias_gelu", "triton"), (x, b, "tanh")),
                "eager": (eager_bias_gelu, (x, b)), "numel": x.numel()}

    tokens_s, ffn_s = (64, 781) if smoke else (8192, 14336)  # Llama-3-8B MLP width

    def swiglu():
        g, u = torch.randn(tokens_s, ffn_s, **dev), torch.randn(tokens_s, ffn_s, **dev)
        return {"fused": (kernels.get("swiglu", "triton"), (g, u)), "eager": (eager_swiglu, (g, u)),
                "numel": g.numel()}

    cases += [Case("bias_gelu", f"{tokens}x{ffn}", gelu), Case("swiglu", f"{tokens_s}x{ffn_s}", swiglu)]

    b, s, hq, hk, d = (1, 16, 4, 2, 64) if smoke else (4, 4096, 32, 8, 128)

    def rope():
        from autoplan.kernels.rope import rope_cache

        q, k = torch.randn(b, s, hq, d, **dev), torch.randn(b, s, hk, d, **dev)
        cos, sin = rope_cache(s, d, device=device)
        cos_full = torch.cat((cos, cos), -1).to(dtype)[None, :, None, :]
        sin_full = torch.cat((sin, sin), -1).to(dtype)[None, :, None, :]
        return {"fused": (kernels.get("rope", "triton"), (q, k, cos, sin)),
                "eager": (eager_rope, (q, k, cos_full, sin_full)), "numel": q.numel() + k.numel(),
                "inplace": True, "grad_args": (0, 1)}

    cases.append(Case("rope", f"b{b} s{s} hq{hq} hk{hk} d{d}", rope))

    bs, hs, sq = (1, 2, 37) if smoke else (4, 32, 2048)

    def softmax():
        x = torch.randn(bs, hs, sq, sq, **dev)
        mask = torch.ones(sq, sq, dtype=torch.bool, device=device).triu(1)
        scale = 1 / math.sqrt(128)
        return {"fused": (kernels.get("softmax", "triton"), (x, scale, True)),
                "eager": (eager_softmax, (x, scale, mask)), "numel": x.numel()}

    cases.append(Case("softmax", f"{bs}x{hs}x{sq}x{sq} causal", softmax))

    n, h, v = (64, 32, 1000) if smoke else (8192, 4096, 131072)

    def ce():
        hid = torch.randn(n, h, **dev)
        w = torch.randn(v, h, **dev) * 0.02
        t = torch.randint(0, v, (n,), device=device)
        return {"fused": (kernels.get("cross_entropy", "triton"), (hid, w, t)),
                "eager": (eager_cross_entropy, (hid, w, t)), "numel": n * v, "tokens_vocab_hidden": (n, v, h),
                "grad_args": (0, 1)}

    cases.append(Case("cross_entropy", f"N{n} h{h} V{v}", ce, bandwidth=False))
    return cases


# --------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], object], device: str, smoke: bool) -> float:
    """Median milliseconds of fn() over repeated runs (CUDA events on GPU, wall clock on CPU)."""
    warmup, reps = (1, 2) if smoke else (5, 20)  # the interpreter is slow and its times mean nothing
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _leaves(args, grad_args, inplace: bool):
    """Fresh autograd inputs: args[i] for i in grad_args require grad (non-leaf clones for in-place ops)."""
    out = list(args)
    for i in grad_args:
        leaf = args[i].detach().requires_grad_(True)
        out[i] = leaf.clone() if inplace else leaf
    return out


def _outputs(result):
    return [r for r in (result if isinstance(result, tuple) else (result,)) if isinstance(r, torch.Tensor)]


def _measure(fn, args, grad_args, device, smoke, inplace=False):
    """(fwd ms under no_grad, bwd ms = (fwd + bwd) minus a forward that records autograd)."""
    with torch.no_grad():
        fwd = _time_ms(lambda: fn(*args), device, smoke)  # in-place ops just rotate the buffer again
    grads = [None if o.dim() == 0 else torch.randn_like(o) for o in _outputs(fn(*_leaves(args, grad_args, inplace)))]

    def forward():
        return fn(*_leaves(args, grad_args, inplace))

    def forward_backward():
        outs = _outputs(forward())
        torch.autograd.backward(outs, grads[: len(outs)])

    recorded = _time_ms(forward, device, smoke)
    both = _time_ms(forward_backward, device, smoke)
    return fwd, max(both - recorded, 0.0)


def _peak_mib(fn, args, device) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fn(*_leaves(args, (0, 1), False))
    loss.backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# --------------------------------------------------------------------------- main


def run(ops: list[str] | None, device: str, dtype: torch.dtype, compile_: bool, smoke: bool) -> list[Row]:
    rows: list[Row] = []
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    for case in _cases(device, dtype, smoke):
        if ops and case.op not in ops:
            continue
        torch.manual_seed(0)
        setup = case.make()
        inplace = setup.get("inplace", False)
        impls = [("fused", *setup["fused"]), ("eager", *setup["eager"])]
        if compile_:
            impls.append(("torch.compile", torch.compile(setup["eager"][0]), setup["eager"][1]))
        fused_fwd_bytes = traffic.bytes_moved(case.op, setup["numel"], "fused", "fwd", dtype_bytes)
        fused_bwd_bytes = traffic.bytes_moved(case.op, setup["numel"], "fused", "bwd", dtype_bytes)
        for impl, fn, args in impls:
            row = Row(case.op, case.label, impl)
            try:
                grad_args = setup.get("grad_args", [i for i, a in enumerate(args)
                                                    if isinstance(a, torch.Tensor) and a.is_floating_point()])
                row.fwd_ms, row.bwd_ms = _measure(fn, args, grad_args, device, smoke, inplace and impl == "fused")
            except Exception as exc:  # report and keep going: one failing baseline must not hide the rest
                row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                rows.append(row)
                continue
            if case.bandwidth:
                row.fwd_gbps = fused_fwd_bytes / (row.fwd_ms * 1e-3) / 1e9 if row.fwd_ms else None
                row.bwd_gbps = fused_bwd_bytes / (row.bwd_ms * 1e-3) / 1e9 if row.bwd_ms else None
            else:
                row.peak_mib = _peak_mib(fn, args, device)
                n, v, h = setup["tokens_vocab_hidden"]
                model = traffic.cross_entropy_peak_bytes(n, v, h, "fused" if impl == "fused" else "eager",
                                                         dtype_bytes)
                row.extra["modeled_peak_mib"] = model / 2**20
            rows.append(row)
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), Triton interpreter"


def _peak_gbps(name: str) -> float | None:
    for fragment, gbps in HBM_GBPS.items():
        if fragment in name:
            return gbps
    return None


def print_table(rows: list[Row], device_name: str, peak: float | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(f"[bold]device:[/bold] {device_name}" + (f"  (HBM {peak:.0f} GB/s)" if peak else ""))
    table = Table(title="fused kernels vs eager PyTorch / torch.compile")
    for col in ("op", "shape", "impl", "fwd ms", "fwd GB/s", "bwd ms", "bwd GB/s", "peak MiB",
                "speedup fwd/bwd", "note"):
        table.add_column(col, justify="left" if col in ("op", "shape", "impl", "note") else "right")
    eager = {(r.op, r.shape): r for r in rows if r.impl == "eager"}

    def ms(x):
        return "-" if x is None else f"{x:.3f}"

    def gbps(x):
        if x is None:
            return "-"
        return f"{x:,.0f}" + ("" if peak is None else f" ({100 * x / peak:.0f}%)")

    for r in rows:
        base = eager.get((r.op, r.shape))
        speed = "-"
        if base and r.fwd_ms and base.fwd_ms and r.bwd_ms and base.bwd_ms:
            speed = f"{base.fwd_ms / r.fwd_ms:.2f}x / {base.bwd_ms / r.bwd_ms:.2f}x"
        peak_mib = r.peak_mib if r.peak_mib is not None else r.extra.get("modeled_peak_mib")
        peak_txt = "-" if peak_mib is None else f"{peak_mib:,.1f}" + ("" if r.peak_mib is not None else " (model)")
        table.add_row(r.op, r.shape, r.impl, ms(r.fwd_ms), gbps(r.fwd_gbps), ms(r.bwd_ms), gbps(r.bwd_gbps),
                      peak_txt, speed, r.note)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", help=f"comma-separated subset of: {', '.join(kernels.available())}")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--compile", dest="compile_", action="store_true", default=None,
                        help="also time torch.compile (default on CUDA, off on CPU)")
    parser.add_argument("--no-compile", dest="compile_", action="store_false")
    parser.add_argument("--json", type=Path, help="write the rows as JSON to this file")
    args = parser.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    smoke = device == "cpu"
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # kernels pick the interpreter at launch time
        torch.set_num_threads(1)
    compile_ = (device == "cuda") if args.compile_ is None else args.compile_
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    ops = [o.strip() for o in args.ops.split(",")] if args.ops else None
    unknown = sorted(set(ops or ()) - set(kernels.available()))
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {kernels.available()}")

    name = _device_name(device)
    rows = run(ops, device, dtype, compile_, smoke)
    print_table(rows, name, _peak_gbps(name) if device == "cuda" else None)
    if args.json:
        args.json.write_text(json.dumps({"device": name, "dtype": args.dtype, "smoke": smoke,
                                         "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
