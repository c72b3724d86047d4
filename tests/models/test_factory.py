"""module:factory models: what the capture of the user's module allows, the refusals before launch (module and
reason named), and recomputation doing what it says (counted ops). In-process, no torchrun."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.api import make_plan
from autoplan.cost_models.errors import ConfigError
from autoplan.models import check_plan_model
from autoplan.models.factory import (
    apply_factory_recompute,
    build_factory,
    cut_factory_stage,
    factory_structure,
)
from autoplan.models.source import attach
from autoplan.plan import StagePlan
from autoplan.specs import TrainingSpec, load_cluster
from autoplan.workload import resolve_model

M = "tests/capture/_models.py"


def _plan(ref: str, layout: str, world: int = 2):
    spec, _ = resolve_model(ref)
    training = TrainingSpec(global_batch_size=4, seq_length=8, dtype="fp32")
    uneven = [(0, 2), (2, 3)] if "pp=2" in layout else None
    return attach(make_plan(spec, load_cluster("local-cpu").with_gpus(world), training, layout, kernels="torch",
                            stage_layers=uneven), ref)


def test_capture_finds_the_column_row_pairs_heads_and_cut_points():
    st = factory_structure(f"{M}:split_lm")
    assert st.col == ["attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"]
    assert st.row == ["attn.wo", "mlp.w2"]
    assert (st.embedding, st.head, st.head_is_output, st.tied) == ("embed.tok", "head", True, False)
    assert (st.heads, st.kv_heads, st.head_dim, st.sdpa, st.attention) == (4, 2, 8, True, "layers.0.attn")
    assert (st.pre_modules, st.post_modules) == (["embed"], ["norm", "head"])
    assert st.fanout == ["attn_norm", "mlp_norm"]  # read by q/k/v and by w1/w3: one input all-reduce each
    assert not st.tp_problems and not st.pp_problems and not st.selective_problems
    softcap = factory_structure(f"{M}:softcap_lm")
    assert (softcap.head, softcap.head_is_output) == ("head", False)  # tanh after the head: logits gathered
    assert factory_structure(f"{M}:tied_lm").tied
    functional = factory_structure(f"{M}:functional_head_lm")  # F.linear(x, embed.tok.weight) in the root forward
    assert (functional.embedding, functional.head, functional.vocab) == (None, None, 96)  # vocabulary replicated


@pytest.mark.parametrize("layout", ["tp=2", "pp=2", "tp=2,recompute=selective", "dp=2,recompute=full"])
def test_shardable_module_passes_the_check(layout):
    check_plan_model(_plan(f"{M}:split_lm", layout))


def test_blocks_that_differ_but_share_their_linears_take_tp():
    st = factory_structure(f"{M}:mixed_core_lm")
    assert len({st.blocks[0], st.blocks[1]}) == 2 and not st.tp_problems
    check_plan_model(_plan(f"{M}:mixed_core_lm", "tp=2"))


@pytest.mark.parametrize("factory, layout, message", [
    ("tiny_lm", "tp=2", "tp=2: blocks.0.qkv: its output is split along its 96 features (split) into several "
                        "tensors (a fused projection"),
    ("hard_heads_lm", "tp=2", "tp=2: layers.0.attn: with its linears split over tp=2 the attention gets 4 heads of "
                              "size 4 (2 KV heads) per rank instead of 2 of size 8 (1 KV heads): the reshape does not take the head count from an attribute (a literal "
    "count, or one computed from the hidden size; attributes divided: attn.n_heads=4, attn.n_kv_heads=2)"),
    ("root_scale_lm", "pp=2", "pp=2: the model's own forward computes mul before the first block, outside any "
                              "module"),
    ("pad_mask_lm", "pp=2", "pp=2: the forward computes unsqueeze from the token ids and passes it to layers.0: a "
                            "later pipeline stage receives only the hidden state (a padding mask?)"),
    ("explicit_core_lm", "tp=2,recompute=selective", "recompute=selective: layers.0.attn: the attention core is "
                                                     "written as matmul/softmax"),
    ("mixed_core_lm", "tp=2,recompute=selective", "recompute=selective: layers.1.attn: the attention core is "
                                                  "written as matmul/softmax"),
    ("softcap_lm", "pp=2", "pp=2: the model's own forward computes div after the last block"),
    ("tied_lm", "pp=2", "pp=2: head shares its weight with embed.tok: the first and last pipeline stages would each"),
    ("split_lm", "tp=2,sp=1", "sp=1: sequence parallelism needs the norms and residual stream of autoplan's own"),
    ("split_lm", "cp=2", "cp=2: context and expert parallelism need autoplan's own"),
])
def test_refusals_name_the_module_and_the_reason(factory, layout, message):
    ref = f"{M}:{factory}"
    with pytest.raises(ConfigError) as e:
        check_plan_model(_plan(ref, layout))
    assert str(e.value).startswith(f"module {ref} cannot be sharded as planned: {message}"), str(e.value)
    assert "fix: re-plan with --fix" in str(e.value)


def test_pipeline_cut_keeps_global_names_and_runs_the_users_forward():
    ref = f"{M}:split_lm"
    full = build_factory(ref, seed=3)
    tokens = torch.randint(0, 96, (2, 8))
    stages = [StagePlan(index=i, pp_rank=i, layers=r, has_embedding=i == 0, has_head=i == 1, recompute="none",
                        recompute_layers=0, forward_s=0, backward_s=0) for i, r in enumerate([(0, 2), (2, 3)])]
    first, last = build_factory(ref, seed=3), build_factory(ref, seed=3)
    cut_factory_stage(first, stages[0])
    cut_factory_stage(last, stages[1])
    names = [n for m in (first, last) for n, _ in m.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())  # each parameter on exactly one stage
    assert "module.layers.2.attn.wq.weight" in dict(last.named_parameters())
    assert sorted(first.layers) == ["0", "1"] and sorted(last.layers) == ["2"]
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), full(tokens), rtol=0, atol=0)


def test_materialising_a_meta_module_keeps_its_tied_weights():
    model = build_factory(f"{M}:tied_lm", seed=0)
    assert model.module.head.weight is model.module.embed.tok.weight
    assert sum(p.numel() for p in model.parameters()) == factory_structure(f"{M}:tied_lm").num_parameters


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _ops(recompute: str, n: int = 0) -> dict[str, int]:
    model = build_factory(f"{M}:split_lm", seed=0)
    stage = StagePlan(index=0, pp_rank=0, layers=(0, 3), has_embedding=True, has_head=True, recompute=recompute,
                      recompute_layers=n, forward_s=0, backward_s=0)
    apply_factory_recompute(model, stage)
    tokens = torch.randint(0, 96, (2, 8))
    with _Count() as c:
        model(tokens).sum().backward()
    return c.ops


def test_selective_recompute_reruns_only_the_attention_kernel_and_full_reruns_blocks():
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu"
    none, selective, full = _ops("none"), _ops("selective"), _ops("full", 2)
    assert none[sdpa] == 3 and selective[sdpa] == 6  # forward + recomputed in backward, every block
    assert selective["aten.addmm"] == none["aten.addmm"]  # the linears are not recomputed
    # 2 of 3 blocks rerun whole, the third its attention kernel (a partly full stage is selective elsewhere)
    assert full[sdpa] == 6 and full["aten.addmm"] > none["aten.addmm"]
    assert _ops("full", 3)[sdpa] == 6 and _ops("full", 3)["aten.addmm"] > full["aten.addmm"]


def test_search_pins_what_the_runtime_cannot_shard():
    from autoplan.models.source import planner_pins

    assert planner_pins(f"{M}:split_lm") == {"sp": "0", "cp": "1", "ep": "1"}
    assert planner_pins(f"{M}:tiny_lm") == {"sp": "0", "cp": "1", "ep": "1", "tp": "1"}  # fused qkv
    assert planner_pins(f"{M}:root_scale_lm")["pp"] == "1"
    assert planner_pins("tiny-llama") == {}


def test_the_emitted_program_lists_the_factory_layout():
    """The stage program the runtime executes names every sharded module of the user's module."""
    from autoplan.codegen.emit import emit_source

    src = emit_source(_plan(f"{M}:tied_lm", "tp=2"))["stage_0.py"]
    assert '"layers.2.attn.wq": ColwiseParallel(),' in src and '"layers.0.mlp.w2": RowwiseParallel(),' in src
    assert '"embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),' in src
    assert '"head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),' in src
    assert ('"layers.1.mlp_norm": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(), '
            'use_local_output=False),') in src
    assert 'HEAD_COUNTS = [("layers.0.attn", "n_heads"), ("layers.0.attn", "n_kv_heads"),' in src
    assert 'TIED = ("head", "embed.tok")' in src
    compile(src, "stage_0.py", "exec")


