"""Software-stack profiles (`--stack`, `--stack-set`, `autoplan stacks`): knobs reach the cost model through
TrainingSpec, are recorded in the plan, and bad names are one-line errors."""

from __future__ import annotations

import json

import pytest

from autoplan.cli import main
from autoplan.cost_models.errors import SpecError
from autoplan.cost_models.specs import TrainingSpec
from autoplan.cost_models.stacks import STACKS, apply_stack, parse_stack_set

EST = ["estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "1024", "--global-batch",
       "1536", "--seq-len", "2048", "--parallel", "tp=8,pp=8,vp=3,mbs=1,recompute=full", "--json"]


def _llama2_on_16_h100(stack: str) -> list[str]:
    """The workload options of the stack-capability tests' CLI calls."""
    return ["--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64", "--seq-len",
            "2048", "--stack", stack]


def _forged(plan, tmp_path, stage0: dict | None = None, **training) -> str:
    """`plan` with training fields (and stage 0's) edited and the hash recomputed (a shared file made to claim
    another stack)."""
    from autoplan.plan import Plan

    d = json.loads(plan.to_json())
    d["training"].update(training)
    d["stages"][0].update(stage0 or {})
    d["content_hash"] = Plan.model_validate(d).compute_hash()
    path = tmp_path / "forged.json"
    path.write_text(json.dumps(d))
    return str(path)


def _est(capsys, *extra: str) -> dict:
    assert main(EST + list(extra)) == 0
    return json.loads(capsys.readouterr().out)


