"""`autoplan export`: Megatron-LM flags and torchtitan TOML, and the published configurations round trip."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from inspect_helpers import check_published, megatron_parser, parse, vp_of

from autoplan.api import make_plan
from autoplan.inspect import export_megatron, export_torchtitan
from autoplan.specs import load_cluster

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT.parent / "shared" / "reference" / "calibration_runs.json"


def test_megatron_interleaved(plan_interleaved):
    ns = parse(plan_interleaved)
    assert (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, vp_of(ns)) == (8, 8, 3)
    assert ns.num_layers_per_virtual_pipeline_stage == 4
    assert ns.sequence_parallel and ns.bf16 and not ns.fp16
    assert ns.micro_batch_size == 1 and ns.global_batch_size == 1536
    assert ns.recompute_granularity == "selective" and ns.recompute_method is None
    assert not ns.use_distributed_optimizer
    assert (ns.num_layers, ns.hidden_size, ns.num_attention_heads, ns.seq_length) == (96, 12288, 96, 2048)
    d = export_megatron(plan_interleaved)
    assert d["command"].startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nnodes 128 --nproc-per-node 8 "
                                    "pretrain_gpt.py \\\n")
    assert d["warnings"] == []
    json.dumps(d)


def test_megatron_full_recompute(plan_1f1b):
    ns = parse(plan_1f1b)
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == ("full", "uniform", 1)
    assert vp_of(ns) == 1 and ns.num_layers_per_virtual_pipeline_stage is None


def test_megatron_uneven_first_last(plan_uneven):
    ns = parse(plan_uneven)
    assert ns.decoder_first_pipeline_num_layers == 11
    assert ns.decoder_last_pipeline_num_layers == 13
    # Megatron puts the rest evenly on the middle ranks: (96 - 11 - 13) / 6 = 12, what the plan has
    middle = (ns.num_layers - 11 - 13) / (ns.pipeline_model_parallel_size - 2)
    assert middle == 12 == plan_uneven.stages[3].num_layers
    assert export_megatron(plan_uneven)["warnings"] == []


def test_megatron_uneven_virtual_stages_use_layout(plan_uneven_vp):
    d = export_megatron(plan_uneven_vp)
    ns = megatron_parser().parse_args(d["args"])
    assert ns.num_virtual_stages_per_pipeline_rank is None  # Megatron refuses it beside the layout
    assert vp_of(ns) == 2
    stages = ns.pipeline_model_parallel_layout.split("|")
    assert [s.count("t") for s in stages] == [s.num_layers for s in plan_uneven_vp.stages]
    assert stages[0].startswith("E") and stages[-1].endswith("L")
    assert any("pipeline-model-parallel-layout" in w for w in d["warnings"])


def test_megatron_partial_full_recompute_uses_block(gpt175):
    m, c, tr = gpt175
    plan = make_plan(m, c, tr, "tp=8,pp=8,mbs=1,sp=1,recompute=full,recompute_layers=6")
    ns = parse(plan)
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == ("full", "block", 6)
    # the stage's other 6 layers recompute their attention core in the plan, nothing under the block method
    warned = [w for w in export_megatron(plan)["warnings"] if "block method recomputes nothing" in w]
    assert len(warned) == 1 and "up to 6 layer(s)" in warned[0], export_megatron(plan)["warnings"]
    every = make_plan(m, c, tr, "tp=8,pp=8,mbs=1,sp=1,recompute=full")
    assert not [w for w in export_megatron(every)["warnings"] if "block method" in w]
    # where selective recomputation does nothing (a flash kernel whose outputs the stack keeps: megatron-core) the
    # plan is the block method exactly, and nothing is warned
    from autoplan.cost_models.stacks import apply_stack

    core = make_plan(m, c, apply_stack(tr, "megatron-core", {}), "tp=8,pp=8,mbs=1,sp=1,recompute=full,recompute_layers=6")
    assert parse(core).recompute_method == "block"
    assert not [w for w in export_megatron(core)["warnings"] if "block method" in w]


def test_megatron_model_shape_flags_llama_and_moe():
    from autoplan.specs import TrainingSpec, load_model

    tr = TrainingSpec(global_batch_size=64, seq_length=4096)
    plan = make_plan(load_model("llama2-70b"), load_cluster("dgx-h100", gpus=64), tr,
                     "tp=8,pp=2,mbs=1,sp=1,zero=1,recompute=selective")
    ns = parse(plan)
    assert ns.group_query_attention and ns.num_query_groups == 8
    assert ns.swiglu and ns.normalization == "RMSNorm" and ns.position_embedding_type == "rope"
    assert ns.untie_embeddings_and_output_weights and ns.disable_bias_linear
    assert ns.use_distributed_optimizer and ns.overlap_param_gather
    moe = make_plan(load_model("mixtral-8x7b"), load_cluster("dgx-h100", gpus=64), tr,
                    "tp=2,pp=2,ep=4,mbs=1,sp=1,zero=1,recompute=selective")
    ns = parse(moe)
    assert ns.expert_model_parallel_size == 4 and ns.num_experts == 8 and ns.moe_router_topk == 2


# -------------------------------------------------------------------------- published configurations


def _calibration_runs():
    if not REFERENCE.exists():
        pytest.skip(f"{REFERENCE} not present")
    sys.path.insert(0, str(ROOT))
    from benchmarks.fidelity import run_setting

    runs = json.loads(REFERENCE.read_text())["runs"]
    return [(run, *run_setting(run)) for run in runs]


def test_megatron_flags_reproduce_published_configurations():
    """Done-when (fixed-configuration path): plans made for each published setting export it back. The three
    largest SC21 runs (thousands of micro-batch x stage actions to simulate) are left to the search-pinned test
    in test_inspect_scaling.py, which covers every run."""
    rows = _calibration_runs()
    assert len(rows) >= 10
    checked = 0
    for run, model, cluster_name, training, cfg, _table in rows:
        if "SC21" in run["source"] and run["cluster"]["num_gpus"] > 1536:
            continue
        cluster = load_cluster(cluster_name, gpus=run["cluster"]["num_gpus"])
        check_published(run, make_plan(model, cluster, training, cfg))
        checked += 1
    assert checked >= 15


# ------------------------------------------------------------------------------------------ torchtitan


def test_torchtitan_02_toml(plan_interleaved, plan_uneven, plan_barely):
    """The TOML form for torchtitan 0.2.x (--job.config_file), values in 0.2.2's ranges."""
    d = export_torchtitan(plan_interleaved, "0.2")
    cfg = toml_loads(d["toml"])
    p = cfg["parallelism"]
    assert (p["tensor_parallel_degree"], p["pipeline_parallel_degree"]) == (8, 8)
    assert p["pipeline_parallel_schedule"] == "Interleaved1F1B"
    parts = p["module_fqns_per_model_part"]
    assert [sum(x.startswith("layers.") for x in part) for part in parts] == [4] * 24
    assert p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"] == 16
    assert cfg["training"]["global_batch_size"] == 1536 and cfg["training"]["seq_len"] == 2048
    assert cfg["training"]["local_batch_size"] == 1536 // 16  # with PP: every micro-batch in one schedule
    assert cfg["training"]["mixed_precision_reduce"] == "float32"
    assert cfg["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert cfg == d["toml_config"]
    assert any("not a Llama-style" in w for w in d["warnings"])
    u = toml_loads(export_torchtitan(plan_uneven, "0.2")["toml"])["parallelism"]["module_fqns_per_model_part"]
    assert [sum(x.startswith("layers.") for x in part) for part in u] == [11, 12, 12, 12, 12, 12, 12, 13]
    assert u[0][0] == "tok_embeddings" and u[-1][-2:] == ["norm", "output"]
    b = toml_loads(export_torchtitan(plan_barely, "0.2")["toml"])
    assert b["activation_checkpoint"]["mode"] == "none"


def test_torchtitan_03_layers_as_torchtitan_counts(plan_interleaved, plan_uneven):
    """0.3: embedding and head count as layers (first/last_stage_less_layers)."""
    p = export_torchtitan(plan_interleaved)["config"]["parallelism"]
    assert p["pipeline_parallel_layers_per_stage"] == 4
    assert (p["pipeline_parallel_first_stage_less_layers"], p["pipeline_parallel_last_stage_less_layers"]) == (0, 0)
    u = export_torchtitan(plan_uneven)["config"]["parallelism"]  # 11 | 12 x 6 | 13: not expressible so
    assert [sum(x.startswith("layers.") for x in part) for part in u["module_fqns_per_model_part"]] == \
        [11, 12, 12, 12, 12, 12, 12, 13]
    assert u["module_fqns_per_model_part"][-1][-1] == "lm_head"


def test_torchtitan_llama_flavour():
    from autoplan.specs import TrainingSpec, load_model

    plan = make_plan(load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8),
                     TrainingSpec(global_batch_size=16, seq_length=8192), "tp=1,pp=1,mbs=1,zero=3,recompute=full")
    d = export_torchtitan(plan)
    assert d["config"]["model"] == {"module": "llama3", "config": "llama3_8b", "flavor": "8B"}
    assert d["config"]["training"]["local_batch_size"] == 1  # the micro-batch; torchtitan accumulates
    assert "config.parallelism.data_parallel_shard_degree = 8" in d["python"]
    assert "config.activation_checkpoint = FullAC.Config()" in d["python"]
    assert d["command"].endswith("-m torchtitan.train --module autoplan_" + plan.short_hash +
                                 " --config autoplan_config")
    assert not any("flavour" in w or "Llama-style" in w or "no config" in w for w in d["warnings"])
    cfg = toml_loads(export_torchtitan(plan, "0.2")["toml"])
    assert cfg["model"] == {"name": "llama3", "flavor": "8B"}
    assert cfg["activation_checkpoint"]["mode"] == "full"


