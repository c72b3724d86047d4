"""The parity suites' launcher: a batch that hangs is killed with all its workers, and the test says so."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.dist import worker_loop

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too (its parent, torchrun, is killed with it and init reaps it)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_launch_is_killed_with_its_workers(tmp_path, monkeypatch):
    worker = tmp_path / "hang_worker.py"
    pids = tmp_path / "pids"
    worker.write_text("import os, sys, time\n"
                      f"open({str(pids)!r} + os.environ['RANK'], 'w').write(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    monkeypatch.setattr(worker_loop, "LAUNCH_TIMEOUT_S", 15)
    t0 = time.perf_counter()
    with pytest.raises(pytest.fail.Exception, match="hung for 15 s; it was stopped, its workers with it"):
        worker_loop.launch_workers(worker, 2, ["case"], tmp_path / "out.json", ROOT)
    assert time.perf_counter() - t0 < 60
    workers = [int(Path(f"{pids}{r}").read_text()) for r in range(2)]  # both started before the timeout
    time.sleep(0.5)
    assert not any(_alive(p) for p in workers), workers
