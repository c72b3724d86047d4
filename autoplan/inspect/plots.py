"""Pictures with matplotlib: the scaling curve (`autoplan scaling --plot`) and the simulated pipeline schedule
(`autoplan trace --plot`). The format follows the file's suffix (.png, .svg, .pdf). matplotlib is imported
only here, and only when a picture is asked for (the `plots` extra); without it the command says so in one
line.
"""

from __future__ import annotations

from pathlib import Path

from autoplan.cost_models.errors import SpecError

# Category colours of the schedule picture: matplotlib's tab10 (forward blue, backward orange, recompute green,
# communication grey).
_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "recompute": "tab:green"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecError("plots need matplotlib", "it is not installed",
                        "pip install matplotlib (or autoplan[plots])") from None
    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".") or "png"
    if fmt not in ("png", "svg", "pdf"):
        raise SpecError("unknown picture format", f"{path.name} ends in .{fmt}", "use .png, .svg or .pdf")
    try:
        fig.savefig(path, format=fmt, dpi=100, bbox_inches="tight")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path


def plot_scaling(rows: list[dict], path: str | Path, *, title: str) -> Path:
    """Predicted tokens/s against GPUs (log-log), with linear scaling from the smallest size that fits."""
    plt = _pyplot()
    ok = [r for r in rows if "error" not in r and r.get("tokens_per_s")]
    fig, ax = plt.subplots(figsize=(8, 5))
    if ok:
        xs = [r["gpus"] for r in ok]
        ax.plot(xs, [r["tokens_per_s"] for r in ok], "o-", color="tab:blue", label="predicted")
        ref = ok[0]
        ax.plot(xs, [ref["tokens_per_s_per_gpu"] * n for n in xs], "--", color="tab:grey", label="linear scaling")
    for r in rows:
        if "error" in r:
            ax.axvline(r["gpus"], color="tab:red", alpha=0.3, lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_schedule(plan, path: str | Path) -> Path:
    """One optimizer step of the simulated pipeline schedule: a row per pipeline rank, a bar per micro-batch
    forward/backward/recompute slice (the same slices as `autoplan trace`)."""
    from .trace import TID_COMPUTE, trace_events

    plt = _pyplot()
    events = [e for e in trace_events(plan)["traceEvents"] if e.get("ph") == "X" and e.get("tid") == TID_COMPUTE]
    pp = plan.parallel.pp
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.5 * pp))
    for cat, colour in _COLOURS.items():
        bars: dict[int, list[tuple[float, float]]] = {}
        for e in events:
            if e.get("cat") == cat:
                bars.setdefault(e["pid"], []).append((e["ts"] / 1e3, e["dur"] / 1e3))  # µs -> ms
        for rank, spans in bars.items():
            ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.3,
                           label=cat if rank == min(bars) else None)
    ax.set_yticks(range(pp), [f"PP rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"plan {plan.short_hash}: {plan.parallel.to_string()}", fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    return _save(fig, path)
