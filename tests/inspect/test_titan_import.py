"""`autoplan from-torchtitan`: a torchtitan 0.2 job config read back into autoplan's terms. Every 0.2 export of
autoplan's reads back to the plan it came from, torchtitan's own defaults apply where a config is silent (the
pipeline split with lighter end stages, FSDP2 resharding, per-op selective AC), and the torchtitan rows of the
fidelity benchmark come out as the benchmark prices them."""

from __future__ import annotations

import json

import pytest

from autoplan.api import plan_from_estimate
from autoplan.cli import main
from autoplan.cost_models.errors import ConfigError, SpecError
from autoplan.cost_models.layout import counts
from autoplan.cost_models.specs import TrainingSpec
from autoplan.cost_models.stacks import apply_stack
from autoplan.estimate_api import estimate_config
from autoplan.inspect import export_torchtitan
from autoplan.inspect.titan_import import load_titan, read_titan, stage_modules
from autoplan.specs import load_cluster, load_model

# (model, GPUs, global batch, seq, configuration, --stack-set)
CASES = [
    ("llama3-8b", 64, 64, 8192, "tp=1,pp=1,mbs=1,zero=3,recompute=selective", {"kernels": "torch"}),
    ("llama3-8b", 16, 32, 4096, "tp=2,pp=1,mbs=1,sp=1,zero=0,recompute=full", {"kernels": "fused"}),
    ("llama3-70b", 64, 64, 8192, "tp=8,pp=4,vp=2,mbs=1,sp=1,zero=3,recompute=full,schedule=interleaved",
     {"kernels": "torch", "checkpoint_early_stop": True, "tp_comm_overlap": False}),
    ("llama3-70b", 32, 32, 4096, "tp=4,pp=4,mbs=1,sp=1,zero=2,recompute=full,recompute_layers=10",
     {"kernels": "torch", "tp_comm_overlap": False}),
    ("llama3-70b", 64, 64, 4096, "tp=8,pp=4,mbs=1,sp=1,zero=3,recompute=selective,layout=Et*19|t*21|t*21|t*19L",
     {"kernels": "fused", "tp_comm_overlap": True}),
    ("llama3-8b", 32, 64, 8192, "tp=1,pp=1,mbs=2,zero=3,recompute=full,recompute_layers=16", {"kernels": "torch"}),
]


