"""`autoplan scaling`: the best plan per cluster size, the table, the PNG plot; the search pinned to the
published configurations."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from inspect_helpers import assert_fits_width, check_published, render

from autoplan.api import make_plan
from autoplan.cost_models.errors import DoesNotFitError
from autoplan.inspect import render_scaling, scaling_rows
from autoplan.inspect.scaling import parse_fix, plot_scaling
from autoplan.specs import TrainingSpec, load_cluster, load_model

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT.parent / "shared" / "reference" / "calibration_runs.json"


class _Result:
    def __init__(self, plan):
        self.plan = plan


def fake_search(model, cluster, training, *, top=1, fix=None, **_kw):
    """Stands in for the search: a fixed rule (tp=8 inside a node, dp for the rest) through make_plan, and
    no fit below 16 GPUs."""
    if cluster.num_gpus < 16:
        raise DoesNotFitError("no configuration fits", f"{cluster.num_gpus} GPUs", "use more GPUs")
    tp = min(8, cluster.num_gpus)
    return _Result(make_plan(model, cluster, training, f"tp={tp},pp=2,mbs=1,sp=1,recompute=selective"))


@pytest.fixture(scope="module")
def workload():
    return load_model("gpt3-13b"), load_cluster("dgx-a100-80g"), TrainingSpec(global_batch_size=512,
                                                                               seq_length=2048)


def test_scaling_rows_with_a_search(workload):
    m, c, tr = workload
    rows = scaling_rows(m, c, tr, [8, 16, 32, 64], search=fake_search)
    assert [r["gpus"] for r in rows] == [8, 16, 32, 64]
    assert "error" in rows[0] and rows[0]["kind"] == "does not fit"
    ok = rows[1:]
    assert ok[0]["scaling_efficiency"] == pytest.approx(1.0) and ok[0]["speedup"] == pytest.approx(1.0)
    for r in ok:
        assert r["parallel"]["dp"] == r["gpus"] // 16
        assert r["gpu_hours_per_billion_tokens"] == pytest.approx(r["gpus"] * 1e9 / r["tokens_per_s"] / 3600)
    assert ok[-1]["tokens_per_s"] > ok[0]["tokens_per_s"]
    json.dumps(rows)
    text = render(render_scaling, rows, title="gpt3-13b")
    assert_fits_width(text)
    assert "does not fit" in text and "Cheapest per token" in text


def test_parse_fix():
    assert parse_fix(["tp=8", "pp=2,mbs=1"]) == {"tp": "8", "pp": "2", "mbs": "1"}
    assert parse_fix({"tp": "8"}) == {"tp": "8"} and parse_fix(None) == {}


def test_plot_png_and_svg(workload, tmp_path):
    pytest.importorskip("matplotlib")
    m, c, tr = workload
    rows = scaling_rows(m, c, tr, [8, 16, 32, 64], search=fake_search)
    png = plot_scaling(rows, tmp_path / "scaling.png", title="gpt3-13b scaling")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    assert w > 500 and h > 300
    svg = plot_scaling(rows, tmp_path / "scaling.svg", title="gpt3-13b scaling").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "gpt3-13b scaling" in svg


def test_schedule_picture(tmp_path, gpt175):
    pytest.importorskip("matplotlib")
    from autoplan.api import make_plan
    from autoplan.inspect.plots import plot_schedule

    m, c, tr = gpt175
    plan = make_plan(m, c, tr, "tp=8,pp=4,vp=2,mbs=1,sp=1")
    svg = plot_schedule(plan, tmp_path / "s.svg").read_text()
    assert "PP rank 3" in svg and "forward" in svg and "backward" in svg
    assert plot_schedule(plan, tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def _real_search():
    try:
        from autoplan.inspect.scaling import default_search

        return default_search()
    except Exception:  # noqa: BLE001
        pytest.skip("autoplan.search is not available")


def test_scaling_with_the_real_search(workload):
    search = _real_search()
    m, c, tr = workload
    rows = scaling_rows(m, c, tr, [32, 64], search=search, fix={"pp": "1"})
    assert all("error" not in r for r in rows)
    assert all(r["parallel"]["pp"] == 1 for r in rows)
    assert rows[1]["tokens_per_s"] > rows[0]["tokens_per_s"]


def test_search_pinned_to_published_configurations_exports_them():
    """Done-when: the search pinned with --fix to each published setting, exported as Megatron flags, gives
    back the published tp, pp, vp, micro-batch and global batch."""
    search = _real_search()
    if not REFERENCE.exists():
        pytest.skip(f"{REFERENCE} not present")
    sys.path.insert(0, str(ROOT))

    from autoplan.inspect.scaling import plan_of
    from benchmarks.fidelity import run_setting

    runs = json.loads(REFERENCE.read_text())["runs"]
    for run in runs:
        model, cluster_name, training, cfg, _ = run_setting(run)
        cluster = load_cluster(cluster_name, gpus=run["cluster"]["num_gpus"])
        d = cfg.as_dict()
        fix = {k: str(d[k]) for k in ("tp", "pp", "dp", "cp", "vp", "mbs", "sp", "zero", "recompute", "schedule")}
        check_published(run, plan_of(search(model, cluster, training, fix=fix, top=1)))