def test_a_meta_module_that_cannot_be_initialised_is_refused_and_a_cpu_one_shards():
    """transformers' Llama built on meta: its RMSNorm weights and rotary table have no reset_parameters, so
    materialising it would train from uninitialised memory (refused); built on the CPU it is sharded with tp: the
    reshape uses -1, so no attribute is divided (num_key_value_groups equals the KV heads by coincidence)."""
    pytest.importorskip("transformers")
    from autoplan.models.factory import tp_head_counts

    ref = f"{M}:hf_llama_meta"
    with pytest.raises(ConfigError) as e:
        check_plan_model(_plan(ref, "dp=2"))
    assert str(e.value).startswith(
        f"module {ref} cannot be sharded as planned: initialisation: the factory builds it on the meta device and "
        "model.layers.0.input_layernorm (LlamaRMSNorm) holds weight and has no reset_parameters()"), str(e.value)
    st = factory_structure(f"{M}:hf_llama")
    assert st.head_attrs == [("self_attn", "num_key_value_groups", 2)]
    assert tp_head_counts(st.ref, 2) == ((), ())
    assert (st.pre_modules, st.post_modules) == (["model.embed_tokens"], ["model.norm", "lm_head"])
    assert st.fanout == ["input_layernorm", "post_attention_layernorm"]


