"""Inputs that forgive and never guess: sizes from --gpus when a cluster file leaves them out, one-line errors
naming the field, the value and the fix, and no silent defaults for 0 or duplicate keys."""

from __future__ import annotations

import json

import pytest

from autoplan.cli import main

EST = ["estimate", "--global-batch", "64", "--parallel", "tp=1"]


def _err(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoplan:") and "\n" not in err and "fix:" in err, err
    assert "Traceback" not in err and len(err) < 400, err
    return err


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


CLUSTER = "name: c\ngpu: h100-sxm\ngpus_per_node: 8\nintra_node: {bandwidth_gbps: 450}\ninter_node: {bandwidth_gbps: 50}\n"


def test_cluster_file_without_num_nodes_takes_gpus(tmp_path, capsys):
    path = _write(tmp_path, "c.yaml", CLUSTER)
    assert main(EST + ["--model", "gpt3-125m", "--cluster", path, "--gpus", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parallel"]["dp"] == 16
    err = _err(capsys, EST + ["--model", "gpt3-125m", "--cluster", path])
    assert "'num_nodes' is required" in err and "--gpus" in err


def test_gpus_beyond_a_sized_cluster_file_is_an_error(tmp_path, capsys):
    path = _write(tmp_path, "c.yaml", CLUSTER + "num_nodes: 2\n")
    err = _err(capsys, EST + ["--model", "gpt3-125m", "--cluster", path, "--gpus", "64"])
    assert "more than" in err and "16 GPUs" in err


def test_gpus_beyond_a_preset_is_said(capsys):
    assert main(["estimate", "--global-batch", "4096", "--parallel", "tp=1", "--model", "gpt3-125m", "--cluster",
                 "dgx-h100", "--gpus", "4096", "--json"]) == 0
    assert "grows preset dgx-h100 from 1024 to 4096 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--gpus", "--seq-len", "--global-batch"])
def test_zero_is_not_a_default(capsys, flag):
    argv = ["estimate", "--model", "gpt3-125m", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64",
            "--parallel", "tp=1"]
    if flag in argv:
        argv[argv.index(flag) + 1] = "0"
    else:
        argv += [flag, "0"]
    assert f"{flag} must be positive" in _err(capsys, argv)


def test_duplicate_parallel_keys(capsys):
    err = _err(capsys, ["estimate", "--model", "gpt3-125m", "--cluster", "dgx-h100", "--gpus", "8",
                        "--global-batch", "64", "--parallel", "tp=2,tp=4"])
    assert "'tp' given twice" in err


@pytest.mark.parametrize("sched", ["gpipe", "1f1b"])
def test_virtual_stages_with_another_schedule_are_refused(capsys, sched):
    """vp>1 with schedule=gpipe|1f1b was quietly run (and priced) as the interleaved schedule."""
    err = _err(capsys, ["estimate", "--model", "gpt3-125m", "--cluster", "dgx-h100", "--gpus", "8",
                        "--global-batch", "64", "--parallel", f"pp=2,vp=2,schedule={sched}"])
    assert f"vp>1 runs the interleaved schedule, not {sched}" in err and "Traceback" not in err


@pytest.mark.parametrize("name,text,needle", [
    ("config.json", '{"model_type": "llama", "hidden_size": 4096,\n', "is not valid JSON"),
    ("config.json", '{"model_type":"llama","num_hidden_layers":4,"hidden_size":"big","num_attention_heads":8,'
                    '"vocab_size":1000}', "'hidden_size' must be an integer: got 'big'"),
    ("config.json", '{"model_type":"bert","architectures":["BertForMaskedLM"],"num_hidden_layers":4,'
                    '"hidden_size":64,"num_attention_heads":8,"vocab_size":1000}', "decoder-only causal"),
    ("config.json", '{"model_type":"t5","is_encoder_decoder":true,"num_layers":4,"d_model":64,"num_heads":8,'
                    '"vocab_size":1000}', "decoder-only causal"),
    ("spec.yaml", "name: x\nnum_layers: 2\nhidden_size: big\nnum_attention_heads: 2\nvocab_size: 10\n"
                  "max_seq_length: 8\n", "field 'hidden_size'"),
    ("spec.yaml", "name: x\nnum_layers: 2\nhidden_size: 8\nnum_attention_heads: 2\nvocab_size: 10\n",
     "field 'max_seq_length' is required"),
    ("spec.json", '{"name": "x", "num_layers": 2,', "is not valid JSON"),
])
def test_model_file_errors_are_one_line(tmp_path, capsys, name, text, needle):
    path = _write(tmp_path, name, text)
    err = _err(capsys, EST + ["--model", path, "--cluster", "dgx-h100", "--gpus", "8"])
    assert needle in err


def test_cluster_field_error_is_one_line(tmp_path, capsys):
    path = _write(tmp_path, "c.yaml", CLUSTER.replace("450", "-4") + "num_nodes: 1\n")
    err = _err(capsys, EST + ["--model", "gpt3-125m", "--cluster", path])
    assert "intra_node.bandwidth_gbps" in err and "got -4" in err


def test_spaces_separate_configuration_items_as_commas_do():
    """`--parallel "tp=2 pp=2"` read as tp=2pp=2 ("tp must be an integer") until session 25."""
    from autoplan.cost_models.specs import ParallelConfig

    want = ParallelConfig.parse("tp=2,pp=2,recompute=full")
    for text in ("tp=2 pp=2 recompute=full", "tp = 2, pp = 2,recompute=full", " tp=2,,pp=2  recompute=full "):
        assert ParallelConfig.parse(text) == want, text
    assert ParallelConfig.parse("tp=2 pp=4 layout=Et*4|(t*7|)*2,t*6L mbs=2").pp == 4  # a layout keeps its comma
