"""Scale terms added for issue 15's held-out runs (session 5): what pipeline messages cost the ranks at either
end (blocking vs asynchronous p2p, interleaving), the receiver's all-gather after a scatter/gather message, and
the stack facts behind them. Each test checks the direction the physics says, not a fitted number."""

from __future__ import annotations

import pytest

from autoplan.cost_models import comm
from autoplan.cost_models.estimate import estimate, p2p_occupancy, pipeline_p2p_time
from autoplan.cost_models.profile import profile_from_spec
from autoplan.cost_models.specs import check_config
from autoplan.cost_models.stacks import apply_stack, get_stack
from autoplan.specs import ParallelConfig, TrainingSpec, load_cluster, load_model

A100 = load_cluster("dgx-a100-80g", gpus=512)


def _train(**kw) -> TrainingSpec:
    """Megatron-style mixed precision (16-bit weights, fp32 master) unless a test asks for autoplan's autocast."""
    kw.setdefault("autocast_fp32_params", False)
    return TrainingSpec(global_batch_size=kw.pop("batch", 64), seq_length=2048, **kw)


def test_no_messages_no_cost():
    t = _train(p2p_overlap=False)
    assert p2p_occupancy(0, 1, 1e-3, A100, t) == (0.0, 0.0)  # one stage: nothing to send
    assert p2p_occupancy(3, 8, 0.0, A100, t) == (0.0, 0.0)
    assert pipeline_p2p_time(A100, t, hidden=8192, pp=1, tp=8, cp=1, dp=8, mbs=1) == 0.0


def test_blocking_p2p_puts_each_received_message_on_the_receivers_path():
    t, p = _train(p2p_overlap=False), 2e-3
    assert p2p_occupancy(0, 4, p, A100, t) == (0.0, p)  # first stage: receives only gradients
    assert p2p_occupancy(3, 4, p, A100, t) == (p, 0.0)  # last stage: receives only activations
    assert p2p_occupancy(1, 4, p, A100, t) == (p, p)


def test_async_p2p_costs_only_interference_on_both_ends():
    t, p = _train(p2p_overlap=True), 2e-3
    k = A100.gpu.calibration.overlap_interference
    f, b = p2p_occupancy(1, 4, p, A100, t)
    assert f == pytest.approx(2 * k * p) and b == pytest.approx(2 * k * p)  # one message in, one out
    assert f + b < sum(p2p_occupancy(1, 4, p, A100, _train(p2p_overlap=False)))  # k < 1/2: cheaper than blocking


def test_interference_counts_the_bytes_not_the_latency():
    """Asynchronous messages slow the compute beside them only while they move bytes: a latency-bound message
    (gloo's millisecond hops) costs no compute, a bandwidth-bound one costs overlap_interference of it."""
    t = _train(p2p_overlap=True)
    k = A100.gpu.calibration.overlap_interference
    assert p2p_occupancy(1, 4, 1e-3, A100, t, busy_s=0.0) == (0.0, 0.0)
    assert p2p_occupancy(1, 4, 1e-3, A100, t, busy_s=4e-4)[0] == pytest.approx(2 * k * 4e-4)
    from autoplan.cost_models.estimate import pipeline_p2p_parts

    total, busy = pipeline_p2p_parts(A100, t, hidden=20480, pp=35, tp=8, cp=1, dp=8, mbs=1, sp=True)
    assert 0 < busy < total and total - busy == pytest.approx(comm.hop_latency(A100, A100.inter_node))


def test_messages_per_rank_grow_with_interleaving():
    """A rank holding vp virtual stages sends and receives at every one of them: its message time per
    micro-batch grows with vp (issue 15: interleaving's interaction with communication)."""
    t, p, pp = _train(p2p_overlap=False), 1e-3, 4

    def rank1(vp):
        n = pp * vp
        return sum(sum(p2p_occupancy(s, n, p, A100, t)) for s in range(1, n, pp))

    assert rank1(1) < rank1(2) < rank1(4)
    assert rank1(4) == pytest.approx(4 * rank1(1))


def test_scatter_gather_message_is_smaller_but_the_receiver_gathers_it():
    kw = dict(hidden=20480, pp=35, tp=8, cp=1, dp=8, mbs=1)
    whole = pipeline_p2p_time(A100, _train(p2p_scatter_gather=False), **kw)
    split = pipeline_p2p_time(A100, _train(p2p_scatter_gather=True), **kw)
    split_sp = pipeline_p2p_time(A100, _train(p2p_scatter_gather=True), sp=True, **kw)
    full = 2048 * 20480 * 2
    gather = comm.all_gather(A100, comm.group_of(A100, 8, 1), full)
    assert split_sp < split < whole
    assert split - split_sp == pytest.approx(gather)  # the NVLink all-gather of SC21 sec. 4.1
    assert split_sp == pytest.approx(comm.p2p(A100, full / 8, True))
    # without scatter/gather the whole hidden states cross, nothing gathered; under SP every runtime sends the
    # rank's sequence shard, whatever the knob says
    assert whole == pytest.approx(comm.p2p(A100, full, True))
    assert pipeline_p2p_time(A100, _train(p2p_scatter_gather=False), sp=True, **kw) == pytest.approx(split_sp)


