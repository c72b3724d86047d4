"""Emit each pipeline stage of a Plan as readable Python source: the artefact a user inspects, and the code
the runtime executes (runtime.parallelize.parallelize compiles `stage_source` and calls its `build`).

    write_program(plan, out_dir) -> [out_dir/stage_0.py, ..., out_dir/plan.json, out_dir/README.md]

Each stage file opens with a header naming the plan hash, the layers, the ranks that run it, the tensor-parallel
style of every module, the recomputed regions and the kernels, then defines `build(dims, seed=, device=)`.

A plan is untrusted data (SECURITY.md): every value from it reaches the source only through `codegen.quote`
(`literal` in code, `docstring` for docstrings, `comment`/`one_line` for comments and header lines); the rest of
the source is this module's own constant text and the parallel styles of `codegen.program` (fixed code, chosen
from the plan's integers and literals, never built from its strings).
"""

from __future__ import annotations

from pathlib import Path

from autoplan.plan import Plan

from .program import StageProgram, stage_programs
from .quote import comment, docstring, literal, one_line

_IMPORTS = '''from __future__ import annotations

import json  # noqa: F401

import torch
from torch.distributed.tensor import Replicate, Shard  # noqa: F401
from torch.distributed.tensor.parallel import (  # noqa: F401
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autoplan.plan import StagePlan
from autoplan.models import build as build_model, init_weights
from autoplan.codegen.fuse import substitute_kernels  # noqa: F401
from autoplan.cost_models.specs import ModelSpec
from autoplan.models.factory import apply_factory_recompute, cut_factory_stage, divide_head_counts  # noqa: F401
from autoplan.runtime.parallelize import (  # noqa: F401
    PositionsSequenceParallel,
    apply_cp,
    apply_dp,
    apply_ep,
    apply_mixed_precision,
    apply_recompute,
)
'''


def _describe_model(plan: Plan) -> str:
    m = plan.model
    moe = f", MoE {m.moe.num_experts} experts top-{m.moe.top_k}" if m.moe else ""
    return (f"{one_line(m.name)} ({m.num_layers} layers, h={m.hidden_size}, {m.num_attention_heads} heads / {m.kv_heads} KV "
            f"heads, vocab {m.vocab_size}, {m.position}, {m.norm}, {m.activation}{moe})")


