"""Cost-model fidelity: predicted vs published step time and TFLOP/s per GPU for every calibration run.

    python benchmarks/fidelity.py [--json] [--reference PATH] [--decompose] [--plot PNG] [--commands]

Runs come from shared/reference/calibration_runs.json. Every run is expressed as the `autoplan estimate`
command a user would type (`--commands` prints them) and resolved through the CLI's own path. SC21 rows use
the published configuration with full recomputation and `--stack megatron-2021` (fp16, unfused softmax
attention, no distributed optimizer; fp16 gradients all-reduced after the backward pass, except where NVIDIA's repro
script runs torch DDP, which overlaps the all-reduce with the backward: 1.7B-18B).
Megatron-LM README H100 rows do not publish micro-batch, recomputation or sequence parallelism: we assume
mbs=1, sp=1, zero=1 (distributed optimizer), recompute=selective and `--stack megatron-core` (bf16, flash
attention, --overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap). Errors are signed: (predicted - published) / published.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
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


_SC21_TORCH_DDP = {"GPT-1.7B", "GPT-3.6B", "GPT-7.5B", "GPT-18.4B"}  # DDP=torch in run_table_1.sh (session 36)


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
        # NVIDIA's repro script (examples/academic_paper_scripts/sc21/run_table_1.sh, the source of vp and mbs)
        # runs 1.7B-18B with --DDP-impl torch: torch DDP all-reduces its buckets during the (last micro-batch's,
        # model.no_sync before it) backward; 39B and up with Megatron's local DDP, after the backward
        overlap = m["name"] in _SC21_TORCH_DDP
    else:
        cfg = ParallelConfig(tp=p["tp"], pp=p["pp"], dp=p["dp"], mbs=1, sp=p["tp"] > 1, zero=1,
                             recompute="selective")
        cluster, stack, table = "dgx-h100", "megatron-core", "Megatron-LM H100"
    argv = ["estimate", "--model", model_file(spec), "--cluster", cluster, "--gpus", str(run["cluster"]["num_gpus"]),
            "--global-batch", str(b["global"]), "--seq-len", str(m["seq"]), "--stack", stack,
            "--parallel", short_parallel(cfg)]
    if sc21 and overlap:
        argv += ["--stack-set", "overlap_grad_reduce=true"]
    return argv, table


def short_parallel(cfg: ParallelConfig) -> str:
    """The configuration string without the keys at their defaults (what a user would type)."""
    default = ParallelConfig().as_dict()
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.as_dict().items() if v is not None and v != default.get(k))


def setting_of(argv: list[str]):
    """Model, cluster, training, configuration and layout exactly as `autoplan <argv>` resolves them."""
    from autoplan.cli import build_parser, load_workload, parallel_of

    args = build_parser().parse_args(argv)
    with contextlib.redirect_stderr(io.StringIO()):  # the CLI's notes (e.g. a preset grown by --gpus)
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


HELDOUT = Path(__file__).resolve().parent / "published" / "heldout_runs.yaml"
# runs compared only with each other (their absolute level rests on something unpublished): `--pairs`
PAIR_RUNS = Path(__file__).resolve().parent / "published" / "pair_runs.yaml"
ROOT = Path(__file__).resolve().parents[1]


def heldout_command(run: dict) -> list[str]:
    """The `autoplan estimate` arguments of one held-out run (benchmarks/published/heldout_runs.yaml)."""
    cluster = run["cluster"]
    if cluster.endswith((".yaml", ".yml")):
        cluster = str(ROOT / cluster)
    argv = ["estimate", "--model", model_file(run["model"]), "--cluster", cluster, "--gpus", str(run["gpus"]),
            "--global-batch", str(run["global_batch"]), "--seq-len", str(run["seq_len"]), "--stack", run["stack"],
            "--parallel", run["parallel"]]
    for key in ("stack_set", "layout", "uneven", "dtype"):
        if run.get(key):
            argv += ["--" + key.replace("_", "-"), str(run[key])]
    return argv


def _sc21_hw_flops(spec: dict, batch: int, seq: int) -> float:
    """Hardware FLOPs per step with full recomputation, SC21 eq. 3 (Megatron-DeepSpeed's logged TFLOP/s)."""
    layers, h, vocab = spec["num_layers"], spec["hidden_size"], spec["vocab_size"]
    return 96 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def published_step(run: dict, est) -> float:
    """The published step time, or the one implied by the published utilisation (see the YAML's header)."""
    pub = run["published"]
    if "step_s" in pub:
        return float(pub["step_s"])
    if "tokens_per_gpu_s" in pub:  # torchtitan's "WPS": tokens per second per GPU
        return run["global_batch"] * run["seq_len"] / (pub["tokens_per_gpu_s"] * run["gpus"])
    if "mfu" in pub:  # autoplan's model FLOPs are Korthikanti eq. 7, the convention of these sources
        return est.model_flops / (pub["mfu"] * est.peak_flops * est.num_gpus)
    flops = _sc21_hw_flops(run["model"], run["global_batch"], run["seq_len"])
    return flops / (pub["hw_tflops"] * 1e12 * run["gpus"])


def evaluate_heldout(path: Path = HELDOUT, calibration: dict[str, GPUCalibration] | None = None,
                     table: str = "held-out") -> list[dict]:
    """One row per held-out published run, predicted through the CLI's path."""
    runs = yaml.safe_load(path.read_text())["runs"]
    rows = []
    for run in runs:
        argv = heldout_command(run)
        model, cluster, cfg, est = predict(argv, calibration)
        pub = published_step(run, est)
        rows.append({
            "table": table, "model": run["name"], "published_memory_gib": run["published"].get("memory_gib"),
            "gpus": cluster.num_gpus, "pp": cfg.pp,
            "config": cfg.to_string(), "stack": run["stack"], "source": run["source"],
            "command": "autoplan " + " ".join(argv), "published_step_s": pub, "predicted_step_s": est.step_time_s,
            "step_error": (est.step_time_s - pub) / pub, "published_tflops": est.model_flops / pub / est.num_gpus / 1e12,
            "predicted_tflops": est.tflops_per_gpu, "peak_memory_gib": est.peak_memory_gib, "fits": est.fits,
            "breakdown": {k: round(v, 4) for k, v in est.breakdown.items()},
        })
    return rows


def decompose(path: Path = HELDOUT) -> list[dict]:
    """Per held-out run, the predicted step taken apart: micro-batches, the per-micro-batch forward/backward of
    the first, a middle and the last (virtual) stage, one pipeline message, and the step's breakdown. Runs of
    one model from one source at several GPU counts (same stage costs, fewer micro-batches) also get the line
    T = a*m + b fitted through the published and through the predicted steps: a is the time per micro-batch, b
    what each step pays once (fill and drain, gradient sync, optimizer)."""
    from autoplan.cost_models.estimate import num_microbatches, pipeline_p2p_time

    out = []
    for run in yaml.safe_load(path.read_text())["runs"]:
        argv = heldout_command(run)
        model, cluster, training, _cfg, _args = setting_of(argv)
        _, _, cfg, est = predict(argv)
        st = est.stages
        p2p = pipeline_p2p_time(cluster, training, hidden=model.hidden_size, pp=cfg.pp, tp=cfg.tp, cp=cfg.cp,
                                dp=cfg.dp, mbs=cfg.mbs, sp=cfg.sp)
        pick = {"first": st[0], "middle": st[len(st) // 2], "last": st[-1]}
        out.append({
            "model": run["name"], "family": (run["source"], run["model"]["name"]), "gpus": cluster.num_gpus,
            "config": cfg.to_string(),
            "m": num_microbatches(cfg, training), "published_step_s": published_step(run, est),
            "predicted_step_s": est.step_time_s, "p2p_ms": 1e3 * p2p,
            "stages_ms": {k: {"blocks": s.layout.layers[1] - s.layout.layers[0], "fwd": 1e3 * s.fwd_s,
                              "bwd": 1e3 * s.bwd_s, "recompute": 1e3 * s.recompute_s, "tp_comm": 1e3 * s.comm_s,
                              "p2p": 1e3 * s.p2p_s} for k, s in pick.items()},
            "breakdown": {k: round(v, 3) for k, v in est.breakdown.items()},
        })
    fam: dict[str, list[dict]] = {}
    for r in out:
        fam.setdefault(r["family"], []).append(r)
    for rs in fam.values():
        if len({r["m"] for r in rs}) < 2:
            continue
        for key in ("published_step_s", "predicted_step_s"):
            ms, ts = [r["m"] for r in rs], [r[key] for r in rs]
            mm, tt = statistics.mean(ms), statistics.mean(ts)
            a = sum((x - mm) * (y - tt) for x, y in zip(ms, ts)) / sum((x - mm) ** 2 for x in ms)
            for r in rs:
                r.setdefault("line", {})[key.split("_")[0]] = {"a_ms_per_mb": 1e3 * a, "b_s": tt - a * mm}
    return out


def print_decomposition(rows: list[dict]) -> None:
    for r in rows:
        err = (r["predicted_step_s"] - r["published_step_s"]) / r["published_step_s"]
        print(f"\n{r['model']}  ({r['gpus']} GPUs, m={r['m']}, one p2p message {r['p2p_ms']:.2f} ms)  published "
              f"{r['published_step_s']:.2f} s, predicted {r['predicted_step_s']:.2f} s ({100 * err:+.1f}%)")
        print("  " + r["config"])
        for k, s in r["stages_ms"].items():
            print(f"  {k:6s} stage {s['blocks']:3d} blocks: fwd {s['fwd']:7.1f} ms  bwd {s['bwd']:7.1f} ms  (recompute "
                  f"{s['recompute']:.1f}, exposed tp {s['tp_comm']:.1f}, p2p held {s['p2p']:.1f})")
        print("  breakdown s: " + "  ".join(f"{k} {v:.2f}" for k, v in r["breakdown"].items()))
        if "line" in r:
            pub, pred = r["line"]["published"], r["line"]["predicted"]
            print(f"  T = a*m + b over this model's runs: published a = {pub['a_ms_per_mb']:.1f} ms, b = "
                  f"{pub['b_s']:.2f} s; predicted a = {pred['a_ms_per_mb']:.1f} ms, b = {pred['b_s']:.2f} s")


def summarize(rows: list[dict]) -> dict:
    summary = {}
    for table in sorted({r["table"] for r in rows}):
        errs = [abs(r["step_error"]) for r in rows if r["table"] == table]
        summary[table] = {"mean_abs_error": statistics.mean(errs), "worst_abs_error": max(errs), "runs": len(errs)}
    allerr = [abs(r["step_error"]) for r in rows]
    summary["all"] = {"mean_abs_error": statistics.mean(allerr), "worst_abs_error": max(allerr), "runs": len(allerr)}
    return summary


GPU_BUCKETS = ((1, 128), (129, 512), (513, 2048), (2049, 4096), (4097, 1 << 30))
PP_BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 1 << 30))


def _label(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else (f">={lo}" if hi >= 1 << 30 else f"{lo}-{hi}")


def trend(rows: list[dict], key: str, buckets) -> list[dict]:
    """Signed mean and mean |error| per bucket of `key` (GPUs or pp): a growing trend shows at a glance."""
    out = []
    for lo, hi in buckets:
        sel = [r["step_error"] for r in rows if lo <= r[key] <= hi]
        if sel:
            out.append({key: _label(lo, hi), "runs": len(sel), "mean_error": statistics.mean(sel),
                        "mean_abs_error": statistics.mean(abs(e) for e in sel), "worst_abs_error": max(map(abs, sel))})
    return out


def by_source(rows: list[dict]) -> dict[str, dict]:
    """Held-out errors per publication (the source's text before its first parenthesis: 'Smith et al. 2022')."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(r["source"].split(" (")[0], []).append(r["step_error"])
    return {k: {"runs": len(e), "mean_error": statistics.mean(e), "mean_abs_error": statistics.mean(map(abs, e)),
                "worst_abs_error": max(map(abs, e))} for k, e in groups.items()}


def plot_trend(rows: list[dict], path: str) -> None:
    """Signed step-time error against GPUs and against pp, one marker per run, by table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    markers = {"SC21 (A100)": "o", "Megatron-LM H100": "s", "held-out": "^"}
    for ax, key, xlabel in ((axes[0], "gpus", "GPUs"), (axes[1], "pp", "pipeline stages (pp)")):
        for table in sorted({r["table"] for r in rows}):
            sel = [r for r in rows if r["table"] == table]
            ax.scatter([r[key] for r in sel], [100 * r["step_error"] for r in sel], label=table,
                       marker=markers.get(table, "x"))
        ax.axhspan(-7, 7, color="0.9", zorder=0)
        ax.axhline(0, color="0.4", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("step time error, % (predicted - published)")
    axes[0].legend(fontsize=8)
    fig.suptitle("autoplan cost model vs published runs (band: +/-7%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# Pairs of published runs that differ in one thing (or as few as the record allows): the published ratio of their
# step times against the predicted one isolates what the model gets wrong about that one thing, free of whatever
# both runs share (session 7). (label, run A, run B, what differs).
PAIRS = (
    ("data parallelism 1 -> 8, nothing else (Megatron 2022, 530B, selective)",
     "GPT-530B (Korthikanti 2022)", "GPT-530B dp=8 (Korthikanti 2022)"),
    ("stack 2021 -> 2022: same 530B config (tp8 pp35 vp3, m=280, full recompute, no sp; dp 9 -> 8)",
     "GPT-529.6B", "GPT-530B dp=8 full recompute (Korthikanti 2022)"),
    ("stack 2021 -> 2022: same 1T config (tp8 pp64, m=512, full recompute, no sp; dp 6 -> 1)",
     "GPT-1008.0B", "GPT-1T full recompute (Korthikanti 2022)"),
    ("full -> selective recompute + sp (Megatron 2022, 22B)",
     "GPT-22B full recompute (Korthikanti 2022)", "GPT-22B (Korthikanti 2022)"),
    ("full -> selective recompute + sp (Megatron 2022, 175B)",
     "GPT-175B full recompute (Korthikanti 2022)", "GPT-175B (Korthikanti 2022)"),
    ("full -> selective recompute + sp (Megatron 2022, 530B)",
     "GPT-530B full recompute (Korthikanti 2022)", "GPT-530B (Korthikanti 2022)"),
    ("full -> selective recompute + sp (Megatron 2022, 1T)",
     "GPT-1T full recompute (Korthikanti 2022)", "GPT-1T (Korthikanti 2022)"),
    ("stack Megatron 2022 -> Megatron-DeepSpeed (MT-NLG): 530B tp8 pp35 dp8, full recompute; m 280 -> 240, "
     "vp 3 -> 1", "GPT-530B dp=8 full recompute (Korthikanti 2022)", "MT-NLG 530B (2240 GPUs)"),
    ("MT-NLG dp 8 -> 12 (m 240 -> 160)", "MT-NLG 530B (2240 GPUs)", "MT-NLG 530B (3360 GPUs)"),
    ("Llama 3 405B dp 64 -> 128 (m 32 -> 16)", "Llama 3 405B (8192 GPUs)", "Llama 3 405B (16384 GPUs)"),
)


def pairs(rows: list[dict], more: tuple = ()) -> list[dict]:
    """Published vs predicted step-time ratio B/A for each of PAIRS (and `more`) present in `rows`; where both
    runs publish their memory, its change B - A too."""
    by_name = {r["model"]: r for r in rows}
    out = []
    for label, a, b in (*PAIRS, *more):
        if a not in by_name or b not in by_name:
            continue
        ra, rb = by_name[a], by_name[b]
        pub = rb["published_step_s"] / ra["published_step_s"]
        pred = rb["predicted_step_s"] / ra["predicted_step_s"]
        out.append({"pair": label, "a": a, "b": b, "published_ratio": pub, "predicted_ratio": pred,
                    "published_delta_s": rb["published_step_s"] - ra["published_step_s"],
                    "predicted_delta_s": rb["predicted_step_s"] - ra["predicted_step_s"],
                    "residual": pred / pub - 1})
        if ra.get("published_memory_gib") is not None and rb.get("published_memory_gib") is not None:
            out[-1].update(published_memory_delta_gib=rb["published_memory_gib"] - ra["published_memory_gib"],
                           predicted_memory_delta_gib=rb["peak_memory_gib"] - ra["peak_memory_gib"])
    return out


def pair_runs(path: Path = PAIR_RUNS) -> tuple[list[dict], tuple]:
    """The runs compared only with each other (table 'pairs only') and their pairs."""
    return evaluate_heldout(path, table="pairs only"), tuple(tuple(p) for p in yaml.safe_load(path.read_text())["pairs"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, default=DEFAULT_REF)
    ap.add_argument("--heldout", type=Path, default=HELDOUT, help="held-out published runs (YAML)")
    ap.add_argument("--plot", metavar="PNG", help="draw the error against GPUs and pp into this PNG")
    ap.add_argument("--commands", action="store_true", help="print the autoplan command of every run")
    ap.add_argument("--decompose", action="store_true",
                    help="take every held-out prediction apart: stage costs, p2p, breakdown, per-micro-batch line")
    ap.add_argument("--pairs", action="store_true",
                    help="published runs that differ in one thing: published vs predicted step-time ratio")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.decompose:
        dec = decompose(args.heldout)
        if args.json:
            print(json.dumps(dec, indent=1))
        else:
            print_decomposition(dec)
        return 0
    rows = evaluate(args.reference) + evaluate_heldout(args.heldout)
    if args.pairs:
        only, more = pair_runs()
        prs = pairs(rows + only, more)
        if args.json:
            print(json.dumps({"pairs": prs, "pair_only_rows": only}, indent=1))
            return 0
        for p in prs:
            mem = (f"; memory B-A published {p['published_memory_delta_gib']:+.1f} GiB, predicted "
                   f"{p['predicted_memory_delta_gib']:+.1f}" if "published_memory_delta_gib" in p else "")
            print(f"{p['pair']}\n    B/A published {p['published_ratio']:.3f} ({p['published_delta_s']:+.2f} s), "
                  f"predicted {p['predicted_ratio']:.3f} ({p['predicted_delta_s']:+.2f} s): "
                  f"residual {100 * p['residual']:+.1f}%{mem}")
        print(f"\nruns compared only with each other ({PAIR_RUNS.name}; absolute errors for context, not a test):")
        for r in only:
            print(f"    {r['model']}: published {r['published_step_s']:.3f} s, predicted {r['predicted_step_s']:.3f} s "
                  f"({100 * r['step_error']:+.1f}%), memory {r['peak_memory_gib']:.1f} GiB predicted"
                  + (f", {r['published_memory_gib']:.1f} published" if r["published_memory_gib"] else ""))
        return 0
    summary = summarize(rows)
    trends = {"by_gpus": trend(rows, "gpus", GPU_BUCKETS), "by_pp": trend(rows, "pp", PP_BUCKETS),
              "heldout_by_gpus": trend([r for r in rows if r["table"] == "held-out"], "gpus", GPU_BUCKETS),
              "heldout_by_source": by_source([r for r in rows if r["table"] == "held-out"])}
    if args.plot:
        plot_trend(rows, args.plot)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary, "trend": trends}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console(width=170)
    t = Table(title="Cost-model fidelity: predicted vs published")
    for col in ("table", "model", "GPUs", "config", "step pub", "step pred", "err", "TF/s pub", "TF/s pred",
                "mem GiB"):
        t.add_column(col, justify="right" if col not in ("table", "model", "config") else "left")
    for r in rows:
        t.add_row(r["table"], r["model"], str(r["gpus"]), short_config(r["config"]),
                  f"{r['published_step_s']:.2f}", f"{r['predicted_step_s']:.2f}", f"{100 * r['step_error']:+.1f}%",
                  f"{r['published_tflops']:.0f}", f"{r['predicted_tflops']:.0f}",
                  f"{r['peak_memory_gib']:.1f}" + ("" if r["fits"] else " !"))
    con.print(t)
    for name, key in (("by_gpus", "gpus"), ("by_pp", "pp"), ("heldout_by_gpus", "gpus")):
        tt = Table(title=f"error {name.replace('_', ' ')} (all tables)" if name != "heldout_by_gpus"
                   else "held-out error by gpus")
        for col in (key, "runs", "mean (signed)", "mean |err|", "worst |err|"):
            tt.add_column(col, justify="right")
        for b in trends[name]:
            tt.add_row(b[key], str(b["runs"]), f"{100 * b['mean_error']:+.1f}%", f"{100 * b['mean_abs_error']:.1f}%",
                       f"{100 * b['worst_abs_error']:.1f}%")
        con.print(tt)
    for k, v in summary.items():
        print(f"{k:18s} mean |err| {100 * v['mean_abs_error']:.2f}%  worst {100 * v['worst_abs_error']:.2f}%  "
              f"({v['runs']} runs)")
    for k, v in trends["heldout_by_source"].items():
        print(f"  held-out, {k:24s} signed {100 * v['mean_error']:+.1f}%  mean |err| {100 * v['mean_abs_error']:.1f}%"
              f"  worst {100 * v['worst_abs_error']:.1f}%  ({v['runs']} runs)")
    if args.commands:
        for r in rows:
            print(f"# {r['model']} ({r['table']})\n{r['command']}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def short_config(config: str) -> str:
    return (config.split(",schedule")[0].replace(",cp=1,ep=1", "") +
            ("," + config.split(",schedule=")[1].split(",", 1)[1] if ",layout=" in config else ""))


if __name__ == "__main__":
    raise SystemExit(main())
