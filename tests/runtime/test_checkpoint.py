"""Checkpoints in one process: save + resume equals an uninterrupted run, and a missing, incomplete, corrupt or
wrong-model checkpoint stops at start-up with one clear line; a save that fails midway keeps the previous one.
(Resuming under other layouts is in tests/dist/test_checkpoint.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autoplan.api import make_plan
from autoplan.specs import TrainingSpec, load_cluster, load_model

torch = pytest.importorskip("torch")
torch.set_num_threads(1)


def _plan(tmp: Path, model: str = "tiny-gpt", gbs: int = 4) -> Path:
    training = TrainingSpec(global_batch_size=gbs, seq_length=64, dtype="fp32")
    plan = make_plan(load_model(model), load_cluster("local-cpu").with_gpus(1), training, "dp=1", kernels="torch")
    return plan.save(tmp / f"{model}-{gbs}.json")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _train(*args) -> int:
    from autoplan.runtime import train

    return train.main([*map(str, args), "--quiet"])


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """tiny-gpt trained 4 steps uninterrupted (log), checkpoints at steps 2 and 4."""
    from autoplan.runtime import train

    tmp = tmp_path_factory.mktemp("ckpt")
    plan = _plan(tmp)
    mp = pytest.MonkeyPatch()
    for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        mp.delenv(var, raising=False)
    rc = train.main(["--plan", str(plan), "--steps", "4", "--save", str(tmp / "ck"), "--save-every", "2",
                     "--log", str(tmp / "ref.jsonl"), "--quiet"])
    mp.undo()
    assert rc == 0
    return tmp


def _copy(base: Path, tmp: Path) -> Path:
    shutil.copytree(base / "ck", tmp / "ck")
    return tmp / "ck"


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_save_and_resume_equals_uninterrupted(base, tmp_path):
    ck = base / "ck"
    assert sorted(p.name for p in ck.iterdir() if not p.name.startswith(".")) == ["latest", "step_2", "step_4"]
    assert (ck / "latest").read_text().strip() == "step_4"
    log = tmp_path / "resumed.jsonl"
    assert _train("--plan", _plan(tmp_path), "--steps", "4", "--resume", ck / "step_2", "--log", log) == 0
    ref, got = _losses(base / "ref.jsonl"), _losses(log)
    assert sorted(got) == [3, 4]
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=0)


def test_resume_from_the_parent_follows_latest(base, tmp_path):
    from autoplan.runtime import checkpoint

    assert checkpoint.inspect(base / "ck")["step"] == 4
    log = tmp_path / "log.jsonl"
    assert _train("--plan", _plan(tmp_path), "--steps", "5", "--resume", base / "ck", "--log", log) == 0
    assert sorted(_losses(log)) == [5]
    assert _train("--plan", _plan(tmp_path), "--steps", "4", "--resume", base / "ck") == 0  # nothing left to do


def test_missing_directory(tmp_path, capsys):
    assert _train("--plan", _plan(tmp_path), "--resume", tmp_path / "nope") == 2
    line = _error(capsys)
    assert line.startswith("autoplan run: CheckpointError: checkpoint") and "nope does not exist" in line


def test_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert _train("--plan", _plan(tmp_path), "--resume", tmp_path / "empty") == 2
    assert "is not a checkpoint" in _error(capsys)


def test_truncated_metadata(base, tmp_path, capsys):
    ck = _copy(base, tmp_path)
    md = ck / "step_4" / ".metadata"
    md.write_bytes(md.read_bytes()[:100])
    assert _train("--plan", _plan(tmp_path), "--steps", "6", "--resume", ck) == 2
    line = _error(capsys)
    assert "checkpoint" in line and "step_4 is corrupt" in line and ".metadata" in line


def test_missing_and_truncated_shard(base, tmp_path, capsys):
    ck = _copy(base, tmp_path)
    shard = next((ck / "step_4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    assert _train("--plan", _plan(tmp_path), "--steps", "6", "--resume", ck) == 2
    assert f"shard {shard.name} has 1000 bytes" in _error(capsys)
    shard.unlink()
    assert _train("--plan", _plan(tmp_path), "--steps", "6", "--resume", ck) == 2
    assert f"is incomplete: shard {shard.name} is missing" in _error(capsys)


def test_incomplete_checkpoint_without_its_json(base, tmp_path, capsys):
    ck = _copy(base, tmp_path)
    (ck / "step_2" / "autoplan_checkpoint.json").unlink()
    assert _train("--plan", _plan(tmp_path), "--steps", "6", "--resume", ck / "step_2") == 2
    assert "step_2 is incomplete" in _error(capsys)
    (ck / "step_4" / "autoplan_checkpoint.json").write_text("{not json")
    assert _train("--plan", _plan(tmp_path), "--steps", "6", "--resume", ck) == 2
    assert "step_4 is corrupt" in _error(capsys)
    (ck / "latest").write_text("step_9\n")
    assert _train("--plan", _plan(tmp_path), "--steps", "6", "--resume", ck) == 2
    assert "points to 'step_9'" in _error(capsys)


def test_checkpoint_of_another_model(base, tmp_path, capsys):
    assert _train("--plan", _plan(tmp_path, "tiny-llama"), "--steps", "6", "--resume", base / "ck") == 2
    line = _error(capsys)
    assert "is of model 'tiny-gpt', not the plan's 'tiny-llama'" in line


def test_checkpoint_of_another_shape_or_batch(base, tmp_path, capsys):
    from autoplan.plan import load_plan
    from autoplan.runtime import checkpoint

    meta = checkpoint.inspect(base / "ck")
    plan = load_plan(_plan(tmp_path))
    bigger = plan.model_copy(update={"model": plan.model.model_copy(update={"hidden_size": 128})})
    with pytest.raises(checkpoint.CheckpointError, match="another shape.*hidden_size: checkpoint 64 vs plan 128"):
        checkpoint.check_compatible(meta, bigger)
    assert _train("--plan", _plan(tmp_path, gbs=8), "--steps", "6", "--resume", base / "ck") == 2
    assert "global batch 4 x sequence 64" in _error(capsys)


def test_failed_save_keeps_the_previous_checkpoint(base, tmp_path, monkeypatch, capsys):
    import torch.distributed.checkpoint as dcp

    ck = _copy(base, tmp_path)
    real_save = dcp.save

    def failing_save(state_dict, *, storage_writer, **kw):
        Path(storage_writer.fs.concat_path(storage_writer.path, "__0_0.distcp")).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", failing_save)
    assert _train("--plan", _plan(tmp_path), "--steps", "6", "--resume", ck, "--save", ck) == 2
    line = _error(capsys)
    assert "saving checkpoint" in line and "step_6 failed" in line and "disk full" in line
    assert sorted(p.name for p in ck.iterdir() if not p.name.startswith(".")) == ["latest", "step_2", "step_4"]  # no step_6, no temporary
    assert (ck / "latest").read_text().strip() == "step_4"
    monkeypatch.setattr(dcp, "save", real_save)
    log = tmp_path / "after.jsonl"
    assert _train("--plan", _plan(tmp_path), "--steps", "5", "--resume", ck, "--save", ck, "--log", log) == 0
    assert (ck / "latest").read_text().strip() == "step_5" and sorted(_losses(log)) == [5]


def test_save_every_needs_save(tmp_path, capsys):
    assert _train("--plan", _plan(tmp_path), "--save-every", "2") == 2
    assert "--save-every needs --save DIR" in _error(capsys)
    assert _train("--plan", _plan(tmp_path), "--save", tmp_path / "ck", "--async-save") == 2
    assert "--async-save needs --save DIR --save-every K" in _error(capsys)


def _slow_writes(monkeypatch, seconds: float, fail: bool = False) -> list[float]:
    """DCP's file writes, in whatever thread runs them, wait `seconds` first (or fail): training goes on meanwhile."""
    import time

    import torch.distributed.checkpoint as dcp

    real, starts = dcp.FileSystemWriter.write_data, []

    def write_data(self, plan, planner):
        starts.append(time.time())
        time.sleep(seconds)
        if fail:
            raise OSError("disk full")
        return real(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    return starts


def test_async_save_writes_a_snapshot_while_training_goes_on(base, tmp_path, monkeypatch):
    """--async-save: step 2's checkpoint is written while steps 3 and 4 train (its writer is held for 1.5 s), and
    it still holds step 2's state: resuming from it gives the uninterrupted run's losses; every checkpoint
    verifies and the run's own losses are unchanged."""
    from autoplan.runtime import checkpoint

    starts = _slow_writes(monkeypatch, 1.5)
    ck, log = tmp_path / "ck", tmp_path / "async.jsonl"
    assert _train("--plan", _plan(tmp_path), "--steps", "4", "--save", ck, "--save-every", "2", "--async-save",
                  "--log", log) == 0
    ref = _losses(base / "ref.jsonl")
    assert _losses(log) == ref
    steps = {r["step"]: r["time"] for r in map(json.loads, log.read_text().splitlines())}
    assert steps[3] < starts[0] + 1.5  # step 3 trained while step 2's shards were still being written
    assert sorted(p.name for p in ck.iterdir() if not p.name.startswith(".")) == ["latest", "step_2", "step_4"]
    for name in ("step_2", "step_4"):
        checkpoint.verify(ck / name)
    monkeypatch.undo()
    resumed = tmp_path / "resumed.jsonl"
    assert _train("--plan", _plan(tmp_path), "--steps", "4", "--resume", ck / "step_2", "--log", resumed) == 0
    got = _losses(resumed)
    assert sorted(got) == [3, 4] and all(got[s] == ref[s] for s in got)


def test_failed_async_save_is_one_line_and_keeps_the_previous_checkpoint(base, tmp_path, monkeypatch, capsys):
    ck = _copy(base, tmp_path)
    _slow_writes(monkeypatch, 0.0, fail=True)
    assert _train("--plan", _plan(tmp_path), "--steps", "8", "--resume", ck, "--save", ck, "--save-every", "2",
                  "--async-save") == 2
    line = _error(capsys)
    assert "saving checkpoint" in line and "step_6 failed" in line and "disk full" in line
    assert sorted(p.name for p in ck.iterdir() if not p.name.startswith(".")) == ["latest", "step_2", "step_4"]
    assert (ck / "latest").read_text().strip() == "step_4"


# ----------------------------------------------------------------------------- trust (issue 18, SECURITY.md)


class _RunsCode:
    """Unpickling this creates the file named `path`: what a hostile DCP .metadata can do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _foreign_dcp_dir(tmp: Path) -> tuple[Path, Path]:
    import pickle

    ck, marker = tmp / "foreign" / "step_1", tmp / "PWNED"
    ck.mkdir(parents=True)
    (ck / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    (ck / "__0_0.distcp").write_bytes(b"\0" * 64)
    (ck.parent / "latest").write_text("step_1\n")
    return ck, marker


def test_resume_refuses_a_checkpoint_autoplan_did_not_write(tmp_path, capsys):
    """A DCP directory without autoplan's file is refused before its pickle is read, by the runtime and by
    `autoplan run` (before torchrun starts)."""
    from autoplan.cli import main

    ck, marker = _foreign_dcp_dir(tmp_path)
    plan = _plan(tmp_path)
    assert _train("--plan", plan, "--steps", "2", "--resume", ck) == 2
    line = _error(capsys)
    assert "was not written by autoplan" in line and "fix:" in line and "SECURITY.md" in line
    assert main(["run", str(plan), "--print-command", "--", "--steps", "2", "--resume", str(ck.parent)]) == 2
    assert "was not written by autoplan" in _error(capsys)
    assert main(["run", str(plan), "--print-command", "--", f"--resume={ck}"]) == 2
    assert "was not written by autoplan" in _error(capsys)
    assert not marker.exists()  # the pickle never ran
    (ck / "autoplan-manifest.json").write_text(json.dumps({"writer": "someone else", "version": 1, "files": {}}))
    assert _train("--plan", plan, "--steps", "2", "--resume", ck) == 2
    assert "was not written by autoplan" in _error(capsys) and not marker.exists()


def test_check_trusted_accepts_autoplans_own(base):
    from autoplan.runtime import checkpoint

    meta = checkpoint.check_trusted(base / "ck" / "step_4")
    assert meta["step"] == 4 and meta["model"]["name"] == "tiny-gpt"
