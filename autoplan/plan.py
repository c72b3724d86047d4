"""The Plan: what the search chose, as data. Codegen and the runtime read this, never the search's internals.

A plan is JSON with a `schema_version` and a `content_hash` over everything else, so a plan that was edited
by hand or truncated is rejected on load with a message saying what is wrong. `autoplan schema` prints the
JSON Schema.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autoplan.cost_models.errors import AutoplanError, ConfigError, PlanError
from autoplan.cost_models.profile import LayerProfile
from autoplan.cost_models.specs import ClusterSpec, ModelSpec, ParallelConfig, Recompute, TrainingSpec

SCHEMA_VERSION = 1
# Fields added after version 1, hashed only when set (see Plan.compute_hash).
_LATER_FIELDS: dict[str, tuple[str, ...]] = {
    "plan": ("stack", "runtime_semantics", "model_source", "profiles"),
    "model": ("rope_theta",),
    "model.moe": ("pad_to_capacity", "first_layer", "layers"),
    "parallel": ("layout",),
    "training": ("tp_bwd_comm_overlap", "p2p_scatter_gather", "p2p_overlap", "grad_accum_fused",
                 "grad_accum_cast_copy", "optimizer_separate_passes", "grad_sync_all_reduce", "runtime_memory",
                 "sp_grads_coalesced", "selective_policy", "checkpoint_early_stop", "cp_attention",
                 "optimizer_dtype", "master_weights", "loss_fusion", "align_grad_reduce", "flexible_rounds", "short_1f1b", "zero_stages",
                 "schedules", "seq_splits", "recompute_modes", "recompute_per_stage",
                 "uneven_stages", "partial_recompute"),
    "cluster.gpu.calibration": ("dtensor_param_us", "fused_call_us", "pipeline_action_us"),
}
# LayerProfile fields added after plans recorded profiles (false / 0 when unset)
_LATER_PROFILE_FIELDS = ("param_tensors", "saves_after_last_gemm", "moe_capacity")
# Later training fields whose default changed after plans were written with the old one: the value that leaves them
# out of the hash stays the old default, so those plans keep their hash (p2p_scatter_gather: true until session 21).
_HASH_NEUTRAL: dict[str, object] = {"p2p_scatter_gather": True}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MemoryBreakdown(_Frozen):
    """Predicted memory of one pipeline rank, GiB."""

    weights: float = Field(description="Parameters held (after TP/PP/EP and ZeRO-3 sharding).")
    gradients: float = Field(description="Gradient buffers (after ZeRO-2/3 sharding).")
    optimizer: float = Field(description="Master weights (as master_weights holds them) and Adam moments (fp32, bf16 "
                             "under optimizer_dtype=bf16), after ZeRO-1+ sharding.")
    activations: float = Field(description="Activations of the micro-batches in flight, logits included.")
    other: float = Field(description="Framework overhead, communication buffers and workspaces.")
    total: float = Field(description="Sum of the above.")


class StagePlan(_Frozen):
    """One (virtual) pipeline stage: which layers it runs, on which pipeline rank, recomputing what."""

    index: int = Field(ge=0, description="Stage index in model order (0 .. pp*vp-1).")
    pp_rank: int = Field(ge=0, description="Pipeline rank that runs it (index % pp).")
    layers: tuple[int, int] = Field(description="Transformer blocks [start, stop) of this stage.")
    has_embedding: bool = Field(description="Stage holds the input embedding.")
    has_head: bool = Field(description="Stage holds the final norm, LM head and loss.")
    recompute: Recompute = Field(description="Recomputation of this stage's layers.")
    recompute_layers: int = Field(ge=0, description="With full recompute: how many of its layers recompute.")
    forward_s: float = Field(ge=0, description="Predicted forward time of one micro-batch, seconds.")
    backward_s: float = Field(ge=0, description="Predicted backward time (recompute included), seconds.")

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def recompute_split(self, rest: str | None = "selective") -> tuple[int, int]:
        """(blocks checkpointed whole, blocks after them whose attention core is checkpointed), counted from the
        stage's first block: full recomputes its first `recompute_layers` blocks whole and the stage's other blocks
        as `rest` says (TrainingSpec.partial_rest: 'selective' on autoplan's stack, 'none' under Megatron's block
        method; as the stage ILP and the estimate price a partly full stage); selective recomputes every block's
        attention core; none, nothing."""
        from autoplan.cost_models.estimate import (  # (the estimate's rule, one place)
            StageLayout,
            block_recompute,
        )

        kinds = block_recompute(StageLayout(self.layers, self.recompute, self.recompute_layers), rest)
        return kinds.count("full"), kinds.count("selective")


class Prediction(_Frozen):
    """The cost model's prediction for a configuration (DESIGN.md's JSON fields)."""

    step_time_s: float = Field(description="Predicted time of one optimizer step.")
    tflops_per_gpu: float = Field(description="Model TFLOP/s per GPU (Korthikanti eq. 7 FLOPs).")
    mfu: float = Field(description="Model FLOPs utilisation against the dtype's dense peak.")
    hfu: float = Field(description="Hardware FLOPs (recompute included) utilisation.")
    tokens_per_s: float = Field(description="Tokens per second, whole cluster.")
    memory_gib: dict[str, object] = Field(description='{"per_stage": [GiB per pipeline rank], "peak": GiB}.')
    memory_breakdown: list[MemoryBreakdown] = Field(description="Memory per pipeline rank by component.")
    breakdown: dict[str, float] = Field(description="Seconds per component of the step.")
    fits: bool = Field(description="Peak memory is within the GPU's capacity.")


class RunnerUp(_Frozen):
    parallel: dict[str, object] = Field(description="The configuration as a mapping.")
    step_time_s: float
    mfu: float
    peak_memory_gib: float
    note: str = Field(default="", description="Why it lost, in words.")


class Provenance(_Frozen):
    autoplan_version: str
    python_version: str
    inputs_hash: str = Field(description="sha256 of model, cluster, training and search options.")
    search_time_s: float | None = None
    command: str = ""


class Plan(_Frozen):
    """A complete, runnable parallel training plan."""

    schema_version: int = Field(default=SCHEMA_VERSION, description="Bumped on incompatible changes.")
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    parallel: ParallelConfig = Field(description="The chosen configuration, dp resolved.")
    stages: list[StagePlan] = Field(description="pp*vp stages in model order.")
    kernels: Literal["fused", "torch"] = Field(default="fused", description="Fused Triton kernels or torch ops.")
    stack: str | None = Field(
        default=None, description="Software-stack profile the prediction assumes (`autoplan stacks`), with any "
        "--stack-set overrides after a '+'; its knobs are in `training`. None = autoplan's runtime.")
    prediction: Prediction
    runners_up: list[RunnerUp] = Field(default_factory=list)
    provenance: Provenance
    runtime_semantics: dict[str, str] = Field(
        default_factory=dict,
        description="Where autoplan's runtime executes a knob differently from its textbook form, what runs and "
                    "how it is priced (cost_models.counts.runtime_semantics): e.g. ZeRO-2/3 under pipeline "
                    "parallelism, context-parallel attention.")
    model_source: dict[str, Any] | None = Field(
        default=None, description="What the runtime builds with autoplan.models.load: {'hf_config': {...}} (the "
        "Hugging Face config) or {'factory': 'pkg.module:fn'}; null = the zoo model of `model` (presets, spec files).")
    profiles: list[LayerProfile] | None = Field(
        default=None, description="The layer profiles (embedding, blocks, head) the prediction was made from when "
        "they are not the analytic ones of `model`: the capture of a user's module (model_source factory). Data, "
        "so that show, explain, compare and the runtime's counts re-price the plan as it was priced without "
        "importing the module; null = `model`'s analytic profile.")
    content_hash: str = Field(default="", description="sha256 of the plan without this field.")

    # ---- hashing and files
    def compute_hash(self) -> str:
        # Fields added after schema version 1 are left out of the hash while they hold their defaults, so a plan
        # that does not use them hashes as before they existed and older plan files still load.
        exclude: dict = {"content_hash": True}
        for part, names in _LATER_FIELDS.items():
            obj = self
            for attr in () if part == "plan" else part.split("."):
                obj = getattr(obj, attr) if obj is not None else None
            if obj is None:  # an optional part the plan has none of (a dense model's moe)
                continue
            unset = {n for n in names
                     if getattr(obj, n) == _HASH_NEUTRAL.get(n, type(obj).model_fields[n].get_default(
                         call_default_factory=True))}
            if part == "plan":
                exclude.update(dict.fromkeys(unset, True))
            elif unset:  # nested: {"cluster": {"gpu": {"calibration": {...}}}}, "model" beside "model.moe"
                where = exclude
                *outer, last = part.split(".")
                for attr in outer:
                    if isinstance(where.get(attr), set):
                        where[attr] = dict.fromkeys(where[attr], True)
                    where = where.setdefault(attr, {})
                if isinstance(where.get(last), dict):
                    where[last].update(dict.fromkeys(unset, True))
                else:
                    where[last] = unset
        # the same for fields added to LayerProfile after `profiles` (plans of session 15 recorded profiles
        # without a tensor count; saves_after_last_gemm came in session 23): left out of the hash while unset
        unrecorded = {i: {n for n in _LATER_PROFILE_FIELDS
                          if not getattr(p, n) or getattr(p, n) == type(p).model_fields[n].get_default()}
                      for i, p in enumerate(self.profiles or ())}
        unrecorded = {i: names for i, names in unrecorded.items() if names}
        if unrecorded:
            exclude["profiles"] = unrecorded
        body = self.model_dump(mode="json", exclude=exclude)
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def sealed(self) -> Plan:
        return self.model_copy(update={"content_hash": self.compute_hash()})

    def to_json(self) -> str:
        plan = self if self.content_hash else self.sealed()
        return json.dumps(plan.model_dump(mode="json"), indent=1, sort_keys=False) + "\n"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # atomic: a crash never leaves half a plan behind
        return path

    @property
    def short_hash(self) -> str:
        return (self.content_hash or self.compute_hash())[:12]

    @property
    def world_size(self) -> int:
        return self.cluster.num_gpus


def load_plan(path: str | Path) -> Plan:
    """Read and verify a plan file; raises PlanError naming what is wrong. Every command that reads a plan
    (show, compare, explain, trace, export, codegen, run, the runtime) reads it here.

    A plan file is untrusted data (SECURITY.md): it is checked strictly before anything is rendered from it or
    launched — JSON types exactly as the schema says (no "2" for 2, no 1 for true), no unknown fields, every
    range, the content hash, and then `check_plan`: the layout must be one the runtime can run as written.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except OSError as e:
        raise PlanError(f"cannot read plan {path}", e.strerror or str(e), "check the path") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"plan {path} is not valid JSON", str(e), "re-create it with `autoplan search -o`") from None
    if not isinstance(data, dict):
        raise PlanError(f"plan {path} is not a JSON object", "", "re-create it with `autoplan search -o`")
    version = data.get("schema_version")
    if version is None:  # another tool's JSON (a Megatron config, an HF config.json), or an empty object
        raise PlanError(f"{path} is not an autoplan plan", "it has no schema_version (keys: "
                        f"{', '.join(sorted(data)[:6]) or 'none'})", "pass a plan written by `autoplan search -o` "
                        "or `autoplan estimate -o`")
    if version != SCHEMA_VERSION:
        raise PlanError(f"plan {path} has schema_version {version!r}", f"this autoplan reads {SCHEMA_VERSION}",
                        "re-run `autoplan search` with this version")
    try:
        plan = Plan.model_validate_json(text, strict=True)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "(file)"
        raise PlanError(f"plan {path} does not match the schema", f"{loc}: {first['msg']}"[:300],
                        "re-create it with `autoplan search -o`") from None
    except AutoplanError as e:  # a spec's own rule (e.g. heads vs kv_heads), raised inside validation
        raise PlanError(f"plan {path} does not match the schema", e.one_line()[:300],
                        "re-create it with `autoplan search -o`") from None
    training = data.get("training")
    missing = {k: v for k, v in _HASH_NEUTRAL.items() if isinstance(training, dict) and k not in training}
    if missing:  # written before the field existed: it was priced with the old default, its hash-neutral value
        plan = plan.model_copy(update={"training": plan.training.model_copy(update=missing)})
    if plan.content_hash != plan.compute_hash():
        raise PlanError(f"plan {path} was modified after it was made",
                        f"content hash {_shown(plan.content_hash[:12]) or '(missing)'} != {plan.compute_hash()[:12]}",
                        "re-create it with `autoplan search -o` (or `autoplan estimate -o`) instead of editing it")
    check_plan(plan, str(path))
    return plan


