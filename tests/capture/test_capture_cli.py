"""`autoplan estimate` and `autoplan search` on captured models: a HF config.json and a module:factory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplan.cli import main

HERE = Path(__file__).parent
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
         "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": False}
WORK = ["--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "24", "--seq-len", "8"]


def _estimate(ref: str, capsys, cfg: str = "tp=2,pp=2", gpus: str = "8") -> dict:
    work = [*WORK]
    work[work.index("--gpus") + 1] = gpus
    assert main(["estimate", "--model", ref, *work, "--parallel", cfg, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_and_search_on_a_hf_config(tmp_path, capsys):
    path = tmp_path / "tiny-llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA))
    captured = _estimate(str(path), capsys)
    analytic = _estimate("tiny-llama", capsys)  # same sizes, 4 layers instead of 2
    assert captured["parallel"]["tp"] == 2 and captured["step_time_s"] > 0
    assert captured["step_time_s"] < analytic["step_time_s"]  # half the blocks
    assert main(["search", "--model", str(path), *WORK, "--top", "2", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert best["step_time_s"] <= captured["step_time_s"] * (1 + 1e-9)


def test_estimate_on_a_module_factory(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    d = _estimate("_models:tiny_lm", capsys, "tp=2,pp=3", gpus="6")  # its 3 blocks, one per stage
    assert d["step_time_s"] > 0 and len(d["memory_gib"]["per_stage"]) == 3
    # an impossible split of the captured model is refused with the rule, in one line
    assert main(["estimate", "--model", "_models:tiny_lm", *WORK, "--parallel", "tp=8"]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("autoplan: note:")]
    assert len(err) == 1 and "attention heads must divide by tp" in err[0]


@pytest.mark.parametrize("ref", ["_models:no_such_factory", "no_such_module_xyz:f"])
def test_bad_factory_refs_are_one_line_errors(capsys, monkeypatch, ref):
    monkeypatch.syspath_prepend(str(HERE))
    assert main(["estimate", "--model", ref, *WORK, "--parallel", "tp=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoplan:") and "\n" not in err
