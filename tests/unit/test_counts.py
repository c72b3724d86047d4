"""The cost model's per-rank counts (cost_models.counts) as data: conventions that hold without running anything,
and the plan's record of runtime semantics. Agreement with the runtime is tests/dist/test_counts.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.api import make_plan
from autoplan.counts import counts_of_plan
from autoplan.plan import load_plan
from autoplan.specs import ParallelConfig, TrainingSpec, load_cluster, load_model

ROOT = Path(__file__).resolve().parents[2]


def _plan(cfg: str, model: str = "tiny-gpt", gpus: int = 4):
    return make_plan(load_model(model), load_cluster("local-cpu").with_gpus(gpus),
                     TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32"), cfg, kernels="torch")


def test_flops_by_phase_follow_the_layout():
    base = counts_of_plan(_plan("dp=4"))[0]["flops"]
    assert base["backward"] > 2 * base["forward"] and base["recompute"] == 0  # SDPA backward is 2.5x
    sel = counts_of_plan(_plan("dp=4,recompute=selective"))[0]["flops"]
    full = counts_of_plan(_plan("dp=4,recompute=full"))[0]["flops"]
    assert 0 < sel["recompute"] < full["recompute"] < full["forward"]
    tp = counts_of_plan(_plan("dp=2,tp=2"))[0]["flops"]
    assert tp["forward"] == pytest.approx(base["forward"] * 2 / 2)  # twice the tokens, half of every GEMM
    pp = counts_of_plan(_plan("pp=2,dp=2"))
    assert sum(r["flops"]["forward"] for r in pp) == pytest.approx(2 * base["forward"])  # dp=2: 2x per replica


def test_collectives_by_mesh_dimension():
    def comm(cfg):
        return {(c["collective"], c["mesh_dim"]): c for c in counts_of_plan(_plan(cfg))[0]["comm"]}

    assert set(comm("dp=4")) == {("all_reduce", "dp")}
    z2, z3 = comm("dp=4,zero=2"), comm("dp=4,zero=3")
    assert z3[("all_gather", "dp")]["bytes"] == 2 * z2[("all_gather", "dp")]["bytes"]  # forward and backward
    assert {("reduce_scatter", "tp"), ("all_gather", "tp")} <= set(comm("dp=2,tp=2,sp=1"))
    assert {("send", "pp"), ("recv", "pp")} <= set(comm("pp=2,dp=2"))
    assert {("all_gather", "cp"), ("all_to_all", "cp")} <= set(comm("cp=2,dp=2"))


def test_memory_categories_add_up_and_zero_under_pp_is_priced_as_run():
    for cfg in ("dp=4", "dp=4,zero=3", "pp=2,dp=2,zero=2"):
        for r in counts_of_plan(_plan(cfg)):
            m = r["memory_bytes"]
            assert m["peak"] == pytest.approx(sum(v for k, v in m.items() if k != "peak"), abs=8)
    flat, piped = _plan("dp=4,zero=2"), _plan("pp=2,dp=2,zero=2")
    assert "zero" in piped.runtime_semantics and "zero" not in flat.runtime_semantics
    # whole gradients under pp (the schedule defers the reduce-scatter), sharded without
    g_pp = piped.prediction.memory_breakdown[0].gradients
    w_pp = piped.prediction.memory_breakdown[0].weights
    # the weights hold FSDP2's unsharded 1/(dp x cp) copy beside the 16-bit parameters (estimate.runtime_per_param)
    assert g_pp == pytest.approx(w_pp / (1 + 1 / 2))
    assert flat.prediction.memory_breakdown[0].gradients < flat.prediction.memory_breakdown[0].weights / 2


def test_plans_without_runtime_semantics_keep_their_hash(tmp_path):
    plan = _plan("dp=4")
    assert plan.runtime_semantics == {}
    body = json.loads(plan.to_json())
    body.pop("runtime_semantics")  # a plan written before the field existed
    (tmp_path / "old.json").write_text(json.dumps(body))
    assert load_plan(tmp_path / "old.json").content_hash == plan.content_hash


def test_plans_of_the_old_p2p_default_keep_their_hash_and_meaning(tmp_path):
    """p2p_scatter_gather's default became false in session 21 (autoplan's runtime sends whole hidden states):
    a plan written with true keeps its hash, and one written before the field existed reads as true, which is
    what it was priced with."""
    plan = _plan("tp=2,pp=2")
    assert plan.training.p2p_scatter_gather is False
    old = plan.model_copy(update={"training": plan.training.model_copy(update={"p2p_scatter_gather": True})})
    body = json.loads(plan.to_json())
    body["training"]["p2p_scatter_gather"] = True
    (tmp_path / "true.json").write_text(json.dumps({**body, "content_hash": old.compute_hash()}))
    assert load_plan(tmp_path / "true.json").training.p2p_scatter_gather is True
    body["training"].pop("p2p_scatter_gather")  # before the field existed
    (tmp_path / "older.json").write_text(json.dumps(body | {"content_hash": old.compute_hash()}))
    assert load_plan(tmp_path / "older.json").training.p2p_scatter_gather is True
    # and the new default is in the hash: a plan that says false is not the plan that says true
    assert plan.compute_hash() != old.compute_hash()


def test_counts_need_no_torch():
    code = ("import sys; from autoplan.counts import counts_of_plan; from autoplan.plan import load_plan; "
            "import autoplan.inspect.counts_view; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_pipeline_keeps_receive_buffers_and_stage_outputs():
    """torch.distributed.pipelining's buffers beyond the in-flight micro-batches' saved tensors, in units of one
    stage-boundary tensor (64 tokens x 64 x fp32 = 16 KiB): pp=4, m=8, one block per stage. Rank r holds
    4 - r micro-batches; it keeps m - (4 - r) more receive buffers than the profile's block inputs (not rank 0),
    and sends (not rank 3) keep its in-flight outputs plus the 1F1B warm-up's last send (SiteMemTracker on
    benchmarks/counts.py --sites: rank 1 held 5 + 3 + 1). Interleaved pp=2, vp=2, m=4: all outputs of both
    sending stages on rank 0 are kept until the step ends, and 4 - 2.5 receive buffers of stage 2."""
    from autoplan.cost_models.counts import boundary_bytes, pipeline_act
    from autoplan.cost_models.estimate import (
        StageLayout,
        _stages_by_rank,
        context,
        estimate,
        num_microbatches,
    )
    from autoplan.cost_models.pipeline import in_flight
    from autoplan.cost_models.profile import profile_from_spec

    def extras(cfg: str) -> list[float]:
        plan = _plan(cfg)
        profiles, cfg_, training = profile_from_spec(plan.model), plan.parallel, plan.training
        layout = [StageLayout(tuple(s.layers), s.recompute, s.recompute_layers) for s in plan.stages]
        est = estimate(profiles, plan.cluster, training, cfg_, layout, simulate_pipeline=False)
        ctx = context(plan.cluster, training, cfg_)
        m = num_microbatches(cfg_, training)
        fl = in_flight(cfg_.schedule, cfg_.pp, m, cfg_.vp)
        x = boundary_bytes(profiles, ctx, cfg_, training)
        assert x == 64 * 64 * 4
        return [pipeline_act(st, profiles, ctx, cfg_, training, m, fl[r]) / x
                for r, st in enumerate(_stages_by_rank(est.stages, cfg_.pp))]

    assert extras("pp=4") == [5, 9, 9, 7]
    assert extras("pp=2,vp=2,dp=2,schedule=interleaved")[0] == pytest.approx(2 * 4 + (4 - 2.5))
    assert extras("dp=4") == [0]


def test_zero3_parameters_are_the_shards_the_root_unit_and_one_block():
    """FSDP2 under ZeRO-3 at a block's backward: every shard, the root unit (embeddings, final norm, the tied head)
    left unsharded, and the running block's unsharded parameters; its prefetch of the next block is a temporary."""
    from autoplan.cost_models.profile import profile_from_spec

    profiles = profile_from_spec(load_model("tiny-gpt"))
    root, block = profiles[0].params + profiles[-1].params, profiles[1].params
    total = sum(p.params for p in profiles)
    (r,) = counts_of_plan(_plan("dp=4,zero=3"))[:1]
    assert r["memory_moment"] == "block"
    assert r["memory_bytes"]["parameters"] == pytest.approx(4 * (total / 4 + root + block), abs=8)  # fp32
    z1 = counts_of_plan(_plan("dp=4,zero=1"))[0]["memory_bytes"]
    assert r["memory_bytes"]["temporaries"] - z1["temporaries"] == pytest.approx(4 * block, abs=8)