_REMAKE = "re-create it with `autoplan search -o` or `autoplan estimate -o` instead of editing it"


def _shown(text: str) -> str:
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}"
                   for ch in text)


def check_plan(plan: Plan, where: str = "plan") -> None:
    """The rules a well-formed plan obeys beyond its schema; raises PlanError naming the first one broken.

    A plan edited and re-hashed can pass the schema and the hash and still describe something the runtime must
    not run: a layout whose degrees do not multiply to the world size, a micro-batch that leaves sequences of
    the global batch untrained, stages that skip or repeat layers, names that would print control characters.
    """
    from autoplan.cost_models.specs import check_config, check_stages_run

    def bad(rule: str, detail: str) -> PlanError:
        return PlanError(f"{where} is inconsistent: {rule}", detail, _REMAKE)

    for field, name in (("model.name", plan.model.name), ("cluster.name", plan.cluster.name),
                        ("cluster.gpu.name", plan.cluster.gpu.name)):
        if not name or not name.isprintable() or len(name) > 200:
            raise bad(f"{field} must be 1-200 printable characters (no line breaks or control characters)",
                      f"got {_shown(name[:60])!r}" + (f" ({len(name)} characters)" if len(name) > 60 else ""))
    c = plan.parallel
    if c.dp is None:
        raise bad("parallel.dp must be resolved", "dp is null")
    try:
        check_config(c, plan.model, plan.cluster, plan.training, stage_layers=False)
    except AutoplanError as e:  # ConfigError, or the layout parser's own error
        raise bad(e.rule, e.detail) from None
    n = c.pp * c.vp
    if len(plan.stages) != n:
        raise bad("a plan has pp*vp stages", f"pp={c.pp}, vp={c.vp} but {len(plan.stages)} stages")
    start = 0
    for i, st in enumerate(plan.stages):
        lo, hi = st.layers
        if st.index != i or st.pp_rank != i % c.pp:
            raise bad("stage i runs on pipeline rank i % pp, in order",
                      f"stage {i} has index {st.index}, pp_rank {st.pp_rank} (pp={c.pp})")
        if lo != start or hi < lo:  # a stage may hold no blocks (only the embedding or the head)
            raise bad("stages cover the layers in order",
                      f"stage {i} has layers [{lo}, {hi}) but the next layer is {start}")
        start = hi
        if st.has_embedding != (i == 0) or st.has_head != (i == n - 1):
            raise bad("the embedding is on the first stage and the head on the last",
                      f"stage {i} of {n}: has_embedding={st.has_embedding}, has_head={st.has_head}")
        if st.recompute_layers > hi - lo:
            raise bad("a stage recomputes at most its own layers",
                      f"stage {i} has {hi - lo} layers, recompute_layers={st.recompute_layers}")
        if not (math.isfinite(st.forward_s) and math.isfinite(st.backward_s)):
            raise bad("predicted stage times are finite", f"stage {i}: {st.forward_s}, {st.backward_s}")
    if start != plan.model.num_layers:
        raise bad("stages cover every layer", f"they end at layer {start} of {plan.model.num_layers}")
    try:  # what the plan's software stack runs (TrainingSpec.recompute_modes, .recompute_per_stage, .uneven_stages)
        check_stages_run([(st.layers[1] - st.layers[0], st.recompute, st.recompute_layers) for st in plan.stages],
                         plan.training)
    except ConfigError as e:
        raise bad(e.rule, e.detail) from None
    if c.layout is not None:  # the layout string and the stages are two copies of one fact: they must agree
        from autoplan.cost_models.layout import counts

        for i, (want, st) in enumerate(zip(counts(c.layout), plan.stages)):
            if st.layers[1] - st.layers[0] != want:
                raise bad("the stages follow parallel.layout",
                          f"stage {i} (pipeline rank {i % c.pp}) has {st.layers[1] - st.layers[0]} block(s), "
                          f"layout {c.layout} gives it {want}")
    if not (math.isfinite(plan.prediction.step_time_s) and plan.prediction.step_time_s > 0):
        raise bad("the predicted step time is a positive number", f"got {plan.prediction.step_time_s}")
    if plan.profiles is not None:  # one per layer of the model, in order
        kinds = [p.kind for p in plan.profiles]
        want = ["embedding", *["block"] * plan.model.num_layers, "head"]
        if kinds != want:
            raise bad("profiles are the embedding's, one per block, then the head's",
                      f"{len(kinds)} profiles ({', '.join(dict.fromkeys(kinds))}) for {plan.model.num_layers} blocks")