def test_torchtitan_export_trains_fp8_plans_with_float8_linears():
    """An fp8 plan prices the block linears in fp8 and the LM head in bf16 (compute.float8_gemm); torchtitan 0.3
    runs Float8 through a model converter, which the export now sets with the head filtered out (before: bf16
    parameters and a warning). 0.2 and unregistered models keep the warning."""
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.specs import TrainingSpec, load_model

    training = apply_stack(TrainingSpec(global_batch_size=16, seq_length=8192), "torchtitan", {}).model_copy(
        update={"dtype": "fp8"})
    plan = make_plan(load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8), training, "tp=2,mbs=1,zero=3")
    d = export_torchtitan(plan)
    assert "from torchtitan.components.quantization import Float8LinearConverter" in d["python"]
    assert "Float8LinearConverter.Config(filter_fqns=['lm_head'], model_compile_enabled=compiled)" in d["python"]
    assert "model_registry('8B', converters=[" in d["python"]
    assert not [w for w in d["warnings"] if w.startswith("fp8")]
    assert [w for w in export_torchtitan(plan, "0.2")["warnings"] if w.startswith("fp8")]
    bf16 = make_plan(load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8),
                     training.model_copy(update={"dtype": "bf16"}), "tp=2,mbs=1,zero=3")
    assert "Float8" not in export_torchtitan(bf16)["python"]
    other = make_plan(load_model("llama2-7b"), load_cluster("dgx-h100", gpus=8), training, "tp=2,mbs=1,zero=3")
    d = export_torchtitan(other)
    assert "Float8" not in d["python"] and [w for w in d["warnings"] if w.startswith("fp8")]