def test_autoplans_pipeline_messages_are_what_its_runtime_sends():
    """torch.distributed.pipelining sends each tp rank's stage output as it holds it: without SP the whole hidden
    states, rank to rank, and the receiver gathers nothing -- the bytes cost_models.counts.boundary_bytes counts
    (and benchmarks/counts.py measures). Until session 21 the estimate priced Megatron's scatter/gather for it: a
    tp-split message plus an all-gather on arrival, ~1.2 of the 2.4 ms a tp=2,pp=2 message took on local-cpu."""
    from autoplan.cost_models.counts import boundary_bytes
    from autoplan.cost_models.estimate import context, pipeline_p2p_parts

    model = load_model("tiny-gpt")
    cpu = load_cluster("local-cpu", gpus=4)
    for stack in ("autoplan", "torchtitan"):
        assert get_stack(stack).knobs["p2p_scatter_gather"] is False
    assert TrainingSpec.model_fields["p2p_scatter_gather"].default is False  # no stack named: autoplan's runtime
    for sp in (False, True):
        t = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32")
        cfg = check_config(ParallelConfig.parse(f"tp=2,pp=2,mbs=1,sp={int(sp)}"), model, cpu, t)
        profiles = profile_from_spec(model)
        ctx = context(cpu, t, cfg)
        sent = boundary_bytes(profiles, ctx, cfg, t, ctx.residual_bytes)
        _, busy = pipeline_p2p_parts(cpu, t, hidden=model.hidden_size, pp=2, tp=2, cp=1, dp=1, mbs=1, sp=sp)
        assert busy == pytest.approx(comm.transfer_time(cpu.intra_node, sent))


def _est(stack_set: dict, cfg: str):
    model = load_model("sc21-145.6b")
    c = load_cluster("dgx-a100-80g", gpus=1536)
    t = apply_stack(_train(batch=2304), "megatron-2021", stack_set)
    cfg = check_config(ParallelConfig.parse(cfg), model, c, t)
    return estimate(profile_from_spec(model), c, t, cfg)


def test_blocking_p2p_lengthens_a_pipelined_step_and_shows_as_pp_comm():
    cfg = "tp=8,pp=8,vp=2,mbs=2,recompute=full,schedule=interleaved"
    blocking, overlapped = _est({"p2p_overlap": False}, cfg), _est({"p2p_overlap": True}, cfg)
    assert blocking.step_time_s > overlapped.step_time_s
    assert blocking.breakdown["pp_comm"] > overlapped.breakdown["pp_comm"]
    assert sum(blocking.breakdown.values()) == pytest.approx(blocking.step_time_s)
    # without a pipeline the knob changes nothing
    flat = "tp=8,pp=1,mbs=2,recompute=full"
    assert _est({"p2p_overlap": False}, flat).step_time_s == _est({"p2p_overlap": True}, flat).step_time_s


def test_stack_p2p_facts():
    # DeepSpeed's PipelineEngine partitions stage-to-stage tensors over tp (is_pipe_partitioned) and blocks
    ds = get_stack("megatron-deepspeed").knobs
    assert ds["p2p_scatter_gather"] is True and ds["p2p_overlap"] is False
    for name in ("megatron-2021", "megatron-2022"):
        assert get_stack(name).knobs["p2p_overlap"] is False
    assert get_stack("megatron-core").knobs["p2p_overlap"] is None  # overlapped under interleaving only
    for name in ("autoplan", "torchtitan"):  # torch.distributed.pipelining: isend/irecv
        assert get_stack(name).knobs["p2p_overlap"] is True


def test_deepspeed_train_schedule_replay_matches_1f1b_without_messages():
    """benchmarks/ds_train_schedule.py replays DeepSpeed's TrainSchedule with blocking paired sends; without
    message time it is exactly 1F1B, and messages only add their own time (no lock-step): the evidence that
    MT-NLG's missing per-step time is not its pipeline schedule."""
    from autoplan.cost_models.pipeline import simulate
    from benchmarks.ds_train_schedule import makespan

    for pp, m in ((4, 8), (5, 12)):
        assert makespan(m, pp, 1.0, 2.0, 0.0) == pytest.approx(simulate("1f1b", pp, m, 1, [1.0] * pp, [2.0] * pp).makespan)
    slow = makespan(16, 4, 1.0, 3.0, 0.05)
    assert (16 + 3) * 4.0 < slow < (16 + 3) * 4.0 * 1.1


