"""A plan of a user's own module (`model_source: {"factory": ...}`) names Python code. A plan file is data
(SECURITY.md): reading, inspecting or exporting it never imports that code, and running it does so only when the
user names the module themselves (`autoplan run PLAN --model REF`, `autoplan tune --model REF`; the workers get
it as AUTOPLAN_TRUSTED_MODULE). Session 14's counts of `show` imported the module (found in session 15)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoplan.api import make_plan
from autoplan.cli import main
from autoplan.cost_models.errors import PlanError
from autoplan.models.source import TRUSTED_MODULE_ENV, attach
from autoplan.specs import TrainingSpec, load_cluster
from autoplan.workload import resolve_model

MODELS = Path(__file__).resolve().parents[1] / "capture" / "_models.py"


@pytest.fixture()
def hostile(tmp_path: Path) -> tuple[Path, Path]:
    """(a plan naming a module that marks its import, the marker). The module re-exports split_lm."""
    marker = tmp_path / "IMPORTED"
    mod = tmp_path / "hostile_mod.py"
    mod.write_text(f"import pathlib, runpy\npathlib.Path({str(marker)!r}).write_text('imported')\n"
                   f"split_lm = runpy.run_path({str(MODELS)!r})['split_lm']\n")
    spec, profiles = resolve_model(f"{MODELS}:split_lm")
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(2), TrainingSpec(global_batch_size=4, seq_length=16,
                     dtype="fp32"), "dp=2", kernels="torch", profiles=profiles)
    path = attach(plan, f"{mod}:split_lm").save(tmp_path / "plan.json")
    return path, marker


@pytest.mark.parametrize("command", [["show"], ["show", "--json"], ["explain"], ["trace", "-o", "{tmp}/t.json"],
                                     ["export", "--format", "megatron"], ["export", "--format", "torchtitan"],
                                     ["codegen", "-o", "{tmp}/cg"]])
def test_inspecting_a_plan_never_imports_its_module(hostile, command, tmp_path, capsys):
    path, marker = hostile
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    main([args[0], str(path), *args[1:]])
    assert not marker.exists(), f"autoplan {' '.join(command)} imported the plan's module"


def test_run_refuses_a_module_the_user_did_not_name(hostile, capsys):
    path, marker = hostile
    assert main(["run", str(path), "--print-command"]) != 0
    err = capsys.readouterr().err
    assert "trains the Python module" in err and f"--model {path.parent / 'hostile_mod.py'}:split_lm" in err
    assert not marker.exists()
    # named by the user: launched, with the module passed on to the workers
    assert main(["run", str(path), "--print-command", "--model", f"{path.parent / 'hostile_mod.py'}:split_lm"]) == 0
    assert f"{TRUSTED_MODULE_ENV}=" in capsys.readouterr().out


def test_the_workers_refuse_it_without_the_users_word(hostile, monkeypatch, capsys):
    """`python -m autoplan.runtime.train` (what torchrun starts) checks the same before building anything."""
    from autoplan.runtime import train

    path, marker = hostile
    monkeypatch.delenv(TRUSTED_MODULE_ENV, raising=False)
    assert train.main(["--plan", str(path), "--steps", "1"]) == 2
    assert "trains the Python module" in capsys.readouterr().err and not marker.exists()
    monkeypatch.setenv(TRUSTED_MODULE_ENV, f"{MODELS}:split_lm")  # another module than the plan's
    assert train.main(["--plan", str(path), "--steps", "1"]) == 2
    assert not marker.exists()


def test_tune_refuses_a_seed_plan_of_an_unnamed_module(hostile):
    from autoplan.plan import load_plan
    from autoplan.tune.core import tune

    path, marker = hostile
    plan = load_plan(path)
    with pytest.raises(PlanError, match="trains the Python module"):
        tune(plan.model, plan.cluster, plan.training, top=0, diverse=0, seed_plan=plan, trusted_module=None)
    assert not marker.exists()


def test_tune_runs_the_users_module_not_the_zoo_model_of_its_spec():
    """The candidates of `autoplan tune --model module:factory` record the module (so the runs train it, as
    `autoplan run` would) and keep to what the runtime can shard in it (search's pins: sp, cp, ep)."""
    from autoplan.tune.core import select_candidates

    ref = f"{MODELS}:split_lm"
    spec, profiles = resolve_model(ref)
    from autoplan.models.source import planner_pins

    cands = select_candidates(spec, load_cluster("local-cpu").with_gpus(4),
                              TrainingSpec(global_batch_size=8, seq_length=16, dtype="fp32"), top=2, diverse=2,
                              profiles=profiles, fix=planner_pins(ref), source=ref)
    assert len(cands) >= 3
    assert all(c.plan.model_source == {"factory": ref} for c in cands)
    assert all(c.plan.parallel.sp == 0 and c.plan.parallel.cp == 1 for c in cands)


def test_a_plan_records_the_capture_it_was_priced_from(tmp_path, capsys):
    """`autoplan search -o` of a user module writes the capture's profiles into the plan (data): explain and the
    counts of `show` re-price it from them, as search priced it (before, from the spec's analytic profile: split_lm
    read 13.4 ms in explain against the plan's 12.3), without importing the module. An edited plan whose profiles
    do not match its model is refused on load."""
    import json

    from autoplan.counts import counts_of_plan
    from autoplan.inspect.common import reestimate
    from autoplan.plan import load_plan

    ref = f"{MODELS}:split_lm"
    out = tmp_path / "plan.json"
    assert main(["search", "--model", ref, "--cluster", "local-cpu", "--gpus", "4", "--global-batch", "8",
                 "--seq-len", "32", "-o", str(out)]) == 0
    plan = load_plan(out)
    _, captured = resolve_model(ref)
    assert plan.profiles == captured
    assert reestimate(plan).step_time_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    assert counts_of_plan(plan) == counts_of_plan(plan.model_copy(update={"profiles": None}), module_loaded=True)
    data = json.loads(out.read_text())
    data["profiles"] = data["profiles"][:-1]  # the head's dropped, the plan re-hashed
    bad = plan.model_validate(data).model_copy(update={"content_hash": ""}).sealed().save(tmp_path / "bad.json")
    with pytest.raises(PlanError, match="profiles are the embedding's, one per block, then the head's"):
        load_plan(bad)


def test_tune_around_a_plan_keeps_its_model_for_every_candidate(tmp_path):
    """`autoplan tune --plan P --model REF`: the search's candidates beside the given plan train the plan's module
    too (its model source and profiles copied), not the zoo model of its spec."""
    from autoplan.plan import load_plan
    from autoplan.tune.core import select_candidates

    ref = f"{MODELS}:split_lm"
    out = tmp_path / "plan.json"
    assert main(["search", "--model", ref, "--cluster", "local-cpu", "--gpus", "4", "--global-batch", "8",
                 "--seq-len", "32", "-o", str(out)]) == 0
    seed = load_plan(out)
    cands = select_candidates(seed.model, seed.cluster, seed.training, top=2, diverse=1, profiles=seed.profiles,
                              fix={"sp": "0", "cp": "1", "ep": "1"}, seed_plan=seed)
    assert len(cands) >= 2
    assert all(c.plan.model_source == {"factory": ref} and c.plan.profiles == seed.profiles for c in cands)