def test_stacks_lists_the_issue_profiles(capsys, monkeypatch):
    assert main(["stacks", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) >= {"autoplan", "megatron-2021", "megatron-2022", "megatron-core", "deepspeed-zero3",
                         "torchtitan"}
    assert rows["autoplan"]["default"] and rows["megatron-2021"]["knobs"]["flash_attention"] is False
    assert all(r["assumes"] and r["source"] for r in rows.values())
    monkeypatch.setenv("COLUMNS", "300")  # one line per knob: no cell folded
    assert main(["stacks"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "megatron-core" in out and "(default) (default)" not in out
    # the autoplan stack's gradients are its fp32 parameters' own (TrainingSpec.grad_dtype), not the compute dtype
    assert "grad_dtype=fp32 (the fp32 parameters' own)" in out
    # an unset knob says what it resolves to (not the gradient dtype's "compute" for every knob, as until session 35)
    assert "p2p_overlap=default (under interleaving only)" in out and "p2p_overlap=compute" not in out
    assert "master_weights=default (optimizer_dtype's)" in out


def test_every_stack_is_valid_training_values():
    base = TrainingSpec(global_batch_size=8, seq_length=128)
    for name, stack in STACKS.items():
        tr = apply_stack(base, name)
        for k, v in stack.knobs.items():
            assert getattr(tr, k) == v, (name, k)


def test_stack_changes_the_prediction_and_is_reported(capsys):
    default = _est(capsys)
    old = _est(capsys, "--stack", "megatron-2021")
    assert default["stack"] == "autoplan" and old["stack"] == "megatron-2021"
    assert old["kernels_assumed"] == "megatron"
    assert default["step_time_s"] != old["step_time_s"]
    # unfused attention, fp16 reduce without overlap: Megatron-LM 2021 is slower than today's Megatron
    # (autoplan's own runtime is not the comparison: it computes under autocast over fp32 weights)
    core = _est(capsys, "--stack", "megatron-core")
    assert old["step_time_s"] > core["step_time_s"] * 1.02
    # a single knob set to today's value moves the prediction toward it
    one = _est(capsys, "--stack", "megatron-2021", "--stack-set", "flash_attention=true")
    assert one["stack"] == "megatron-2021+flash_attention=true"
    assert core["step_time_s"] < one["step_time_s"] < old["step_time_s"]


def test_explicit_dtype_wins_over_the_stack(capsys):
    fp16 = _est(capsys, "--stack", "megatron-2021")
    bf16 = _est(capsys, "--stack", "megatron-2021", "--dtype", "bf16")
    # same peak on A100; the one difference is fp16's grad-scaler unscale pass in Megatron's optimizer step
    # (optimizer_separate_passes: read and write the fp32 grads, 8 B per parameter), which bf16 does not run
    assert fp16["step_time_s"] > bf16["step_time_s"]
    assert fp16["step_time_s"] == pytest.approx(bf16["step_time_s"], rel=2e-3)
    tt = apply_stack(TrainingSpec(global_batch_size=8, seq_length=128, dtype="fp8"), "torchtitan",
                     keep=("dtype",))
    assert tt.dtype == "fp8" and tt.tp_comm_overlap and tt.grad_reduce_dtype == "fp32"


def test_plan_records_the_stack_and_show_restacks(tmp_path, capsys):
    from autoplan.plan import load_plan

    out = tmp_path / "p.json"
    d = _est(capsys, "--stack", "megatron-core", "-o", str(out))
    plan = load_plan(out)
    assert plan.stack == "megatron-core" and plan.training.tp_comm_overlap
    assert plan.prediction.step_time_s == pytest.approx(d["step_time_s"])
    assert main(["show", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stack"] == "megatron-core"
    assert main(["show", str(out), "--json", "--stack", "megatron-2021"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["stack"] == "megatron-2021"
    assert shown["step_time_s"] > d["step_time_s"] * 1.02


def test_search_and_scaling_take_a_stack(capsys):
    args = ["--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g", "--global-batch", "64", "--seq-len", "2048",
            "--stack", "deepspeed-zero3", "--json"]
    assert main(["search", "--gpus", "16", "--top", "1", *args]) == 0
    assert json.loads(capsys.readouterr().out)["stack"] == "deepspeed-zero3"
    assert main(["scaling", "--gpus", "8,16", *args]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["rows"]) == 2 and got["stack"] == "deepspeed-zero3"
    assert main(["scaling", "--gpus", "8", *args[:-1]]) == 0  # the table says which stack it assumed
    assert "stack deepspeed-zero3" in capsys.readouterr().out


@pytest.mark.parametrize("extra,needle", [
    (["--stack", "megatron-1999"], "unknown stack"),
    (["--stack-set", "flashy=1"], "unknown stack knob"),
    (["--stack-set", "flash_attention=maybe"], "takes true or false"),
    (["--stack-set", "kernels=torch,kernels=fused"], "given twice"),
    (["--stack-set", "grad_reduce_dtype=int4"], "stack knob grad_reduce_dtype"),
])
def test_bad_stacks_are_one_line_errors(capsys, extra, needle):
    assert main(EST + extra) == 2
    d = json.loads(capsys.readouterr().out)  # EST has --json: the error is one JSON object on stdout
    assert needle in d["error"] and "\n" not in d["error"] and d["fix"]


def test_parse_stack_set():
    assert parse_stack_set("tp_comm_overlap=on, grad_reduce_dtype=fp32") == {"tp_comm_overlap": True,
                                                                              "grad_reduce_dtype": "fp32"}
    assert parse_stack_set("grad-reduce-dtype=none") == {"grad_reduce_dtype": None}
    # the short names `autoplan stacks` prints are accepted too
    assert parse_stack_set("flash=false,grad_dtype=fp32") == {"flash_attention": False, "grad_reduce_dtype": "fp32"}
    with pytest.raises(Exception, match="given twice"):
        parse_stack_set("flash=false,flash_attention=true")


def test_a_non_reentrant_checkpoint_stops_before_the_last_gemm():
    """Full recomputation under torch.utils.checkpoint without reentrance (autoplan's runtime; torchtitan's full
    AC before 2025-08, checkpoint_wrapper) stops once the block's last saved tensor is back: the MLP's output GEMM is
    not re-run. Megatron's and DeepSpeed's reentrant checkpoints re-run the whole forward, and so does torchtitan's
    since its early_stop config defaults to false (25413d224). `checkpoint_early_stop` says which
    (None: as `runtime_memory`, i.e. autoplan's runtime); --stack-set takes it; a plan of autoplan's stack that
    says false prices a program the runtime does not run and `run` refuses it."""
    from autoplan.api import make_plan
    from autoplan.cost_models.compute import _gemm_parts, early_stop_skips_last_gemm
    from autoplan.cost_models.estimate import context, layer_cost
    from autoplan.cost_models.profile import profile_from_spec
    from autoplan.runtime.launch import check_stack
    from autoplan.specs import ParallelConfig, check_config, load_cluster, load_model

    base = TrainingSpec(global_batch_size=64, seq_length=2048)
    titan, megatron = apply_stack(base, "torchtitan", {}), apply_stack(base, "megatron-2022", {})
    assert not apply_stack(base, "torchtitan").recompute_stops_early  # today's torchtitan re-runs the whole block
    titan = apply_stack(base, "torchtitan", {"checkpoint_early_stop": True})  # the 2024 code's (fidelity rows)
    assert titan.recompute_stops_early and base.recompute_stops_early and not megatron.recompute_stops_early
    assert apply_stack(base, "megatron-2022", {"checkpoint_early_stop": True}).recompute_stops_early
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8)
    block = profile_from_spec(model)[1]
    for training, stops in ((titan, True), (megatron, False)):
        cfg = check_config(ParallelConfig.parse("dp=8,zero=1,recompute=full"), model, cluster, training)
        ctx = context(cluster, training, cfg)
        c = layer_cost(block, ctx)
        assert early_stop_skips_last_gemm(block, training) is stops
        # device-bound, no tensor parallelism: the re-run is the forward, less w2's GEMM where it stops early
        assert c.recompute_full_s == pytest.approx(c.fwd_s - (_gemm_parts(block, ctx)[-1][0] if stops else 0.0))
    assert parse_stack_set("checkpoint_early_stop=off") == {"checkpoint_early_stop": False}
    assert parse_stack_set("checkpoint_early_stop=default") == {"checkpoint_early_stop": None}
    with pytest.raises(Exception, match="takes true or false"):
        parse_stack_set("checkpoint_early_stop=sometimes")
    tiny, cpu = load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(2)
    small = TrainingSpec(global_batch_size=4, seq_length=64, dtype="fp32")
    for value, refused in ((False, True), (True, False), (None, False)):
        plan = make_plan(tiny, cpu, apply_stack(small, "autoplan", {"checkpoint_early_stop": value}),
                         "dp=2,recompute=full")
        label = "autoplan" + ("" if value is None else f"+checkpoint_early_stop={str(value).lower()}")
        assert bool(check_stack(plan.model_copy(update={"stack": label}).sealed())) is refused


def test_bf16_optimizer_state_halves_the_optimizer_memory_and_exports_as_megatron_can(capsys):
    """`--stack-set optimizer_dtype=bf16` (apex's DistributedFusedAdam with dtype=bf16, as NeMo runs Nemotron-4
    340B with store_params): master copy and both Adam moments in bf16, 6 bytes a parameter instead of 12, sharded
    as the state is; Megatron's export asks for bf16 moments, whose master (16-bit remainders) is as large;
    torchtitan's says it has none."""
    from autoplan.api import make_plan
    from autoplan.inspect import export_megatron, export_torchtitan
    from autoplan.specs import load_cluster, load_model

    assert parse_stack_set("optimizer_dtype=bf16") == {"optimizer_dtype": "bf16"}
    assert TrainingSpec(global_batch_size=8, seq_length=256, dtype="bf16", autocast_fp32_params=False,
                        optimizer_dtype="bf16").optimizer_state_bytes == 6
    assert TrainingSpec(global_batch_size=8, seq_length=256, dtype="bf16",
                        autocast_fp32_params=False).optimizer_state_bytes == 12
    # fp32 parameters are their own master copy: the moments alone
    assert TrainingSpec(global_batch_size=8, seq_length=256, dtype="fp32",
                        optimizer_dtype="bf16").optimizer_state_bytes == 4
    plans = {}
    for opt in ("fp32", "bf16"):
        tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-core",
                         {"optimizer_dtype": opt})
        plans[opt] = make_plan(load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16), tr,
                               "tp=2,pp=1,mbs=1,sp=1,zero=1")
    mem = {k: p.prediction.memory_breakdown[0] for k, p in plans.items()}
    assert mem["bf16"].optimizer == pytest.approx(mem["fp32"].optimizer / 2, abs=2e-6)  # GiB, 6 decimals
    assert mem["bf16"].weights == mem["fp32"].weights and mem["bf16"].gradients == mem["fp32"].gradients
    assert plans["bf16"].prediction.step_time_s < plans["fp32"].prediction.step_time_s  # a lighter Adam pass
    meg = export_megatron(plans["bf16"])
    assert meg["flags"]["--use-precision-aware-optimizer"] is True and meg["flags"]["--exp-avg-dtype"] == "bf16"
    assert meg["flags"]["--exp-avg-sq-dtype"] == "bf16" and "--use-distributed-optimizer" in meg["flags"]
    assert not any("master_weights" in w for w in meg["warnings"])  # remainders: 2 bytes, as planned
    assert "--use-precision-aware-optimizer" not in export_megatron(plans["fp32"])["flags"]
    assert any("optimizer_dtype=bf16" in w for w in export_torchtitan(plans["bf16"])["warnings"])
    # planned on autoplan's own stack, the knob is named as one `autoplan run` refuses; kernels (the runtime's) is not
    base = ["estimate", "--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8",
            "--parallel", "tp=8"]
    assert main([*base, "--stack-set", "optimizer_dtype=bf16"]) == 0
    assert "optimizer_dtype=bf16 prices software autoplan's runtime does not have" in capsys.readouterr().err
    assert main([*base, "--stack-set", "kernels=torch,p2p_overlap=true"]) == 0  # its own values: no note
    assert "does not have" not in capsys.readouterr().err
    # a wrong value is one line naming the knob
    assert main(["estimate", "--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8",
                 "--parallel", "tp=8", "--stack", "megatron-core", "--stack-set", "optimizer_dtype=fp8"]) != 0
    err = capsys.readouterr().err
    assert "optimizer_dtype" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 4


def test_master_weights_price_what_each_optimizer_holds_and_moves():
    """`master_weights`: fp32 (4 bytes), a 16-bit master or bf16 remainders (2), in place (0: NeMo's
    distributed_fused_adam with optim.dtype equal to the weights'); the Adam pass moves 10 / 6 / 8 / 4 bytes for it.
    Unset, it follows optimizer_dtype as before the knob (bf16 -> a 16-bit master)."""
    from autoplan.api import make_plan
    from autoplan.cost_models.estimate import optimizer_time
    from autoplan.inspect import export_megatron
    from autoplan.specs import load_cluster, load_model

    def tr(**kw):
        return TrainingSpec(global_batch_size=8, seq_length=256, dtype="bf16", autocast_fp32_params=False, **kw)

    assert [tr(master_weights=m).optimizer_state_bytes for m in ("fp32", "bf16", "remainders", "in-place")] == \
        [12, 10, 10, 8]
    assert tr(optimizer_dtype="bf16", master_weights="in-place").optimizer_state_bytes == 4
    assert tr(optimizer_dtype="bf16").master_kind == "bf16" and tr().master_kind == "fp32"
    cluster = load_cluster("dgx-h100", gpus=8)
    t = {m: optimizer_time(1e9, 1, cluster, tr(master_weights=m)) for m in ("fp32", "bf16", "remainders", "in-place")}
    assert t["fp32"] / 34 == pytest.approx(t["bf16"] / 30) == pytest.approx(t["remainders"] / 32)
    assert t["in-place"] / 28 == pytest.approx(t["fp32"] / 34)
    assert optimizer_time(1e9, 1, cluster, tr(optimizer_dtype="bf16")) == pytest.approx(t["fp32"] * 22 / 34)
    # fp32 parameters are their own master: the knob prices nothing there
    assert TrainingSpec(global_batch_size=8, seq_length=256, dtype="bf16", master_weights="in-place").master_bytes == 0
    with pytest.raises(SpecError, match="remainders"):
        TrainingSpec(global_batch_size=8, seq_length=256, dtype="fp16", master_weights="remainders")
    assert parse_stack_set("master_weights=in-place") == {"master_weights": "in-place"}
    assert parse_stack_set("master_weights=default") == {"master_weights": None}
    # exported to Megatron-Core: in place is not what it holds (4 bytes more); remainders export as such
    plans = {}
    for m in ("in-place", "remainders"):
        t_ = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-core", {"master_weights": m})
        plans[m] = make_plan(load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16), t_,
                             "tp=2,pp=1,mbs=1,sp=1,zero=1")
    mem = {k: p.prediction.memory_breakdown[0].optimizer for k, p in plans.items()}
    assert mem["in-place"] == pytest.approx(mem["remainders"] * 8 / 10, abs=2e-6)
    meg = export_megatron(plans["in-place"])
    assert "--use-precision-aware-optimizer" not in meg["flags"]
    assert any("master_weights=in-place" in w and "4 bytes" in w for w in meg["warnings"])
    meg = export_megatron(plans["remainders"])
    assert meg["flags"]["--use-precision-aware-optimizer"] is True and "--exp-avg-dtype" not in meg["flags"]
    assert not any("master_weights" in w for w in meg["warnings"])
    # autoplan's runtime steps fp32 parameters, their own master: the knob prices nothing there and is not refused
    from autoplan.runtime.launch import check_stack

    tiny, cpu = load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(2)
    small = apply_stack(TrainingSpec(global_batch_size=4, seq_length=64, dtype="bf16"), "autoplan",
                        {"master_weights": "in-place"})
    plan = make_plan(tiny, cpu, small, "dp=2")
    assert plan.training.master_bytes == 0 and check_stack(plan.model_copy(
        update={"stack": "autoplan+master_weights=in-place"}).sealed()) == []


def test_fused_cross_entropy_prices_22_bytes_a_logit_and_exports_megatrons_flag(capsys):
    """`--stack-set loss_fusion=true` (Megatron-Core's --cross-entropy-loss-fusion, NeMo's
    cross_entropy_loss_fusion): the head's loss moves FUSED_CE_BYTES a logit where the eager one moves
    EAGER_CE_BYTES; nothing else in the plan changes. Megatron's export asks for it, torchtitan's says it has not."""
    from autoplan.api import make_plan
    from autoplan.cost_models.compute import Context, _mem_time, layer_cost
    from autoplan.cost_models.profile import EAGER_CE_BYTES, FUSED_CE_BYTES, profile_from_spec
    from autoplan.inspect import export_megatron, export_torchtitan
    from autoplan.specs import load_cluster, load_model

    assert parse_stack_set("loss_fusion=true") == {"loss_fusion": True}
    assert (EAGER_CE_BYTES, FUSED_CE_BYTES) == (38, 22)
    model, h100 = load_model("llama3-8b"), load_cluster("dgx-h100", gpus=16)
    prof = profile_from_spec(model)
    head, block = prof[-1], prof[1]
    cost = {}
    for fused in (False, True):
        tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=4096), "megatron-core", {"loss_fusion": fused})
        ctx = Context(h100, tr, tp=2, cp=1, sp=True, ep=1, mbs=1)
        cost[fused] = (layer_cost(head, ctx), layer_cost(block, ctx), ctx)
    (eager, b0, ctx), (fused, b1, _) = cost[False], cost[True]
    logits = ctx.tokens * model.vocab_size / 2  # this rank's vocabulary shard
    saved = _mem_time(ctx, logits * (EAGER_CE_BYTES - FUSED_CE_BYTES))
    assert eager.fwd_s - fused.fwd_s == pytest.approx(saved, rel=1e-9)
    assert eager.bwd_s - fused.bwd_s == pytest.approx(2 * saved, rel=1e-9)  # the backward's rule: twice the forward
    assert b0 == b1 and eager.act_none == fused.act_none  # blocks unchanged; the fp32 softmax is kept all the same
    plans = {f: make_plan(model, h100, apply_stack(TrainingSpec(global_batch_size=64, seq_length=4096),
                                                    "megatron-core", {"loss_fusion": f}), "tp=2,pp=2,mbs=1,sp=1,zero=1")
             for f in (False, True)}
    assert plans[True].prediction.step_time_s < plans[False].prediction.step_time_s
    assert plans[True].short_hash != plans[False].short_hash
    assert plans[True].prediction.memory_breakdown == plans[False].prediction.memory_breakdown
    assert export_megatron(plans[True])["flags"]["--cross-entropy-loss-fusion"] is True
    assert "--cross-entropy-loss-fusion" not in export_megatron(plans[False])["flags"]
    assert any("loss_fusion" in w for w in export_torchtitan(plans[True])["warnings"])
    base = ["estimate", "--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8",
            "--parallel", "tp=8"]
    assert main([*base, "--stack-set", "loss_fusion=true"]) == 0  # a knob autoplan's runtime lacks: named
    assert "loss_fusion=true prices software autoplan's runtime does not have" in capsys.readouterr().err


def test_older_megatron_stacks_keep_whole_rounds_of_pp(capsys):
    """Six micro-batches on pp=4: one interleaved round of six on autoplan's and Megatron-Core's stacks; Megatron-LM
    before Megatron-Core 0.10 (megatron-2021/2022) needs m a multiple of pp, so estimate refuses it with the fix
    and the search never proposes it; --stack-set flexible_rounds=true lifts that. (megatron-deepspeed runs no
    interleaved schedule at all: test_each_stack_plans_only_the_schedules_it_runs.)"""
    from autoplan.api import make_plan
    from autoplan.cost_models.errors import ConfigError
    from autoplan.search.space import all_configs
    from autoplan.specs import load_cluster, load_model

    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16)
    cfg = "tp=2,pp=4,dp=2,vp=2,mbs=1,schedule=interleaved"
    for stack, ok in (("autoplan", True), ("megatron-core", True), ("megatron-2022", False),
                      ("megatron-2021", False)):
        tr = apply_stack(TrainingSpec(global_batch_size=12, seq_length=2048), stack, {})
        assert tr.flexible_rounds == ok
        if ok:
            assert make_plan(model, cluster, tr, cfg).prediction.step_time_s > 0
        else:
            with pytest.raises(ConfigError, match="multiple of pp"):
                make_plan(model, cluster, tr, cfg)
        odd = [c for c in all_configs(model, cluster, tr, {"tp": 2, "mbs": 1})
               if c.schedule == "interleaved" and (12 // (c.dp * c.mbs)) % c.pp]
        assert bool(odd) == ok, stack
    tr = apply_stack(TrainingSpec(global_batch_size=12, seq_length=2048), "megatron-2022", {"flexible_rounds": True})
    assert make_plan(model, cluster, tr, cfg).prediction.step_time_s > 0
    assert main(["estimate", "--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "12",
                 "--seq-len", "2048", "--stack", "megatron-2022", "--parallel", cfg]) != 0
    err = capsys.readouterr().err
    assert "flexible_rounds=true" in err and "Traceback" not in err


def test_megatron_and_deepspeed_run_1f1b_with_fewer_micro_batches_than_stages(capsys):
    """Four micro-batches on pp=8: torch.distributed.pipelining's Schedule1F1B (autoplan's and torchtitan's
    stacks) refuses it, Megatron's and DeepSpeed's 1F1B run it with the pipeline never full (SC21's figure-14/17
    scripts): priced there as the simulated schedule, the fill and drain of (pp-1) stage times whatever m is."""
    from autoplan.api import make_plan
    from autoplan.cost_models.errors import ConfigError
    from autoplan.specs import load_cluster, load_model

    model, cluster = load_model("gpt3-175b"), load_cluster("dgx-a100-80g", gpus=64)
    cfg = "tp=8,pp=8,mbs=1"
    for stack in ("autoplan", "torchtitan"):
        tr = apply_stack(TrainingSpec(global_batch_size=4, seq_length=2048), stack, {})
        with pytest.raises(ConfigError, match="short_1f1b=true"):
            make_plan(model, cluster, tr, cfg)
    steps = {}
    for stack in ("megatron-2021", "megatron-2022", "megatron-core", "megatron-deepspeed"):
        for m in (1, 4, 8, 16):
            tr = apply_stack(TrainingSpec(global_batch_size=m, seq_length=2048), stack, {})
            pred = make_plan(model, cluster, tr, cfg).prediction
            steps[stack, m] = pred.step_time_s
            assert pred.breakdown["bubble"] > 0
        one, four, eight = steps[stack, 1], steps[stack, 4], steps[stack, 8]
        # each micro-batch past the first adds one stage's f + b; the fill and drain stay: (T8 - T4) / 4 is that
        # stage time, and T1 holds the whole chain of 8 stages of it
        per_stage = (eight - four) / 4
        assert one == pytest.approx(8 * per_stage, rel=0.1)
        assert four - one == pytest.approx(3 * per_stage, rel=0.1)
        assert steps[stack, 16] - eight == pytest.approx(8 * per_stage, rel=0.02)
    assert main(["estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "64", "--global-batch",
                 "4", "--seq-len", "2048", "--parallel", cfg]) != 0
    assert "short_1f1b=true" in capsys.readouterr().err


def test_each_stack_plans_only_the_zero_stages_it_runs(capsys):
    """Megatron-Core has no ZeRO-2 (its distributed optimizer keeps the whole gradient buffer), DeepSpeed's
    pipeline engine refuses ZeRO-2/3, Megatron-LM 2021 had no distributed optimizer: estimate refuses those with
    the fix, the search never proposes them, and --stack-set zero_stages=... widens a stack that does run them."""
    from autoplan.api import make_plan
    from autoplan.cost_models.errors import ConfigError
    from autoplan.search.space import all_configs
    from autoplan.specs import load_cluster, load_model

    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16)
    runs = {"autoplan": {0, 1, 2, 3}, "torchtitan": {0, 1, 2, 3}, "deepspeed-zero3": {0, 1, 2, 3},
            "megatron-core": {0, 1, 3}, "megatron-2022": {0, 1}, "megatron-deepspeed": {0, 1}, "megatron-2021": {0}}
    assert set(runs) == set(STACKS)
    for stack, zeros in runs.items():
        tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), stack, {})
        seen = {c.zero for c in all_configs(model, cluster, tr, {"tp": 2, "pp": 1, "mbs": 1})}
        assert seen == zeros, stack
        for z in range(4):
            cfg = f"tp=2,pp=1,mbs=1,zero={z}"
            if z in zeros:
                assert make_plan(model, cluster, tr, cfg).prediction.step_time_s > 0
            else:
                with pytest.raises(ConfigError, match=f"zero={z} is not a ZeRO stage this software stack runs"):
                    make_plan(model, cluster, tr, cfg)
    wide = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-core", {"zero_stages": "0123"})
    assert make_plan(model, cluster, wide, "tp=2,pp=1,mbs=1,zero=2").prediction.step_time_s > 0
    base = _llama2_on_16_h100("megatron-core")
    assert main(["estimate", *base, "--parallel", "tp=2,zero=2"]) != 0
    err = capsys.readouterr().err
    assert "use zero=1" in err and "zero_stages=0123" in err and "\n" not in err.strip()
    assert main(["search", *base, "--fix", "zero=2"]) != 0
    assert "zero=2 is not a ZeRO stage" in capsys.readouterr().err
    assert main(["estimate", *base, "--parallel", "tp=2,zero=2", "--stack-set", "zero_stages=0123", "--json"]) == 0
    capsys.readouterr()
    for bad in ("0213", "", "4", "13"):  # digits of 0-3 in order, 0 among them
        with pytest.raises(ConfigError, match="stack knob zero_stages"):
            apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "autoplan", {"zero_stages": bad})


