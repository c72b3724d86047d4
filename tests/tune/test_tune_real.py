"""A short real `autoplan tune` on 2 gloo processes: two candidates run under torchrun, the cluster is refit,
the refit cluster file loads and predicts the measured runs better, and the measured fastest plan is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tune_two_processes_end_to_end(tmp_path):
    cluster_out, plan_out = tmp_path / "refit.yaml", tmp_path / "best.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "autoplan.cli", "tune", "--model", "tiny-gpt", "--cluster", "local-cpu",
           "--gpus", "2", "--global-batch", "4", "--seq-len", "32", "--dtype", "fp32", "--top", "1",
           "--diverse", "1", "--steps", "5", "--cluster-out", str(cluster_out), "-o", str(plan_out),
           "--workdir", str(tmp_path / "runs"), "--json"]
    # a hang guard, not a speed check: two launches take ~20 s here when the machine is quiet, 217 s at load 50
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    measured = [c for c in out["candidates"] if c["measured_step_time_s"]]
    assert len(measured) == 2, out["candidates"]
    assert len({c["parallel"] for c in measured}) == 2  # the deliberately different one differs
    assert any(c["why"].startswith("different:") for c in measured)
    fit = out["fit"]
    # the fit improves a start that is off; a start already inside the runs' own noise (0.9% in session 34's
    # make test, against 1.7% after) may move within it: the fit minimises over the runs' components beside
    # their totals, so the totals' mean need not fall once it is at the noise floor (5%: the spread of these
    # two-process timings at load, session 7)
    assert fit["mean_abs_error_after"] < max(fit["mean_abs_error_before"], 0.05), fit
    # two runs, several knobs: they can be explained -- not exactly, since each run's timed components are rows
    # of the fit beside its total. How well is the benchmark's question (benchmarks/tune_local.py); here only that
    # the fit works: over 5 tunes at load 1.5-4.7 (session 7) the runs' mean error went 59-135% -> 2.2-8.3%, and
    # the written plan's error (its run's row alone) was 1.0-14.7%. The bound leaves room for that noise; it is
    # absolute, not relative to the start: with the preset's measured host time per operator (session 11) the
    # start is already closer on some runs, and a third of it was then tighter than the runs' own spread.
    assert fit["mean_abs_error_after"] < 0.15
    fastest = min(measured, key=lambda c: c["measured_step_time_s"])
    assert out["fastest"] == fastest["parallel"]
    assert (tmp_path / "runs").is_dir() and list((tmp_path / "runs").glob("log-*.jsonl"))
    # the steps after the profiled one are timed by component, and the buckets account for the rank's step
    from autoplan.tune.records import read_run_log

    for path in (tmp_path / "runs").glob("log-*.jsonl"):
        log = read_run_log(path)
        assert [t.step for t in log.timings] == [4, 5], path  # step 3 profiled, steps 1-2 warm-up
        for r in log.timings[0].ranks:
            assert sum(r.time_s.values()) == pytest.approx(r.step_s, rel=0.05, abs=2e-3), r
            assert r.time_s.get("backward", 0) > 0 and r.time_s.get("step_tail", 0) > 0, r.time_s
        assert log.time_components()["compute"] > 0
        # each rank's process CPU time over the step: some, and no more than its threads could use in it
        assert all(r.cpu_s is not None and 0 < r.cpu_s < 8 * r.step_s for t in log.timings for r in t.ranks)
        assert 0 < log.cpu_fraction() < 8

    from autoplan.cost_models.fit import knob_values
    from autoplan.plan import load_plan
    from autoplan.specs import load_cluster

    text = cluster_out.read_text()
    assert text.startswith("# refit by `autoplan tune` on 2 measured runs of tiny-gpt")
    refit = load_cluster(str(cluster_out))
    knobs = knob_values(refit)
    for k in ("kernel_launch_us", "intra_latency_us", "intra_bandwidth_gbps"):  # stored as fitted
        assert abs(knobs[k] / fit["after"][k] - 1) < 1e-6, (k, knobs[k], fit["after"][k])
    best = load_plan(plan_out)
    assert best.parallel.to_string() == fastest["parallel"]
    # the written plan carries the refit prediction, within 25% of what was measured. Not also "no further than
    # the start's": the fit minimises over both runs and their components (checked above: the mean over the runs
    # improves), and one run's row can move off a start that was close by chance (session 13's make test: 9.0%
    # after against 3.2% before on the fastest run, while the runs' mean improved).
    err_after = abs(best.prediction.step_time_s / fastest["measured_step_time_s"] - 1)
    assert err_after < 0.25, (err_after, fastest)
    # and the refit cluster is accepted by estimate, which predicts the written plan's step time (same stage
    # layout: the search may have balanced the pipeline stages unevenly)
    layout = ",".join(str(s.layers[1] - s.layers[0]) for s in best.stages)
    e = subprocess.run([sys.executable, "-m", "autoplan.cli", "estimate", "--model", "tiny-gpt", "--cluster",
                        str(cluster_out), "--gpus", "2", "--global-batch", "4", "--seq-len", "32", "--dtype", "fp32",
                        "--kernels", "torch", "--parallel", fastest["parallel"], "--json"]
                       + (["--layout", layout] if best.parallel.pp > 1 else []),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert e.returncode == 0, e.stderr
    assert json.loads(e.stdout)["step_time_s"] == pytest.approx(best.prediction.step_time_s, rel=1e-6)
