"""Hugging Face weights in and out: --init-from, export-weights, round trips, refusals.

One torchrun launch (`autoplan run --init-from` with 2 ranks, dp=2 x ep=2 with FSDP) gives the bit-exact round
trip HF -> autoplan (sharded) -> DCP checkpoint -> HF; the rest runs in this process (a 1-rank plan through
runtime.train's main, as `python -m autoplan.runtime.train` does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from autoplan import models  # noqa: E402
from autoplan.api import make_plan  # noqa: E402
from autoplan.cost_models.errors import SpecError  # noqa: E402
from autoplan.models import hf_weights  # noqa: E402
from autoplan.models.blocks import spec_of  # noqa: E402
from autoplan.models.export import export_hf  # noqa: E402
from autoplan.models.source import attach  # noqa: E402
from autoplan.specs import TrainingSpec, load_cluster  # noqa: E402

from .hf_configs import CONFIGS, hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _save_hf(name: str, path: Path, **over) -> dict:
    cfg = dict(CONFIGS[name], **over)
    hf_model(cfg).save_pretrained(path)
    return cfg


def _plan(cfg: dict, layout: str, world: int, path: Path) -> Path:
    arch = models.arch_from_hf(cfg)
    plan = make_plan(spec_of(arch), load_cluster("local-cpu").with_gpus(world),
                     TrainingSpec(global_batch_size=4, seq_length=16, dtype="fp32"), layout, kernels="torch")
    return attach(plan, cfg).save(path)


def _files(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_round_trip_through_a_sharded_run_is_bit_exact(tmp_path):
    cfg = _save_hf("mixtral", tmp_path / "hf")
    plan = _plan(cfg, "dp=2,ep=2,zero=3", 2, tmp_path / "plan.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "autoplan.cli", "run", str(plan), "--init-from", str(tmp_path / "hf"), "--",
           "--steps", "1", "--lr", "0", "--save", str(tmp_path / "ck"), "--quiet"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export_hf(tmp_path / "ck", tmp_path / "out")
    before, after = _files(tmp_path / "hf"), _files(tmp_path / "out")
    assert set(before) == set(after)
    for k, v in before.items():  # lr=0: AdamW leaves every weight exactly as loaded
        assert torch.equal(after[k], v), k


def test_trained_checkpoint_exports_to_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from autoplan.runtime.train import main

    cfg = _save_hf("gemma2", tmp_path / "hf")
    plan = _plan(cfg, "dp=1", 1, tmp_path / "plan.json")
    rc = main(["--plan", str(plan), "--init-from", str(tmp_path / "hf"), "--steps", "2", "--lr", "1e-2",
               "--save", str(tmp_path / "ck"), "--quiet", "--log", str(tmp_path / "log.jsonl")])
    assert rc == 0
    written = export_hf(tmp_path / "ck", tmp_path / "out")
    assert {p.name for p in written} >= {"model.safetensors", "config.json"}
    ref, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    trained = _files(tmp_path / "out")
    start = _files(tmp_path / "hf")
    assert any(not torch.equal(trained[k], start[k]) for k in start), "training changed nothing"
    ours = models.load(tmp_path / "out", init_from=tmp_path / "out").eval()
    tokens = torch.randint(0, cfg["vocab_size"], (2, 12))
    with torch.no_grad():
        diff = (ref.eval()(input_ids=tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-5
    rec = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert rec["parameters_trained"] == sum(p.numel() for p in ours.parameters())


def test_init_from_another_config_is_refused_by_field(tmp_path):
    from autoplan.plan import load_plan
    from autoplan.runtime.hf_init import check_init_from

    cfg = _save_hf("llama", tmp_path / "hf", rope_theta=123.0)
    plan = load_plan(_plan(dict(CONFIGS["llama"]), "dp=1", 1, tmp_path / "plan.json"))
    with pytest.raises(SpecError, match="rope_theta: planned 5000.0, checkpoint 123.0"):
        check_init_from(plan, tmp_path / "hf")
    assert cfg["rope_theta"] == 123.0


def test_sharded_safetensors_with_an_index_load_back(tmp_path):
    ref = hf_model(CONFIGS["phi3"])
    model = models.load(CONFIGS["phi3"], device="meta")
    shapes = {n: p.shape for n, p in model.state_dict().items()}
    state = hf_weights.from_hf(ref.state_dict(), model.arch, shapes)
    written = hf_weights.save(state, model.arch, tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").exists() and len(written) > 3
    back = hf_weights.load_full(tmp_path, model.arch, shapes)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_planning_warns_about_fields_the_runtime_refuses(tmp_path, capsys):
    from autoplan.models.source import warn_unsupported

    bad = dict(CONFIGS["mixtral"], router_jitter_noise=0.1)
    problems = warn_unsupported(bad)
    assert [p.field for p in problems] == ["router_jitter_noise"]
    assert "router_jitter_noise=0.1" in capsys.readouterr().err


def test_module_factory_trains_the_factory_module_with_fsdp(tmp_path):
    """`autoplan run` of a module:factory plan trains the module the factory returns (dp=2, FSDP ZeRO-3 over its
    blocks); the log's parameter count equals the capture's; a plan with tp is refused naming the module."""
    from autoplan.capture import capture, load_module_factory
    from autoplan.cost_models.errors import ConfigError
    from autoplan.models import check_plan_model
    from autoplan.plan import load_plan
    from autoplan.workload import resolve_model

    ref = "tests/capture/_models.py:tiny_lm"
    spec, _profiles = resolve_model(ref)
    cluster = load_cluster("local-cpu").with_gpus(2)
    training = TrainingSpec(global_batch_size=4, seq_length=8, dtype="fp32")
    plan = attach(make_plan(spec, cluster, training, "dp=2,zero=3", kernels="torch"), ref).save(tmp_path / "p.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    # the module named again: a plan file alone never imports it (tests/models/test_plan_module_trust.py)
    cmd = [sys.executable, "-m", "autoplan.cli", "run", str(plan), "--model", ref, "--", "--steps", "2", "--quiet",
           "--log-file", str(tmp_path / "log.jsonl"), "--save", str(tmp_path / "ck")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    module, inputs = load_module_factory(ref)
    captured = capture(module, inputs, name="tiny_lm")
    assert recs[0]["parameters_trained"] == sum(p.numel() for p in module.parameters())
    assert recs[0]["parameters_trained"] == captured.num_parameters
    # the checkpoint holds the factory module's own parameters (the zoo stand-in that ran before has the same
    # count for this model, but its names are layers.N.attention.wq...)
    from autoplan.runtime.checkpoint import read_dcp_metadata

    keys = set(read_dcp_metadata(tmp_path / "ck" / "step_2").state_dict_metadata)
    assert "model.module.blocks.0.qkv.weight" in keys and not any(".attention.wq" in k for k in keys)
    tp_plan = attach(make_plan(spec, cluster, training, "tp=2", kernels="torch"), ref)
    with pytest.raises(ConfigError, match="module tests/capture/_models.py:tiny_lm cannot be sharded as planned: tp=2"):
        check_plan_model(load_plan(tp_plan.save(tmp_path / "tp.json")))
