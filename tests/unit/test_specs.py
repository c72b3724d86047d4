"""Specs: loading (presets, YAML/JSON, Hugging Face configs), the configuration string, validation rules."""

from __future__ import annotations

import json

import pytest

from autoplan.specs import (
    ConfigError,
    ParallelConfig,
    SpecError,
    TrainingSpec,
    check_config,
    load_cluster,
    load_model,
    model_from_hf_config,
)


def test_parallel_string_round_trip():
    text = "tp=8,pp=8,dp=16,cp=1,ep=1,vp=3,mbs=1,sp=1,zero=1,recompute=selective,schedule=interleaved"
    cfg = ParallelConfig.parse(text)
    assert cfg.to_string() == text
    assert ParallelConfig.parse(cfg.to_string()) == cfg


def test_parallel_string_defaults_and_aliases():
    cfg = ParallelConfig.parse("tp=2")
    assert (cfg.pp, cfg.cp, cfg.ep, cfg.vp, cfg.mbs, cfg.sp, cfg.zero) == (1, 1, 1, 1, 1, False, 0)
    assert cfg.recompute == "none" and cfg.schedule == "1f1b" and cfg.dp is None
    assert ParallelConfig.parse("pp=4,vpp=2").schedule == "interleaved"
    assert ParallelConfig.parse("recompute=off,sp=true,schedule=1F1B").recompute == "none"


@pytest.mark.parametrize("bad,rule", [
    ("tp=two", "tp must be an integer"),
    ("tp", "key=value"),
    ("tq=2", "unknown parallel configuration key"),
    ("recompute=some", "recompute must be"),
    ("schedule=zigzag", "schedule must be"),
    ("tp=0", "invalid parallel configuration"),
    ("zero=4", "invalid parallel configuration"),
])
def test_bad_configuration_strings(bad, rule):
    with pytest.raises(ConfigError, match=rule):
        ParallelConfig.parse(bad)


def _check(cfg, model="gpt3-175b", gpus=1024, batch=1536, seq=2048, cluster="dgx-a100-80g"):
    m = load_model(model)
    c = load_cluster(cluster, gpus=gpus)
    t = TrainingSpec(global_batch_size=batch, seq_length=seq)
    return check_config(ParallelConfig.parse(cfg), m, c, t)


def test_dp_is_derived_from_world_size():
    assert _check("tp=8,pp=8").dp == 16


@pytest.mark.parametrize("cfg,kw,rule", [
    ("tp=8,pp=8,dp=32", {}, "tp\\*pp\\*cp\\*dp must equal the world size"),
    ("tp=8,pp=7", {}, "world size must be a multiple"),
    ("tp=16", {"gpus": 1024}, "tp must stay inside a node"),
    ("tp=8", {"model": "llama2-70b", "gpus": 64, "batch": 64, "seq": 4096}, None),  # 8 kv heads / tp=8: legal
    ("tp=4,pp=4", {"model": "gpt3-2.7b", "gpus": 16, "batch": 16}, None),
    ("tp=8", {"model": "gpt3-125m", "gpus": 8, "batch": 8}, "attention heads must divide by tp"),
    ("tp=8", {"model": "sc21-1.7b", "gpus": 8, "batch": 8}, None),
    ("tp=8,pp=3", {"model": "gpt3-13b", "gpus": 24, "batch": 24}, "layers must divide evenly"),
    ("pp=7", {"model": "gpt3-13b", "gpus": 7, "batch": 7, "cluster": "dgx-h100"}, "layers must divide evenly"),
    ("pp=2,vp=2", {"model": "gpt3-125m", "gpus": 2, "batch": 2, "cluster": "dgx-h100"}, None),
    ("vp=2", {"model": "gpt3-125m", "gpus": 1, "batch": 2}, "virtual stages need pp>1"),
    ("tp=8,pp=8", {"batch": 1000}, "global batch must divide by dp\\*mbs"),
    ("tp=8,pp=8,mbs=5", {}, "global batch must divide by dp\\*mbs"),
    ("tp=8,pp=8", {"seq": 4096}, "sequence longer than the learned positions"),
    ("tp=8,pp=8,cp=2", {"seq": 2046}, "sequence must divide by 2\\*cp"),
    ("sp=1", {"model": "gpt3-125m", "gpus": 8, "batch": 8}, "sequence parallelism needs tp>1"),
    ("tp=8,pp=8,ep=2", {}, "ep>1 needs a MoE model"),
    ("tp=8,pp=8,recompute=selective,recompute_layers=2", {}, "recompute_layers applies to full"),
    ("tp=8,zero=1", {"gpus": 8, "batch": 8}, "ZeRO needs dp>1"),
])
def test_configuration_rules(cfg, kw, rule):
    if rule is None:
        _check(cfg, **kw)
        return
    with pytest.raises(ConfigError, match=rule) as e:
        _check(cfg, **kw)
    msg = str(e.value)
    assert "fix:" in msg and "\n" not in msg  # one line, with a way out