def test_exports_reduce_gradients_in_the_dtype_the_plan_priced():
    """The autoplan stack trains under autocast over fp32 parameters: its gradients are fp32 and reduced in fp32
    (TrainingSpec.grad_dtype), which is Megatron's default reduce and torchtitan's only one, so neither export
    asks for bf16 or warns; a plan priced with Megatron-Core's bf16 reduce asks Megatron for it and is warned
    about torchtitan's fp32."""
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.specs import TrainingSpec, load_model

    base = TrainingSpec(global_batch_size=16, seq_length=4096)
    for stack, grad in (("autoplan", "fp32"), ("megatron-core", "bf16")):
        plan = make_plan(load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8), apply_stack(base, stack, {}),
                         "tp=2,mbs=1,zero=1,recompute=selective")
        assert plan.training.grad_dtype == grad
        assert ("--grad-reduce-in-bf16" in export_megatron(plan)["flags"]) == (grad == "bf16")
        assert any("float32 only" in w for w in export_torchtitan(plan)["warnings"]) == (grad == "bf16")


def test_torchtitan_mixed_recompute_warns(gpt175):
    m, c, tr = gpt175
    plan = make_plan(m, c, tr, "tp=8,pp=8,mbs=1,sp=1,recompute=full,recompute_layers=3")
    d = export_torchtitan(plan)
    assert d["config"]["activation_checkpoint"]["mode"] == "full"
    # autoplan's partial recomputation re-runs the other blocks' attention core: torchtitan has no such policy
    assert any("where the plan recomputes their attention core" in w for w in d["warnings"])


@pytest.mark.parametrize("cfg, n", [("tp=8,pp=8,mbs=1,sp=1,recompute=full,recompute_layers=6", 2),
                                    ("tp=8,pp=8,mbs=1,sp=1,recompute=full,recompute_layers=4", 3),
                                    # 3 chunks of 4 blocks a rank, 2 of each in full: the counter runs on
                                    ("tp=8,pp=8,vp=3,mbs=1,sp=1,recompute=full,recompute_layers=6", 2),
                                    ("tp=8,pp=8,mbs=1,sp=1,recompute=full,recompute_layers=5", None)])
