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
    cp_mask_tensors,
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
    against the keys up to its end; K and V gathered before it (nothing hides them) and their gradients sent back
    by an all-to-all after its backward. On a GPU the chunks' masks are torch's lower-right causal bias, applied
    inside the kernel: the causal half of the scores, as ring attention's kernel, and no mask tensor."""
    block, own = _block_ctx("autoplan")
    _, ring = _block_ctx("autoplan", {"cp_attention": "ring"})
    assert cp_masked_attention(own) and not cp_masked_attention(ring)
    assert not cp_mask_tensors(own)  # a GPU cluster
    assert cp_score_fraction(own) == pytest.approx(17 / 32) and cp_score_fraction(ring) == 1.0  # cp = 8: shapes
    f_own, b_own, flops_own = _attention(block, own)
    assert (f_own, b_own, flops_own) == _attention(block, ring) and flops_own == _attention_flops(block, own)
    grp = comm.group_of(own.cluster, own.cp, own.tp)
    kv = cp_kv_bytes(block, own)
    cf, cb = _cp_comm(block, own, f_own)
    assert cf == pytest.approx(2 * comm.all_gather(own.cluster, grp, kv) + 2 * _mem_time(own, 2 * kv))
    assert cb > 2 * comm.all_to_all(own.cluster, grp, kv)
    # ring attention hides most of its transfers behind the attention
    rf, rb = _cp_comm(block, ring, f_ring := _attention(block, ring)[0])
    assert f_ring == f_own and rf < cf and rb < cb


def test_on_cpu_processes_the_core_computes_every_score_of_its_prefixes_through_masks():
    """torch's CPU kernels have no lower-right causal bias: the core passes boolean masks, every score of a chunk
    against its key prefix is computed ((2cp+1)/(4cp) of the rank's s/cp x s, against a causal kernel's half),
    and SDPA builds and reads the fp32 masks."""
    model, cluster = load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(4)
    training = TrainingSpec(global_batch_size=4, seq_length=64, dtype="fp32")
    block = profile_from_spec(model)[1]
    ctxs = {}
    for par in ("cp=4,mbs=1", "dp=4,mbs=1"):
        ctxs[par] = context(cluster, training, check_config(ParallelConfig.parse(par), model, cluster, training))
    own, plain = ctxs["cp=4,mbs=1"], ctxs["dp=4,mbs=1"]
    assert cp_mask_tensors(own) and cp_score_fraction(own) == pytest.approx(9 / 16)
    f_own = _attention(block, own)[0]
    f_plain = _attention(block, plain)[0]  # the causal kernel over the whole sequence: 4x this rank's queries
    c = own.seq / (2 * own.cp)
    mask = c * c * (2 * own.cp + 1)
    assert f_own == pytest.approx(f_plain / own.cp * 2 * 9 / 16 + _mem_time(own, mask * CP_MASK_FWD_BYTES))


def test_the_lower_right_causal_bias_is_the_chunks_mask():
    """What a GPU runs (torch's causal_lower_right: a chunk's queries are the last positions of its key prefix)
    gives the outputs and gradients of the boolean masks a CPU passes; the upper-left variant would not."""
    import torch
    from torch.nn.attention.bias import causal_upper_left

    from autoplan.runtime import parallelize as par

    torch.manual_seed(0)
    s, n, d = 48, 3, 8
    for cp in (2, 3):
        for r in range(cp):
            masks, ends = par.cp_chunk_masks(par.load_balanced_positions(s, cp, r))
            q, k, v = (torch.randn(2, n, length, d, dtype=torch.float64, requires_grad=True)
                       for length in (s // cp, s, s))
            g = torch.randn(2, n, s // cp, d, dtype=torch.float64)
            want = par.prefix_attention(q, k, v, masks, ends)
            got = par.prefix_attention(q, k, v, None, ends)
            assert torch.equal(want, got)
            for a, b in zip(torch.autograd.grad(want, (q, k, v), g), torch.autograd.grad(got, (q, k, v), g),
                            strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
            c = s // (2 * cp)
            if ends[0] > c:  # a chunk shorter than its prefix: the alignment matters
                wrong = torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, :c], k[:, :, :ends[0]], v[:, :, :ends[0]], attn_mask=causal_upper_left(c, ends[0]))
                assert not torch.allclose(wrong, want[:, :, :c])


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
