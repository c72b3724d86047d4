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
    # the message names the case that was running (the first without a result line) and how many were done
    with pytest.raises(pytest.fail.Exception,
                       match=r"hung for 15 s in case case \(0 done\); it was stopped, its workers with it"):
        worker_loop.launch_workers(worker, 2, ["case"], tmp_path / "out.json", ROOT)
    assert time.perf_counter() - t0 < 60
    workers = [int(Path(f"{pids}{r}").read_text()) for r in range(2)]  # both started before the timeout
    time.sleep(0.5)
    assert not any(_alive(p) for p in workers), workers


def test_a_hung_parity_worker_says_which_case_and_where_its_ranks_wait(tmp_path, monkeypatch):
    """A worker built on worker_main whose second case hangs in a collective (rank 0 in a barrier rank 1 never
    joins): the failure names that case and carries both ranks' stacks (faulthandler, armed 20 s before the
    launch's timeout)."""
    worker = tmp_path / "hang_worker.py"
    worker.write_text(f"""import sys, time
sys.path.insert(0, {str(ROOT)!r})
import tests.dist.worker_loop as wl
wl.LAUNCH_TIMEOUT_S = 25
import torch.distributed as dist

def make_runner(world, rank):
    def run(case):
        if case == "second":
            if rank == 0:
                dist.barrier()
            else:
                time.sleep(120)
        return {{"case": case, "ok": True, "seconds": 0.0}}
    return run

sys.exit(wl.worker_main(make_runner))
""")
    monkeypatch.setattr(worker_loop, "LAUNCH_TIMEOUT_S", 25)
    with pytest.raises(pytest.fail.Exception) as err:
        worker_loop.launch_workers(worker, 2, ["first", "second", "third"], tmp_path / "out.json", ROOT)
    msg = str(err.value)
    assert "hung for 25 s in case second (1 done)" in msg
    assert msg.count("hang_worker.py\", line") >= 2  # a stack from each rank, down to the case's own code