def test_zero2_peaks_when_the_forward_returns_with_the_last_block_gathered():
    """Without pp, zero 2 gathers the blocks again for every micro-batch's forward; the last all-gather output
    (one block's parameters) lives until the root module's forward returns: that moment beats the backward's."""
    from autoplan.cost_models.profile import profile_from_spec

    block = profile_from_spec(load_model("tiny-gpt"))[1].params
    z2, z1 = counts_of_plan(_plan("dp=4,zero=2"))[0], counts_of_plan(_plan("dp=4,zero=1"))[0]
    assert (z2["memory_moment"], z2["memory_phase"]) == ("forward", "forward")
    assert (z1["memory_moment"], z1["memory_phase"]) == ("block", "backward")  # gathered once, before any gradient
    assert z2["memory_bytes"]["temporaries"] == 0  # no backward runs at that moment
    # the same saved tensors at both moments; the forward adds the gathered block, the head's inputs and logits
    # and loses the head's softmax (not made yet) -- at least the block's all-gather output
    assert z2["memory_bytes"]["activations"] - z1["memory_bytes"]["activations"] > 4 * block * 0.9


def test_memory_of_rank_counts_a_checkpoint_input_and_the_fp32_softmax_once():
    """The step-time model's OOM check: a recomputed layer's transient excludes its input (the checkpoint, kept
    anyway), and the head's fp32 log-softmax is 4 bytes a logit whatever the activation width."""
    from autoplan.cost_models.compute import layer_cost
    from autoplan.cost_models.estimate import context, estimate
    from autoplan.cost_models.profile import profile_from_spec

    plan = _plan("dp=4,recompute=full")
    profiles = profile_from_spec(plan.model)
    ctx = context(plan.cluster, plan.training, plan.parallel)
    blk = layer_cost(profiles[1], ctx)
    est = estimate(profiles, plan.cluster, plan.training, plan.parallel)
    assert est.memory[0].activations == pytest.approx(
        sum(layer_cost(p, ctx).act_none for p in (profiles[0], profiles[-1]))
        + sum(layer_cost(p, ctx).act_full for p in profiles[1:-1]) + blk.act_none - blk.act_full, rel=1e-9)
    head = profiles[-1]
    bf16 = context(plan.cluster, plan.training.model_copy(update={"dtype": "bf16", "autocast_fp32_params": False}),
                   plan.parallel)
    softmax = ctx.tokens * 4 * head.logits_per_token  # fp32 at both widths
    rest = ctx.tokens * head.act_seq / 2  # elements of the rest (2-byte units)
    assert layer_cost(head, ctx).act_none == pytest.approx(softmax + 4 * rest)
    assert layer_cost(head, bf16).act_none == pytest.approx(softmax + 2 * rest)
    # under autoplan's autocast the head also keeps the final norm's fp32 input per micro-batch, and the bf16 copy
    # of its weight once for the step (the tied embedding's: the head casts it)
    amp = context(plan.cluster, plan.training.model_copy(update={"dtype": "bf16"}), plan.parallel)
    weight = head.gemms[0].n * head.gemms[0].k
    assert layer_cost(head, amp).act_none == pytest.approx(softmax + 2 * rest + 2 * ctx.tokens * head.hidden)
    assert layer_cost(head, amp).weight_copies == pytest.approx(2 * weight)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_bytes_under_autocast_follow_the_dtype_of_what_is_reduced(sp):
    """Autocast over fp32 parameters: a block's forward reduces bf16 matmul outputs (2 bytes), its backward the
    fp32 gradients of the norms' outputs (4), the embedding and the head the fp32 residual stream; 16-bit
    parameters (autocast off) move 2 bytes everywhere. Measured: tests/dist/test_counts.py."""
    from autoplan.cost_models.compute import tp_units
    from autoplan.cost_models.estimate import context
    from autoplan.cost_models.profile import profile_from_spec

    plan = _plan("dp=2,tp=2" + (",sp=1" if sp else ""))
    profiles = profile_from_spec(plan.model)
    amp = context(plan.cluster, plan.training.model_copy(update={"dtype": "bf16"}), plan.parallel)
    half = context(plan.cluster, plan.training.model_copy(update={"dtype": "bf16", "autocast_fp32_params": False}),
                   plan.parallel)
    unit = amp.tokens * profiles[1].hidden
    fwd, bwd = tp_units(profiles[1], amp)
    if sp:
        assert fwd == {"all_gather": 4 * unit, "reduce_scatter": 2 * unit}
        assert bwd == {"reduce_scatter": 4 * unit, "all_gather": 2 * unit}
    else:
        assert (fwd, bwd) == ({"all_reduce": 2 * unit}, {"all_reduce": 4 * unit})
    for p in (profiles[0], profiles[-1]):  # the embedding's output, the head's input gradient: fp32
        assert all(b == 4 * unit for u in tp_units(p, amp) for b in u.values())
    for p in profiles:
        assert all(b == 2 * unit for u in tp_units(p, half) for b in u.values())