def _header(p: StageProgram) -> str:
    plan, st, c = p.plan, p.stage, p.plan.parallel
    n = len(plan.stages)
    dp = c.dp or 1
    n_micro = plan.training.global_batch_size // (dp * c.mbs)
    parts = [f"layers {st.layers[0]}..{st.layers[1] - 1}" if st.layers[1] > st.layers[0] else "no blocks"]
    if st.has_embedding:
        parts.insert(0, "embedding")
    if st.has_head:
        parts.append("final norm + LM head + loss")
    lines = [
        f"autoplan program: stage {st.index} of {n}, generated from plan {one_line(plan.short_hash)} -- do not edit;",
        "re-run `autoplan codegen` (the runtime executes this same code).",
        "",
        f"plan          {one_line(plan.content_hash or plan.compute_hash())}",
        f"model         {_describe_model(plan)}",
        f"cluster       {one_line(plan.cluster.name)}, {plan.world_size} ranks ({plan.cluster.backend})",
        f"parallel      {one_line(c.to_string())}",
        f"stage         {st.index} on pipeline rank {st.pp_rank} (ranks {', '.join(map(str, p.ranks))}): "
        + " + ".join(parts),
        f"schedule      {c.schedule if c.pp > 1 else 'none (pp=1)'}; {n_micro} micro-batches of {c.mbs} "
        f"sequence(s) per rank per step (global batch {plan.training.global_batch_size}, seq "
        f"{plan.training.seq_length})",
    ]
    if p.tp:
        lines.append(f"tensor par.   tp={c.tp}, sequence parallel {'on' if c.sp else 'off'}")
        for group, styles in p.tp.items():
            for path, s in styles.items():
                full = f"{group}.{path}" if group else path
                why = f"   # {s.why}" if s.why else ""
                lines.append(f"    {full:<28} {s.code()}{why}")
    else:
        lines.append("tensor par.   none (tp=1)")
    lines.append(f"context par.  cp={c.cp}" + (": load-balanced chunks r and 2cp-1-r, K/V all-gathered in the "
                                                  "attention core" if c.cp > 1 else ""))
    if plan.model.moe:
        lines.append(f"experts       ep={c.ep}" + (f": {plan.model.moe.num_experts // c.ep} experts per rank, "
                                                    "tokens exchanged by all-to-all" if c.ep > 1 else
                                                    ": all experts on every rank"))
    lines.append(f"recompute     {st.recompute}" + (": " + ", ".join(p.recompute) if p.recompute else ""))
    if p.kernels:
        lines.append("kernels       fused (kernels.modules):")
        for path, cls in p.kernels.items():
            lines.append(f"    {path:<28} -> {cls}")
    else:
        lines.append(f"kernels       {plan.kernels}: torch ops" + ("" if plan.kernels == "torch" else
                                                                    " (nothing fusable on this stage)"))
    dpcp = dp * c.cp
    if dpcp > 1:
        how = "replicate (all-reduce)" if c.zero == 0 else f"FSDP2 fully_shard, ZeRO-{c.zero}"
        lines.append(f"data par.     {how} over dp x cp = {dpcp} ranks")
    else:
        lines.append("data par.     none")
    lines.append(f"precision     {plan.training.dtype}" + (" autocast, fp32 master weights"
                                                            if plan.training.dtype in ("bf16", "fp16") else ""))
    lines.append(f"predicted     forward {st.forward_s * 1e3:.3f} ms, backward {st.backward_s * 1e3:.3f} ms per "
                 f"micro-batch; step {plan.prediction.step_time_s * 1e3:.3f} ms")
    return docstring("\n".join(lines) + "\n") + "\n"


def _dict_literal(styles: dict, indent: str) -> str:
    rows = [f"{indent}    {literal(path)}: {s.code()}," for path, s in styles.items()]
    return "{\n" + "\n".join(rows) + f"\n{indent}}}"


