"""Context parallelism priced as each stack runs it (`TrainingSpec.cp_attention`): ring attention for Megatron-Core
and torchtitan, K/V all-gathered for Llama 3's stack, and for autoplan's runtime the gather plus one masked SDPA
per query chunk over its key prefix, every score of it computed (measured on this machine by
benchmarks/cp_pricing.py: before session 24, priced as ring attention, the cp layouts ran 2.1-2.4x their prediction
where the data-parallel control ran 1.3x)."""

import pytest

from autoplan.cost_models import comm
from autoplan.cost_models.compute import (
    CP_MASK_FWD_BYTES,
    _attention,
    _attention_flops,
    _cp_comm,
    _mem_time,
    cp_kv_bytes,
    cp_masked_attention,
    cp_score_fraction,
)
from autoplan.cost_models.estimate import context, layer_cost
from autoplan.cost_models.profile import profile_from_spec
from autoplan.cost_models.stacks import apply_stack
from autoplan.specs import ParallelConfig, TrainingSpec, check_config, load_cluster, load_model


def _block_ctx(stack: str | None, overrides: dict | None = None, parallel: str = "tp=8,cp=8,mbs=1,zero=1",
               seq: int = 32768):
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", gpus=64)
    training = apply_stack(TrainingSpec(global_batch_size=64, seq_length=seq), stack, overrides or {})
    cfg = check_config(ParallelConfig.parse(parallel), model, cluster, training)
    return profile_from_spec(model)[1], context(cluster, training, cfg)


def test_the_stacks_say_how_context_parallel_attention_runs():
    base = TrainingSpec(global_batch_size=8, seq_length=4096)
    assert base.cp_style == "all_gather_masked"  # autoplan's runtime (runtime_memory)
    assert apply_stack(base, "autoplan", {}).cp_style == "all_gather_masked"
    for stack in ("megatron-core", "torchtitan", "megatron-2022"):
        assert apply_stack(base, stack, {}).cp_style == "ring"
    assert apply_stack(base, "megatron-core", {"cp_attention": "all_gather"}).cp_style == "all_gather"


def test_autoplans_core_computes_its_query_chunks_against_their_key_prefixes_and_its_gathers_are_exposed():
    """The runtime's core (runtime.parallelize.ContextParallelAttentionCore): each of a rank's two query chunks
    against the keys up to its end, masked, every score computed: (2cp+1)/(4cp) of the rank's s/cp x s scores
    against ring attention's causal half, plus the fp32 masks SDPA builds and reads; K and V gathered before it
    (nothing hides them) and their gradients sent back by an all-to-all after its backward."""
    block, own = _block_ctx("autoplan")
    _, ring = _block_ctx("autoplan", {"cp_attention": "ring"})
    assert cp_masked_attention(own) and not cp_masked_attention(ring)
    assert cp_score_fraction(own) == pytest.approx(17 / 32) and cp_score_fraction(ring) == 1.0  # cp = 8
    f_own, b_own, flops_own = _attention(block, own)
    f_ring, b_ring, flops_ring = _attention(block, ring)
    assert flops_own == flops_ring == _attention_flops(block, own)  # the model FLOPs are the same
    c = own.seq / (2 * own.cp)
    mask = c * c * (2 * own.cp + 1)
    assert f_own == pytest.approx(f_ring * 2 * 17 / 32 + _mem_time(own, mask * CP_MASK_FWD_BYTES))
    assert b_own > b_ring * 2 * 17 / 32
    grp = comm.group_of(own.cluster, own.cp, own.tp)
    kv = cp_kv_bytes(block, own)
    cf, cb = _cp_comm(block, own, f_own)
    assert cf == pytest.approx(2 * comm.all_gather(own.cluster, grp, kv) + 2 * _mem_time(own, 2 * kv))
    assert cb > 2 * comm.all_to_all(own.cluster, grp, kv)
    # ring attention hides most of its transfers behind the attention
    rf, rb = _cp_comm(block, ring, f_ring)
    assert rf < cf and rb < cb


def test_llama3s_all_gather_is_exposed_but_skips_the_causal_half():
    block, ag = _block_ctx("megatron-core", {"cp_attention": "all_gather"})
    _, ring = _block_ctx("megatron-core")
    assert _attention(block, ag) == _attention(block, ring)  # the same causal kernel
    grp = comm.group_of(ag.cluster, ag.cp, ag.tp)
    kv = cp_kv_bytes(block, ag)
    assert _cp_comm(block, ag, 0.0) == pytest.approx((2 * comm.all_gather(ag.cluster, grp, kv),
                                                      2 * comm.reduce_scatter(ag.cluster, grp, kv)))


def test_the_runtimes_selective_recompute_gathers_k_and_v_again():
    """The checkpointed attention core holds the gathers (counts.layer_comm books them twice): its re-run in the
    backward costs them again."""
    block, own = _block_ctx("autoplan", parallel="tp=8,cp=8,mbs=1,zero=1,recompute=selective", seq=131072)
    c = layer_cost(block, own)
    attn = _attention(block, own)[0]
    cf, _ = _cp_comm(block, own, attn)
    assert cf > 0
    # device-bound at 128k tokens (the checkpoint's host time hides under it): the re-run is the core and its gathers
    assert c.checkpoint_selective_s == 0.0
    assert c.recompute_selective_s == pytest.approx(attn + cf, rel=1e-9)


def test_a_plan_of_autoplans_stack_with_another_cp_attention_is_not_run():
    from autoplan.api import make_plan
    from autoplan.runtime.launch import check_stack

    tiny, cpu = load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(2)
    small = TrainingSpec(global_batch_size=4, seq_length=64, dtype="fp32")
    for layout, value, refused in (("cp=2", "ring", True), ("cp=2", "all_gather_masked", False),
                                   ("cp=2", None, False), ("dp=2", "ring", False)):
        overrides = {"cp_attention": value}
        plan = make_plan(tiny, cpu, apply_stack(small, "autoplan", overrides), layout)
        label = "autoplan" + ("" if value is None else f"+cp_attention={value}")
        assert bool(check_stack(plan.model_copy(update={"stack": label}).sealed())) is refused, (layout, value)
