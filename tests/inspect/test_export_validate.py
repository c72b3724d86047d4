"""The exports checked by the frameworks' own code, on plans the search chose.

Three levels, each skipped (with its reason) only where its framework cannot be imported:
- always: the rules Megatron-LM's validate_args enforces that the planner had broken (one layout form, FSDP
  flavour, launch environment, the plan's assumptions as flags);
- megatron-core wheel (the `test` extra): the flags become megatron.core's TransformerConfig;
- Megatron-LM checkout ($MEGATRON_LM): parse_args -> validate_args -> core_transformer_config_from_args;
- torchtitan (>= 0.3, `pip install torchtitan`): its ConfigManager loads the export, ParallelDims accepts
  the mesh, its pipeline split equals the plan's.
benchmarks/export_validation.py runs the same checks on a 17-plan matrix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autoplan.inspect import export_check as ec
from autoplan.inspect import export_megatron, export_torchtitan
from autoplan.inspect.export import megatron_arch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from export_validation import MATRIX, searched_plans  # noqa: E402

# uneven interleaved stages, ZeRO-3 with MoE, fp16 on A100
ROWS = [MATRIX[i] for i in (7, 13, 11)]


@pytest.fixture(scope="module")
def plans():
    try:
        rows = searched_plans(ROWS)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"autoplan.search is not available: {e}")
    assert all(not isinstance(p, str) for _, p in rows), rows
    return rows


def test_megatron_export_keeps_megatron_rules(plans):
    for label, plan in plans:
        d = export_megatron(plan)
        f = d["flags"]
        vp_flags = {"--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                    "--pipeline-model-parallel-layout"} & set(f)
        assert len(vp_flags) <= 1, (label, vp_flags)
        if plan.parallel.zero == 3:
            assert f["--use-megatron-fsdp"] and f["--data-parallel-sharding-strategy"] == "optim_grads_params"
            assert "--use-torch-fsdp2" not in f and d["env"] == {}
        if (plan.parallel.tp > 1 or plan.parallel.cp > 1) and plan.parallel.zero < 3:
            assert d["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
            assert d["command"].startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun ")
        assert f["--attention-backend"] == ("flash" if plan.training.flash_attention else "unfused")
        # the gradients' dtype the plan priced: fp32 on the autoplan stack (autocast over fp32 parameters), which is
        # Megatron's default reduce; bf16 only where the plan reduces in bf16
        assert ("--grad-reduce-in-bf16" in f) == (plan.training.grad_dtype == "bf16")
        if plan.model.is_moe:
            assert f["--moe-token-dispatcher-type"] == "alltoall"
        assert "--use-flash-attn" not in f


def test_megatron_core_accepts_exports(plans):
    try:
        ec.check_megatron_core(export_megatron(plans[0][1]))
    except ec.FrameworkUnavailable as e:
        pytest.skip(str(e))
    for label, plan in plans:
        assert ec.check_megatron_core(export_megatron(plan)) is None, label


@pytest.mark.skipif(not ec.megatron_available(), reason="Megatron-LM (megatron.training) is not importable; "
                    "set MEGATRON_LM to a checkout")
def test_megatron_lm_validate_args_accepts_exports(plans):
    for label, plan in plans:
        d = export_megatron(plan)
        assert ec.check_megatron(d["args"], plan.cluster.num_gpus, d["env"], megatron_arch(plan)) is None, label
    # and it is a real check: the old form (layout beside the virtual-stage count) is refused
    _, plan = plans[0]
    d = export_megatron(plan)
    assert "--pipeline-model-parallel-layout" in d["flags"]
    bad = d["args"] + ["--num-virtual-stages-per-pipeline-rank", str(plan.parallel.vp)]
    assert "No more than one" in ec.check_megatron(bad, plan.cluster.num_gpus, d["env"], megatron_arch(plan))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in ec.check_megatron(d["args"], plan.cluster.num_gpus, {}, 9)


@pytest.mark.skipif(not ec.megatron_available(), reason="Megatron-LM (megatron.training) is not importable; "
                    "set MEGATRON_LM to a checkout")
def test_megatron_lm_accepts_bf16_optimizer_state():
    """optimizer_dtype=bf16 exports as the precision-aware optimizer's bf16 moments, which Megatron-LM parses."""
    from autoplan.api import make_plan
    from autoplan.cost_models.specs import TrainingSpec
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.specs import load_cluster, load_model

    tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-core", {"optimizer_dtype": "bf16"})
    plan = make_plan(load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16), tr, "tp=2,pp=1,mbs=1,sp=1,zero=1")
    d = export_megatron(plan)
    assert "--use-precision-aware-optimizer" in d["args"]
    assert ec.check_megatron(d["args"], 16, d["env"], megatron_arch(plan)) is None
    assert "invalid choice" in ec.check_megatron(d["args"] + ["--exp-avg-dtype", "bf17"], 16, d["env"], 9)


