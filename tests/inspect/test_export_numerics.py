"""Exports of a Hugging Face model carry its numerics (rotary base and scaling, norm epsilon, biases, activation,
dropout, sliding windows), and name what the framework cannot express, instead of leaving Megatron's defaults."""

from __future__ import annotations

import pytest

from autoplan.api import make_plan
from autoplan.inspect import export_check as ec
from autoplan.inspect import export_megatron, export_torchtitan
from autoplan.inspect.export import megatron_arch
from autoplan.specs import TrainingSpec, load_cluster, load_model, model_from_hf_config

pytest.importorskip("transformers")

LLAMA31 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
           "intermediate_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4,
           "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}, "tie_word_embeddings": False}
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 512, "intermediate_size": 1536,
         "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1024,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "use_sliding_window": True, "sliding_window": 1024, "max_window_layers": 2, "tie_word_embeddings": True}
GEMMA2 = {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 512,
          "intermediate_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
          "num_hidden_layers": 4, "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
          "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
          "sliding_window": 512, "hidden_activation": "gelu_pytorch_tanh"}
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 512, "n_head": 8, "n_layer": 4,
        "n_positions": 1024, "vocab_size": 1024, "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}


def hf_plan(cfg: dict, parallel: str = "tp=2,pp=2,mbs=1,sp=1"):
    model = model_from_hf_config(cfg, name=cfg["model_type"] + "-test")
    training = TrainingSpec(global_batch_size=32, seq_length=1024)
    plan = make_plan(model, load_cluster("dgx-h100", gpus=16), training, parallel, kernels="torch")
    return plan.model_copy(update={"model_source": {"hf_config": cfg}, "content_hash": ""}).sealed()


def core_accepts(d: dict) -> None:
    """megatron.core's TransformerConfig takes the flags (the megatron-core wheel is in the `test` extra; the
    Megatron-LM parse is the last test's, where a checkout is at hand)."""
    assert ec.check_megatron_core(d) is None


def test_llama3_numerics_reach_the_megatron_flags():
    plan = hf_plan(LLAMA31)
    d = export_megatron(plan)
    f = d["flags"]
    # Megatron's defaults are rotary base 10000 and no scaling: left out, the export trained another model
    assert f["--rotary-base"] == 500000 and f["--use-rope-scaling"] is True and f["--rope-scaling-factor"] == 8.0
    assert f["--norm-epsilon"] == 1e-5 and f["--swiglu"] is True and f["--disable-bias-linear"] is True
    assert "--window-size" not in f and "--add-qkv-bias" not in f
    assert not [w for w in d["warnings"] if "rotary" in w or "numerics" in w], d["warnings"]
    core_accepts(d)
    # Megatron fixes the llama3 scaling's other constants: a config that differs is named
    other = dict(LLAMA31, rope_scaling=dict(LLAMA31["rope_scaling"], high_freq_factor=2.0))
    (w,) = [w for w in export_megatron(hf_plan(other))["warnings"] if "llama3 rotary scaling" in w]
    assert "high_freq_factor" in w and "low_freq_factor" not in w


def test_qwen2_qkv_bias_and_sliding_layers():
    plan = hf_plan(QWEN2)
    d = export_megatron(plan)
    f = d["flags"]
    assert f["--add-qkv-bias"] is True and f["--disable-bias-linear"] is True
    assert f["--rotary-base"] == 1000000 and f["--norm-epsilon"] == 1e-6
    # Qwen2's sliding window starts at max_window_layers: layers 2 and 3 slide, 0 and 1 attend fully
    from autoplan.models.arch import read_arch

    arch, _ = read_arch(QWEN2)
    sliding = [int(arch.is_sliding(i)) for i in range(4)]
    assert sliding == [0, 0, 1, 1]
    assert f["--window-size"] == "(1023,0)"  # flash's left window: the 1024 keys ending at the query
    assert ec._literal(f["--window-attn-skip-freq"]) == sliding
    core_accepts(d)


def test_gemma2_features_megatron_cannot_express_are_named():
    d = export_megatron(hf_plan(GEMMA2))
    f = d["flags"]
    assert f["--apply-layernorm-1p"] is True  # Gemma's x * (1 + w)
    (w,) = [w for w in d["warnings"] if "has no flag" in w]
    for part in ("attention logit soft-capping 50", "final logit soft-capping 30", "sandwich", "embeddings scaled"):
        assert part in w, w
    assert any("GeGLU" in w for w in d["warnings"])
    # alternating sliding / full layers (Gemma 2) in Megatron's list form
    assert ec._literal(f["--window-attn-skip-freq"]) == [1, 0, 1, 0]
    assert f["--window-attn-skip-freq"] == "[1,0]*2"
    core_accepts(d)


def test_gpt2_keeps_biases_tanh_gelu_and_per_site_dropout():
    d = export_megatron(hf_plan(GPT2, "tp=2,pp=1,mbs=1"))
    f = d["flags"]
    assert "--disable-bias-linear" not in f and "--swiglu" not in f and f["--openai-gelu"] is True
    assert f["--hidden-dropout"] == 0.1 and f["--attention-dropout"] == 0.1
    assert "--rotary-base" not in f and f["--norm-epsilon"] == 1e-5
    core_accepts(d)


