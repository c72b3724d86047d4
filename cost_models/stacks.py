"""Software-stack profiles: which kernels, overlaps and dtypes a training run assumes, by name.

The cost model's knobs for the software a run uses live in `TrainingSpec` (flash attention, the kernel set,
overlapped gradient reduction / parameter gather / TP communication, the gradient-reduce dtype). A stack is
nothing but a named set of those values, so that a user can say "Megatron-LM as of SC21" instead of five
flags, and a plan records which stack its prediction assumed. `TrainingSpec` stays the single source:
`apply_stack` returns a TrainingSpec; `--stack-set key=value,...` overrides single knobs on top.

What each stack assumes, and where it comes from, is in its `assumes` and `source` fields
(`autoplan stacks` prints them). Parallel knobs (tp, pp, recompute, ZeRO stage, ...) are not part of a stack:
they are the configuration, searched or given with `--parallel`; `typical` says what the stack's users ran.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .errors import ConfigError, SpecError
from .specs import ALL_RECOMPUTE_MODES, ALL_SCHEDULES, ALL_SEQ_SPLITS, ALL_ZERO_STAGES, TrainingSpec

DEFAULT_STACK = "autoplan"

# The TrainingSpec fields a stack may set (the runtime's software, not the workload: batch and sequence length
# are never part of a stack).
STACK_KNOBS = ("dtype", "grad_reduce_dtype", "flash_attention", "overlap_grad_reduce", "overlap_param_gather",
               "tp_comm_overlap", "tp_bwd_comm_overlap", "p2p_scatter_gather", "p2p_overlap", "grad_accum_fused",
               "grad_accum_cast_copy", "optimizer_separate_passes", "optimizer_dtype", "master_weights", "loss_fusion",
               "align_grad_reduce", "flexible_rounds", "short_1f1b", "zero_stages", "schedules", "seq_splits",
               "recompute_modes",
               "recompute_per_stage", "partial_recompute", "uneven_stages", "grad_sync_all_reduce",
               "sp_grads_coalesced", "runtime_memory", "autocast_fp32_params", "selective_policy", "kernels",
               "checkpoint_early_stop", "cp_attention")
# The short names `autoplan stacks` prints for some knobs; --stack-set takes them as well as the field names.
KNOB_ALIASES = {"flash": "flash_attention", "overlap_grad": "overlap_grad_reduce",
                "overlap_gather": "overlap_param_gather", "tp_overlap": "tp_comm_overlap",
                "grad_dtype": "grad_reduce_dtype"}
# Values every stack has unless it says otherwise (TrainingSpec's defaults for these knobs). runtime_memory (what
# autoplan's runtime holds beyond Megatron's memory count, estimate.runtime_extra) is autoplan's alone. torchtitan
# also runs FSDP2 and DTensor, but: it has no replicate-with-TP at ZeRO-0 (its DDP is 1-D only), its MoE shards
# experts its own way, its models are untied, and its vocabulary-parallel embedding runs under FSDP (ZeRO >= 1,
# where the whole gradient is not held). The one term it would share, FSDP2's unsharded copy beside a ZeRO-1/2
# shard (reshard_after_forward=False), is left out with the rest: torchtitan's typical run is ZeRO-3.
_COMMON = {"tp_bwd_comm_overlap": False, "p2p_scatter_gather": True, "p2p_overlap": True, "grad_accum_fused": True,
           "grad_accum_cast_copy": False, "optimizer_separate_passes": False, "optimizer_dtype": "fp32",
           "master_weights": None,
           "loss_fusion": False, "align_grad_reduce": False, "flexible_rounds": True, "short_1f1b": False,
           "zero_stages": ALL_ZERO_STAGES, "schedules": ALL_SCHEDULES, "seq_splits": ALL_SEQ_SPLITS,
           "recompute_modes": ALL_RECOMPUTE_MODES,
           # one recomputation setting for every stage, except on autoplan's runtime (TrainingSpec.recompute_per_stage)
           "recompute_per_stage": False,
           # a partial full recomputation leaves the other layers plain: Megatron's block method
           # (--recompute-method block: each model chunk checkpoints its first --recompute-num-layers layers "and
           # skip[s] the rest", megatron/core/recompute.py); torchtitan's layer SAC is every-nth (below)
           "partial_recompute": "rest-none",
           "uneven_stages": True,
           "grad_sync_all_reduce": False,
           "sp_grads_coalesced": True, "runtime_memory": False, "autocast_fp32_params": False,
           "selective_policy": "attention_core", "checkpoint_early_stop": None, "cp_attention": None}


# Megatron's pipeline schedules (megatron/core/pipeline_parallel/schedules.py get_forward_backward_func): 1F1B
# (forward_backward_pipelining_without_interleaving) and the interleaved one; no GPipe.
_MEGATRON_SCHEDULES = "1f1b+interleaved"
# Megatron's and DeepSpeed's 1F1B run fewer micro-batches than stages (TrainingSpec.short_1f1b): SC21's figure-14
# and -17 scripts run a global batch of 1 per pipeline (examples/academic_paper_scripts/sc21)


class Stack(BaseModel):
    """One named software stack: TrainingSpec values plus what they mean."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Name used by --stack.")
    title: str = Field(description="One line: the software and its era.")
    knobs: dict[str, object] = Field(description="TrainingSpec values the stack sets (others keep their defaults).")
    assumes: str = Field(description="What the values mean, in words.")
    typical: str = Field(default="", description="Parallel settings its users typically ran (not applied).")
    source: str = Field(default="", description="Where the assumptions come from.")


