"""The cost model's formulas against the papers, by hand-computed values.

Narayanan et al. 2021 (SC21) eq. 2 (parameters) and eq. 3 (hardware FLOPs with full recomputation);
Korthikanti et al. 2022 eq. 7 (model FLOPs) and Table 2 (activation bytes per layer); pipeline bubbles.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan.cost_models.compute import Context, _core_kernels, _gemm_parts, fused_calls, layer_cost
from autoplan.cost_models.estimate import estimate
from autoplan.cost_models.pipeline import (
    bubble_fraction,
    closed_form_makespan,
    in_flight,
    interleaved_rounds_fit,
    microbatch_group,
    rank_end_lower_bounds,
    schedule_actions,
    simulate,
)
from autoplan.cost_models.profile import profile_from_spec
from autoplan.cost_models.specs import check_config
from autoplan.specs import ModelSpec, ParallelConfig, TrainingSpec, load_cluster, load_model

SC21 = ["sc21-1.7b", "sc21-18.4b", "sc21-145.6b", "sc21-1t"]


@pytest.mark.parametrize("name", SC21)
def test_parameters_match_sc21_eq2(name):
    m = load_model(name)
    l, h, V, s = m.num_layers, m.hidden_size, m.vocab_size, m.max_seq_length
    eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    ours = sum(p.params for p in profile_from_spec(m))
    # eq. 2 leaves out the final LayerNorm (2h parameters); everything else is counted the same way
    assert ours - 2 * h == pytest.approx(eq2, rel=1e-12)


def test_llama_parameter_counts_match_released_models():
    # Llama-2-7B: 6,738,415,616 and Llama-3-8B: 8,030,261,248 parameters (released checkpoints)
    assert sum(p.params for p in profile_from_spec(load_model("llama2-7b"))) == 6_738_415_616
    assert sum(p.params for p in profile_from_spec(load_model("llama3-8b"))) == 8_030_261_248


def _estimate(model, gpus, cfg, batch, flash=False, cluster="dgx-a100-80g", **training):
    c = load_cluster(cluster, gpus=gpus)
    t = TrainingSpec(global_batch_size=batch, seq_length=model.max_seq_length, dtype="fp16", flash_attention=flash,
                     **training)
    cfg = check_config(ParallelConfig.parse(cfg), model, c, t)
    return estimate(profile_from_spec(model), c, t, cfg), t


@pytest.mark.parametrize("name,gpus,cfg,batch", [
    ("sc21-1.7b", 32, "tp=1,pp=1,mbs=16,recompute=full", 512),
    ("sc21-145.6b", 1536, "tp=8,pp=8,vp=2,mbs=2,recompute=full", 2304),
])
def test_hardware_flops_with_full_recompute_match_sc21_eq3(name, gpus, cfg, batch):
    """Megatron's reentrant checkpoint re-runs every forward GEMM (SC21 eq. 3); autoplan's runtime's
    (torch.utils.checkpoint, early stop) leaves out each block's last, the 4h -> h GEMM (8 B s h^2 per layer),
    unless the hidden dropout after it keeps a mask for the backward (the SC21 GPTs' 0.1): then it re-runs it too."""
    m = load_model(name)
    est, t = _estimate(m, gpus, cfg, batch, runtime_memory=False)
    B, s, l, h, V = batch, t.seq_length, m.num_layers, m.hidden_size, m.vocab_size
    eq3 = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert est.hardware_flops == pytest.approx(eq3, rel=1e-9)
    assert m.dropout > 0
    ours, _ = _estimate(m, gpus, cfg, batch)
    assert ours.hardware_flops == pytest.approx(eq3, rel=1e-9)
    ours, _ = _estimate(m.model_copy(update={"dropout": 0.0}), gpus, cfg, batch)
    assert ours.hardware_flops == pytest.approx(eq3 - 8 * B * s * h * h * l, rel=1e-9)


@pytest.mark.parametrize("name,gpus,cfg,batch", [
    ("sc21-18.4b", 256, "tp=8,mbs=8", 1024),
    ("gpt3-175b", 1024, "tp=8,pp=8,sp=1,recompute=selective", 1536),
])
def test_model_flops_match_korthikanti_eq7(name, gpus, cfg, batch):
    m = load_model(name)
    est, t = _estimate(m, gpus, cfg, batch)
    B, s, l, h, V = batch, t.seq_length, m.num_layers, m.hidden_size, m.vocab_size
    eq7 = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * h * l))
    assert est.model_flops == pytest.approx(eq7, rel=1e-9)
    # selective recomputation of the unfused attention core adds its forward, 4*B*s^2*h per layer
    if "selective" in cfg:
        assert est.hardware_flops - est.model_flops == pytest.approx(4 * B * s * s * h * l, rel=1e-9)


