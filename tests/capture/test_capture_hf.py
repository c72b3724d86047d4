"""Hugging Face models built from tiny configs on the meta device: grouping, counts, attention, loaders."""

from __future__ import annotations

import functools
import json
import sys

import pytest

pytest.importorskip("transformers")

from autoplan.capture import (  # noqa: E402
    CaptureError,
    capture_hf_config,
    capture_hf_model,
    capture_model_ref,
    hf_model_from_config,
)
from autoplan.cost_models.profile import profile_from_spec  # noqa: E402
from autoplan.specs import model_from_hf_config  # noqa: E402

GPT2 = dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=176, vocab_size=128, max_position_embeddings=64)


@functools.cache
def _hf(kind: str, attn: str = "sdpa"):
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, attn_implementation=attn)
    else:
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=176, vocab_size=128, max_position_embeddings=64,
                          attn_implementation=attn)
    model = hf_model_from_config(cfg)
    return model, capture_hf_model(model)


def _unique_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates tied weights


def test_gpt2_grouping_and_counts():
    model, g = _hf("gpt2")
    assert g.method == "torch.export"
    assert g.blocks == ["transformer.h.0", "transformer.h.1"] and g.num_layers == 2
    assert [grp.label() for grp in g.block_groups] == ["transformer.h.0 … transformer.h.1 ×2 identical"]
    assert g.num_parameters == _unique_params(model) == sum(p.params for p in g.profiles)
    blk = g.profiles[1]
    assert [(gm.name, gm.n, gm.k, gm.tp) for gm in blk.gemms] == [
        ("attn.c_attn", 192, 64, "col"), ("attn.c_proj", 64, 64, "row"),
        ("mlp.c_fc", 256, 64, "col"), ("mlp.c_proj", 64, 256, "row")]
    a = blk.attention
    assert (a.heads, a.kv_heads, a.head_dim, a.dropout) == (4, 4, 16, True)  # GPT-2 configs default to 0.1
    # resid_pdrop 0.1: the dropout after mlp.c_proj keeps a mask, so an early-stopped re-run still runs c_proj
    assert blk.saves_after_last_gemm and not g.profiles[0].saves_after_last_gemm
    head = g.profiles[-1]
    assert head.gemms[0].tp == "vocab" and head.gemms[0].count == 0  # tied to wte
    assert head.logits_per_token == 128
    spec = model_from_hf_config(GPT2)
    assert g.flops_per_token(64) == pytest.approx(sum(p.model_flops_per_token(64) for p in profile_from_spec(spec)))


def test_llama_gqa_grouping_and_profile_match_the_spec_mapping():
    model, g = _hf("llama")
    assert g.blocks == ["model.layers.0", "model.layers.1"] and len(g.block_groups) == 1
    assert g.num_parameters == _unique_params(model)
    blk = g.profiles[1]
    assert (blk.attention.heads, blk.attention.kv_heads, blk.attention.head_dim) == (4, 2, 16)
    ref = profile_from_spec(model_from_hf_config(LLAMA))
    for cap, r in zip(g.profiles, ref):
        a, b = cap.model_dump(), r.model_dump()
        for d in (a, b):
            d.pop("name"), d.pop("kernels_fwd")
            for gm in d["gemms"]:
                gm.pop("name")
        assert a == b, cap.name


def test_eager_attention_is_found_from_the_matmul_softmax_matmul_pattern():
    _, sdpa = _hf("gpt2")
    _, eager = _hf("gpt2", "eager")
    assert not any(o.kind == "attention" for o in eager.ops.values())
    a, b = eager.profiles[1], sdpa.profiles[1]
    assert a.attention == b.attention
    assert eager.flops_per_token(64) == pytest.approx(sdpa.flops_per_token(64))
    # saved per score: softmax output 2 bytes + dropout mask 1 + dropout output 2, per head (counted from the
    # real ops here; the fused SDPA reports the same convention)
    assert a.act_scores_per_seq == b.act_scores_per_seq == 4 * 5


def test_hf_config_file_and_model_refs(tmp_path):
    path = tmp_path / "tiny-llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA))
    g = capture_hf_config(path)
    assert g.num_layers == 2 and g.name == "tiny-llama" and g.seq == 64
    assert capture_model_ref(str(path.parent)).num_parameters == g.num_parameters
    assert capture_model_ref("gpt3-175b") is None  # presets take the analytic path
    spec = tmp_path / "model.yaml"
    spec.write_text("name: x\nnum_layers: 2\n")
    assert capture_model_ref(str(spec)) is None


def test_missing_transformers_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(CaptureError, match="transformers") as e:
        capture_hf_config(path)
    assert "pip install" in e.value.hint


def test_unknown_model_type_is_a_capture_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 8}))
    with pytest.raises(CaptureError, match="no-such-model"):
        capture_hf_config(path)


def test_hf_config_capture_is_the_module_autoplan_runs(tmp_path):
    """A config.json is captured through `autoplan.models.build` (what `autoplan run` trains), not transformers'
    class: the parameter count is still transformers', and the MoE FLOPs are what runs -- every token through
    top_k experts (balanced), Qwen2-MoE's shared expert and its dense `mlp_only_layers` included. (transformers'
    own modules traced on meta lose most routed expert work: Mixtral's capture there has half the FLOPs.)"""

    from autoplan.models import build

    cfg = dict(model_type="qwen2_moe", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
               decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=False)
    path = tmp_path / "qmoe" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    g = capture_hf_config(path)
    theirs = hf_model_from_config(dict(cfg))
    assert g.num_parameters == _unique_params(theirs)
    ours = build(path, device="meta")
    assert g.num_parameters == sum(p.numel() for p in ours.parameters())
    # forward FLOPs per token of the blocks, by hand: attention projections, the scores, and per layer either the
    # dense SwiGLU (layer 1) or router + 2 of 4 experts + shared expert + its gate (layers 0 and 2)
    h, s, kv = 32, g.seq, 2 * 8  # kv: 2 heads of 8
    attn = 2 * h * (h + 2 * kv + h) + 2 * 2 * s * h  # q, k, v, o; QK^T and PV counted in full (causal in full)
    swiglu = lambda f: 2 * 3 * h * f  # noqa: E731
    moe = 2 * h * 4 + 2 * swiglu(16) + swiglu(24) + 2 * h * 1
    blocks = [p for p in g.profiles if p.kind == "block"]
    assert len(blocks) == 3
    got = [p.model_flops_per_token(s) for p in blocks]
    assert got == pytest.approx([attn + moe, attn + swiglu(48), attn + moe], rel=1e-6), got