def test_kv_heads_vs_tp(tmp_path):
    spec = {"name": "gqa", "num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_kv_heads": 2,
            "vocab_size": 1000, "max_seq_length": 128}
    f = tmp_path / "m.json"
    f.write_text(json.dumps(spec))
    m = load_model(str(f))
    c = load_cluster("dgx-h100", gpus=8)
    t = TrainingSpec(global_batch_size=8, seq_length=128)
    with pytest.raises(ConfigError, match="KV heads must divide by tp"):
        check_config(ParallelConfig.parse("tp=4"), m, c, t)


def test_moe_expert_rules():
    m = load_model("mixtral-8x7b")
    c = load_cluster("dgx-h100", gpus=64)
    t = TrainingSpec(global_batch_size=64, seq_length=4096)
    assert check_config(ParallelConfig.parse("tp=2,ep=8"), m, c, t).dp == 32
    with pytest.raises(ConfigError, match="experts must divide by ep"):
        check_config(ParallelConfig.parse("tp=2,ep=16"), m, c, t)


def test_yaml_model_and_cluster_files(tmp_path):
    (tmp_path / "m.yaml").write_text(
        "name: mine\nnum_layers: 4\nhidden_size: 256\nnum_attention_heads: 4\nvocab_size: 1000\n"
        "max_seq_length: 512\nactivation: swiglu\nnorm: rmsnorm\nposition: rope\n")
    m = load_model(str(tmp_path / "m.yaml"))
    assert m.name == "mine" and m.ffn == 1024 and m.kv_heads == 4
    (tmp_path / "c.yaml").write_text(
        "name: mycluster\ngpu: h100-sxm\ngpus_per_node: 8\nnum_nodes: 4\n"
        "intra_node: {bandwidth_gbps: 450, latency_us: 3}\ninter_node: {bandwidth_gbps: 50, latency_us: 5}\n")
    c = load_cluster(str(tmp_path / "c.yaml"))
    assert c.num_gpus == 32 and c.gpu.peak_tflops.bf16 == 989.4
    (tmp_path / "c2.yaml").write_text(
        "base: dgx-h100\ngpu: {preset: h100-sxm, hbm_gib: 64}\nnum_nodes: 2\n")
    c2 = load_cluster(str(tmp_path / "c2.yaml"))
    assert c2.gpu.hbm_gib == 64 and c2.num_gpus == 16 and c2.inter_node.bandwidth_gbps == 50


@pytest.mark.parametrize("content,rule", [
    ("num_layers: [", "not valid YAML"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("name: x\nnum_layers: -1\nhidden_size: 8\nnum_attention_heads: 2\nvocab_size: 8\nmax_seq_length: 8\n",
     "num_layers"),
    ("name: x\nnum_layers: 2\nhidden_size: 10\nnum_attention_heads: 3\nvocab_size: 8\nmax_seq_length: 8\n",
     "hidden_size must be a multiple"),
    ("name: x\nnum_layers: 2\nhidden_size: 8\nnum_attention_heads: 2\nvocab_size: 8\nmax_seq_length: 8\n"
     "activation: tanh\n", "activation"),
    ("name: x\nnum_layers: 2\nhidden_size: 8\nnum_attention_heads: 2\nvocab_size: 8\nmax_seq_length: 8\n"
     "colour: red\n", "colour"),
])
def test_malformed_model_specs(tmp_path, content, rule):
    f = tmp_path / "bad.yaml"
    f.write_text(content)
    with pytest.raises(SpecError, match=rule) as e:
        load_model(str(f))
    assert "\n" not in str(e.value)


def test_unknown_presets_say_how_to_list():
    with pytest.raises(SpecError, match="autoplan models"):
        load_model("gpt-7")
    with pytest.raises(SpecError, match="autoplan clusters"):
        load_cluster("dgx-z9000")
    with pytest.raises(SpecError, match="whole nodes"):
        load_cluster("dgx-h100", gpus=12)


def test_unknown_presets_name_the_close_ones():
    with pytest.raises(SpecError) as e:
        load_cluster("cpu")  # a part of the name
    assert "no such file (did you mean 'local-cpu'?)" in str(e.value)
    with pytest.raises(SpecError) as e:
        load_model("llama3-8")  # a spelling
    assert "did you mean 'llama3-8b'" in str(e.value)
    with pytest.raises(SpecError) as e:
        load_cluster("xyzzy")
    assert "did you mean" not in str(e.value)


HF = {
    "llama": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 4096, "hidden_act": "silu", "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                "max_position_embeddings": 32768, "hidden_act": "silu", "rms_norm_eps": 1e-5},
    "qwen2": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
              "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 131072, "hidden_act": "silu", "tie_word_embeddings": False},
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
             "vocab_size": 50257, "activation_function": "gelu_new"},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 2560, "intermediate_size": 10240,
                 "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 50432,
                 "max_position_embeddings": 2048, "hidden_act": "gelu"},
    "mixtral": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
                "hidden_act": "silu", "rms_norm_eps": 1e-5},
}


