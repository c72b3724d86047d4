"""Counts as parity: the cost model's per-rank FLOPs, bytes on the wire and memory (cost_models.counts) against
what the runtime executes, measured with torch's instruments (runtime.measure), for a few layouts of
benchmarks/counts.py's matrix in one torchrun launch; and the runtime's --profile-step record and tensor-memory
log lines in one single-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.counts import compare  # noqa: E402
from tests.train_cli import train_one_process  # noqa: E402

TORCHRUN = Path(sys.executable).with_name("torchrun")
CASES = ["tiny-gpt:tp=2,sp=1", "tiny-gpt:tp=2,sp=1,recompute=full", "tiny-gpt:pp=2,recompute=full", "tiny-gpt:dp=2,zero=2", "tiny-gpt:dp=2,zero=3",
         "tiny-moe:dp=2,zero=1",
         # one micro-batch: gradients made in the backward (cost_models.estimate.grads_made_in_backward)
         "tiny-gpt:tp=2,mbs=8", "tiny-gpt:dp=2,zero=1,mbs=4",
         # half the blocks in full, the others plain (Megatron's block method: TrainingSpec.partial_recompute)
         "tiny-gpt:tp=2,recompute=full,recompute_layers=2@partial_recompute=rest-none"]


def _launch_counts(out: Path, layouts, *extra: str) -> list[dict]:
    """benchmarks/counts.py's worker on two gloo ranks: one record per layout (a failed launch fails the test)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(ROOT / "benchmarks" / "counts.py"),
           "--worker", str(out), "--steps-before", "2", *extra, "--layouts", *layouts]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    if not out.exists():
        pytest.fail(f"counts launch failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return {r["case"]: r for r in _launch_counts(tmp_path_factory.mktemp("counts") / "counts.json", CASES)}


@pytest.mark.parametrize("case", CASES)
def test_counts_agree(records, case):
    rec = records.get(case)
    assert rec is not None and "error" not in rec, rec and rec.get("traceback")
    assert rec["event"] == "profile" and {r["rank"] for r in rec["ranks"]} == {0, 1}
    c = compare(rec)
    for phase, (pred, meas) in c["flops"].items():
        assert pred == pytest.approx(meas, rel=0.005), f"{case}: {phase} FLOPs predicted {pred} measured {meas}"
    assert c["flops"]["forward"][1] > 0 and c["flops"]["backward"][1] > 0
    if "recompute" in case:
        assert c["flops"]["recompute"][1] > 0
    pred_b, meas_b = c["bytes"]
    assert meas_b > 0 and c["bytes_err"] <= 0.02, f"{case}: bytes predicted {pred_b} measured {meas_b}: {c['comm']}"
    # the collectives the layout is about are attributed to their mesh dimension, with matching bytes
    dim = {"tp": "tp", "pp": "pp", "zero": "dp"}[next(k for k in ("tp", "pp", "zero") if k in case)]
    if "moe" in case:  # the experts, left out of FSDP, are reduced over dp in one bucket of their own
        pred_e, meas_e = c["comm"]["all_reduce@dp"][:2]
        assert meas_e > 0 and abs(pred_e - meas_e) <= 0.02 * meas_e, (case, c["comm"])
    mine = [v for k, v in c["comm"].items() if k.endswith("@" + dim)]
    pred_d, meas_d = sum(v[0] for v in mine), sum(v[1] for v in mine)
    assert meas_d > 0 and abs(pred_d - meas_d) <= 0.02 * meas_d, (case, c["comm"])
    # per rank and per (collective, mesh dimension), the step's scalar all-reduces (loss, gradient norm) included:
    # what `autoplan tune` flags as a count mismatch (they were left out, and every pipelined run showed
    # "all_reduce@world bytes: measured 24, predicted 0")
    from autoplan.tune.records import parse_profile_record

    wire = [m for m in parse_profile_record({k: rec[k] for k in ("event", "step", "ranks")}).count_mismatches()
            if "bytes" in m]
    assert wire == [], (case, wire)
    # and as many calls of each collective as the runtime makes (FSDP2 and replicate: one per unit)
    assert c["calls_off"] == [], (case, c["calls_off"])
    for r in rec["ranks"]:  # only scalars (the loss's all-reduce, not run on private copies) may go off-thread
        assert r["measured"]["memory_freed_off_thread"][1] < 1024, (case, r["rank"], r["measured"])
    for rank, _stage, p, m, at, _moment, _phase in c["memory"]:
        assert m["peak"] > 0 and abs(p["peak"] - m["peak"]) <= 0.10 * m["peak"], f"{case} rank {rank}: {p} vs {m}"
        # every category, at the measured moment of the predicted moment's kind (benchmarks.counts.at_moment),
        # ZeRO-3's activations and temporaries included: with the step's collectives on private copies
        # (runtime.measure._private_collective) which FSDP2 buffers are alive no longer depends on when gloo's
        # worker thread lets go of them (before, 3 runs in 15 here failed on one rank: docs/cost_model.md)
        for k in ("parameters", "gradients", "optimizer", "activations", "temporaries"):
            assert abs(p[k] - at[k]) <= 0.10 * at[k], f"{case} rank {rank} {k}: {p[k]} vs {at[k]}"


BF16_CASES = ["tiny-gpt:tp=2", "tiny-gpt:tp=2,sp=1", "tiny-moe:dp=2,ep=2", "tiny-gpt:pp=2"]


def test_bytes_on_the_wire_under_autocast(tmp_path):
    """The runtime in 16 bits (torch.autocast over fp32 parameters): a tensor-parallel block's forward reduces
    bf16 matmul outputs while its backward reduces the fp32 gradients of its norms' outputs, and the embedding
    and the head move the fp32 residual stream; expert all-to-alls dispatch fp32 norm outputs and combine bf16
    ones (compute.tp_units, compute.ep_routed_bytes); pipeline messages are the fp32 residual stream. Pricing
    every one at 2 bytes was 36% (tp), 33% (ep) and 50% (pp) short of the measured bytes."""
    for rec in _launch_counts(tmp_path / "counts.json", BF16_CASES, "--dtype", "bf16"):
        case = rec["case"]
        assert "error" not in rec, rec.get("traceback")
        c = compare(rec)
        mine = ["all_to_all@ep"] if "ep=" in case else ["send@pp", "recv@pp"] if "pp=" in case \
            else ["all_gather@tp", "reduce_scatter@tp"] if "sp=1" in case else ["all_reduce@tp"]
        for key in mine:
            pred, meas = c["comm"][key][:2]
            assert meas > 0 and abs(pred - meas) <= 0.02 * meas, f"{case} {key}: predicted {pred} measured {meas}"
        assert c["bytes_err"] <= 0.02, f"{case}: {c['comm']}"


def test_one_micro_batch_peaks_where_its_gradients_and_activations_meet(tmp_path):
    """With one micro-batch and gradients made in the backward (cost_models.estimate.grads_made_in_backward) the
    peak moves with what outweighs what: without recomputation the head's or the last block's backward (no
    block's gradient yet); under full recomputation with FSDP2 an earlier block's, where the later blocks'
    gradients (and reduce-scatter input) are held beside one block's recomputed activations (counting only the
    last block's was 8% short at ZeRO-3). The peak within 2%. (Within a recomputed block's backward two ops tie and
    the activation/temporary split follows whichever MemTracker sees first: categories are not compared here;
    docs/cost_model.md.)"""
    cases = {"tiny-gpt:tp=2,mbs=8": False, "tiny-gpt:tp=2,recompute=full,mbs=8": False,
             "tiny-gpt:dp=2,zero=3,recompute=full,mbs=4": True, "tiny-gpt:dp=2,zero=1,recompute=full,mbs=4": True}
    for rec in _launch_counts(tmp_path / "counts.json", cases):
        assert "error" not in rec, rec.get("traceback")
        for r in rec["ranks"]:
            pred, meas = r["predicted"]["memory_bytes"], r["measured"]["memory_bytes"]
            assert abs(pred["peak"] - meas["peak"]) <= 0.02 * meas["peak"], (rec["case"], r["rank"], pred, meas)
            # an earlier block's backward holds the later blocks' gradients; the head's or the last block's none
            held = pred["gradients"] / r["measured"]["memory_by_moment"]["optimizer"]["gradients"]
            assert (held > 0.3) == cases[rec["case"]], (rec["case"], held)
            assert r["predicted"]["memory_at"] in ("backward/block", "backward/other"), rec["case"]


def _train_one_process(plan, tmp_path, *, steps: int):
    """One process of `autoplan.runtime.train` on `plan`, profiling step 2 (tests/train_cli.py)."""
    return train_one_process(plan, tmp_path, steps=steps, args=("--profile-step", "2"))


def test_profile_step_and_tensor_memory_in_the_log(tmp_path):
    """`python -m autoplan.runtime.train --profile-step 2`: one profile record of the agreed shape and, on every
    step line from the measured step on, the tensor-memory peak (MemTracker, not RSS) beside the prediction."""
    from autoplan.api import make_plan
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    plan = make_plan(load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(1),
                     TrainingSpec(global_batch_size=2, seq_length=64, dtype="fp32"), "mbs=1,recompute=selective",
                     kernels="torch")
    proc, rows = _train_one_process(plan, tmp_path, steps=3)
    assert "profile of step 2" in proc.stdout
    prof = [r for r in rows if r.get("event") == "profile"]
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and len(prof) == 1 and prof[0]["step"] == 2
    (rank,) = prof[0]["ranks"]
    assert rank["rank"] == 0 and rank["pp_stage"] == 0
    for side in ("measured", "predicted"):
        c = rank[side]
        assert set(c["flops"]) == {"forward", "backward", "recompute"} and c["flops"]["recompute"] > 0
        assert {"parameters", "gradients", "optimizer", "activations", "temporaries", "peak"} <= set(c["memory_bytes"])
        assert isinstance(c["comm"], list)
    for k, v in rank["measured"]["flops"].items():  # one process: every FLOP is counted
        assert rank["predicted"]["flops"][k] == pytest.approx(v, rel=1e-6), k
    assert steps[0]["peak_memory_gib"] is None  # nothing measured yet
    for r in steps[1:]:
        assert r["memory_measured_step"] == 2
        assert r["peak_memory_gib"] == pytest.approx(rank["measured"]["memory_bytes"]["peak"] / 2**30)
        assert r["peak_memory_gib"] < r["rss_gib"] / 10  # tensor memory, not the process's RSS
        assert "predicted_memory_gib" in r


@pytest.fixture
def gloo_world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def test_collectives_run_on_private_copies(gloo_world_of_one):
    """Under the step's memory tracker a collective runs on copies of its tensors (runtime.measure's
    `_private_collective`): the program gets the values and a finished Work, and the tracked memory is exactly
    the program's tensors -- neither gloo's whole-input reduce-scatter buffer (made again on every wait of gloo's
    Work) nor a storage that gloo's worker thread lets go of after the program has."""
    import torch
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    from autoplan.runtime.measure import StepMemTracker

    dist = gloo_world_of_one
    mem = StepMemTracker()
    with mem:
        x = torch.arange(8, dtype=torch.float32)
        gathered = torch.empty(8)
        work = dist.all_gather_single(gathered, x, async_op=True)
        work.wait()
        work.wait()
        scattered = torch.empty(8)
        dist.reduce_scatter_single(scattered, x * 2)
        reduced = torch.ops._c10d_functional.all_reduce(x, "sum", dist.group.WORLD.group_name)
        reduced = torch.ops._c10d_functional.wait_tensor(reduced)
        total = sum(s[_TOTAL_KEY] for s in mem._curr_mem_snap.values())
    assert torch.equal(gathered, x) and torch.equal(scattered, 2 * x) and torch.equal(reduced, x)
    assert work.is_completed()
    # x, gathered, scattered, reduced (x * 2 is gone): four 32-byte tensors; at the peak x * 2 instead of reduced
    # (gloo's reduce-scatter buffer, 32 bytes more, is not the program's)
    assert total == 4 * 32 and mem.summary()["peak"] == 4 * 32, (total, mem.summary()["peak"])
    assert mem.freed_off_thread == [0, 0]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_model_with_dropout_on_cpu_counts_as_run(tmp_path, recompute):
    """One process, tiny-gpt with dropout 0.1. Full recomputation: the hidden dropout after w2 keeps its mask, so
    torch.utils.checkpoint's early stop runs w2 again and the re-run is the blocks' whole forward (session 23
    measured this on an H200 for GPT-1.3B: 4.618e13 where the model said 3.299e13). On CPU, SDPA runs its math
    path under attention dropout (compute.sdpa_math_path): a backward of 2x the core's forward, a selective re-run
    that stops before the PV bmm, and the s x s probabilities kept (before session 23: backward 3% over, selective
    recompute 2x over, activations 45% short). The profiled step's FLOPs equal the prediction in every phase; the
    activations are within 10% where there is no full recomputation (with it the prediction is 12% over, as it
    is, more, without dropout at this one-process shape)."""
    from autoplan.api import make_plan
    from autoplan.cost_models.profile import profile_from_spec
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    spec = load_model("tiny-gpt").model_copy(update={"dropout": 0.1})
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(1),
                     TrainingSpec(global_batch_size=2, seq_length=64, dtype="fp32"), f"mbs=2,recompute={recompute}",
                     kernels="torch")
    _, rows = _train_one_process(plan, tmp_path, steps=2)
    (prof,) = [r for r in rows if r.get("event") == "profile"]
    (rank,) = prof["ranks"]
    measured, predicted = rank["measured"], rank["predicted"]
    for k, v in measured["flops"].items():
        assert predicted["flops"][k] == pytest.approx(v, rel=1e-6), k
    assert (measured["flops"]["recompute"] > 0) == (recompute != "none")
    if recompute != "full":
        m, p = measured["memory_bytes"]["activations"], predicted["memory_bytes"]["activations"]
        assert abs(p - m) <= 0.10 * m, (recompute, p, m)
    blocks = [p for p in (plan.profiles or profile_from_spec(spec)) if p.kind == "block"]
    assert blocks and all(p.saves_after_last_gemm for p in blocks)