def test_categories_are_compared_at_the_moment_of_the_models_kind():
    """benchmarks.counts.at_moment: the measured moment of the predicted moment's phase and place (inside a block
    or not, runtime.measure's `memory_by_moment`), else the predicted phase's largest, else the peak's."""
    sys.path.insert(0, str(ROOT))
    from autoplan.cost_models.counts import MOMENT_AT, MOMENT_PHASE
    from autoplan.runtime.measure import _BLOCK
    from benchmarks.counts import at_moment

    assert {k: v.split("/")[0] for k, v in MOMENT_AT.items()} == MOMENT_PHASE
    assert _BLOCK.search("FSDPTransformerLM.layers.3") and _BLOCK.search("TransformerLM.layers.12.mlp")
    assert _BLOCK.search("layers.0._checkpoint_wrapped_module.attention")
    assert not _BLOCK.search("FSDPTransformerLM.output") and not _BLOCK.search("TransformerLM.norm")
    assert not _BLOCK.search("TransformerLM.extra_layers")
    head, block = {"peak": 10, "temporaries": 3}, {"peak": 11, "temporaries": 1}
    rank = {"predicted": {"memory_moment": "head", "memory_phase": "backward", "memory_at": "backward/other"},
            "measured": {"memory_bytes": {"peak": 11}, "memory_by_phase": {"backward": block, "forward": {"peak": 5}},
                         "memory_by_moment": {"backward/other": head, "backward/block": block}}}
    assert at_moment(rank) == (head, "backward")
    del rank["measured"]["memory_by_moment"]
    assert at_moment(rank) == (block, "backward")


