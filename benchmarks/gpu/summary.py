"""The table of one lent-GPU call (benchmarks/gpu/check.sh): each run's measured step time and memory beside the
plan's prediction, and where the step's time went.

    python benchmarks/gpu/summary.py DIR      # DIR holds NAME.plan.json and NAME.jsonl pairs

Measured step time is the median of the steps after the first three (the first compiles the Triton kernels and
warms the allocator; the profiled step, if any, is left out). Measured memory is the allocator's peak
(`torch.cuda.max_memory_allocated`, every step); the plan's peak includes the cluster's framework overhead (CUDA
context, NCCL and cuBLAS workspaces: memory the allocator does not see), so both the total and the total less it
are shown.
Components: the mean of the timing records (`--time-from`), synchronised with the device at every boundary.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load(path: Path) -> tuple[list[dict], list[dict], list[dict]]:
    steps, timings, profiles = [], [], []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        event = rec.get("event")
        if event == "timing":
            timings.append(rec)
        elif event == "profile":
            profiles.append(rec)
        elif "step_time_s" in rec:
            steps.append(rec)
    return steps, timings, profiles


def summarise(name: str, plan: dict, log: Path) -> dict:
    steps, timings, profiles = load(log)
    profiled = {p["step"] for p in profiles}
    steady = [r for r in steps if r["step"] > 3 and r["step"] not in profiled]
    pred = plan["prediction"]
    # memory the allocator does not see: the cluster's framework overhead (CUDA context, NCCL, cuBLAS workspaces);
    # the rest of the plan's `other` (the loss's transient) is allocator memory
    other = plan["cluster"]["gpu"].get("calibration", {}).get("framework_overhead_gib", 0.0)
    row = {"run": name, "predicted_s": pred["step_time_s"], "breakdown": pred["breakdown"],
           "predicted_peak_gib": pred["memory_gib"]["peak"], "predicted_other_gib": other,
           "steps": len(steps), "loss_first": steps[0]["loss"] if steps else None,
           "loss_last": steps[-1]["loss"] if steps else None}
    if steady:
        row["measured_s"] = statistics.median(r["step_time_s"] for r in steady)
        row["ratio"] = row["measured_s"] / row["predicted_s"]
        peaks = [r["peak_memory_gib"] for r in steady if r.get("peak_memory_gib") is not None]
        row["measured_peak_gib"] = max(peaks) if peaks else None
    comps: dict[str, list[float]] = {}
    for rec in timings:
        for k, v in rec["ranks"][0]["time_s"].items():
            comps.setdefault(k, []).append(v)
    row["components_s"] = {k: statistics.mean(v) for k, v in comps.items()}
    if profiles:
        row["profile"] = profiles[0]["ranks"][0]
    return row


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else ".")
    rows = []
    for plan_path in sorted(root.glob("*.plan.json")):
        name = plan_path.name.removesuffix(".plan.json")
        log = root / f"{name}.jsonl"
        if not log.exists():
            print(f"{name}: no log (the run failed; see {name}.out)")
            continue
        rows.append(summarise(name, json.loads(plan_path.read_text()), log))
    print(f"{'run':28s} {'pred s':>8s} {'meas s':>8s} {'m/p':>5s} {'pred GiB':>9s} {'-other':>7s} {'meas GiB':>9s}"
          "  loss")
    for r in rows:
        meas = r.get("measured_s")
        mpk = r.get("measured_peak_gib")
        print(f"{r['run']:28s} {r['predicted_s']:8.4f} {meas or float('nan'):8.4f} {r.get('ratio', float('nan')):5.2f} "
              f"{r['predicted_peak_gib']:9.2f} {r['predicted_peak_gib'] - r['predicted_other_gib']:7.2f} "
              f"{mpk if mpk is not None else float('nan'):9.2f}  {r['loss_first']:.3f} -> {r['loss_last']:.3f}")
    print("\ncomponents, measured (synchronised) vs predicted, seconds")
    for r in rows:
        meas = " ".join(f"{k}={v:.4f}" for k, v in sorted(r["components_s"].items()))
        pred = " ".join(f"{k}={v:.4f}" for k, v in r["breakdown"].items() if v)
        print(f"  {r['run']}: measured {meas}\n  {' ' * len(r['run'])}  predicted {pred}")
    print("\nprofiled step (counted by the runtime's dispatch mode on this device) vs the cost model")
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        m, p = prof["measured"], prof["predicted"]
        flops = " ".join(f"{k} {m['flops'][k] / max(p['flops'][k], 1):.3f}" for k in m["flops"] if p["flops"].get(k))
        mem = m["memory_bytes"]["peak"] / max(p["memory_bytes"]["peak"], 1)
        print(f"  {r['run']}: flops measured/predicted {flops}; tensor-memory peak {mem:.3f}")
    out = root / "summary.json"
    out.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
