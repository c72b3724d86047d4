"""`autoplan compare` and `autoplan explain [--why-not]`."""

from __future__ import annotations

import json

import pytest
from inspect_helpers import assert_fits_width, render

from autoplan.inspect import compare_json, explain_json, render_compare, render_explain, why_not
from autoplan.inspect.explain import SAME, render_why_not

# ------------------------------------------------------------------------------------------------ compare


def test_compare_lists_differences_and_costs(plan_interleaved, plan_1f1b):
    d = compare_json(plan_interleaved, plan_1f1b)
    json.dumps(d)
    assert d["differs"]["pp"] == [8, 16]
    assert d["differs"]["vp"] == [3, 1]
    assert d["differs"]["recompute"] == ["selective", "full"]
    assert "stage_layers" in d["differs"]
    assert not d["workload_differs"]
    st = d["metrics"]["step_time_s"]
    assert st["delta"] == pytest.approx(st["b"] - st["a"])
    total = sum(v["delta"] for v in d["breakdown"].values())
    assert total == pytest.approx(st["delta"], rel=1e-6, abs=1e-9)
    faster = "A" if st["a"] < st["b"] else "B"
    assert d["verdict"].startswith(f"{faster} is faster")
    assert "recomputation" in d["verdict"]  # full recompute is B's largest extra cost


def test_compare_renders_at_80_columns(plan_interleaved, plan_uneven, plan_barely):
    for a, b in ((plan_interleaved, plan_uneven), (plan_uneven, plan_barely)):
        text = render(render_compare, a, b)
        assert_fits_width(text)
        assert "What differs" in text and "What it costs" in text
    text = render(render_compare, plan_uneven, plan_barely)
    assert "Different workloads" in text


def test_compare_same_plan(plan_uneven):
    d = compare_json(plan_uneven, plan_uneven)
    assert d["differs"] == {} and d["verdict"].startswith("A and B take the same")


# ------------------------------------------------------------------------------------------------ explain


def _by_change(d):
    return {n["change"]: n for n in d["neighbours"]}


def test_explain_neighbours_and_rules(plan_interleaved):
    d = explain_json(plan_interleaved)
    json.dumps(d)
    n = _by_change(d)
    for change in ("tp x2", "tp /2", "pp x2", "pp /2", "mbs x2", "vp +1", "vp -1", "1f1b schedule",
                   "less recompute", "more recompute", "sp off"):
        assert change in n, change
    # tp=16 cannot stay inside an 8-GPU node: the ConfigError rule is quoted
    assert n["tp x2"]["status"] == "ruled out"
    assert n["tp x2"]["rule"] == "tp must stay inside a node"
    assert n["tp x2"]["reason"].startswith("tp must stay inside a node")
    # dp is re-derived when tp or pp change
    assert n["pp x2"]["parallel"]["dp"] == 8
    for row in d["neighbours"]:
        if row["status"] in ("faster", "slower", "same"):
            assert row["delta_s"] == pytest.approx(row["step_time_s"] - d["step_time_s"])
        if row["status"] == "does not fit":
            assert row["reason"].startswith("does not fit: needs ") and "GiB of 80" in row["reason"]
    b = d["bottleneck"]
    assert b["component"] != "compute" and 0 < b["share"] < 1
    assert d["summary"]


def test_explain_barely_fitting_plan_is_memory_bound(plan_barely):
    d = explain_json(plan_barely)
    n = _by_change(d)
    assert d["bottleneck"]["memory"]["tight"]
    # doubling the micro-batch needs more activation memory than the 0.4 GiB left
    assert n["mbs x2"]["status"] == "does not fit"
    assert "does not fit: needs" in n["mbs x2"]["reason"]
    # every faster neighbour that is not allowed says why, in the summary
    for row in d["neighbours"]:
        t = row["step_time_s"] or row.get("step_time_s_if_allowed")
        if t and t < d["step_time_s"] * (1 - SAME) and row["status"] in ("ruled out", "does not fit"):
            assert any(s.startswith(row["change"]) for s in d["summary"])


def test_explain_uneven_plan_keeps_its_layout(plan_uneven):
    d = explain_json(plan_uneven)
    assert d["step_time_s"] == pytest.approx(plan_uneven.prediction.step_time_s, rel=1e-9)
    n = _by_change(d)
    # pp x2 (16 stages of 96 layers) is evaluated on even stages, not the plan's 8
    assert n["pp x2"]["parallel"]["pp"] == 16