def test_a_vocabulary_parallel_embedding_keeps_its_whole_gradient(monkeypatch):
    """At zero 0 with tp: a rank's embedding gradient is a view of DTensor's whole-vocabulary
    embedding_dense_backward output (128 x 64 fp32 on both tiny models, half of it beyond the shard) unless a tied
    head on the same rank takes the gradient first; not priced under ZeRO."""
    import autoplan.cost_models.estimate as ce

    def grads(cfg, model="tiny-gpt"):
        return [r["memory_bytes"]["gradients"] for r in counts_of_plan(_plan(cfg, model))]

    cases = [("tp=2,pp=2,recompute=full", "tiny-gpt"), ("dp=2,tp=2,ep=2", "tiny-moe"), ("dp=2,tp=2", "tiny-gpt"),
             ("dp=2,tp=2,ep=2,zero=1", "tiny-moe")]
    priced = [grads(*c) for c in cases]
    monkeypatch.setattr(ce, "embedding_grad_whole", lambda *a: 0.0)
    extra = [[a - b for a, b in zip(p, grads(*c))] for p, c in zip(priced, cases)]
    half = 128 * 64 // 2 * 4
    assert extra[0] == [half, 0]  # the first stage's embedding; the last stage's tied head copy has its shard's
    assert extra[1] == [half]  # untied, under FSDP2's replicate
    assert extra[2] == [0] and extra[3] == [0]  # tied head on the rank; ZeRO


