"""Explicit stage layouts: Megatron-Core's layout string and block counts, --uneven, checks naming the stage,
the cost model and plans following the layout, the Megatron export."""

from __future__ import annotations

import json

import pytest

from autoplan.cli import main
from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.layout import check_layout, counts, normalize, parse_layout, uneven
from autoplan.cost_models.specs import ParallelConfig

BASE = ["estimate", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80g", "--gpus", "16", "--global-batch", "64",
        "--json"]


def test_megatron_grammar():
    text = "Et*3|(tt|)*29,t|L"  # Megatron-Core's DeepSeek-V3 example with the MTP layer as a block
    stages = parse_layout(text)
    assert len(stages) == 32 and stages[0].embedding and stages[0].blocks == 3
    assert stages[-1].loss and stages[-1].blocks == 0 and stages[30].blocks == 1
    assert sum(counts(text)) == 62
    canon = normalize(text)
    assert "," not in canon and parse_layout(canon) == stages  # canonical form round-trips
    assert normalize("5,8,8,7") == normalize("Et*5|t*8|t*8|t*7L") == normalize("5/8/8/7")


@pytest.mark.parametrize("text,needle", [
    ("Et*3|(tt|*2", "unmatched '('"),
    ("Et*3|x|L", "unknown symbol"),
    ("*3|tL", "'*' needs"),
    ("EEt|tL", "more than once in stage 0"),
])
def test_grammar_errors(text, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("*", r"\*")):
        parse_layout(text)


@pytest.mark.parametrize("text,needle", [
    ("Et*4|t*4|t*4|t*4", "loss (L) must be on the last stage"),
    ("t*4|Et*4|t*4|t*4L", "embedding (E) must be on the first stage"),
    ("Et*4||t*8|t*4L", "stage 1 (pipeline rank 1) is empty"),
    ("Et*4|t*4|t*4|t*3L", "add up to the model's"),
    ("Et*8|t*8L", "pp*vp stages"),
])
def test_layout_rules_name_the_stage(text, needle):
    with pytest.raises(ConfigError) as e:
        check_layout(text, num_layers=16, pp=4, vp=1)
    assert needle in e.value.one_line() and "fix:" in e.value.one_line()


def test_uneven():
    assert counts(uneven(126, 16, 1, 7, 7)) == [7] + [8] * 14 + [7]  # Llama 3 405B-like: 126 layers on pp=16
    assert counts(uneven(24, 8, 1, 0, 1)) == [0, 4, 4, 4, 4, 4, 3, 1]
    assert counts(uneven(24, 4, 1, None, 3)) == [7, 7, 7, 3]
    with pytest.raises(ConfigError):
        uneven(8, 2, 1, 5, 5)


def test_uneven_counts_pipeline_ranks_under_interleaving_as_megatron_does():
    """first/last are the first and last pipeline rank's blocks over all their virtual stages (Megatron-Core's
    --decoder-first/last-pipeline-num-layers), not the first and last virtual stage's."""
    # Llama 3 405B: one block fewer on the first and the last of 16 ranks, one block per virtual stage
    assert uneven(126, 16, 8, 7, 7) == "E|(t|)*126L"
    # divisible, as Megatron requires: ranks 0 and 3 hold 4 blocks as 2 + 2, the middle ranks 8 as 4 + 4
    assert counts(uneven(24, 4, 2, 4, 4)) == [2, 4, 4, 2, 2, 4, 4, 2]
    # a remainder goes away from the embedding on the first rank, away from the loss on the last
    assert counts(uneven(24, 4, 2, 3, 3)) == [1, 5, 5, 2, 2, 4, 4, 1]
    assert counts(uneven(24, 4, 2, None, 1)) == [4, 4, 4, 1, 4, 4, 3, 0]
    with pytest.raises(ConfigError, match="other pipeline rank"):
        uneven(24, 2, 2, 10, 10)


