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
    # another tool's JSON: named as not a plan (it read "schema_version None" until session 25)
    bad.write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(PlanError, match=r"is not an autoplan plan: it has no schema_version \(keys: hidden_size, "
                                        r"model_type\)"):
        load_plan(bad)
    bad.write_text('{"schema_version": 99}')
    with pytest.raises(PlanError, match="has schema_version 99"):
        load_plan(bad)


def test_save_is_atomic(plan, tmp_path):
    p = plan.save(tmp_path / "p.json")
    assert not (tmp_path / "p.json.tmp").exists() and p.exists()


def test_json_schema_names_every_field():
    schema = Plan.model_json_schema()
    assert {"model", "cluster", "training", "parallel", "stages", "prediction", "provenance"} <= set(
        schema["properties"])


# ----------------------------------------------------------------------------- strict validation on load (issue 18)
# A plan is shared and untrusted: an edit that is re-hashed passes the hash, so the rules must hold on their own.


def _rehashed(plan: Plan, tmp_path, fn, name="forged.json") -> str:
    import hashlib

    d = json.loads(plan.to_json())
    fn(d)
    try:  # the hash autoplan itself would compute (fields added later are hashed only when set)
        d["content_hash"] = Plan.model_validate(d).compute_hash()
    except Exception:  # an edit the schema rejects anyway: any hash will do
        body = {k: v for k, v in d.items() if k != "content_hash"}
        d["content_hash"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return str(p)


@pytest.fixture(scope="module")
def small() -> Plan:
    """8 sequences per step on 2 ranks (dp=2, mbs=1), 4 layers in 2 stages: room for every edit below."""
    return make_plan(load_model("tiny-gpt"), load_cluster("local-cpu", gpus=4),
                     TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32"), "pp=2,dp=2")


def _stage(i, **kw):
    return lambda d: d["stages"][i].update(**kw)


@pytest.mark.parametrize("edit,needle", [
    # the layout is no longer the world size: tp changed, product 2*2*2 = 8 on 4 ranks
    (lambda d: d["parallel"].update(tp=2), "tp*pp*cp*dp must equal the world size"),
    (lambda d: d["parallel"].update(dp=None), "parallel.dp must be resolved"),
    # mbs=3 with 8 sequences on dp=2: one micro-batch of 3 per rank would train 6 of the 8 sequences
    (lambda d: d["parallel"].update(mbs=3), "global batch must divide by dp*mbs"),
    (lambda d: d["training"].update(global_batch_size=7), "global batch must divide by dp*mbs"),
    (lambda d: d["stages"].pop(), "a plan has pp*vp stages"),
    (_stage(1, layers=[3, 4]), "stages cover the layers in order"),
    (_stage(1, layers=[2, 1]), "stages cover the layers in order"),
    (_stage(1, layers=[2, 3]), "stages cover every layer"),
    (_stage(1, pp_rank=0), "pipeline rank i % pp"),
    (_stage(0, has_head=True), "the embedding is on the first stage and the head on the last"),
    (_stage(0, recompute_layers=5), "recomputes at most its own layers"),
    (lambda d: d["model"].update(name='tiny"""\nimport os\n"""'), "model.name must be 1-200 printable characters"),
    (lambda d: d["cluster"].update(name="\x1b[2Jlocal"), "cluster.name must be 1-200 printable characters"),
    (lambda d: d["model"].update(num_attention_heads=3), "does not match the schema"),
    (lambda d: d["parallel"].update(tp="2"), "parallel.tp: Input should be a valid integer"),
    (lambda d: d["parallel"].update(sp=0), "parallel.sp: Input should be a valid boolean"),
    (lambda d: d["stages"][0].update(forward_s=-1.0), "greater than or equal to 0"),
    (lambda d: d["parallel"].update(tensor=2), "Extra inputs are not permitted"),
    (lambda d: d["parallel"].update(layout='Et|tL"""\nimport os'), "is inconsistent"),
    (lambda d: d["model"].update(activation="os.system"), "does not match the schema"),
    # a layout that disagrees with the stages (both valid alone): stage 0 has 2 blocks, the layout gives it 1
    (lambda d: d["parallel"].update(layout="Et|t*3L"), "stage 0 (pipeline rank 0) has 2 block(s)"),
])
def test_rehashed_edits_are_refused(small, tmp_path, edit, needle):
    with pytest.raises(PlanError) as e:
        load_plan(_rehashed(small, tmp_path, edit))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and "fix:" in msg, msg


def test_the_unedited_small_plan_loads(small, tmp_path):
    assert load_plan(_rehashed(small, tmp_path, lambda d: None)) == small


def test_nan_and_lone_surrogates_are_refused(small, tmp_path):
    p = _rehashed(small, tmp_path, _stage(0, forward_s=float("nan")))  # json writes NaN, which Python reads
    with pytest.raises(PlanError, match="stages.0.forward_s"):
        load_plan(p)
    p = _rehashed(small, tmp_path, lambda d: d["model"].update(name="a\ud800"))
    with pytest.raises(PlanError, match="not match the schema|not valid JSON"):
        load_plan(p)


@pytest.mark.parametrize("argv", [["show"], ["export", "--format", "megatron"], ["explain"], ["trace", "-o", "t.json"],
                                  ["codegen", "-o", "prog"], ["run", "--print-command"]])
def test_every_command_refuses_an_inconsistent_plan(small, tmp_path, capsys, monkeypatch, argv):
    from autoplan.cli import main

    monkeypatch.chdir(tmp_path)
    p = _rehashed(small, tmp_path, lambda d: d["parallel"].update(tp=2))
    assert main([argv[0], p, *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert "tp*pp*cp*dp must equal the world size" in err and "\n" not in err and "fix:" in err, err
    assert not (tmp_path / "prog").exists() and not (tmp_path / "t.json").exists()


def test_profiles_recorded_before_tensor_counts_still_load(plan, tmp_path):
    """A plan of a user's module records its layer profiles (Plan.profiles, session 15); `LayerProfile.
    param_tensors` and the cluster's `dtensor_param_us` came later. data/plan-s15-module-profiles.json was written
    by session 15's code (b6a0647, `autoplan estimate --model tests/capture/_models.py:split_lm ... -o`): it has
    neither, hashes without them and still loads; a recorded count is hashed, so an edited one is caught."""
    from pathlib import Path

    from autoplan.cost_models.profile import profile_from_spec

    old = load_plan(Path(__file__).parent / "data" / "plan-s15-module-profiles.json")
    assert old.profiles and not any(p.param_tensors for p in old.profiles)
    assert all(p.tensors() > 0 for p in old.profiles)  # estimated from the GEMMs and norms

    new = plan.model_copy(update={"profiles": profile_from_spec(load_model("gpt3-1.3b"))}).sealed()
    d = json.loads(new.to_json())
    d["profiles"][1]["param_tensors"] += 1
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="modified after it was made"):
        load_plan(path)


def test_rope_theta_is_hashed_only_where_it_is_set(tmp_path):
    """ModelSpec.rope_theta came after plans were written: a plan at the default 10000 hashes without it (a file
    written before the field loads, and runs the zoo model it ran then), a set one is hashed, so editing it is
    caught."""
    tr = TrainingSpec(global_batch_size=8, seq_length=256)
    llama2 = make_plan(load_model("llama2-7b"), load_cluster("dgx-h100", gpus=8), tr, "tp=8,mbs=1")
    d = json.loads(llama2.to_json())
    assert d["model"].pop("rope_theta") == 10000.0
    old = tmp_path / "before-the-field.json"
    old.write_text(json.dumps(d))
    assert load_plan(old) == llama2

    llama3 = make_plan(load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8), tr, "tp=8,mbs=1")
    assert llama3.model.rope_theta == 500000.0 and load_plan(llama3.save(tmp_path / "l3.json")) == llama3
    d = json.loads(llama3.to_json())
    d["model"]["rope_theta"] = 10000.0
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="modified after it was made"):
        load_plan(edited)
