"""Context parallelism priced as autoplan's runtime runs it: measured against predicted step time on this machine.

The runtime's context-parallel attention (runtime.parallelize.ContextParallelAttentionCore) all-gathers K and V,
runs one masked SDPA per query chunk over the keys up to its end (every score of those) and sends the K/V
gradients back by an all-to-all; until session 24 the cost model priced ring attention instead (transfers hidden
behind the attention, the causal half skipped) while the runtime ran one masked SDPA over the whole gathered
sequence. This benchmark plans a few
long-sequence layouts for 2 processes with a cluster measured by `autoplan calibrate` (or --cluster), trains
each for a few steps with `autoplan run`, and prints measured / predicted per layout; the data-parallel layout
is the control (same model, no context parallelism). Last line:

    cp: measured/predicted cp 1.32-1.57 against dp 1.23-1.34 over 8 layouts

Usage: python benchmarks/cp_pricing.py [--cluster cpu.yaml] [--steps 8] [--json]
"""

# ruff: noqa: E402
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

# Two small models whose step is mostly attention at 2048 tokens: a GPT (multi-head attention, learned positions)
# and a Llama (grouped-query attention, RoPE, RMSNorm, SwiGLU)
MODELS = {
    "gpt-2k": "name: gpt-2k\nnum_layers: 2\nhidden_size: 128\nnum_attention_heads: 4\nffn_hidden_size: 512\n"
              "vocab_size: 256\nmax_seq_length: 2048\n",
    "llama-2k": "name: llama-2k\nnum_layers: 2\nhidden_size: 128\nnum_attention_heads: 4\nnum_kv_heads: 2\n"
                "ffn_hidden_size: 384\nvocab_size: 256\nmax_seq_length: 2048\nactivation: swiglu\nnorm: rmsnorm\n"
                "position: rope\ntie_embeddings: false\n",
}
LAYOUTS = ["dp=2", "cp=2", "cp=2,recompute=selective", "cp=2,recompute=full"]
SEQ, BATCH = 2048, 2


def _autoplan(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)


def calibrated_cluster(tmp: Path) -> Path:
    out = tmp / "cpu.yaml"
    res = _autoplan("calibrate", "--nproc", "2", "-o", str(out))
    if res.returncode:
        raise SystemExit(f"calibrate failed:\n{res.stderr}")
    return out


def measure(model: Path, cluster: Path, layout: str, steps: int, tmp: Path) -> dict:
    plan = tmp / f"{model.stem}-{layout}.json"
    res = _autoplan("estimate", "--model", str(model), "--cluster", str(cluster), "--gpus", "2", "--global-batch",
                    str(BATCH), "--seq-len", str(SEQ), "--parallel", f"{layout},mbs=1", "-o", str(plan))
    if res.returncode:
        raise SystemExit(f"estimate {layout} failed:\n{res.stderr}")
    predicted = json.loads(plan.read_text())["prediction"]
    log = tmp / f"{model.stem}-{layout}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = _autoplan("run", str(plan), "--", "--steps", str(steps), "--log-file", str(log), "--quiet", env=env)
    if res.returncode:
        raise SystemExit(f"run {layout} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if r.get("step", 0) >= 3 and r.get("step_time_s")]
    measured = statistics.median(times)
    return {"model": model.stem, "layout": layout, "predicted_s": predicted["step_time_s"],
            "measured_s": measured, "ratio": measured / predicted["step_time_s"],
            "cp_comm_s": predicted["breakdown"].get("tp_cp_ep_comm", 0.0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", help="cluster YAML (default: measured now by `autoplan calibrate --nproc 2`)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cluster = Path(args.cluster).resolve() if args.cluster else calibrated_cluster(tmp)
        for name, text in MODELS.items():
            spec = tmp / f"{name}.yaml"
            spec.write_text(text)
            for layout in LAYOUTS:
                r = measure(spec, cluster, layout, args.steps, tmp)
                rows.append(r)
                print(f"{r['model']:9s} {r['layout']:26s} predicted {r['predicted_s'] * 1e3:7.1f} ms  measured "
                      f"{r['measured_s'] * 1e3:7.1f} ms  measured/predicted {r['ratio']:.2f}  (cp comm "
                      f"{r['cp_comm_s'] * 1e3:.1f} ms)", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    cp = [r["ratio"] for r in rows if r["layout"].startswith("cp")]
    dp = [r["ratio"] for r in rows if not r["layout"].startswith("cp")]
    print(f"cp: measured/predicted cp {min(cp):.2f}-{max(cp):.2f} against dp {min(dp):.2f}-{max(dp):.2f} over "
          f"{len(rows)} layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
