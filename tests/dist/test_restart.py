"""Long runs under real torchrun (2 gloo processes, tiny-gpt dp=2, Megatron-format data over several epochs):

1. an uninterrupted run: the reference losses;
2. rank 1 SIGKILLed after step 3 with `--max-restarts 1`: torchrun restarts both workers, they resume from the
   newest complete checkpoint (step 2) and the whole run's losses equal the reference bit for bit; the log holds one
   restart row and no duplicate steps; prints the time from the kill to the first step trained again;
3. SIGTERM to `autoplan run`: every worker stops after the same step, saves it, the job exits 143 with one line on
   how to resume, no traceback, no process left;
4. rank 1 stopped (SIGSTOP) after step 2: rank 0's collective times out (--collective-timeout) with a line naming
   rank 1; SIGTERM then ends the job within --term-timeout, hung rank included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from autoplan.api import make_plan
from autoplan.specs import TrainingSpec, load_cluster, load_model

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
AUTOPLAN = Path(sys.executable).with_name("autoplan")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from autoplan.runtime.indexed_data import write_indexed

    tmp = tmp_path_factory.mktemp("restart")
    plan = make_plan(load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(2),
                     TrainingSpec(global_batch_size=4, seq_length=64, dtype="fp32"), "dp=2", kernels="torch")
    rng = np.random.default_rng(0)
    # ~1,000 tokens: 15 samples of 64+1, so 6 steps of 4 sequences run through more than one epoch
    write_indexed(tmp / "data", [rng.integers(0, 128, rng.integers(20, 60)) for _ in range(25)], dtype=np.int32)
    return {"tmp": tmp, "plan": str(plan.save(tmp / "plan.json")), "data": str(tmp / "data")}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOPLAN_FAULT", "TORCHELASTIC"))}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)


def _rows(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()]


def _alive(marker: str) -> list[int]:
    """Processes whose command line names this test's directory (workers, torchrun, launcher)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and d.name != str(os.getpid()):
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                state = (d / "stat").read_text().split()[2]
            except OSError:
                continue
            if marker in cmd and state != "Z":
                pids.append(int(d.name))
    return pids


def _launch(setup, name: str, steps: int, extra: list[str], env: dict, **kw) -> tuple[list[str], Path, Path]:
    ck, log = setup["tmp"] / f"ck-{name}", setup["tmp"] / f"{name}.jsonl"
    cmd = [str(AUTOPLAN), "run", setup["plan"], *extra, "--", "--steps", str(steps), "--data", setup["data"],
           "--save", str(ck), "--log", str(log), "--quiet", *kw.get("train", [])]
    return cmd, ck, log


@pytest.fixture(scope="module")
def reference(setup):
    cmd, ck, log = _launch(setup, "ref", 6, [], {}, train=["--save-every", "2"])
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    return {r["step"]: r["loss"] for r in _rows(log)}