def test_capture_prices_the_vocabulary_as_the_tp_layout_splits_it():
    """The capture's profiles follow the module's tensor-parallel layout (factory_tp_layout): an nn.Linear head is
    vocab-parallel (its GEMM split, its input gradient all-reduced, the loss over sharded logits) and an
    nn.Embedding read by nothing else split over vocabulary rows; a head applying the embedding's table with
    F.linear leaves both replicated (no vocab GEMM split, no all-reduce at either end), its logits still known."""
    from autoplan.workload import resolve_model

    _, split = resolve_model(f"{M}:split_lm")
    assert [g.tp for g in split[-1].gemms] == ["vocab"] and split[-1].tp_allreduces == 1
    assert split[0].tp_allreduces == 1 and split[0].params_sharded > 0
    _, functional = resolve_model(f"{M}:functional_head_lm")
    head, emb = functional[-1], functional[0]
    assert [g.tp for g in head.gemms] == ["replicated"] and head.tp_allreduces == 0
    assert head.logits_per_token == 96
    assert emb.tp_allreduces == 0 and emb.params_sharded == 0 and emb.params_replicated > 0
    # one rule for the capture's pricing and the factory's layout (capture.analyze.vocab_parallel_lookup): ids
    # viewed before the lookup (GPT-2) leave the table split in both; before, the factory required the lookup to
    # read the input itself and left it replicated while the capture priced it split
    _, viewed = resolve_model(f"{M}:viewed_ids_lm")
    assert viewed[0].tp_allreduces == 1 and viewed[0].params_sharded > 0
    assert factory_structure(f"{M}:viewed_ids_lm").embedding == "embed.tok"
    assert factory_structure(f"{M}:functional_head_lm").embedding is None


