"""`autoplan from-nemo`: a NeMo training config (NeMo-Framework-Launcher's form) read as the Megatron flags that
set the same fields, estimated as `from-megatron` estimates them; the NeMo rows of the fidelity benchmark come out
as the benchmark prices them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplan.cli import main
from autoplan.cost_models.errors import ConfigError, SpecError
from autoplan.cost_models.specs import ModelSpec
from autoplan.inspect.megatron_import import read_megatron
from autoplan.inspect.nemo_import import load_nemo, nemo_words

DATA = Path(__file__).parent / "data"
GPT = DATA / "nemo_gpt3_175b.yaml"
LLAMA = DATA / "nemo_llama2_70b.yaml"


def _json(capsys, *argv) -> dict:
    assert main(["from-nemo", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_launcher_config_reads_as_megatron_flags():
    nemo = nemo_words(load_nemo(GPT))
    run = read_megatron(nemo.words)
    assert nemo.gpus == 128  # trainer.num_nodes x devices
    assert run.parallel.to_string() == "tp=4,pp=8,cp=1,ep=1,vp=6,mbs=1,sp=1,zero=1,recompute=none,schedule=interleaved"
    m = run.model
    assert (m.num_layers, m.hidden_size, m.ffn, m.num_attention_heads) == (96, 12288, 4 * 12288, 96)  # ${multiply:}
    assert m.vocab_size == 50688  # GPT-2's 50257 padded to 128 x tp, as NeMo and Megatron pad it
    assert (run.seq_len, run.global_batch, run.dtype) == (2048, 256, "bf16")
    assert run.stack_set["overlap_grad_reduce"] and run.stack_set["overlap_param_gather"]
    assert run.stack_set["grad_reduce_dtype"] == "fp32"  # distributed_fused_adam's grad_sync_dtype default
    assert "p2p_overlap" not in run.stack_set  # overlap_p2p_comm true: Megatron-Core's default under interleaving
    assert "init_method_std" in nemo.unpriced and "optim" not in nemo.unpriced
    # apex's fp32 state over O2's bf16 weights: NeMo stores the master as remainders
    assert nemo.stack_set == {"optimizer_dtype": "fp32", "master_weights": "remainders"}


@pytest.mark.parametrize("sets, state, reduce", [
    # Nemotron-4 340B's optim (launcher 24.07): the state in the weights' dtype, stepped in place; apex reduces
    # gradients in the optimizer's dtype unless grad_sync_dtype says otherwise
    (["+model.optim.dtype=bf16"], {"optimizer_dtype": "bf16", "master_weights": "in-place"}, "bf16"),
    (["+model.optim.dtype=bf16", "+model.optim.store_params=true"],
     {"optimizer_dtype": "bf16", "master_weights": "bf16"}, "bf16"),
    (["+model.optim.store_params=false"], {"optimizer_dtype": "fp32", "master_weights": "in-place"}, "fp32"),
    (["+model.fp8_params=true"], {"optimizer_dtype": "fp32", "master_weights": "fp32"}, "fp32"),
    (["model.megatron_amp_O2=false"], {"optimizer_dtype": "fp32", "master_weights": "fp32"}, "fp32"),
    (["model.optim.name=mcore_distributed_optim", "+model.optim.dtype=bf16"], {}, "fp32"),
])
def test_the_optimizer_state_is_held_as_nemo_sets_up_apex(sets, state, reduce, capsys):
    nemo = nemo_words(load_nemo(GPT, sets))
    assert nemo.stack_set == state
    assert read_megatron(nemo.words).stack_set["grad_reduce_dtype"] == reduce
    if not state:  # Megatron-Core's optimizer reads no optim.dtype: said, not dropped
        assert any("optim.dtype bf16" in n for n in nemo.notes)
    # and the estimate prices it: optimizer state per parameter against the 2-byte weights, sharded over dp = 4
    out = _json(capsys, GPT, "--cluster", "dgx-h100", *[x for s in sets for x in ("--set", s)])
    assert out["from_nemo"]["stack_set"].get("master_weights") == state.get("master_weights")
    want = {"in-place": 0, "bf16": 2, "fp32": 4, None: 4}[state.get("master_weights")] + \
        (4 if state.get("optimizer_dtype") == "bf16" else 8)
    mem = out["memory_breakdown_gib"][0]
    assert mem["optimizer"] / mem["weights"] == pytest.approx(want / 2 / 4)


def test_keys_that_change_what_runs_are_priced_or_said():
    """Until session 36 these keys were listed as changing nothing: NeMo's FSDP (ZeRO-3), the fused weight-gradient
    accumulation turned off, unfused kernels, a gated GeGLU, a sliding window, fp8 weights."""
    nemo = nemo_words(load_nemo(GPT, ["model.fsdp=true", "model.gradient_accumulation_fusion=false",
                                      "model.bias_activation_fusion=false", "model.bias_dropout_add_fusion=false",
                                      "model.activation=fast-geglu", "+model.window_size=[4096,0]",
                                      "+model.fp8_params=true"]))
    run = read_megatron(nemo.words)
    assert run.parallel.zero == 3 and run.stack_set["grad_accum_fused"] is False
    assert run.model.activation == "swiglu" and run.model.ffn == 4 * 12288
    said = " ".join([*nemo.notes, *run.notes])
    for needle in ("torch FSDP2", "fast-geglu", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                   "priced as full causal attention", "--fp8-param-gather"):
        assert needle in said, needle
    for key in ("fsdp", "gradient_accumulation_fusion", "bias_activation_fusion", "window_size"):
        assert key not in nemo.unpriced
    # squared ReLU has no fused bias-activation kernel: turning the fusion off changes nothing, and says nothing
    relu2 = nemo_words(load_nemo(GPT, ["model.activation=squared-relu", "model.bias_activation_fusion=false"]))
    assert not any("fusion" in n for n in read_megatron(relu2.words).notes)


def test_overrides_and_nemo_only_settings():
    cfg = load_nemo(GPT, ["model.fp8=true", "model.optim.grad_sync_dtype=bf16", "model.overlap_p2p_comm=false",
                          "+model.activations_checkpoint_granularity=selective", "trainer.num_nodes=4"])
    nemo = nemo_words(cfg)
    run = read_megatron(nemo.words)
    assert (run.dtype, nemo.gpus, run.parallel.recompute) == ("fp8", 32, "selective")
    assert run.stack_set["grad_reduce_dtype"] == "bf16" and run.stack_set["p2p_overlap"] is False


def test_the_nemo_fidelity_row_comes_out_as_the_benchmark_prices_it(capsys, tmp_path):
    """Llama 2 70B, NeMo 24.07 FP8, 64 H100 (benchmarks/published/heldout_runs.yaml): the config with the table's
    batch and the launcher example's fp8 overrides gives the row's configuration and prediction (the vocabulary
    32000 padded to 32256, 128 x tp, as NeMo pads it and the row states it)."""
    out = _json(capsys, LLAMA, "--cluster", "dgx-h100", "--gpus", "64", "--vocab-size", "32000",
                "--set", "model.global_batch_size=128", "--set", "model.fp8=true",
                "--set", "model.optim.grad_sync_dtype=bf16")
    assert out["from_nemo"]["parallel"] == "tp=4,pp=4,cp=1,ep=1,vp=20,mbs=1,sp=1,zero=1,recompute=none," \
                                          "schedule=interleaved"
    row = ModelSpec(name="llama2-70b", num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8,
                    ffn_hidden_size=28672, vocab_size=32256, max_seq_length=4096, activation="swiglu", norm="rmsnorm",
                    position="rope", tie_embeddings=False)
    spec = tmp_path / "row.json"
    spec.write_text(row.model_dump_json())
    # the row as benchmarks/fidelity.py runs it (heldout_command: `autoplan estimate` with the row's fields)
    assert main(["estimate", "--model", str(spec), "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "128",
                 "--seq-len", "4096", "--stack", "megatron-core", "--stack-set",
                 "tp_comm_overlap=true,p2p_overlap=true,master_weights=remainders",
                 "--dtype", "fp8", "--parallel", "tp=4,pp=4,vp=20,mbs=1,sp=1,zero=1,recompute=none,schedule=interleaved",
                 "--json"]) == 0
    want = json.loads(capsys.readouterr().out)["step_time_s"]
    assert out["step_time_s"] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("sets, vocab, needle", [
    (["model.hidden_size=${oc.env:HIDDEN}"], None, "NeMo key hidden_size is an interpolation autoplan does not"),
    ([], None, "pass --vocab-size N"),
    (["model.activation=softplus"], 32000, "NeMo activation autoplan does not price"),
    (["model.fsdp=true", "model.fsdp_sharding_strategy=hybrid"], 32000, "NeMo FSDP sharding autoplan does not price"),
    (["trainer.precision=bf17"], 32000, "unknown trainer.precision"),
    (["model.optim.grad_sync_dtype=fp8"], 32000, "optim.grad_sync_dtype"),
])
def test_what_cannot_be_read_is_refused_in_one_line(sets, vocab, needle, capsys):
    with pytest.raises((ConfigError, SpecError), match=needle.replace("(", "\\(")):
        nemo_words(load_nemo(LLAMA, sets), vocab)
    argv = ["from-nemo", str(LLAMA), "--cluster", "dgx-h100"] + [x for s in sets for x in ("--set", s)]
    assert main(argv + (["--vocab-size", str(vocab)] if vocab else [])) != 0
    err = capsys.readouterr().err
    assert needle in err and "\n" not in err.strip()


def test_files_that_are_not_nemo_configs(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_nemo(bad)
    bad.write_text("trainer: {devices: 8}\n")
    with pytest.raises(SpecError, match="has no `model:` mapping"):
        load_nemo(bad)
    with pytest.raises(SpecError, match="cannot read the NeMo config"):
        load_nemo(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="--set takes KEY=VALUE"):
        load_nemo(GPT, ["model.fp8"])
    assert main(["from-nemo", str(tmp_path / "missing.yaml"), "--cluster", "dgx-h100"]) != 0
    assert "cannot read the NeMo config" in capsys.readouterr().err
    no_trainer = tmp_path / "no_trainer.yaml"
    no_trainer.write_text(GPT.read_text().replace("trainer:", "not_the_trainer:"))
    assert main(["from-nemo", str(no_trainer), "--cluster", "dgx-h100"]) != 0
    err = capsys.readouterr().err
    assert "the number of GPUs is not in the config" in err and "pass --gpus N" in err
    assert main(["from-nemo", str(no_trainer), "--cluster", "dgx-h100", "--gpus", "128", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["from_nemo"]["parallel"].startswith("tp=4,pp=8")
