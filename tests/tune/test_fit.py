"""The fit recovers known constants from synthetic measurements made by the cost model with those constants,
the refit cluster round-trips through a YAML file, and tune's run-log reader parses the profile record."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autoplan.cost_models import comm
from autoplan.cost_models.fit import (
    COMPONENTS,
    KNOBS,
    CollectiveSample,
    GemmSample,
    RegionSample,
    RunSample,
    TimedComponents,
    cluster_yaml,
    fit_cluster,
    knob_values,
    predict_collective,
    predict_gemm,
    predict_region,
    predict_run,
    predicted_component,
    with_knobs,
)
from autoplan.cost_models.hardware import cluster_preset
from autoplan.cost_models.specs import ModelSpec, ParallelConfig, TrainingSpec, check_config
from autoplan.presets import MODEL_PRESETS
from autoplan.specs import load_cluster

TRUTH = {"matmul_max_efficiency": 0.6, "matmul_half_dim": 40.0, "attention_efficiency": 0.25,
         "memory_efficiency": 0.5, "kernel_launch_us": 25.0, "intra_latency_us": 300.0,
         "intra_bandwidth_gbps": 0.8, "oversubscription_wait_us": 900.0, "tp_op_overhead_us": 80.0,
         "fsdp_collective_overhead_us": 2000.0, "step_wait_us": 1500.0, "fsdp_hook_us": 300.0,
         "skew_wait_us": 700.0, "recompute_region_us": 250.0, "recompute_op_us": 45.0, "dtensor_param_us": 100.0,
         "pipeline_action_us": 180.0}
SMALL = ModelSpec(name="small-gpt", num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024,
                  vocab_size=512, max_seq_length=256)


def _base():
    return cluster_preset("local-cpu").model_copy(update={"cores_per_node": 2})


def _synthetic(truth, with_components: bool = False):
    """Runs (host-bound tiny and device-bound small GPTs, 4 and 2 processes), GEMMs and collectives, all
    'measured' by the cost model with the true constants."""
    runs = []
    # the third at a larger batch: host time per step (the optimizer's) and per micro-batch (hooks, operators)
    # then scale differently and the totals tell them apart
    for model, seq, gbs in ((MODEL_PRESETS["tiny-gpt"], 64, 8), (SMALL, 256, 8), (SMALL, 128, 32)):
        for world, cfgs in ((4, ["dp=4", "tp=2,dp=2", "pp=2,dp=2", "dp=4,zero=3", "tp=2,pp=2,recompute=full"]),
                            (2, ["dp=2", "tp=2"])):
            for c in cfgs:
                tr = TrainingSpec(global_batch_size=gbs, seq_length=seq, dtype="fp32", kernels="torch")
                cfg = check_config(ParallelConfig.parse(c), model, truth.with_gpus(world), tr)
                r = RunSample(model=model, training=tr, parallel=cfg, world=world, measured_step_s=1.0, label=c)
                est = predict_run(truth, r)
                comps = TimedComponents(seconds={k: predicted_component(est.breakdown, k, cfg)
                                                 for k in COMPONENTS}) \
                    if with_components else None
                runs.append(r.model_copy(update={"measured_step_s": est.step_time_s, "components": comps}))
    gemms = [GemmSample(m=m, n=n, k=k, seconds=1.0)
             for m, n, k in ((64, 64, 64), (128, 256, 64), (512, 512, 512), (256, 1024, 256), (32, 2048, 128))]
    gemms = [g.model_copy(update={"seconds": predict_gemm(truth, g)}) for g in gemms]
    colls = []
    for kind in ("all_reduce", "all_gather", "send_recv", "all_to_all"):
        for ppn in (2, 4):
            for nbytes in (4096, 1 << 20, 16 << 20):
                c = CollectiveSample(collective=kind, level="intra", ranks=ppn, processes_per_node=ppn,
                                     nbytes=nbytes, seconds=1.0)
                colls.append(c.model_copy(update={"seconds": predict_collective(truth, c)}))
    return runs, gemms, colls


def _regions(truth):
    """Checkpoint micro-benchmarks (calibrate_bench.bench_recompute_region): an attention core and a block."""
    return [RegionSample(ops=ops, seconds=predict_region(truth, RegionSample(ops=ops, seconds=1.0)))
            for ops in (1, 12)]


@pytest.mark.parametrize("with_components", [False, True])
def test_fit_recovers_known_constants_within_1_percent(with_components):
    truth = with_knobs(_base(), TRUTH)
    runs, gemms, colls = _synthetic(truth, with_components)
    # start 30% off in alternating directions
    start = with_knobs(_base(), {k: v * (1.3 if i % 2 else 0.7) for i, (k, v) in enumerate(TRUTH.items())})
    res = fit_cluster(start, runs, gemms, colls, _regions(truth))
    assert set(res.free) == set(TRUTH), res.free
    assert not res.undetermined and not res.collinear
    for k, v in TRUTH.items():
        assert res.after[k] == pytest.approx(v, rel=0.01), (k, res.after[k], v)
    assert res.mean_abs_error("run", "before") > 0.05  # the start was really wrong
    assert res.mean_abs_error("run") < 1e-3
    fitted = knob_values(res.cluster)
    assert fitted["kernel_launch_us"] == pytest.approx(TRUTH["kernel_launch_us"], rel=0.01)


def test_component_rows_determine_what_the_step_time_cannot():
    """One tiny ZeRO-3 run: its step time is mostly FSDP's host time per collective (dp_comm); the host time per
    operator (compute) is a few percent of it, too little of the total for the fit to pin, so from the total
    alone kernel_launch_us is held at its (wrong) start. The measured components are rows of their own: with them
    both knobs are recovered."""
    truth = with_knobs(_base(), TRUTH)
    runs, _, _ = _synthetic(truth, with_components=True)
    run = next(r for r in runs if r.label == "dp=4,zero=3" and r.model.name == "tiny-gpt")
    assert {"compute", "dp_comm"} <= set(run.components.seconds)
    free = ["kernel_launch_us", "fsdp_collective_overhead_us"]
    start = with_knobs(truth, {"kernel_launch_us": 40.0, "fsdp_collective_overhead_us": 1200.0})
    total_only = fit_cluster(start, [run.model_copy(update={"components": None})], free=free)
    assert total_only.held == ["kernel_launch_us"], total_only.held
    assert total_only.after["kernel_launch_us"] == 40.0 != pytest.approx(TRUTH["kernel_launch_us"], rel=0.05)
    with_parts = fit_cluster(start, [run], free=free)
    assert not with_parts.held and not with_parts.collinear
    for k in free:
        assert with_parts.after[k] == pytest.approx(TRUTH[k], rel=0.01), (k, with_parts.after[k])
    assert {r["label"].split()[-1] for r in with_parts.rows if r["kind"] == "component"} >= {"compute", "dp_comm"}


def test_timing_buckets_map_to_the_estimate_components(tmp_path):
    """The runtime's timing buckets (autoplan.runtime.timing) sum into the breakdown's components; the busiest
    pipeline stage is the one reported, each component its ranks' median; the log's median over timed steps."""
    from autoplan.tune.records import TimingRecord, component_seconds, read_run_log

    b = {"forward": 0.02, "backward": 0.04, "forward/funcol": 0.01, "backward/funcol": 0.015, "recompute": 0.005,
         "recompute/funcol": 0.001, "fsdp": 0.003, "fsdp/work": 0.007, "backward/p2p": 0.02, "step_tail": 0.004,
         "step_tail/work": 0.002, "forward/work": 0.001}
    c = component_seconds(b)
    assert c == pytest.approx({"compute": 0.06, "recompute": 0.006, "tp_cp_ep_comm": 0.025, "dp_comm": 0.01,
                               "pp_wait": 0.02, "optimizer": 0.006, "other_wait": 0.001})
    assert sum(c.values()) == pytest.approx(sum(b.values()))
    rank = lambda r, s, f: {"rank": r, "pp_stage": s, "step_s": 0.1, "time_s": {"forward": f, "step_tail": 0.01}}  # noqa: E731
    rec = {"event": "timing", "step": 3, "ranks": [rank(0, 0, 0.05), rank(1, 1, 0.07), rank(2, 1, 0.09),
                                                    rank(3, 1, 0.08)]}
    assert TimingRecord.model_validate(rec).components()["compute"] == pytest.approx(0.08)  # stage 1's median
    log = tmp_path / "log.jsonl"
    lines = [{"step": 1, "step_time_s": 0.2}, {**rec, "step": 2}, {**rec, "step": 3}]
    lines[2]["ranks"] = [rank(0, 0, 0.05), rank(1, 1, 0.03)]
    log.write_text("\n".join(json.dumps(o) for o in lines) + "\n")
    comps = read_run_log(log).time_components()
    assert comps["compute"] == pytest.approx((0.08 + 0.05) / 2) and comps["optimizer"] == pytest.approx(0.01)


def test_runs_alone_leave_primitives_collinear_knobs_reported():
    """Without micro-benchmarks, and with runs whose every collective spans all four processes of the node, hop
    latency and the descheduling wait are the same term: the fit must say that one of them is not pinned rather
    than claim to know both. (Runs with two-member collectives, tp=2 or pp=2 on the same node, pay no wait and
    separate them.)"""
    truth = with_knobs(_base(), TRUTH)
    runs, _, _ = _synthetic(truth)
    runs = [r for r in runs if r.world == 4 and r.label in ("dp=4", "dp=4,zero=3")]
    res = fit_cluster(truth, runs, free=["intra_latency_us", "oversubscription_wait_us", "kernel_launch_us"])
    total = res.after["intra_latency_us"] + 0.5 * res.after["oversubscription_wait_us"]
    assert total == pytest.approx(TRUTH["intra_latency_us"] + 0.5 * TRUTH["oversubscription_wait_us"], rel=0.01)
    assert res.mean_abs_error("run") < 1e-3
    assert ["intra_latency_us", "oversubscription_wait_us"] in res.collinear, res.collinear
    # one of the pair is held at its start (here the truth) and the other carries the combination
    held = [k for k in ("intra_latency_us", "oversubscription_wait_us") if k in res.held]
    assert len(held) == 1, res.held
    assert res.after[held[0]] == res.before[held[0]]


def test_a_knob_no_run_sees_is_held_at_its_start():
    """dp-only runs without ZeRO (torch DDP) never use the tensor-parallel or FSDP overheads, and a model with no attention
    difference between them cannot see attention efficiency apart from the rest: whatever the fit cannot see it
    must leave where it started instead of letting it wander."""
    truth = with_knobs(_base(), TRUTH)
    runs, _, _ = _synthetic(truth)
    runs = [r for r in runs if r.parallel.tp == 1 and r.parallel.pp == 1 and r.parallel.zero == 0][:3]
    free = ["kernel_launch_us", "tp_op_overhead_us", "fsdp_collective_overhead_us"]
    start = with_knobs(truth, {"kernel_launch_us": 40.0})
    res = fit_cluster(start, runs, free=free)
    assert set(res.held) >= {"tp_op_overhead_us", "fsdp_collective_overhead_us"}, res.held
    for k in ("tp_op_overhead_us", "fsdp_collective_overhead_us"):
        assert res.after[k] == res.before[k] == TRUTH[k]
    assert res.after["kernel_launch_us"] == pytest.approx(TRUTH["kernel_launch_us"], rel=0.01)


def test_efficiency_above_one_raises_the_peak_and_predicts_the_same():
    base = _base()
    up = with_knobs(base, {"matmul_max_efficiency": 2.0, "memory_efficiency": 1.5})
    assert up.gpu.calibration.matmul_max_efficiency == pytest.approx(1.0)
    assert up.gpu.peak_tflops.fp32 == pytest.approx(2 * base.gpu.peak_tflops.fp32)
    assert up.gpu.hbm_gbps == pytest.approx(1.5 * base.gpu.hbm_gbps)
    g = GemmSample(m=512, n=512, k=512, seconds=1.0)
    half = with_knobs(base, {"matmul_max_efficiency": 1.0})
    assert predict_gemm(up, g) == pytest.approx(predict_gemm(half, g) / 2, rel=1e-9)


def test_oversubscription_wait_only_when_a_collectives_members_outnumber_cores():
    """A ring step waits for a descheduled member only when the collective's own members outnumber the cores
    (they block and wake in lockstep); a pair on a node of four processes, the others idle, does not (measured:
    calibrate's send/recv between two of four processes costs what it costs between two of two)."""
    cl = with_knobs(_base(), {"oversubscription_wait_us": 1000.0, "intra_latency_us": 100.0})
    four, two = cl.with_gpus(4), cl.with_gpus(2)
    assert four.descheduled_fraction == pytest.approx(0.5) and two.descheduled_fraction == 0.0
    assert four.member_descheduled_fraction(4) == pytest.approx(0.5) and four.member_descheduled_fraction(2) == 0.0
    assert comm.p2p(four, 1.0, False) == pytest.approx(comm.p2p(two, 1.0, False), rel=1e-12)
    no_wait = four.model_copy(update={"oversubscription_wait_us": 0.0})
    whole = comm.group_of(four, 4, 1)
    # a ring all-reduce over all four: 2 x (4-1) hops, each 0.5 x 1 ms more
    assert comm.all_reduce(four, whole, 1.0) - comm.all_reduce(no_wait, whole, 1.0) == pytest.approx(3e-3, rel=1e-6)
    assert cluster_preset("dgx-h100").member_descheduled_fraction(8) == 0.0  # accelerators: no term


def test_step_wait_only_for_collectives_with_processes_outside_them():
    """Inside a step a woken member of a collective waits for a core only when the node's processes outside the
    collective (computing) take every core: 1 - cores/(outside + 1)."""
    cl = with_knobs(_base(), {"step_wait_us": 3000.0, "intra_latency_us": 100.0}).with_gpus(4)  # 2 cores
    assert cl.crowded_fraction(4) == 0.0 and cl.crowded_fraction(3) == 0.0
    assert cl.crowded_fraction(2) == pytest.approx(1 / 3) and cl.crowded_fraction(1) == pytest.approx(0.5)
    idle = cl.model_copy(update={"step_wait_us": 0.0})
    whole, pair = comm.group_of(cl, 4, 1), comm.group_of(cl, 2, 1)
    assert comm.all_reduce(cl, whole, 1.0) == pytest.approx(comm.all_reduce(idle, whole, 1.0), rel=1e-12)
    # a pair: one hop each way (2 x (2-1)), each 1 ms more
    assert comm.all_reduce(cl, pair, 1.0) - comm.all_reduce(idle, pair, 1.0) == pytest.approx(2e-3, rel=1e-6)
    assert comm.p2p(cl, 1.0, False) - comm.p2p(idle, 1.0, False) == pytest.approx(1e-3, rel=1e-6)
    assert cl.with_gpus(2).crowded_fraction(2) == 0.0  # no more processes than cores
    assert cluster_preset("dgx-h100").crowded_fraction(2) == 0.0  # accelerators: no term


def test_crowding_counts_only_outside_processes_that_compute():
    """With the configuration's crowding (estimate.crowded_for), processes of other pipeline stages count for
    the fraction of the step a stage computes, m/(m + pp - 1); those of the same stage count whole."""
    from autoplan.cost_models.estimate import crowded_for

    cl = _base().with_gpus(4)  # 4 processes on 2 cores
    tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    tp_dp = crowded_for(cl, tr, tp=2, cp=1, dp=2, pp=1, mbs=1)
    assert tp_dp.crowding == (4, 1.0) and tp_dp.crowded_fraction(2) == pytest.approx(1 / 3)  # other replica busy
    one_mb = crowded_for(cl, tr, tp=2, cp=1, dp=1, pp=2, mbs=8)  # m = 1: the other stage computes half the step
    assert one_mb.crowding == (2, 0.5) and one_mb.crowded_fraction(2) == 0.0
    many = crowded_for(cl, tr, tp=2, cp=1, dp=1, pp=2, mbs=1)  # m = 8: busy 8/9 of the step
    assert many.crowded_fraction(2) == pytest.approx(1 - 2 / (2 * 8 / 9 + 1))
    pp4 = crowded_for(cl, tr, tp=1, cp=1, dp=1, pp=4, mbs=1)  # a message between two of four stages
    assert pp4.crowded_fraction(2, pair=True) == pytest.approx(1 - 2 / (2 * 8 / 11 + 1))
    assert crowded_for(cluster_preset("dgx-h100"), tr, tp=2, cp=1, dp=1, pp=2, mbs=1).crowding is None
    assert "crowding" not in cl.model_copy(update={"crowding": (2, 0.5)}).model_dump()  # never in a file


def test_compute_is_priced_at_the_all_at_once_rate_whatever_the_schedule():
    """4 processes on 2 cores: the calibration's rate assumes all four compute at once (half a core each), and it
    prices every layout's compute, pipelines whose stages take turns included (session 18: the runtime's measured
    compute per unit of work is 0.74-0.82 of that estimate for pipelines with one micro-batch, 1.13-1.38 with
    more, 0.74-1.04 without a pipeline; the turn-taking rate, half of it, was too fast for every pipelined class).
    The crowding of the configuration moves only the waits of its collectives (crowded_fraction)."""
    from autoplan.cost_models.compute import Context, layer_cost
    from autoplan.cost_models.estimate import crowded_for
    from autoplan.cost_models.profile import profile_from_spec

    cl = _base().with_gpus(4)
    tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    block = profile_from_spec(MODEL_PRESETS["tiny-gpt"])[1]
    plain = layer_cost(block, Context(cluster=cl, training=tr, tp=1, cp=1, sp=False, ep=1, mbs=4))
    for pp, mbs in ((2, 4), (2, 1), (1, 2)):  # one micro-batch (turns), several, no pipeline
        crowded = crowded_for(cl, tr, tp=1, cp=1, dp=4 // pp, pp=pp, mbs=mbs)
        cost = layer_cost(block, Context(cluster=crowded, training=tr, tp=1, cp=1, sp=False, ep=1, mbs=4))
        assert (cost.fwd_s, cost.bwd_s) == (plain.fwd_s, plain.bwd_s)
    # the waits do follow it: a pair of one stage's processes, the other stage computing half the step
    assert cl.crowded_fraction(2) == pytest.approx(1 / 3)
    assert crowded_for(cl, tr, tp=1, cp=1, dp=2, pp=2, mbs=4).crowded_fraction(2) == 0.0


def test_skew_wait_once_per_collective_inside_a_step_only():
    cl = with_knobs(_base(), {"skew_wait_us": 2000.0, "intra_latency_us": 100.0}).with_gpus(4)
    idle = cl.model_copy(update={"skew_wait_us": 0.0})
    for size in (2, 4):  # per collective (x the descheduled fraction 0.5), whatever its hops
        grp = comm.group_of(cl, size, 1)
        assert comm.all_reduce(cl, grp, 1.0) - comm.all_reduce(idle, grp, 1.0) == pytest.approx(1e-3, rel=1e-6)
    c = CollectiveSample(collective="all_reduce", level="intra", ranks=4, processes_per_node=4, nbytes=4096,
                         seconds=1.0)
    assert predict_collective(cl, c) == pytest.approx(predict_collective(idle, c))  # micro-benchmarks: none
    gpu = cluster_preset("dgx-h100").model_copy(update={"skew_wait_us": 2000.0})
    assert comm.skew_wait(gpu) == 0.0


def test_refit_cluster_yaml_loads_with_its_header(tmp_path):
    truth = with_knobs(_base(), TRUTH)
    path = tmp_path / "refit.yaml"
    path.write_text(cluster_yaml(truth, ["refit by a test", "residuals: none"]))
    text = path.read_text()
    assert text.startswith("# refit by a test\n# residuals: none\n")
    loaded = load_cluster(str(path))
    assert loaded == truth
    assert load_cluster(str(path), gpus=2).descheduled_fraction == 0.0


def test_profile_record_parser_on_a_hand_written_record(tmp_path):
    from autoplan.tune.records import parse_profile_record, read_run_log

    counts = lambda f, b, t=None: {  # noqa: E731
        "flops": {"forward": f, "backward": 2 * f, "recompute": 0},
        "comm": [{"collective": "all_reduce", "mesh_dim": "dp", "count": 3, "bytes": b}],
        "memory_bytes": {"parameters": 1000, "activations": 5000}, **({"time_s": t} if t else {})}
    rec = {"event": "profile", "step": 2, "ranks": [
        {"rank": 0, "pp_stage": 0, "measured": counts(1e6, 4096, {"compute": 0.02, "dp_comm": 0.01}),
         "predicted": counts(1e6, 4096)},
        {"rank": 1, "pp_stage": 0, "measured": counts(1.1e6, 4096, {"compute": 0.03}),
         "predicted": counts(1e6, 4096)}]}
    p = parse_profile_record(rec)
    assert p.step == 2 and len(p.ranks) == 2 and p.ranks[0].measured.comm[0].count == 3
    assert p.time_components() == {"compute": 0.03, "dp_comm": 0.01}  # the slowest rank's
    mism = p.count_mismatches()
    assert len(mism) == 2 and all(m.startswith("rank 1 flops.") for m in mism), mism
    log = tmp_path / "log.jsonl"
    steps = [{"step": i, "loss": 4.0 - i, "step_time_s": t, "predicted_step_time_s": 0.01}
             for i, t in enumerate([0.5, 0.1, 0.12, 0.11, 0.9], start=1)]
    rec["step"] = 5  # the profiled step is slow and left out of the median
    log.write_text("\n".join(json.dumps(o) for o in [*steps[:2], rec, *steps[2:], {"event": "other"}]) + "\n")
    rl = read_run_log(log)
    assert rl.measured_step_s() == pytest.approx(0.11)
    assert rl.profile is not None and rl.profile.step == 5 and rl.final_loss == -1.0
    from autoplan.cost_models.errors import SpecError

    with pytest.raises(SpecError, match="ranks"):
        parse_profile_record({"event": "profile", "step": 1})


def _block_fwd(cluster, kernel_launch_us: float) -> float:
    from autoplan.cost_models.compute import layer_cost
    from autoplan.cost_models.estimate import context
    from autoplan.cost_models.profile import profile_from_spec

    cl = with_knobs(cluster, {"kernel_launch_us": kernel_launch_us})
    tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    cfg = check_config(ParallelConfig.parse("dp=4"), MODEL_PRESETS["tiny-gpt"], cl, tr)
    return layer_cost(profile_from_spec(MODEL_PRESETS["tiny-gpt"])[1], context(cl, tr, cfg)).fwd_s


def test_cpu_processes_pay_host_time_and_kernels_one_after_the_other():
    """On an accelerator the host issues kernels ahead of the device: a layer takes the longer of the two. A CPU
    process (the cluster's cores are given) runs each operator in the thread that issues it: the sum."""
    gpu_like = cluster_preset("local-cpu").with_gpus(4)
    cpu = gpu_like.model_copy(update={"cores_per_node": 2})
    device = _block_fwd(gpu_like, 1e-2)  # host time negligible: the device's
    host = _block_fwd(gpu_like, 1e4)  # host-bound: the host's (the max)
    assert host > 10 * device
    assert _block_fwd(cpu, 1e4) == pytest.approx(host + device, rel=1e-3)
    assert _block_fwd(cpu, 1e-2) == pytest.approx(device, rel=1e-2)


def test_a_gemm_benchmarked_alone_ran_on_a_whole_core():
    """calibrate's GEMMs run in one process; in a run 4 processes share 2 cores, and the cost model's rates are
    a run's. So the benchmark took half the time a run's GEMM takes; on accelerators (cores not given) nothing
    changes."""
    cpu = cluster_preset("local-cpu").with_gpus(4).model_copy(update={"cores_per_node": 2})
    g = GemmSample(m=256, n=256, k=256, seconds=1.0)
    in_run = predict_gemm(cpu, g.model_copy(update={"processes": 4}))
    assert predict_gemm(cpu, g) == pytest.approx(in_run / 2)
    gpu = cluster_preset("dgx-h100")
    assert predict_gemm(gpu, g) == predict_gemm(gpu, g.model_copy(update={"processes": 4}))


def test_fsdp_hooks_under_the_pipeline_schedule_are_paid_once_per_step():
    """torch.distributed.pipelining turns reshard-after-backward and gradient sync off for every backward but the
    last, so FSDP's hooks do their work once per step there; without a pipeline, once per micro-batch. At ZeRO-0
    the runtime runs `replicate` (FSDP2's hooks) only under tp > 1; a pipelined stage without tp is torch's DDP,
    which has no hooks (runtime.parallelize.apply_dp)."""
    from autoplan.cost_models.estimate import fsdp_unit_time

    cl = with_knobs(_base(), {"fsdp_hook_us": 1000.0, "fsdp_collective_overhead_us": 1e-2})
    tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")

    def hooks(pp: int, tp: int, m: int) -> float:
        return fsdp_unit_time(3, 1e5, dp=2, cp=1, tp=tp, pp=pp, zero=0, m=m, cluster=cl, training=tr)

    assert hooks(2, 2, 4) == pytest.approx(hooks(2, 2, 1))
    assert hooks(2, 2, 1) == pytest.approx(3e-3, rel=1e-3)
    assert hooks(1, 2, 4) == pytest.approx(4 * hooks(1, 2, 1), rel=1e-3)
    assert hooks(2, 1, 4) == hooks(1, 1, 4) == 0.0


def test_torch_ddp_waits_are_in_the_measured_compute():
    """torch's DDP waits for its gradient all-reduces from C++ inside backward (under a pipeline, the last
    micro-batch's): the step timer books them as compute, so the fit compares that row with compute + dp_comm.
    FSDP (ZeRO>=1) and replicate (tp > 1) wait in Python, inside FSDP's regions: dp_comm stays its own row."""
    bd = {"compute": 0.03, "dp_comm": 0.01}
    for ddp in ("dp=4", "pp=2,dp=2", "pp=2,cp=2"):
        assert predicted_component(bd, "compute", ParallelConfig.parse(ddp)) == pytest.approx(0.04), ddp
    for other in ("dp=4,zero=1", "tp=2,dp=2", "pp=2,tp=2,dp=2", "pp=2,dp=2,zero=1", "tp=4"):
        assert predicted_component(bd, "compute", ParallelConfig.parse(other)) == pytest.approx(0.03), other


def test_fit_recovers_the_checkpoint_region_cost():
    """The checkpoint's host time (recompute_region_us per region, recompute_op_us per operator in it): from the
    micro-benchmarks alone, and from runs that recompute (selective: one core of 1 op; full: a block of 12) when
    no benchmark was taken; a run set without recompute leaves the knobs out."""
    truth = with_knobs(_base(), TRUTH)
    keys = ["recompute_region_us", "recompute_op_us"]
    start = with_knobs(truth, {"recompute_region_us": 120.0, "recompute_op_us": 90.0})
    bench = fit_cluster(start, regions=_regions(truth), free=keys)
    for k in keys:
        assert bench.after[k] == pytest.approx(TRUTH[k], rel=0.01), (k, bench.after[k])
    model = MODEL_PRESETS["tiny-gpt"]
    runs = []
    for c in ("dp=4", "dp=4,recompute=selective", "dp=4,recompute=full", "dp=2,pp=2,recompute=full"):
        tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
        cfg = check_config(ParallelConfig.parse(c), model, truth.with_gpus(4), tr)
        r = RunSample(model=model, training=tr, parallel=cfg, world=4, measured_step_s=1.0, label=c)
        runs.append(r.model_copy(update={"measured_step_s": predict_run(truth, r).step_time_s}))
    res = fit_cluster(start, runs, free=["kernel_launch_us", *keys])
    assert not res.held, res.held
    for k in keys:
        assert res.after[k] == pytest.approx(TRUTH[k], rel=0.01), (k, res.after[k])
    from autoplan.cost_models.fit import default_free_knobs

    assert set(keys) <= set(default_free_knobs(start, runs))
    assert not set(keys) & set(default_free_knobs(start, runs[:1]))
    assert set(keys) <= set(default_free_knobs(start, runs[:1], regions=_regions(truth)))


def test_gloo_all_to_all_pays_one_latency_not_one_per_peer():
    """Gloo posts every send and receive of an all-to-all at once (measured here, 4 ranks: 0.6-1.5 ms against
    all_gather's three ring steps, 2.5-3.7 ms); NCCL's grouped point-to-point is priced per peer as before."""
    cl = with_knobs(_base(), {"oversubscription_wait_us": 0.0, "intra_latency_us": 100.0}).with_gpus(4)
    grp = comm.group_of(cl, 4, 1)
    bw = 3 / 4 * 1.0 / (cl.intra_node.bandwidth_gbps * 1e9 * cl.intra_node.efficiency)
    assert comm.all_to_all(cl, grp, 1.0) == pytest.approx(bw + 100e-6, rel=1e-9)
    nccl = cl.model_copy(update={"backend": "nccl", "cores_per_node": None})
    assert comm.all_to_all(nccl, grp, 1.0) == pytest.approx(bw + 3 * 100e-6, rel=1e-9)


def test_scalar_all_reduce_costs_two_latencies_on_gloo():
    """Gloo's ring sends only its non-empty segments: a scalar is reduced and returned in two messages whatever
    the ranks (measured: 0.42-0.59 ms at 4 ranks on this 2-core machine, 5-7 ms for 16 elements)."""
    cl = with_knobs(_base(), {"oversubscription_wait_us": 1000.0, "intra_latency_us": 100.0}).with_gpus(4)
    assert comm.scalar_all_reduce(cl, comm.group_of(cl, 4, 1)) == pytest.approx(200e-6, rel=1e-12)
    assert comm.scalar_all_reduce(cl, comm.group_of(cl, 1, 1)) == 0.0
    nccl = cluster_preset("dgx-h100")
    grp = comm.group_of(nccl, 8, 1)
    assert comm.scalar_all_reduce(nccl, grp) == pytest.approx(comm.all_reduce(nccl, grp, 8.0), rel=1e-12)


@pytest.mark.parametrize("cfg,groups", [
    ("dp=4", 1),               # DDP: plain gradients, only the loss over every rank
    ("dp=4,zero=1", 2),        # FSDP's shards: the norm over dp, then the loss
    ("pp=2,dp=2", 2),          # stages: the norm over pp
    ("tp=2,dp=2", 2),          # tensor-parallel shards: the norm over tp
    ("tp=2,pp=2", 3),          # the norm over tp, then over pp, then the loss
    ("tp=2,dp=2,zero=1", 4),   # FSDP2 + TP: sharded weights over dp and tp, the norms' over dp, then the loss
    ("dp=4,ep=4", 2),          # the experts' squares over ep (every rank of an ep group), then the loss
])
def test_step_scalars_are_the_reductions_the_runtime_issues(cfg, groups):
    """runtime.engine.Trainer: grad_norm sums squares over every mesh dimension that shards a gradient, then
    pp; _reduce_loss makes one all-reduce over every rank. Counted in units of one scalar all-reduce (gloo: the
    same price for every group size)."""
    from autoplan.cost_models.estimate import step_scalars_time

    cl = with_knobs(_base(), {"intra_latency_us": 100.0}).with_gpus(4)
    c = ParallelConfig.parse(cfg)
    t = step_scalars_time(tp=c.tp, cp=c.cp, dp=c.dp or 1, pp=c.pp, ep=c.ep, zero=c.zero, cluster=cl)
    assert t == pytest.approx(groups * 200e-6, rel=1e-12)


@pytest.mark.parametrize("cfg", ["dp=4", "dp=4,zero=1", "dp=4,zero=3", "pp=2,dp=2", "tp=2,dp=2", "tp=2,dp=2,zero=1",
                                 "tp=2,pp=2", "tp=4", "pp=4", "cp=2,dp=2,zero=2", "dp=4,ep=4", "dp=4,ep=2,zero=2",
                                 "tp=2,dp=2,ep=2", "pp=2,dp=2,ep=2"])
def test_step_scalars_priced_are_the_ones_counted(cfg):
    """The time and the counts of the step's scalar all-reduces come from one list: as many priced as counted
    (they differed under FSDP2 + TP and at ep > 1 when each kept its own)."""
    from autoplan.cost_models.counts import _Comm, scalar_comm
    from autoplan.cost_models.estimate import step_scalars_time

    cl = with_knobs(_base(), {"intra_latency_us": 100.0}).with_gpus(4)
    c = ParallelConfig.parse(cfg).resolve(4)
    comm = _Comm()
    scalar_comm(c, comm)
    counted = sum(n for (kind, _), (n, _) in comm.d.items() if kind == "all_reduce")
    t = step_scalars_time(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp, ep=c.ep, zero=c.zero, cluster=cl)
    assert counted >= 1 and t == pytest.approx(counted * 200e-6, rel=1e-12)


def test_a_knob_that_ends_on_a_bound_is_flagged_not_reported_as_measured():
    """A fitted value on a knob's physical bound is where the data pushed it, not a measurement: the fit says so
    in the refit file's header and tune's table."""
    truth = with_knobs(_base(), TRUTH)
    runs, gemms, colls = _synthetic(truth)
    res = fit_cluster(truth, runs, gemms, colls, free=["kernel_launch_us", "intra_latency_us"])
    assert res.at_bounds == {}
    lo = KNOBS["kernel_launch_us"].lower
    pinned = replace(res, after={**res.after, "kernel_launch_us": lo})
    assert pinned.at_bounds == {"kernel_launch_us": "lower"}
    assert "at its lower bound" in pinned.knob_note("kernel_launch_us")
    assert any("kernel_launch_us" in line and "lower bound" in line for line in pinned.summary_lines())
    held = replace(pinned, held=["kernel_launch_us"])
    assert held.at_bounds == {} and "held at its start" in held.knob_note("kernel_launch_us")


def test_cpu_fraction_from_timing_records():
    from autoplan.tune.records import RunLog, TimingRank, TimingRecord

    def rec(step, cpus):
        return TimingRecord(event="timing", step=step, ranks=[
            TimingRank(rank=r, step_s=0.1, cpu_s=c, time_s={"forward": 0.05}) for r, c in enumerate(cpus)])

    # step 1 (warm-up) left out; per rank the median over steps 2-4, then the mean over ranks
    log = RunLog(timings=[rec(1, [0.9, 0.9]), rec(2, [0.05, 0.08]), rec(3, [0.06, 0.08]), rec(4, [0.07, 0.2])])
    assert log.cpu_fraction() == pytest.approx((0.6 + 0.8) / 2)
    old = RunLog(timings=[TimingRecord(event="timing", step=2, ranks=[TimingRank(rank=0, step_s=0.1)])])
    assert old.cpu_fraction() is None  # a log written before cpu_s was recorded


def test_a_host_op_benchmark_pins_kernel_launch_us():
    """The host time per operator measured by calibrate (one process) is a row of the fit against
    kernel_launch_us at a run's share of the cores: alone it recovers the constant, and it keeps a fit on runs
    from trading it for the compute rates (session 18: a live tune ended at its 0.01 us bound without it)."""
    from autoplan.cost_models.fit import HostOpSample, predict_host_op

    truth = with_knobs(_base(), {"kernel_launch_us": 14.0}).with_gpus(4)  # 4 processes on 2 cores
    one = HostOpSample(seconds=1.0)
    assert predict_host_op(truth, one) == pytest.approx(7e-6)  # alone in a process it had a whole core
    sample = HostOpSample(seconds=predict_host_op(truth, one))
    start = with_knobs(truth, {"kernel_launch_us": 40.0})
    res = fit_cluster(start, host_ops=[sample], free=["kernel_launch_us"])
    assert res.after["kernel_launch_us"] == pytest.approx(14.0, rel=0.01)
    assert [r["kind"] for r in res.rows] == ["host"]


def test_a_pipeline_action_benchmark_pins_pipeline_action_us():
    """calibrate's pipeline benchmark (two processes, calibrate_bench.bench_pipeline_actions) is a row against
    pipeline_action_us at a run's share of the cores, which frees the knob without a pipelined run; the row of
    the other knob leaves it alone."""
    from autoplan.cost_models.fit import HostOpSample, default_free_knobs, predict_host_op

    truth = with_knobs(_base(), {"pipeline_action_us": 200.0, "kernel_launch_us": 14.0}).with_gpus(4)
    two = HostOpSample(seconds=1.0, processes=2, knob="pipeline_action_us")
    assert predict_host_op(truth, two) == pytest.approx(100e-6)  # each of the two processes had a core
    sample = two.model_copy(update={"seconds": predict_host_op(truth, two)})
    assert "pipeline_action_us" in default_free_knobs(truth, [], host_ops=[sample])
    assert "pipeline_action_us" not in default_free_knobs(truth, [], host_ops=[HostOpSample(seconds=7e-6)])
    start = with_knobs(truth, {"pipeline_action_us": 50.0})
    res = fit_cluster(start, host_ops=[sample], free=["pipeline_action_us"])
    assert res.after["pipeline_action_us"] == pytest.approx(200.0, rel=0.01)
    assert res.rows[0]["label"] == "host time per pipeline action, 2 process(es)"


def test_load_bench_reads_the_host_op_rows(tmp_path):
    import json as _json

    from autoplan.cost_models.errors import SpecError
    from autoplan.tune.core import load_bench

    path = tmp_path / "bench.json"
    path.write_text(_json.dumps({"gemm": [], "collectives": [], "host_op": [{"seconds": 6e-6, "processes": 1}]}))
    gemms, colls, regions, host_ops = load_bench(path)
    assert (gemms, colls, regions) == ([], [], []) and host_ops[0].seconds == 6e-6
    path.write_text(_json.dumps({"host_op": [{"seconds": -1}]}))
    with pytest.raises(SpecError, match="malformed micro-benchmark file"):
        load_bench(path)


def test_load_bench_refuses_a_file_measured_on_another_kind_of_device(tmp_path):
    """A GPU's micro-benchmarks fitted into a CPU cluster set its GEMM rate to the fit's bound (session 23); the
    file says where it was measured, and tune refuses it for a cluster of the other backend before any run."""
    import json as _json

    from autoplan.cost_models.errors import SpecError
    from autoplan.tune.core import load_bench

    path = tmp_path / "bench.json"
    rows = {"gemm": [], "host_op": [{"seconds": 4e-5, "processes": 1}]}
    path.write_text(_json.dumps({"device": "cuda", **rows}))
    assert load_bench(path, "nccl")[3][0].seconds == 4e-5
    with pytest.raises(SpecError, match="measured on 'cuda'") as err:
        load_bench(path, "gloo")
    assert "calibrate --bench-out" in str(err.value)
    path.write_text(_json.dumps({"device": "cpu", **rows}))
    assert load_bench(path, "gloo")[3][0].seconds == 4e-5
    with pytest.raises(SpecError, match="measured on 'cpu'"):
        load_bench(path, "nccl")
    # another GPU family than the cluster's (torch's device name against the preset's), where both say one
    path.write_text(_json.dumps({"device": "cuda", "device_name": "NVIDIA H200", **rows}))
    assert load_bench(path, "nccl", "h200")[3][0].seconds == 4e-5
    assert load_bench(path, "nccl", "my-own-gpu")[3][0].seconds == 4e-5  # no family to compare: taken
    with pytest.raises(SpecError, match="measured on a NVIDIA H200") as err:
        load_bench(path, "nccl", "h100-sxm")
    assert "h100-sxm" in str(err.value)


def test_one_disturbed_measurement_does_not_set_the_constants():
    """The fit's loss is robust (soft L1 beyond a 10% log-ratio, fit.ROBUST_SCALE): of five all-reduce timings
    that an alpha-beta model explains exactly, one taken 1.5x slow (a disturbed launch on a shared host) leaves
    latency and bandwidth within 5% of the truth."""
    truth = with_knobs(_base(), {"intra_latency_us": 100.0, "intra_bandwidth_gbps": 2.0}).with_gpus(2)

    def sample(nbytes, scale=1.0):
        probe = CollectiveSample(collective="all_reduce", level="intra", ranks=2, processes_per_node=2,
                                 nbytes=nbytes, seconds=1.0)
        return probe.model_copy(update={"seconds": scale * predict_collective(truth, probe)})

    sizes = [4096, 65536, 1 << 20, 8 << 20, 32 << 20]
    samples = [sample(n, 1.5 if n == 1 << 20 else 1.0) for n in sizes]
    start = with_knobs(truth, {"intra_latency_us": 300.0, "intra_bandwidth_gbps": 0.5})
    res = fit_cluster(start, collectives=samples, free=["intra_latency_us", "intra_bandwidth_gbps"])
    assert res.after["intra_latency_us"] == pytest.approx(100.0, rel=0.05)
    assert res.after["intra_bandwidth_gbps"] == pytest.approx(2.0, rel=0.05)


def test_a_refit_peak_far_past_the_start_is_said_to_be_no_measurement():
    """A GEMM or attention efficiency fitted above 1 is a raised peak (`with_knobs`); past 1.5x tune says that the
    runs did not measure it and what pins it (session 26: a 4-layer Llama on 4 CPU processes refit
    matmul_max_efficiency 1 -> 18.3 with matmul_half_dim 19 -> 2500, and MFU then read 0.4%)."""
    from autoplan.cost_models.fit import FitResult
    from autoplan.tune.core import peak_raise_note

    base = load_cluster("local-cpu")

    def fit(mme: float, att: float) -> FitResult:
        after = {"matmul_max_efficiency": mme, "attention_efficiency": att, "matmul_half_dim": 2500.0}
        return FitResult(cluster=with_knobs(base, after), before={k: 1.0 for k in after}, after=after,
                         free=list(after), undetermined=[], collinear=[["matmul_max_efficiency", "matmul_half_dim"]])

    assert fit(0.9, 0.4).peak_raise == 1.0 and peak_raise_note(fit(0.9, 0.4), base, "fp32", False) is None
    assert peak_raise_note(fit(1.4, 0.4), base, "fp32", False) is None  # within launch noise of the start
    f = fit(18.28, 0.4)
    assert f.peak_raise == pytest.approx(18.28)
    # the refit spec's own peak is what the note names
    assert f.cluster.gpu.peak_flops("fp32") == pytest.approx(18.28 * base.gpu.peak_flops("fp32"))
    start = base.gpu.peak_flops("fp32") / 1e12
    note = peak_raise_note(f, base, "fp32", False)
    assert note.startswith(f"the refit raises the fp32 peak 18.3x ({start:g} -> {start * 18.28:.3g} TF/s)")
    assert "tune with --bench bench.json" in note
    assert "did not pin it" in peak_raise_note(fit(1.0, 3.0), base, "fp32", True)  # attention counts too