def test_logits_the_forward_transforms_are_priced_gathered():
    """A head whose logits the forward soft-caps is vocab-parallel in its GEMM but gathers the logits whole on every
    tp rank (factory_tp_layout: a Replicate output) and runs a plain loss on them: the capture marks it, and the
    counts hold the all-gather (the gathered tensor, forward only) instead of the vocab-parallel loss's three
    all-reduces per micro-batch; the loss's fp32 temporaries cover the whole vocabulary. The same module with
    its logits returned as they are keeps loss_parallel."""
    from autoplan.cost_models.compute import LOSS_PARALLEL_INDEX_BYTES, loss_transient
    from autoplan.cost_models.counts import predict_counts
    from autoplan.cost_models.estimate import context

    spec, profiles = resolve_model(f"{M}:softcap_lm")
    head = profiles[-1]
    assert head.logits_gathered and head.vocab_split(2) == 1 and head.tp_allreduces == 1
    assert factory_structure(f"{M}:softcap_lm").head_is_output is False
    plain = [*profiles[:-1], head.model_copy(update={"logits_gathered": False})]
    assert plain[-1].vocab_split(2) == 2

    plan = _plan(f"{M}:softcap_lm", "tp=2")
    cluster = load_cluster("local-cpu").with_gpus(2)

    def tp_comm(profs):
        got = predict_counts(profs, cluster, plan.training, plan.parallel)[0]["comm"]
        return {(c["collective"]): (c["count"], c["bytes"]) for c in got if c["mesh_dim"] == "tp"}

    gathered, split = tp_comm(profiles), tp_comm(plain)
    m = plan.training.global_batch_size // plan.parallel.mbs
    tokens = plan.parallel.mbs * plan.training.seq_length
    assert gathered["all_gather"] == (m, m * tokens * 96 * 4)
    assert "all_gather" not in split
    assert split["all_reduce"][0] - gathered["all_reduce"][0] == 3 * m  # loss_parallel's max, target, sum of exp
    ctx = context(cluster, plan.training, plan.parallel)
    # the backward's fp32 gradients of the log-softmax and of the logits, whole (plain loss) or split with
    # loss_parallel's third and its index tensors (compute.loss_backward_temporaries)
    v = head.logits_per_token
    assert loss_transient(head, ctx) == pytest.approx(ctx.tokens * v * 2 * 4)
    assert loss_transient(plain[-1], ctx) == pytest.approx(ctx.tokens * (3 * v / 2 * 4 + LOSS_PARALLEL_INDEX_BYTES))


def test_the_longest_sequence_is_the_position_tables_not_the_example_inputs():
    """A module traced with a 16-token example takes sequences up to its learned position table's rows (64 in
    split_lm), and no longer: before, it was refused above 16 tokens (`autoplan tune --seq-len 32` on split_lm
    said seq=32 > max_seq_length=16)."""
    spec, _ = resolve_model(f"{M}:split_lm")
    assert spec.max_seq_length == 64 and spec.position == "learned"
    training = TrainingSpec(global_batch_size=4, seq_length=32, dtype="fp32")
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(2), training, "dp=2", kernels="torch")
    assert plan.training.seq_length == 32
    with pytest.raises(ConfigError, match="learned positions"):
        make_plan(spec, load_cluster("local-cpu").with_gpus(2), training.model_copy(update={"seq_length": 128}),
                  "dp=2", kernels="torch")


def test_a_module_without_a_position_table_needs_its_sequence_length(capsys):
    """A module whose capture shows no learned position table (rotary positions: transformers' Llama) states no
    maximum sequence length: the CLI asks for --seq-len instead of planning for its 2^20 placeholder."""
    pytest.importorskip("transformers")
    from autoplan.cli import main

    args = ["search", "--model", f"{M}:hf_llama", "--cluster", "local-cpu", "--gpus", "2", "--global-batch", "4"]
    assert main(args) == 2
    assert "--seq-len is needed" in capsys.readouterr().err
    assert main([*args, "--seq-len", "32"]) == 0
