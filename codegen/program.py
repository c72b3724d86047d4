"""What each (virtual) pipeline stage of a Plan runs, as data: the single source for the emitted source code
(`autoplan.codegen.emit`) and for the runtime (which executes that emitted code).

No torch here: placements and parallel styles are described by name and rendered to code by `Style.code()`. (A
module:factory plan with tp > 1 is the exception: its layout comes from capturing the user's module, which
imports torch, lazily.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoplan.cost_models.specs import ModelSpec
from autoplan.plan import Plan, StagePlan


@dataclass(frozen=True)
class Style:
    """A DTensor parallel style applied to one module, e.g. ColwiseParallel(input_layouts=Shard(1))."""

    name: str
    kwargs: tuple[tuple[str, str], ...] = ()
    why: str = ""

    def code(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.kwargs)})"


def tp_layout(spec: ModelSpec, stage: StagePlan, sp: bool) -> dict[str, dict[str, Style]]:
    """Module path -> Style, grouped by the module `parallelize_module` is called on ("" = the stage root,
    "layers.N" = a block). Heads and KV heads are split by the column-parallel wq/wk/wv; the row-parallel
    wo/w2 reduce (all-reduce, or reduce-scatter over the sequence with sp)."""
    seq = "Shard(1)" if sp else "Replicate()"
    root: dict[str, Style] = {}
    if stage.has_embedding:
        root["tok_embeddings"] = Style("RowwiseParallel", (("input_layouts", "Replicate()"), ("output_layouts", seq)),
                                       "vocab-parallel embedding")
        if sp and spec.position == "learned":
            root["pos_embeddings"] = Style("PositionsSequenceParallel", (), "positions of this rank's sequence shard")
    # post-norm blocks (OPT do_layer_norm_before=False) add the residual to the norm's output: keep it local
    post = getattr(spec, "residual", "pre") == "post"
    block_norm = Style("SequenceParallel", (("use_local_output", "True"),)) if post else Style("SequenceParallel")
    if stage.has_head:
        if sp and getattr(spec, "final_norm", True):
            root["norm"] = Style("SequenceParallel", (), "norm on the sequence shard")
        root["output"] = Style("ColwiseParallel", (("input_layouts", seq), ("output_layouts", "Shard(-1)"),
                                                   ("use_local_output", "False")),
                               "vocab-parallel LM head; logits stay sharded for loss_parallel")
    out: dict[str, dict[str, Style]] = {"": root} if root else {}
    for i in range(*stage.layers):
        lp: dict[str, Style] = {}
        if sp:
            lp["attention_norm"] = block_norm
        lp["attention"] = Style("PrepareModuleInput", (("input_layouts", f"({seq}, None)"),
                                                       ("desired_input_layouts", "(Replicate(), None)")),
                                "gather the sequence once for q, k, v" if sp else "one all-reduce for q, k, v grads")
        for w in ("wq", "wk", "wv"):
            lp[f"attention.{w}"] = Style("ColwiseParallel", (), "heads split" if w == "wq" else "KV heads split")
        lp["attention.wo"] = Style("RowwiseParallel", (("output_layouts", seq),))
        if sp:
            lp["mlp_norm"] = block_norm
            if getattr(spec, "sandwich_norms", False):  # Gemma 2: norms on the branch outputs (sequence shards)
                lp["post_attention_norm"] = Style("SequenceParallel", (("use_local_output", "True"),))
                lp["post_mlp_norm"] = Style("SequenceParallel", (("use_local_output", "True"),))
        if spec.is_moe_layer(i):
            lp["mlp"] = Style("PrepareModuleInputOutput", (
                ("input_layouts", f"({seq},)"), ("desired_input_layouts", "(Replicate(),)"),
                ("use_local_input", "True"), ("output_layouts", "(Replicate(),)"),
                ("desired_output_layouts", f"({seq},)"), ("use_local_output", "True")),
                "MoE: experts replicated over tp (no expert TP)")
        else:
            lp["mlp"] = Style("PrepareModuleInput", (("input_layouts", f"({seq},)"),
                                                     ("desired_input_layouts", "(Replicate(),)")))
            lp["mlp.w1"] = Style("ColwiseParallel")
            if spec.activation == "swiglu":
                lp["mlp.w3"] = Style("ColwiseParallel")
            lp["mlp.w2"] = Style("RowwiseParallel", (("output_layouts", seq),))
        out[f"layers.{i}"] = lp
    return out


def factory_tp_layout(st, stage: StagePlan) -> dict[str, Style]:
    """A user module's tensor-parallel layout, from its capture (`autoplan.models.factory.FactoryStructure`):
    module path (relative to the user's module) -> Style. Column-parallel linears read the replicated residual
    stream, row-parallel ones their output; the token embedding is split over vocabulary rows and the head over
    vocabulary columns (logits left sharded for loss_parallel when the forward returns them as they are)."""
    out: dict[str, Style] = {}
    if stage.has_embedding and st.embedding:
        out[st.embedding] = Style("RowwiseParallel", (("input_layouts", "Replicate()"),
                                                      ("output_layouts", "Replicate()")), "vocab-parallel embedding")
    lo, hi = stage.layers
    for b in st.blocks[lo:hi]:
        for m in st.fanout:
            out[f"{b}.{m}"] = Style("PrepareModuleOutput", (("output_layouts", "Replicate()"),
                                                            ("desired_output_layouts", "Replicate()"),
                                                            ("use_local_output", "False")),
                                    "read by several column linears: one all-reduce of its gradient")
        for p, role in st.linears:
            out[f"{b}.{p}"] = (Style("ColwiseParallel", (), "column-parallel (reads the residual stream)") if role == "col"
                               else Style("RowwiseParallel", (), "row-parallel (reads a column-parallel output)"))
    if stage.has_head and st.head:
        if st.head_is_output:
            out[st.head] = Style("ColwiseParallel", (("output_layouts", "Shard(-1)"), ("use_local_output", "False")),
                                 "vocab-parallel LM head; logits stay sharded for loss_parallel")
        else:
            out[st.head] = Style("ColwiseParallel", (("output_layouts", "Replicate()"),),
                                 "vocab-parallel LM head; logits gathered (the forward transforms them)")
    return out


def recompute_regions(stage: StagePlan, rest: str | None = "selective") -> list[str]:
    """Module paths checkpointed (recomputed in the backward pass); `rest`: what a partly full stage's other blocks
    do (TrainingSpec.partial_rest)."""
    start = stage.layers[0]
    n_full, n_sel = stage.recompute_split(rest)
    return ([f"layers.{i}" for i in range(start, start + n_full)]
            + [f"layers.{i}.attention.core" for i in range(start + n_full, start + n_full + n_sel)])


def _factory_regions(stage: StagePlan, rest: str | None = "selective") -> list[str]:
    """What a user module's stage recomputes, by block index (the module paths come from its capture)."""
    lo = stage.layers[0]
    n_full, n_sel = stage.recompute_split(rest)
    out = [f"blocks {lo}..{lo + n_full - 1} (whole)"] if n_full else []
    if n_sel:
        out.append(f"the attention kernel of blocks {lo + n_full}..{lo + n_full + n_sel - 1}")
    return out


def kernel_substitutions(spec: ModelSpec, stage: StagePlan, mode: str, sp: bool) -> dict[str, str]:
    """Module path -> fused module class (kernels.modules) for `mode == "fused"`.

    Norms under sequence parallelism run on DTensors, which the fused kernels do not take: they stay torch.
    """
    if mode != "fused":
        return {}
    norm = "FusedRMSNorm" if spec.norm == "rmsnorm" else "FusedLayerNorm"
    act = "FusedSwiGLU" if spec.activation == "swiglu" else ("FusedGELU" if spec.activation == "gelu" else None)
    subs: dict[str, str] = {}
    for i in range(*stage.layers):
        if not sp:
            subs[f"layers.{i}.attention_norm"] = norm
            subs[f"layers.{i}.mlp_norm"] = norm
        if act:
            if spec.is_moe_layer(i):
                for e in range(spec.moe.num_experts):
                    subs[f"layers.{i}.mlp.experts.{e}.act"] = act
            else:
                subs[f"layers.{i}.mlp.act"] = act
    if stage.has_head and not sp:
        subs["norm"] = norm
    return subs


def stage_ranks(plan: Plan, stage: StagePlan) -> list[int]:
    """Global ranks that run `stage` (mesh order pp, dp, cp, tp; tp innermost)."""
    c = plan.parallel
    dp = c.dp or 1
    return [((stage.pp_rank * dp + d) * c.cp + k) * c.tp + t
            for d in range(dp) for k in range(c.cp) for t in range(c.tp)]


@dataclass
class StageProgram:
    plan: Plan
    stage: StagePlan
    tp: dict[str, dict[str, Style]] = field(default_factory=dict)
    recompute: list[str] = field(default_factory=list)
    kernels: dict[str, str] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)

    @property
    def deleted_layers(self) -> list[int]:
        lo, hi = self.stage.layers
        return [i for i in range(self.plan.model.num_layers) if not lo <= i < hi]


