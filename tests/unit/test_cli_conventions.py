"""Conventions of a well-made command line: help for everything, `python -m autoplan`, JSON errors under
--json, one-line errors for unwritable outputs, untruncated preset names, schema_version on JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from autoplan.cli import build_parser, main

EST = ["--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g", "--gpus", "8", "--global-batch", "64", "--seq-len",
       "2048"]


def _subparsers(ap: argparse.ArgumentParser):
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return sub, sub.choices


def test_every_subcommand_and_option_has_help():
    """Walks the whole parser, including subcommands other modules register (search, run, codegen, ...)."""
    sub, choices = _subparsers(build_parser())
    helps = {a.dest: a.help for a in sub._choices_actions}
    missing = []
    for name, p in choices.items():
        if not helps.get(name):
            missing.append(f"{name}: no help line")
        if not p.description:
            missing.append(f"{name}: no description")
        for a in p._actions:
            if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
                continue
            if not a.help:
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}: no help")
    assert not missing, missing
    assert len(choices) >= 10


def test_python_dash_m_autoplan():
    r = subprocess.run([sys.executable, "-m", "autoplan", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "estimate" in r.stdout and "usage: autoplan" in r.stdout


def test_errors_under_json_are_json(capsys):
    assert main(["estimate", *EST, "--parallel", "tp=3", "--json"]) != 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) >= {"error", "fix", "schema_version"} and d["error"] and d["fix"]
    with pytest.raises(SystemExit) as e:
        main(["estimate", *EST, "--parallel", "tp=1", "--json", "--no-such-option"])
    assert e.value.code != 0
    d = json.loads(capsys.readouterr().out)
    assert "unrecognized arguments" in d["error"] and d["fix"]
    assert main(["show", "/no/such/plan.json", "--json"]) != 0
    d = json.loads(capsys.readouterr().out)
    assert d["error"] and "fix" in d


@pytest.mark.parametrize("argv", [
    ["estimate", *EST, "--parallel", "tp=1", "-o", "/no/such/dir/plan.json"],
    ["search", *EST, "--top", "1", "-o", "/no/such/dir/plan.json"],
    ["scaling", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g", "--global-batch", "64", "--seq-len", "2048",
     "--gpus", "8,16", "--plot", "/no/such/dir/s.png"],
])
def test_unwritable_output_is_one_line(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # an option this branch's command does not have: not what is tested here
        pytest.skip(f"usage: {e}")
    assert rc != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/no/such/dir" in err[0] and "Traceback" not in err[0], err


def test_unwritable_output_under_json(tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["estimate", *EST, "--parallel", "tp=1", "-o", str(plan), "--json"]) == 0
    capsys.readouterr()
    for argv in (["trace", str(plan), "-o", "/no/such/dir/t.json", "--json"],
                 ["export", str(plan), "-o", "/no/such/dir/x.sh", "--json"]):
        assert main(argv) != 0
        d = json.loads(capsys.readouterr().out)
        assert "/no/such/dir" in d["error"] and d["fix"], argv


@pytest.mark.parametrize("cmd", ["models", "clusters"])
def test_tables_keep_names_whole_at_80_columns(cmd, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main([cmd]) == 0
    out = capsys.readouterr().out
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80
    assert main([cmd, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    words = set(out.split())
    for r in rows:
        assert r["name"] in words, r["name"]


def test_models_json_uses_the_spec_field_names(capsys):
    from autoplan.cost_models.specs import ModelSpec

    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    keys = set(rows[0]) - {"num_parameters"}
    assert keys <= set(ModelSpec.model_fields), keys - set(ModelSpec.model_fields)


def test_json_objects_carry_schema_version(capsys):
    from autoplan.plan import SCHEMA_VERSION

    assert main(["estimate", *EST, "--parallel", "tp=1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schema_version"] == SCHEMA_VERSION


def test_demo_json_prints_json(capsys):
    assert main(["demo", "--no-run", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema_version"] and d["tiny"]["parallel"] and d["tiny"]["step_time_s"] > 0


def test_search_json_stdout_is_only_json():
    """The stage ILP's solver (HiGHS prints a banner from C++ on fd 1) must not leak into --json output."""
    r = subprocess.run([sys.executable, "-m", "autoplan", "search", *EST, "--top", "1", "--fix", "pp=2", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    d = json.loads(r.stdout)
    assert d["parallel"]["pp"] == 2 and d["schema_version"]


def test_every_parallel_mapping_uses_the_plans_field_names_and_types(tmp_path, capsys):
    """One vocabulary: the `parallel` mapping of estimate/search/show/explain --json (and the runners-up) has
    the Plan's field names with the Plan's types (`sp` a bool, as in plan.json), not the string's 1/0."""
    from autoplan.cost_models.specs import ParallelConfig
    from autoplan.plan import load_plan

    plan_path = tmp_path / "p.json"
    args = ["--model", "tiny-gpt", "--cluster", "local-cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "64"]
    assert main(["search", *args, "--json", "-o", str(plan_path)]) == 0
    found = json.loads(capsys.readouterr().out)
    mappings = [("search", found["parallel"])] + [("search runner-up", r["parallel"]) for r in found["runners_up"]]
    assert main(["estimate", *args, "--parallel", "tp=2,sp=1", "--json"]) == 0
    mappings.append(("estimate", json.loads(capsys.readouterr().out)["parallel"]))
    for cmd in ("show", "explain"):
        assert main([cmd, str(plan_path), "--json"]) == 0
        mappings.append((cmd, json.loads(capsys.readouterr().out)["parallel"]))
    plan = json.loads(plan_path.read_text())
    mappings.append(("plan.json", plan["parallel"]))
    mappings += [("plan.json runner-up", r["parallel"]) for r in plan["runners_up"]]
    fields = set(ParallelConfig.model_fields)
    for where, d in mappings:
        assert set(d) <= fields, (where, set(d) - fields)
        assert isinstance(d["sp"], bool), (where, d["sp"])
        assert ParallelConfig.model_validate(d).to_string() == ParallelConfig(**d).to_string()
    assert "sp=1" in ParallelConfig.parse("tp=2,sp=1").to_string()
    assert load_plan(plan_path).parallel.as_dict() == {k: v for k, v in plan["parallel"].items()
                                                       if v is not None or k == "recompute_layers"}
