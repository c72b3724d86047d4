"""Captures of zoo models against the analytic `profile_from_spec`: FLOPs, parameters, layer by layer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from autoplan.cost_models.profile import profile_from_spec
from autoplan.specs import ModelSpec, MoESpec, load_model

# Fields where capture and the analytic profile legitimately differ (see the capture module docstrings):
# GEMM names are module paths in a capture, and kernel launches follow a structural rule there.
_IGNORED = {"kernels_fwd"}


def _compare(cap, ref, ignore=_IGNORED):
    a, b = cap.model_dump(), ref.model_dump()
    for g in (*a["gemms"], *b["gemms"]):
        g["name"] = ""
    return {k: (a[k], b[k]) for k in a if k not in ignore and a[k] != b[k]}


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_flops_and_params_equal_the_analytic_formulas(spec_graph, name):
    spec = load_model(name)
    g = spec_graph(name)
    ref = profile_from_spec(spec)
    assert g.num_layers == spec.num_layers
    assert g.num_parameters == sum(p.params for p in ref)  # exactly
    assert [p.params for p in g.profiles] == [p.params for p in ref]
    for seq in (64, 2048, 8192):
        want = sum(p.model_flops_per_token(seq) for p in ref)
        assert g.flops_per_token(seq) == pytest.approx(want, rel=1e-9)
        assert g.model_flops_per_step(32, seq) == pytest.approx(3 * 32 * seq * want, rel=1e-9)
    # the per-op FLOPs of the captured graph agree with the per-token profile at the captured shape
    op_flops = sum(o.flops for o in g.ops.values() if o.kind in ("gemm", "attention", "matmul"))
    assert op_flops / (g.capture_batch * g.capture_seq) == pytest.approx(g.flops_per_token(g.capture_seq))


def test_gpt_flops_per_step_match_korthikanti_eq7(spec_graph):
    """72 B s l h^2 (1 + s/6h + V/12hl): the closed form for GPT (ffn 4h, tied embeddings)."""
    spec = load_model("tiny-gpt")
    g = spec_graph("tiny-gpt")
    b, s, l, h, v = 8, 64, spec.num_layers, spec.hidden_size, spec.vocab_size
    eq7 = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * h * l))
    assert g.model_flops_per_step(b, s) == pytest.approx(eq7, rel=1e-9)


def test_a_dropout_after_the_last_gemm_is_seen_by_capture_and_by_the_formulas():
    """With hidden dropout the block's mask after w2 is the last tensor its backward keeps, so a checkpoint that
    stops early re-runs w2 (compute.early_stop_skips_last_gemm): capture finds it in the graph, the analytic
    profile from the spec's dropout, and the two profiles agree field by field."""
    from autoplan.capture import capture_spec

    spec = load_model("tiny-gpt").model_copy(update={"dropout": 0.1})
    cap = capture_spec(spec).profiles
    ref = profile_from_spec(spec)
    assert [p.saves_after_last_gemm for p in cap] == [p.kind == "block" for p in cap]
    for c, r in zip(cap, ref):  # the blocks (the formulas give the embedding a dropout the zoo model has not)
        if c.kind == "block":
            assert _compare(c, r) == {}, c.name
    assert not any(p.saves_after_last_gemm for p in profile_from_spec(load_model("tiny-gpt")))


def test_a_norm_after_the_last_gemm_is_seen_by_capture():
    """A post-norm block's last norm keeps fc2's output (its input) for the backward: capture marks the block, so
    the cost model prices the early-stopped re-run with fc2 in it; the same blocks pre-norm, without dropout, not."""
    from autoplan.capture import capture_model_ref

    pre, post = capture_model_ref("_models:tiny_lm"), capture_model_ref("_models:post_norm_lm")
    assert [p.kind for p in pre.profiles].count("block") == 3
    assert not any(p.saves_after_last_gemm for p in pre.profiles)
    assert [p.saves_after_last_gemm for p in post.profiles] == [p.kind == "block" for p in post.profiles]


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_layer_by_layer_profiles_match(spec_graph, name):
    g = spec_graph(name)
    ref = profile_from_spec(load_model(name))
    assert [p.name for p in g.profiles] == [p.name for p in ref]
    for cap, r in zip(g.profiles, ref):
        assert _compare(cap, r) == {}, cap.name


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_kernel_launches_follow_the_structural_rule(spec_graph, name):
    """Blocks: one launch per GEMM, attention core, norm and fused element-wise region (two residual adds,
    the activation, RoPE on q and on k). The analytic profile uses constants for blocks (14, +2 with RoPE),
    which differ: see the report. Embedding and head follow the same conventions as the analytic profile."""
    g = spec_graph(name)
    ref = profile_from_spec(load_model(name))
    assert g.profiles[0].kernels_fwd == ref[0].kernels_fwd
    assert g.profiles[-1].kernels_fwd == ref[-1].kernels_fwd
    blk = g.profiles[1]
    regions = 3 + (2 if name == "tiny-llama" else 0)
    assert blk.kernels_fwd == len(blk.gemms) + 1 + 2 + regions