def test_step_scalars_are_counted_where_a_measurement_names_them():
    """The loss's all-reduce (loss + two stop flags, float64) over every rank, named by the most specific mesh
    dimension spanning them (runtime.measure.group_names), and the gradient norm's float64 partial sums: none for
    plain tensors (DDP, a pipeline stage without TP or FSDP), per sharded dimension of each DTensor sharding
    otherwise, then over ep and pp."""
    from autoplan.cost_models.counts import _Comm, scalar_comm, world_dim

    def scalars(cfg: str) -> dict:
        comm = _Comm()
        scalar_comm(ParallelConfig.parse(cfg).resolve(4), comm)
        return {f"{d['collective']}@{d['mesh_dim']}": (d["count"], d["bytes"]) for d in comm.as_list()}

    assert scalars("dp=4") == {"all_reduce@dp": (1, 24)}
    assert scalars("pp=2,dp=2") == {"all_reduce@world": (1, 24), "all_reduce@pp": (1, 8)}
    assert scalars("dp=4,zero=1") == {"all_reduce@dp": (2, 32)}
    assert scalars("tp=2,dp=2,zero=1") == {"all_reduce@world": (1, 24), "all_reduce@dp": (2, 16),
                                           "all_reduce@tp": (1, 8)}
    assert scalars("tp=2,dp=2") == {"all_reduce@world": (1, 24), "all_reduce@tp": (1, 8)}
    assert scalars("tp=4") == {"all_reduce@tp": (2, 32)}
    assert world_dim(ParallelConfig.parse("dp=4,ep=4").resolve(4)) == "ep"


def test_the_estimate_prices_the_tp_points_the_runtime_runs():
    """The estimate times the tensor-parallel reductions and GEMMs cost_models.counts counts (and benchmarks/counts.py
    measures): a full recomputation under autoplan's runtime (torch.utils.checkpoint, early stop) re-runs a dense
    block's forward but its last GEMM and the reduction after it, Megatron's reentrant checkpoint all of it; a MoE
    block's experts are not tensor-parallel in autoplan's runtime, so only its attention reduces."""
    from autoplan.cost_models import comm
    from autoplan.cost_models.compute import (
        _gemm_parts,
        _skipped_tp_share,
        early_stop_skips_last_gemm,
        full_recompute_tp_calls,
        layer_cost,
        tp_points,
        tp_units,
    )
    from autoplan.cost_models.counts import layer_flops
    from autoplan.cost_models.estimate import context
    from autoplan.cost_models.profile import profile_from_spec
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.specs import check_config

    ours = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    megatron = apply_stack(ours, "megatron-2022", {})
    assert ours.runtime_memory and not megatron.runtime_memory
    cpu = load_cluster("local-cpu", gpus=4).model_copy(update={"cores_per_node": 2})
    cfg = check_config(ParallelConfig.parse("tp=2,dp=2,mbs=1,recompute=full"), load_model("tiny-gpt"), cpu, ours)
    block = profile_from_spec(load_model("tiny-gpt"))[1]
    ctx = context(cpu, ours, cfg)
    assert tp_points(block, ours) == (2, 2) and full_recompute_tp_calls(block, ctx) == {"all_reduce": 1}
    mcfg_ = check_config(ParallelConfig.parse("tp=2,dp=2,mbs=1,recompute=full"), load_model("tiny-gpt"), cpu, megatron)
    assert full_recompute_tp_calls(block, context(cpu, megatron, mcfg_)) == {"all_reduce": 2}
    # with sp the all-gather before the MLP's GEMMs runs again, only the reduce-scatter after w2 does not
    # (benchmarks/counts.py, tp=2 sp=1 full recompute: 2 all-gathers and 1 reduce-scatter a block, session 22)
    scfg = check_config(ParallelConfig.parse("tp=2,dp=2,mbs=1,sp=1,recompute=full"), load_model("tiny-gpt"), cpu, ours)
    sctx = context(cpu, ours, scfg)
    assert full_recompute_tp_calls(block, sctx) == {"all_gather": 2, "reduce_scatter": 1}
    sgrp = comm.group_of(cpu, 2, 1)
    ag, rs = (comm.all_gather(cpu, sgrp, b) if k == "all_gather" else comm.reduce_scatter(cpu, sgrp, b)
              for k, b in tp_units(block, sctx)[0].items())
    assert _skipped_tp_share(block, sctx) == pytest.approx(rs / (2 * (ag + rs)), rel=1e-12)
    c = layer_cost(block, ctx)
    # the whole forward again (its host time, kernels and reductions) less the last GEMM, its operator's host time
    # and the reduction after it, plus the checkpoint; its FLOPs less that GEMM's, as counts.layer_flops counts
    w2_s, _ = _gemm_parts(block, ctx)[-1]
    launch = (cpu.gpu.calibration.kernel_launch_us + cpu.gpu.calibration.tp_op_overhead_us) * 1e-6
    assert early_stop_skips_last_gemm(block, ours) and not early_stop_skips_last_gemm(block, megatron)
    assert c.recompute_full_s == pytest.approx(c.fwd_s - c.comm_fwd_s / 2 - w2_s - launch + c.checkpoint_full_s,
                                               rel=1e-12)
    assert c.recompute_flops_full == pytest.approx(layer_flops(block, ctx, "full")["recompute"], rel=1e-12)
    gpu = load_cluster("dgx-h100", gpus=4)
    gcfg = check_config(ParallelConfig.parse("tp=4,mbs=1,recompute=full"), load_model("tiny-gpt"), gpu, megatron)
    g = layer_cost(block, context(gpu, megatron, gcfg))
    assert g.recompute_full_s == pytest.approx(g.fwd_s, rel=1e-12)  # Megatron re-runs all of it
    # MoE: one reduction a block forward and backward in our runtime, and a full recompute re-runs it
    moe = profile_from_spec(load_model("tiny-moe"))[1]
    assert moe.moe_top_k and moe.tp_allreduces == 2
    assert tp_points(moe, ours) == (1, 1)
    assert tp_points(moe, megatron) == (2, 2)
    mcfg = check_config(ParallelConfig.parse("tp=2,dp=2,mbs=1"), load_model("tiny-moe"), cpu, ours)
    ctx = context(cpu, ours, mcfg)
    assert full_recompute_tp_calls(moe, ctx) == {"all_reduce": 1}
    grp = comm.group_of(ctx.cluster, 2, 1)
    one = sum(comm.all_reduce(ctx.cluster, grp, b) for b in tp_units(moe, ctx)[0].values())
    assert layer_cost(moe, ctx).comm_fwd_s == pytest.approx(one, rel=1e-12)