def test_each_stack_plans_only_the_schedules_it_runs(capsys):
    """Megatron has 1F1B and the interleaved schedule but no GPipe; DeepSpeed's pipeline engine runs its
    TrainSchedule (1F1B) only, so Megatron-DeepSpeed has no virtual stages, and ZeRO-3 on a plain model no
    pipeline; torch.distributed.pipelining (autoplan, torchtitan) runs all three. estimate refuses the others with
    the fix, the search never proposes them, and --stack-set schedules=... widens a stack."""
    from autoplan.api import make_plan
    from autoplan.cost_models.errors import ConfigError
    from autoplan.search.space import all_configs
    from autoplan.specs import load_cluster, load_model

    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16)
    runs = {"autoplan": {"gpipe", "1f1b", "interleaved"}, "torchtitan": {"gpipe", "1f1b", "interleaved"},
            "megatron-core": {"1f1b", "interleaved"}, "megatron-2022": {"1f1b", "interleaved"},
            "megatron-2021": {"1f1b", "interleaved"}, "megatron-deepspeed": {"1f1b"}, "deepspeed-zero3": set()}
    assert set(runs) == set(STACKS)
    cfgs = {"gpipe": "tp=2,pp=4,mbs=1,schedule=gpipe", "1f1b": "tp=2,pp=4,mbs=1,schedule=1f1b",
            "interleaved": "tp=2,pp=4,vp=2,mbs=1"}
    for stack, scheds in runs.items():
        tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), stack, {})
        seen = {c.schedule for c in all_configs(model, cluster, tr, {"tp": 2, "pp": 4, "mbs": 1})}
        assert seen == scheds, stack
        for sched, cfg in cfgs.items():
            if sched in scheds:
                assert make_plan(model, cluster, tr, cfg).prediction.step_time_s > 0
            else:
                refusal = f"schedule={sched} is not a pipeline schedule" if scheds else "runs no pipeline parallelism"
                with pytest.raises(ConfigError, match=refusal):
                    make_plan(model, cluster, tr, cfg)
        # without a pipeline there is no schedule to refuse
        assert make_plan(model, cluster, tr, "tp=2,pp=1,mbs=1").prediction.step_time_s > 0
    base = _llama2_on_16_h100("megatron-deepspeed")
    assert main(["estimate", *base, "--parallel", "tp=2,pp=4,vp=2"]) != 0
    err = capsys.readouterr().err
    assert "schedule=1f1b and vp=1" in err and "schedules=1f1b+interleaved" in err and "\n" not in err.strip()
    assert main(["estimate", *base, "--parallel", "tp=2,pp=4,vp=2", "--stack-set", "schedules=1f1b+interleaved,"
                 "flexible_rounds=true", "--json"]) == 0
    capsys.readouterr()
    # "none" is a value of its own here, not the knob's default
    assert parse_stack_set("schedules=none") == {"schedules": "none"}
    flat = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "autoplan", {"schedules": "none"})
    with pytest.raises(ConfigError, match="runs no pipeline parallelism"):
        make_plan(model, cluster, flat, "tp=2,pp=4,mbs=1")
    assert not [c for c in all_configs(model, cluster, flat, {"tp": 2, "mbs": 1}) if c.pp > 1]
    for bad in ("1f1b,interleaved", "zb", "1f1b+", "", "none+1f1b"):
        with pytest.raises(ConfigError, match="stack knob schedules"):
            apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "autoplan", {"schedules": bad})