def _plan(name, gpus, batch, seq, cfg, knobs):
    tr = apply_stack(TrainingSpec(global_batch_size=batch, seq_length=seq, dtype="bf16"), "torchtitan", knobs)
    model, cluster = load_model(name), load_cluster("dgx-h100", gpus=gpus)
    return plan_from_estimate(model, cluster, tr, estimate_config(model, cluster, tr, cfg))


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_every_0_2_export_reads_back_to_its_plan(case, tmp_path, capsys):
    plan = _plan(*case)
    path = tmp_path / "job.toml"
    path.write_text(export_torchtitan(plan, "0.2")["toml"])
    run, preset = read_titan(load_titan(path), plan.cluster.num_gpus)
    assert preset == plan.model.name
    want, got = plan.parallel, run.parallel
    for f in ("tp", "pp", "cp", "vp", "mbs", "sp", "zero", "recompute", "schedule", "dp"):
        assert getattr(got, f) == getattr(want, f), f
    if want.recompute_layers is not None:
        assert got.recompute_layers == want.recompute_layers
    sizes = [s.layers[1] - s.layers[0] for s in plan.stages]
    assert (counts(got.layout) if got.layout else [plan.model.num_layers // len(sizes)] * len(sizes)) == sizes
    assert (run.seq_len, run.global_batch, run.dtype) == (plan.training.seq_length, plan.training.global_batch_size,
                                                          "bf16")
    tr = plan.training
    assert run.stack_set["kernels"] == tr.kernels
    assert run.stack_set["tp_comm_overlap"] == (tr.tp_comm_overlap and want.tp > 1)
    assert run.stack_set["checkpoint_early_stop"] == tr.recompute_stops_early or want.recompute == "selective"
    assert not run.unpriced  # the export writes nothing the reader leaves unread
    # and the CLI predicts what the plan predicted
    assert main(["from-torchtitan", str(path), "--cluster", "dgx-h100", "--gpus", str(plan.cluster.num_gpus),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] == pytest.approx(plan.prediction.step_time_s, rel=1e-6)


def test_async_tp_is_exported_only_under_compile():
    """torchtitan's maybe_enable_async_tp refuses async TP without torch.compile (v0.2.2 and 0.3): an eager plan
    that priced it is warned about, not exported into a config torchtitan would refuse."""
    eager = _plan("llama3-8b", 16, 32, 4096, "tp=2,pp=1,mbs=1,sp=1,zero=3", {"kernels": "torch"})
    for version in ("0.2", "0.3"):
        d = export_torchtitan(eager, version)
        assert any("only under torch.compile" in w for w in d["warnings"])
        assert "enable_async_tensor_parallel" not in d["text"]
    compiled = _plan("llama3-8b", 16, 32, 4096, "tp=2,pp=1,mbs=1,sp=1,zero=3", {"kernels": "fused"})
    assert "config.compile.enable_async_tensor_parallel = True" in export_torchtitan(compiled, "0.3")["text"]
    assert "enable_async_tensor_parallel = true" in export_torchtitan(compiled, "0.2")["text"]


def test_torchtitans_default_pipeline_split_makes_the_end_stages_lighter():
    """generate_llm_fqn_per_model_part (v0.2.2): the embedding and the output each count as one block, the
    effective blocks are split evenly, remainder first."""
    parts = stage_modules(4, 30)  # 32 effective: 8 each; first and last stage hold 7 blocks
    assert [sum(m.startswith("layers.") for m in p) for p in parts] == [7, 8, 8, 7]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    parts = stage_modules(3, 8)  # 10 effective: 4, 3, 3 -> 3, 3, 2
    assert [sum(m.startswith("layers.") for m in p) for p in parts] == [3, 3, 2]
    with pytest.raises(ConfigError, match="torchtitan refuses this pipeline split"):
        stage_modules(8, 4)


def test_defaults_and_torchtitans_own_rules(tmp_path):
    """What a config leaves out is torchtitan 0.2.2's default: local batch 8, the shard degree the rest of the
    world, selective_ac_option "2" (every second block), FSDP resharding after the forward only without
    pipelining, Interleaved1F1B with two stages per rank."""
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "70B"\n[training]\nseq_len = 4096\n'
                    '[parallelism]\ntensor_parallel_degree = 8\npipeline_parallel_degree = 4\n'
                    'pipeline_parallel_schedule = "Interleaved1F1B"\npipeline_parallel_microbatch_size = 2\n'
                    '[compile]\nenable = true\n[activation_checkpoint]\nmode = "full"\nearly_stop = true\n'
                    '[optimizer]\nlr = 1e-4\n[float8]\nenable_fsdp_float8_all_gather = true\n')
    run, preset = read_titan(load_titan(path), 128)
    p = run.parallel
    assert preset == "llama3-70b" and (p.dp, p.zero, p.vp, p.mbs) == (4, 2, 2, 2)  # pp: no reshard by default
    # 8 stages of 80 blocks + 2: 10 each, the first two one more; the end stages one block lighter
    assert counts(p.layout) == [10, 11, 10, 10, 10, 10, 10, 9]
    assert run.global_batch == 8 * 4 and run.stack_set["kernels"] == "fused"
    assert run.stack_set["checkpoint_early_stop"] is True and p.recompute == "full"
    # the default AC: selective_ac_option "2", every second block whole
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nseq_len = 8192\n')
    run, _ = read_titan(load_titan(path), 64)
    assert (run.parallel.recompute, run.parallel.recompute_layers, run.parallel.zero) == ("full", 16, 3)
    # a --set override, in torchtitan's section.key form
    run, _ = read_titan(load_titan(path, ["parallelism.tensor_parallel_degree=8",
                                          "activation_checkpoint.selective_ac_option=op"]), 64)
    assert (run.parallel.tp, run.parallel.dp, run.parallel.recompute) == (8, 8, "selective")
    # Float8 through the converter, and its fp8 weight gathers said (not priced)
    run, _ = read_titan(load_titan(path, ['model.converters=["float8"]',
                                          "quantize.linear={float8 = {enable_fsdp_float8_all_gather = true}}"]), 64)
    assert run.dtype == "fp8" and any("enable_fsdp_float8_all_gather" in n for n in run.notes)


def test_the_fidelity_row_comes_out_as_the_benchmark_prices_it(tmp_path, capsys):
    """torchtitan's performance.md Llama 3 8B per-op SAC run on 64 A100 (compile off, local batch 1), written as
    its train config says it: the same prediction as the benchmark's row, which goes through `autoplan estimate`."""
    import yaml

    from benchmarks.fidelity import HELDOUT, heldout_command, predict
    rows = yaml.safe_load(HELDOUT.read_text())["runs"]
    row = next(r for r in rows if r["name"] == "Llama 3 8B, torchtitan FSDP, per-op selective AC")
    want = predict(heldout_command(row))[3].step_time_s
    path = tmp_path / "llama3_8b.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nseq_len = 8192\n'
                    '[parallelism]\ndata_parallel_shard_degree = -1\n[compile]\nenable = false\n'
                    '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n')
    assert main(["from-torchtitan", str(path), "--cluster", "dgx-a100-80g", "--gpus", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("text, sets, needle", [
    ('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_replicate_degree = 2\n'
     'data_parallel_shard_degree = 4\n', [], "HSDP"),
    ('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\npipeline_parallel_degree = 2\n'
     'pipeline_parallel_schedule = "ZBVZeroBubble"\n', [], "pipeline schedule autoplan does not price"),
    ('[model]\nname = "llama3"\nflavor = "8B"\n[activation_checkpoint]\nmode = "memory_budget"\n', [],
     "activation_checkpoint mode"),
    ('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ntensor_parallel_degree = "eight"\n', [],
     "takes an integer"),
    ('[model]\nname = "llama3"\nflavor = "8B"\n', ["tensor_parallel_degree=8"], "SECTION.KEY=VALUE"),
    ('[model\nname = ', [], "not valid TOML"),
    ('title = "x"\n', [], "not a torchtitan job config"),
    ('model = "llama3"\n[parallelism]\ntensor_parallel_degree = 2\n', [], "must be a table in a torchtitan config"),
])
def test_what_cannot_be_read_is_refused_in_one_line(text, sets, needle, tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises((ConfigError, SpecError), match=needle):
        read_titan(load_titan(path, sets), 64)
    assert main(["from-torchtitan", str(path), "--cluster", "dgx-h100", "--gpus", "64",
                 *[x for s in sets for x in ("--set", s)]]) != 0
    err = capsys.readouterr().err
    assert needle in err and "\n" not in err.strip()


def test_a_python_config_is_never_run_and_an_unknown_model_needs_model(tmp_path, capsys):
    py = tmp_path / "config.py"
    py.write_text("raise SystemExit('ran')\n")
    assert main(["from-torchtitan", str(py), "--cluster", "dgx-h100", "--gpus", "8"]) == 2
    assert "never runs" in capsys.readouterr().err
    toml = tmp_path / "job.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n')
    assert main(["from-torchtitan", str(toml), "--cluster", "dgx-h100", "--gpus", "8"]) == 2
    assert "pass --model PRESET or FILE" in capsys.readouterr().err
    assert main(["from-torchtitan", str(toml), "--cluster", "dgx-h100", "--gpus", "8", "--model", "llama2-7b",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["from_torchtitan"]["parallel"].startswith("tp=1,pp=1,dp=8")