def test_groups_and_structure(spec_graph):
    g = spec_graph("tiny-llama")
    assert g.blocks == [f"layers.{i}" for i in range(4)]
    assert len(g.block_groups) == 1 and g.block_groups[0].count == 4
    assert g.block_groups[0].label() == "layers.0 … layers.3 ×4 identical"
    assert list(g.layers.nodes) == ["embedding", *g.blocks, "head"]
    assert g.layers.has_edge("layers.0", "layers.1") and g.layers.has_edge("embedding", "layers.0")
    info = g.layer("layers.2")
    assert info.kind == "block" and info.index == 2 and info.ops.number_of_nodes() == len(info.order)
    blk = g.profiles[1]
    roles = {gm.name: gm.tp for gm in blk.gemms}
    assert roles == {"attention.wq": "col", "attention.wk": "col", "attention.wv": "col", "attention.wo": "row",
                     "mlp.w1": "col", "mlp.w3": "col", "mlp.w2": "row"}
    assert (blk.attention.heads, blk.attention.kv_heads, blk.attention.head_dim) == (4, 2, 16)
    assert g.profiles[-1].gemms[0].tp == "vocab"
    lin = next(o for o in g.ops.values() if o.opname == "linear" and o.module == "layers.0.mlp.w1")
    assert lin.flops == 2 * 16 * 64 * 176 and lin.param_bytes == 176 * 64 * 2
    assert lin.bytes_read == (16 * 64 + 176 * 64) * 2 and lin.bytes_written == 16 * 176 * 2


def test_moe_and_heterogeneous_layers():
    from autoplan.capture import capture_spec

    spec = ModelSpec(name="tiny-moe-alt", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                     ffn_hidden_size=128, vocab_size=128, max_seq_length=64, activation="swiglu", norm="rmsnorm",
                     position="rope", bias=False,
                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=96, every_n_layers=2))
    g = capture_spec(spec)
    ref = profile_from_spec(spec)
    assert [grp.members for grp in g.block_groups] == [["layers.0", "layers.2"], ["layers.1", "layers.3"]]
    assert g.num_parameters == sum(p.params for p in ref)
    for cap, r in zip(g.profiles, ref):
        assert cap.params == r.params and cap.moe_experts == r.moe_experts and cap.moe_top_k == r.moe_top_k
        assert cap.model_flops_per_token(64) == pytest.approx(r.model_flops_per_token(64), rel=1e-9)
    moe = g.profiles[2]
    by_name = {gm.name: gm for gm in moe.gemms}
    assert by_name["mlp.router"].tp == "replicated"
    w1 = by_name["mlp.experts.*.w1"]
    assert (w1.expert, w1.count, w1.tokens_per_token, w1.tp) == (True, 4, 2.0, "col")
    assert by_name["mlp.experts.*.w2"].tp == "row" and moe.tp_allreduces == 2


_TIMING = textwrap.dedent("""
    import json, resource, sys, time
    t0, c0 = time.perf_counter(), time.process_time()
    from autoplan.capture import capture_spec
    g = capture_spec("gpt3-175b")
    t1, c1 = time.perf_counter(), time.process_time()
    json.dump({"seconds": t1 - t0, "cpu_seconds": c1 - c0,
               "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
               "num_layers": g.num_layers, "num_parameters": g.num_parameters,
               "groups": [grp.count for grp in g.block_groups],
               "profiles": [p.model_dump() for p in g.profiles]}, sys.stdout)
""")


@pytest.fixture(scope="module")
def gpt3_175b():
    """The full 96-block GPT-3 175B capture, in a fresh process (time includes importing torch)."""
    out = subprocess.run([sys.executable, "-c", _TIMING], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_gpt3_175b_full_capture_under_20s_and_2gib(gpt3_175b):
    """All 96 blocks exported (import of autoplan.capture and torch included). CPU time, not wall time, is
    asserted: the wall clock of a shared 2-core machine measures the neighbours (8-9 s wall when idle)."""
    assert gpt3_175b["num_layers"] == 96 and gpt3_175b["groups"] == [96]
    ref = profile_from_spec(load_model("gpt3-175b"))
    assert gpt3_175b["num_parameters"] == sum(p.params for p in ref)
    assert gpt3_175b["cpu_seconds"] < 20, gpt3_175b
    assert gpt3_175b["rss_gib"] < 2, gpt3_175b["rss_gib"]


@pytest.mark.parametrize("cfg", ["tp=8,pp=16,dp=8", "tp=8,pp=8,dp=16,recompute=selective",
                                 "tp=8,pp=8,dp=16,sp=1,recompute=full", "tp=4,pp=16,dp=16,vp=2"])
def test_gpt3_175b_step_estimate_within_1pct_of_spec(gpt3_175b, cfg):
    from autoplan.cost_models.estimate import estimate
    from autoplan.cost_models.profile import LayerProfile
    from autoplan.specs import ParallelConfig, TrainingSpec, check_config, load_cluster

    spec = load_model("gpt3-175b")
    cluster = load_cluster("dgx-a100-80g", 1024)
    train = TrainingSpec(global_batch_size=1536, seq_length=2048)
    conf = check_config(ParallelConfig.parse(cfg), spec, cluster, train)
    cap = [LayerProfile(**p) for p in gpt3_175b["profiles"]]
    a = estimate(cap, cluster, train, conf)
    b = estimate(profile_from_spec(spec), cluster, train, conf)
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=0.01)
    assert a.peak_memory_gib == pytest.approx(b.peak_memory_gib, rel=0.01)
    assert a.model_flops == pytest.approx(b.model_flops, rel=1e-9)
