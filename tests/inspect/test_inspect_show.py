"""`autoplan show`: rendering at 80 columns, JSON fields, the mesh, memory bars and the timeline grid."""

from __future__ import annotations

import json

import pytest
from inspect_helpers import assert_fits_width, render

from autoplan.cost_models.estimate import num_microbatches
from autoplan.inspect import mesh_info, render_show, show_json, timeline_grid
from autoplan.inspect.show import memory_bar

NAMES = ["interleaved", "1f1b", "uneven", "uneven_vp", "barely", "pp1"]


@pytest.mark.parametrize("name", NAMES)
def test_show_renders_at_80_columns(all_plans, name):
    plan = all_plans[name]
    text = render(render_show, plan, timeline=True)
    assert_fits_width(text)
    for needle in ("Mesh", "pp rank 0", "Memory per pipeline rank", "Step time", "MFU", "tokens/s", "Schedule"):
        assert needle in text, needle
    assert plan.short_hash in text


def test_show_wide_terminal_also_fits(plan_interleaved):
    text = render(render_show, plan_interleaved, timeline=True, width=120)
    assert_fits_width(text, 120)


def test_show_json_has_design_fields(plan_interleaved):
    d = show_json(plan_interleaved, timeline=True)
    json.dumps(d)  # serialisable
    for k in ("step_time_s", "tflops_per_gpu", "mfu", "hfu", "memory_gib", "breakdown", "parallel", "mesh",
              "stages", "runners_up", "timeline", "memory_breakdown_gib"):
        assert k in d, k
    assert d["parallel"]["tp"] == 8 and d["parallel"]["vp"] == 3
    assert len(d["stages"]) == 8 and d["stages"][0]["embedding"] and d["stages"][-1]["head"]
    assert [len(s["layers"]) for s in d["stages"]] == [3] * 8
    assert len(d["runners_up"]) == 2 and "delta_s" in d["runners_up"][0]
    head = d["memory_breakdown_gib"][0]
    assert head["headroom"] == pytest.approx(80 - head["total"])


def test_runners_up_are_shown_as_changes(plan_interleaved):
    text = render(render_show, plan_interleaved)
    assert "Runners-up" in text and "pp 8->16" in text


def test_mesh_maps_ranks_to_nodes(plan_interleaved, plan_pp1):
    info = mesh_info(plan_interleaved)
    axes = {a["axis"]: a for a in info["axes"]}
    assert [a["axis"] for a in info["axes"]] == ["tp", "cp", "dp", "pp"]
    assert axes["tp"]["stride"] == 1 and axes["tp"]["nodes_per_group"] == 1
    assert axes["dp"]["stride"] == 8 and axes["dp"]["nodes_per_group"] == 16
    assert axes["pp"]["stride"] == 128
    assert info["pp_ranks"][1] == {"pp_rank": 1, "ranks": [128, 255], "nodes": [16, 31]}
    one = mesh_info(plan_pp1)
    assert one["pp_ranks"] == [{"pp_rank": 0, "ranks": [0, 7], "nodes": [0, 0]}]


def test_uneven_stages_are_visible(plan_uneven):
    text = render(render_show, plan_uneven)
    assert "uneven stages" in text
    assert "0-10" in text and "83-95" in text
    d = show_json(plan_uneven)
    assert [s["num_layers"] for s in d["stages"]] == [11, 12, 12, 12, 12, 12, 12, 13]


def test_barely_fitting_plan_is_flagged_tight(plan_barely):
    text = render(render_show, plan_barely)
    assert "tight" in text
    assert "DOES NOT FIT" not in text


def test_memory_bar_marks_overflow():
    parts = {"weights": 30.0, "gradients": 10.0, "optimizer": 40.0, "activations": 15.0, "other": 5.0,
             "total": 100.0}
    bar = memory_bar(parts, 80.0, 40).plain
    assert len(bar) == 40 and bar.endswith("!" * 8)
    fine = memory_bar({**parts, "optimizer": 20.0, "activations": 0.0, "total": 65.0}, 80.0, 40).plain
    assert len(fine) == 40 and fine.endswith("·")


@pytest.mark.parametrize("name", ["interleaved", "1f1b", "uneven_vp", "pp1"])
def test_timeline_grid_holds_every_action_once(all_plans, name):
    plan = all_plans[name]
    g = timeline_grid(plan)
    pp, vp = plan.parallel.pp, plan.parallel.vp
    shown = g["microbatches_shown"]
    assert g["microbatches"] == num_microbatches(plan.parallel, plan.training)
    for r in range(pp):
        cells = [row[r] for row in g["rows"] if row[r]]
        assert len(cells) == 2 * shown * vp
        assert len(set(cells)) == len(cells)
        assert cells[0].endswith("F0")
    if name == "1f1b":
        # unit-tick 1F1B: every rank idles 2*(pp-1) ticks of 2*m + 2*(pp-1)
        assert g["idle_fraction"] == pytest.approx((pp - 1) / (shown + pp - 1))


def test_timeline_truncates_long_schedules(plan_1f1b):
    text = render(render_show, plan_1f1b, timeline=True)
    assert "..." in text.split("Schedule")[1]
    # pp=16 ranks do not fit in 80 columns of 5-character cells: the middle ones are elided
    header = next(line for line in text.splitlines() if line.startswith("tick"))
    assert "r15" in header and ".." in header


def test_timeline_grid_shows_a_round_longer_than_pp():
    """Six micro-batches on pp=4 run interleaved in one round of six (pipeline.microbatch_group): the grid shows
    that round, each rank's first chunk through all six before its second chunk starts."""
    from autoplan.api import make_plan
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    plan = make_plan(load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16),
                     TrainingSpec(global_batch_size=12, seq_length=2048), "tp=2,pp=4,dp=2,vp=2,mbs=1,schedule=interleaved")
    g = timeline_grid(plan)
    assert g["microbatches"] == g["microbatches_shown"] == 6
    first = [row[0] for row in g["rows"] if row[0]][:7]
    assert first == ["0F0", "0F1", "0F2", "0F3", "0F4", "0F5", "4F0"]
