"""Fit the per-GPU calibration constants to the published runs (how cost_models/hardware.py's numbers were set).

    python benchmarks/calibrate_fit.py [--gpu a100-80g|h100-sxm]

One set of constants per GPU type, fitted to all runs of that GPU at once by coordinate descent on
mean |error| + 0.5 * worst |error|. Never per run. Prints the fitted constants and the resulting errors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoplan.cost_models.hardware import GPU_PRESETS  # noqa: E402
from benchmarks.fidelity import DEFAULT_REF, evaluate  # noqa: E402

# Physical bounds of each constant (fraction of peak, dims, microseconds).
BOUNDS = {
    "matmul_max_efficiency": (0.5, 0.95),
    "matmul_half_dim": (0.0, 1500.0),
    "attention_efficiency": (0.2, 0.75),
    "memory_efficiency": (0.7, 0.92),
    "kernel_launch_us": (0.0, 80.0),
}


def objective(gpu: str, cal, table: str) -> tuple[float, list[float]]:
    rows = [r for r in evaluate(DEFAULT_REF, {gpu: cal}) if r["table"].startswith(table)]
    errs = [abs(r["step_error"]) for r in rows]
    return statistics.mean(errs) + 0.5 * max(errs), [r["step_error"] for r in rows]


def fit(gpu: str, table: str, keys: list[str], rounds: int = 3) -> None:
    cal = GPU_PRESETS[gpu].calibration
    best, errs = objective(gpu, cal, table)
    for _ in range(rounds):
        for key in keys:
            lo, hi = BOUNDS[key]
            for frac in (0.25, 0.1, 0.04, 0.015):
                step = (hi - lo) * frac
                improved = True
                while improved:
                    improved = False
                    for sign in (1, -1):
                        val = min(hi, max(lo, getattr(cal, key) + sign * step))
                        trial = cal.model_copy(update={key: val})
                        obj, e = objective(gpu, trial, table)
                        if obj < best - 1e-6:
                            best, cal, errs, improved = obj, trial, e, True
    print(f"{gpu}: objective {best:.4f}")
    for k in keys:
        print(f"  {k} = {getattr(cal, k):.4g}")
    print("  errors:", " ".join(f"{100 * e:+.1f}%" for e in errs))
    ab = [abs(e) for e in errs]
    print(f"  mean |err| {100 * statistics.mean(ab):.2f}%  worst {100 * max(ab):.2f}%")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", choices=["a100-80g", "h100-sxm"], default=None)
    args = ap.parse_args()
    if args.gpu in (None, "a100-80g"):
        fit("a100-80g", "SC21", ["matmul_max_efficiency", "matmul_half_dim", "memory_efficiency", "kernel_launch_us"])
    if args.gpu in (None, "h100-sxm"):
        fit("h100-sxm", "Megatron", ["matmul_max_efficiency", "matmul_half_dim", "attention_efficiency",
                                     "memory_efficiency", "kernel_launch_us"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