def test_each_stack_splits_the_sequence_only_as_it_can():
    """Sequence parallelism came to Megatron-LM in 2022-03 and context parallelism in 2023-08: megatron-2021 and the
    2021-22 Megatron-DeepSpeed have neither, megatron-2022 sp only; DeepSpeed ZeRO-3 on a plain model neither (its
    Ulysses split is not the ring context parallelism priced here). estimate refuses the others with the fix, the
    search never proposes them, --stack-set seq_splits=... widens a stack."""
    from autoplan.api import make_plan
    from autoplan.cost_models.errors import ConfigError
    from autoplan.search.space import all_configs
    from autoplan.specs import load_cluster, load_model

    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16)
    runs = {"autoplan": {"sp", "cp"}, "torchtitan": {"sp", "cp"}, "megatron-core": {"sp", "cp"},
            "megatron-2022": {"sp"}, "megatron-2021": set(), "megatron-deepspeed": set(), "deepspeed-zero3": set()}
    assert set(runs) == set(STACKS)
    for stack, splits in runs.items():
        tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=4096), stack, {})
        cfgs = list(all_configs(model, cluster, tr, {"tp": 2, "pp": 1, "mbs": 1, "zero": 0}))
        assert any(c.sp for c in cfgs) == ("sp" in splits), stack
        assert any(c.cp > 1 for c in cfgs) == ("cp" in splits), stack
        for name, cfg in (("sp", "tp=2,pp=1,mbs=1,sp=1"), ("cp", "tp=2,cp=2,pp=1,mbs=1")):
            if name in splits:
                assert make_plan(model, cluster, tr, cfg).prediction.step_time_s > 0
            else:
                with pytest.raises(ConfigError, match="this software stack has no"):
                    make_plan(model, cluster, tr, cfg)
    wide = apply_stack(TrainingSpec(global_batch_size=64, seq_length=4096), "megatron-2022", {"seq_splits": "sp+cp"})
    assert make_plan(model, cluster, wide, "tp=2,cp=2,pp=1,mbs=1").prediction.step_time_s > 0
    assert parse_stack_set("seq_splits=none") == {"seq_splits": "none"}
    with pytest.raises(ConfigError, match="seq_splits=sp\\+cp"):
        make_plan(model, cluster, apply_stack(TrainingSpec(global_batch_size=64, seq_length=4096), "megatron-2022",
                                              {}), "tp=2,cp=2,pp=1,mbs=1")
    for bad in ("cp+sp", "sp,cp", "ulysses", ""):
        with pytest.raises(ConfigError, match="stack knob seq_splits"):
            apply_stack(TrainingSpec(global_batch_size=64, seq_length=4096), "autoplan", {"seq_splits": bad})