def test_parallel_string_keeps_layout_commas_and_refuses_duplicates():
    cfg = ParallelConfig.parse("tp=2,pp=4,layout=Et*4|(t*7|)*2,t*6L,mbs=2")
    assert cfg.mbs == 2 and counts(cfg.layout) == [4, 7, 7, 6]
    assert ParallelConfig.parse(cfg.to_string()) == cfg
    assert "layout" not in ParallelConfig.parse("tp=2").as_dict()  # the string without a layout is unchanged
    with pytest.raises(ConfigError, match="given twice"):
        ParallelConfig.parse("tp=2,tp=4")


def _est(capsys, *extra):
    assert main(BASE + list(extra)) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_follows_the_layout(capsys):
    even = _est(capsys, "--parallel", "tp=2,pp=4")
    same = _est(capsys, "--parallel", "tp=2,pp=4", "--layout", "6,6,6,6")
    assert same["step_time_s"] == pytest.approx(even["step_time_s"], rel=1e-12)
    lop = _est(capsys, "--parallel", "tp=2,pp=4", "--layout", "Et*10|t*10|t*2|t*2L")
    assert lop["step_time_s"] > even["step_time_s"]  # the first ranks do 10 blocks per micro-batch
    assert lop["memory_gib"]["per_stage"][0] > even["memory_gib"]["per_stage"][0]
    # 32 layers-per-stage checks are lifted: an E-only virtual stage and a loss-only one
    ends = _est(capsys, "--parallel", "tp=2,pp=4,vp=2", "--uneven", "first=1,last=1")
    assert counts(ends["parallel"]["layout"]) == [0, 6, 6, 1, 1, 5, 5, 0]


def test_estimate_layout_errors_are_one_line(capsys):
    assert main(BASE + ["--parallel", "tp=2,pp=4", "--layout", "Et*4|t*4|t*4|t*4"]) == 2
    cap = capsys.readouterr()
    err = (json.loads(cap.out)["error"] if "--json" in BASE else cap.err).strip()  # --json: errors as JSON
    assert "loss (L) must be on the last stage" in err and "stage 3" in err and "\n" not in err
    assert main(BASE + ["--parallel", "tp=2,pp=4,layout=6/6/6/6", "--uneven", "first=4"]) == 2
    cap = capsys.readouterr()
    assert "give the stage layout once" in (cap.out if "--json" in BASE else cap.err)


