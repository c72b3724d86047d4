"""Every inspect command on plans chosen by the search itself (with runners-up and per-stage choices)."""

from __future__ import annotations

import json

import pytest
from inspect_helpers import assert_fits_width, parse, render

from autoplan.cost_models.estimate import num_microbatches
from autoplan.inspect import (
    compare_json,
    explain_json,
    export_megatron,
    export_torchtitan,
    render_compare,
    render_explain,
    render_show,
    show_json,
    trace_events,
)
from autoplan.inspect.scaling import plan_of
from autoplan.inspect.trace import slice_counts
from autoplan.specs import TrainingSpec, load_cluster, load_model


@pytest.fixture(scope="module")
def searched():
    try:
        from autoplan.inspect.scaling import default_search

        search = default_search()
    except Exception:  # noqa: BLE001
        pytest.skip("autoplan.search is not available")
    m = load_model("gpt3-13b")
    tr = TrainingSpec(global_batch_size=512, seq_length=2048)
    free = plan_of(search(m, load_cluster("dgx-a100-80g", gpus=64), tr, top=4))
    piped = plan_of(search(m, load_cluster("dgx-a100-80g", gpus=64), tr, top=3,
                           fix={"tp": "4", "pp": "4", "mbs": "1"}))
    return free, piped


def test_show_explain_compare_on_searched_plans(searched):
    free, piped = searched
    for plan in searched:
        text = render(render_show, plan, timeline=True)
        assert_fits_width(text)
        json.dumps(show_json(plan, timeline=True))
        d = explain_json(plan)
        # the search's choice is re-estimated to the same time
        assert d["step_time_s"] == pytest.approx(plan.prediction.step_time_s, rel=1e-6)
        assert_fits_width(render(render_explain, plan))
    assert free.runners_up and "Runners-up" in render(render_show, free)
    c = compare_json(free, piped)
    assert c["differs"]["pp"][1] == 4
    assert_fits_width(render(render_compare, free, piped))


def test_trace_and_export_on_searched_plans(searched):
    for plan in searched:
        tr = json.loads(json.dumps(trace_events(plan)))
        m = num_microbatches(plan.parallel, plan.training)
        counts = slice_counts(tr)
        assert set(counts) == set(range(plan.parallel.pp))
        assert all(c["forward"] == c["backward"] == m * plan.parallel.vp for c in counts.values())
        ns = parse(plan)
        assert ns.tensor_model_parallel_size == plan.parallel.tp
        assert ns.pipeline_model_parallel_size == plan.parallel.pp
        assert ns.micro_batch_size == plan.parallel.mbs
        json.dumps(export_megatron(plan))
        assert "[parallelism]" in export_torchtitan(plan, "0.2")["toml"]
        assert "config.parallelism.tensor_parallel_degree" in export_torchtitan(plan)["python"]
