"""`autoplan from-megatron`: a Megatron-LM command line read back into autoplan's terms. Every export of autoplan's
(`autoplan export --format megatron`) reads back to the plan it came from, and Megatron's defaults apply where a
command leaves a flag out."""

from __future__ import annotations

import json

import pytest

from autoplan.api import plan_from_estimate
from autoplan.cli import main
from autoplan.cost_models.errors import ConfigError, SpecError
from autoplan.cost_models.layout import counts
from autoplan.cost_models.specs import ModelSpec, MoESpec, TrainingSpec
from autoplan.cost_models.stacks import apply_stack
from autoplan.estimate_api import estimate_config
from autoplan.inspect import export_megatron
from autoplan.inspect.megatron_import import command_tokens, read_megatron
from autoplan.specs import load_cluster, load_model

# (model, GPUs, global batch, seq, dtype, configuration, --stack-set): each a different part of the flag table
CASES = [
    ("llama2-70b", 64, 512, 4096, "bf16", "tp=4,pp=4,vp=5,mbs=1,sp=1,zero=1,recompute=selective", {}),
    ("gpt3-175b", 1024, 1536, 2048, "fp16", "tp=8,pp=16,mbs=1,recompute=full", {}),
    ("llama2-70b", 64, 128, 4096, "bf16", "tp=4,pp=4,vp=2,mbs=1,sp=1,zero=1,layout=Et*9|t*10|t*10|t*11|t*11|t*10|"
     "t*10|t*9L", {}),
    ("llama2-7b", 8, 256, 4096, "bf16", "tp=1,pp=2,mbs=4,zero=1,recompute=full,recompute_layers=4", {}),
    ("llama3-8b", 16, 64, 8192, "fp8", "tp=2,cp=2,pp=1,mbs=1,sp=1,zero=3", {"loss_fusion": True}),
    ("mixtral-8x7b", 64, 256, 4096, "bf16", "tp=2,pp=4,ep=8,mbs=1,sp=1,zero=1,recompute=full", {}),
    ("gpt3-13b", 32, 256, 2048, "bf16", "tp=2,pp=2,mbs=2,sp=1,zero=1",
     {"grad_reduce_dtype": "fp32", "overlap_grad_reduce": False, "optimizer_dtype": "bf16",
      "master_weights": "remainders"}),
    # fp32 moments beside the remainders (--use-precision-aware-optimizer alone): 10 bytes a parameter
    ("llama2-7b", 16, 64, 4096, "bf16", "tp=2,pp=1,mbs=1,sp=1,zero=1", {"master_weights": "remainders"}),
    # blocking pipeline sends under interleaving: --no-overlap-p2p-communication (Megatron overlaps by default)
    ("gpt3-175b", 128, 256, 2048, "bf16", "tp=4,pp=8,vp=6,mbs=1,sp=1,zero=1", {"p2p_overlap": False}),
    # 16-bit weight gradients added to the fp32 buffer apart (Megatron-FSDP's scripts): --no-gradient-accumulation-fusion
    ("llama3-8b", 16, 64, 8192, "bf16", "tp=1,pp=1,mbs=1,zero=3", {"grad_accum_fused": False}),
]


