"""benchmarks/tune_local.py --replay: the fit and the held-out evaluation on saved measurements, launching
nothing."""

from __future__ import annotations

import json

import pytest

import autoplan.tune.core as tune_core
from autoplan.api import make_plan
from autoplan.cost_models.fit import predicted_component
from autoplan.tune.core import select_candidates
from autoplan.tune.records import RunLog, TimingRank, TimingRecord
from benchmarks import tune_local


def _saved(tmp_path, scale: float = 2.0):
    """A --save file made up from predictions: every measurement is `scale` x the starting cluster's prediction,
    so a refit that scales the host and device rates should explain the held-out ones too."""
    model, cluster, training = tune_local.workload("tiny-gpt", 4, 8, 64)
    cands = select_candidates(model, cluster, training, top=1, diverse=3, kernels="torch")
    tuned = []
    for c in cands:
        log = RunLog(step_times_s=[1.0, scale * c.predicted_before_s], steps=[1, 2])
        if c is cands[0]:  # one run with a timing record, as --time-from writes it: its compute, scaled alike
            compute = predicted_component(c.plan.prediction.breakdown, "compute", c.plan.parallel)
            log.timings.append(TimingRecord(event="timing", step=2, ranks=[
                TimingRank(rank=r, step_s=scale * c.predicted_before_s,
                           time_s={"forward": scale * compute}) for r in range(4)]))
        tuned.append({"parallel": c.config, "measured_s": scale * c.predicted_before_s,
                      "plan": json.loads(c.plan.to_json()), "log": log.model_dump(), "why": c.why})
    held = []
    for cfg in ("dp=4,mbs=1", "pp=4", "dp=4,zero=1,mbs=1"):  # the last with a timed log
        p = make_plan(model, cluster, training, cfg, kernels="torch")
        t = scale * p.prediction.step_time_s
        log = RunLog(step_times_s=[1.0, 1.0, t, t], steps=[1, 2, 3, 4], instrumented_steps=[2])
        log.timings.append(TimingRecord(event="timing", step=3, ranks=[
            TimingRank(rank=r, step_s=t, time_s={"forward": 0.3 * t, "step_tail": 0.1 * t}) for r in range(4)]))
        held.append({"parallel": p.parallel.to_string(), "measured_s": t, "error": None,
                     "log": log.model_dump() if "zero" in cfg else None})
    path = tmp_path / "saved.json"
    path.write_text(json.dumps({"tuned": tuned, "held_out": held, "cluster": json.loads(cluster.model_dump_json()),
                                "args": {"model": "tiny-gpt", "nproc": 4, "global_batch": 8, "seq_len": 64},
                                "known": {}, "bench": None}, default=float))
    return path