def test_torchtitan_02_writes_layer_selective_ac_where_it_recomputes_the_planned_count(gpt175, cfg, n):
    """A plan on the torchtitan stack that recomputes k of a stage's blocks whole and leaves the rest plain is
    0.2's layer-selective AC (selective_ac_option = n: every n-th block a rank wraps) where floor(blocks / n) is k on
    every stage; 0.3 removed it, and where no n fits the export says so. early_stop is written as priced."""
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.inspect.export import titan_layer_sac

    m, c, tr = gpt175
    plan = make_plan(m, c, apply_stack(tr, "torchtitan"), cfg)
    assert plan.training.partial_rest == "none" and titan_layer_sac(plan) == n
    ac = toml_loads(export_torchtitan(plan, "0.2")["toml"])["activation_checkpoint"]
    if n is None:
        assert ac == {"mode": "full", "early_stop": False}
        assert any("no n gives this plan's count" in w for w in export_torchtitan(plan, "0.2")["warnings"])
    else:
        assert ac == {"mode": "selective", "selective_ac_option": str(n), "early_stop": False}
        # the count per stage it gives, replayed as torchtitan's counter runs across a rank's chunks
        for rank in range(plan.parallel.pp):
            count = 0
            for s in sorted((s for s in plan.stages if s.pp_rank == rank), key=lambda s: s.index):
                wrapped = [count + i + 1 for i in range(s.num_layers)]
                assert sum(w % n == 0 for w in wrapped) == s.recompute_layers
                count += s.num_layers
        d3 = export_torchtitan(plan, "0.3")
        assert d3["config"]["activation_checkpoint"] == {"mode": "full"}
        assert any("0.3 has no layer-selective AC" in w for w in d3["warnings"])
    # priced with torch's early stop (the 2024 code), 0.2 writes it and 0.3's FullAC cannot
    early = make_plan(m, c, apply_stack(tr, "torchtitan", {"checkpoint_early_stop": True}), cfg)
    assert toml_loads(export_torchtitan(early, "0.2")["toml"])["activation_checkpoint"]["early_stop"] is True
    assert any("early_stop=False" in w for w in export_torchtitan(early, "0.3")["warnings"])


def toml_loads(text: str) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads(text)


def test_selective_recomputation_is_named_when_the_tools_mean_another_policy(plan_interleaved, gpt175):
    """autoplan's (and Megatron's) selective recomputation re-runs the attention core; torchtitan's SelectiveAC
    re-runs every second matmul and the elementwise ops. Each export says so when the plan's policy is not the
    tool's, and stays quiet when it is."""
    from autoplan.cost_models.stacks import apply_stack

    def policy_warnings(d):
        return [w for w in d["warnings"] if "selective_policy=" in w]

    assert policy_warnings(export_torchtitan(plan_interleaved))
    assert not policy_warnings(export_megatron(plan_interleaved))
    m, c, tr = gpt175
    titan = make_plan(m, c, apply_stack(tr, "torchtitan"), "tp=8,pp=8,vp=3,mbs=1,sp=1,recompute=selective")
    assert titan.training.selective_policy == "every_other_matmul"
    assert not policy_warnings(export_torchtitan(titan))
    (w,) = policy_warnings(export_megatron(titan))
    assert "attention core" in w and "Megatron" in w


def test_context_parallelism_priced_as_autoplans_runtime_is_named_in_the_exports(gpt175):
    """Megatron-Core and torchtitan run context parallelism as ring attention; a plan priced as autoplan's runtime
    runs it (cp_attention all_gather_masked: exposed gathers, masked prefix calls) says so in both exports, and a
    plan of either tool's stack does not."""
    from autoplan.cost_models.stacks import apply_stack

    def cp_warnings(d):
        return [w for w in d["warnings"] if "cp_attention=" in w]

    m, c, tr = gpt175
    own = make_plan(m, c, tr, "tp=8,pp=8,cp=2,mbs=1,sp=1")
    assert own.training.cp_style == "all_gather_masked"
    (w,) = cp_warnings(export_megatron(own))
    assert "--stack megatron-core" in w
    (w,) = cp_warnings(export_torchtitan(own))
    assert "--stack torchtitan" in w
    assert not cp_warnings(export_megatron(make_plan(m, c, apply_stack(tr, "megatron-core"), "tp=8,pp=8,cp=2,mbs=1,sp=1")))
    assert not cp_warnings(export_torchtitan(make_plan(m, c, apply_stack(tr, "torchtitan"), "tp=8,pp=8,cp=2,mbs=1,sp=1")))
    assert not cp_warnings(export_megatron(make_plan(m, c, tr, "tp=8,pp=8,mbs=1,sp=1")))  # no cp, nothing to say