def _plan(name, gpus, batch, seq, dtype, cfg, knobs):
    tr = apply_stack(TrainingSpec(global_batch_size=batch, seq_length=seq, dtype=dtype), "megatron-core", knobs)
    model, cluster = load_model(name), load_cluster("dgx-h100", gpus=gpus)
    # as `autoplan estimate --stack megatron-core` makes it: Megatron's kernels priced, the plan's runtime fused
    return plan_from_estimate(model, cluster, tr, estimate_config(model, cluster, tr, cfg))


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[5].split(',layout')[0]}" for c in CASES])
def test_every_export_reads_back_to_its_plan(case, capsys):
    plan = _plan(*case)
    d = export_megatron(plan)
    run = read_megatron(command_tokens(d["command"]))
    want, got = plan.parallel, run.parallel
    for f in ("tp", "pp", "cp", "ep", "vp", "mbs", "sp", "zero", "recompute", "schedule"):
        assert getattr(got, f) == getattr(want, f), (f, d["command"])
    if want.recompute_layers is not None:
        assert got.recompute_layers == want.recompute_layers
    sizes = [s.layers[1] - s.layers[0] for s in plan.stages]
    assert (counts(got.layout) if got.layout else [plan.model.num_layers // len(sizes)] * len(sizes)) == sizes
    m, w = run.model, plan.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads, m.ffn, m.activation, m.norm, m.position,
            m.tie_embeddings, m.has_bias) == (w.num_layers, w.hidden_size, w.num_attention_heads, w.kv_heads, w.ffn,
                                              w.activation, w.norm, w.position, w.tie_embeddings, w.has_bias)
    assert (m.moe is None) == (w.moe is None) and (m.moe is None or m.moe.num_experts == w.moe.num_experts)
    assert m.vocab_size % (128 * want.tp) == 0 and 0 <= m.vocab_size - w.vocab_size < 128 * want.tp
    assert (run.seq_len, run.dtype, run.global_batch, run.gpus) == (plan.training.seq_length, plan.training.dtype,
                                                                     plan.training.global_batch_size,
                                                                     plan.cluster.num_gpus)
    tr = plan.training
    for knob, value in run.stack_set.items():
        if knob == "grad_reduce_dtype":
            assert value == tr.grad_dtype, d["command"]
        elif knob in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "align_grad_reduce"):
            # the export writes an overlap only where it does something (dp > 1, ZeRO-1/2, tp > 1, vp > 1)
            assert value == getattr(tr, knob) or value is (knob == "align_grad_reduce"), (knob, d["command"])
        else:
            assert value == getattr(tr, knob), (knob, d["command"])
    assert set(run.unpriced) <= {"--ckpt-format"}  # Megatron-FSDP's checkpoint format: nothing a step does
    # and the CLI predicts what the plan predicted, but for the padded vocabulary
    assert main(["from-megatron", "--cluster", "dgx-h100", "--json", "--",
                 *command_tokens(d["command"])]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] == pytest.approx(plan.prediction.step_time_s, rel=0.01)
    assert out["from_megatron"]["parallel"].startswith(f"tp={want.tp},pp={want.pp}")


def test_megatron_defaults_apply_where_the_command_is_silent():
    words = command_tokens("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --swiglu "
             "--tokenizer-type GPT2BPETokenizer --micro-batch-size 2 --tensor-model-parallel-size 2 "
             "--recompute-activations --bf16 --lr 3e-4 --train-iters 1000 --data-path /data/x_text_document")
    run = read_megatron(words)
    m = run.model
    assert m.ffn == int(4 * 2048 * 2 / 3 / 64) * 64 == 5440  # arguments.py's SwiGLU default
    assert m.vocab_size == 50432 and any("50257 padded to 50432" in n for n in run.notes)  # 128 x tp = 256
    assert (m.position, m.norm, m.tie_embeddings, m.has_bias, m.dropout) == ("learned", "layernorm", True, True, 0.1)
    assert run.parallel.recompute == "selective" and run.parallel.schedule == "1f1b"
    assert run.stack_set["grad_reduce_dtype"] == "fp32"  # bf16 gradients are reduced in fp32 unless told otherwise
    assert run.stack_set["overlap_grad_reduce"] is False and "flash_attention" not in run.stack_set
    assert run.global_batch is None and run.gpus is None
    assert run.unpriced == ["--data-path", "--lr", "--train-iters"]
    old = read_megatron(command_tokens("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
                        "--vocab-size 51200 --checkpoint-activations --fp16"))
    assert (old.parallel.recompute, old.parallel.recompute_layers, old.dtype) == ("full", None, "fp16")
    uniform = read_megatron(command_tokens("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
                            "--vocab-size 51200 --recompute-granularity full --recompute-method uniform "
                            "--recompute-num-layers 2"))
    assert uniform.parallel.recompute == "full" and any("one per 2 layers" in n for n in uniform.notes)
    # a launch script: environment, torchrun's world size, comments and continuations
    script = ("# 2 nodes\nCUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nnodes 2 --nproc-per-node 8 pretrain_gpt.py \\\n"
              "  --num-layers 24 --hidden-size 2048 \\\n  --num-attention-heads 16 --seq-length 2048 \\\n"
              "  --vocab-size=51200 --micro-batch-size 1  # per GPU\n")
    run = read_megatron(command_tokens(script))
    assert run.gpus == 16 and run.model.vocab_size == 51200 and run.parallel.mbs == 1