@pytest.mark.skipif(not ec.megatron_available(), reason="Megatron-LM (megatron.training) is not importable; "
                    "set MEGATRON_LM to a checkout")
def test_megatron_lm_accepts_the_fused_cross_entropy():
    """loss_fusion exports as --cross-entropy-loss-fusion, which Megatron-LM parses and validates."""
    from autoplan.api import make_plan
    from autoplan.cost_models.specs import TrainingSpec
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.specs import load_cluster, load_model

    tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-core", {"loss_fusion": True})
    plan = make_plan(load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16), tr, "tp=2,pp=1,mbs=1,sp=1,zero=1")
    d = export_megatron(plan)
    assert "--cross-entropy-loss-fusion" in d["args"]
    assert ec.check_megatron(d["args"], 16, d["env"], megatron_arch(plan)) is None


@pytest.mark.skipif(not ec.megatron_available(), reason="Megatron-LM (megatron.training) is not importable; "
                    "set MEGATRON_LM to a checkout")
def test_megatron_lm_accepts_unaligned_gradient_reduction():
    """An interleaved plan priced with each chunk's reduction launched at its last backward (align_grad_reduce
    false: torch's pipelining, Meta's stack) exports --no-align-grad-reduce, which Megatron-LM parses; with
    Megatron-Core's own default the flag is left out."""
    from autoplan.api import make_plan
    from autoplan.cost_models.specs import TrainingSpec
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.specs import load_cluster, load_model

    args = {}
    for align in (True, False):
        tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-core",
                         {"align_grad_reduce": align})
        plan = make_plan(load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16), tr,
                         "tp=2,pp=2,vp=2,mbs=1,sp=1,zero=1,schedule=interleaved")
        d = export_megatron(plan)
        assert ec.check_megatron(d["args"], 16, d["env"], megatron_arch(plan)) is None
        args[align] = d["args"]
    assert "--no-align-grad-reduce" in args[False] and "--no-align-grad-reduce" not in args[True]


@pytest.mark.skipif(not ec.megatron_available(), reason="Megatron-LM (megatron.training) is not importable; "
                    "set MEGATRON_LM to a checkout")
def test_megatron_lm_runs_longer_interleaved_rounds_in_the_priced_order():
    """Six micro-batches on pp=4 run in one round of six (pipeline.microbatch_group): the export says so
    (--microbatch-group-size-per-virtual-pipeline-stage, which Megatron-LM parses), and Megatron-Core's own
    schedule table and warm-up counts for that group are the order autoplan simulates, rank by rank."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    from autoplan.api import make_plan
    from autoplan.cost_models.pipeline import microbatch_group, schedule_actions
    from autoplan.cost_models.specs import TrainingSpec
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.specs import load_cluster, load_model

    tr = apply_stack(TrainingSpec(global_batch_size=12, seq_length=2048), "megatron-core", {})
    plan = make_plan(load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16), tr,
                     "tp=2,pp=4,dp=2,vp=2,mbs=1,sp=1,zero=1,schedule=interleaved")
    d = export_megatron(plan)
    assert d["flags"]["--microbatch-group-size-per-virtual-pipeline-stage"] == 6
    assert ec.check_megatron(d["args"], 16, d["env"], megatron_arch(plan)) is None
    for pp, vp, m in [(4, 2, 6), (4, 2, 10), (4, 3, 8), (2, 2, 3)]:
        group = microbatch_group(pp, m)
        table = get_schedule_table(m, vp, group)
        for r, acts in enumerate(schedule_actions("interleaved", pp, m, vp)):
            fwd = [(a.mb, a.stage // pp) for a in acts if a.kind == "F"]
            bwd = [(a.mb, vp - 1 - a.stage // pp) for a in acts if a.kind == "B"]  # backwards: chunks reversed
            assert fwd == table and bwd == table, (pp, vp, m, r)
            comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda pp=pp: pp, rank=lambda r=r: r),
                                   virtual_pipeline_model_parallel_size=vp)
            _, _, warm, _ = get_pp_rank_microbatches(m, vp, group, p2p_communicator=comm)
            assert next(i for i, a in enumerate(acts) if a.kind == "B") == min(warm + 1, m * vp)


@pytest.mark.skipif(not ec.torchtitan_available(), reason="torchtitan >= 0.3 is not installed")
def test_torchtitan_loads_exports(plans):
    for label, plan in plans:
        assert ec.check_torchtitan(plan) is None, label



@pytest.mark.skipif(not ec.torchtitan_available(), reason="torchtitan >= 0.3 is not installed")
def test_torchtitan_builds_an_fp8_plan_with_float8_block_linears_and_a_bf16_head(tmp_path):
    """What the fp8 plan prices (compute.float8_gemm) is what torchtitan builds from the export: every block
    linear a Float8Linear, the LM head a plain Linear."""
    from torchtitan.models.common.linear import Linear

    from autoplan.api import make_plan
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.inspect.export import megatron_arch
    from autoplan.specs import TrainingSpec, load_cluster, load_model

    training = apply_stack(TrainingSpec(global_batch_size=16, seq_length=8192), "torchtitan", {}).model_copy(
        update={"dtype": "fp8"})
    plan = make_plan(load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8), training, "tp=2,mbs=1,zero=3")
    assert ec.check_torchtitan(plan) is None
    with ec._as_on_gpu(megatron_arch(plan), megatron=False):
        cfg = ec.load_torchtitan_export(plan, str(tmp_path))
    kinds = {fqn: type(c).__qualname__ for fqn, c, _, _ in cfg.model_spec.model.traverse(Linear.Config)}
    assert kinds.pop("lm_head") == "Linear.Config"
    assert len(kinds) >= 4 * 32 and set(kinds.values()) == {"Float8Linear.Config"}, kinds


@pytest.mark.skipif(not ec.torchtitan_available(), reason="torchtitan >= 0.3 is not installed")
def test_torchtitan_check_catches_the_old_layer_count(plans, monkeypatch):
    """The old export gave layers_per_stage as transformer layers only; torchtitan also counts the embedding
    and the head (first/last_stage_less_layers default to 1), so its split differs from the plan's."""
    from autoplan.inspect import export

    _, plan = next((lb, p) for lb, p in plans if p.parallel.pp > 1)
    k = max(s.num_layers for s in plan.stages)
    monkeypatch.setattr(export, "_titan_stage_layout", lambda plan, head: {"pipeline_parallel_layers_per_stage": k})
    assert ec.check_torchtitan(plan) is not None


