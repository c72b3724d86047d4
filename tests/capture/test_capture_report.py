"""inspect-model rendering: the rich tree and the JSON summary."""

from __future__ import annotations

import json

from rich.console import Console

from autoplan.capture import graph_summary_json, render_model_tree


def test_tree_calls_out_the_repeated_block_and_totals(spec_graph):
    g = spec_graph("tiny-llama")
    console = Console(record=True, width=160)
    render_model_tree(g, console)
    text = console.export_text()
    assert "layers.0 … layers.3 ×4 identical" in text
    assert "embedding" in text and "head" in text and "total" in text
    assert "201.28K params" in text or "201,280" in text
    assert "attention heads=4 kv_heads=2 head_dim=16" in text
    assert "FLOP/token" in text and "act " in text


def test_summary_json(spec_graph):
    g = spec_graph("tiny-gpt")
    d = graph_summary_json(g)
    json.dumps(d)  # serialisable
    assert d["num_layers"] == 4
    assert d["num_parameters"] == g.num_parameters == 212352
    assert d["flops_per_token"] == g.flops_per_token()
    assert [x["name"] for x in d["layers"]] == ["embedding", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    blk = d["layers"][1]
    assert blk["params"] == g.profiles[1].params and blk["attention"]["heads"] == 4
    assert blk["flops_per_token"] == g.profiles[1].model_flops_per_token(g.seq)
    assert d["block_groups"][0]["count"] == 4