@pytest.mark.parametrize("cfg", ["dp=4,mbs=1,zero=3", "pp=2,dp=2,mbs=1,zero=3"])
def test_the_estimate_prices_zero3s_collectives_as_often_as_the_runtime_runs_them(cfg):
    """ZeRO-3 (FSDP2, reshard after forward) gathers every block for every forward and, without a pipeline,
    again for every backward and reduce-scatters after it; under the pipeline schedule once a step each
    (`estimate.fsdp_collectives`, the rule `counts.dp_comm` counts and benchmarks/counts.py measures). With
    nothing hidden, the estimate's per-micro-batch ZeRO-3 traffic over the step plus the gradient sync `dp_sync`
    prices are those collectives, once each (until session 22 a reduction too many a step; under a pipeline m - 1
    gathers and m reductions too many)."""
    from autoplan.cost_models import comm
    from autoplan.cost_models.estimate import (
        context,
        fsdp_collectives,
        fsdp_unit_time,
        layer_cost,
        num_microbatches,
        zero3_block_exposed,
    )
    from autoplan.cost_models.profile import profile_from_spec

    plan = _plan(cfg)
    p = plan.parallel
    m = num_microbatches(p, plan.training)
    assert m > 1
    fwd_g, bwd_g, reduces = fsdp_collectives(3, p.pp, m)
    assert (fwd_g, bwd_g, reduces) == ((m, m, m) if p.pp == 1 else (m, 1, 1))
    # counts: those collectives once per FSDP unit (the blocks and the stage root)
    calls = {c["collective"]: c["count"] for c in counts_of_plan(plan)[0]["comm"] if c["mesh_dim"] == "dp"}
    units = calls["reduce_scatter"] / reduces
    assert units == int(units) and calls["all_gather"] == units * (fwd_g + bwd_g)
    # the estimate, one block, nothing hidden behind compute
    block = profile_from_spec(load_model("tiny-gpt"))[1]
    cluster, training = plan.cluster, plan.training
    c = layer_cost(block, context(cluster, training, p))
    grp = comm.group_of(cluster, p.dp, 1)
    ag = comm.all_gather(cluster, grp, c.params_local * training.weight_bytes)
    rs = comm.reduce_scatter(cluster, grp, c.params_local * training.grad_bytes)
    per_mb = zero3_block_exposed(c.params_local, 0.0, 0.0, dp=p.dp, cp=1, tp=1, cluster=cluster,
                                 training=training, pp=p.pp, m=m)
    assert m * per_mb + rs == pytest.approx((fwd_g + bwd_g) * ag + reduces * rs, rel=1e-12)
    # gloo runs each unit's collectives one after another: the step's last reduction (dp_sync's, one collective
    # of the rank's gradients) pays every unit's latency, FSDP's host work each collective the runtime issues
    cal = cluster.gpu.calibration
    quiet = cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"calibration": cal.model_copy(
        update={"fsdp_hook_us": 0.0, "fsdp_collective_overhead_us": 0.0})})})
    dense = 3e5
    kw = dict(dense=dense, dp=p.dp, cp=1, tp=1, pp=p.pp, zero=3, m=m, training=training)
    g = dense * training.grad_bytes
    assert fsdp_unit_time(units, cluster=quiet, **kw) == pytest.approx(
        units * comm.reduce_scatter(quiet, grp, g / units) - comm.reduce_scatter(quiet, grp, g), rel=1e-12)
    busy = quiet.model_copy(update={"gpu": quiet.gpu.model_copy(update={"calibration": cal.model_copy(
        update={"fsdp_hook_us": 0.0, "fsdp_collective_overhead_us": 100.0})})})
    assert fsdp_unit_time(units, cluster=busy, **kw) - fsdp_unit_time(units, cluster=quiet, **kw) == pytest.approx(
        units * (fwd_g + bwd_g + reduces) * 100e-6, rel=1e-9)


