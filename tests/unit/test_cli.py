"""The CLI's estimate/models/clusters/schema commands: JSON fields of DESIGN.md, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoplan.cli import main

EST = ["estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "1024", "--global-batch",
       "1536", "--seq-len", "2048", "--parallel", "tp=8,pp=8,vp=3,mbs=1,sp=1,zero=1,recompute=selective"]


def test_estimate_json_fields(capsys):
    assert main(EST + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tflops_per_gpu", "mfu", "hfu", "memory_gib", "breakdown", "parallel"):
        assert key in d
    assert len(d["memory_gib"]["per_stage"]) == 8
    assert d["memory_gib"]["peak"] == pytest.approx(max(d["memory_gib"]["per_stage"]))
    assert d["parallel"]["tp"] == 8 and d["parallel"]["dp"] == 16 and d["parallel"]["schedule"] == "interleaved"
    assert sum(d["breakdown"].values()) == pytest.approx(d["step_time_s"], rel=1e-9)
    assert 0.2 < d["mfu"] < 0.8 and d["hfu"] >= d["mfu"]


def test_estimate_rich_output(capsys):
    assert main(EST) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "Memory per pipeline rank" in out and "bubble" in out


def test_memory_tables_say_when_one_micro_batch_makes_its_gradients_in_the_backward(tmp_path, capsys):
    """estimate's and show's memory tables name the moment of the peak where gradients and activations are not
    held together (cost_models.estimate.grads_made_in_backward), and say nothing otherwise."""
    base = ["estimate", "--model", "tiny-gpt", "--cluster", "local-cpu", "--gpus", "1", "--seq-len", "8"]

    def out(batch, extra=()):
        capsys.readouterr()
        assert main(base + ["--global-batch", str(batch), "--parallel", "mbs=1", *extra]) == 0
        return " ".join(capsys.readouterr().out.split())

    assert "gradients are made in the backward" not in out(2)  # two micro-batches: every gradient at the peak
    assert "gradients are made in the backward, so the columns are those of the fullest moment" in out(1)
    plan = tmp_path / "p.json"
    out(1, ["-o", str(plan)])
    assert main(["show", str(plan)]) == 0
    assert "the columns are those of the fullest moment" in " ".join(capsys.readouterr().out.split())


def test_estimate_writes_a_plan(tmp_path, capsys):
    from autoplan.plan import load_plan

    out = tmp_path / "p.json"
    assert main(EST + ["-o", str(out), "--json"]) == 0
    plan = load_plan(out)
    assert plan.parallel.vp == 3 and len(plan.stages) == 24
    assert plan.prediction.step_time_s == pytest.approx(json.loads(capsys.readouterr().out)["step_time_s"])


@pytest.mark.parametrize("args,needle", [
    (["--parallel", "tp=16"], "tp must stay inside a node"),
    (["--parallel", "tp=8,pp=8,mbs=7"], "global batch must divide by dp*mbs"),
    (["--parallel", "tp=8,pp=8,foo=1"], "unknown parallel configuration key"),
])
def test_estimate_errors_are_one_line(capsys, args, needle):
    base = EST[:-2]
    assert main(base + args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and err.startswith("autoplan:") and "fix:" in err


def test_search_says_what_to_write_for_a_parallel_configuration(capsys):
    assert main(["search", "--model", "tiny-gpt", "--cluster", "local-cpu", "--gpus", "4", "--global-batch", "8",
                 "--parallel", "tp=2,pp=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "search chooses the parallel layout: it has no --parallel" in err and "\n" not in err
    assert "--fix tp=2,pp=2" in err and "autoplan estimate --parallel tp=2,pp=2" in err


def test_bad_model_and_cluster(capsys):
    assert main(["estimate", "--model", "nope", "--cluster", "dgx-h100", "--global-batch", "8",
                 "--parallel", "tp=1"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_listing_commands(capsys):
    assert main(["models", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    for name in ("gpt3-125m", "gpt3-175b", "llama2-70b", "llama3-405b", "mixtral-8x7b", "sc21-1t",
                 "mlm-h100-462b", "tiny-gpt"):
        assert name in models
    assert main(["clusters", "--json"]) == 0
    clusters = {c["name"] for c in json.loads(capsys.readouterr().out)}
    assert {"dgx-a100-80g", "dgx-h100", "dgx-h200", "dgx-b200", "local-cpu"} <= clusters
    assert main(["schema"]) == 0
    assert "schema_version" in capsys.readouterr().out


def test_estimate_does_not_import_torch():
    code = ("import sys; from autoplan.cli import main; main(" + repr(EST + ["--json"]) + ");"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--global-batch", "0"], "--global-batch must be positive: got --global-batch 0"),
    (["--global-batch", "8", "--seq-len", "-5"], "--seq-len must be positive: got --seq-len -5"),
])
def test_bad_training_setup_is_one_line(capsys, args, needle):
    assert main(["estimate", "--model", "gpt3-175b", "--cluster", "dgx-h100", *args, "--parallel", "tp=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "pydantic" not in err


def test_memory_limit_keeps_headroom(capsys):
    base = ["--model", "gpt3-175b", "--cluster", "dgx-a100-80g", "--gpus", "1024", "--global-batch", "1536",
            "--seq-len", "2048", "--parallel", "tp=8,pp=8,vp=3,mbs=1,sp=1,zero=1,recompute=selective", "--json",
            "--stack", "megatron-2022"]  # Korthikanti et al.'s run; autoplan's runtime needs more (its autocast)
    assert main(["estimate", *base]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["fits"]
    assert main(["estimate", *base, "--memory-limit", "20"]) == 0
    limited = json.loads(capsys.readouterr().out)
    assert not limited["fits"] and limited["step_time_s"] == pytest.approx(full["step_time_s"])
    assert main(["estimate", *base, "--memory-limit", "81"]) == 2
    assert "--memory-limit must be" in json.loads(capsys.readouterr().out)["error"]  # --json: errors as JSON


def test_demo_plans_without_running(capsys):
    assert main(["demo", "--no-run"]) == 0
    out = capsys.readouterr().out
    assert "best: tp=" in out and "GiB free" in out  # the 175B search, in the 80-column table
    assert "plan tp=" in out and "predicted step time" in out  # the tiny plan for local-cpu
    assert "…" not in out


@pytest.mark.parametrize("cluster, extra, dtype, noted", [
    ("local-cpu", [], "fp32", True),  # a CPU (gloo) cluster: fp32, and a note says so
    ("local-cpu", ["--dtype", "bf16"], "bf16", False),  # asked for: kept, no note
    ("dgx-a100-80g", ["--gpus", "8"], "bf16", False),  # accelerators keep bf16
])
def test_default_dtype_follows_the_cluster(tmp_path, capsys, cluster, extra, dtype, noted):
    out = tmp_path / "plan.json"
    assert main(["estimate", "--model", "tiny-gpt", "--cluster", cluster, "--global-batch", "8",
                 "--parallel", "dp=4" if cluster == "local-cpu" else "dp=8", "-o", str(out), *extra]) == 0
    assert json.loads(out.read_text())["training"]["dtype"] == dtype
    assert ("training in fp32" in capsys.readouterr().err) is noted


def test_tflops_are_readable_at_any_scale():
    from autoplan.inspect.common import fmt_tflops

    assert [fmt_tflops(x) for x in (412.3, 91.44, 3.14159, 0.02551, 0.0)] == ["412", "91.4", "3.1", "0.026", "0"]


def test_search_prints_the_hash_of_the_plan_it_writes(tmp_path, capsys, monkeypatch):
    """A Hugging Face config's plan records its source (models.source.attach): the hash search prints is the
    written file's, which `autoplan run` and `show` print. The model is named after the config's folder, also
    when the path is given relative to it."""
    from autoplan.plan import load_plan

    cfg = tmp_path / "my-llama" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                               "intermediate_size": 176, "num_hidden_layers": 4, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}))
    out = tmp_path / "plan.json"
    monkeypatch.chdir(cfg.parent)
    assert main(["search", "--model", "config.json", "--cluster", "local-cpu", "--global-batch", "8", "--seq-len", "64",
                 "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.model_source is not None and "hf_config" in plan.model_source and plan.model.name == "my-llama"
    assert f"({plan.content_hash[:12]})" in capsys.readouterr().out


def test_a_hugging_face_config_is_priced_with_the_kernels_it_runs(tmp_path, capsys):
    """autoplan's fused kernels replace the zoo models' norms and activations only; a Hugging Face family keeps
    its own modules and runs torch's ops (session 23, an H200: a Llama config.json planned with the fused kernels
    ran the same CUDA kernels as with --kernels torch). Left to the stack, estimate and search price torch's
    kernels and say so; asked for explicitly, the fused kernels are refused; a preset keeps them."""
    from autoplan.plan import load_plan

    cfg = tmp_path / "my-llama" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                               "intermediate_size": 176, "num_hidden_layers": 4, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}))
    work = ["--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64", "--seq-len", "64"]
    out = tmp_path / "plan.json"
    assert main(["estimate", "--model", str(cfg), *work, "--parallel", "tp=2", "-o", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["kernels_assumed"] == "torch" and "runs it with torch's ops" not in captured.err
    assert "which the runtime runs with torch's ops" in captured.err
    assert load_plan(out).kernels == "torch"
    assert main(["search", "--model", str(cfg), *work, "-o", str(out)]) == 0
    assert load_plan(out).kernels == "torch"
    assert main(["estimate", "--model", str(cfg), *work, "--parallel", "tp=2", "--kernels", "fused"]) == 2
    assert "fused kernels replace its own zoo models' norms and activations only" in capsys.readouterr().err
    assert main(["estimate", "--model", "tiny-llama", *work, "--parallel", "tp=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kernels_assumed"] == "fused"


def test_a_hugging_face_config_file_not_called_config_json_is_named_by_its_file(tmp_path):
    """`llama8b.json` in any folder is the model llama8b (session 25: it took the folder's name, e.g. `tmp`);
    a checkpoint's `config.json` keeps its folder's."""
    from autoplan.specs import load_model

    body = json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128})
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "llama8b.json").write_text(body)
    (tmp_path / "Meta-Llama-3-8B").mkdir()
    (tmp_path / "Meta-Llama-3-8B" / "config.json").write_text(body)
    assert load_model(str(tmp_path / "work" / "llama8b.json")).name == "llama8b"
    assert load_model(str(tmp_path / "Meta-Llama-3-8B" / "config.json")).name == "Meta-Llama-3-8B"


def test_a_sequence_past_a_rotary_models_positions_is_planned_with_a_note(tmp_path, capsys):
    """RoPE runs past max_position_embeddings (a learned table cannot: check_config refuses it); the plan is
    made as asked and a note says the positions go past what the model was made for."""
    spec = tmp_path / "r.yaml"
    spec.write_text("name: r\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 256\n"
                    "max_seq_length: 128\nposition: rope\n")
    args = ["estimate", "--model", str(spec), "--cluster", "local-cpu", "--gpus", "1", "--global-batch", "2",
            "--parallel", "tp=1"]
    assert main([*args, "--seq-len", "256"]) == 0
    assert "--seq-len 256 is longer than r was made for (max_seq_length 128" in capsys.readouterr().err
    assert main([*args, "--seq-len", "128"]) == 0
    assert "longer than" not in capsys.readouterr().err