def test_bf16_optimizer_all_reduces_whole_gradients_then_gathers():
    """DeepSpeed's BF16_Optimizer under the pipeline engine all-reduces the whole fp32 gradient (not a
    reduce-scatter), steps its shard, then all-gathers the 16-bit parameters (session 7)."""
    from autoplan.cost_models.estimate import dp_sync

    kw = dict(dp=8, cp=1, tp=4, ep=1, cluster=A100)
    rs = _train(grad_reduce_dtype="fp32")
    ar = _train(grad_reduce_dtype="fp32", grad_sync_all_reduce=True)
    red_rs, gather_rs, _ = dp_sync(3e9, 0.0, zero=1, training=rs, **kw)
    red_ar, gather_ar, _ = dp_sync(3e9, 0.0, zero=1, training=ar, **kw)
    grp = comm.group_of(A100, 8, 4)
    assert red_ar == pytest.approx(comm.all_reduce(A100, grp, 3e9 * 4))
    assert red_ar > 1.8 * red_rs  # an all-reduce moves twice a reduce-scatter's bytes
    assert gather_ar == gather_rs > 0  # the parameter all-gather after the sharded step is the same
    # ZeRO-0 is an all-reduce either way, ZeRO-3 is not this path: the knob changes neither
    assert dp_sync(3e9, 0.0, zero=0, training=ar, **kw) == dp_sync(3e9, 0.0, zero=0, training=rs, **kw)
    assert dp_sync(3e9, 0.0, zero=3, training=ar, **kw) == dp_sync(3e9, 0.0, zero=3, training=rs, **kw)
    ds = get_stack("megatron-deepspeed").knobs
    assert ds["grad_sync_all_reduce"] is True and ds["grad_reduce_dtype"] == "fp32"
    assert all(get_stack(n).knobs["grad_sync_all_reduce"] is False
               for n in ("autoplan", "megatron-2021", "megatron-2022", "megatron-core", "torchtitan"))


@pytest.mark.parametrize("sp", [False, True])
def test_async_tp_backward_hides_the_one_collective_of_a_pair_without_sp(sp):
    """Megatron 2022's async TP backward (tp_bwd_comm_overlap): without sp a linear pair's only backward
    collective (the column-parallel input-gradient all-reduce) runs beside the wgrad GEMM, so only its
    interference is left; with sp the all-gather of the row-parallel output's backward stays exposed, half the
    pair's traffic (session 7)."""
    from autoplan.cost_models.compute import Context, layer_cost

    model = load_model("gpt3-13b")
    block = profile_from_spec(model)[1]
    k = A100.gpu.calibration.overlap_interference

    def bwd_comm(overlap: bool) -> float:
        t = _train(batch=4, tp_bwd_comm_overlap=overlap)
        return layer_cost(block, Context(A100, t, tp=8, cp=1, sp=sp, ep=1, mbs=4)).comm_bwd_s

    full, hidden = bwd_comm(False), bwd_comm(True)
    assert full > 0
    if sp:
        assert hidden == pytest.approx(full / 2 + k * full / 2)
    else:
        assert hidden == pytest.approx(k * full)


def test_fp8_plans_gather_the_fp8_gemm_inputs_in_one_byte():
    """Under fp8 with sp a block's two all-gathers carry the inputs of fp8 GEMMs (the norm's output forward, the
    row-parallel output's gradient backward), cast before the gather (Transformer Engine, torchao's float8 TP):
    1 byte an element; the reduce-scatters sum 16-bit outputs and gradients: 2 bytes, as in a bf16 plan."""
    from autoplan.cost_models.compute import FP8_GATHER_BYTES, Context, tp_units

    block = profile_from_spec(load_model("gpt3-13b"))[1]
    h100 = load_cluster("dgx-h100", gpus=64)

    def units(dtype: str):
        t = _train(batch=4, dtype=dtype)
        return tp_units(block, Context(h100, t, tp=8, cp=1, sp=True, ep=1, mbs=4))

    unit = 4 * 2048 * block.hidden
    (f8, b8), (f16, b16) = units("fp8"), units("bf16")
    assert FP8_GATHER_BYTES == 1
    assert f8 == {"all_gather": unit, "reduce_scatter": 2 * unit} and b8 == {"reduce_scatter": 2 * unit,
                                                                          "all_gather": unit}
    assert f16 == {"all_gather": 2 * unit, "reduce_scatter": 2 * unit} and b16 == dict(f16)


def test_megatron_core_without_userbuffers_still_overlaps_the_backward_reduce_scatter():
    """Transformer Engine's linears reduce-scatter their input gradient asynchronously beside the wgrad GEMM
    (`tp_bwd_comm_overlap`), with or without userbuffers: `--stack megatron-core --stack-set tp_comm_overlap=false`
    leaves the backward's all-gathers exposed (under fp8, at 1 byte) and only the interference of the rest."""
    from autoplan.cost_models.compute import Context, layer_cost, tp_units

    h100 = load_cluster("dgx-h100", gpus=64)
    assert get_stack("megatron-core").knobs["tp_bwd_comm_overlap"] is True
    block = profile_from_spec(load_model("gpt3-13b"))[1]
    base = _train(batch=4, dtype="fp8")

    def bwd(**knobs) -> tuple[float, Context]:
        t = apply_stack(base, "megatron-core", {"tp_comm_overlap": False, **knobs}, keep=("dtype",))
        # tp=2: the wgrad GEMMs (h/tp wide) are long enough to hide the reduce-scatters whole
        ctx = Context(h100, t, tp=2, cp=1, sp=True, ep=1, mbs=4)
        return layer_cost(block, ctx).comm_bwd_s, ctx

    (hidden, ctx), (exposed, _) = bwd(), bwd(tp_bwd_comm_overlap=False)
    grp = comm.group_of(h100, 2, 1)
    gather = comm.all_gather(h100, grp, tp_units(block, ctx)[1]["all_gather"])
    k = h100.gpu.calibration.overlap_interference
    assert exposed > hidden > gather
    assert hidden == pytest.approx(2 * gather + k * (exposed - 2 * gather))  # 2 reduction points a block


