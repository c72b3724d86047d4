"""The kernel benchmark's CPU smoke run works and reports what it measured."""

from __future__ import annotations

import json

import pytest

bench = pytest.importorskip("benchmarks.kernels")


def test_benchmark_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--device", "cpu", "--ops", "softmax", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "device: CPU" in printed and "Triton interpreter" in printed
    data = json.loads(out.read_text())
    assert [r["impl"] for r in data["rows"]] == ["fused", "eager"]  # torch.compile is off on CPU
    assert all(r["fwd_ms"] > 0 and r["note"] == "" for r in data["rows"])
    with pytest.raises(SystemExit):
        bench.main(["--ops", "no_such_op"])
