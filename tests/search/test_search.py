"""End to end: the search against brute force, determinism, pins, errors, the CLI's JSON and the published
configurations of the calibration runs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan.cli import main
from autoplan.cost_models.errors import ConfigError, DoesNotFitError
from autoplan.search.core import search
from autoplan.specs import ClusterSpec, ModelSpec, TrainingSpec, load_cluster, load_model


def brute_force_best(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Every legal configuration, each with its exhaustively best layout and recomputation, estimated."""
    from benchmarks.search_exactness import brute_force_best as brute

    return brute(model, cluster, training)[0]


@settings(max_examples=8, deadline=None)
@given(layers=st.integers(2, 4), hidden=st.sampled_from([64, 128]), gpus=st.sampled_from([2, 4]),
       batch=st.sampled_from([4, 8]), hbm=st.sampled_from([0.6, 0.75, 2.0]), backend=st.sampled_from(["gloo", "nccl"]))
def test_search_equals_brute_force_on_small_instances(layers, hidden, gpus, batch, hbm, backend):
    # both backends: on nccl the search skips sp=0 candidates dominated by their sp=1 twin, on gloo it cannot
    model = ModelSpec(name="t", num_layers=layers, hidden_size=hidden, num_attention_heads=4, vocab_size=256,
                      max_seq_length=128)
    base = load_cluster("local-cpu")
    cluster = base.model_copy(update={"gpus_per_node": gpus, "backend": backend,
                                      "gpu": base.gpu.model_copy(update={"hbm_gib": hbm})})
    training = TrainingSpec(global_batch_size=batch, seq_length=128, dtype="fp32")
    bf = brute_force_best(model, cluster, training)
    if bf == float("inf"):
        with pytest.raises(DoesNotFitError):
            search(model, cluster, training)
        return
    res = search(model, cluster, training, top=3)
    # The search is exact for its closed-form pipeline (the ILP: tests/search/test_ilp.py) and simulates the
    # finalists; a candidate the closed form ranks out while its simulation is faster is missed. Measured with
    # `python benchmarks/search_exactness.py` (seeds 1-5, 520 instances of this strategy): every miss is one
    # instance (3 layers, hidden 128, 4 GPUs, batch 4, gloo; any hbm) where pp=2 dp=2 simulates 2.1% faster
    # than the dp=4 plan found.
    assert res.best.step_time_s >= bf * (1 - 1e-9)
    assert res.best.step_time_s <= bf * 1.03


def test_search_simulates_an_uneven_pipeline_the_closed_form_overstates():
    """5 layers over pp=2 (uneven stages), 2 micro-batches, ZeRO-1 pinned: the closed form says 31.88 ms, the
    simulation 30.70 ms, which beats dp=4 (31.10 ms). (31.38 / 30.21 before session 5 priced what pipeline
    messages cost the ranks at either end.) Before finalists were keyed by `step_time_lower_bound` the
    search stopped at dp=4. (The instance used to be 3 layers with ZeRO free; since the cost model prices the
    runtime's per-block all-reduce of a pipelined ZeRO-0 stage, dp=4 wins there outright, so it no longer
    isolates this case; the unpinned search still equals brute force on it.)"""
    model = ModelSpec(name="t", num_layers=5, hidden_size=64, num_attention_heads=4, vocab_size=256,
                      max_seq_length=128)
    base = load_cluster("local-cpu")
    cluster = base.model_copy(update={"gpus_per_node": 4, "gpu": base.gpu.model_copy(update={"hbm_gib": 0.6})})
    training = TrainingSpec(global_batch_size=4, seq_length=128, dtype="fp32")
    res = search(model, cluster, training, top=3, fix={"zero": 1})
    assert (res.best.config.pp, res.best.config.dp) == (2, 2)
    dp4 = search(model, cluster, training, top=3, fix={"zero": 1, "pp": 1}).best.step_time_s
    assert res.best.step_time_s < dp4
    small = model.model_copy(update={"num_layers": 3})
    unpinned = search(small, cluster, training, top=3)
    assert unpinned.best.step_time_s == pytest.approx(brute_force_best(small, cluster, training), rel=1e-9)


def test_search_weighs_the_layout_without_full_recompute_beside_the_ilps_optimum():
    """Where the stage ILP's optimum recomputes some block fully, the search also solves it with full
    recomputation forbidden and keeps both layouts: the ILP's objective sees ranks' totals, while the simulated
    pipeline also sees one stage's backward grown by a whole block's re-run (Llama-3 405B on 16384 H100 in session
    22: a one-full-block layout 0.02 s ahead in closed form was 0.13 s behind simulated, and the search picked it).
    SC21's 1T model on 3072 A100, its best candidate pinned: the ILP's optimum recomputes two blocks a stage; the
    layout without full recomputation is a finalist too, and the plan is the fastest of the finalists by what
    each can do (simulated step, or the bound a closed-form one cannot beat)."""
    model, cluster = load_model("sc21-1t"), load_cluster("dgx-a100-80g", gpus=3072)
    training = TrainingSpec(global_batch_size=3072, seq_length=2048)
    pins = {"tp": 8, "pp": 32, "dp": 12, "vp": 1, "mbs": 1, "sp": 1, "zero": 1, "schedule": "1f1b"}
    res = search(model, cluster, training, top=1, fix=pins)
    full = [f for f in res.finalists if any(st.recompute == "full" for st in f.layout)]
    other = [f for f in res.finalists if f not in full]
    assert full and other and res.stats.ilp_solved == 2
    best = res.best.step_time_s
    assert all(best <= (f.estimate.step_time_s if f.simulated else f.bound_s) for f in res.finalists)