def test_each_stack_recomputes_only_as_it_can(tmp_path, capsys):
    """Megatron-LM 2021 checkpointed every layer (selective recomputation came in 2022-05), as do the 2021-22
    Megatron-DeepSpeed and DeepSpeed / Hugging Face models: on those stacks estimate refuses selective
    recomputation and a partial full one (whose other layers autoplan recomputes selectively), the search proposes
    neither (GPT-3 175B on 384 A100 under megatron-2021 chose one fully recomputed layer and selective
    recomputation elsewhere before the gate), a plan file that says otherwise is refused on load, and
    --stack-set recompute_modes=selective+full,partial_recompute=rest-none widens a stack."""
    from autoplan.api import make_plan
    from autoplan.cost_models.errors import ConfigError
    from autoplan.plan import load_plan
    from autoplan.search.core import search
    from autoplan.specs import load_cluster, load_model

    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16)
    selective = {"autoplan": True, "torchtitan": True, "megatron-core": True, "megatron-2022": True,
                 "megatron-2021": False, "megatron-deepspeed": False, "deepspeed-zero3": False}
    assert set(selective) == set(STACKS)
    for stack, has in selective.items():
        tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), stack, {})
        assert make_plan(model, cluster, tr, "tp=2,pp=1,mbs=1,recompute=full").prediction.step_time_s > 0
        for cfg, refusal in (("tp=2,pp=1,mbs=1,recompute=selective", "recompute=selective is not a recomputation"),
                             ("tp=2,pp=1,mbs=1,recompute=full,recompute_layers=8", "recomputing 8 of its 32 layers")):
            if has:
                assert make_plan(model, cluster, tr, cfg).prediction.step_time_s > 0
            else:
                with pytest.raises(ConfigError, match=refusal):
                    make_plan(model, cluster, tr, cfg)
    # an explicit layout: the stage with the most layers decides; recompute_layers counts up to a rank's layers
    tr21 = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-deepspeed", {})
    with pytest.raises(ConfigError, match="recomputing 27 of its 28 layers"):
        make_plan(model, cluster, tr21, "tp=2,pp=2,mbs=1,recompute=full,recompute_layers=27,layout=Et*4|t*28L")
    whole = make_plan(model, cluster, tr21, "tp=2,pp=2,mbs=1,recompute=full,recompute_layers=28,layout=Et*4|t*28L")
    assert [(s.recompute_layers, s.layers[1] - s.layers[0]) for s in whole.stages] == [(4, 4), (28, 28)]
    with pytest.raises(ConfigError, match="recompute_layers exceeds the layers of a pipeline rank"):
        make_plan(model, cluster, tr21, "tp=2,pp=2,mbs=1,recompute=full,recompute_layers=29,layout=Et*4|t*28L")

    gpt, a100 = load_model("gpt3-175b"), load_cluster("dgx-a100-80g", gpus=384)
    old = apply_stack(TrainingSpec(global_batch_size=1536, seq_length=2048), "megatron-2021", {})
    plan = search(gpt, a100, old, top=3).plan
    assert all(s.recompute == "none" or (s.recompute == "full" and s.recompute_layers == s.layers[1] - s.layers[0])
               for s in plan.stages), plan.parallel.to_string()
    wide = search(gpt, a100, old.model_copy(update={"recompute_modes": "selective+full",
                                                    "partial_recompute": "rest-none"}), top=3).plan
    assert any(s.recompute == "selective" or (s.recompute == "full" and s.recompute_layers < s.layers[1] - s.layers[0])
               for s in wide.stages), wide.parallel.to_string()
    assert wide.prediction.step_time_s < plan.prediction.step_time_s  # the gate costs speed, it is not free

    base = _llama2_on_16_h100("megatron-2021")
    for fix, needle, widen in (
            ("recompute=selective", "recompute=selective is not a recomputation",
             "recompute_modes=selective+full,partial_recompute=rest-none"),
            ("recompute_layers=4", "--fix recompute_layers recomputes some of a stage's layers",
             "partial_recompute=rest-none")):
        assert main(["search", *base, "--fix", fix]) != 0
        err = capsys.readouterr().err
        assert needle in err and f"--stack-set {widen} " in err and "\n" not in err.strip()
    assert main(["estimate", *base, "--parallel", "tp=2,recompute=selective", "--stack-set",
                 "recompute_modes=selective+full,partial_recompute=rest-none", "--json"]) == 0
    capsys.readouterr()
    # selective beside a stack that recomputes whole stages only: refused with the knob to add (one line)
    assert main(["estimate", *base, "--parallel", "tp=2,recompute=selective", "--stack-set",
                 "recompute_modes=selective+full"]) != 0
    err = capsys.readouterr().err
    assert "partial_recompute=off (every layer in full or none) beside selective" in err
    assert "set partial_recompute=rest-none as well" in err and "\n" not in err.strip()

    # plans edited to claim a stack without selective recomputation and re-hashed: refused on load, by the
    # configuration or by the stage that recomputes part of its layers
    from autoplan.cost_models.errors import PlanError

    autoplan_tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "autoplan", {})
    for cfg, edit, needle in (("tp=2,pp=2,mbs=1,recompute=selective", {}, "recompute=selective is not"),
                              ("tp=2,pp=2,mbs=1,recompute=full", {"recompute_layers": 3},
                               "stage 0 recomputing 3 of its 16 layers")):
        with pytest.raises(PlanError, match=needle):
            load_plan(_forged(make_plan(model, cluster, autoplan_tr, cfg), tmp_path, edit, recompute_modes="full"))
    for bad in ("full+selective", "partial", "", "selective,full"):
        with pytest.raises(ConfigError, match="stack knob recompute_modes"):
            apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "autoplan", {"recompute_modes": bad})


