"""The README's `make test` runs every tier: `pytest tests` must collect the distributed tests too
(pytest skips folders named `dist` unless norecursedirs says otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pytest_tests_collects_every_tier():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for tier in ("tests/unit/", "tests/dist/test_parity.py", "tests/dist/test_checkpoint.py", "tests/kernels/",
                 "tests/capture/", "tests/search/", "tests/inspect/", "tests/runtime/", "tests/zoo/", "tests/gpu/",
                 "tests/tune/"):
        assert tier in r.stdout, f"{tier} not collected by `pytest tests`"