# p2p_overlap=false (blocking pipeline p2p: send and receive are posted together and waited on, so a transfer
# runs only once the receiver is ready for it; estimate.p2p_occupancy):
# Megatron-LM 2021-22 p2p_communication._communicate (batch_isend_irecv, req.wait(), torch.cuda.synchronize());
# Megatron-Core's non-interleaved 1F1B (send_forward_recv_backward with wait_on_reqs; --overlap-p2p-communication
# applies to the interleaved schedule only); DeepSpeed's PipelineEngine ("The communication is blocking and must
# be paired", deepspeed/runtime/pipe/schedule.py SendActivation/SendGrad). torch.distributed.pipelining (autoplan,
# torchtitan) posts isend/irecv and waits only on what the next action consumes: overlapped.


def _stack(**kw) -> Stack:
    return Stack(**{**kw, "knobs": {**_COMMON, **kw["knobs"]}})


STACKS: dict[str, Stack] = {s.name: s for s in (
    _stack(
        name="autoplan", title="autoplan's own runtime",
        knobs={"flash_attention": True, "overlap_grad_reduce": True, "overlap_param_gather": True,
               "tp_comm_overlap": False, "kernels": "fused", "grad_reduce_dtype": None, "runtime_memory": True,
               "recompute_per_stage": True,
               # a stage's other layers recompute their attention core (runtime.parallelize.apply_recompute)
               "partial_recompute": "rest-selective",
               "sp_grads_coalesced": False, "autocast_fp32_params": True,
               # torch.distributed.pipelining sends a stage's output tensor as each tp rank holds it, rank to
               # rank: the whole hidden states without SP, nothing gathered (counts.boundary_bytes, measured)
               "p2p_scatter_gather": False},
        assumes="flash (SDPA) attention; autoplan's fused Triton norms and activations (RoPE and the "
                "cross-entropy eager); 16-bit compute under torch.autocast over fp32 parameters "
                "(autocast_fp32_params); "
                "gradient reduce overlapped with the backward and ZeRO gathers with the forward (FSDP2); "
                "TP collectives not overlapped; parameters and gradients fp32 in memory and on the wire "
                "(autocast_fp32_params); memory as the runtime holds "
                "it (FSDP2's parameter copies, whole experts, the embedding's whole gradient: runtime_memory); a tied "
                "embedding's all-reduce under pp moves the rank's FSDP2 gradient shard; pipeline stages send each "
                "tp rank's hidden states as it holds them (whole without SP: no scatter/gather)",
        source="runtime/parallelize.py (apply_dp, apply_fused_kernels)",
    ),
    _stack(
        name="megatron-2021", title="Megatron-LM as in Narayanan et al. SC21",
        knobs={"dtype": "fp16", "flash_attention": False, "overlap_grad_reduce": False,
               "overlap_param_gather": False, "tp_comm_overlap": False, "kernels": "megatron",
               "grad_reduce_dtype": None, "p2p_overlap": False, "grad_accum_fused": False,
               "optimizer_separate_passes": True, "flexible_rounds": False,
               # no distributed optimizer yet: it arrived in 2022 ("working on Float16DistributedOptimizer",
               # 329fe582, 2022-02-10; megatron/optimizer/distrib_optimizer.py from 28b63ec7, 2022-03-09)
               "zero_stages": "0", "schedules": _MEGATRON_SCHEDULES, "short_1f1b": True,
               # sequence parallelism came to Megatron-LM in 2022-03 ("column parallel linear with sequence
               # parallelism", 02bb1f5c, 2022-03-02), context parallelism in 2023-08 (80590f98, 2023-08-09)
               "seq_splits": "none",
               # --checkpoint-activations checkpointed every layer (megatron/arguments.py, v2.x); a set number of
               # layers per stage came in 2021-08 ("Checkpoint a set number of individual Transformer layers",
               # c1e0689d, --activations-checkpoint-method block), selective recomputation in 2022-05
               # (--recompute-granularity selective, bbab79f8, 2022-05-16)
               "recompute_modes": "full", "partial_recompute": "off",
               # "num_layers must be divisible by pipeline_model_parallel_size" (megatron/model/transformer.py at
               # 50a4b5fa, 2021-04-08; the same for the virtual stages) until "Uneven Pipeline Parallelism"
               # (fa8bb592, 2024-09-05)
               "uneven_stages": False},
        # grad_accum_fused false: Megatron-LM v2 (2021) adds each micro-batch's weight gradients into the DDP
        # buffer in a backward hook, "param.main_grad.add_(param.grad.data)" (megatron/model/distributed.py at
        # 50a4b5fa "Release fixes", 2021-04-08), or lets autograd add into param.grad; the wgrad GEMM writing
        # straight into main_grad came with "gradient accumulation fusion" (83b1e42f, 2022-02-13), after SC21.
        # With fp16 the buffer is fp16 (accumulate_allreduce_grads_in_fp32 is forced only for bf16).
        assumes="fp16; unfused softmax attention (fused scale-mask-softmax over the s x s scores); Megatron's fused "
                "bias-GeLU and LayerNorm; fp16 gradients all-reduced after the backward, not overlapped; "
                "no distributed optimizer",
        typical="recompute=full, schedule=interleaved, zero=0",
        source="Narayanan et al. 2021 (SC21) sections 4-5; Megatron-LM v2.x (2021) training.py/distributed.py",
    ),
    _stack(
        name="megatron-2022", title="Megatron-LM with selective recomputation and SP (Korthikanti et al. 2022)",
        # grad_reduce_dtype fp32: Megatron-LM's arguments.py (2021-22) forces it for bf16 ("bfloat16 requires
        # gradient accumulation and all-reduce to be done in fp32": accumulate_allreduce_grads_in_fp32 = True).
        # Not overlapped: Korthikanti et al. 2022 sec. 6.3, "we do not use any overlapping of gradient all-reduces
        # with back-propagation".
        knobs={"dtype": "bf16", "flash_attention": False, "overlap_grad_reduce": False,
               "overlap_param_gather": False, "tp_comm_overlap": False, "tp_bwd_comm_overlap": True,
               "kernels": "megatron", "grad_reduce_dtype": "fp32", "p2p_overlap": False,
               "optimizer_separate_passes": True, "flexible_rounds": False,
               # --use-distributed-optimizer (ZeRO-1: 2022-03, above); no ZeRO-2 or -3
               "zero_stages": "01", "schedules": _MEGATRON_SCHEDULES, "short_1f1b": True,
               "seq_splits": "sp",  # no context parallelism before 2023-08 (above)
               "uneven_stages": False},  # even stages only until 2024-09 (above)
        # optimizer_separate_passes (megatron-2021 too): Megatron-LM's Float16OptimizerWithFloat16Params zeroes
        # the grad buffer, casts main grads, (fp16) unscales them, runs apex FusedAdam on the fp32 master and then
        # copies the master into the 16-bit weights, each its own pass (estimate.optimizer_time quotes them).
        assumes="bf16; unfused softmax attention (selective recomputation recomputes it); Megatron's fused kernels; "
                "gradients accumulated and all-reduced in fp32 after the backward, not overlapped; forward TP "
                "collectives exposed, in the "
                "backward one collective per linear pair beside the weight-gradient GEMM (async TP all-reduce)",
        typical="sp=1, recompute=selective, zero=0",
        source="Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models', sec. 4-6",
    ),
    _stack(
        name="megatron-core", title="Megatron-Core with Transformer Engine and overlaps (2024+)",
        knobs={"dtype": "bf16", "flash_attention": True, "overlap_grad_reduce": True, "overlap_param_gather": True,
               "tp_comm_overlap": True, "kernels": "megatron", "grad_reduce_dtype": None,
               # --overlap-p2p-communication is on by default under the interleaved schedule ("Make overlap_p2p_comm
               # the default", 4eeff55d, 2023-10) and turned off without it (megatron/training/arguments.py)
               "p2p_overlap": None,
               # Without userbuffers (tp_comm_overlap=false) TE's linears still overlap their backward collectives
               # as Megatron-LM 2022 did: Transformer Engine 1.9 `_Linear.backward` / `_LayerNormLinear.backward`
               # issue "dgrad, handle = reduce_scatter_along_first_dim(dgrad, ctx.tp_group, async_op=True)" (or
               # `allreduce(..., async_op=True)` without sp) before the wgrad GEMM and wait after it; the row-parallel
               # output gradient's all-gather (`grad_output_preprocess`) stays synchronous.
               "tp_bwd_comm_overlap": True,
               # megatron/training/arguments.py: --delay-grad-reduce (core_r0.8.0), --align-grad-reduce today,
               # both on unless turned off (training.py sets grad_sync_func from it)
               "align_grad_reduce": True,
               # flexible_rounds (the common default): interleaved rounds longer than pp when pp does not divide
               # m, --microbatch-group-size-per-virtual-pipeline-stage (Megatron-Core 0.10, Dec 2024; the export
               # writes it only then)
               # ZeRO: the distributed optimizer (1; it reduce-scatters gradients but keeps the whole gradient
               # buffer, megatron/core/distributed/param_and_grad_buffer.py, so there is no ZeRO-2) and
               # Megatron-FSDP's optim_grads_params (3, --use-megatron-fsdp, the export's form)
               "zero_stages": "013", "schedules": _MEGATRON_SCHEDULES, "short_1f1b": True,
               },
        assumes="bf16; TE fused (flash) attention and fused kernels; --overlap-grad-reduce, --overlap-param-gather "
                "(distributed optimizer), --tp-comm-overlap (userbuffers; without it, TE's backward still reduces "
                "each linear pair's input gradient beside its wgrad GEMM); fp32 cross-entropy over materialised "
                "logits; gradients reduced in bf16 (grad_reduce_in_fp32=False); pipeline p2p overlapped under the "
                "interleaved schedule, blocking under 1F1B",
        typical="sp=1, zero=1 (--use-distributed-optimizer), recompute=selective",
        source="Megatron-LM README performance table (Megatron-Core r0.8.0); megatron/core arguments",
    ),
    _stack(
        name="megatron-deepspeed", title="Megatron-DeepSpeed (2021-22): MT-NLG 530B, BLOOM 176B",
        knobs={"dtype": "bf16", "flash_attention": False, "overlap_grad_reduce": False,
               "overlap_param_gather": False, "tp_comm_overlap": False, "p2p_overlap": False,
               "grad_accum_fused": False, "kernels": "megatron", "grad_reduce_dtype": "fp32",
               "grad_sync_all_reduce": True, "grad_accum_cast_copy": True, "flexible_rounds": False,
               # DeepSpeed's PipelineEngine: "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
               # (deepspeed/runtime/pipe/engine.py, an assert on the ZeRO stage)
               "zero_stages": "01",
               # its PipelineEngine runs one schedule, TrainSchedule (deepspeed/runtime/pipe/schedule.py): 1F1B
               # without virtual stages
               "schedules": "1f1b", "short_1f1b": True,
               # the 2021-22 Megatron layers it ran (MT-NLG, BLOOM) predate sequence and context parallelism
               "seq_splits": "none",
               # ... and selective recomputation: --checkpoint-activations recomputes every layer (BLOOM's
               # tr11-176B-ml script, MT-NLG sec. 3 "activation checkpointing"; its --checkpoint-num-layers groups
               # layers per checkpoint, every layer still recomputed)
               "recompute_modes": "full", "partial_recompute": "off"},
        # grad_accum_cast_copy: BF16_Optimizer accumulates each micro-batch's bf16 gradients with
        # `hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype).view(hp_grad.shape))` (update_hp_grads, called by the
        # PipelineEngine's `_exec_backward_pass` after every micro-batch): an fp32 temporary is written and read
        # before the add (estimate.grad_accum_time).
        # grad_sync_all_reduce: with bf16 the PipelineEngine reduces gradients in `_exec_reduce_grads` ->
        # `_bf16_reduce_grads`: "Make our own list of gradients from the optimizer's FP32 grads",
        # `self.buffered_allreduce_fallback(grads=self.optimizer.get_grads_for_reduction(), ...)`, and
        # BF16_Optimizer.get_grads_for_reduction returns `self.fp32_groups_gradients_flat`, the whole fp32 gradient:
        # an all-reduce, not a reduce-scatter. Its step() then updates only this rank's fp32 partition and calls
        # `all_gather_dp_groups(partitioned_param_groups=self.bf16_partitioned_groups, ...)` (DeepSpeed
        # runtime/pipe/engine.py and runtime/bf16_optimizer.py, 2022 to today). BLOOM ran exactly this (ZeRO stage 0
        # + bf16, bigscience-workshop/bigscience train/tr11-176B-ml); for MT-NLG it is the stack's assumption.
        # p2p_scatter_gather stays true: DeepSpeed's PipelineEngine partitions what it sends between stages over
        # the tensor-parallel ("model") axis of its grid, `self.is_pipe_partitioned = self.is_model_parallel` and
        # likewise `is_grad_partitioned` (deepspeed/runtime/pipe/engine.py, 2021-22), and the receiver rebuilds
        # the tensor with PartitionedTensor.full(), an all-gather over that group: Megatron's scatter/gather.
        assumes="Megatron's TP layers and fused kernels, unfused softmax attention, run by DeepSpeed's pipeline "
                "engine: stage-to-stage activations and gradients partitioned over the tp ranks and all-gathered "
                "on arrival (PartitionedTensor); gradients accumulated into fp32 buffers by a separate pass per "
                "micro-batch that first casts each bf16 gradient to an fp32 temporary, and reduced in fp32 after the "
                "pipeline flush (BF16_Optimizer / ZeRO-1), not overlapped",
        typical="zero=1, recompute=full, schedule=1f1b",
        source="Smith et al. 2022 (MT-NLG, arXiv 2201.11990) sec. 2-3; BigScience BLOOM (arXiv 2211.05100) "
               "sec. 3.4; DeepSpeed pipe/engine.py and runtime/bf16_optimizer.py",
    ),
    _stack(
        name="deepspeed-zero3", title="DeepSpeed ZeRO-3 on a Hugging Face-style model",
        knobs={"dtype": "bf16", "flash_attention": True, "overlap_grad_reduce": True, "overlap_param_gather": True,
               "tp_comm_overlap": False, "grad_accum_fused": False, "kernels": "torch", "grad_reduce_dtype": "fp32",
               # no pipeline: DeepSpeed pipelines only a PipelineModule, and its engine refuses ZeRO-2/3 (above)
               "schedules": "none",
               # no tensor parallelism to split the sequence inside; DeepSpeed-Ulysses splits attention heads with
               # all-to-alls, not the ring context parallelism the model prices
               "seq_splits": "none",
               # whole layers: deepspeed.checkpointing.checkpoint and Hugging Face's gradient_checkpointing_enable()
               # wrap every decoder layer; neither recomputes only the attention core
               "recompute_modes": "full", "partial_recompute": "off"},
        assumes="bf16 with eager PyTorch ops (no fused norms/activations); SDPA flash attention; overlap_comm "
                "(parameter prefetch and gradient reduce-scatter behind compute); gradients accumulated in fp32 "
                "by a separate pass per micro-batch and reduced in fp32",
        typical="zero=3, tp=1, pp=1, recompute=full",
        source="DeepSpeed ZeRO-3 config docs (overlap_comm, stage3_prefetch_bucket_size); Rajbhandari et al. 2020",
    ),
    _stack(
        name="torchtitan", title="torchtitan: FSDP2 + async TP + torch.compile",
        knobs={"dtype": "bf16", "flash_attention": True, "overlap_grad_reduce": True, "overlap_param_gather": True,
               "tp_comm_overlap": True, "kernels": "fused", "grad_reduce_dtype": "fp32",
               # its sequence-parallel norms' Partial gradients are redistributed per tensor by FSDP2, as ours
               "sp_grads_coalesced": False,
               # its selective checkpointing is per operator (SelectiveAC; `selective_ac_option = "op"` before 0.3):
               # torchtitan/distributed/activation_checkpoint.py saves matmul and attention outputs, "except every
               # second mm/linear" (parallelize_llama.py `_save_list`, `mm_count % 2` in the 2024 code)
               "selective_policy": "every_other_matmul",
               # layer SAC (`ac_freq`): every n-th block whole, the others plain
               "partial_recompute": "every-nth",
               # its pipeline is torch.distributed.pipelining, as ours: no scatter/gather of stage messages
               "p2p_scatter_gather": False,
               # full AC is torch's checkpoint_wrapper around each block (torchtitan/distributed/
               # activation_checkpoint.py), non-reentrant, and re-runs the whole block: early stop became a config
               # defaulting to false in "Add config to AC to toggle early-stop" (25413d224, 2025-08-29; 0.2's
               # `activation_checkpoint.early_stop`), and 0.3's FullAC passes early_stop=False. Before it torch's
               # default (stop early) applied: the 2024 runs of the fidelity benchmark set it back to true.
               "checkpoint_early_stop": False},
        assumes="bf16 parameters with FSDP2 reducing gradients in fp32 (mixed_precision_reduce=float32); SDPA "
                "flash attention; torch.compile fusing the elementwise ops; async TP overlapping the TP "
                "collectives with the GEMMs; FSDP2 prefetch overlapping gathers and reduce-scatters; "
                "recompute=selective is its per-op policy (every second matmul and all elementwise ops re-run); "
                "recompute=full re-runs each whole block (non-reentrant checkpoint, early_stop=False since "
                "2025-08)",
        typical="zero=3 (FSDP2), tp=8 inside a node, pp for the largest models",
        source="Liang et al. 2024, 'TorchTitan' (arXiv 2410.06511); torchtitan job_config defaults",
    ),
)}