def test_stacks_with_one_recomputation_setting_plan_one_for_every_stage(tmp_path, capsys):
    """Megatron (--recompute-granularity/-method/-num-layers: each model chunk recomputes its first N layers) and
    torchtitan (one activation_checkpoint section) apply one setting to every stage; autoplan's runtime recomputes
    each stage its own way. On the other stacks the search proposes one setting (the block method included: the
    first k layers of every stage in full), the export then needs no "stages recompute differently" warning, and
    a plan or layout that mixes is refused with the fix; --stack-set recompute_per_stage=true widens a stack."""
    from autoplan.cost_models.errors import ConfigError, PlanError
    from autoplan.cost_models.specs import check_stages_run
    from autoplan.inspect.export import megatron_flags
    from autoplan.plan import load_plan
    from autoplan.search.core import search
    from autoplan.specs import load_cluster, load_model

    per_stage = {name: st.knobs["recompute_per_stage"] for name, st in STACKS.items()}
    assert per_stage == {name: name == "autoplan" for name in STACKS}

    def stages(plan):
        return [(s.recompute, s.recompute_layers, s.layers[1] - s.layers[0]) for s in plan.stages]

    # Llama 2 7B on 8 H100, tp=1, pp=2, mbs=4: the first rank (two micro-batches in flight) must recompute 4 of its
    # 16 layers; Megatron's block method recomputes the same 4 on the second rank too
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100", gpus=8)
    fix = {"tp": "1", "cp": "1", "pp": "2", "mbs": "4", "zero": "1", "vp": "1"}
    core = apply_stack(TrainingSpec(global_batch_size=256, seq_length=4096), "megatron-core", {})
    one = search(model, cluster, core, top=2, fix=fix).plan
    assert stages(one) == [("full", 4, 16), ("full", 4, 16)]
    flags, warnings = megatron_flags(one)
    assert ("--recompute-method", "block") in flags and ("--recompute-num-layers", 4) in flags
    assert not [w for w in warnings if "recompute" in w]
    free = search(model, cluster, core.model_copy(update={"recompute_per_stage": True}), top=2, fix=fix).plan
    assert stages(free) == [("full", 4, 16), ("none", 0, 16)]
    assert free.prediction.step_time_s < one.prediction.step_time_s  # what per-stage recomputation is worth
    assert any("recompute differently" in w for w in megatron_flags(free)[1])

    # GPT-3 175B on 128 H100 unpinned: before, megatron-core's best recomputed one layer in one virtual stage only
    gpt = search(load_model("gpt3-175b"), load_cluster("dgx-h100", gpus=128),
                 apply_stack(TrainingSpec(global_batch_size=256, seq_length=2048), "megatron-core", {}), top=2).plan
    held = {(m, k if m == "full" else 0) for m, k, n in stages(gpt) if n}
    assert len(held) == 1 or {m for m, _ in held} == {"full"}, held
    check_stages_run([(n, m, k) for m, k, n in stages(gpt)], gpt.training)

    mixed = [(16, "full", 4), (16, "none", 0)]
    with pytest.raises(ConfigError, match="applies one recomputation setting to every stage"):
        check_stages_run(mixed, core)
    with pytest.raises(ConfigError, match="stage 1 full \\(8 of 16 layers\\)"):
        check_stages_run([(16, "full", 4), (16, "full", 8)], core)
    check_stages_run([(3, "full", 3), (16, "full", 4), (0, "none", 0)], core)  # min(k, layers), empty stages
    check_stages_run(mixed, core.model_copy(update={"recompute_per_stage": True}))

    # the per-stage plan restacked onto megatron-core is refused, and so is a forged plan file
    path = free.save(tmp_path / "free.json")
    assert main(["show", str(path), "--stack", "megatron-core"]) != 0
    err = capsys.readouterr().err
    assert "one recomputation setting" in err and "recompute_per_stage=true" in err and "\n" not in err.strip()
    with pytest.raises(PlanError, match="applies one recomputation setting"):
        load_plan(_forged(free, tmp_path, recompute_per_stage=False))


