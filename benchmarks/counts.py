"""Predicted vs measured FLOPs, communication bytes and memory over a matrix of layouts (issue 12).

    python benchmarks/counts.py [--nproc 4] [--json] [--layouts tiny-gpt:dp=4 ...] [--steps-before 2]
                                [--dtype bf16]

One torchrun launch runs every layout (each with the runtime's Trainer): a warm-up step, then one step under
`autoplan.runtime.measure` (FlopCounterMode's formulas by phase, every c10d/functional collective by mesh
dimension, MemTracker's categories). The prediction is `autoplan.cost_models.counts.predict_counts` on the same
plan. Per layout it prints, summed over ranks, FLOPs by phase and bytes per (collective, mesh dimension), and per
rank the memory categories and peak; the last line is

    counts: worst flops A% bytes B% memory C% over N layouts

(worst relative error over layouts: FLOPs and bytes as the layout's totals; memory as the worst rank's peak),
preceded by the worst error of each memory category and the layouts whose number of collective calls (per
collective and mesh dimension, summed over ranks) differs from the prediction. The categories are compared at the moment the model
prices, in its phase (forward or backward: `at_moment`); the peak as measured, whichever phase holds it.
Targets (issue 12): FLOPs and bytes within 2%, memory per category and the peak within 10%. What is left is
explained in docs/cost_model.md ("Agreement"). `--dtype bf16` runs the matrix as autoplan's runtime trains in 16
bits (torch.autocast over fp32 parameters): the bytes on the wire are the model's to match there too; the memory
categories are not (CPU autocast casts and keeps other tensors than CUDA's, which the model follows: session 12's
H200 census).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GBS, SEQ = 8, 64
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")

MATRIX = [
    "tiny-gpt:dp=4", "tiny-gpt:dp=4,zero=1", "tiny-gpt:dp=4,zero=2", "tiny-gpt:dp=4,zero=3",
    "tiny-gpt:dp=2,tp=2", "tiny-gpt:dp=2,tp=2,sp=1", "tiny-gpt:dp=2,tp=2,sp=1,recompute=full", "tiny-gpt:cp=2,dp=2",
    "tiny-gpt:pp=2,dp=2", "tiny-gpt:pp=2,vp=2,dp=2,schedule=interleaved", "tiny-gpt:pp=4",
    # three micro-batches on pp=2: the interleaved schedule in one round of three (pipeline.microbatch_group)
    "tiny-gpt:pp=2,vp=2,dp=2,mbs=1@gbs=6",
    "tiny-gpt:dp=4,recompute=selective", "tiny-gpt:dp=4,recompute=full",
    "tiny-gpt:tp=2,pp=2,recompute=full", "tiny-gpt:cp=2,tp=2,sp=1,recompute=selective",
    "tiny-gpt:pp=2,dp=2,zero=2", "tiny-gpt:pp=2,dp=2,zero=3",
    "tiny-moe:dp=4,ep=4", "tiny-moe:dp=4,ep=2,zero=1", "tiny-moe:dp=2,tp=2,ep=2", "tiny-moe:pp=2,dp=2,ep=2",
    # one micro-batch: gradients made in the backward (cost_models.estimate.grads_made_in_backward), or DDP's kept
    "tiny-gpt:tp=4,mbs=8", "tiny-gpt:dp=4,zero=1,mbs=2", "tiny-gpt:dp=2,tp=2,mbs=4", "tiny-gpt:dp=4,mbs=2",
    "tiny-gpt:dp=4,zero=3,recompute=full,mbs=2", "tiny-gpt:dp=4,zero=1,recompute=full,mbs=2",
    # a partly full stage: the other blocks recompute their attention core (autoplan's stack) or nothing
    # (Megatron's block method, TrainingSpec.partial_recompute)
    "tiny-gpt:dp=4,recompute=full,recompute_layers=2", "tiny-gpt:dp=4,recompute=full,recompute_layers=2"
    "@partial_recompute=rest-none",
]




def case_parts(case: str, default_gbs: int = GBS) -> tuple[str, str, int, dict[str, str]]:
    """"model:config", optionally followed by "@gbs=N" (a global batch other than the matrix's) and "@knob=value"
    (a stack knob of the TrainingSpec, e.g. "@partial_recompute=rest-none") -> (model, config, gbs, knobs)."""
    name, config = case.split(":", 1)
    config, *extra = config.split("@")
    knobs = dict(item.split("=", 1) for item in extra)
    batch = knobs.pop("gbs", None)
    return name, config, int(batch) if batch else default_gbs, knobs


# ------------------------------------------------------------------------------------------------ worker


def run_case(case: str, world: int, steps_before: int, sites: bool = False, dtype: str = "fp32") -> dict | None:
    import torch
    import torch.distributed as dist

    from autoplan.api import make_plan
    from autoplan.runtime.data import SyntheticDataset
    from autoplan.runtime.engine import Trainer
    from autoplan.runtime.measure import profile_record
    from autoplan.runtime.parallel_dims import ParallelDims
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    name, config, gbs, knobs = case_parts(case)
    spec = load_model(name).model_copy(update={"dropout": 0.0})
    training = TrainingSpec(global_batch_size=gbs, seq_length=SEQ, dtype=dtype, **knobs)
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(world), training, config, kernels="torch")
    dims = ParallelDims.from_plan(plan, world).build_mesh()
    trainer = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
    data = SyntheticDataset(spec.vocab_size, SEQ, gbs, seed=0)
    for s in range(steps_before):
        trainer.step(data.batch(s))
    _, rec = profile_record(trainer, steps_before + 1, data.batch(steps_before), sites)
    dist.barrier()
    return rec if dist.get_rank() == 0 else None


def worker(out: str, cases: list[str], steps_before: int, sites: bool = False, dtype: str = "fp32") -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            rec = run_case(case, world, steps_before, sites, dtype)
            if rank == 0:
                rec.update(case=case, seconds=time.perf_counter() - t0)
                results.append(rec)
        except Exception as e:  # one broken layout must not hide the others' numbers
            if rank == 0:
                results.append({"case": case, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()[-3000:]})
            dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------ comparison


def rel(pred: float, meas: float) -> float:
    if meas == 0:
        return 0.0 if pred == 0 else 1.0
    return abs(pred - meas) / abs(meas)


def compare(rec: dict) -> dict:
    """The layout's totals and worst errors: FLOPs per phase and bytes per (collective, mesh dim) summed over
    ranks; memory per rank (each category and the peak)."""
    ranks = rec["ranks"]
    flops = {}
    for ph in ("forward", "backward", "recompute"):
        flops[ph] = (sum(r["predicted"]["flops"][ph] for r in ranks), sum(r["measured"]["flops"][ph] for r in ranks))
    comm: dict[tuple[str, str], list[int]] = {}
    for side, i in (("predicted", 0), ("measured", 1)):
        for r in ranks:
            for c in r[side]["comm"]:
                e = comm.setdefault((c["collective"], c["mesh_dim"]), [0, 0, 0, 0])
                e[i] += c["bytes"]
                e[2 + i] += c["count"]
    tot_p = sum(v[0] for v in comm.values())
    tot_m = sum(v[1] for v in comm.values())
    mem_rows, mem_err = [], 0.0
    cat_errs = dict.fromkeys(CATEGORIES, 0.0)
    for r in ranks:
        p, m = r["predicted"]["memory_bytes"], r["measured"]["memory_bytes"]
        at, measured_phase = at_moment(r)
        mem_rows.append((r["rank"], r["pp_stage"], p, m, at, r["predicted"].get("memory_moment"), measured_phase))
        mem_err = max(mem_err, rel(p["peak"], m["peak"]))
        for k in CATEGORIES:
            cat_errs[k] = max(cat_errs[k], rel(p[k], at[k]))
    flop_tot = (sum(v[0] for v in flops.values()), sum(v[1] for v in flops.values()))
    return {
        "flops": flops, "comm": {f"{k[0]}@{k[1]}": v for k, v in sorted(comm.items())},
        "flops_err": max(rel(*flop_tot), *(rel(*v) for v in flops.values() if v[1] > 0.01 * flop_tot[1])),
        "bytes_err": rel(tot_p, tot_m), "bytes": (tot_p, tot_m),
        # (collective@dim, predicted calls, measured calls) where they differ, summed over ranks: a collective of
        # a few bytes (the loss's, the norm's) or one split per FSDP unit hides in the bytes' tolerance
        "calls_off": [(f"{k[0]}@{k[1]}", v[2], v[3]) for k, v in sorted(comm.items()) if v[2] != v[3]],
        "memory_err": mem_err, "memory_category_errs": cat_errs,
        "memory_category_err": max(cat_errs[k] for k in CATEGORIES if k != "temporaries"), "memory": mem_rows,
    }


def at_moment(rank: dict) -> tuple[dict, str | None]:
    """(the measured categories to compare with the prediction's, the phase of the measured peak). The model
    prices one moment of the peak (cost_models.counts._moments): a block's backward, the head's backward, the end of
    the forward or a MoE dispatch. The categories are compared with the measurement's largest moment of the same
    kind (runtime.measure's `memory_by_moment`: the phase, and inside a transformer block or not), so that a
    near-tie between two moments (tp=2's head and block backward, 2 KiB apart in the model) or one decided by
    something the plan cannot know (a MoE rank's routing: the busiest expert's load) compares like with like. The
    peaks themselves are compared as they are, wherever they are. Older records: the largest moment of the predicted
    phase (`memory_by_phase`), or the categories at the peak."""
    m = rank["measured"]
    by = m.get("memory_by_phase") or {}
    measured_phase = max(by, key=lambda k: by[k]["peak"]) if by else None
    at = rank["predicted"].get("memory_at")
    if at in (m.get("memory_by_moment") or {}):
        return m["memory_by_moment"][at], measured_phase
    phase = rank["predicted"].get("memory_phase")
    if phase in by:
        return by[phase], measured_phase
    return m["memory_bytes"], measured_phase


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render(results: list[dict], console) -> list[dict]:
    """Per layout a table (FLOPs, collectives, and per rank the memory categories predicted / measured at the
    predicted moment's phase, with the moment and the phase of the measured peak); the summary rows."""
    from rich.table import Table

    from autoplan.cost_models.counts import MOMENT_PHASE

    summary = []
    for rec in results:
        if "error" in rec:
            console.print(f"[red]{rec['case']}: {rec['error']}[/red]")
            continue
        c = compare(rec)
        summary.append({"case": rec["case"], **{k: c[k] for k in ("flops_err", "bytes_err", "memory_err",
                                                                    "memory_category_err", "memory_category_errs",
                                                                    "calls_off")}})
        t = Table(title=f"{rec['case']}  (step {rec['step']}, {len(rec['ranks'])} ranks)", title_justify="left")
        for col in ("quantity", "predicted", "measured", "error"):
            t.add_column(col, justify="left" if col == "quantity" else "right")
        for ph, (p, m) in c["flops"].items():
            t.add_row(f"FLOPs {ph}", f"{p:.4g}", f"{m:.4g}", _pct(rel(p, m)))
        for k, (pb, mb, pn, mn) in c["comm"].items():
            t.add_row(f"{k} bytes (count)", f"{pb:.4g} ({pn})", f"{mb:.4g} ({mn})", _pct(rel(pb, mb)))
        t.add_row("comm bytes, total", f"{c['bytes'][0]:.4g}", f"{c['bytes'][1]:.4g}", _pct(c["bytes_err"]))
        for rank, stage, p, m, at, moment, phase in c["memory"]:
            cells = " ".join(f"{k[:4]} {p[k] / 2**20:.2f}/{at[k] / 2**20:.2f}" for k in CATEGORIES)
            where = f"{moment} ({MOMENT_PHASE.get(moment, '?')}); measured peak in {phase}"
            t.add_row(f"rank {rank} (stage {stage}) MiB pred/meas", f"{cells}\n{where}",
                      f"peak {p['peak'] / 2**20:.2f}/{m['peak'] / 2**20:.2f}", _pct(rel(p["peak"], m["peak"])))
        console.print(t)
    return summary


def render_sites(results: list[dict], console) -> None:
    """Per layout and rank: the activation (and temporary) storages live at the peak, by where they were made."""
    for rec in results:
        for r in rec.get("ranks", []):
            rows = r["measured"].get("memory_sites")
            if not rows:
                continue
            p, m = r["predicted"]["memory_bytes"], r["measured"]["memory_bytes"]
            console.print(f"[bold]{rec['case']} rank {r['rank']} (stage {r['pp_stage']})[/bold]: activations "
                          f"predicted {p['activations'] / 2**20:.4f} MiB, measured {m['activations'] / 2**20:.4f} MiB")
            for row in rows:
                console.print(f"  {row['category'][:4]:4} {row['bytes'] / 2**20:8.4f} MiB {row['count']:4d}x  "
                              f"{row['phase']:9} {row['module']:42} {row['op']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--layouts", nargs="*", default=None, help="model:config cases, optionally @gbs=N (default: the matrix)")
    ap.add_argument("--steps-before", type=int, default=2,
                    help="steps before the profiled one (2: step 3 is the first steady step; DDP rebuilds its "
                         "buckets during step 2)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sites", action="store_true",
                    help="also list, per rank, the activation and temporary storages live at the peak by the module, "
                         "phase and op that made them (runtime.measure.SiteMemTracker; slower)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                    help="training dtype of every layout (bf16: torch.autocast over fp32 parameters, as the runtime "
                         "trains in 16 bits)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = args.layouts or MATRIX
    if args.worker:  # a torchrun worker leaves without the interpreter's finalisation (see exit_process)
        from autoplan.runtime.train import exit_process

        exit_process(worker(args.worker, cases, args.steps_before, args.sites, args.dtype))
    from rich.console import Console

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(args.nproc), __file__, "--worker", str(out),
               "--steps-before", str(args.steps_before), "--dtype", args.dtype, *(["--sites"] if args.sites else []),
               "--layouts", *cases]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if not out.exists():
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        results = json.loads(out.read_text())
    console = Console(stderr=args.json)
    summary = render(results, console)
    if args.sites:
        render_sites(results, console)
    worst = {k: max((s[k] for s in summary), default=0.0) for k in ("flops_err", "bytes_err", "memory_err")}
    if args.json:
        print(json.dumps({"layouts": results, "summary": summary, "worst": worst}))
    failed = [r["case"] for r in results if "error" in r]
    cats = {k: max((s["memory_category_errs"][k] for s in summary), default=0.0) for k in CATEGORIES}
    print("counts by category (at the predicted moment): worst " +
          " ".join(f"{k} {_pct(v)}" for k, v in cats.items()), file=sys.stderr if args.json else sys.stdout)
    off = [f"{s['case']} ({', '.join(f'{k} {p}/{m}' for k, p, m in s['calls_off'])})" for s in summary
           if s["calls_off"]]
    print(f"counts: collective calls as predicted in {len(summary) - len(off)} of {len(summary)} layouts"
          + (f"; predicted/measured differ in {'; '.join(off)}" if off else ""),
          file=sys.stderr if args.json else sys.stdout)
    line = (f"counts: worst flops {_pct(worst['flops_err'])} bytes {_pct(worst['bytes_err'])} memory "
            f"{_pct(worst['memory_err'])} over {len(summary)} layouts")
    if failed:
        line += f" ({len(failed)} failed: {', '.join(failed)})"
    print(line, file=sys.stderr if args.json else sys.stdout)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