def test_hf_configs_map_to_specs(tmp_path):
    from autoplan.cost_models.profile import profile_from_spec

    llama = model_from_hf_config(HF["llama"])
    assert (llama.activation, llama.norm, llama.position, llama.ffn) == ("swiglu", "rmsnorm", "rope", 11008)
    assert sum(p.params for p in profile_from_spec(llama)) == 6_738_415_616  # Llama-2-7B
    assert model_from_hf_config(HF["mistral"]).kv_heads == 8
    assert model_from_hf_config(HF["qwen2"]).vocab_size == 152064
    gpt2 = model_from_hf_config(HF["gpt2"])
    assert (gpt2.position, gpt2.norm, gpt2.activation, gpt2.tie_embeddings) == ("learned", "layernorm", "gelu", True)
    assert sum(p.params for p in profile_from_spec(gpt2)) == 124_439_808  # GPT-2 small
    neox = model_from_hf_config(HF["gpt_neox"])
    assert neox.position == "rope" and neox.norm == "layernorm"
    mix = model_from_hf_config(HF["mixtral"])
    assert mix.moe.num_experts == 8 and mix.moe.top_k == 2
    # through a file named config.json
    d = tmp_path / "my-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF["llama"]))
    assert load_model(str(d / "config.json")).num_layers == 32


def test_hf_config_missing_fields():
    with pytest.raises(SpecError, match="lacks"):
        model_from_hf_config({"model_type": "llama", "hidden_size": 64})


def test_rope_theta_from_presets_spec_files_and_hf_configs(tmp_path):
    """The rotary base: the presets' published values, a spec file's own, a Hugging Face config's (either field
    transformers has used), and one-line errors for a base on a model without rotary positions or a bad value."""
    from autoplan.models.arch import arch_from_hf
    from autoplan.models.blocks import spec_of

    assert [load_model(n).rope_theta for n in ("llama3-70b", "llama2-70b", "mixtral-8x7b")] == [5e5, 1e4, 1e6]
    spec = tmp_path / "m.yaml"
    spec.write_text("name: m\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 128\n"
                    "max_seq_length: 64\nposition: rope\nrope_theta: 250000\n")
    assert load_model(str(spec)).rope_theta == 250000.0
    spec.write_text(spec.read_text().replace("position: rope", "position: learned"))
    with pytest.raises(SpecError, match="no rotary positions"):
        load_model(str(spec))
    cfg = dict(HF["llama"], rope_theta=500000.0)
    assert model_from_hf_config(cfg).rope_theta == 500000.0 == spec_of(arch_from_hf(cfg)).rope_theta
    assert model_from_hf_config(dict(HF["llama"], rope_parameters={"rope_theta": 1e6})).rope_theta == 1e6
    assert model_from_hf_config(HF["llama"]).rope_theta == 10000.0
    assert model_from_hf_config(dict(HF["gpt2"], rope_theta=5.0)).rope_theta == 10000.0  # learned positions
    with pytest.raises(SpecError, match="rope_theta must be a number"):
        model_from_hf_config(dict(HF["llama"], rope_theta="big"))