def test_killed_rank_restarts_and_the_losses_equal_an_uninterrupted_run(setup, reference):
    stamp = setup["tmp"] / "kill.json"
    cmd, ck, log = _launch(setup, "kill", 6, ["--max-restarts", "1"], {}, train=["--save-every", "2"])
    p = subprocess.run(cmd, cwd=ROOT, env=_env(AUTOPLAN_FAULT="kill:1:3", AUTOPLAN_FAULT_STAMP=str(stamp)),
                       capture_output=True, text=True, timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(log)
    events = [r for r in rows if "event" in r]
    steps = [r for r in rows if "step" in r]
    assert len(events) == 1 and events[0]["restart"] == 1 and events[0]["at_step"] == 2
    assert events[0]["steps_redone"] == 1 and events[0]["resumed_from"].endswith("step_2")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert {r["step"]: r["loss"] for r in steps} == reference  # bit-exact
    killed = json.loads(stamp.read_text())
    assert killed["fault"] == "kill" and killed["rank"] == 1
    back = next(r["time"] for r in steps if r["step"] == 3) - killed["at"]
    print(f"\nkilled rank -> first step trained again: {back:.1f} s (restart row written "
          f"{events[0]['time'] - killed['at']:.1f} s after the kill)")
    assert not _alive(str(setup["tmp"]))


def test_async_save_checkpoints_resume_like_synchronous_ones(setup, reference):
    """--async-save under torchrun (2 ranks, a gloo group of its own for the writes): the run's losses equal the
    reference, every checkpoint verifies, and resuming from a background-written one continues bit-exactly."""
    from autoplan.runtime import checkpoint

    cmd, ck, log = _launch(setup, "async", 6, [], {}, train=["--save-every", "2", "--async-save"])
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    assert {r["step"]: r["loss"] for r in _rows(log)} == reference
    assert [s for s, _ in checkpoint.step_dirs(ck)] == [6, 4, 2]
    for _, d in checkpoint.step_dirs(ck):
        checkpoint.verify(d)
    log2 = setup["tmp"] / "async-resumed.jsonl"
    cmd = [str(AUTOPLAN), "run", setup["plan"], "--", "--steps", "6", "--data", setup["data"], "--resume",
           str(ck / "step_4"), "--log", str(log2), "--quiet"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    assert {r["step"]: r["loss"] for r in _rows(log2) if "step" in r} == {s: reference[s] for s in (5, 6)}


def test_the_ranks_hash_the_shards_between_them_and_agree(setup, reference):
    """A bit flipped in the shard rank 1 hashes (`checkpoint.shard_share`: rank 0 never reads it): --resume stops
    both ranks with one line naming the shard; --auto-resume moves both to the previous checkpoint and the losses
    continue bit-exactly."""
    import shutil

    from autoplan.runtime import checkpoint

    ck = setup["tmp"] / "ck-flip"
    shutil.copytree(setup["tmp"] / "ck-ref", ck, ignore=shutil.ignore_patterns(".autoplan.lock"))
    (rel,) = checkpoint.shard_share(checkpoint.read_manifest(ck / "step_6"), 1, 2)
    assert rel not in checkpoint.shard_share(checkpoint.read_manifest(ck / "step_6"), 0, 2)
    f = ck / "step_6" / rel
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x10
    f.write_bytes(bytes(b))
    base = [str(AUTOPLAN), "run", setup["plan"], "--", "--steps", "8", "--data", setup["data"], "--quiet"]
    p = subprocess.run([*base, "--resume", str(ck)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=400)
    assert p.returncode != 0
    said = [x for x in p.stderr.splitlines() if "is corrupt" in x]
    assert len(said) == 1 and f"step_6 is corrupt: shard {rel} fails its sha256 check" in said[0], p.stderr[-3000:]
    log = setup["tmp"] / "flip.jsonl"
    p = subprocess.run([*base, "--save", str(ck), "--auto-resume", "--log", str(log)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("skipped a broken checkpoint") == 1, p.stderr[-3000:]
    got = {r["step"]: r["loss"] for r in _rows(log) if "step" in r}
    assert got == {s: reference[s] for s in (5, 6)} | {s: got[s] for s in (7, 8)}


def _reader(proc, lines: list[str]) -> threading.Thread:
    def run():
        for line in proc.stderr:
            lines.append(line)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sigterm_saves_a_checkpoint_and_exits_with_one_line(setup):
    from autoplan.runtime import checkpoint

    cmd, ck, log = _launch(setup, "term", 500, [], {}, train=["--save-every", "100"])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    lines: list[str] = []
    reader = _reader(proc, lines)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 2):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    reader.join(timeout=10)
    err = "".join(lines)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    stopped = [x for x in lines if "stopped by SIGTERM after step" in x]
    assert len(stopped) == 1 and "--resume" in stopped[0] and "Traceback" not in err, err[-3000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert checkpoint.inspect(ck)["step"] == step and step < 500
    assert max(r["step"] for r in _rows(log)) == step
    time.sleep(1)
    assert not _alive(str(setup["tmp"]))


def test_hung_rank_is_named_and_the_job_still_ends(setup):
    cmd, ck, log = _launch(setup, "hang", 50, ["--term-timeout", "5"], {},
                           train=["--collective-timeout", "10"])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(AUTOPLAN_FAULT="hang:1:2"), stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    reader = _reader(proc, lines)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any("did not complete" in x for x in lines):
        time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    took = time.monotonic() - t0
    msg = [x for x in lines if "did not complete" in x]
    assert msg and "missing: rank 1 (no heartbeat for" in msg[0] and "--collective-timeout 10" in msg[0], \
        "".join(lines)[-3000:]
    assert took < 30
    time.sleep(1)
    assert not _alive(str(setup["tmp"]))