def stage_source(p: StageProgram) -> str:
    """The Python source of one stage (see the module docstring)."""
    from autoplan.models import layout_spec

    plan, st, c = p.plan, p.stage, p.plan.parallel
    tied = layout_spec(plan).tie_embeddings
    out = [_header(p), _IMPORTS, ""]
    out.append(f"PLAN_HASH = {literal(plan.short_hash)}")
    out.append(f"SPEC = ModelSpec.model_validate({literal(plan.model.model_dump(mode='python'))})")
    if plan.model_source and "hf_config" in plan.model_source:
        out.append(f"SOURCE = {literal(plan.model_source['hf_config'])}  # Hugging Face config")
    elif plan.model_source and "factory" in plan.model_source:
        out.append(f"SOURCE = {literal(plan.model_source['factory'])}  # the user's module factory")
    else:
        out.append("SOURCE = SPEC  # the zoo model of this spec")
    out.append(f"STAGE = StagePlan.model_validate({literal(st.model_dump(mode='python'))})")
    if plan.model_source and "factory" in plan.model_source and c.tp > 1:
        from autoplan.models.factory import factory_structure, head_count_attributes

        fs = factory_structure(plan.model_source["factory"])
        out.append(f"HEAD_COUNTS = {literal(head_count_attributes(fs, st.layers, c.tp))}  # (module, attribute) divided by tp")
        tie = (fs.head, fs.embedding) if fs.tied and st.has_embedding and st.has_head else None
        out.append(f"TIED = {literal(tie)}  # (head, embedding) sharing one weight")
    out.append("")
    out.append("")
    b = ["def build(dims, *, seed: int = 0, device: torch.device = torch.device(\"cpu\")) -> torch.nn.Module:",
         "    " + docstring(f"Stage {st.index} as rank(s) {', '.join(map(str, p.ranks))} run it. dims: "
                       "runtime.ParallelDims, mesh built.")]
    if plan.model_source and "factory" in plan.model_source:
        out.append("\n".join(b + _factory_body(plan, st, p.tp.get("module", {}))))
        return "\n".join(out) + "\n"
    lo, hi = st.layers
    kept = f"layers {lo}..{hi - 1}" if hi > lo else "no blocks"
    b.append("    " + comment(f"1. pipeline cut: keep {kept} of {plan.model.num_layers} (global keys kept)"))
    b.append('    model = build_model(SOURCE, device="meta")  # autoplan.models.build: the planned architecture')
    if p.deleted_layers:
        b.append(f"    for key in {literal([str(i) for i in p.deleted_layers])}:")
        b.append("        del model.layers[key]")
    if not st.has_embedding:
        b.append("    model.tok_embeddings = None")
        b.append("    model.pos_embeddings = None")
    if not st.has_head:
        b.append("    model.norm = None")
        b.append("    model.output = None")
    b.append("    model = model.to_empty(device=device)")
    if tied and st.has_embedding and st.has_head:
        b.append("    model.output.weight = model.tok_embeddings.weight  # tied")
    b.append("    init_weights(model, seed)  # values depend only on (seed, parameter name): same as one process")
    if p.kernels:
        b.append("    # 2. fused kernels")
        b.append(f"    substitute_kernels(model, {_dict_literal({k: _Lit(literal(v)) for k, v in p.kernels.items()}, '    ')})")
    else:
        b.append("    " + comment(f"2. fused kernels: none ({plan.kernels})"))
    if p.tp:
        b.append("    " + comment(f"3. tensor parallelism: tp={c.tp}, sequence parallel {'on' if c.sp else 'off'}"))
        b.append('    tp = dims["tp"]')
        for group, styles in p.tp.items():
            target = "model" if not group else f"model.layers[{literal(group.split('.')[1])}]"
            plain = {k: s for k, s in styles.items() if s.name != "PositionsSequenceParallel"}
            b.append(f"    parallelize_module({target}, tp, {_dict_literal(plain, '    ')})")
            if len(plain) != len(styles):
                b.append("    PositionsSequenceParallel.apply(model.pos_embeddings, tp)")
        if tied and st.has_embedding and st.has_head:
            b.append("    model.output.weight = model.tok_embeddings.weight  # re-tie: both Shard(0) over the vocab")
    else:
        b.append("    # 3. tensor parallelism: none")
    if c.ep > 1 and plan.model.moe:
        b.append("    " + comment(f"4. expert parallelism: ep={c.ep}"))
        b.append('    apply_ep(model, dims["ep"])')
    if c.cp > 1:
        b.append("    " + comment(f"5. context parallelism: cp={c.cp}"))
        b.append(f'    apply_cp(model, dims["cp"], {literal(plan.training.seq_length)}, device)')
    if p.recompute:
        b.append("    " + comment(f"6. recompute ({st.recompute}): {', '.join(p.recompute)}"))
        b.append("    apply_recompute(model, STAGE" + _rest_arg(plan) + ")")
    b.append("    " + comment(f"7. precision: {plan.training.dtype}"))
    b.append(f"    apply_mixed_precision(model, {literal(plan.training.dtype)}, device.type)")
    if (c.dp or 1) * c.cp > 1:
        b.append("    " + comment(f"8. data parallelism over dp x cp, ZeRO-{c.zero}"))
        pipelined = ", pipelined=True" if c.pp > 1 else ""  # the schedule, not the forward, syncs a DDP stage
        b.append(f'    apply_dp(model, dims["dp_cp"], {literal(c.zero)}{pipelined})')
    b.append("    return model")
    out.append("\n".join(b))
    return "\n".join(out) + "\n"