# Korthikanti et al. 2022, Table 2: activation bytes per layer (16-bit activations, dropout, unfused softmax)
GPT = ModelSpec(name="t2", num_layers=8, hidden_size=4096, num_attention_heads=32, vocab_size=51200,
                max_seq_length=2048, dropout=0.1)


def _act(t: int, sp: bool, mode: str) -> float:
    cluster = load_cluster("dgx-a100-80g", gpus=8)
    train = TrainingSpec(global_batch_size=8, seq_length=2048, dtype="fp16", flash_attention=False,
                         autocast_fp32_params=False,  # Megatron's 16-bit weights, as the paper counts
                         runtime_memory=False)  # and Megatron's layers (not autoplan's runtime's eager saves)
    ctx = Context(cluster=cluster, training=train, tp=t, cp=1, sp=sp, ep=1, mbs=4)
    c = layer_cost(profile_from_spec(GPT)[1], ctx)
    return {"none": c.act_none, "selective": c.act_selective, "full": c.act_full}[mode]


@pytest.mark.parametrize("t", [1, 2, 8])
def test_activation_memory_rows_of_korthikanti_table2(t):
    s, b, h, a = 2048, 4, 4096, 32
    sbh = s * b * h
    assert _act(t, False, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert _act(t, False, "selective") == pytest.approx(sbh * (10 + 24 / t))
    assert _act(t, False, "full") == pytest.approx(2 * sbh)
    if t > 1:
        assert _act(t, True, "none") == pytest.approx(sbh / t * (34 + 5 * a * s / h))
        assert _act(t, True, "selective") == pytest.approx(34 * sbh / t)
    if t == 1:
        assert _act(t, False, "none") == pytest.approx(sbh * (34 + 5 * a * s / h))


@pytest.mark.parametrize("p,m", [(4, 8), (8, 32), (2, 2)])
def test_1f1b_bubble_is_p_minus_1_over_m(p, m):
    f, b = 1.0, 2.0
    tl = simulate("1f1b", p, m, 1, [f] * p, [b] * p)
    ideal = m * (f + b)
    assert (tl.makespan - ideal) / ideal == pytest.approx(bubble_fraction(p, m))
    gp = simulate("gpipe", p, m, 1, [f] * p, [b] * p)
    assert gp.makespan == pytest.approx(tl.makespan)


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 3, 8), (8, 2, 16), (4, 2, 6), (4, 2, 10), (8, 3, 20), (2, 2, 3)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, v, m):
    f, b = 1.0 / v, 2.0 / v  # a rank's layers split into v chunks
    tl = simulate("interleaved", p, m, v, [f] * (p * v), [b] * (p * v))
    ideal = m * v * (f + b)
    assert (tl.makespan - ideal) / ideal == pytest.approx(bubble_fraction(p, m, v))