def stack_names() -> list[str]:
    return list(STACKS)


def get_stack(name: str) -> Stack:
    key = name.strip().lower().replace("_", "-")
    if key not in STACKS:
        raise SpecError(f"unknown stack {name!r}", "not one of " + ", ".join(STACKS),
                        "run `autoplan stacks` to list them")
    return STACKS[key]


def _coerce(key: str, value: str) -> object:
    field = TrainingSpec.model_fields[key]
    low = value.strip().lower()
    if field.annotation in (bool, bool | None):
        if low in ("1", "true", "on", "yes"):
            return True
        if low in ("0", "false", "off", "no"):
            return False
        if field.annotation is not bool and low in ("none", "null", "default"):
            return None
        raise ConfigError(f"--stack-set {key} takes true or false", f"got {key}={value}", f"write {key}=true")
    if low in ("none", "null", "default") and type(None) in getattr(field.annotation, "__args__", ()):
        return None
    return low  # e.g. schedules=none: a value of its own


def parse_stack_set(text: str | None) -> dict[str, object]:
    """`flash_attention=false,kernels=torch` -> {knob: value}; unknown or repeated knobs are errors."""
    out: dict[str, object] = {}
    if not text:
        return out
    for raw in text.split(","):
        raw = raw.strip()
        if not raw:
            continue
        if "=" not in raw:
            raise ConfigError("--stack-set items are key=value", f"got {raw!r}", "write e.g. tp_comm_overlap=true")
        key, val = (x.strip() for x in raw.split("=", 1))
        key = key.lower().replace("-", "_")
        key = KNOB_ALIASES.get(key, key)
        if key not in STACK_KNOBS:
            raise ConfigError(f"unknown stack knob {key!r}", f"in --stack-set {text!r}",
                              "knobs: " + ", ".join(STACK_KNOBS))
        if key in out:
            raise ConfigError(f"stack knob {key!r} given twice", f"in --stack-set {text!r}", "give each knob once")
        out[key] = _coerce(key, val)
    return out


