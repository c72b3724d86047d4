"""tune without processes: candidate choice, the fit of candidates, and the command's one-line errors."""

from __future__ import annotations

import pytest

from autoplan.cli import main
from autoplan.specs import TrainingSpec, load_cluster, load_model
from autoplan.tune.core import Candidate, TuneResult, fastest_plan, refit, select_candidates


def _workload():
    return (load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(4),
            TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch"))


def test_candidates_are_the_search_best_then_deliberately_different():
    model, cluster, training = _workload()
    cands = select_candidates(model, cluster, training, top=2, diverse=3, kernels="torch")
    assert [c.why for c in cands[:2]] == ["search #1", "search #2"]
    assert len(cands) == 5 and len({c.config for c in cands}) == 5
    extra = cands[2:]
    pins = {"tp": lambda c: c.tp == 2, "pp": lambda c: c.pp == 2, "dp": lambda c: c.dp == 4,
            "zero": lambda c: c.zero == 3, "recompute": lambda c: c.recompute == "full"}
    assert [c.why for c in extra] == ["different: tp", "different: pp", "different: dp"]
    for c in extra:  # each honours its pin
        assert pins[c.why.split(": ")[1]](c.plan.parallel), (c.why, c.config)
    assert all(c.plan.kernels == "torch" for c in cands)


def test_refit_on_fake_measurements_and_the_fastest_plan():
    """Measurements made up as 3x the prediction: the refit must explain them and -o's plan must carry the
    refit prediction. (The real loop is tests/tune/test_tune_real.py.)"""
    model, cluster, training = _workload()
    cands = select_candidates(model, cluster, training, top=2, diverse=2, kernels="torch")
    for c in cands:
        c.measured_s = 3.0 * c.predicted_before_s
    cands[-1].measured_s, cands[-1].error = None, "skipped: over --budget"
    fit = refit(cluster, cands)
    assert fit.mean_abs_error("run") < 0.02 < fit.mean_abs_error("run", "before")
    assert all(c.predicted_after_s for c in cands)  # the unmeasured one is predicted too
    result = TuneResult(candidates=cands, fit=fit)
    best = fastest_plan(result)
    assert best.parallel == result.fastest.plan.parallel
    assert best.prediction.step_time_s == pytest.approx(result.fastest.measured_s, rel=0.02)


def test_refit_with_nothing_measured_is_none():
    model, cluster, training = _workload()
    plan = select_candidates(model, cluster, training, top=1, diverse=0, kernels="torch")[0].plan
    assert refit(cluster, [Candidate(plan=plan, why="x", error="interrupted")]) is None


@pytest.mark.parametrize("argv, message", [
    (["tune", "--model", "tiny-gpt"], "autoplan tune needs a workload: missing --cluster, --global-batch"),
    (["tune", "--model", "tiny-gpt", "--cluster", "local-cpu", "--global-batch", "8", "--steps", "1"],
     "--steps must be at least 2"),
    (["tune", "--model", "tiny-gpt", "--cluster", "local-cpu", "--global-batch", "8", "--bench", "/nonexistent"],
     "no micro-benchmark file"),
])
def test_bad_input_is_one_line(argv, message, capsys, monkeypatch):
    import autoplan.tune.core as core

    monkeypatch.setattr(core, "run_candidate", lambda *a, **k: pytest.fail("must fail before running"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "fix:" in err, err
