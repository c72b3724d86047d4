"""Cost-model fidelity: predicted vs published step time and TFLOP/s per GPU for every calibration run.

    python benchmarks/fidelity.py [--json] [--reference PATH]

Runs come from shared/reference/calibration_runs.json. Every run is expressed as the `autoplan estimate`
command a user would type (`--commands` prints them) and resolved through the CLI's own path. SC21 rows use
the published configuration with full recomputation and `--stack megatron-2021` (fp16, unfused softmax
attention, fp16 gradients all-reduced after the backward pass without overlap, no distributed optimizer).
Megatron-LM README H100 rows do not publish micro-batch, recomputation or sequence parallelism: we assume
mbs=1, sp=1, zero=1 (distributed optimizer), recompute=selective and `--stack megatron-core` (bf16, flash
attention, --overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap). Errors are signed: (predicted - published) / published.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoplan.estimate_api import estimate_config  # noqa: E402
from autoplan.specs import GPUCalibration, ModelSpec, ParallelConfig, TrainingSpec  # noqa: E402


def _find_reference() -> Path:
    """shared/reference/calibration_runs.json beside the repository (or beside a worktree's parent)."""
    for parent in Path(__file__).resolve().parents[1:]:
        cand = parent / "shared" / "reference" / "calibration_runs.json"
        if cand.exists():
            return cand
    return Path(__file__).resolve().parents[2] / "shared" / "reference" / "calibration_runs.json"


DEFAULT_REF = _find_reference()
_SPEC_DIR = Path(tempfile.mkdtemp(prefix="autoplan-fidelity-"))


def model_file(spec: dict) -> str:
    """Write a model spec as a YAML file (what a user would pass to --model) and return its path."""
    text = yaml.safe_dump(spec, sort_keys=False)
    path = _SPEC_DIR / f"{spec['name']}-{hashlib.sha256(text.encode()).hexdigest()[:8]}.yaml"
    if not path.exists():
        path.write_text(text)
    return str(path)


def run_command(run: dict) -> tuple[list[str], str]:
    """The `autoplan estimate` arguments that express one published run, and its table's name."""
    m = run["model"]
    sc21 = "SC21" in run["source"]
    spec = {"name": m["name"], "num_layers": m["layers"], "hidden_size": m["hidden"],
            "num_attention_heads": m["heads"], "ffn_hidden_size": m["ffn"], "vocab_size": m["vocab"],
            "max_seq_length": m["seq"], "dropout": 0.1, "tie_embeddings": sc21}
    p, b = run["parallel"], run["batch"]
    if sc21:
        vp = p.get("vp") or 1
        cfg = ParallelConfig(tp=p["tp"], pp=p["pp"], dp=p["dp"], vp=vp, mbs=b["micro"], recompute="full",
                             schedule="interleaved" if vp > 1 else "1f1b")
        cluster, stack, table = "dgx-a100-80g", "megatron-2021", "SC21 (A100)"
    else:
        cfg = ParallelConfig(tp=p["tp"], pp=p["pp"], dp=p["dp"], mbs=1, sp=p["tp"] > 1, zero=1,
                             recompute="selective")
        cluster, stack, table = "dgx-h100", "megatron-core", "Megatron-LM H100"
    argv = ["estimate", "--model", model_file(spec), "--cluster", cluster, "--gpus", str(run["cluster"]["num_gpus"]),
            "--global-batch", str(b["global"]), "--seq-len", str(m["seq"]), "--stack", stack,
            "--parallel", short_parallel(cfg)]
    return argv, table


def short_parallel(cfg: ParallelConfig) -> str:
    """The configuration string without the keys at their defaults (what a user would type)."""
    default = ParallelConfig().as_dict()
    return ",".join(f"{k}={v}" for k, v in cfg.as_dict().items() if v is not None and v != default.get(k))


def setting_of(argv: list[str]):
    """Model, cluster, training, configuration and layout exactly as `autoplan <argv>` resolves them."""
    from autoplan.cli import build_parser, load_workload, parallel_of

    args = build_parser().parse_args(argv)
    model, cluster, training, profiles = load_workload(args)
    return model, cluster, training, parallel_of(args, model), args


def run_setting(run: dict) -> tuple[ModelSpec, str, TrainingSpec, ParallelConfig, str]:
    """Model, cluster preset, training and configuration of one published run (through the CLI's path)."""
    argv, table = run_command(run)
    model, _cluster, training, cfg, args = setting_of(argv)
    return model, args.cluster, training, cfg, table


def predict(argv: list[str], calibration: dict[str, GPUCalibration] | None = None):
    """(model, cluster, configuration, Estimate) of `autoplan <argv>`; `calibration` overrides a GPU's
    constants (calibrate_fit.py tries candidate constants this way)."""
    model, cluster, training, cfg, args = setting_of(argv)
    if calibration and cluster.gpu.name in calibration:
        gpu = cluster.gpu.model_copy(update={"calibration": calibration[cluster.gpu.name]})
        cluster = cluster.model_copy(update={"gpu": gpu})
    est = estimate_config(model, cluster, training, cfg)
    return model, cluster, est.config, est


def evaluate(ref_path: Path, calibration: dict[str, GPUCalibration] | None = None) -> list[dict]:
    """One row per published run; `calibration` overrides a GPU's constants (used by calibrate_fit.py)."""
    runs = json.loads(ref_path.read_text())["runs"]
    rows = []
    for run in runs:
        argv, table = run_command(run)
        model, cluster, cfg, est = predict(argv, calibration)
        published_t = run["derived"]["iter_time_s"]
        sc21 = table.startswith("SC21")
        pred_tflops = est.hfu * est.peak_flops / 1e12 if sc21 else est.tflops_per_gpu
        rows.append({
            "table": table, "model": model.name, "gpus": cluster.num_gpus, "config": cfg.to_string(),
            "pp": cfg.pp, "command": "autoplan " + " ".join(argv),
            "published_step_s": published_t, "predicted_step_s": est.step_time_s,
            "step_error": (est.step_time_s - published_t) / published_t,
            "published_tflops": run["reported"]["tflops_per_gpu"], "predicted_tflops": pred_tflops,
            "peak_memory_gib": est.peak_memory_gib, "fits": est.fits,
            "breakdown": {k: round(v, 4) for k, v in est.breakdown.items()},
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, default=DEFAULT_REF)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = evaluate(args.reference)
    summary = {}
    for table in sorted({r["table"] for r in rows}):
        errs = [abs(r["step_error"]) for r in rows if r["table"] == table]
        summary[table] = {"mean_abs_error": statistics.mean(errs), "worst_abs_error": max(errs), "runs": len(errs)}
    allerr = [abs(r["step_error"]) for r in rows]
    summary["all"] = {"mean_abs_error": statistics.mean(allerr), "worst_abs_error": max(allerr), "runs": len(allerr)}
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Cost-model fidelity: predicted vs published")
    for col in ("table", "model", "GPUs", "config", "step pub", "step pred", "err", "TF/s pub", "TF/s pred",
                "mem GiB"):
        t.add_column(col, justify="right" if col not in ("table", "model", "config") else "left")
    for r in rows:
        t.add_row(r["table"], r["model"], str(r["gpus"]), r["config"].split(",schedule")[0].replace(",cp=1,ep=1", ""),
                  f"{r['published_step_s']:.2f}", f"{r['predicted_step_s']:.2f}", f"{100 * r['step_error']:+.1f}%",
                  f"{r['published_tflops']:.0f}", f"{r['predicted_tflops']:.0f}",
                  f"{r['peak_memory_gib']:.1f}" + ("" if r["fits"] else " !"))
    Console(width=170).print(t)
    for k, v in summary.items():
        print(f"{k:18s} mean |err| {100 * v['mean_abs_error']:.2f}%  worst {100 * v['worst_abs_error']:.2f}%  "
              f"({v['runs']} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
