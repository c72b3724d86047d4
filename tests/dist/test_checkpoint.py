"""Checkpoints under torchrun: save/resume gives the losses of an uninterrupted run, in the same layout and in
others (DCP reshards), including back to one process.

Two torchrun launches of 2 processes:
  1. `autoplan.runtime.train` (the CLI) with dp=2: 8 steps, --save-every 3 -> the uninterrupted losses and step_3, step_6,
     step_8 checkpoints written mid-run.
  2. tests/dist/checkpoint_worker.py: resume step_3 to step 6 under dp=2 (same layout), pp=2 (tied head copy),
     pp=2 interleaved, tp=2 with sp, dp=2 ZeRO-3; the pp=2 run saves its step 6.
Then one process (in this pytest process) resumes the pp=2 step_6 checkpoint to step 8.
tiny-gpt has tied embeddings and no dropout; fp32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.api import make_plan
from autoplan.specs import TrainingSpec, load_cluster, load_model

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
WORKER = Path(__file__).with_name("checkpoint_worker.py")
RESUMED = ["dp=2", "pp=2", "pp=2,vp=2", "tp=2,sp=1", "dp=2,zero=3"]


def _plan(tmp: Path, gpus: int, config: str) -> Path:
    training = TrainingSpec(global_batch_size=4, seq_length=64, dtype="fp32")
    plan = make_plan(load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(gpus), training, config,
                     kernels="torch")
    return plan.save(tmp / f"plan-{config.replace(',', '_').replace('=', '')}.json")


def _torchrun(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    ref_log, ckpt = tmp / "ref.jsonl", tmp / "ckpt"
    proc = _torchrun("-m", "autoplan.runtime.train", "--", "--plan", str(_plan(tmp, 2, "dp=2")), "--steps", "8",
                     "--save", str(ckpt), "--save-every", "3", "--log", str(ref_log), "--quiet")
    if proc.returncode != 0:
        pytest.fail(f"reference run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    resumed = []
    for config in RESUMED:
        log = tmp / f"resume-{config}.jsonl"
        save = f" --save {tmp / 'ckpt-pp2'}" if config == "pp=2" else ""
        resumed.append((config, log, f"--plan {_plan(tmp, 2, config)} --steps 6 --resume {ckpt / 'step_3'} "
                                     f"--log {log} --quiet{save}"))
    out = tmp / "worker.json"
    proc = _torchrun(str(WORKER), "--out", str(out), *[r for _, _, r in resumed])
    results = json.loads(out.read_text()) if out.exists() else []
    return {"tmp": tmp, "ckpt": ckpt, "ref": _losses(ref_log), "resumed": resumed, "results": results,
            "stderr": proc.stderr[-4000:]}


def test_reference_run_saved_every_3_steps_and_at_the_end(runs):
    ckpt = runs["ckpt"]
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["latest", "step_3", "step_6", "step_8"]
    assert (ckpt / "latest").read_text().strip() == "step_8"
    meta = json.loads((ckpt / "step_3" / "autoplan_checkpoint.json").read_text())
    assert meta["step"] == 3 and meta["model"]["name"] == "tiny-gpt" and meta["data"]["next_step"] == 3
    assert sorted(runs["ref"]) == list(range(1, 9))


def test_resume_same_layout_is_identical(runs):
    _check_resumed(runs, "dp=2", rtol=1e-6)


@pytest.mark.parametrize("config", [c for c in RESUMED if c != "dp=2"])
def test_resume_under_another_layout(runs, config):
    _check_resumed(runs, config, rtol=1e-5)


def _check_resumed(runs, config: str, rtol: float) -> None:
    done = {r["run"]: r for r in runs["results"]}
    _, log, run = next(x for x in runs["resumed"] if x[0] == config)
    r = done.get(run)
    assert r is not None, f"{config} did not run:\n{runs['stderr']}"
    assert "error" not in r and r["rc"] == 0, f"{config}: {r.get('error')}\n{r.get('traceback', '')}"
    got = _losses(log)
    assert sorted(got) == [4, 5, 6]
    for step, loss in got.items():
        assert loss == pytest.approx(runs["ref"][step], rel=rtol, abs=0), f"{config} step {step}"


def test_single_process_resumes_a_pipeline_checkpoint(runs, monkeypatch, capsys):
    from autoplan.runtime import train

    for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    tmp = runs["tmp"]
    assert (tmp / "ckpt-pp2" / "latest").read_text().strip() == "step_6", runs["stderr"]
    log = tmp / "single.jsonl"
    rc = train.main(["--plan", str(_plan(tmp, 1, "dp=1")), "--steps", "8", "--resume", str(tmp / "ckpt-pp2"),
                     "--log", str(log), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    got = _losses(log)
    assert sorted(got) == [7, 8]
    for step, loss in got.items():
        assert loss == pytest.approx(runs["ref"][step], rel=1e-5, abs=0), f"step {step}"