def test_unfused_gradient_accumulation_pass_is_in_the_buffer_dtype():
    """Without fused wgrad accumulation each micro-batch's 16-bit gradients are added into the accumulation
    buffer, which is in the reduction dtype: 2 + 2*4 bytes per parameter in fp32 (Megatron with bf16, DeepSpeed's
    bf16 optimizer), 2 + 2*2 in fp16 (Megatron v2 with fp16, whose buffer is the parameters' dtype)."""
    from autoplan.cost_models.estimate import grad_accum_time

    bw = A100.gpu.hbm_gbps * 1e9 * A100.gpu.calibration.memory_efficiency
    fp32 = _train(grad_accum_fused=False, grad_reduce_dtype="fp32")
    fp16 = _train(grad_accum_fused=False, dtype="fp16")
    assert grad_accum_time(1e9, A100, fp32) == pytest.approx(1e9 * 10 / bw)
    assert grad_accum_time(1e9, A100, fp16) == pytest.approx(1e9 * 6 / bw)
    assert grad_accum_time(1e9, A100, _train(grad_accum_fused=True)) == 0.0


def test_bf16_optimizer_accumulation_casts_to_an_fp32_temporary_first():
    """DeepSpeed's BF16_Optimizer.update_hp_grads runs `hp_grad.add_(lp.grad.to(fp32))`: the cast writes an fp32
    temporary that the add reads back, so the pass moves 2 (bf16 read) + 4 (temp write) + 4 (temp read) + 4 + 4
    (buffer read, write) = 18 bytes per parameter instead of 10, every micro-batch; megatron-deepspeed sets it,
    no other stack does, and a fused stack still pays nothing."""
    from autoplan.cost_models.estimate import grad_accum_time

    bw = A100.gpu.hbm_gbps * 1e9 * A100.gpu.calibration.memory_efficiency
    plain = _train(grad_accum_fused=False, grad_reduce_dtype="fp32")
    cast = _train(grad_accum_fused=False, grad_reduce_dtype="fp32", grad_accum_cast_copy=True)
    assert grad_accum_time(1e9, A100, cast) == pytest.approx(1e9 * 18 / bw)
    assert grad_accum_time(1e9, A100, cast) == pytest.approx(1.8 * grad_accum_time(1e9, A100, plain))
    assert grad_accum_time(1e9, A100, _train(grad_accum_fused=True, grad_accum_cast_copy=True)) == 0.0
    assert get_stack("megatron-deepspeed").knobs["grad_accum_cast_copy"] is True
    assert all(get_stack(n).knobs["grad_accum_cast_copy"] is False
               for n in ("autoplan", "megatron-2021", "megatron-2022", "megatron-core", "deepspeed-zero3",
                         "torchtitan"))


def test_bf16_optimizer_cast_lengthens_every_stage_by_its_parameters():
    """In the estimate the extra 8 bytes per parameter land on every stage's backward, every micro-batch: the
    step grows by at least m * (the slowest stage's extra pass), and by no more than (m + pp - 1) times the
    largest stage's."""
    model = load_model("gpt3-13b")
    cl = load_cluster("dgx-a100-80g", gpus=64)
    cfg = ParallelConfig(tp=4, pp=4, dp=4, mbs=1, zero=1, recompute="full")
    base = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-deepspeed")
    off = base.model_copy(update={"grad_accum_cast_copy": False})
    prof = profile_from_spec(model)
    on_t, off_t = estimate(prof, cl, base, cfg).step_time_s, estimate(prof, cl, off, cfg).step_time_s
    bw = cl.gpu.hbm_gbps * 1e9 * cl.gpu.calibration.memory_efficiency
    per_stage = sum(p.params for p in prof[1:-1]) / cfg.pp / cfg.tp  # blocks only: a lower bound on any stage
    m = 64 // (cfg.dp * cfg.mbs)
    assert on_t - off_t > 0.9 * m * per_stage * 8 / bw
    assert on_t - off_t < (m + cfg.pp) * 1.5 * per_stage * 8 / bw