def _gpt13():
    return load_model("gpt3-1.3b"), load_cluster("dgx-a100-80g", gpus=16), TrainingSpec(global_batch_size=64,
                                                                                       seq_length=2048)


def test_deterministic_plan_bytes():
    m, c, t = _gpt13()
    a = search(m, c, t).plan.to_json()
    b = search(m, c, t).plan.to_json()
    assert a == b
    assert json.loads(a)["provenance"]["search_time_s"] is None


def test_fix_pins_knobs():
    m, c, t = _gpt13()
    res = search(m, c, t, fix={"tp": "2", "recompute": "full", "pp": "2"})
    p = res.plan
    assert p.parallel.tp == 2 and p.parallel.pp == 2
    assert all(s.recompute == "full" and s.recompute_layers == s.num_layers for s in p.stages)
    for e in res.runners_up:
        assert e.config.tp == 2 and e.config.pp == 2


def test_fix_recompute_layers_and_bad_pin():
    m, c, t = _gpt13()
    res = search(m, c, t, fix={"recompute_layers": "2", "pp": "2"})
    assert res.plan.parallel.recompute == "full" and res.plan.parallel.recompute_layers == 2
    with pytest.raises(ConfigError):
        search(m, c, t, fix={"tp": "3"})


def test_does_not_fit_names_closest_candidate_and_remedy():
    m = load_model("gpt3-175b")
    c = load_cluster("dgx-a100-80g", gpus=8)
    t = TrainingSpec(global_batch_size=8, seq_length=2048)
    with pytest.raises(DoesNotFitError) as err:
        search(m, c, t)
    msg = str(err.value)
    assert "closest candidate" in msg and "misses by" in msg and "GiB" in msg
    assert "more GPUs" in msg or "--gpus" in msg


def test_cli_json_shape(capsys, tmp_path):
    out = tmp_path / "plan.json"
    rc = main(["search", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g", "--gpus", "16", "--global-batch", "64",
               "--seq-len", "2048", "--top", "3", "--json", "-o", str(out)])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("step_time_s", "tflops_per_gpu", "mfu", "hfu", "memory_gib", "breakdown", "parallel", "runners_up",
              "search_time_s"):
        assert k in d
    assert set(d["memory_gib"]) == {"per_stage", "peak"}
    assert len(d["runners_up"]) == 2
    for r in d["runners_up"]:
        assert {"step_time_s", "mfu", "hfu", "memory_gib", "breakdown", "parallel"} <= set(r)
        assert r["step_time_s"] >= d["step_time_s"]
    from autoplan.plan import load_plan

    assert load_plan(out).prediction.step_time_s == pytest.approx(d["step_time_s"])


def test_cli_table_and_error_are_one_line(capsys):
    rc = main(["search", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "8", "--global-batch", "8",
               "--seq-len", "2048"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoplan: does not fit:") and "\n" not in err


REF = Path(__file__).resolve().parents[3] / "shared" / "reference" / "calibration_runs.json"


@pytest.mark.skipif(not REF.exists(), reason="shared reference data not present")
@pytest.mark.parametrize("index", [0, 2, 4, 10, 12, 14])  # a subset: benchmarks/plan_quality.py runs them all
def test_never_slower_than_published(index):
    from autoplan.estimate_api import estimate_config
    from benchmarks.fidelity import run_setting

    run = json.loads(REF.read_text())["runs"][index]
    model, cluster_name, training, cfg, _ = run_setting(run)
    cluster = load_cluster(cluster_name, gpus=run["cluster"]["num_gpus"])
    pub = estimate_config(model, cluster, training, cfg)
    best = search(model, cluster, training, top=3).best
    assert best.step_time_s <= pub.step_time_s * (1 + 1e-9)


@pytest.mark.parametrize("width", [80, 200])
def test_search_table_fits_the_terminal(width):
    from rich.console import Console

    from autoplan.inspect.common import short_config
    from autoplan.search.cli import render_search

    m, c, t = _gpt13()
    res = search(m, c, t, top=3)
    con = Console(width=width, record=True, file=io.StringIO())
    render_search(con, res, m, c, t, None)
    text = con.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    best = short_config(res.best.config)
    assert (best.replace(",", " ") if width < 150 else str(res.best.config.tp)) in text
    assert "…" not in text  # nothing cut off


def test_progress_never_reports_more_done_than_its_total():
    """Issue 16: `simulating pipelines 34/5` and `ranking 3008/204316` were totals that were not totals."""
    from autoplan.cost_models.specs import TrainingSpec
    from autoplan.search.core import search
    from autoplan.specs import load_cluster, load_model

    seen: list[tuple[str, int, int]] = []
    search(load_model("gpt3-175b"), load_cluster("dgx-a100-80g", gpus=1024),
           TrainingSpec(global_batch_size=1536, seq_length=2048), progress=lambda *a: seen.append(a))
    phases = {p for p, _, _ in seen}
    assert {"ranking candidates", "simulating pipelines"} <= phases
    assert all(done <= total for _, done, total in seen if total > 0)
    assert all(total == 0 for p, _, total in seen if p in ("ranking candidates", "solving stage ILPs"))
