"""Runtime benchmark: measured vs predicted step time of plans run with torchrun on this machine.

    python benchmarks/runtime.py [--model tiny-llama] [--nproc 4] [--steps 6] [--configs "dp=4" "tp=2,pp=2" ...]
                                 [--global-batch 8] [--seq-len 64] [--dtype fp32] [--json]

For every configuration: a Plan from the planner's API (`make_plan`, the configuration fixed) on the
`local-cpu` cluster resized to --nproc ranks, one `torchrun -m autoplan.runtime.train` launch with --log, and the
median step time of the steps after the first (warm-up: shape inference, DTensor caches, allocator).
Prints measured, predicted and their ratio; --json prints one object per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoplan.api import make_plan  # noqa: E402
from autoplan.specs import TrainingSpec, load_cluster, load_model  # noqa: E402

DEFAULT_CONFIGS = {
    1: ["tp=1"],
    2: ["dp=2", "tp=2", "pp=2", "cp=2"],
    4: ["dp=4", "dp=2,tp=2", "tp=2,pp=2", "dp=2,pp=2", "tp=2,pp=2,sp=1", "dp=4,zero=3"],
}


def run_one(model: str, nproc: int, config: str, training: TrainingSpec, steps: int, kernels: str,
            workdir: Path) -> dict:
    plan = make_plan(load_model(model), load_cluster("local-cpu").with_gpus(nproc), training, config,
                     kernels=kernels)
    plan_path = plan.save(workdir / f"plan-{plan.short_hash}.json")
    log = workdir / f"log-{plan.short_hash}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), "-m", "autoplan.runtime.train", "--",
           "--plan", str(plan_path), "--steps", str(steps), "--log", str(log), "--quiet"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"parallel": config, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[1:]] or [rows[0]["step_time_s"]]
    measured = statistics.median(times)
    predicted = plan.prediction.step_time_s
    return {
        "parallel": plan.parallel.to_string(),
        "plan": plan.short_hash,
        "measured_step_time_s": measured,
        "predicted_step_time_s": predicted,
        "ratio_measured_over_predicted": measured / predicted if predicted else None,
        "tokens_per_s": training.global_batch_size * training.seq_length / measured,
        "final_loss": rows[-1]["loss"],
        "peak_memory_gib": max(r["peak_memory_gib"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--kernels", default="torch", choices=["torch", "fused"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    configs = args.configs or DEFAULT_CONFIGS.get(args.nproc, ["tp=1"])
    training = TrainingSpec(global_batch_size=args.global_batch, seq_length=args.seq_len, dtype=args.dtype)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in configs:
            r = run_one(args.model, args.nproc, cfg, training, args.steps, args.kernels, Path(tmp))
            results.append(r)
            if args.json:
                print(json.dumps(r), flush=True)
            elif "error" in r:
                print(f"{cfg:<40} FAILED: {r['error']}", flush=True)
            else:
                ratio = r["ratio_measured_over_predicted"]
                print(f"{r['parallel']:<80} measured {r['measured_step_time_s'] * 1e3:8.1f} ms  predicted "
                      f"{r['predicted_step_time_s'] * 1e3:8.1f} ms  ratio {ratio if ratio is None else f'{ratio:.2f}'}",
                      flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
