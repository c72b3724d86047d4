"""The Plan file: round trip, content hash, schema version, corrupt files — each a one-line PlanError."""

from __future__ import annotations

import json

import pytest

from autoplan.api import make_plan
from autoplan.cost_models.errors import PlanError
from autoplan.plan import SCHEMA_VERSION, Plan, load_plan
from autoplan.specs import TrainingSpec, load_cluster, load_model


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(load_model("gpt3-1.3b"), load_cluster("dgx-a100-80g", gpus=16),
                     TrainingSpec(global_batch_size=64, seq_length=2048), "tp=2,pp=2,mbs=2,zero=1")


def test_round_trip_is_byte_identical(plan, tmp_path):
    p = plan.save(tmp_path / "p.json")
    again = load_plan(p)
    assert again == plan
    assert again.to_json() == p.read_text()
    assert len(again.stages) == 2 and again.stages[1].has_head and again.stages[0].has_embedding
    assert again.prediction.step_time_s > 0 and len(again.prediction.memory_breakdown) == 2


def _edit(plan: Plan, tmp_path, fn) -> str:
    d = json.loads(plan.to_json())
    fn(d)
    p = tmp_path / "edited.json"
    p.write_text(json.dumps(d))
    return str(p)


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["parallel"].update(tp=4), "modified after it was made"),
    (lambda d: d.update(schema_version=SCHEMA_VERSION + 1), "schema_version"),
    (lambda d: d.pop("stages"), "does not match the schema"),
    (lambda d: d["prediction"].update(step_time_s="fast"), "does not match the schema"),
])
def test_edited_plans_are_rejected(plan, tmp_path, edit, needle):
    with pytest.raises(PlanError, match=needle) as e:
        load_plan(_edit(plan, tmp_path, edit))
    assert "\n" not in str(e.value) and "fix:" in str(e.value)


def test_corrupt_and_missing_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "model": ')
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(PlanError, match="not a JSON object"):
        load_plan(bad)
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "nope.json")


def test_save_is_atomic(plan, tmp_path):
    p = plan.save(tmp_path / "p.json")
    assert not (tmp_path / "p.json.tmp").exists() and p.exists()


def test_json_schema_names_every_field():
    schema = Plan.model_json_schema()
    assert {"model", "cluster", "training", "parallel", "stages", "prediction", "provenance"} <= set(
        schema["properties"])