def stage_programs(plan: Plan) -> list[StageProgram]:
    from autoplan.models import layout_spec
    from autoplan.models.source import record_runs_torch_ops

    c = plan.parallel
    spec = layout_spec(plan)
    factory = "factory" in (plan.model_source or {})
    # a Hugging Face family or a user's module keeps its own modules: no kernel substitution (the fused kernels
    # implement the zoo's norms and activations); the planner prices torch's kernels for it by the same rule
    own_modules = record_runs_torch_ops(plan.model_source) is not None
    structure = None
    if factory and c.tp > 1:  # the capture of the user's module (imports torch; cached per process)
        from autoplan.models.factory import factory_structure

        structure = factory_structure(plan.model_source["factory"])
    out = []
    for st in plan.stages:
        if structure is not None:
            tp = {"module": factory_tp_layout(structure, st)}
        else:
            tp = tp_layout(spec, st, c.sp) if c.tp > 1 else {}
        out.append(StageProgram(
            plan=plan, stage=st,
            tp=tp,
            recompute=(_factory_regions if factory else recompute_regions)(st, plan.training.partial_rest),
            kernels={} if own_modules else kernel_substitutions(spec, st, plan.kernels, c.sp and c.tp > 1),
            ranks=stage_ranks(plan, st),
        ))
    return out
