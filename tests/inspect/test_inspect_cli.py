"""The inspect commands through `autoplan.cli.main`: text at 80 columns, `--json`, files, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from inspect_helpers import assert_fits_width

from autoplan.cli import main
from autoplan.cost_models.estimate import num_microbatches
from autoplan.inspect.trace import slice_counts


@pytest.fixture()
def files(tmp_path, plan_interleaved, plan_uneven, plan_barely, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    paths = {}
    for name, plan in (("a", plan_interleaved), ("u", plan_uneven), ("tight", plan_barely)):
        paths[name] = str(plan.save(tmp_path / f"{name}.json"))
    return paths


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_show(files, capsys):
    rc, out, _ = run(capsys, "show", files["a"], "--timeline")
    assert rc == 0 and "Mesh" in out and "tick" in out
    assert_fits_width(out)
    rc, out, _ = run(capsys, "show", files["u"], "--json", "--timeline", "--microbatches", "4")
    d = json.loads(out)
    assert d["timeline"]["microbatches_shown"] == 4 and d["parallel"]["pp"] == 8


def test_compare(files, capsys):
    rc, out, _ = run(capsys, "compare", files["a"], files["u"])
    assert rc == 0 and "What differs" in out
    assert_fits_width(out)
    rc, out, _ = run(capsys, "compare", files["a"], files["u"], "--json")
    assert json.loads(out)["differs"]["vp"] == [3, 1]


def test_explain_and_why_not(files, capsys):
    rc, out, _ = run(capsys, "explain", files["tight"])
    assert rc == 0 and "Bottleneck" in out and "does not fit: needs" in out
    assert_fits_width(out)
    rc, out, _ = run(capsys, "explain", files["a"], "--why-not", "tp=4,pp=16")
    assert rc == 0 and "Why not" in out
    assert_fits_width(out)
    rc, out, _ = run(capsys, "explain", files["a"], "--why-not", "tp=16", "--json")
    assert json.loads(out)["rule"] == "tp must stay inside a node"
    rc, out, _ = run(capsys, "explain", files["a"], "--json")
    assert {n["change"] for n in json.loads(out)["neighbours"]} >= {"tp x2", "pp x2", "mbs x2"}


def test_trace(files, capsys, tmp_path, plan_uneven):
    path = tmp_path / "t.json"
    rc, out, _ = run(capsys, "trace", files["u"], "-o", str(path), "--json")
    assert rc == 0
    summary = json.loads(out)
    trace = json.loads(path.read_text())
    m = num_microbatches(plan_uneven.parallel, plan_uneven.training)
    assert {int(k): v for k, v in summary["slices_per_rank"].items()} == slice_counts(trace)
    assert all(v["forward"] == m for v in slice_counts(trace).values())


def test_export(files, capsys, tmp_path):
    rc, out, err = run(capsys, "export", files["u"])
    assert rc == 0 and "--decoder-first-pipeline-num-layers 11" in out and err == ""
    rc, out, _ = run(capsys, "export", files["a"], "--format", "megatron", "--json")
    assert json.loads(out)["flags"]["--num-layers-per-virtual-pipeline-stage"] == 4
    dest = tmp_path / "titan.toml"
    rc, out, err = run(capsys, "export", files["a"], "--format", "torchtitan", "--torchtitan-version", "0.2",
                       "-o", str(dest))
    assert rc == 0 and toml_loads(dest.read_text())["parallelism"]["tensor_parallel_degree"] == 8
    py = tmp_path / "titan_cfg.py"
    rc, _, _ = run(capsys, "export", files["a"], "--format", "torchtitan", "-o", str(py))
    assert rc == 0 and "config.parallelism.tensor_parallel_degree = 8" in py.read_text()
    assert "warning" in err  # gpt3 is not a torchtitan llama3 flavour: said on stderr, not in the file


def test_scaling(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "80")
    try:
        from autoplan.inspect.scaling import default_search

        default_search()
    except Exception:  # noqa: BLE001
        rc, _, err = run(capsys, "scaling", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g", "--gpus", "8,16",
                         "--global-batch", "64")
        assert rc == 2 and err.count("\n") == 1
        return
    png = tmp_path / "s.png"
    rc, out, _ = run(capsys, "scaling", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g", "--gpus", "8,16",
                     "--global-batch", "64", "--seq-len", "2048", "--plot", str(png))
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert_fits_width(out)
    rc, out, _ = run(capsys, "scaling", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g", "--gpus", "8,16",
                     "--global-batch", "64", "--fix", "tp=1", "--json")
    d = json.loads(out)
    assert [r["gpus"] for r in d["rows"]] == [8, 16] and all(r["parallel"]["tp"] == 1 for r in d["rows"])


@pytest.mark.parametrize("argv", [
    ["show", "/nonexistent/plan.json"],
    ["explain", "PLAN", "--why-not", "tq=4"],
    ["scaling", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g", "--gpus", "8,x", "--global-batch", "64"],
])
def test_errors_are_one_line(files, capsys, argv):
    argv = [files["a"] if a == "PLAN" else a for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and err.startswith("autoplan: ") and err.count("\n") == 1


def test_tampered_plan_is_rejected(files, capsys, tmp_path):
    d = json.loads(Path(files["a"]).read_text())
    d["parallel"]["tp"] = 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    rc, _, err = run(capsys, "show", str(bad))
    assert rc == 2 and "modified" in err


def toml_loads(text: str) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads(text)