def test_torchtitan_export_values_in_range(plans):
    for label, plan in plans:
        d = export_torchtitan(plan)
        tr, par = d["config"]["training"], d["config"]["parallelism"]
        assert tr["mixed_precision_reduce"] == "float32"  # the only value torchtitan accepts
        assert tr["mixed_precision_param"] in ("bfloat16", "float32")
        if plan.parallel.pp == 1:
            assert tr["local_batch_size"] == plan.parallel.mbs  # torchtitan accumulates the rest
        else:
            assert tr["local_batch_size"] % par["pipeline_parallel_microbatch_size"] == 0
        # torchtitan reduces in float32: a warning only where the plan priced 16-bit gradients
        assert any("float32 only" in w for w in d["warnings"]) == (plan.training.grad_dtype != "fp32"), label
        compile(d["python"], "export.py", "exec")
        old = export_torchtitan(plan, "0.2")
        assert "[parallelism]" in old["toml"] and old["command"].endswith("--job.config_file <this file>")


@pytest.mark.skipif(not ec.megatron_available(), reason="Megatron-LM (megatron.training) is not importable; "
                    "set MEGATRON_LM to a checkout")
def test_megatron_lm_builds_the_uneven_stages_autoplan_priced():
    """`--uneven first=N,last=M` means what Megatron's --decoder-first/last-pipeline-num-layers mean, interleaved
    or not: Megatron-LM, given the export, builds on every (virtual) stage the layers the plan priced there."""
    from autoplan.api import make_plan
    from autoplan.cost_models.layout import uneven
    from autoplan.cost_models.specs import TrainingSpec
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.specs import load_cluster, load_model

    model = load_model("llama2-7b")  # 32 layers
    tr = apply_stack(TrainingSpec(global_batch_size=32, seq_length=2048), "megatron-core", {})
    for pp, vp, first, last in [(4, 2, 4, 4), (4, 1, 7, 9), (4, 2, 6, 2)]:  # each Megatron-valid
        layout = uneven(model.num_layers, pp, vp, first, last)
        sched = ",schedule=interleaved" if vp > 1 else ""
        plan = make_plan(model, load_cluster("dgx-h100", gpus=16), tr,
                         f"tp=2,pp={pp},vp={vp},mbs=1,sp=1,zero=1,layout={layout}{sched}")
        d = export_megatron(plan)
        assert d["flags"]["--decoder-first-pipeline-num-layers"] == first, d["command"]
        assert d["flags"]["--decoder-last-pipeline-num-layers"] == last
        built = ec.megatron_stage_layers(d["args"], 16, d["env"], megatron_arch(plan))
        assert built == [s.num_layers for s in plan.stages], (pp, vp, first, last)