def test_attention_dropout_on_cpu_is_priced_as_sdpas_math_path():
    """On gloo (CPU processes) with attention dropout autoplan's runtime runs SDPA's math path: the counts book a
    backward of 2x the core's forward and a selective re-run of half of it (the early stop leaves the PV bmm out),
    the estimate's recompute FLOPs say the same, the core's saved probabilities are the full s x s scores at three
    tensors' width, and its extra operators are host time. On a GPU cluster, and without dropout, the fused
    kernel's counts stay."""
    from autoplan.cost_models.compute import SDPA_MATH_SAVED_PER_SCORE, layer_cost, sdpa_math_path
    from autoplan.cost_models.counts import ATTN_BWD_FACTOR, layer_flops
    from autoplan.cost_models.estimate import context
    from autoplan.cost_models.profile import profile_from_spec
    from autoplan.specs import check_config

    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    dropped = load_model("tiny-gpt").model_copy(update={"dropout": 0.1})
    plain = load_model("tiny-gpt")
    cpu, gpu = load_cluster("local-cpu", gpus=1), load_cluster("dgx-h100", gpus=8).with_gpus(1)

    def costs(model, cluster):
        cfg = check_config(ParallelConfig.parse("mbs=2"), model, cluster, training)
        ctx = context(cluster, training, cfg)
        block = profile_from_spec(model)[1]
        return block, ctx, {r: layer_flops(block, ctx, r) for r in ("none", "selective")}, layer_cost(block, ctx)

    block, ctx, f, c = costs(dropped, cpu)
    attn = 4.0 * 2 * 64 * 64 * block.attention.heads * block.attention.head_dim
    gemm = f["none"]["forward"] - attn
    assert sdpa_math_path(block, ctx)
    assert f["none"]["backward"] == pytest.approx(2 * gemm + 2 * attn, rel=1e-12)
    assert f["selective"]["recompute"] == pytest.approx(attn / 2, rel=1e-12)
    assert c.recompute_flops_selective == pytest.approx(attn / 2, rel=1e-12)
    # the kept probabilities: a micro-batch's tokens x heads x s scores, three tensors of the activation width
    block_plain, _, _, c_plain = costs(plain, cpu)
    scores = 2 * 64 * block.attention.heads * 64 * SDPA_MATH_SAVED_PER_SCORE * 4
    lse = 2 * 64 * block.attention.heads * 4.0
    masks = 2 * 64 * (block.act_seq - block_plain.act_seq) * 4 / 2  # the hidden dropouts' (profile units, scaled)
    assert c.act_none - c_plain.act_none == pytest.approx(scores - lse + masks, rel=1e-9)
    assert c.fwd_s > c_plain.fwd_s
    for model, cluster in ((dropped, gpu), (plain, cpu)):
        block, ctx, f, c = costs(model, cluster)
        assert not sdpa_math_path(block, ctx)
        gemm = f["none"]["forward"] - attn
        assert f["none"]["backward"] == pytest.approx(2 * gemm + ATTN_BWD_FACTOR * attn, rel=1e-12)
        assert f["selective"]["recompute"] == pytest.approx(attn, rel=1e-12)


