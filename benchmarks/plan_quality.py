"""Plan quality: the planner's best plan against each published configuration, by the cost model's own numbers.

    python benchmarks/plan_quality.py [--json] [--reference PATH] [--limit N]

For every run of shared/reference/calibration_runs.json (same model, GPU count, global batch, sequence and
the runtime assumptions of `benchmarks/fidelity.py`), this prints the published configuration's predicted
step time, the planner's best, their ratio (best / published, <= 1 means the planner is at least as fast),
and the rank the published configuration would take among the planner's ranked finalists (1 = it would
have been the best; ">N" = all N finalists beat it: the search prunes the rest, so no exact rank exists). "why" names the largest component of the step the planner's plan saves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoplan.estimate_api import estimate_config  # noqa: E402
from autoplan.search.core import search  # noqa: E402
from autoplan.specs import load_cluster  # noqa: E402
from benchmarks.fidelity import DEFAULT_REF, run_setting  # noqa: E402


def evaluate(ref: Path, limit: int | None = None) -> list[dict]:
    runs = json.loads(ref.read_text())["runs"][:limit]
    rows = []
    for run in runs:
        model, cluster_name, training, cfg, table = run_setting(run)
        cluster = load_cluster(cluster_name, gpus=run["cluster"]["num_gpus"])
        pub = estimate_config(model, cluster, training, cfg)
        t0 = time.perf_counter()
        res = search(model, cluster, training, top=5)
        dt = time.perf_counter() - t0
        best = res.best
        times = sorted(f.estimate.step_time_s for f in res.finalists)
        faster = sum(1 for t in times if t < pub.step_time_s - 1e-12)
        rank = faster + 1 if faster < len(times) else None  # None: behind every finalist
        saved = {k: pub.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0) for k in pub.breakdown}
        why = max(saved, key=saved.get)
        rows.append({
            "table": table, "model": model.name, "gpus": cluster.num_gpus,
            "published_config": cfg.to_string(), "published_step_s": pub.step_time_s,
            "published_fits": pub.fits, "best_config": best.config.to_string(), "best_step_s": best.step_time_s,
            "ratio": best.step_time_s / pub.step_time_s, "published_rank": rank,
            "finalists": len(times),
            "why": f"{why.replace('_', ' ')} -{saved[why]:.3f} s" if best.step_time_s < pub.step_time_s else "",
            "search_time_s": dt,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, default=DEFAULT_REF)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = evaluate(args.reference, args.limit)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Plan quality: planner's best vs the published configuration (cost model's predictions)")
    for c in ("table", "model", "GPUs", "published", "pub s", "best", "best s", "ratio", "rank", "why", "search s"):
        t.add_column(c, justify="left" if c in ("table", "model", "published", "best", "why") else "right")
    short = lambda s: s.replace(",cp=1", "").replace(",ep=1", "").split(",schedule")[0]  # noqa: E731
    for r in rows:
        t.add_row(r["table"], r["model"], str(r["gpus"]), short(r["published_config"]),
                  f"{r['published_step_s']:.2f}" + ("" if r["published_fits"] else "!"), short(r["best_config"]),
                  f"{r['best_step_s']:.2f}", f"{r['ratio']:.3f}", str(r["published_rank"] or f">{r['finalists']}"), r["why"],
                  f"{r['search_time_s']:.1f}")
    Console(width=220).print(t)
    worst = max(r["ratio"] for r in rows)
    print(f"worst ratio {worst:.3f} (<= 1 means the planner is never slower than the published configuration)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