def test_sequence_parallel_partial_gradients_are_reduced_per_tensor_or_coalesced():
    """Under sp the replicated weights that see sequence-sharded inputs (norms, row-parallel biases, learned
    positions) have partial gradients all-reduced over tp once per step: one collective per tensor in autoplan's
    runtime (DTensor redistribution), one coalesced collective under Megatron (`sp_grads_coalesced`)."""
    from autoplan.cost_models.estimate import sp_grad_reduce_time, sp_partial_grads

    model = load_model("tiny-gpt")  # layernorm, biases, learned positions; hidden 64
    emb, block, head = (p := profile_from_spec(model))[0], p[1], p[-1]
    assert sp_partial_grads(block) == (6, float(block.params_replicated))  # 2 norms x (w, b) + 2 row biases
    assert block.params_replicated == 6 * 64
    assert sp_partial_grads(head) == (2, 128.0) and sp_partial_grads(emb) == (1, 64.0 * 64)
    cl = load_cluster("local-cpu", gpus=4)
    own, meg = TrainingSpec(global_batch_size=8, seq_length=64), TrainingSpec(global_batch_size=8, seq_length=64,
                                                                              sp_grads_coalesced=True)
    grp = comm.group_of(cl, 2, 1)
    assert sp_grad_reduce_time(6, 384.0, tp=2, cluster=cl, training=own) == pytest.approx(
        6 * comm.all_reduce(cl, grp, 64 * own.grad_bytes))
    assert sp_grad_reduce_time(6, 384.0, tp=2, cluster=cl, training=meg) == pytest.approx(
        comm.all_reduce(cl, grp, 384 * meg.grad_bytes))
    assert get_stack("megatron-2022").knobs["sp_grads_coalesced"] is True
    assert get_stack("autoplan").knobs["sp_grads_coalesced"] is False
    # in the estimate: with sp the step's tail grows by exactly the term (dp=1: in the optimizer's tail)
    t = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    two = load_cluster("local-cpu", gpus=2)
    on, off = (estimate(p, two, t, ParallelConfig(tp=2, dp=1, sp=s)) for s in (True, False))
    whole = sp_grad_reduce_time(4 * 6 + 1 + 2, 4 * 384.0 + 64 * 64 + 128, tp=2, cluster=two, training=t)
    assert whole > 0
    assert on.breakdown["optimizer"] - off.breakdown["optimizer"] == pytest.approx(whole, rel=1e-6)


# ---- a tied word embedding under pipeline parallelism (session 8): the last stage's own copy of the weight, (a)
# held with its gradient and optimizer state, (b) reduced over data parallelism, (c) stepped, (d) all-reduced with
# the first stage's over the embedding group (estimate.tied_copy, tied_grad_sync)

def _tied_case(stack: str, *, tied: bool, pp: int, tp: int = 2, dp: int | None = None, zero: int = 1,
               gpus: int = 32):
    from autoplan.specs import ModelSpec

    model = ModelSpec(name="t", num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=32768,
                      max_seq_length=1024, tie_embeddings=tied)
    cluster = load_cluster("dgx-a100-80g", gpus=gpus)
    # sp=1 under tp on every stack, the 2021-22 Megatron-DeepSpeed too (seq_splits widened): the terms, not the stack
    training = apply_stack(TrainingSpec(global_batch_size=64, seq_length=1024), stack, {"seq_splits": "sp"})
    cfg = check_config(ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, sp=tp > 1), model, cluster, training)
    profiles = profile_from_spec(model)
    return model, cluster, training, cfg, profiles, estimate(profiles, cluster, training, cfg)


@pytest.mark.parametrize("stack", ["megatron-2022", "megatron-deepspeed", "autoplan"])
def test_tied_head_copy_is_held_on_the_last_stage_like_an_untied_head(stack):
    """(a) With pp > 1 the last stage holds the tied weight's own copy: its weights, gradients and optimizer state
    are an untied head's (same shape); the first stage is unchanged. Without a pipeline the tied model holds the
    weight once: V*h/tp parameters less than the untied one."""
    for pp in (2, 4):
        *_, tied = _tied_case(stack, tied=True, pp=pp)
        *_, untied = _tied_case(stack, tied=False, pp=pp)
        for part in ("weights", "gradients", "optimizer"):
            assert getattr(tied.memory[-1], part) == pytest.approx(getattr(untied.memory[-1], part), rel=1e-12)
            assert getattr(tied.memory[0], part) == pytest.approx(getattr(untied.memory[0], part), rel=1e-12)
    model, _, training, cfg, _, tied1 = _tied_case(stack, tied=True, pp=1, dp=16)
    *_, untied1 = _tied_case(stack, tied=False, pp=1, dp=16)
    static = lambda mm: mm.weights + mm.gradients + mm.optimizer  # noqa: E731
    assert static(untied1.memory[0]) > static(tied1.memory[0])
    if stack != "autoplan":  # Megatron's count: 2 + 4 + 12 bytes per parameter less, the optimizer sharded (zero 1)
        head = model.vocab_size * model.hidden_size / cfg.tp
        per = training.weight_bytes + training.grad_bytes + 12 / (cfg.dp * cfg.cp)
        assert static(untied1.memory[0]) - static(tied1.memory[0]) == pytest.approx(head * per, rel=1e-9)