def test_plan_carries_the_layout_to_show_trace_export(tmp_path, capsys):
    from autoplan.inspect.export import export_megatron
    from autoplan.plan import load_plan

    out = tmp_path / "p.json"
    _est(capsys, "--parallel", "tp=2,pp=4,vp=2", "--uneven", "first=1,last=2", "-o", str(out))
    plan = load_plan(out)
    assert [s.num_layers for s in plan.stages] == counts(plan.parallel.layout) == [0, 6, 5, 1, 1, 5, 5, 1]
    assert plan.stages[0].has_embedding and plan.stages[-1].has_head
    flags = export_megatron(plan)["command"]
    assert f"--pipeline-model-parallel-layout '{plan.parallel.layout}'" in flags
    assert main(["show", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"][0]["embedding"]
    assert main(["trace", str(out), "-o", str(tmp_path / "t.json"), "--json"]) == 0
    assert main(["explain", str(out), "--json"]) == 0


def test_uneven_under_interleaving_exports_megatrons_own_flags(tmp_path, capsys):
    """`--uneven first=4,last=4` at pp=4, vp=2 is what Megatron's --decoder-first/last-pipeline-num-layers 4 build:
    the export writes those flags back with the same counts, not a layout string."""
    from autoplan.inspect.export import export_megatron
    from autoplan.plan import load_plan

    out = tmp_path / "p.json"
    _est(capsys, "--parallel", "tp=2,pp=4,vp=2", "--uneven", "first=4,last=4", "-o", str(out))
    flags = export_megatron(load_plan(out))["command"]
    assert "--decoder-first-pipeline-num-layers 4" in flags and "--decoder-last-pipeline-num-layers 4" in flags
    assert "--num-virtual-stages-per-pipeline-rank 2" in flags and "--pipeline-model-parallel-layout" not in flags


def test_plans_without_the_new_fields_still_load(tmp_path, capsys):
    """A plan file written before `stack`, `parallel.layout` and the new stack knobs existed keeps its hash."""
    from autoplan.plan import Plan, load_plan

    out = tmp_path / "p.json"
    _est(capsys, "--parallel", "tp=2,pp=4", "-o", str(out))
    data = json.loads(out.read_text())
    assert data["stack"] is None and data["parallel"]["layout"] is None
    data.pop("stack")
    data["parallel"].pop("layout")
    # (p2p_scatter_gather is not among them: its default changed, and a plan without it was priced with true --
    # tests/unit/test_counts.py::test_plans_of_the_old_p2p_default_keep_their_hash_and_meaning)
    for k in ("tp_bwd_comm_overlap", "p2p_overlap", "grad_accum_fused", "grad_sync_all_reduce", "runtime_memory",
              "optimizer_dtype", "master_weights", "loss_fusion", "align_grad_reduce", "flexible_rounds", "zero_stages",
              "schedules", "seq_splits"):
        data["training"].pop(k)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    plan = load_plan(old)  # the stored hash, computed with the new fields present, still verifies
    assert plan.content_hash == Plan.model_validate(data).compute_hash() == json.loads(out.read_text())["content_hash"]


def test_search_balances_the_head_of_a_large_vocabulary(tmp_path, capsys):
    """The search weighs the LM head (a 256K vocabulary on a 2048-wide model) when it places stages: the last
    stage gets fewer blocks than the others."""
    spec = tmp_path / "bigvocab.yaml"
    spec.write_text("name: bigvocab\nnum_layers: 24\nhidden_size: 2048\nnum_attention_heads: 16\n"
                    "vocab_size: 256000\nmax_seq_length: 2048\n")
    assert main(["search", "--model", str(spec), "--cluster", "dgx-a100-80g", "--gpus", "32", "--global-batch", "64",
                 "--fix", "tp=8,pp=4,vp=1,mbs=1", "--top", "1", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    sizes = [s["layers"][1] - s["layers"][0] for s in stages]
    assert sum(sizes) == 24 and sizes[-1] < min(sizes[:-1]), sizes


def test_search_gives_a_heavy_head_a_virtual_stage_of_its_own(tmp_path, capsys):
    """With interleaving the search may leave the last virtual stage to the LM head alone (Megatron-Core's
    `...|L`): a 256K-vocabulary head on a 2048-wide model outweighs the blocks, so it does, and the plan runs as
    estimated from its own layout string and exports it."""
    from autoplan.plan import load_plan

    spec = tmp_path / "bigvocab.yaml"
    spec.write_text("name: bigvocab\nnum_layers: 24\nhidden_size: 2048\nnum_attention_heads: 16\n"
                    "vocab_size: 256000\nmax_seq_length: 2048\n")
    out = tmp_path / "p.json"
    args = ["--model", str(spec), "--cluster", "dgx-a100-80g", "--gpus", "32", "--global-batch", "64"]
    assert main(["search", *args, "--fix", "tp=8,pp=4,vp=2", "--top", "1", "-o", str(out), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    sizes = [s["layers"][1] - s["layers"][0] for s in found["stages"]]
    assert sizes[-1] == 0 and min(sizes[:-1]) >= 1 and sum(sizes) == 24
    plan = load_plan(out)
    assert plan.stages[-1].num_layers == 0 and plan.stages[-1].has_head
    layout = ",".join(str(n) for n in sizes)
    cfg = ",".join(f"{k}={v}" for k, v in found["parallel"].items() if k in ("tp", "pp", "vp", "mbs", "zero"))
    assert main(["estimate", *args, "--parallel", f"{cfg},sp=1,schedule=interleaved", "--layout", layout,
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(found["step_time_s"], rel=1e-9)
    assert main(["export", str(out), "--format", "megatron", "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["flags"]["--pipeline-model-parallel-layout"].endswith("|L")