def test_the_block_method_leaves_a_stages_other_layers_plain():
    """Megatron's block method (--recompute-method block) and torchtitan's layer SAC run a partly full stage's other
    layers plainly; autoplan's runtime recomputes their attention core. Before partial_recompute, every stack was
    priced autoplan's way: without flash attention (megatron-2022) a block-method plan was priced slower and
    smaller than Megatron runs it, and the search never proposed the block method there."""
    from autoplan.api import make_plan
    from autoplan.search.core import search
    from autoplan.specs import load_cluster, load_model

    partial = {name: st.knobs["partial_recompute"] for name, st in STACKS.items()}
    assert partial == {"autoplan": "rest-selective", "megatron-2021": "off", "megatron-deepspeed": "off",
                       "deepspeed-zero3": "off", "megatron-2022": "rest-none", "megatron-core": "rest-none",
                       "torchtitan": "every-nth"}

    gpt, a100 = load_model("gpt3-175b"), load_cluster("dgx-a100-80g", gpus=64)
    old = apply_stack(TrainingSpec(global_batch_size=512, seq_length=2048), "megatron-2022", {})
    cfg = "tp=8,pp=8,mbs=1,sp=1,recompute=full,recompute_layers=4"
    plain = make_plan(gpt, a100, old, cfg)
    sel = make_plan(gpt, a100, old.model_copy(update={"partial_recompute": "rest-selective"}), cfg)
    assert [(s.recompute, s.recompute_layers) for s in plain.stages] == [("full", 4)] * 8
    # the other 8 layers of each stage keep their softmax and dropout outputs and re-run nothing
    assert plain.prediction.step_time_s < sel.prediction.step_time_s
    assert plain.prediction.memory_gib["peak"] > sel.prediction.memory_gib["peak"]
    whole = "tp=8,pp=8,mbs=1,sp=1,recompute=full"  # nothing else to recompute: the same either way
    assert make_plan(gpt, a100, old, whole).prediction == \
        make_plan(gpt, a100, old.model_copy(update={"partial_recompute": "rest-selective"}), whole).prediction

    # a stack without selective recomputation and flash attention that has the block method: the search proposes
    # it (half of each stage's layers in full), faster than recomputing every layer. Which plan wins depends on the
    # GPU's constants; these are the A100's of sessions 7-35 (session 36's refit makes whole-stage recomputation
    # at tp=4, dp=2 the fastest here), so the test checks the mechanism, not the fit.
    a100 = a100.model_copy(update={"gpu": a100.gpu.model_copy(update={"calibration": a100.gpu.calibration.model_copy(
        update={"matmul_max_efficiency": 0.7232, "matmul_half_dim": 120.0, "memory_efficiency": 0.8263})})})
    ds = apply_stack(TrainingSpec(global_batch_size=512, seq_length=2048), "megatron-deepspeed", {})
    whole_only = search(gpt, a100, ds, top=2).plan
    block = search(gpt, a100, ds.model_copy(update={"partial_recompute": "rest-none"}), top=2).plan
    assert {(s.recompute, s.recompute_layers) for s in block.stages} == {("full", 6)}, block.parallel.to_string()
    assert all(s.recompute_layers in (0, s.layers[1] - s.layers[0]) for s in whole_only.stages)
    assert block.prediction.step_time_s < whole_only.prediction.step_time_s


