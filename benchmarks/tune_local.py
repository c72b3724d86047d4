"""Held-out check of `autoplan tune` on this machine: tune, then measure layouts tune never ran.

    python benchmarks/tune_local.py [--model tiny-gpt] [--nproc 4] [--budget 240] [--steps 5] [--json]

1. `autoplan.tune.core.tune` on local-cpu (the model, 4 processes) within --budget seconds: the search's best
   plans and a few deliberately different ones run for real, and the cluster is refit.
2. At least 10 *other* layouts (a fixed list of legal configurations minus what tune ran) are measured the same
   way (torchrun, median step after the first) and predicted with the refit cluster (and, for comparison, with
   the cluster tune started from).
3. The search is re-run with the refit cluster; its choice is measured too if nobody ran it.
Prints a table, then Spearman rank correlation and mean absolute error of the refit predictions over the held-out
layouts, and the chosen plan's measured step over the fastest measured one. Last line:
`tune: held-out spearman S, mean error E%, chosen/fastest R over N layouts`.

Timings on a shared 2-core machine are noisy: read the numbers with the load in mind.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoplan.api import make_plan  # noqa: E402
from autoplan.cost_models.errors import AutoplanError  # noqa: E402
from autoplan.specs import TrainingSpec, load_cluster, load_model  # noqa: E402
from autoplan.tune.core import Candidate, prepare_cluster, run_candidate, tune  # noqa: E402

# Layouts to hold out: every parallelism the runtime runs on 4 processes, alone and combined.
HELD_OUT = [
    "dp=4", "tp=4", "pp=4", "dp=2,tp=2", "dp=2,pp=2", "tp=2,pp=2", "dp=4,zero=1", "dp=4,zero=2", "dp=4,zero=3",
    "dp=2,tp=2,sp=1", "tp=2,pp=2,sp=1", "dp=2,tp=2,recompute=full", "dp=4,recompute=selective",
    "dp=2,pp=2,mbs=2", "pp=2,dp=2,schedule=gpipe", "cp=2,dp=2", "tp=2,cp=2", "pp=4,vp=1,mbs=2", "dp=2,tp=2,zero=3",
    "tp=4,recompute=full", "pp=2,tp=2,recompute=full", "dp=4,mbs=2",
]


def micro_benchmarks(model: str, seq: int, nproc: int) -> dict:
    """What `autoplan calibrate --bench-out` measures: GEMMs at the model's shapes (one micro-batch of 1-2
    sequences), collectives among `nproc` and 2 processes (two process counts separate the descheduling wait
    from the hop latency)."""
    import os

    from autoplan.calibrate_bench import bench_gemms, model_gemm_shapes, run_collectives

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shapes = sorted(set(model_gemm_shapes(model, seq, 1, nproc) + model_gemm_shapes(model, seq, 2, nproc)))
    colls = run_collectives(nproc, "cpu") + (run_collectives(2, "cpu") if nproc > 2 else [])
    return {"gemm": bench_gemms(shapes, "cpu", "fp32"), "collectives": colls}


def spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the tune step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--diverse", type=int, default=7)
    ap.add_argument("--min-held-out", type=int, default=12)
    ap.add_argument("--no-bench", action="store_true",
                    help="skip the micro-benchmarks (calibrate's GEMMs and collectives at 4 and 2 processes)")
    ap.add_argument("--save", default=None, help="write every measurement (tuned and held out) to this JSON file")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model = load_model(args.model)
    cluster = prepare_cluster(load_cluster("local-cpu").with_gpus(args.nproc))
    training = TrainingSpec(global_batch_size=args.global_batch, seq_length=args.seq_len, dtype="fp32",
                            kernels="torch")
    bench_file = None
    t0 = time.perf_counter()
    if not args.no_bench:
        bench_file = Path(tempfile.mkdtemp(prefix="tune-bench-")) / "bench.json"
        bench_file.write_text(json.dumps(micro_benchmarks(args.model, args.seq_len, args.nproc)))
    t_bench = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = tune(model, cluster, training, top=args.top, diverse=args.diverse, steps=args.steps,
               budget_s=args.budget, kernels="torch", bench=bench_file,
               progress=lambda d, i, n: print(f"[tune {i}/{n}] {d}", file=sys.stderr, flush=True))
    t_tune = time.perf_counter() - t0
    if res.fit is None:
        print("tune measured nothing", file=sys.stderr)
        return 1
    refit = res.fit.cluster
    tuned = {c.config for c in res.measured}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in HELD_OUT:
            if len([r for r in rows if r["measured_s"]]) >= args.min_held_out:
                break
            try:
                before = make_plan(model, cluster, training, cfg, kernels="torch")
                after = make_plan(model, refit.with_gpus(args.nproc), training, cfg, kernels="torch")
            except AutoplanError:
                continue  # not legal for this model and process count
            if before.parallel.to_string() in tuned:
                continue
            c = Candidate(plan=before, why="held out")
            print(f"[held-out {len(rows) + 1}] {before.parallel.to_string()}", file=sys.stderr, flush=True)
            # timed by component too (for the saved file: the fit never sees held-out runs)
            run_candidate(c, Path(tmp), steps=args.steps, profile_step=None, time_from=2)
            rows.append({"parallel": before.parallel.to_string(), "measured_s": c.measured_s,
                         "before_s": before.prediction.step_time_s, "after_s": after.prediction.step_time_s,
                         "error": c.error, "components": c.log.time_components() if c.log else None,
                         "after_breakdown": after.prediction.breakdown})
        # the search's choice with the refit cluster, measured if nobody ran it
        from autoplan.search.core import search

        choice = search(model, refit.with_gpus(args.nproc), training, top=1, kernels="torch").plan
        known = {r["parallel"]: r["measured_s"] for r in rows if r["measured_s"]}
        known.update({c.config: c.measured_s for c in res.measured})
        chosen_s = known.get(choice.parallel.to_string())
        if chosen_s is None:
            c = Candidate(plan=choice, why="refit choice")
            run_candidate(c, Path(tmp), steps=args.steps, profile_step=None)
            chosen_s = c.measured_s
            if chosen_s:
                known[choice.parallel.to_string()] = chosen_s
    ok = [r for r in rows if r["measured_s"]]
    meas = [r["measured_s"] for r in ok]
    s_after = spearman([r["after_s"] for r in ok], meas) if len(ok) > 2 else float("nan")
    s_before = spearman([r["before_s"] for r in ok], meas) if len(ok) > 2 else float("nan")
    e_after = sum(abs(r["after_s"] / r["measured_s"] - 1) for r in ok) / max(1, len(ok))
    e_before = sum(abs(r["before_s"] / r["measured_s"] - 1) for r in ok) / max(1, len(ok))
    fastest = min(known.values())
    ratio = chosen_s / fastest if chosen_s else float("nan")
    if args.save:
        Path(args.save).write_text(json.dumps({
            "tuned": [{"parallel": c.config, "measured_s": c.measured_s, "plan": json.loads(c.plan.to_json()),
                       "components": c.log.time_components() if c.log else None} for c in res.measured],
            "fit_rows": res.fit.rows, "fit_after": res.fit.after, "fit_held": res.fit.held,
            "held_out": rows, "bench": json.loads(bench_file.read_text()) if bench_file else None}, default=float))
    summary = {"tune_s": t_tune, "bench_s": t_bench, "tuned": sorted(tuned), "fit_after": res.fit.after,
               "undetermined": res.fit.undetermined, "held_out": rows, "spearman_after": s_after,
               "spearman_before": s_before, "mean_error_after": e_after, "mean_error_before": e_before,
               "chosen": choice.parallel.to_string(), "chosen_s": chosen_s, "fastest_s": fastest,
               "chosen_over_fastest": ratio, "layouts": len(known)}
    if args.json:
        print(json.dumps(summary, default=float))
    else:
        print(f"micro-benchmarks {t_bench:.0f} s; tune: {len(tuned)} layouts measured in {t_tune:.0f} s; fitted "
              + ", ".join(f"{k}={v:.4g}" for k, v in res.fit.after.items()))
        for c in res.candidates:
            m = f"{c.measured_s * 1e3:8.1f}" if c.measured_s else f"{c.error or '-':>8}"
            print(f"  tuned     {c.config:<80} measured {m} ms  refit {(c.predicted_after_s or 0) * 1e3:8.1f} ms")
        for r in rows:
            m = f"{r['measured_s'] * 1e3:8.1f}" if r["measured_s"] else f"{r['error']}"
            print(f"  held-out  {r['parallel']:<80} measured {m} ms  before {r['before_s'] * 1e3:8.1f} ms  "
                  f"refit {r['after_s'] * 1e3:8.1f} ms")
        print(f"held-out, cluster before tune: spearman {s_before:.2f}, mean error {100 * e_before:.0f}%")
        print(f"search with the refit cluster chooses {choice.parallel.to_string()}: "
              f"{(chosen_s or float('nan')) * 1e3:.1f} ms vs fastest measured {fastest * 1e3:.1f} ms")
    print(f"tune: held-out spearman {s_after:.2f}, mean error {100 * e_after:.1f}%, chosen/fastest {ratio:.2f} "
          f"over {len(ok)} layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
