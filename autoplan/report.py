"""Rich rendering of an estimate: the headline numbers, memory per stage, and the time breakdown."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autoplan.cost_models.estimate import Estimate, memory_moment_note
from autoplan.cost_models.specs import ClusterSpec, ModelSpec, TrainingSpec
from autoplan.inspect.common import fmt_tflops


def render_estimate(con: Console, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                    est: Estimate) -> None:
    cfg = est.config
    con.print(f"[bold]{model.name}[/] on {cluster.num_gpus} x {cluster.gpu.name} ({cluster.name}), "
              f"batch {training.global_batch_size} x {training.seq_length} tokens, {training.dtype}")
    con.print(f"config  {cfg.to_string()}")
    head = Table(show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("step time", f"{est.step_time_s:.3f} s")
    head.add_row("TFLOP/s per GPU", fmt_tflops(est.tflops_per_gpu))
    head.add_row("MFU / HFU", f"{100 * est.mfu:.1f}% / {100 * est.hfu:.1f}%")
    head.add_row("tokens/s", f"{est.tokens_per_s:,.0f}")
    head.add_row("peak memory", f"{est.peak_memory_gib:.1f} GiB of {cluster.gpu.hbm_gib:g}"
                 + ("" if est.fits else "  [red]DOES NOT FIT[/]"))
    head.add_row("kernels", {"fused": "fused Triton", "torch": "eager torch ops",
                             "megatron": "Megatron-LM/TE"}[training.kernels])
    con.print(head)
    mem = Table(title="Memory per pipeline rank (GiB)")
    for c in ("rank", "weights", "grads", "optimizer", "activations", "other", "total"):
        mem.add_column(c, justify="right")
    for r, m in enumerate(est.memory):
        g = m.gib()
        mem.add_row(str(r), *(f"{g[k]:.2f}" for k in ("weights", "gradients", "optimizer", "activations", "other")),
                    f"[{'red' if m.total > est.capacity_bytes else 'green'}]{g['total']:.2f}[/]")
    con.print(mem)
    note = memory_moment_note(cfg, training)
    if note:
        con.print(f"[dim]  {note}[/]")
    br = Table(title="Step time breakdown")
    br.add_column("component")
    br.add_column("seconds", justify="right")
    br.add_column("share", justify="right")
    for k, v in est.breakdown.items():
        br.add_row(k, f"{v:.4f}", f"{100 * v / est.step_time_s:.1f}%")
    con.print(br)
