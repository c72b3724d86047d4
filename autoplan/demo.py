"""`autoplan demo` (what `make demo` runs): the main job end to end on built-in examples.

1. Plan GPT-3 175B on 1,024 A100s (the search when it is installed, otherwise the published Megatron
   configuration through the cost model) and show the prediction.
2. Plan a tiny GPT for this machine (`local-cpu`, 4 gloo processes), write the plan, and train it for a few
   steps with `autoplan run`, printing the predicted and the measured step time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from autoplan.cost_models.specs import TrainingSpec

from .plan import SCHEMA_VERSION
from .specs import load_cluster, load_model


def _search_available() -> bool:
    return importlib.util.find_spec("autoplan.search") is not None


def _runtime_available() -> bool:
    return importlib.util.find_spec("autoplan.runtime.train") is not None


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    as_json = getattr(args, "json", False)
    con = Console(stderr=as_json)  # under --json the story goes to stderr and one JSON object to stdout
    summary: dict = {}
    con.rule("[bold]1. Plan GPT-3 175B on 1,024 A100-80GB (batch 1536 x 2048)")
    model = load_model("gpt3-175b")
    cluster = load_cluster("dgx-a100-80g", gpus=1024)
    training = TrainingSpec(global_batch_size=1536, seq_length=2048, dtype="bf16")
    if _search_available():
        from .search import search
        from .search.cli import render_search

        result = search(model, cluster, training, top=5)
        render_search(con, result, model, cluster, training, None)
        summary["gpt3_175b"] = _plan_summary(result.plan)
    else:
        from .estimate_api import estimate_config
        from .report import render_estimate

        est = estimate_config(model, cluster, training, "tp=8,pp=8,vp=3,mbs=1,sp=1,zero=1,recompute=selective")
        render_estimate(con, model, cluster, training, est)

    con.rule("[bold]2. Plan and train a tiny GPT on this machine (local-cpu, 4 processes)")
    tiny = load_model("tiny-gpt")
    local = load_cluster("local-cpu")
    tiny_train = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    if _search_available():
        from .search import search

        plan = search(tiny, local, tiny_train, top=3).plan
    else:
        from .api import make_plan

        plan = make_plan(tiny, local, tiny_train, "tp=2,pp=2", kernels="torch")
    out = Path(tempfile.mkdtemp(prefix="autoplan-demo-"))
    plan_path = plan.save(out / "tiny-plan.json")
    from .inspect.common import short_config

    con.print(f"plan {short_config(plan.parallel)} ({plan.short_hash}), written to {plan_path}")
    con.print(f"predicted step time {plan.prediction.step_time_s:.4f} s, peak memory "
              f"{plan.prediction.memory_gib['peak']:.3f} GiB per process")
    summary["tiny"] = {**_plan_summary(plan), "plan_file": str(plan_path)}
    if args.no_run:
        return _done(summary, as_json)
    if not _runtime_available():
        con.print("[yellow]runtime not installed in this build; skipping the training run[/]")
        return _done(summary, as_json)
    log = out / "train.jsonl"
    cmd = [sys.executable, "-m", "autoplan.cli", "run", str(plan_path), "--nproc-per-node",
           str(plan.world_size), "--", "--steps", "20", "--lr", "3e-3", "--log", str(log)]
    con.print("$ autoplan " + " ".join(cmd[3:]))
    rc = subprocess.call(cmd, stdout=sys.stderr if as_json else None)
    if rc != 0:
        con.print(f"[red]training exited with status {rc}[/]")
        if as_json:
            print(json.dumps({"schema_version": SCHEMA_VERSION, "error": f"training exited with status {rc}",
                              "fix": "run the printed `autoplan run` command to see its output"}))
        return rc
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steady = rows[1:] or rows
    measured = sorted(r["step_time_s"] for r in steady)[len(steady) // 2]
    con.print(f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} over {len(rows)} steps")
    # the run's own closing line ("done: ...") gave the step time against the prediction (the same median)
    con.print(f"measured / predicted = {measured / plan.prediction.step_time_s:.2f} (local-cpu: 4 processes share "
              "2 cores; the local-cpu preset is this machine's, measured once: `autoplan calibrate` and "
              "`autoplan tune` fit yours)")
    summary["tiny"].update(steps=len(rows), loss_first=rows[0]["loss"], loss_last=rows[-1]["loss"],
                           measured_step_time_s=measured)
    return _done(summary, as_json)


def _plan_summary(plan) -> dict:
    return {"plan": plan.short_hash, "parallel": plan.parallel.as_dict(),
            "step_time_s": plan.prediction.step_time_s, "mfu": plan.prediction.mfu,
            "memory_gib": plan.prediction.memory_gib}


def _done(summary: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"schema_version": SCHEMA_VERSION, **summary}, indent=1, default=float))
    return 0