@pytest.mark.parametrize("name", ["interleaved", "uneven", "barely", "pp1", "uneven_vp"])
def test_explain_renders_at_80_columns(all_plans, name):
    text = render(render_explain, all_plans[name])
    assert_fits_width(text)
    assert "Bottleneck:" in text and "Neighbouring choices" in text


def test_why_not_rule(plan_interleaved):
    d = why_not(plan_interleaved, "tp=16")
    assert d["status"] == "ruled out" and d["rule"] == "tp must stay inside a node"
    assert d["hint"]
    text = render(render_why_not, plan_interleaved, "tp=16")
    assert_fits_width(text)
    assert "Ruled out: tp must stay inside a node" in text


def test_why_not_memory(plan_barely):
    d = why_not(plan_barely, "mbs=8")
    assert d["status"] == "does not fit"
    assert d["reason"].startswith(f"does not fit: needs {d['peak_memory_gib']:.1f} GiB of")
    assert d["memory_gib"]["total"] == pytest.approx(d["peak_memory_gib"])
    text = render(render_why_not, plan_barely, "mbs=8")
    assert_fits_width(text)
    assert "memory on rank" in text


def test_why_not_overlays_the_plan(plan_interleaved):
    d = why_not(plan_interleaved, "tp=4,pp=16")
    p = d["parallel"]
    assert (p["tp"], p["pp"], p["vp"], p["dp"], p["recompute"]) == (4, 16, 3, 16, "selective")
    assert d["status"] in ("faster", "slower", "same", "does not fit")
    if d["status"] != "does not fit":
        assert d["delta_s"] == pytest.approx(d["step_time_s"] - d["plan_step_time_s"])
        assert sum(c["delta_s"] for c in d["breakdown_delta"]) == pytest.approx(d["delta_s"], abs=1e-9)
    text = render(render_why_not, plan_interleaved, "tp=4,pp=16")
    assert_fits_width(text)


def test_why_not_vp_off_switches_schedule(plan_interleaved):
    d = why_not(plan_interleaved, "vp=1")
    assert d["parallel"]["schedule"] == "1f1b" and d["status"] != "ruled out"


def test_why_not_bad_string(plan_interleaved):
    from autoplan.cost_models.errors import ConfigError

    with pytest.raises(ConfigError):
        why_not(plan_interleaved, "tq=4")


def test_explain_legend_only_where_a_step_is_bracketed(plan_interleaved):
    """tp=8 fills a node, so `tp x2` is ruled out and its step shown in brackets with the legend; a plan whose
    neighbours are all allowed prints no legend for brackets it does not show."""
    from autoplan.api import make_plan
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    text = render(render_explain, plan_interleaved)
    assert "ruled out" in text and "in brackets" in text
    small = make_plan(load_model("gpt3-1.3b"), load_cluster("dgx-h100", gpus=8),
                      TrainingSpec(global_batch_size=64, seq_length=2048), "tp=2,mbs=1")
    text = render(render_explain, small)
    assert "ruled out" not in text and "in brackets" not in text


def test_a_need_just_over_the_capacity_shows_the_digits_that_tell_them_apart():
    """79.64 GiB against 79.6 read "needs 79.6 GiB of 79.6" (session 25, explain's zero-1 row)."""
    import types

    from autoplan.inspect.common import Outcome

    def reason(need: float, cap: float) -> str:
        mem = [types.SimpleNamespace(total=need)]
        est = types.SimpleNamespace(fits=False, memory=mem, peak_memory_gib=need)
        return Outcome(config=None, est=est).reason(cap)

    assert reason(79.64, 79.6) == "does not fit: needs 79.64 GiB of 79.60"
    assert reason(116.6, 79.6) == "does not fit: needs 116.6 GiB of 79.6"
    assert reason(80.0004, 80.0) == "does not fit: needs 80.000 GiB of 80.000"  # past 3 digits: no claim made
    from autoplan.inspect.common import fmt_gib_of

    assert fmt_gib_of(79.58, 79.6) == "79.58 of 79.60"  # fits: search's and explain's memory lines
    assert fmt_gib_of(65.6, 79.6) == "65.6 of 79.6"
