"""`autoplan trace`: valid Chrome trace JSON with the expected slices per pipeline rank."""

from __future__ import annotations

import json

import pytest

from autoplan.cost_models.estimate import num_microbatches
from autoplan.inspect import trace_events
from autoplan.inspect.trace import TID_COMPUTE, TID_P2P, slice_counts


def _roundtrip(plan, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace_events(plan)))
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", ["interleaved", "1f1b", "uneven", "uneven_vp", "barely", "pp1"])
def test_trace_is_valid_chrome_json_with_expected_slices(all_plans, name, tmp_path):
    plan = all_plans[name]
    tr = _roundtrip(plan, tmp_path)
    assert isinstance(tr["traceEvents"], list)
    cfg = plan.parallel
    m = num_microbatches(cfg, plan.training)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    for e in xs:
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["dur"] >= 0 and e["ts"] >= 0
        assert set(e) >= {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"}
        assert 0 <= e["pid"] < cfg.pp
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"pp rank {r}" for r in range(cfg.pp)}
    counts = slice_counts(tr)
    for r in range(cfg.pp):
        c = counts[r]
        assert c["forward"] == m * cfg.vp, (r, c)
        assert c["backward"] == m * cfg.vp, (r, c)
        modes = {s.recompute for s in plan.stages if s.pp_rank == r}
        if modes == {"full"}:
            assert c["recompute"] == m * cfg.vp  # one R<mb> slice before each backward
        elif modes == {"none"}:
            assert "recompute" not in c
        else:  # selective: a slice only where the cost model charges recomputation (not with flash attention)
            assert c.get("recompute", 0) in (0, m * cfg.vp)
    # every forward of every stage and micro-batch appears exactly once, named F<mb> with its stage in args
    fwd = [(e["args"]["stage"], e["args"]["microbatch"]) for e in xs if e["cat"] == "forward"]
    assert len(set(fwd)) == len(fwd) == m * cfg.pp * cfg.vp
    assert all(e["name"] == f"F{e['args']['microbatch']}" for e in xs if e["cat"] == "forward")
    # compute slices of one rank never overlap
    for r in range(cfg.pp):
        sl = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e["pid"] == r and e["tid"] == TID_COMPUTE)
        assert all(b[0] >= a[1] - 1e-3 for a, b in zip(sl, sl[1:], strict=False))
    # the trace ends at the predicted step time
    end = max(e["ts"] + e["dur"] for e in xs) / 1e6
    assert end == pytest.approx(tr["otherData"]["step_time_s"], rel=0.02)


def test_trace_sends_between_ranks(plan_interleaved):
    tr = trace_events(plan_interleaved)
    sends = [e for e in tr["traceEvents"] if e["ph"] == "X" and e["tid"] == TID_P2P]
    m = num_microbatches(plan_interleaved.parallel, plan_interleaved.training)
    n = plan_interleaved.parallel.pp * plan_interleaved.parallel.vp
    # every stage boundary is crossed once forward and once backward per micro-batch
    assert len(sends) == 2 * (n - 1) * m
    assert all(e["args"]["to_rank"] != e["pid"] for e in sends)


def test_trace_pp1_has_no_sends(plan_pp1):
    tr = trace_events(plan_pp1)
    assert not [e for e in tr["traceEvents"] if e["ph"] == "X" and e["tid"] == TID_P2P]
