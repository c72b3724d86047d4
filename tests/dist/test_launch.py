"""`python -m autoplan.runtime.train` under torchrun: wrong launches stop at start-up with one clear line (no hang), and
a 4-process run on a memory-mapped token file writes the JSON-lines log with measured and predicted times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.api import make_plan
from autoplan.specs import TrainingSpec, load_cluster, load_model

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _torchrun(nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "-m", "autoplan.runtime.train", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _plan(tmp_path: Path, model: str, gpus: int, config: str, dtype: str = "fp32") -> Path:
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype=dtype)
    plan = make_plan(load_model(model), load_cluster("local-cpu").with_gpus(gpus), training, config, kernels="fused")
    return plan.save(tmp_path / f"{model}-{gpus}.json")


def test_plan_for_8_ranks_on_4_processes_stops_at_startup(tmp_path):
    plan = _plan(tmp_path, "tiny-gpt", 8, "tp=2,pp=2")
    proc = _torchrun(4, "--plan", str(plan), "--steps", "1", timeout=120)
    assert proc.returncode != 0
    assert "is for 8 ranks but 4 processes were launched" in proc.stderr
    assert "--nnodes 2 --nproc-per-node 4" in proc.stderr


def test_plan_for_another_model_stops_at_startup(tmp_path):
    plan = _plan(tmp_path, "tiny-gpt", 2, "tp=2")
    proc = _torchrun(2, "--plan", str(plan), "--model", "tiny-llama", "--steps", "1", "--log-file", "x.jsonl",
                     timeout=120)
    assert proc.returncode != 0
    assert "was made for model 'tiny-gpt', not 'tiny-llama'" in proc.stderr


def test_four_process_run_logs_measured_and_predicted(tmp_path):
    from autoplan.runtime.data import write_token_file

    plan_path = _plan(tmp_path, "tiny-llama", 4, "tp=2,pp=2,sp=1", dtype="bf16")
    data = write_token_file(tmp_path / "tokens.u16", [(i * 7919) % 128 for i in range(20_000)], "uint16")  # dtype by suffix
    log = tmp_path / "log.jsonl"
    from autoplan.runtime.launch import run  # what `autoplan run plan.json --nproc-per-node 4 -- ...` calls

    out = tmp_path / "stdout.txt"
    with open(out, "w") as f, _redirect_stdout(f):
        rc = run(plan_path, 4, ["--steps", "4", "--data", str(data), "--log", str(log)])
    assert rc == 0, out.read_text()[-4000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    prediction = json.loads(plan_path.read_text())["prediction"]
    predicted = prediction["step_time_s"]
    for r in rows:
        assert r["predicted_step_time_s"] == predicted
        assert r["predicted_memory_gib"] == prediction["memory_gib"]["per_stage"][0]  # rank 0 is pp stage 0
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        # tensor memory (MemTracker on step 3 on the CPU), carried from the measured step on
        assert (r["peak_memory_gib"] is None) if r["step"] < 3 else (r["peak_memory_gib"] > 0)
        assert 0 < r["loss"] < 10
    assert rows[-1]["loss"] < rows[0]["loss"]  # a periodic token stream is learnable
    assert "predicted" in out.read_text()
    # rank 0's closing lines: the median of steps 2-4 against the prediction, the tensor peak against stage 0's
    text = out.read_text()
    median = sorted(r["step_time_s"] for r in rows[1:])[1]
    assert (f"done: 4 steps; step time {median * 1e3:.1f} ms (median of steps 2-4) = {median / predicted:.2f} x "
            f"the predicted {predicted * 1e3:.1f} ms") in text, text[-2000:]
    assert f"tensor memory {rows[-1]['peak_memory_gib'] * 1024:.1f} MiB (step 3) = " in text


def test_launcher_refuses_a_wrong_process_count_without_starting(tmp_path):
    from autoplan.cost_models.errors import PlanError
    from autoplan.runtime.launch import run

    with pytest.raises(PlanError, match="is for 8 ranks but 4 processes"):
        run(_plan(tmp_path, "tiny-gpt", 8, "tp=2,pp=2"), 4, ["--steps", "1"])


class _redirect_stdout:
    """Send the child's stdout (fd 1) to a file: torchrun's workers inherit the descriptor."""

    def __init__(self, f) -> None:
        self.f = f

    def __enter__(self):
        sys.stdout.flush()
        self.saved = os.dup(1)
        os.dup2(self.f.fileno(), 1)

    def __exit__(self, *exc):
        sys.stdout.flush()
        os.dup2(self.saved, 1)
        os.close(self.saved)


def test_two_node_launch_on_one_machine(tmp_path):
    """`autoplan run --nnodes 2 --rdzv-endpoint` as on a cluster: two launchers (the two "nodes", 2 processes
    each) meet at one c10d rendezvous and train a dp2 x tp2 plan made for 2 GPUs per node."""
    import socket

    base = load_cluster("local-cpu")
    cluster = base.model_copy(update={"gpus_per_node": 2, "num_nodes": 2})
    plan = make_plan(load_model("tiny-gpt"), cluster, TrainingSpec(global_batch_size=8, seq_length=64,
                                                                    dtype="fp32"), "dp=2,tp=2", kernels="torch")
    plan_path = plan.save(tmp_path / "plan.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "autoplan.cli", "run", str(plan_path), "--nnodes", "2", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "two-node-test", "--", "--steps", "3", "--log", str(log), "--quiet"]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [n.communicate(timeout=240) for n in nodes]
    for n, (_, err) in zip(nodes, outs, strict=True):
        assert n.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 < r["loss"] < 10 for r in rows)


def test_a_workers_one_line_error_is_not_buried_under_torchruns_report(tmp_path):
    """`autoplan run` with a training argument every rank refuses: the worker's line, then one line from the
    launcher; torchrun's agent lines, traceback and failure table are left out (kept with
    AUTOPLAN_TORCHRUN_REPORT=1)."""
    plan = _plan(tmp_path, "tiny-gpt", 2, "dp=2")
    cmd = [str(Path(sys.executable).with_name("autoplan")), "run", str(plan), "--", "--steps", "2",
           "--profile-step", "9"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("AUTOPLAN_TORCHRUN_REPORT", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr[-3000:]
    assert "--profile-step must name a step of this run" in lines[0]
    assert "torchrun's own report left out" in lines[1] and "Traceback" not in proc.stderr
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(env, AUTOPLAN_TORCHRUN_REPORT="1"), capture_output=True,
                          text=True, timeout=120)
    assert "ChildFailedError" in proc.stderr and "left out" not in proc.stderr