@pytest.mark.parametrize("stack", ["megatron-2022", "megatron-deepspeed", "autoplan"])
def test_tied_head_copy_is_reduced_and_stepped_with_its_stage(stack):
    """(b), (c) The last rank's gradient reduction and optimizer step cover the copy: they equal an untied
    head's; without a pipeline the tied weight is reduced and stepped once."""
    from autoplan.cost_models.estimate import _rank_tails, _stages_by_rank, rank_params

    for pp in (1, 2, 4):
        dp = 32 // (2 * pp)
        out = {}
        for tied in (True, False):
            _, cluster, training, cfg, _, est = _tied_case(stack, tied=tied, pp=pp, dp=dp)
            by_rank = _stages_by_rank(est.stages, pp)
            out[tied] = (rank_params(by_rank[-1], cfg)[0], _rank_tails(by_rank, cfg, cluster, training)[-1])
        if pp > 1:
            assert out[True][0] == out[False][0]
            assert out[True][1] == pytest.approx(out[False][1], rel=1e-12)  # (reduce, tail, optimizer, gather)
        else:
            assert out[True][0] < out[False][0]
            assert out[True][1][0] < out[False][1][0] and out[True][1][2] < out[False][1][2]


@pytest.mark.parametrize("stack,zero", [("megatron-2022", 1), ("megatron-2021", 0), ("megatron-deepspeed", 1),
                                        ("megatron-core", 1), ("autoplan", 0), ("autoplan", 1)])
def test_tied_embedding_all_reduce_is_in_the_breakdown(stack, zero):
    """(d) The embedding group's all-reduce: the whole tied gradient per tp rank in the gradient-reduction dtype
    (Megatron's main_grad, DeepSpeed's fp32 _hp_grad; autoplan's runtime: its local FSDP2 shard under ZeRO >= 1),
    between the first and the last pipeline rank, across nodes once (pp - 1) * tp * dp ranks fill one; 0 without a
    pipeline or untied."""
    from autoplan.cost_models.estimate import tied_sync_group

    for pp, dp, level in ((2, 2, "intra"), (4, 4, "inter")):
        model, cluster, training, cfg, _, est = _tied_case(stack, tied=True, pp=pp, dp=dp, zero=zero,
                                                           gpus=2 * pp * dp)
        assert est.critical_rank in (0, pp - 1)
        grp = tied_sync_group(cluster, pp=pp, tp=2, cp=1, dp=dp)
        assert (grp.size, grp.nodes) == (2, 1 if level == "intra" else 2)
        shard = dp if stack == "autoplan" and zero >= 1 else 1
        nbytes = model.vocab_size * model.hidden_size / 2 / shard * training.grad_bytes
        assert est.breakdown["embedding_comm"] == pytest.approx(comm.all_reduce(cluster, grp, nbytes), rel=1e-12)
        assert est.breakdown["embedding_comm"] > 0
        assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s, rel=1e-12)
        *_, untied = _tied_case(stack, tied=False, pp=pp, dp=dp, zero=zero, gpus=2 * pp * dp)
        assert untied.breakdown["embedding_comm"] == 0.0
    # autoplan's runtime reduces its parameters' own fp32 gradients (autocast over fp32 parameters)
    assert training.grad_bytes == (2 if stack in ("megatron-2021", "megatron-core") else 4)
    *_, one = _tied_case(stack, tied=True, pp=1, dp=16, zero=zero)
    assert one.breakdown["embedding_comm"] == 0.0


def test_first_and_last_rank_meet_at_the_embedding_all_reduce():
    from autoplan.cost_models.estimate import sync_tied_ranks

    assert sync_tied_ranks([3.0, 1.0, 2.0], 0.5) == [3.5, 1.0, 3.5]
    assert sync_tied_ranks([3.0, 1.0, 2.0], 0.0) == [3.0, 1.0, 2.0]
    assert sync_tied_ranks([3.0], 0.5) == [3.0]


def test_runtime_counts_all_reduce_the_tied_gradient_shard():
    """autoplan's runtime all-reduces the tied gradient as the rank holds it after FSDP2's reduce-scatter (its
    1/dp shard under ZeRO >= 1, the whole tp shard at ZeRO-0): the counts and the estimate agree."""
    from autoplan.cost_models.counts import predict_counts

    for zero in (0, 1):
        model, cluster, training, cfg, profiles, _ = _tied_case("autoplan", tied=True, pp=2, dp=4, zero=zero,
                                                                gpus=16)
        ranks = predict_counts(profiles, cluster, training, cfg)
        for r in (0, 1):
            ar = [c for c in ranks[r]["comm"] if c["collective"] == "all_reduce" and c["mesh_dim"] == "pp"]
            assert len(ar) == 1
            shard = 4 if zero else 1
            assert ar[0]["bytes"] == pytest.approx(model.vocab_size * model.hidden_size / 2 / shard
                                                   * training.grad_bytes)


