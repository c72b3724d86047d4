"""Vocab-parallel cross-entropy under real gloo with 2 processes (see vocab_parallel_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("vocab_parallel_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
def test_vocab_parallel_cross_entropy_two_ranks():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(WORKER)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "vocab-parallel cross-entropy: OK" in proc.stdout