@pytest.mark.parametrize("words, needle", [
    ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --vocab-size 1000", "no --seq-length"),
    ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048", "vocabulary size"),
    ("--num-layers $LAYERS --seq-length 2048", "shell variable"),
    ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 1000 "
     "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4", "must divide each pipeline rank"),
    ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 1000 "
     "--recompute-granularity full --recompute-method zigzag", "unknown --recompute-method"),
    ("--num-layers twelve --seq-length 2048", "--num-layers takes an integer"),
    # values the model or the configuration refuses name the flag that gave them (until session 35 a pydantic dump)
    ("--num-layers 0 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 1000",
     "invalid --num-layers: input should be greater than 0"),
    ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 1000 "
     "--micro-batch-size 0", "invalid --micro-batch-size"),
    ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 1000 "
     "--num-experts 8 --moe-router-topk 0", "invalid --moe-router-topk"),
    ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 0 --vocab-size 1000",
     "--seq-length must be positive"),
    ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 1000 "
     "--global-batch-size -8", "--global-batch-size must be positive"),
])
def test_commands_autoplan_cannot_read_are_refused_with_the_fix(words, needle, capsys):
    with pytest.raises(ConfigError, match=needle):
        read_megatron(words.split())
    # and on the command line: one line, no traceback
    assert main(["from-megatron", "--cluster", "dgx-h100", "--gpus", "8", "--", *words.split()]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert needle.split(":")[0] in err[-1] and "Traceback" not in "\n".join(err)


def test_the_embedding_and_loss_counted_as_layers_lighten_the_end_stages():
    """--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the embedding and the loss
    count as a layer each in the split, and the first / last virtual stage builds one block fewer. Llama 3 405B's
    126 blocks on pp=16 x vp=8 come out as the fidelity row's layout (embedding and loss alone on their chunks)."""
    base = command_tokens("--hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --vocab-size 32000 ")
    run = read_megatron([*base, *command_tokens("--num-layers 126 --pipeline-model-parallel-size 16 "
                         "--num-virtual-stages-per-pipeline-rank 8 --account-for-embedding-in-pipeline-split "
                         "--account-for-loss-in-pipeline-split")])
    assert run.parallel.layout == "E|(t|)*126L" and run.unpriced == []
    run = read_megatron([*base, *command_tokens("--num-layers 31 --pipeline-model-parallel-size 4 "
                         "--account-for-embedding-in-pipeline-split")])
    assert counts(run.parallel.layout) == [7, 8, 8, 8]
    # without a pipeline the flags change nothing; with uneven first/last counts Megatron refuses the pair
    assert read_megatron([*base, "--num-layers", "4", "--account-for-loss-in-pipeline-split"]).parallel.layout is None
    with pytest.raises(ConfigError, match="do not split evenly"):
        read_megatron([*base, *command_tokens("--num-layers 32 --pipeline-model-parallel-size 4 "
                       "--account-for-embedding-in-pipeline-split")])
    with pytest.raises(ConfigError, match="cannot be combined"):
        read_megatron([*base, *command_tokens("--num-layers 30 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers "
                       "6 --account-for-embedding-in-pipeline-split")])


def test_an_expert_capacity_is_read_for_what_it_changes():
    """--moe-expert-capacity-factor: at or above the balanced load with no padding nothing changes (autoplan prices a
    balanced load, dropless); below it tokens are dropped, padded to it every expert computes cf x the load: both
    said in a note. A model spec with capacity_factor below 1 is refused."""
    base = command_tokens("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
                          "--vocab-size 32000 --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8")
    for extra, note in (("1.0", None), ("1.25", None), ("0.5", "drops tokens"),
                        ("1.25 --moe-pad-expert-input-to-capacity", "1.25 x the balanced load")):
        run = read_megatron([*base, "--moe-expert-capacity-factor", *extra.split()])
        got = [n for n in run.notes if "capacity" in n]
        assert (got == []) if note is None else (len(got) == 1 and note in got[0]), (extra, run.notes)
        assert "--moe-expert-capacity-factor" not in run.unpriced
    from autoplan.cost_models.errors import SpecError
    from autoplan.cost_models.specs import MoESpec

    with pytest.raises(SpecError, match="drops tokens"):
        MoESpec(num_experts=8, capacity_factor=0.5)
    assert MoESpec(num_experts=8, capacity_factor=1.25).capacity_factor == 1.25


def test_megatron_2022s_standalone_embedding_stage():
    """--standalone-embedding-stage (Megatron-LM 2022): rank 0 holds the embedding alone, the blocks split evenly
    over the other ranks; with virtual stages rank 0's later chunks would be empty, which autoplan refuses."""
    base = command_tokens("--hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --vocab-size 32000 --num-layers 24 ")
    run = read_megatron([*base, "--pipeline-model-parallel-size", "5", "--standalone-embedding-stage"])
    assert run.parallel.layout == "E|(t*6|)*3t*6L" and counts(run.parallel.layout) == [0, 6, 6, 6, 6]
    assert run.stack_set["uneven_stages"] is True  # estimated under --stack megatron-2022, whose default is even
    assert main(["from-megatron", "--cluster", "dgx-a100-80g", "--gpus", "40", "--stack", "megatron-2022", "--",
                 *base, "--pipeline-model-parallel-size", "5", "--standalone-embedding-stage",
                 "--tensor-model-parallel-size", "8", "--global-batch-size", "64", "--bf16"]) == 0
    for extra, needle in (("--pipeline-model-parallel-size 6", "over the other pp - 1 ranks"),
                          ("--pipeline-model-parallel-size 5 --num-virtual-stages-per-pipeline-rank 2",
                           "later chunks empty")):
        with pytest.raises(ConfigError, match=needle):
            read_megatron([*base, *extra.split(), "--standalone-embedding-stage"])


def test_any_value_a_model_refuses_is_one_line_on_the_command_line(capsys, monkeypatch):
    """The CLI's last net: a pydantic refusal no reader turned into its own error is still one line."""
    from pydantic import ValidationError

    import autoplan.inspect.cli as icli

    def broken(args):
        ModelSpec(name="x", num_layers=-1, hidden_size=8, num_attention_heads=1, vocab_size=8, max_seq_length=8)

    monkeypatch.setattr(icli, "cmd_from_megatron", broken)
    with pytest.raises(ValidationError):
        broken(None)
    assert main(["from-megatron", "--cluster", "dgx-h100", "--", "--num-layers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoplan: invalid value: ModelSpec num_layers") and "\n" not in err


def test_the_cli_says_what_it_read_and_what_it_did_not(tmp_path, capsys):
    flags = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
             "--num-layers-per-virtual-pipeline-stage", "4", "--sequence-parallel", "--micro-batch-size", "1",
             "--global-batch-size", "1536", "--recompute-granularity", "selective", "--bf16", "--lr", "6e-5"]
    base = ["from-megatron", "--cluster", "dgx-a100-80g", "--gpus", "1024", "--model", "gpt3-175b"]
    assert main([*base, "-o", str(tmp_path / "p.json"), "--", *flags, "--seq-length", "2048"]) == 0
    captured = capsys.readouterr()
    assert "not read, priced as if absent: --lr" in captured.err
    assert "the same as: autoplan estimate --model gpt3-175b" in captured.err
    assert "--parallel tp=8,pp=8,cp=1,ep=1,vp=3,mbs=1,sp=1,zero=0,recompute=selective,schedule=interleaved" \
        in captured.err
    from autoplan.plan import load_plan

    plan = load_plan(tmp_path / "p.json")
    assert plan.stack.startswith("megatron-core") and plan.parallel.vp == 3 and plan.model.name == "gpt3-175b"
    # the same, estimated the way the command says: identical prediction
    assert main(["estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "1024",
                 "--global-batch", "1536", "--seq-len", "2048", "--dtype", "bf16", "--stack", "megatron-core",
                 "--stack-set", "overlap_grad_reduce=false,overlap_param_gather=false,tp_comm_overlap=false,"
                 "align_grad_reduce=true,loss_fusion=false,grad_reduce_dtype=fp32", "--parallel",
                 "tp=8,pp=8,vp=3,mbs=1,sp=1,recompute=selective", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(plan.prediction.step_time_s)
    # errors are one line with the fix
    for extra, needle in (([], "no Megatron flags given"),
                          (["--", *flags], "no --seq-length")):
        assert main([*base, *extra]) != 0
        err = capsys.readouterr().err
        assert needle in err and "\n" not in err.strip()
    assert main(["from-megatron", "--cluster", "dgx-h100", "--model", "tiny-gpt", "--", "--seq-length", "64"]) != 0
    assert "the number of GPUs is not in the command" in capsys.readouterr().err
    assert main(["from-megatron", "--cluster", "dgx-h100", "--gpus", "8", "--", "--seq-length", "64"]) != 0
    assert "the flags give no model shape" in capsys.readouterr().err


def _megatron():
    from autoplan.inspect import export_check as ec

    return ec if ec.megatron_available() else None


@pytest.mark.skipif(_megatron() is None, reason="Megatron-LM (megatron.training) is not importable; set MEGATRON_LM "
                    "to a checkout")
def test_what_is_read_is_what_megatron_builds():
    """A terse command (Megatron's defaults for the FFN, the head size, dropout, biases, recomputation): autoplan's
    reading equals the arguments Megatron-LM validates and the TransformerConfig it builds from them."""
    from autoplan.inspect import export_check as ec

    words = command_tokens(
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 2048 "
        "--num-attention-heads 16 --group-query-attention --num-query-groups 4 --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 "
        "--global-batch-size 64 --bf16 --recompute-granularity full --recompute-method block "
        "--recompute-num-layers 3 --num-layers-per-virtual-pipeline-stage 3 --use-distributed-optimizer "
        "--disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 32000")
    run = read_megatron(words)
    ns, config = ec.megatron_config(words, world_size=8, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    m = run.model
    assert (m.ffn, m.dhead, m.kv_heads) == (config.ffn_hidden_size, config.kv_channels, config.num_query_groups)
    assert m.dropout == config.hidden_dropout == config.attention_dropout
    assert m.has_bias == config.add_bias_linear and m.tie_embeddings != ns.untie_embeddings_and_output_weights
    assert run.parallel.vp == config.virtual_pipeline_model_parallel_size
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 3)
    assert run.parallel.recompute_layers // run.parallel.vp == config.recompute_num_layers  # per model chunk
    assert run.stack_set["grad_reduce_dtype"] == ("fp32" if ns.accumulate_allreduce_grads_in_fp32 else "bf16")
    assert run.parallel.zero == (1 if ns.use_distributed_optimizer else 0)


def test_search_says_what_autoplan_would_choose_instead(capsys):
    """--search: the same workload and stack searched, beside the command's own prediction."""
    plan = _plan(*CASES[0])
    words = command_tokens(export_megatron(plan)["command"])
    assert main(["from-megatron", "--cluster", "dgx-h100", "--search", "--json", "--", *words]) == 0
    out = json.loads(capsys.readouterr().out)
    found = out["from_megatron"]["search"]
    assert found["speedup"] == pytest.approx(out["step_time_s"] / found["step_time_s"])
    assert found["speedup"] >= 1.0  # Llama 2 70B, tp=4, pp=4, vp=5 on 64 H100: the search finds 1.02x
    # without --json the summary line follows the estimate
    assert main(["from-megatron", "--cluster", "dgx-h100", "--search", "--", *words]) == 0
    text = capsys.readouterr().out
    assert "autoplan search on the same stack: " + found["parallel"] in text


_SHAPE = "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 32000 "


def test_megatron_turns_sequence_parallelism_off_at_tp_1():
    """arguments.py: "Disabling sequence parallelism because tensor model parallelism is disabled". NVIDIA's own
    Llama 3 8B script passes --sequence-parallel with tp=1; until session 36 the reader refused it."""
    run = read_megatron(command_tokens(_SHAPE + "--tensor-model-parallel-size 1 --sequence-parallel"))
    assert run.parallel.sp is False and any("Megatron turns it off" in n for n in run.notes)
    run = read_megatron(command_tokens(_SHAPE + "--tensor-model-parallel-size 2 --sequence-parallel"))
    assert run.parallel.sp is True and not any("turns it off" in n for n in run.notes)


def test_quick_geglu_is_a_gated_mlp_with_the_plain_ffn_default():
    """argument_utils.py: --quick-geglu sets gated_linear_unit (three matrices); the FFN default stays 4h, which
    only --swiglu changes."""
    plain = read_megatron(command_tokens(_SHAPE))
    gated = read_megatron(command_tokens(_SHAPE + "--quick-geglu"))
    assert plain.model.activation == "gelu" and gated.model.activation == "swiglu"
    assert gated.model.ffn == plain.model.ffn == 4 * 2048
    assert any("--quick-geglu" in n for n in gated.notes)


def test_pretrain_gpt_takes_the_gpt2_tokenizer_when_none_is_named():
    """pretrain_gpt.py passes args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}: a command with a vocab file
    and no --tokenizer-type (Megatron-LM's GPT-3 175B example) has GPT-2's 50257 tokens."""
    shape = "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
    run = read_megatron(command_tokens("torchrun --nproc-per-node 8 pretrain_gpt.py " + shape + "--vocab-file v.json"))
    assert run.model.vocab_size == 50304 and any("GPT2BPETokenizer" in n for n in run.notes)
    assert "--tokenizer-type" not in run.unpriced
    with pytest.raises(ConfigError, match="vocabulary size is not in the flags"):
        read_megatron(command_tokens("torchrun --nproc-per-node 8 pretrain_bert.py " + shape))


def test_flags_that_change_what_runs_are_said_and_unexpressible_models_refused():
    run = read_megatron(command_tokens(_SHAPE + "--window-size 127,0 --window-attn-skip-freq 2 --fp8-param-gather "
                                       "--no-rope-fusion --lr 1e-4"))
    said = " ".join(run.notes)
    assert "priced as full causal attention" in said and "fp8" in said and "RoPE" in said
    assert run.unpriced == ["--lr"]  # the rest are noted, not listed as priced-as-absent
    with pytest.raises(ConfigError, match="--multi-latent-attention: multi-latent attention is not expressible"):
        read_megatron(command_tokens(_SHAPE + "--multi-latent-attention --q-lora-rank 1536"))


def test_no_gradient_accumulation_fusion_is_read():
    run = read_megatron(command_tokens(_SHAPE + "--no-gradient-accumulation-fusion"))
    assert run.stack_set["grad_accum_fused"] is False
    assert "grad_accum_fused" not in read_megatron(command_tokens(_SHAPE)).stack_set


def test_megatron_2021_flags_of_the_sc21_scripts():
    """examples/academic_paper_scripts/sc21/run_table_1.sh passes --activations-checkpoint-method uniform alone
    (2021-08 to 2022-05: the method turned full recomputation on) and --DDP-impl torch up to 18B (torch DDP
    all-reduces its buckets during the backward). Until session 36 both were read as changing nothing."""
    run = read_megatron(command_tokens(_SHAPE + "--activations-checkpoint-method uniform --DDP-impl torch"))
    assert run.parallel.recompute == "full" and run.stack_set["overlap_grad_reduce"] is True
    run = read_megatron(command_tokens(_SHAPE + "--pipeline-model-parallel-size 2 --activations-checkpoint-method "
                                       "block --activations-checkpoint-num-layers 3 --DDP-impl local"))
    assert (run.parallel.recompute, run.parallel.recompute_layers) == ("full", 3)
    assert run.stack_set["overlap_grad_reduce"] is False and not run.unpriced


def test_megatron_deepspeed_commands_price_on_deepspeeds_stack(tmp_path, capsys):
    """Megatron-DeepSpeed (BLOOM's and MT-NLG's software): --deepspeed runs DeepSpeed's engine, whose JSON gives
    the micro-batch, the batch, the ZeRO stage and the precision where the flags do not; --zero-stage is its flag
    for the stage. Until session 36 all of it was read as changing nothing, on Megatron-Core's stack."""
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2048,
                              "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}))
    flags = ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 50304 "
             "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --checkpoint-activations "
             f"--deepspeed --deepspeed_config {ds} --zero-stage 1")
    run = read_megatron(command_tokens(flags))
    assert run.stack == "megatron-deepspeed" and run.dtype == "bf16" and run.parallel.mbs == 2
    assert run.global_batch == 2048 and run.parallel.zero == 1  # the flag over the JSON's stage
    assert "overlap_grad_reduce" not in run.stack_set and not run.unpriced
    assert any("--micro-batch-size 2 from --deepspeed_config" in n for n in run.notes)
    assert main(["from-megatron", "--cluster", "dgx-a100-80g", "--gpus", "64", "--json", "--",
                 *command_tokens(flags)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["from_megatron"]["stack"] == "megatron-deepspeed"
    # --stack still chooses; a missing JSON is said, not guessed
    assert main(["from-megatron", "--cluster", "dgx-a100-80g", "--gpus", "64", "--stack", "megatron-core",
                 "--json", "--", *command_tokens(flags.replace(str(ds), str(tmp_path / "gone.json"))),
                 "--micro-batch-size", "1", "--global-batch-size", "512"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["from_megatron"]["stack"] == "megatron-core"
    assert any("gone.json not read" in n for n in out["from_megatron"]["notes"])
    # a name only running could give (Megatron-DeepSpeed's examples build it from $(nvidia-smi ... | wc -l)): said
    run = read_megatron(command_tokens(flags.replace(str(ds), "'ds_$(nvidia-smi -L | wc -l).json'")))
    assert run.parallel.mbs == 1 and any("not read (its name holds a command substitution" in n for n in run.notes)
    ds.write_text(json.dumps({"bf16": True}))  # not DeepSpeed's form: refused naming the key, not a traceback
    with pytest.raises(ConfigError, match="the DeepSpeed config's bf16 is not an object"):
        read_megatron(command_tokens(flags))


def test_megatron_deepspeeds_own_flags_for_bloom(capsys):
    """BLOOM's Megatron-DeepSpeed flags: --pad-vocab-size-to gives the embedding's rows (the tokenizer's files are
    not needed), ALiBi positions, and --zero-stage 0 under bf16 runs DeepSpeed's BF16_Optimizer, which shards the
    fp32 master and Adam states itself (zero=1); under fp16 stage 0 is unsharded."""
    flags = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --tokenizer-type "
             "PretrainedFromHF --pad-vocab-size-to 250880 --position-embedding-type alibi --deepspeed --zero-stage 0 ")
    run = read_megatron(command_tokens(flags + "--bf16"))
    assert run.model.vocab_size == 250880 and run.model.position == "alibi" and run.parallel.zero == 1
    assert any("BF16_Optimizer" in n for n in run.notes) and not run.unpriced
    assert read_megatron(command_tokens(flags + "--fp16")).parallel.zero == 0
    # over one data-parallel rank the sharding is a no-op that Megatron and DeepSpeed run: priced as zero=0
    assert main(["from-megatron", "--cluster", "dgx-a100-80g", "--gpus", "2", "--json", "--",
                 *command_tokens(flags + "--bf16 --tensor-model-parallel-size 2 --global-batch-size 4")]) == 0
    captured = capsys.readouterr()
    assert ",zero=0," in json.loads(captured.out)["from_megatron"]["parallel"]
    assert "zero=1 over one data-parallel rank shards nothing" in captured.err
    with pytest.raises(ConfigError, match="--pad-vocab-size-to is below the vocabulary"):
        read_megatron(command_tokens(flags.replace("--tokenizer-type PretrainedFromHF", "--vocab-size 300000")))
    # exported back to Megatron-LM, which has no ALiBi: said, not written as a flag its parser refuses
    cluster = load_cluster("dgx-a100-80g", gpus=8)
    tr = apply_stack(TrainingSpec(global_batch_size=16, seq_length=2048, dtype="bf16"), "megatron-core", {})
    plan = plan_from_estimate(run.model, cluster, tr, estimate_config(run.model, cluster, tr, "tp=2,pp=1,mbs=1"))
    d = export_megatron(plan)
    assert "--position-embedding-type" not in d["flags"] and any("ALiBi" in w for w in d["warnings"])


def test_deepspeed_moe_reads_as_megatron_deepspeed_runs_it():
    """DeepSpeed-MoE's flags (Megatron-DeepSpeed's examples_deepspeed/MoE): experts every --expert-interval-th
    layer (default 2), --topk (default 1), expert parallelism --moe-expert-parallel-size, and every expert's input
    padded to --moe-train-capacity-factor x the balanced load. Until session 37 these were read as Megatron-Core's:
    experts on every layer, top-2, ep=1."""
    flags = ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048 --vocab-size 50304 "
             "--micro-batch-size 4 --global-batch-size 256 --deepspeed --num-experts 64 --moe-expert-parallel-size 8 ")
    run = read_megatron(command_tokens(flags))
    moe = run.model.moe
    assert (moe.num_experts, moe.top_k, moe.every_n_layers, moe.pad_to_capacity) == (64, 1, 2, False)
    assert run.parallel.ep == 8 and not run.unpriced
    run = read_megatron(command_tokens(flags + "--topk 2 --expert-interval 1 --moe-train-capacity-factor 1.25"))
    assert (run.model.moe.top_k, run.model.moe.every_n_layers) == (2, 1)
    assert (run.model.moe.capacity_factor, run.model.moe.pad_to_capacity) == (1.25, True)
    dropless = read_megatron(command_tokens(flags + "--disable-moe-token-dropping --moe-train-capacity-factor 2"))
    assert not dropless.model.moe.pad_to_capacity and any("busiest" in n for n in dropless.notes)
    # DeepSpeed's launcher gives the world size where it writes both counts (else its hostfile's, not known here)
    assert read_megatron(command_tokens("deepspeed --num_nodes 2 --num_gpus 8 pretrain_gpt.py " + flags)).gpus == 16
    assert read_megatron(command_tokens("deepspeed --hostfile hf pretrain_gpt.py " + flags)).gpus is None
    with pytest.raises(ConfigError, match="Residual MoE"):
        read_megatron(command_tokens(flags + "--mlp-type residual"))
    with pytest.raises(ConfigError, match="pyramid MoE"):
        read_megatron(command_tokens(flags.replace("--num-experts 64", "--num-experts 32 32 64")))
    assert read_megatron(command_tokens(flags.replace("--num-experts 64", "--num-experts 64 64"))).model.moe


def test_deepspeeds_partition_by_type_counts_the_embeddings():
    """BLOOM's 'type:transformer|embedding' on 70 blocks over pp=12: 72 units of 6, the end stages 5 blocks each
    (the fidelity row's layout)."""
    flags = ("--num-layers 70 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --vocab-size 50304 "
             "--pipeline-model-parallel-size 12 --deepspeed --pp-partition-method type:transformer|embedding")
    run = read_megatron(command_tokens(flags.replace("type:transformer|embedding", "'type:transformer|embedding'")))
    assert counts(run.parallel.layout) == [5] + [6] * 10 + [5]
    assert run.stack_set["uneven_stages"] is True
    uneven = read_megatron(command_tokens(flags.replace("70", "71").replace("type:transformer|embedding",
                                                                           "'type:transformer|embedding'")))
    assert uneven.parallel.layout is None and any("balances the stages its own way" in n for n in uneven.notes)


def test_megatron_cores_moe_layer_freq_starts_at_layer_zero():
    """--moe-layer-freq N puts Megatron-Core's experts on layers 0, N, 2N (gpt_layer_specs.py: `1 if (i %
    moe_layer_freq == 0)`), where Hugging Face's decoder_sparse_step and DeepSpeed's expert_interval start at N - 1:
    on 5 layers that is 3 MoE layers, not 2. A list pattern of one MoE layer every n from some first layer reads;
    the export writes back the layers the plan priced (an int where Megatron's int means them, else the list)."""
    flags = ("--num-layers 5 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --vocab-size 1000 "
             "--num-experts 4 --moe-layer-freq ")
    model = read_megatron(command_tokens(flags + "2")).model
    assert [model.is_moe_layer(i) for i in range(5)] == [True, False, True, False, True]
    pattern = read_megatron(command_tokens(flags.replace("--num-layers 5", "--num-layers 12") +
                                           "'([0]*3+[1]*1)*3'")).model
    assert [i for i in range(12) if pattern.is_moe_layer(i)] == [3, 7, 11]
    dense_first = read_megatron(command_tokens(flags + "'[0]+[1]*4'")).model  # DeepSeek's dense first layer
    assert [dense_first.is_moe_layer(i) for i in range(5)] == [False, True, True, True, True]
    irregular = read_megatron(command_tokens(flags + "'[1,1,0,1,0]'")).model
    assert irregular.moe.layers == (0, 1, 3)
    for bad in ("'([1]*2+[0])*2'", "'__import__(\"os\")'", "'[0]*5'"):  # 6 entries for 5 layers; a call; none
        with pytest.raises(ConfigError, match="not a 0/1 list of one entry per layer"):
            read_megatron(command_tokens(flags + bad))
    # exported as priced, and read back to the same layers and prediction
    cluster = load_cluster("dgx-h100", gpus=8)
    tr = apply_stack(TrainingSpec(global_batch_size=16, seq_length=128), "megatron-core", {})
    hf_style = ModelSpec(name="m", num_layers=6, hidden_size=256, num_attention_heads=4, vocab_size=1024,
                         max_seq_length=128, moe=MoESpec(num_experts=4, every_n_layers=2))  # layers 1, 3, 5
    for spec, written in ((hf_style, "[0,1]*3"),
                          (hf_style.model_copy(update={"moe": hf_style.moe.model_copy(update={"first_layer": 0})}),
                           2),
                          (hf_style.model_copy(update={"moe": hf_style.moe.model_copy(update={"layers": (0, 1, 4)})}),
                           "[1,1,0,0,1,0]")):
        plan = plan_from_estimate(spec, cluster, tr, estimate_config(spec, cluster, tr, "tp=1,pp=1,mbs=1"))
        d = export_megatron(plan)
        assert d["flags"]["--moe-layer-freq"] == written
        back = read_megatron(command_tokens(d["command"])).model
        assert [back.is_moe_layer(i) for i in range(6)] == [spec.is_moe_layer(i) for i in range(6)]
    with pytest.raises(SpecError, match="MoE layers fall outside the model"):
        ModelSpec(
            name="m", num_layers=6, hidden_size=256, num_attention_heads=4, vocab_size=1024, max_seq_length=128,
            moe=MoESpec(num_experts=4, every_n_layers=2, first_layer=9))


def test_experts_padded_to_capacity_export_and_read_back(capsys):
    """A plan priced with Megatron's padded dispatch exports --moe-expert-capacity-factor and
    --moe-pad-expert-input-to-capacity, and reads back to the same padded experts and prediction."""
    mix = load_model("mixtral-8x7b")
    model = mix.model_copy(update={"moe": mix.moe.model_copy(update={"capacity_factor": 1.25,
                                                                      "pad_to_capacity": True})})
    cluster = load_cluster("dgx-h100", gpus=64)
    tr = apply_stack(TrainingSpec(global_batch_size=256, seq_length=4096, dtype="bf16"), "megatron-core", {})
    plan = plan_from_estimate(model, cluster, tr, estimate_config(model, cluster, tr,
                                                                  "tp=2,pp=4,ep=8,mbs=1,sp=1,zero=1,recompute=full"))
    d = export_megatron(plan)
    assert d["flags"]["--moe-expert-capacity-factor"] == 1.25 and d["flags"]["--moe-pad-expert-input-to-capacity"]
    run = read_megatron(command_tokens(d["command"]))
    assert (run.model.moe.capacity_factor, run.model.moe.pad_to_capacity) == (1.25, True)
    assert any("1.25 x the balanced load" in n for n in run.notes)
    assert main(["from-megatron", "--cluster", "dgx-h100", "--json", "--", *command_tokens(d["command"])]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] == pytest.approx(plan.prediction.step_time_s, rel=0.01)