def test_alibi_unfused_attention_writes_and_reads_the_scores_once_more():
    """ALiBi in Megatron-DeepSpeed (BLOOM): the raw scores come from `baddbmm(alibi_slice, q, k^T, beta=1)`;
    PyTorch copies the broadcast bias into the output and the batched GEMM reads it back, so an unfused forward
    moves 2 * 2 bytes per score more than `baddbmm(empty, ..., beta=0)`; the bias has no gradient, so the
    backward is unchanged; flash attention and the parameter count do not change (ALiBi has no weights, the
    RoPE rotation is gone)."""
    from autoplan.cost_models.compute import Context, _attention
    from autoplan.cost_models.specs import ModelSpec

    shape = dict(name="m", num_layers=2, hidden_size=4096, num_attention_heads=32, vocab_size=32000,
                 max_seq_length=2048, dropout=0.1)
    learned, alibi = ModelSpec(**shape), ModelSpec(**shape, position="alibi")
    b_l, b_a = profile_from_spec(learned)[1], profile_from_spec(alibi)[1]
    assert b_a.attention.score_bias and not b_l.attention.score_bias
    assert b_a.rope_elems == 0 and b_a.params == b_l.params
    assert profile_from_spec(alibi)[0].params == 32000 * 4096  # no position table
    unfused = _train(batch=8, flash_attention=False)
    ctx = Context(A100, unfused, tp=4, cp=1, sp=False, ep=1, mbs=2)
    (fl, bl, flop_l), (fa, ba, flop_a) = _attention(b_l, ctx), _attention(b_a, ctx)
    scores = 2 * (32 / 4) * 2048 * 2048
    bw = A100.gpu.hbm_gbps * 1e9 * A100.gpu.calibration.memory_efficiency
    assert fa - fl == pytest.approx(2 * scores * 2 / bw)
    assert ba == bl and flop_a == flop_l
    flash = Context(A100, _train(batch=8, flash_attention=True), tp=4, cp=1, sp=False, ep=1, mbs=2)
    assert _attention(b_a, flash) == _attention(b_l, flash)


def test_alibi_is_refused_by_the_runtime_model():
    """autoplan's runtime has no ALiBi attention: building the zoo model says so instead of training a model
    without positions."""
    from autoplan.cost_models.specs import ModelSpec
    from autoplan.zoo.model import Attention

    spec = ModelSpec(name="m", num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128,
                     max_seq_length=32, position="alibi")
    with pytest.raises(NotImplementedError, match="ALiBi"):
        Attention(spec)


def test_alibi_plan_is_refused_before_launch():
    """`autoplan run`'s start-up check refuses an ALiBi plan in one line, before any process starts."""
    from autoplan.api import make_plan
    from autoplan.cost_models.errors import PlanError
    from autoplan.cost_models.specs import ModelSpec
    from autoplan.models import check_plan_model

    spec = ModelSpec(name="m", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
                     max_seq_length=64, position="alibi")
    plan = make_plan(spec, load_cluster("local-cpu", gpus=1), TrainingSpec(global_batch_size=2, seq_length=64),
                     "dp=1", kernels="torch")
    with pytest.raises(PlanError, match="no ALiBi attention") as e:
        check_plan_model(plan)
    assert "fix:" in e.value.one_line() and len(e.value.one_line().splitlines()) == 1


def test_megatron_float16_optimizer_runs_its_passes_separately():
    """Megatron-LM's Float16OptimizerWithFloat16Params: zero the main_grad buffer (grad dtype), cast 16-bit main
    grads to fp32 (fp16 runs), unscale (fp16 only), clip-norm read, apex FusedAdam (28 B), then copy the master
    into the 16-bit weights (read 4, write 2): 42 B per parameter with bf16 and fp32 main grads (Korthikanti
    2022), 54 B with fp16 main grads and a grad scaler (SC21), against a fused Adam's 34 B; under ZeRO-1 the
    buffer zeroing still covers every local parameter."""
    from autoplan.cost_models.estimate import optimizer_time

    bw = A100.gpu.hbm_gbps * 1e9 * A100.gpu.calibration.memory_efficiency
    fused = optimizer_time(1e9, 1, A100, _train())
    assert fused == pytest.approx(1e9 * 34 / bw) == optimizer_time(1e9, 1, A100)
    # autoplan's runtime also casts every weight to bf16 once per step (read 4, write 2), sharded or not
    assert optimizer_time(1e9, 8, A100, _train(autocast_fp32_params=True)) == pytest.approx(1e9 * (34 / 8 + 6) / bw)
    m22 = apply_stack(_train(), "megatron-2022")
    m21 = apply_stack(_train(), "megatron-2021")
    assert optimizer_time(1e9, 1, A100, m22) == pytest.approx(1e9 * 42 / bw)
    assert optimizer_time(1e9, 1, A100, m21) == pytest.approx(1e9 * 54 / bw)
    # ZeRO-1 over 8 ranks: the per-shard passes divide by 8, the zeroing of the whole grad buffer does not
    assert optimizer_time(1e9, 8, A100, m22) == pytest.approx(1e9 * (38 / 8 + 4) / bw)
    assert all(get_stack(n).knobs["optimizer_separate_passes"] is (n in ("megatron-2021", "megatron-2022"))
               for n in ("autoplan", "megatron-2021", "megatron-2022", "megatron-core", "megatron-deepspeed",
                         "deepspeed-zero3", "torchtitan"))