def test_experts_padded_to_capacity_price_capacity_times_the_balanced_rows():
    """Megatron's --moe-pad-expert-input-to-capacity: every expert computes capacity_factor x the balanced load
    and the all-to-alls carry the padding. Priced exactly that: expert FLOPs and routed bytes x cf, nothing else;
    refused on the stack of autoplan's runtime, which routes dropless and unpadded (one program)."""
    import pytest

    from autoplan.cost_models.errors import ConfigError
    from autoplan.cost_models.profile import profile_from_spec
    from autoplan.cost_models.specs import ModelSpec, MoESpec, TrainingSpec
    from autoplan.cost_models.stacks import apply_stack
    from autoplan.estimate_api import estimate_config
    from autoplan.specs import load_cluster

    base = dict(name="m", num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32000,
                max_seq_length=2048, activation="swiglu", norm="rmsnorm", position="rope")
    plain = ModelSpec(**base, moe=MoESpec(num_experts=8, top_k=2, capacity_factor=1.5))
    padded = ModelSpec(**base, moe=MoESpec(num_experts=8, top_k=2, capacity_factor=1.5, pad_to_capacity=True))
    bp, bq = (next(p for p in profile_from_spec(m) if p.kind == "block") for m in (plain, padded))
    experts = [g for g in bp.gemms if g.expert]
    assert experts and all(gq.flops_per_token == pytest.approx(1.5 * gp.flops_per_token)
                           for gp, gq in zip(bp.gemms, bq.gemms, strict=True) if gp.expert)
    assert all(gq.flops_per_token == gp.flops_per_token for gp, gq in zip(bp.gemms, bq.gemms, strict=True)
               if not gp.expert)  # attention and the router untouched
    assert bq.routed_per_token == 3.0 and bp.routed_per_token == 2.0
    cluster = load_cluster("dgx-h100", gpus=16)
    tr = apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048), "megatron-core", {})
    cfg = "tp=1,pp=1,ep=8,mbs=1,zero=1"
    slow, fast = (estimate_config(m, cluster, tr, cfg) for m in (padded, plain))
    assert slow.step_time_s > fast.step_time_s
    # tp = cp = 1: the exposed collectives of the layers are the experts' all-to-alls, 1.5x the bytes
    assert slow.breakdown["tp_cp_ep_comm"] > 1.2 * fast.breakdown["tp_cp_ep_comm"] > 0
    assert MoESpec(num_experts=8, capacity_factor=1.0, pad_to_capacity=True).routed_scale == 1.0  # nothing to pad
    with pytest.raises(ConfigError, match="routes experts dropless without padding"):
        estimate_config(padded, cluster, apply_stack(TrainingSpec(global_batch_size=64, seq_length=2048),
                                                     "autoplan", {}), cfg)


def test_a_models_own_moe_layers_are_the_priced_ones():
    """MoE layers as one every n from a first one: moe_layer_spacing reads a per-layer pattern into every_n_layers
    and first_layer (None where the first is n - 1), and a Hugging Face model's spec prices the layers the model
    has: the test Qwen2-MoE (3 layers, mlp_only_layers=[1]) has its experts on layers 0 and 2, where the spec put
    them on all three until session 37 (every_n_layers = 3 // 2)."""
    from autoplan import models
    from autoplan.cost_models.specs import MoESpec, moe_layer_spacing
    from autoplan.models.blocks import spec_of
    from tests.models.hf_configs import CONFIGS

    assert moe_layer_spacing([False, True, False, True]) == {"every_n_layers": 2, "first_layer": None}
    assert moe_layer_spacing([True, False, True, False, True]) == {"every_n_layers": 2, "first_layer": 0}
    assert moe_layer_spacing([False, True, True, True]) == {"every_n_layers": 1, "first_layer": 1}
    assert moe_layer_spacing([True, True, False, True]) == {"layers": (0, 1, 3)}  # irregular: the layers
    assert moe_layer_spacing([False, False]) is None
    arch = models.arch_from_hf(CONFIGS["qwen2_moe"])
    spec = spec_of(arch)
    assert [spec.is_moe_layer(i) for i in range(arch.num_layers)] == [bool(b) for b in arch.moe.sparse_layers]
    assert spec.num_moe_layers == sum(arch.moe.sparse_layers) == 2
    irregular = models.arch_from_hf(dict(CONFIGS["qwen2_moe"], num_hidden_layers=5, mlp_only_layers=[1, 2]))
    spec = spec_of(irregular)
    assert spec.moe.layers == (0, 3, 4) and [spec.is_moe_layer(i) for i in range(5)] == list(
        irregular.moe.sparse_layers)
    with pytest.raises(SpecError, match="layer indices once each"):
        MoESpec(num_experts=4, layers=(3, 1))
    with pytest.raises(SpecError, match="fall outside the model"):
        spec.model_copy(update={"moe": None}).model_validate(
            {**spec.model_dump(), "moe": {"num_experts": 4, "layers": (1, 7)}})