@pytest.mark.parametrize("p,m,group", [(4, 8, 4), (4, 6, 6), (4, 10, 5), (4, 12, 4), (8, 20, 10), (2, 3, 3), (4, 7, 7)])
def test_interleaved_rounds_follow_torchs_rule(p, m, group):
    """Rounds of `microbatch_group` micro-batches (torch's Interleaved1F1B: m // p rounds): every stage runs each
    micro-batch once, forwards in order, a round through each of the rank's chunks before the next round."""
    v = 2
    assert microbatch_group(p, m) == group and interleaved_rounds_fit(p, m)
    acts = schedule_actions("interleaved", p, m, v)
    for r in range(p):
        fwd = [a for a in acts[r] if a.kind == "F"]
        assert [(a.stage // p, a.mb) for a in fwd] == [
            (c, g + j) for g in range(0, m, group) for c in range(v) for j in range(group)]
        for stage in (r, p + r):
            assert sorted(a.mb for a in acts[r] if a.kind == "B" and a.stage == stage) == list(range(m))
        # the warm-up, (v - 1) rounds and two forwards per later rank (torch's _get_warmup_ops), then one more
        # forward before the first backward
        first_backward = next(i for i, a in enumerate(acts[r]) if a.kind == "B")
        assert first_backward == min((v - 1) * group + 2 * (p - 1 - r) + 1, m * v)


@pytest.mark.parametrize("p,m", [(4, 9), (4, 2), (8, 17), (8, 25)])
def test_uneven_rounds_are_refused(p, m):
    """m // p rounds must divide m (torch raises otherwise; Megatron's last group would be shorter than p)."""
    assert not interleaved_rounds_fit(p, m)


def test_in_flight_matches_the_action_lists():
    """A rank's peak of forwards without their backward (in chunks, / v) is `in_flight`, for rounds of p and
    longer."""
    for p, v, m in [(4, 2, 8), (4, 2, 6), (4, 3, 10), (2, 2, 3), (8, 2, 20)]:
        fl = in_flight("interleaved", p, m, v)
        for r, acts in enumerate(schedule_actions("interleaved", p, m, v)):
            live = peak = 0
            for a in acts:
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
            assert fl[r] == pytest.approx(peak / v), (p, v, m, r)


def test_in_flight_microbatches():
    assert in_flight("gpipe", 4, 16) == [16.0] * 4
    assert in_flight("1f1b", 4, 16) == [4.0, 3.0, 2.0, 1.0]
    # Korthikanti et al. 2022: the first interleaved stage holds p * (1 + (p-1)/(p*v)) micro-batches' worth
    p, v = 8, 3
    assert in_flight("interleaved", p, 64, v)[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_pipeline_grid_uses_action_notation():
    tl = simulate("1f1b", 2, 2, 1, [1.0, 1.0], [2.0, 2.0], keep_slices=True)
    grid = tl.grid()
    assert grid[0] == ["0F0", "1F0"]
    assert [row[0] for row in grid] == ["0F0", "0F1", "0B0", "0B1"]


def test_kernel_traffic_copy_matches_the_kernels_table():
    from autoplan.cost_models.kernel_traffic import BYTES_PER_ELEMENT
    from autoplan.kernels.traffic import bytes_per_element

    for op, (ff, fb, ef, eb) in BYTES_PER_ELEMENT.items():
        assert bytes_per_element(op, "fused", "fwd") == ff, op
        assert bytes_per_element(op, "fused", "bwd") == fb, op
        assert bytes_per_element(op, "eager", "fwd") == ef, op
        assert bytes_per_element(op, "eager", "bwd") == eb, op


def test_kernel_sets_change_the_elementwise_time_only():
    m = load_model("llama3-8b")
    c = load_cluster("dgx-h100", gpus=8)
    times = {}
    for k in ("fused", "megatron", "torch"):
        t = TrainingSpec(global_batch_size=8, seq_length=8192, kernels=k)
        cfg = check_config(ParallelConfig.parse("tp=8"), m, c, t)
        est = estimate(profile_from_spec(m), c, t, cfg)
        times[k] = est
    # Megatron's (RoPE fused too) < autoplan's (RMSNorm and SwiGLU fused, RoPE eager) < eager torch
    assert times["megatron"].step_time_s < times["fused"].step_time_s < times["torch"].step_time_s
    assert times["fused"].model_flops == times["torch"].model_flops
    # every set keeps the fp32 softmax of the logits: autoplan's runtime does not call the chunked cross-entropy
    assert times["fused"].memory[0].activations == times["megatron"].memory[0].activations


def test_fp8_runs_the_linears_in_fp8_and_pays_their_casts():
    """Under dtype fp8 the block's linears run at the fp8 peak and pay the quantisation of their operands (read the
    16-bit tensor, write its fp8 copy and transpose: 4 bytes an element: inputs and weights in the forward, output
    gradients in the backward); the attention core and the LM head stay 16-bit, as on torchtitan (Float8Linear,
    `output` filtered) and Megatron-Core (TE linears; attention and output layer outside). Until session 28 every
    GEMM ran at the fp8 peak with no cast: 8B's Float8 speed-up 1.67x predicted against torchtitan's 1.28x."""
    from autoplan.cost_models.compute import FP8_CAST_BYTES, _attention, fp8_cast_bytes

    m = load_model("llama3-8b")
    c = load_cluster("dgx-h100", gpus=8)
    emb, block, head = profile_from_spec(m)[0], profile_from_spec(m)[1], profile_from_spec(m)[-1]
    ctx = {d: Context(cluster=c, training=TrainingSpec(global_batch_size=8, seq_length=8192, dtype=d), tp=2, cp=1,
                      sp=True, ep=1, mbs=2) for d in ("bf16", "fp8")}
    tokens = 2 * 8192
    for (t16, f16), (t8, f8), g in zip(_gemm_parts(block, ctx["bf16"]), _gemm_parts(block, ctx["fp8"]), block.gemms):
        assert f8 == f16 and t8 == pytest.approx(t16 * 989.4 / 1978.9, rel=1e-12), g.name  # the peaks, same shape
    (h16, _), = _gemm_parts(head, ctx["bf16"])
    (h8, _), = _gemm_parts(head, ctx["fp8"])
    assert h8 == h16
    assert _attention(block, ctx["fp8"]) == _attention(block, ctx["bf16"])
    # the casts, by hand: wq, wk, wv, w1, w3 split their outputs over tp, wo and w2 their inputs
    h, kv, ffn = 4096, 8 * 128, 14336
    shapes = [(h, h // 2), (h, kv // 2), (h, kv // 2), (h // 2, h), (h, ffn // 2), (h, ffn // 2), (ffn // 2, h)]
    fwd = sum(tokens * k + k * n for k, n in shapes) * FP8_CAST_BYTES
    bwd = sum(tokens * n for _, n in shapes) * FP8_CAST_BYTES
    assert [g.name for g in block.gemms] == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    assert fp8_cast_bytes(block, ctx["fp8"]) == pytest.approx((fwd, bwd), rel=1e-12)
    assert fp8_cast_bytes(block, ctx["bf16"]) == (0.0, 0.0) == fp8_cast_bytes(emb, ctx["fp8"])
    assert fp8_cast_bytes(head, ctx["fp8"]) == (0.0, 0.0)
    lc16, lc8 = layer_cost(block, ctx["bf16"]), layer_cost(block, ctx["fp8"])
    assert 0.5 * lc16.fwd_s < lc8.fwd_s < lc16.fwd_s and 0.5 * lc16.bwd_s < lc8.bwd_s < lc16.bwd_s


# ---- rank_end_lower_bounds: what the search keys closed-form finalists by


@settings(max_examples=60, deadline=None)
@given(data=st.data(), pp=st.integers(2, 4), vp=st.integers(1, 3), schedule=st.sampled_from(["1f1b", "gpipe"]),
       p2p=st.sampled_from([0.0, 0.05]))
def test_rank_end_lower_bounds_never_exceed_the_simulation(data, pp, vp, schedule, p2p):
    if schedule == "gpipe":
        vp = 1
    elif vp > 1:
        schedule = "interleaved"
    m = data.draw(st.integers(pp, 3 * pp).map(lambda x: x - x % pp if vp > 1 else x))
    times = st.lists(st.floats(0.1, 3.0), min_size=pp * vp, max_size=pp * vp)
    fwd, bwd = data.draw(times), data.draw(times)
    sim = simulate(schedule, pp, m, vp, fwd, bwd, p2p)
    lb = rank_end_lower_bounds(fwd, bwd, pp, m, vp, p2p)
    for r in range(pp):
        assert lb[r] <= sim.rank_end[r] + 1e-9


@pytest.mark.parametrize("pp,vp,m", [(2, 1, 2), (4, 1, 8), (4, 2, 8), (3, 3, 6)])
def test_rank_end_lower_bound_is_exact_for_even_stages(pp, vp, m):
    fwd, bwd = [1.0] * (pp * vp), [2.0] * (pp * vp)
    schedule = "interleaved" if vp > 1 else "1f1b"
    sim = simulate(schedule, pp, m, vp, fwd, bwd)  # without messages: with them neither formula is exact
    assert max(rank_end_lower_bounds(fwd, bwd, pp, m, vp)) == pytest.approx(sim.makespan, rel=1e-12)
    assert closed_form_makespan(fwd, bwd, pp, m, vp) == pytest.approx(sim.makespan, rel=1e-12)


def test_closed_form_overstates_an_uneven_pipeline_and_the_bound_does_not():
    # stage 0 twice stage 1, 2 micro-batches: stage 0's extra work hides under stage 1's round trip
    fwd, bwd = [1.0, 0.5], [1.0, 0.5]
    assert simulate("1f1b", 2, 2, 1, fwd, bwd).makespan == pytest.approx(4.0)
    assert closed_form_makespan(fwd, bwd, 2, 2) == pytest.approx(5.0)
    assert max(rank_end_lower_bounds(fwd, bwd, 2, 2)) == pytest.approx(4.0)


def test_checkpoint_region_is_priced_where_the_host_bounds_it():
    """The runtime recomputes with torch.utils.checkpoint: on a CPU cluster (the host is the critical path) each
    checkpointed region costs recompute_region_us + its operators x recompute_op_us, and the selective region
    (the attention core) also re-runs its kernel, flash or not. On a GPU the same hooks are host time of
    autoplan's runtime, which the region's kernels hide only where they outlast it; a stack that is not
    autoplan's runtime gets nothing of it, even with the constants set."""
    tiny = load_model("tiny-gpt")
    block = profile_from_spec(tiny)[1]
    tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", flash_attention=True)
    cpu = load_cluster("local-cpu").model_copy(update={"cores_per_node": 2})
    cal = cpu.gpu.calibration
    assert cal.recompute_region_us > 0 and cal.recompute_op_us > 0  # the preset's measured values

    def cost(cluster, region_us, op_us):
        gpu = cluster.gpu.model_copy(update={"calibration": cluster.gpu.calibration.model_copy(
            update={"recompute_region_us": region_us, "recompute_op_us": op_us})})
        ctx = Context(cluster=cluster.model_copy(update={"gpu": gpu}), training=tr, tp=1, cp=1, sp=False, ep=1,
                      mbs=1)
        return layer_cost(block, ctx)

    zero, with_ = cost(cpu, 0.0, 0.0), cost(cpu, 300.0, 40.0)
    assert with_.recompute_full_s - zero.recompute_full_s == pytest.approx((300 + 40 * block.kernels_fwd) * 1e-6)
    # the whole forward again but what the checkpoint's early stop leaves out: the last GEMM and its operator
    w2 = _gemm_parts(block, Context(cluster=cpu, training=tr, tp=1, cp=1, sp=False, ep=1, mbs=1))[-1][0]
    assert zero.recompute_full_s == pytest.approx(zero.fwd_s - w2 - cal.kernel_launch_us * 1e-6)
    assert with_.recompute_selective_s - zero.recompute_selective_s == pytest.approx(340e-6)
    # re-running the core: its device time and its one kernel's host time, although flash_attention is set
    launch = cal.kernel_launch_us * 1e-6
    assert zero.recompute_selective_s > launch and zero.recompute_flops_selective > 0
    assert with_.fwd_s == zero.fwd_s and with_.bwd_s == zero.bwd_s  # recompute is priced on its own
    gpu = load_cluster("dgx-h100")
    g0, g1 = cost(gpu, 0.0, 0.0), cost(gpu, 300.0, 40.0)
    # tiny-gpt at 64 tokens: the host bounds the layer on a GPU, so the region's host time adds in full
    gcal = gpu.gpu.calibration
    host = (block.kernels_fwd * gcal.kernel_launch_us + fused_calls(block) * gcal.fused_call_us) * 1e-6
    assert g0.fwd_s == pytest.approx(host)
    assert g1.recompute_full_s - g0.recompute_full_s == pytest.approx((300 + 40 * block.kernels_fwd) * 1e-6)
    assert g1.checkpoint_full_s == pytest.approx(g1.recompute_full_s - g0.recompute_full_s)  # over the plain re-run
    core_host = (_core_kernels(block) * (gcal.kernel_launch_us + 40) + 300) * 1e-6
    assert g1.recompute_selective_s == pytest.approx(max(g0.recompute_selective_s, core_host))
    assert g1.fwd_s == g0.fwd_s and g1.bwd_s == g0.bwd_s
    # autoplan's runtime re-runs the flash core on a GPU too (its attention forward); a stack that keeps flash's
    # outputs (runtime_memory false: not autoplan's runtime) recomputes nothing selectively and pays no hooks
    assert 0.0 < g0.recompute_selective_s < g0.fwd_s
    assert g0.recompute_full_s == pytest.approx(g0.fwd_s - gcal.kernel_launch_us * 1e-6)  # host-bound: w2's op
    tr = tr.model_copy(update={"runtime_memory": False})
    assert cost(gpu, 0.0, 0.0).recompute_selective_s == 0.0
    assert cost(gpu, 300.0, 40.0) == cost(gpu, 0.0, 0.0)
    # a block whose kernels outlast the hooks (GPT-3 1.3B, 2 x 2048 tokens, torch's kernels): nothing of them shows
    big = profile_from_spec(load_model("gpt3-1.3b"))[1]
    tr = TrainingSpec(global_batch_size=8, seq_length=2048, dtype="bf16", kernels="torch")

    def big_cost(region_us, op_us):
        slow = gpu.gpu.model_copy(update={"calibration": gpu.gpu.calibration.model_copy(
            update={"recompute_region_us": region_us, "recompute_op_us": op_us})})
        return layer_cost(big, Context(cluster=gpu.model_copy(update={"gpu": slow}), training=tr, tp=1, cp=1,
                                       sp=False, ep=1, mbs=2))

    b0, b1 = big_cost(0.0, 0.0), big_cost(10.0, 1.0)
    assert b1.recompute_full_s == b0.recompute_full_s and b1.checkpoint_full_s == 0.0


def test_fused_module_calls_cost_host_time_in_autoplans_runtime_on_a_gpu():
    """A fused Triton module's call costs host time beyond the eager op it replaces (fused_call_us, session 12's
    H200 launch measurement): priced per call of the runtime's substitutions (norms and a block's GeLU/SwiGLU) in
    the forward and twice in the backward, where the host bounds the layer, with kernels=fused on autoplan's
    runtime on a GPU; not with torch's kernels, another stack's, or on a CPU host."""
    tiny = load_model("tiny-gpt")
    emb, block, head = (profile_from_spec(tiny)[i] for i in (0, 1, -1))
    assert (fused_calls(emb), fused_calls(block), fused_calls(head)) == (0, 3, 1)
    llama = profile_from_spec(load_model("tiny-llama"))
    assert fused_calls(llama[1]) == 3 and fused_calls(llama[-1]) == 1

    def cost(cluster_name, call_us, **training):
        cluster = load_cluster(cluster_name)
        gpu = cluster.gpu.model_copy(update={"calibration": cluster.gpu.calibration.model_copy(
            update={"fused_call_us": call_us})})
        tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="bf16", **training)
        ctx = Context(cluster=cluster.model_copy(update={"gpu": gpu}), training=tr, tp=1, cp=1, sp=False, ep=1,
                      mbs=1)
        return layer_cost(block, ctx)

    g0, g1 = cost("dgx-h100", 0.0, kernels="fused"), cost("dgx-h100", 100.0, kernels="fused")
    assert g1.fwd_s - g0.fwd_s == pytest.approx(3 * 100e-6)  # tiny-gpt's layer is host-bound here
    assert g1.bwd_s - g0.bwd_s == pytest.approx(2 * 3 * 100e-6)
    assert cost("dgx-h100", 100.0, kernels="torch") == cost("dgx-h100", 0.0, kernels="torch")
    assert cost("dgx-h100", 100.0, kernels="fused", runtime_memory=False) == \
        cost("dgx-h100", 0.0, kernels="fused", runtime_memory=False)
    assert cost("local-cpu", 100.0, kernels="fused") == cost("local-cpu", 0.0, kernels="fused")


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_checkpoint_host_time_is_compute_not_recompute_in_the_breakdown(recompute):
    """The runtime times the checkpoint's own host time as backward compute, outside its "recompute" phase (which
    holds the re-run operators): the estimate's breakdown says so, and the step pays it once per region."""
    tiny = load_model("tiny-gpt")
    tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    base = load_cluster("local-cpu").model_copy(update={"cores_per_node": 2}).with_gpus(1)

    def run(region_us, op_us):
        gpu = base.gpu.model_copy(update={"calibration": base.gpu.calibration.model_copy(
            update={"recompute_region_us": region_us, "recompute_op_us": op_us})})
        cl = base.model_copy(update={"gpu": gpu})
        cfg = check_config(ParallelConfig.parse(f"dp=1,mbs=1,recompute={recompute}"), tiny, cl, tr)
        return estimate(profile_from_spec(tiny), cl, tr, cfg)

    a, b = run(0.0, 0.0), run(300.0, 40.0)
    ops = 1 if recompute == "selective" else profile_from_spec(tiny)[1].kernels_fwd
    regions = 8 * tiny.num_layers  # 8 micro-batches of 4 blocks
    assert b.breakdown["recompute"] == pytest.approx(a.breakdown["recompute"])
    assert b.breakdown["compute"] - a.breakdown["compute"] == pytest.approx(regions * (300 + 40 * ops) * 1e-6)
    assert b.step_time_s - a.step_time_s == pytest.approx(regions * (300 + 40 * ops) * 1e-6, rel=1e-6)


@pytest.mark.parametrize("model,extra", [("gpt3-1.3b", 8), ("llama3-8b", 10)])
def test_autocast_block_keeps_what_the_h200_census_measured(model, extra):
    """Autoplan's autocast over fp32 parameters (TrainingSpec.autocast_fp32_params) adds to a block's 16-bit count,
    per token and hidden unit: the two norms' fp32 inputs (+4) and one more cast of a norm's output per extra
    reading linear (wq, wk, wv: +4; SwiGLU's w1, w3: +2). GPT-1.3B's block measured 42.0 on an H200 against the
    profile's 34 (session 12, benchmarks/gpu/saved.py). Its weights' 16-bit copies are held once per rank."""
    m = load_model(model)
    cluster = load_cluster("dgx-h200", gpus=8)
    ctxs = {}
    for amp in (False, True):
        # torch's kernels: the fused modules' host time would bound GPT-1.3B's forward (fused_call_us)
        train = TrainingSpec(global_batch_size=8, seq_length=2048, dtype="bf16", autocast_fp32_params=amp,
                             kernels="torch")
        ctxs[amp] = Context(cluster=cluster, training=train, tp=1, cp=1, sp=False, ep=1, mbs=2)
    block = profile_from_spec(m)[1]
    off, on = layer_cost(block, ctxs[False]), layer_cost(block, ctxs[True])
    tokens, h = 2 * 2048, m.hidden_size
    assert on.act_none - off.act_none == pytest.approx(tokens * h * extra)
    assert on.weight_copies == pytest.approx(2 * sum(g.params for g in block.gemms)) and off.weight_copies == 0
    assert on.fwd_s > off.fwd_s and on.bwd_s > off.bwd_s  # the casts and the fp32 gradient accumulation


@pytest.mark.parametrize("kernels,census", [("fused", 8.13 + 42.0), ("torch", 8.13 + 50.0)])
def test_runtime_block_keeps_what_the_h200_census_measured_under_gqa(kernels, census):
    """Llama-3.2-1B's block under autoplan's runtime keeps, per token and hidden unit, 8.13 fp32 and 42 bf16 bytes
    with the fused kernels, 50 with torch's (session 17, benchmarks/gpu/saved.py on an H200): SDPA saves the
    query-head-wide K and V the core expands for GQA (+3 over the profile's kv-head-wide ones) and eager SwiGLU
    keeps silu(w1 x) too (+8 with torch's kernels). Selective recompute drops the core's part (the checkpointed
    region keeps its inputs), full recompute all of it; a stack that is not autoplan's runtime keeps the profile's."""
    m = load_model("benchmarks/gpu/llama-3.2-1b.config.json")
    block = profile_from_spec(m)[1]
    cluster = load_cluster("dgx-h200", gpus=1)

    def cost(**kw):
        train = TrainingSpec(global_batch_size=8, seq_length=2048, dtype="bf16", kernels=kernels, **kw)
        return layer_cost(block, Context(cluster=cluster, training=train, tp=1, cp=1, sp=False, ep=1, mbs=2))

    own, megatron = cost(), cost(runtime_memory=False)
    units = 2 * 2048 * m.hidden_size
    assert own.act_none / units == pytest.approx(census, rel=0.005)
    a = block.attention
    core = 2 * 2048 * 2 * (a.heads - a.kv_heads) * a.head_dim * 2  # tokens x K and V x extra heads x bf16
    assert own.act_none - own.act_selective == pytest.approx(core)
    assert own.act_full == megatron.act_full
    assert megatron.act_none < own.act_none


@pytest.mark.parametrize("model,gib", [("gpt3-1.3b", 0.39), ("benchmarks/gpu/llama-3.2-1b.config.json", 0.98)])
def test_loss_backward_is_the_wider_transient(model, gib):
    """The loss's transient is the wider of its forward (bf16 logits and their fp32 copy beside the kept
    log-softmax: 6 bytes per logit) and its backward (the fp32 gradients of the log-softmax and of the logits: 8):
    on an H200 (session 17, benchmarks/gpu/saved.py) the step's allocator peak exceeded the forward's by 0.39 GiB
    for GPT-1.3B and 0.98 GiB for Llama-3.2-1B at 2 x 2048 tokens, 2 bytes per logit."""
    from autoplan.cost_models.compute import loss_transient

    head = profile_from_spec(load_model(model))[-1]
    train = TrainingSpec(global_batch_size=8, seq_length=2048, dtype="bf16")
    ctx = Context(cluster=load_cluster("dgx-h200", gpus=1), training=train, tp=1, cp=1, sp=False, ep=1, mbs=2)
    logits = 2 * 2048 * head.logits_per_token
    assert loss_transient(head, ctx) == pytest.approx(8 * logits)
    assert (8 - 6) * logits / 2**30 == pytest.approx(gib, abs=0.005)
