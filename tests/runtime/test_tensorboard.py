"""`--tensorboard DIR`: the log's fields, measured MFU and timestamps, read back with TensorBoard's own reader."""

from __future__ import annotations

import json

import pytest

from autoplan.api import make_plan
from autoplan.specs import TrainingSpec, load_cluster, load_model

pytest.importorskip("torch")
pytest.importorskip("tensorboard")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_tensorboard_has_the_log_fields_and_measured_mfu(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from autoplan.runtime import train

    training = TrainingSpec(global_batch_size=4, seq_length=64, dtype="fp32")
    plan = make_plan(load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(1), training, "dp=1",
                     kernels="torch")
    path = plan.save(tmp_path / "p.json")
    log, tb = tmp_path / "log.jsonl", tmp_path / "tb"
    assert train.main(["--plan", str(path), "--steps", "3", "--log", str(log), "--tensorboard", str(tb),
                       "--quiet"]) == 0
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in rows[0]:
        if key != "step" and isinstance(rows[0][key], (int, float)):
            assert f"train/{key}" in tags, key
    assert {"train/measured_mfu", "train/timestamp"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    mfu = acc.Scalars("train/measured_mfu")
    for e, r in zip(mfu, rows):
        want = plan.prediction.mfu * plan.prediction.step_time_s / r["step_time_s"]
        assert e.value == pytest.approx(want, rel=1e-5)
    assert all(e.wall_time > 1.7e9 for e in loss)