def _rest_arg(plan: Plan) -> str:
    """A partly full stage's other blocks run plainly under partial_recompute=rest-none (Megatron's block method);
    the runtime's default recomputes them selectively."""
    rest = plan.training.partial_rest
    return "" if rest in (None, "selective") else f", rest={literal(rest)}"


def _factory_body(plan: Plan, st, tp_styles: dict) -> list[str]:
    """A user module (autoplan.models.factory): its structure (blocks, column/row linears, head counts) comes from
    the capture of the same module at run time; layouts it cannot take were refused at start-up."""
    c = plan.parallel
    b = ["    # 1. the module the factory returns, materialised and initialised under the seed (same on every rank)",
         "    model = build_model(SOURCE, device=device, seed=seed)"]
    if c.pp > 1:
        lo, hi = st.layers
        b.append("    " + comment(f"1b. pipeline cut at the captured block boundaries: blocks {lo}..{hi - 1} of "
                                  f"{plan.model.num_layers}; the other stages' modules pass their input through"))
        b.append("    cut_factory_stage(model, STAGE)")
    if c.tp > 1:
        b.append("    " + comment(f"3. tensor parallelism: tp={c.tp} on the column/row linear pairs the capture of the "
                                  "module found (codegen.program.factory_tp_layout)"))
        b.append('    tp = dims["tp"]')
        b.append(f"    parallelize_module(model.module, tp, {_dict_literal(tp_styles, '    ')})")
        b.append("    divide_head_counts(model.module, tp.size(), HEAD_COUNTS)  # each rank holds 1/tp of the heads")
        b.append("    if TIED:  # both Shard(0) over the vocabulary: one tensor again")
        b.append("        model.module.get_submodule(TIED[0]).weight = model.module.get_submodule(TIED[1]).weight")
    if st.recompute != "none":
        b.append("    " + comment(f"6. recompute ({st.recompute})"))
        b.append("    apply_factory_recompute(model, STAGE" + _rest_arg(plan) + ")")
    b += ["    " + comment(f"7. precision: {plan.training.dtype}"),
          f"    apply_mixed_precision(model, {literal(plan.training.dtype)}, device.type)"]
    if (c.dp or 1) * c.cp > 1:
        b.append(f"    # 8. data parallelism over dp x cp, ZeRO-{c.zero}: one unit per repeated block, plus the root")
        pipelined = ", pipelined=True" if c.pp > 1 else ""  # the schedule, not the forward, syncs a DDP stage
        b.append(f'    apply_dp(model, dims["dp_cp"], {literal(c.zero)}{pipelined})')
    b.append("    return model")
    return b


class _Lit:
    """A value rendered verbatim by _dict_literal."""

    def __init__(self, text: str) -> None:
        self.text = text

    def code(self) -> str:
        return self.text


def emit_source(plan: Plan) -> dict[str, str]:
    """File name -> source for every stage."""
    return {f"stage_{p.stage.index}.py": stage_source(p) for p in stage_programs(plan)}


def write_program(plan: Plan, out_dir: str | Path) -> list[Path]:
    """Write every stage's program, the plan and an index; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, src in emit_source(plan).items():
        path = out / name
        path.write_text(src)
        written.append(path)
    plan_path = out / "plan.json"
    plan_path.write_text(plan.to_json())
    written.append(plan_path)
    rows = [f"| {p.stage.index} | {p.stage.pp_rank} | {', '.join(map(str, p.ranks))} | "
            f"{p.stage.layers[0]}..{p.stage.layers[1] - 1} | stage_{p.stage.index}.py |" for p in stage_programs(plan)]
    readme = out / "README.md"
    readme.write_text(
        f"# autoplan program for plan {one_line(plan.short_hash)}\n\n{_describe_model(plan)}, `{plan.parallel.to_string()}` "
        f"on {plan.world_size} ranks.\n\n| stage | pp rank | ranks | layers | file |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + f"\n\nRun: `torchrun --nproc-per-node {plan.world_size} -m autoplan.runtime.train --plan plan.json --steps 10`\n"
    )
    written.append(readme)
    return written