def test_megatron_core_overlaps_pipeline_sends_under_interleaving_only():
    """Megatron-LM made --overlap-p2p-communication the default in 2023-10 (4eeff55d) and turns it off without
    virtual stages (megatron/training/arguments.py); the megatron-core stack priced blocking sends everywhere, so
    every interleaved plan on it paid each received message on its critical path."""
    from autoplan.api import make_plan
    from autoplan.specs import load_cluster, load_model

    core = apply_stack(TrainingSpec(global_batch_size=256, seq_length=2048), "megatron-core", {})
    assert core.p2p_overlap is None and core.p2p_overlapped(2) and not core.p2p_overlapped(1)
    gpt, h100 = load_model("gpt3-175b"), load_cluster("dgx-h100", gpus=128)
    for cfg, overlapped in (("tp=4,pp=8,vp=6,mbs=1,sp=1,zero=1", True), ("tp=4,pp=8,mbs=1,sp=1,zero=1", False)):
        plan = make_plan(gpt, h100, core, cfg)
        same = make_plan(gpt, h100, core.model_copy(update={"p2p_overlap": overlapped}), cfg)
        other = make_plan(gpt, h100, core.model_copy(update={"p2p_overlap": not overlapped}), cfg)
        assert plan.prediction.step_time_s == same.prediction.step_time_s
        assert plan.prediction.step_time_s != other.prediction.step_time_s
    run = read_megatron_flags(["--no-overlap-p2p-communication"])
    assert run.stack_set["p2p_overlap"] is False
    assert "p2p_overlap" not in read_megatron_flags([]).stack_set  # absent: the chosen stack's


def read_megatron_flags(extra):
    from autoplan.inspect.megatron_import import read_megatron

    return read_megatron(["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length",
                          "512", "--vocab-size", "1000", "--pipeline-model-parallel-size", "2",
                          "--num-virtual-stages-per-pipeline-rank", "2", *extra])


def test_older_megatron_stacks_split_layers_evenly(tmp_path, capsys):
    """Megatron-LM asserted "num_layers must be divisible by pipeline_model_parallel_size" (and by the virtual
    stages) until its uneven pipeline parallelism (2024-09): on megatron-2021 and megatron-2022 estimate refuses a
    layout or a layer count that is not an even split, the search proposes none (Llama 3 70B on 64 H100 under
    megatron-2022 placed 19, 20, 21 and 20 layers on four stages before the gate), a plan that says otherwise is
    refused on load, and --stack-set uneven_stages=true widens a stack."""
    from autoplan.api import make_plan
    from autoplan.cost_models.errors import ConfigError, PlanError
    from autoplan.plan import load_plan
    from autoplan.search.core import search
    from autoplan.search.space import all_configs
    from autoplan.specs import load_cluster, load_model

    even = {name: not st.knobs["uneven_stages"] for name, st in STACKS.items()}
    assert even == {name: name in ("megatron-2021", "megatron-2022") for name in STACKS}
    model, cluster = load_model("llama2-7b"), load_cluster("dgx-h100", gpus=16)  # 32 layers
    for stack, only_even in even.items():
        tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), stack, {})
        # 24 GPUs at tp=2: pp=3 and pp=6 do not divide 32 layers
        cfgs = list(all_configs(model, load_cluster("dgx-h100", gpus=24), tr, {"tp": 2, "mbs": 1, "zero": 0}))
        odd = [c for c in cfgs if model.num_layers % (c.pp * c.vp)]
        if tr.schedules == "none":  # no pipeline: one stage holds every layer
            assert not odd and all(c.pp == 1 for c in cfgs), stack
            continue
        assert bool(odd) != only_even, stack
        for cfg in ("tp=2,pp=2,mbs=1,layout=Et*15|t*17L", "tp=2,pp=2,vp=3,mbs=1,layout=E|(t*6|)*4,t*8L"):
            if only_even:
                with pytest.raises(ConfigError, match="splits the layers evenly"):
                    make_plan(model, cluster, tr, cfg)
            elif "vp=3" not in cfg or "interleaved" in tr.schedules:
                assert make_plan(model, cluster, tr, cfg).prediction.step_time_s > 0
    tr22 = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-2022", {})
    assert make_plan(model, cluster, tr22, "tp=2,pp=2,mbs=1,layout=Et*16|t*16L").prediction.step_time_s > 0

    big, h100 = load_model("llama3-70b"), load_cluster("dgx-h100", gpus=64)
    tr = apply_stack(TrainingSpec(global_batch_size=512, seq_length=2048), "megatron-2022", {})
    plan = search(big, h100, tr, top=2).plan
    assert len({s.layers[1] - s.layers[0] for s in plan.stages}) == 1, plan.parallel.to_string()
    wide = search(big, h100, tr.model_copy(update={"uneven_stages": True}), top=2).plan
    assert len({s.layers[1] - s.layers[0] for s in wide.stages}) > 1, wide.parallel.to_string()
    assert wide.prediction.step_time_s < plan.prediction.step_time_s

    base = _llama2_on_16_h100("megatron-2021")
    assert main(["estimate", *base, "--parallel", "tp=2,pp=2", "--uneven", "first=15,last=17"]) != 0
    err = capsys.readouterr().err
    assert "splits the layers evenly" in err and "uneven_stages=true" in err and "\n" not in err.strip()
    assert main(["estimate", *base, "--gpus", "24", "--parallel", "tp=2,pp=3"]) != 0
    assert "32 layers do not divide into pp*vp=3 stages" in capsys.readouterr().err

    # an uneven plan file edited to claim an even-only stack, re-hashed: refused on load
    uneven = make_plan(model, cluster, apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "autoplan",
                                                   {}), "tp=2,pp=2,mbs=1,layout=Et*15|t*17L")
    with pytest.raises(PlanError, match="splits the layers evenly"):
        load_plan(_forged(uneven, tmp_path, uneven_stages=False))