def test_replay_refits_saved_measurements_without_launching(tmp_path, monkeypatch, capsys):
    path = _saved(tmp_path)

    def no_launch(*a, **k):
        raise AssertionError("replay launched a run")

    monkeypatch.setattr(tune_core, "run_candidate", no_launch)
    monkeypatch.setattr(tune_local, "run_candidate", no_launch)
    assert tune_local.main(["--replay", str(path), "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    ev = json.loads(out[0])
    logged = next(r for r in ev["held_out"] if "zero=1" in r["parallel"])
    assert logged["components_measured"]["compute"] > 0 and logged["components_refit"]["optimizer"] > 0
    assert ev["held_out_count"] == 3
    assert ev["mean_error_before"] == pytest.approx(0.5, abs=0.01)  # the starting cluster: half the time
    assert ev["mean_error_after"] < 0.25  # the refit learned the slowdown from the tuned runs alone
    assert out[-1].startswith("tune: held-out spearman ")


def test_replay_of_a_file_without_logs_uses_its_saved_components(tmp_path, capsys):
    """Files saved before the run logs were (session 6) carry each tuned run's components only; .gz is read."""
    data = json.loads(_saved(tmp_path).read_text())
    for e in data["tuned"]:
        e.pop("log")
        e["components"] = {"compute": 0.5 * e["measured_s"]}
    data.pop("cluster")
    import gzip

    path = tmp_path / "old.json.gz"  # committed sets are gzipped
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(data))
    assert tune_local.main(["--replay", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("over 3 layouts")


def test_a_save_file_named_gz_is_written_compressed_and_replays(tmp_path, capsys):
    """`--save X.json.gz` writes gzip, which `--replay` reads (it wrote plain JSON under that name before)."""
    import gzip

    data = json.loads(_saved(tmp_path).read_text())
    path = tmp_path / "set.json.gz"
    tune_local._write_saved(str(path), data)
    with gzip.open(path, "rt") as f:
        assert json.loads(f.read()) == data
    assert tune_local.main(["--replay", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("over 3 layouts")


def test_the_memory_measured_step_is_not_a_step_time(tmp_path):
    """On CPU the runtime measures memory (MemTracker) on one step, step 3 when nothing is profiled; that step ran
    5-10x a plain one here, and it was in the held-out runs' median."""
    from autoplan.tune.records import read_run_log

    rows = [{"step": n, "step_time_s": t, "memory_measured_step": 3 if n >= 3 else None}
            for n, t in ((1, 0.2), (2, 0.05), (3, 0.8), (4, 0.04), (5, 0.045))]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    log = read_run_log(path)
    assert log.instrumented_steps == [3]
    assert log.measured_step_s() == pytest.approx(0.045)  # median of steps 2, 4, 5
    # a saved log from before the field existed gets the runtime's default back in a replay
    old = log.model_dump()
    old.pop("instrumented_steps")
    assert tune_local._saved_log(old).measured_step_s() == pytest.approx(0.045)


def test_drift_control_picks_the_fastest_and_a_tp_layout_and_reports_the_ratio():
    runs = [("tp=1,pp=1,dp=4,mbs=1", 0.028), ("tp=1,pp=1,dp=4,mbs=2", 0.031), ("tp=2,pp=1,dp=2,mbs=4", 0.19),
            ("tp=1,pp=2,dp=2,mbs=2", 0.05), ("tp=2,pp=1,dp=2,mbs=1", 0.58), ("tp=1,pp=1,dp=4,zero=3", None)]
    # the two fastest are tp=1: the second place goes to the fastest tp layout
    assert tune_local.control_layouts(runs, 2) == ["tp=1,pp=1,dp=4,mbs=1", "tp=2,pp=1,dp=2,mbs=4"]
    assert tune_local.control_layouts(runs, 1) == ["tp=2,pp=1,dp=2,mbs=4"]  # one control: the tp one
    assert tune_local.control_layouts(runs, 0) == []
    assert tune_local.control_layouts([("tp=1,pp=4", 0.04)], 2) == ["tp=1,pp=4"]
    line = tune_local.drift_line([{"parallel": "tp=1,pp=1,dp=4,cp=1", "tune_s": 0.030, "end_s": 0.036},
                                  {"parallel": "tp=2,pp=1,dp=2,cp=1", "tune_s": 0.200, "end_s": 0.240},
                                  {"parallel": "tp=1,pp=2,dp=2,cp=1", "tune_s": 0.050, "end_s": None}])
    assert line.endswith("end/tune 1.20")  # both re-measured controls 20% slower; the failed one left out
    assert "tp=2,pp=1,dp=2 200.0 -> 240.0 ms" in line
    assert tune_local.drift_line([]) == "drift control: nothing re-measured"


def test_spread_line_reads_repeated_launches():
    line = tune_local.spread_line([[0.10, 0.12], [0.20, 0.20, 0.30], [0.5]], [[1.0, None, 1.1]])
    # held out: 20% and 50% apart (the single launch has no spread); tuned: 10% (a failed launch left out)
    assert "held-out median 35% over 2" in line and "tuned median 10% over 1" in line
    assert "not repeated" in tune_local.spread_line([[0.1]], [])


def test_a_replay_times_a_tuned_run_as_tune_did(tmp_path):
    """tune times its runs from the profiled step on (`records.warmup_before`: DDP's bucket rebuild in step 2 is
    warm-up); a replay of the saved run must measure the same, or its fit and its chosen / fastest are not the
    live run's (session 18: 24.3 against 22.3 ms for one DDP run)."""
    from autoplan.tune.records import ProfileRecord, warmup_before

    steps = [1, 2, 3, 4, 5]
    times = [0.3, 0.09, 0.5, 0.05, 0.06]  # step 2 slow (warm-up), step 3 profiled
    log = RunLog(steps=steps, step_times_s=times)
    profiled = log.model_copy(update={"profile": ProfileRecord(event="profile", step=3, ranks=[])})
    assert warmup_before(3) == 2 and warmup_before(None) == 1
    assert profiled.measured_step_s(warmup_before(3)) == pytest.approx(0.055)  # steps 4 and 5
    assert profiled.measured_step_s() == pytest.approx(0.06)  # step 2 in the median: what replays did
    model, cluster, training = tune_local.workload("tiny-gpt", 4, 8, 64)
    plan = make_plan(model, cluster.with_gpus(4), training, "dp=4,mbs=2", kernels="torch")
    sample = tune_local._sample_of_saved({"log": profiled.model_dump(), "why": "saved"}, plan)
    assert sample.measured_step_s == pytest.approx(0.055)