def test_one_micro_batch_makes_its_gradients_in_the_backward():
    """autoplan's runtime sets gradients to None at a step's start except under torch's DDP, so with one
    micro-batch and no pipeline the activations' peak holds only the head's gradients, and the optimizer step every
    gradient without the activations: the estimate takes the larger, the counts place each at its moment. Measured:
    tests/dist/test_counts.py (tp=2 and dp=2 ZeRO-1 at one micro-batch)."""
    from autoplan.cost_models.estimate import estimate, grads_made_in_backward, memory_of_rank
    from autoplan.cost_models.pipeline import in_flight
    from autoplan.cost_models.profile import profile_from_spec

    def parts(cfg, training=None, model="tiny-gpt", gpus=4):
        plan = make_plan(load_model(model), load_cluster("local-cpu").with_gpus(gpus),
                         training or TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32"), cfg,
                         kernels="torch")
        profiles = profile_from_spec(plan.model)
        est = estimate(profiles, plan.cluster, plan.training, plan.parallel)
        m = plan.training.global_batch_size // (plan.parallel.dp * plan.parallel.mbs)
        fl = in_flight(plan.parallel.schedule, plan.parallel.pp, m, plan.parallel.vp)[0]
        stages = [s for s in est.stages if s.index % plan.parallel.pp == 0]  # rank 0's
        every = memory_of_rank(stages, fl, plan.parallel, plan.cluster, plan.training)  # every gradient
        return plan, est.memory[0], every, counts_of_plan(plan)[0]

    for cfg, made in [("tp=4,mbs=8", True), ("dp=4,zero=1,mbs=2", True), ("dp=2,tp=2,mbs=4", True),
                      ("dp=4,zero=3,mbs=2", True), ("dp=4,mbs=2", False), ("tp=4,mbs=4", False),
                      ("pp=2,tp=2,mbs=8,schedule=gpipe", False)]:
        plan, mem, every, rank = parts(cfg)
        m = plan.training.global_batch_size // (plan.parallel.dp * plan.parallel.mbs)
        assert grads_made_in_backward(plan.parallel, m, plan.training) is made, cfg
        if not made:
            assert mem.total == pytest.approx(every.total, rel=1e-12), cfg
            continue
        # tiny-gpt's activations outweigh its gradients: the peak is the backward's, with the final norm's
        # gradient only (the tied head's weight gradient is a temporary there)
        assert mem.activations == pytest.approx(every.activations) and 0 < mem.gradients < 0.01 * every.gradients
        assert mem.total < every.total
        assert rank["memory_moment"] in ("block", "head", "forward") and rank["memory_at"] != "optimizer", cfg
        assert rank["memory_bytes"]["gradients"] <= mem.gradients, cfg
    # under full recomputation a block keeps little: the first block's backward, with every later block's
    # gradient, outweighs the last block's (measured: tests/dist/test_counts.py)
    plan, mem, every, rank = parts("mbs=8,recompute=full", gpus=1)
    assert 0.5 * every.gradients < mem.gradients < every.gradients and 0 < mem.activations < every.activations
    assert rank["memory_moment"] == "block" and 0.5 * every.gradients < rank["memory_bytes"]["gradients"]
    # ZeRO-1 with one micro-batch holds ZeRO-2's gradient shards at its step (not every gradient, as with two)
    plan, mem, every, _ = parts("dp=4,zero=1,mbs=2")
    z2 = parts("dp=4,zero=2,mbs=2")[2]
    assert every.gradients > z2.gradients > 0
    # a wide model on few tokens: the gradients outweigh the activations, the optimizer step is the peak
    wide = TrainingSpec(global_batch_size=1, seq_length=8, dtype="fp32")
    plan, mem, every, rank = parts("tp=4,mbs=1", wide)
    assert every.gradients > every.activations
    assert mem.gradients == pytest.approx(every.gradients) and mem.activations == 0.0
    assert mem.total < every.total
    assert rank["memory_moment"] == "step" and rank["memory_at"] == "optimizer"
    assert rank["memory_bytes"]["gradients"] == pytest.approx(every.gradients)
    assert 0 < rank["memory_bytes"]["activations"] < 0.05 * every.activations  # the token ids only
    # other software (Megatron's grad buffer) keeps every gradient: only autoplan's runtime is priced so
    from autoplan.cost_models.stacks import apply_stack

    assert not grads_made_in_backward(plan.parallel, 1, apply_stack(wide, "megatron-core", {}))