def test_zoo_model_exports_its_shape_only():
    """A zoo model is its ModelSpec: the export is as before (no numerics flags, no warning about them)."""
    plan = make_plan(load_model("gpt3-1.3b"), load_cluster("dgx-h100", gpus=16),
                     TrainingSpec(global_batch_size=32, seq_length=2048), "tp=2,pp=2,mbs=1")
    d = export_megatron(plan)
    assert not {"--rotary-base", "--norm-epsilon", "--add-qkv-bias"} & set(d["flags"])
    assert not [w for w in d["warnings"] if "numerics" in w]


def test_a_user_module_is_named_as_built_with_the_frameworks_defaults():
    plan = make_plan(load_model("gpt3-1.3b"), load_cluster("dgx-h100", gpus=16),
                     TrainingSpec(global_batch_size=32, seq_length=2048), "tp=2,pp=2,mbs=1")
    plan = plan.model_copy(update={"model_source": {"factory": "mypkg.model:build"}, "content_hash": ""}).sealed()
    for d in (export_megatron(plan), export_torchtitan(plan)):
        assert any("your module mypkg.model:build" in w for w in d["warnings"]), d["warnings"]


def test_torchtitan_export_carries_the_numerics_to_register():
    d = export_torchtitan(hf_plan(LLAMA31))
    assert "rope_theta=500000" in d["python"] and "rope_scaling=llama3 factor=8" in d["python"]
    assert "norm_eps=1e-05" in d["python"]
    compile(d["python"], "export.py", "exec")
    q = export_torchtitan(hf_plan(QWEN2))
    (w,) = [w for w in q["warnings"] if "torchtitan's llama3 model has none of them" in w]
    assert "linear biases" in w and "sliding-window attention (1024)" in w
    old = export_torchtitan(hf_plan(LLAMA31), "0.2")
    assert "# model numerics (register the flavour with them): rope_theta=500000" in old["toml"]


@pytest.mark.skipif(not ec.megatron_available(), reason="Megatron-LM (megatron.training) is not importable; "
                    "set MEGATRON_LM to a checkout")
def test_megatron_lm_parses_the_numerics_flags():
    for cfg, par in ((LLAMA31, "tp=2,pp=2,mbs=1,sp=1"), (QWEN2, "tp=2,pp=2,mbs=1,sp=1"),
                     (GEMMA2, "tp=2,pp=2,mbs=1,sp=1"), (GPT2, "tp=2,pp=1,mbs=1"), (QWEN2_MOE, "tp=2,pp=1,ep=2,mbs=1")):
        plan = hf_plan(cfg, par)
        d = export_megatron(plan)
        assert ec.check_megatron(d["args"], plan.cluster.num_gpus, d["env"], megatron_arch(plan)) is None, cfg


QWEN2_MOE = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 512,
             "intermediate_size": 1536, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 1024,
             "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 2,
             "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 1024,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}


def test_qwen2_moe_routing_shared_expert_and_sparse_layers():
    d = export_megatron(hf_plan(QWEN2_MOE, "tp=2,pp=1,ep=2,mbs=1"))
    f = d["flags"]
    # softmax over all experts before the top-k, unrenormalised (norm_topk_prob false)
    assert f["--moe-router-pre-softmax"] is True
    assert f["--moe-shared-expert-intermediate-size"] == 1024 and f["--moe-shared-expert-gate"] is True
    assert ec._literal(f["--moe-layer-freq"]) == [0, 1, 0, 1]  # decoder_sparse_step 2: layers 1 and 3
    core_accepts(d)


def test_zoo_model_exports_its_rotary_base():
    """A preset or spec file's rope_theta is what autoplan's zoo model rotates with (Llama 3: 500000); both exports
    carry it, so the exported run and `autoplan run` train the same model."""
    def plan_of(model):
        return make_plan(model, load_cluster("dgx-h100", gpus=8), TrainingSpec(global_batch_size=8, seq_length=4096),
                         "tp=8,mbs=1")

    llama3, llama2 = plan_of(load_model("llama3-8b")), plan_of(load_model("llama2-7b"))
    d = export_megatron(llama3)
    assert d["flags"]["--rotary-base"] == 500000 and not [w for w in d["warnings"] if "rope" in w]
    core_accepts(d)
    assert export_megatron(llama2)["flags"]["--rotary-base"] == 10000
    t = export_torchtitan(llama3)
    assert "rope_theta=500000" in t["text"] and not [w for w in t["warnings"] if "rope_theta" in w]
    assert "rope_theta=10000 " in export_torchtitan(llama2)["text"].replace("\n", " ")
    # a spec named like torchtitan's flavour but rotating otherwise: the flavour's 500000 would train another model
    mine = plan_of(load_model("llama3-8b").model_copy(update={"rope_theta": 10000.0}))
    (w,) = [w for w in export_torchtitan(mine)["warnings"] if "rope_theta" in w]
    assert "rope_theta=10000" in w and "500000" in w
    assert export_megatron(mine)["flags"]["--rotary-base"] == 10000
