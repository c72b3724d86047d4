"""One-process training runs of `python -m autoplan.runtime.train` for the tests that read its log: the plan
saved beside the log, the environment cleared of torchrun's variables, one thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_env() -> dict[str, str]:
    """This process's environment for a one-process run: one thread, this checkout, no torchrun variables."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def train_one_process(plan, tmp_path: Path, *, steps: int, args: tuple[str, ...] = (), timeout: float = 180):
    """Train `plan` for `steps` steps in a process of its own; returns the finished process and the log's
    records (the run must succeed)."""
    plan.save(tmp_path / "plan.json")
    log = tmp_path / "log.jsonl"
    proc = subprocess.run([sys.executable, "-m", "autoplan.runtime.train", "--plan", str(tmp_path / "plan.json"),
                           "--steps", str(steps), "--log", str(log), *args], cwd=ROOT, env=train_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [json.loads(line) for line in log.read_text().splitlines()]
