"""benchmarks/overhead.py compares the runtime with plain PyTorch scripts; a ratio means something only if both
sides train the same thing. One torchrun launch (2 processes) runs two pairs for 3 steps and checks that the
runtime's losses equal the plain script's (fp32, rtol 1e-5). Timings are the benchmark's business, not a test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
# DDP (the runtime's ZeRO-0 path) and DTensor TP without sequence parallelism (plain and DTensor norms mixed).
LAYOUTS = ["dp zero=0", "tp"]


def test_runtime_and_plain_scripts_train_the_same_losses(tmp_path):
    out = tmp_path / "pairs.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(ROOT / "benchmarks" / "overhead.py"),
           "--worker", "--out", str(out), "--reps", "1", "--steps", "3", "--no-warmup", "--layouts", *LAYOUTS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), f"launch failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    results = {r["layout"]: r for r in json.loads(out.read_text())}
    assert sorted(results) == sorted(LAYOUTS)
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r.get('error')}\n{r.get('traceback', '')}"
        rep = r["reps"][0]
        a, b = rep["autoplan"]["losses"], rep["plain"]["losses"]
        assert len(a) == len(b) == 3, f"{name}: {a} vs {b}"
        assert r["loss_rel_diff"] <= 1e-5, f"{name}: runtime losses {a} vs plain {b}"
        assert a[-1] < a[0], f"{name}: the loss did not fall ({a})"  # both really trained
