"""torchtitan's per-op selective activation checkpointing (`selective_policy='every_other_matmul'`, the torchtitan
stack's `recompute=selective`): which GEMMs it re-runs, what the re-run costs, what a block keeps, and that
autoplan's own stack keeps Megatron's attention-core selective recomputation."""

from __future__ import annotations

import pytest

from autoplan.cost_models import comm
from autoplan.cost_models.compute import _attention, _gemm_parts, layer_cost, op_sac_reruns, tp_units
from autoplan.cost_models.estimate import context
from autoplan.cost_models.hardware import cluster_preset
from autoplan.cost_models.profile import profile_from_spec
from autoplan.cost_models.specs import ModelSpec, ParallelConfig, TrainingSpec
from autoplan.cost_models.stacks import STACKS, apply_stack

LLAMA = ModelSpec(name="llama-ish", num_layers=4, hidden_size=1024, num_attention_heads=16, num_kv_heads=4,
                  ffn_hidden_size=2816, vocab_size=32000, max_seq_length=2048, activation="swiglu", norm="rmsnorm",
                  position="rope")


def _ctx(stack: str, tp: int = 1, sp: int = 0, overrides: dict | None = None):
    training = apply_stack(TrainingSpec(global_batch_size=8, seq_length=2048), stack, overrides)
    cfg = ParallelConfig(tp=tp, pp=1, dp=8 // tp, mbs=1, sp=sp, zero=3, recompute="selective")
    return context(cluster_preset("dgx-a100-80g").with_gpus(8), training, cfg)


def test_every_second_matmul_of_a_block_is_rerun():
    """SelectiveAC counts the block's mm calls in forward order and re-runs the even ones: wk, wo and w3 of a
    Llama block (wq, wv, w1 and w2 are kept); a MoE router's gate and the experts' grouped GEMMs always re-run."""
    block = profile_from_spec(LLAMA)[1]
    assert [g.name for g in block.gemms] == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    assert op_sac_reruns(block) == [False, True, False, True, False, True, False]
    moe_spec = ModelSpec.model_validate({**LLAMA.model_dump(), "moe": {"num_experts": 8, "top_k": 2}})
    moe = next(p for p in profile_from_spec(moe_spec) if any(g.expert for g in p.gemms))
    flags = dict(zip([g.name for g in moe.gemms], op_sac_reruns(moe), strict=True))
    assert flags["router"] and all(flags[g.name] for g in moe.gemms if g.expert)
    assert [flags[n] for n in ("wq", "wk", "wv", "wo")] == [False, True, False, True]


def test_only_the_torchtitan_stack_recomputes_per_operator():
    assert STACKS["torchtitan"].knobs["selective_policy"] == "every_other_matmul"
    assert all(s.knobs["selective_policy"] == "attention_core" for n, s in STACKS.items() if n != "torchtitan")


def test_the_rerun_costs_its_gemms_and_every_elementwise_op():
    """On a GPU host without tensor parallelism the re-run is the re-run GEMMs plus the forward's elementwise
    passes (norms, SwiGLU, RoPE, residuals), not the attention kernel; its FLOPs are exactly the re-run GEMMs'."""
    block = profile_from_spec(LLAMA)[1]
    ctx = _ctx("torchtitan")
    cost = layer_cost(block, ctx)
    parts = _gemm_parts(block, ctx)
    reruns = op_sac_reruns(block)
    gemm_t = sum(t for (t, _), r in zip(parts, reruns, strict=True) if r)
    assert cost.recompute_flops_selective == pytest.approx(sum(f for (_, f), r in zip(parts, reruns, strict=True) if r))
    # the elementwise forward is what the full forward has beyond its GEMMs and the attention kernel
    plain = layer_cost(block, _ctx("torchtitan", overrides={"selective_policy": "attention_core"}))
    assert plain.recompute_selective_s == 0.0  # flash with its outputs kept: nothing re-runs, nothing is saved
    assert plain.act_selective == plain.act_none
    assert gemm_t < cost.recompute_selective_s < cost.fwd_s
    # device-bound here (15 kernels x 4 us of host time against ~0.4 ms): the forward is GEMMs + attention +
    # elementwise, so the re-run is the forward less the kept GEMMs and the attention kernel, exactly
    kept_t = sum(t for (t, _), r in zip(parts, reruns, strict=True) if not r)
    assert cost.recompute_selective_s == pytest.approx(cost.fwd_s - kept_t - _attention(block, ctx)[0])
    # full AC re-runs the whole block (torchtitan's early_stop=False since 2025-08); with the 2024 code's early
    # stop (checkpoint_early_stop=true) the re-run ends before the block's last GEMM
    assert cost.recompute_full_s == pytest.approx(cost.fwd_s)
    early = layer_cost(block, _ctx("torchtitan", overrides={"checkpoint_early_stop": True}))
    assert early.recompute_full_s == pytest.approx(cost.fwd_s - parts[-1][0])
    assert cost.checkpoint_selective_s == 0.0


def test_the_rerun_repeats_the_forwards_gathers_and_all_reduces_not_its_reduce_scatters():
    block = profile_from_spec(LLAMA)[1]
    for sp in (0, 1):
        ctx = _ctx("torchtitan", tp=2, sp=sp)
        cost = layer_cost(block, ctx)
        grp = comm.group_of(ctx.cluster, 2, 1)
        times = {c: {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather,
                     "reduce_scatter": comm.reduce_scatter}[c](ctx.cluster, grp, b)
                 for c, b in tp_units(block, ctx)[0].items()}
        # the forward's exposed TP time (async TP hides part of it in torchtitan), less the reduce-scatters' share
        expected = cost.comm_fwd_s * (1 - times.get("reduce_scatter", 0.0) / sum(times.values()))
        parts = _gemm_parts(block, ctx)
        kept_t = sum(t for (t, _), r in zip(parts, op_sac_reruns(block), strict=True) if not r)
        device = cost.fwd_s - cost.comm_fwd_s - kept_t - _attention(block, ctx)[0]
        assert expected > 0 and cost.recompute_selective_s == pytest.approx(device + expected)
        if sp:  # the reduce-scatter is half of sp's forward traffic and is not repeated
            assert expected < cost.comm_fwd_s
        else:
            assert expected == pytest.approx(cost.comm_fwd_s)


def test_what_a_block_keeps():
    """The region's input, the kept GEMMs' outputs (column-parallel n/tp, row-parallel the whole pre-reduction
    output), the attention kernel's context and log-sum-exp, and under sp the reduce-scatters' outputs."""
    block = profile_from_spec(LLAMA)[1]
    h, kv = 1024, 4 * 64
    for tp, sp in ((1, 0), (2, 1)):
        ctx = _ctx("torchtitan", tp=tp, sp=sp)
        cost = layer_cost(block, ctx)
        tok, e = ctx.tokens, ctx.act_bytes
        kept_gemms = tok * e * (h / tp + kv / tp + 2816 / tp + h)  # wq, wv, w1 (column), w2 (row, unreduced)
        attention = tok * e * h / tp + tok * 16 / tp * 4.0  # context + fp32 log-sum-exp per head
        scattered = block.tp_allreduces * tok * h / tp * e if sp else 0.0
        assert cost.act_selective == pytest.approx(cost.act_full + kept_gemms + attention + scattered)
        assert cost.act_full < cost.act_selective < cost.act_none


def test_autoplans_stack_keeps_the_attention_core_policy():
    block = profile_from_spec(LLAMA)[1]
    own = layer_cost(block, _ctx("autoplan"))
    assert own.recompute_flops_selective > 0  # the runtime's checkpointed core re-runs the flash forward
    gemm_flops = sum(f for _, f in _gemm_parts(block, _ctx("autoplan")))
    assert own.recompute_flops_selective == pytest.approx(own.model_flops - gemm_flops)  # attention only