def stack_knobs(name: str | None, overrides: dict[str, object] | None = None) -> dict[str, object]:
    """The TrainingSpec values of stack `name` (default: autoplan's) with `overrides` on top."""
    knobs = dict(get_stack(name or DEFAULT_STACK).knobs)
    knobs.update(overrides or {})
    return knobs


def stack_label(name: str | None, overrides: dict[str, object] | None = None) -> str:
    """How a plan records its stack: the name, then any single-knob overrides."""
    label = get_stack(name or DEFAULT_STACK).name
    if overrides:
        label += "+" + ",".join(f"{k}={str(v).lower()}" for k, v in overrides.items())
    return label


def apply_stack(training: TrainingSpec, name: str | None, overrides: dict[str, object] | None = None,
                *, keep: tuple[str, ...] = ()) -> TrainingSpec:
    """`training` with the stack's knobs set, except the fields in `keep` (given explicitly by the user)."""
    knobs = {k: v for k, v in stack_knobs(name, overrides).items() if k not in keep or k in (overrides or {})}
    try:
        return TrainingSpec(**{**training.model_dump(), **knobs})
    except SpecError:
        raise
    except Exception as e:  # pydantic: one line naming the knob
        errs = e.errors() if hasattr(e, "errors") else []
        first = errs[0] if errs else {"loc": ("?",), "msg": str(e), "input": None}
        loc = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"stack knob {loc}: {first['msg'].lower()}", f"got {first.get('input')!r}",
                          "run `autoplan stacks` for the knobs and their values") from None