@pytest.mark.parametrize("sp", [False, True])
def test_lm_head_reduces_its_input_gradient_over_tp(sp):
    """The LM head is column-parallel over the vocabulary: its input's gradient is summed over tp in the backward
    (Megatron's `copy_to_tensor_model_parallel_region` / async all-reduce, with sp a reduce-scatter), one
    h-wide collective per micro-batch, nothing at tp=1 (session 9). counts.layer_comm counted it already; the step
    time now prices it too. Its forward has the vocab-parallel cross-entropy's three all-reduces of a float per
    token (max, target logit, sum of exponentials; session 14)."""
    from autoplan.cost_models.compute import Context, layer_cost

    head = profile_from_spec(load_model("gpt3-13b"))[-1]
    t = _train(batch=4)
    c = layer_cost(head, Context(A100, t, tp=8, cp=1, sp=sp, ep=1, mbs=4))
    grp = comm.group_of(A100, 8, 1)
    nbytes = 4 * 2048 * head.hidden * 2
    one = (comm.reduce_scatter(A100, grp, nbytes) + comm.all_gather(A100, grp, nbytes) if sp
           else comm.all_reduce(A100, grp, nbytes))
    assert c.comm_fwd_s == pytest.approx(3 * comm.all_reduce(A100, grp, 4.0 * 4 * 2048))
    assert c.comm_bwd_s == pytest.approx(one)
    assert layer_cost(head, Context(A100, t, tp=1, cp=1, sp=False, ep=1, mbs=4)).comm_bwd_s == 0.0


@pytest.mark.parametrize("config,replicate", [("pp=2,dp=2", False), ("pp=2,vp=2,dp=2,schedule=interleaved", False),
                                              ("pp=2,cp=2", False), ("tp=2,pp=2,dp=2", True), ("dp=4", False)])
def test_zero0_all_reduces_are_the_runtimes(config, replicate):
    """ZeRO-0 as autoplan's runtime runs it (runtime.parallelize.apply_dp): FSDP2's `replicate` only where tp > 1,
    one all-reduce per block and stage root; torch's DDP otherwise, pipelined or not, one DDP per local stage
    (each at least one bucket), with no FSDP2 hooks and no second parameter copy."""
    from autoplan.cost_models.estimate import (
        _stages_by_rank,
        fsdp_unit_time,
        fsdp_units,
        runtime_dp_units,
        runtime_per_param,
        uses_replicate,
    )
    from autoplan.cost_models.fit import with_knobs

    model = load_model("tiny-gpt")
    cluster = with_knobs(load_cluster("local-cpu", gpus=8 if "tp" in config else 4), {"fsdp_hook_us": 100.0})
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    cfg = check_config(ParallelConfig.parse(config), model, cluster, training)
    assert uses_replicate(tp=cfg.tp, zero=cfg.zero, dp_cp=cfg.dp * cfg.cp) == replicate
    est = estimate(profile_from_spec(model), cluster, training, cfg, simulate_pipeline=False)
    stages = _stages_by_rank(est.stages, cfg.pp)[0]
    assert runtime_dp_units(stages, cfg) == (fsdp_units(stages) if replicate else len(stages))
    assert len(stages) == cfg.vp
    (dense_w, _, _), _ = runtime_per_param(dp=cfg.dp, cp=cfg.cp, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, zero=0,
                                           training=training)
    assert (dense_w > 0) == replicate  # replicate's sharded copy beside each parameter
    hooks = fsdp_unit_time(fsdp_units(stages), 1e5, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp, pp=cfg.pp, zero=0, m=4,
                           cluster=cluster, training=training)
    assert (hooks > 0) == replicate


def test_vocab_parallel_loss_all_reduces_follow_each_other():
    """The cross-entropy's three all-reduces over tp run back to back: on an oversubscribed CPU node the first pays
    the step's waits (its peers still in their heads' GEMMs), the two after it find their peers there (no step or
    skew wait, as the step's scalar all-reduces); on accelerators all three cost the same."""
    from autoplan.cost_models.compute import Context, _vocab_parallel_loss_comm, vocab_parallel_loss_bytes

    t = _train(batch=4)
    cpu = load_cluster("local-cpu").model_copy(update={"cores_per_node": 2, "step_wait_us": 2000.0,
                                                       "skew_wait_us": 1000.0, "oversubscription_wait_us": 500.0})
    ctx = Context(cpu, t, tp=4, cp=1, sp=False, ep=1, mbs=1)
    grp = comm.group_of(cpu, 4, 1)
    n = vocab_parallel_loss_bytes(ctx)
    idle = cpu.model_copy(update={"step_wait_us": 0.0, "skew_wait_us": 0.0})
    got = _vocab_parallel_loss_comm(ctx, grp)
    assert got == pytest.approx(comm.all_reduce(cpu, grp, n) + 2 * comm.all_reduce(idle, grp, n))
    assert got < 3 * comm.all_reduce(cpu, grp, n)
    gpu = Context(A100, t, tp=8, cp=1, sp=False, ep=1, mbs=1)
    g8 = comm.group_of(A100, 8, 1)
    assert _vocab_parallel_loss_comm(gpu, g8) == pytest.approx(3 * comm.all_reduce(A100, g8, 4.0 * 2048))
