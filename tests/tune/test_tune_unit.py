"""tune without processes: candidate choice, the fit of candidates, and the command's one-line errors."""

from __future__ import annotations

import pytest

from autoplan.cli import main
from autoplan.specs import TrainingSpec, load_cluster, load_model
from autoplan.tune.cli import spread_note
from autoplan.tune.core import Candidate, TuneResult, fastest_plan, launch_spread, refit, select_candidates


def _workload():
    return (load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(4),
            TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch"))


def test_candidates_are_the_search_best_then_deliberately_different():
    model, cluster, training = _workload()
    cands = select_candidates(model, cluster, training, top=2, diverse=5, kernels="torch")
    assert [c.why for c in cands[:2]] == ["search #1", "search #2"]
    assert len(cands) == 7 and len({c.config for c in cands}) == 7
    extra = cands[2:]
    pins = {"tp": lambda c: c.tp == 2, "pp": lambda c: c.pp == 2, "recompute": lambda c: c.recompute == "full",
            "tp, other mbs": lambda c: c.tp == 2 and c.mbs != extra[0].plan.parallel.mbs,
            "zero-2, dp only": lambda c: c.zero == 2 and c.tp == c.pp == 1}
    assert [c.why for c in extra] == ["different: tp", "different: tp, other mbs", "different: zero-2, dp only",
                                      "different: pp", "different: recompute"]
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


def test_launch_spread_is_the_median_over_repeated_plans():
    # 20% and 50% apart; a single launch has no spread; a failed launch (None) is left out
    assert launch_spread([[0.10, 0.12], [0.20, 0.20, 0.30], [0.5], [1.0, None]]) == pytest.approx(0.35)
    assert launch_spread([[0.1], []]) is None


def _timed(cands, launches):
    for c, ls in zip(cands, launches, strict=True):
        c.launches, c.measured_s = list(ls), min(ls)
    return TuneResult(candidates=cands, fit=None)


def test_candidates_within_the_launch_spread_of_the_fastest_are_reported_as_ties():
    model, cluster, training = _workload()
    cands = select_candidates(model, cluster, training, top=2, diverse=2, kernels="torch")
    # spreads 10%, 20%, 5%, 15% -> median 12.5%; fastest 100 ms: 110 is within it, 120 and 150 are not
    result = _timed(cands, [[0.100, 0.110], [0.110, 0.132], [0.120, 0.126], [0.150, 0.1725]])
    assert result.spread == pytest.approx(0.125)
    assert [c.config for c in result.ties()] == [cands[1].config]
    js = result.as_json()
    assert js["launch_spread"] == pytest.approx(0.125) and js["ties_with_fastest"] == [cands[1].config]
    note = spread_note(result)
    assert "differ by 12%" in note and cands[1].config.split(",schedule")[0] in note
    assert cands[2].config.split(",schedule")[0] not in note
    # the same runs with the runner-up further away: no tie
    clear = _timed(cands, [[0.100, 0.110], [0.130, 0.156], [0.120, 0.126], [0.150, 0.1725]])
    assert clear.ties() == [] and "leads every other candidate" in spread_note(clear)
    # launched once each: no spread to judge by, and the note says how to get one
    once = _timed(cands, [[0.100], [0.101], [0.120], [0.150]])
    assert once.spread is None and once.ties() == [] and "--repeats" in spread_note(once)


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
    # the error is one line; notes about defaults taken (the CPU cluster's fp32) may precede it
    err = "\n".join(x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("autoplan: note:"))
    assert message in err and len(err.splitlines()) == 1 and "fix:" in err, err


def _fake_runs(monkeypatch, *, interrupt_at: int | None = None, wall_s: float = 1.0):
    """Replace the torchrun launch by a stand-in measuring 3x the prediction (the real one is
    test_tune_real.py); raise KeyboardInterrupt at launch number `interrupt_at`."""
    import autoplan.tune.core as core

    calls = []

    def fake(c, workdir, **kw):
        calls.append(c.config)
        if interrupt_at is not None and len(calls) == interrupt_at:
            c.error = "interrupted"
            raise KeyboardInterrupt
        c.measured_s, c.wall_s = 3.0 * c.predicted_before_s, wall_s

    monkeypatch.setattr(core, "run_candidate", fake)
    return calls


def test_ctrl_c_keeps_what_was_measured(monkeypatch):
    from autoplan.tune.core import tune

    calls = _fake_runs(monkeypatch, interrupt_at=3)
    model, cluster, training = _workload()
    res = tune(model, cluster, training, top=2, diverse=2, steps=3, kernels="torch")
    assert res.interrupted and len(calls) == 3
    assert len(res.measured) == 2 and res.fit is not None and res.fastest in res.measured
    assert [c.error for c in res.candidates[2:]] == ["interrupted", "not run: interrupted"]


def test_budget_stops_launching(monkeypatch):
    from autoplan.tune.core import tune

    calls = _fake_runs(monkeypatch, wall_s=50.0)
    model, cluster, training = _workload()
    res = tune(model, cluster, training, top=2, diverse=2, steps=3, budget_s=40.0, kernels="torch")
    # two always run; the third would end past the budget (judged by the longest run so far, 50 s)
    assert len(calls) == 2 and not res.interrupted
    assert all(c.error == "skipped: over --budget" for c in res.candidates[2:])


def test_repeats_keep_each_candidates_fastest_launch(monkeypatch):
    """--repeats 3: every measured candidate is launched three times, passes alternating in order, and keeps its
    fastest launch's time and log; a failed relaunch changes nothing."""
    import autoplan.tune.core as core

    class FakeLog:  # a run log with no components and no profile
        def __init__(self, n):
            self.n, self.profile = n, None

        def time_components(self):
            return {}

    model, cluster, training = _workload()
    calls: list[str] = []
    slow = {1: 1.3, 2: 1.0, 3: 1.6}  # launch number of a candidate -> slowdown (the second is the fastest)

    def fake(c, workdir, **kw):
        calls.append(c.config)
        n = calls.count(c.config)
        if n == 3 and c.config == calls[0]:
            c.error = "boom"
            return
        c.measured_s, c.wall_s, c.log = slow[n] * c.predicted_before_s, 1.0, FakeLog(n)

    monkeypatch.setattr(core, "run_candidate", fake)
    res = core.tune(model, cluster, training, top=1, diverse=2, steps=3, kernels="torch", repeats=3)
    cfgs = [c.config for c in res.candidates]
    assert calls == cfgs + cfgs[::-1] + cfgs  # pass 2 runs backwards
    first = res.candidates[0]  # its third launch failed
    assert first.launches == pytest.approx([s * first.predicted_before_s for s in (1.3, 1.0)])
    for c in res.candidates[1:]:
        assert c.launches == pytest.approx([s * c.predicted_before_s for s in (1.3, 1.0, 1.6)])
    for c in res.candidates:
        assert c.measured_s == pytest.approx(c.predicted_before_s) and c.log.n == 2 and c.error is None


def test_repeats_stay_within_the_budget(monkeypatch):
    import types

    import autoplan.tune.core as core

    calls = _fake_runs(monkeypatch, wall_s=10.0)
    # a clock that advances 10 s per launch (the fake launches take no time)
    monkeypatch.setattr(core, "time", types.SimpleNamespace(perf_counter=lambda: 10.0 * len(calls)))
    model, cluster, training = _workload()
    res = core.tune(model, cluster, training, top=2, diverse=1, steps=3, budget_s=45.0, kernels="torch",
                    repeats=3)
    # 3 first launches (30 s), then one more (40 s); a fifth would end at 50 s, past the 45 s budget
    assert len(calls) == 4 and calls[3] == res.candidates[-1].config
    assert [len(c.launches) for c in res.candidates] == [1, 1, 2]


def test_routing_dependent_mismatches_are_marked_for_moe_plans():
    """A MoE rank's FLOPs and expert all-to-all bytes follow the router's load in the profiled step; tune marks
    those mismatches as expected, and leaves every other one (and every dense plan's) as it is."""
    from autoplan.api import make_plan
    from autoplan.specs import TrainingSpec, load_cluster, load_model
    from autoplan.tune.core import routing_note

    tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    moe = make_plan(load_model("tiny-moe"), load_cluster("local-cpu"), tr, "dp=4,ep=4", kernels="torch")
    dense = make_plan(load_model("tiny-gpt"), load_cluster("local-cpu"), tr, "dp=4", kernels="torch")
    a2a = "rank 0 all_to_all@ep bytes: measured 1.085e+06, predicted 1.049e+06"
    flops = "rank 0 flops.forward: measured 6.366e+07, predicted 6.108e+07"
    other = "rank 0 all_reduce@dp bytes: measured 24, predicted 0"
    assert "expert routing" in routing_note(a2a, moe) and "expert routing" in routing_note(flops, moe)
    assert routing_note(other, moe) == other and routing_note(flops, dense) == flops


# ------------------------------------------------------------------ the choice: ties broken by measurement

L = ((0, 2),)  # one stage of two blocks

def test_finalists_the_model_cannot_order_are_chosen_by_tunes_measurement():
    """Session 19's S19d: DDP mbs 2 priced 1% under mbs 1, measured 24.9 against 18.5 ms; both tuned."""
    from autoplan.tune.core import choose_by_measurement

    ranked = [("dp=4,mbs=2", 0.0200, L), ("dp=4,mbs=1", 0.0202, L), ("tp=2,dp=2", 0.0260, L)]
    measured = {"dp=4,mbs=2": (0.0249, 0.0200, L), "dp=4,mbs=1": (0.0185, 0.0202, L),
                "tp=2,dp=2": (0.0300, 0.0260, L)}
    c = choose_by_measurement(ranked, measured, tolerance=0.05)
    assert (c.config, c.measured_s) == ("dp=4,mbs=1", 0.0185)
    assert "dp=4,mbs=1 within 1.0% of dp=4,mbs=2" in c.why and "18.5 ms against 24.9" in c.why
    # the same measurements, but the model's error on its runs is smaller than the finalists' gap: its order
    c = choose_by_measurement(ranked, measured, tolerance=0.005)
    assert (c.config, c.why) == ("dp=4,mbs=2", "model")
    # a finalist outside the window never wins, however fast it measured
    fast_third = {**measured, "tp=2,dp=2": (0.010, 0.0260, L)}
    assert choose_by_measurement(ranked, fast_third, tolerance=0.05).config == "dp=4,mbs=1"
    # a measurement of the same configuration with other stage layers is not this finalist's
    other_split = {**measured, "dp=4,mbs=1": (0.0185, 0.0202, ((0, 1), (1, 2)))}
    assert choose_by_measurement(ranked, other_split, tolerance=0.05).config == "dp=4,mbs=2"


def test_an_unmeasured_best_competes_at_its_prediction_on_the_measured_scale():
    from autoplan.tune.core import choose_by_measurement

    ranked = [("a", 0.0200, L), ("b", 0.0204, L)]
    # the tuned runs measured (median) 1.2x their refit predictions: "a" is expected at 24 ms, "b" measured 23
    measured = {"b": (0.0230, 0.0204, L), "x": (0.0360, 0.0300, L), "y": (0.0120, 0.0100, L)}
    c = choose_by_measurement(ranked, measured, tolerance=0.05)
    assert (c.config, c.measured_s) == ("b", 0.0230) and "24.0" in c.why
    # "b" measured 25 ms: the unmeasured "a" (24 expected) stays; nothing measured in the window: the model's
    assert choose_by_measurement(ranked, {**measured, "b": (0.0250, 0.0204, L)}, 0.05).config == "a"
    assert choose_by_measurement(ranked, {"x": (0.0360, 0.0300, L)}, 0.05) == \
        choose_by_measurement(ranked, {}, 0.05)
    assert choose_by_measurement(ranked, {}, 0.05).why == "model"
    # an unmeasured runner-up never displaces the best, however slow the best measured
    c = choose_by_measurement(ranked, {"a": (0.0900, 0.0200, L), "y": (0.0120, 0.0100, L)}, 0.05)
    assert (c.config, c.measured_s, c.why) == ("a", 0.0900, "model")


def test_the_tie_tolerance_is_the_fits_own_error_clamped():
    from autoplan.tune.core import TIE_CAP, TIE_FLOOR, tie_tolerance

    class Fit:
        def __init__(self, e):
            self.e = e

        def mean_abs_error(self, kind):
            assert kind == "run"
            return self.e

    assert tie_tolerance(Fit(0.0)) == TIE_FLOOR
    assert tie_tolerance(Fit(0.06)) == 0.06
    assert tie_tolerance(Fit(0.5)) == TIE_CAP
