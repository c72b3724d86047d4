"""The data the whole project speaks: model, hardware, training and parallel-configuration specs.

These are frozen pydantic models. They live in `cost_models` because the cost model may import nothing
else of ours; `autoplan.specs` re-exports them and adds the loaders (files, presets, Hugging Face configs).
The parallel configuration string of DESIGN.md (`tp=8,pp=8,dp=16,...`) is parsed and printed here, and
`check_config` validates a configuration against a model, cluster and training setup with one typed error
per rule.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import ConfigError, SpecError
from .pipeline import interleaved_rounds_fit

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved"]
# What a stack runs when it says nothing narrower (TrainingSpec.zero_stages, .schedules): every ZeRO stage and
# every pipeline schedule, as autoplan's runtime (FSDP2, torch.distributed.pipelining) does.
ALL_ZERO_STAGES = "0123"
ALL_SCHEDULES = "+".join(get_args(Schedule))
ALL_SEQ_SPLITS = "sp+cp"
ALL_RECOMPUTE_MODES = "selective+full"
_SCHEDULE_ALT = "|".join(get_args(Schedule))

# Bytes per element of each training dtype (fp8 keeps weights in bf16 in practice; the matmul inputs are 1 byte).
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def compute16(dtype: str) -> str:
    """The dtype of what an fp8 plan does not run in fp8 (activations, gradients, attention, the LM head): bf16;
    any other dtype is its own."""
    return "bf16" if dtype == "fp8" else dtype


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------------------------- model


class MoESpec(_Frozen):
    """Mixture-of-experts feed-forward layers."""

    num_experts: int = Field(gt=1, description="Experts per MoE layer.")
    top_k: int = Field(default=2, ge=1, description="Experts each token is routed to.")
    expert_ffn_hidden_size: int | None = Field(
        default=None, gt=0, description="Hidden size of one expert's FFN (defaults to the dense ffn_hidden_size)."
    )
    every_n_layers: int = Field(default=1, ge=1, description="Every n-th layer is MoE; the others stay dense.")
    first_layer: int | None = Field(
        default=None, ge=0, description="The first MoE layer (0-based); then every every_n_layers-th. None = "
        "every_n_layers - 1, layers n-1, 2n-1, ... (Hugging Face's decoder_sparse_step, DeepSpeed's "
        "expert_interval); 0 = layers 0, n, 2n, ... (Megatron-Core's --moe-layer-freq N: `1 if (i % "
        "moe_layer_freq == 0)`, megatron/core/models/gpt/gpt_layer_specs.py)."
    )
    layers: tuple[int, ...] | None = Field(
        default=None, description="The MoE layers (0-based) where they are not one every n from a first one "
        "(Qwen2-MoE's mlp_only_layers, a Megatron --moe-layer-freq list); replaces every_n_layers and first_layer."
    )
    capacity_factor: float = Field(
        default=1.0, gt=0, description="Tokens an expert accepts relative to a perfectly balanced load. autoplan "
        "prices routing under a balanced load, dropless: a capacity of at least that load (>= 1) changes nothing "
        "unless the experts' inputs are padded to it (pad_to_capacity), and one below it, which drops tokens, is "
        "refused."
    )
    pad_to_capacity: bool = Field(
        default=False, description="Every expert's input padded to its capacity (Megatron's "
        "--moe-pad-expert-input-to-capacity): each expert computes, and the all-to-alls move, capacity_factor x "
        "the balanced load. Megatron-style stacks only: autoplan's runtime routes dropless without padding."
    )

    @property
    def routed_scale(self) -> float:
        """Rows each expert processes relative to the balanced load: the capacity where inputs are padded to it."""
        return self.capacity_factor if self.pad_to_capacity else 1.0

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.layers is not None and (not self.layers or list(self.layers) != sorted(set(self.layers))
                                        or self.layers[0] < 0):
            raise SpecError("moe.layers must list layer indices once each, in order", f"layers={self.layers}",
                            "write the MoE layers' 0-based indices, ascending")
        if self.capacity_factor < 1:
            raise SpecError("moe.capacity_factor below 1 drops tokens, which autoplan does not price",
                            f"capacity_factor={self.capacity_factor:g}",
                            "use 1 or more (autoplan prices dropless routing under a balanced load)")
        if self.top_k > self.num_experts:
            raise SpecError(
                "moe.top_k must not exceed moe.num_experts",
                f"top_k={self.top_k}, num_experts={self.num_experts}",
                "route to at most num_experts experts",
            )
        return self


def moe_layer_spacing(sparse: list[bool] | tuple[bool, ...]) -> dict[str, object] | None:
    """The MoESpec fields that place a per-layer MoE pattern: every_n_layers and first_layer where it is one MoE
    layer every n from a first one (first_layer None where that is n - 1, the default), else the layers
    themselves; None where no layer is MoE."""
    ones = [i for i, b in enumerate(sparse) if b]
    if not ones:
        return None
    n = ones[1] - ones[0] if len(ones) > 1 else len(sparse) - ones[0]
    if any(bool(b) != (i >= ones[0] and (i - ones[0]) % n == 0) for i, b in enumerate(sparse)):
        return {"layers": tuple(ones)}
    return {"every_n_layers": n, "first_layer": None if ones[0] == n - 1 else ones[0]}


class ModelSpec(_Frozen):
    """A decoder-only transformer, described by the fields of DESIGN.md's model spec."""

    name: str = Field(description="Model name, shown in plans and tables.")
    num_layers: int = Field(gt=0, description="Transformer blocks.")
    hidden_size: int = Field(gt=0, description="Model width h.")
    num_attention_heads: int = Field(gt=0, description="Query heads a.")
    num_kv_heads: int | None = Field(
        default=None, gt=0, description="Key/value heads; fewer than the query heads means GQA/MQA."
    )
    head_dim: int | None = Field(default=None, gt=0, description="Per-head size (defaults to h / a).")
    ffn_hidden_size: int | None = Field(default=None, gt=0, description="MLP hidden size (defaults to 4h).")
    vocab_size: int = Field(gt=0, description="Vocabulary size V.")
    max_seq_length: int = Field(gt=0, description="Longest sequence the positions support.")
    activation: Literal["gelu", "swiglu", "relu", "relu2"] = Field(
        default="gelu", description="MLP activation. relu2: squared ReLU, relu(x)**2 (Nemotron-4 and Nemotron-3; "
        "Hugging Face hidden_act 'relu2', Megatron's --squared-relu).")
    norm: Literal["layernorm", "rmsnorm"] = Field(default="layernorm", description="Normalisation layer.")
    position: Literal["learned", "rope", "alibi"] = Field(
        default="learned", description="Position encoding: learned table, rotary, or ALiBi (no position weights, "
        "a per-head linear bias added to the attention scores; Press et al. 2022, BLOOM).")
    tie_embeddings: bool = Field(default=False, description="LM head shares the input embedding's weight.")
    rope_theta: float = Field(
        default=10000.0, gt=0, description="Rotary base frequency (position rope only): 10000 as in RoFormer "
        "(Su et al. 2021) and Megatron-LM's --rotary-base default; Llama 3 uses 500000. The runtime's model rotates "
        "with it; it does not change the cost.")
    bias: bool | None = Field(
        default=None, description="Linear layers carry biases (defaults to true for GeLU/LayerNorm GPTs)."
    )
    dropout: float = Field(
        default=0.0, ge=0, lt=1, description="Hidden and attention dropout probability (Megatron GPTs use 0.1)."
    )
    moe: MoESpec | None = Field(default=None, description="Mixture-of-experts settings, or null for dense.")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        kv = self.kv_heads
        if self.num_attention_heads % kv:
            raise SpecError(
                "num_attention_heads must be a multiple of num_kv_heads",
                f"{self.name}: heads={self.num_attention_heads}, kv_heads={kv}",
                "choose num_kv_heads that divides num_attention_heads",
            )
        if self.position != "rope" and self.rope_theta != 10000.0:
            raise SpecError(
                "rope_theta is the rotary base; the model has no rotary positions",
                f"{self.name}: position={self.position}, rope_theta={self.rope_theta:g}",
                "set position: rope, or drop rope_theta",
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise SpecError(
                "hidden_size must be a multiple of num_attention_heads (or give head_dim)",
                f"{self.name}: hidden={self.hidden_size}, heads={self.num_attention_heads}",
                "set head_dim explicitly or fix the sizes",
            )
        if self.moe is not None and (self.num_moe_layers == 0 or (self.moe.layers or (0,))[-1] >= self.num_layers):
            raise SpecError(
                "the MoE layers fall outside the model",
                f"{self.name}: {self.num_layers} layers, moe.first_layer={self.moe.first_layer}, "
                f"every_n_layers={self.moe.every_n_layers}, layers={self.moe.layers}",
                "choose a first MoE layer and period inside the layers, or drop moe",
            )
        return self

    # Derived sizes, used everywhere; keep them here so there is one definition.
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def dhead(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def has_bias(self) -> bool:
        return self.bias if self.bias is not None else (self.norm == "layernorm" and self.activation != "swiglu")

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (0-based) is a MoE layer: every every_n_layers-th from moe.first_layer (by default n - 1)."""
        if self.moe is None:
            return False
        if self.moe.layers is not None:
            return i in self.moe.layers
        n = self.moe.every_n_layers
        first = n - 1 if self.moe.first_layer is None else self.moe.first_layer
        return i >= first and (i - first) % n == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))


# ------------------------------------------------------------------------------------------ hardware


class GPUCalibration(_Frozen):
    """Efficiency constants of one accelerator type; fitted per GPU type, never per run."""

    matmul_max_efficiency: float = Field(
        default=0.80, gt=0, le=1, description="Fraction of dense peak a large, well-shaped GEMM reaches."
    )
    matmul_half_dim: float = Field(
        default=256.0,
        ge=0,
        description="GEMM size (harmonic mean of M, N, K) at which efficiency falls to half of the maximum.",
    )
    attention_efficiency: float = Field(
        default=0.55, gt=0, le=1, description="Fraction of peak a fused (flash) attention kernel reaches."
    )
    memory_efficiency: float = Field(
        default=0.80, gt=0, le=1, description="Fraction of HBM bandwidth a memory-bound kernel reaches."
    )
    kernel_launch_us: float = Field(
        default=4.0, ge=0, description="Host time to issue one kernel (Python, dispatch, launch), microseconds."
    )
    fused_call_us: float = Field(
        default=0.0, ge=0,
        description="Host time one call of autoplan's fused Triton modules (norms, activations) adds in the "
        "forward over the eager op it replaces, microseconds: argument checks, allocations, the autograd Function "
        "and Triton's launch in Python. Priced for autoplan's own runtime on a GPU with kernels=fused, where the "
        "forward is host-bound; twice in the backward. 0 where not measured. Measured by `autoplan calibrate` "
        "on a GPU; fitted by `autoplan tune`.",
    )
    tp_op_overhead_us: float = Field(
        default=0.0, ge=0,
        description="Extra host time per operator of a tensor-parallel layer, microseconds: DTensor's sharding "
        "propagation and redistribution run in Python for every op (autoplan's runtime); 0 where tensor "
        "parallelism is hand-written (Megatron-LM). Fitted by `autoplan tune`.",
    )
    dtensor_param_us: float = Field(
        default=0.0, ge=0,
        description="Extra host time per parameter tensor of the optimizer step when the parameters are DTensors "
        "(autoplan's runtime under tensor parallelism or FSDP2), microseconds: the fused AdamW op's per-tensor "
        "arguments go through DTensor's dispatch in Python. 0 where parameters are plain tensors (Megatron-LM, "
        "torch's DDP) or where it was not measured. Measured by `autoplan calibrate`, fitted by `autoplan tune`.",
    )
    fsdp_collective_overhead_us: float = Field(
        default=0.0, ge=0,
        description="Host time FSDP2 spends around each per-unit all-gather or reduce-scatter of ZeRO-1/2/3 "
        "(copy-in to the flat buffer, copy-out and views, DTensor wrapping), microseconds; it is on the critical "
        "path of a host-bound run (CPU, gloo). 0 where the GPU hides it. Fitted by `autoplan tune`.",
    )
    fsdp_hook_us: float = Field(
        default=0.0, ge=0,
        description="Host time of FSDP2's hooks on one unit in one micro-batch (pre/post-forward, pre/post-"
        "backward: state checks, parameter views, registering the backward hooks), microseconds; paid by "
        "`replicate` (ZeRO-0 under tensor parallelism; torch's DDP otherwise, no hooks) as by `fully_shard`, whether or not a "
        "collective is issued. 0 where the GPU hides it. Fitted by `autoplan tune`.",
    )
    pipeline_action_us: float = Field(
        default=0.0, ge=0,
        description="Host time the runtime's pipeline schedule (torch.distributed.pipelining) spends per action, "
        "one stage's forward or backward of one micro-batch, beyond the stage's own operators (its bookkeeping, "
        "posting the micro-batch's receives and sends, wrapping the chunk's inputs and outputs), microseconds. "
        "Priced for autoplan's runtime where the host is the critical path (CPU processes); on a GPU host the "
        "schedule runs ahead of the kernels. Measured by `autoplan calibrate`, fitted by `autoplan tune`.",
    )
    recompute_region_us: float = Field(
        default=0.0, ge=0,
        description="Host time of one checkpointed region in one micro-batch beyond re-running its operators "
        "(torch.utils.checkpoint, non-reentrant, preserve_rng_state: the RNG state saved and restored, the "
        "recompute's own frame in backward), microseconds. Priced where the host is on the critical path (CPU "
        "clusters, and autoplan's own runtime on a GPU host where the region's kernels are shorter) for full (one region per recomputed block) and selective recompute (one per block's "
        "attention core). 0 where the GPU hides it. Measured by `autoplan calibrate --bench-out`; fitted by "
        "`autoplan tune`.",
    )
    recompute_op_us: float = Field(
        default=0.0, ge=0,
        description="Further host time per operator inside a checkpointed region, microseconds: the saved-tensor "
        "hooks torch.utils.checkpoint runs for what each operator saves, in the forward and again in the "
        "recompute. Priced with recompute_region_us. Measured by `autoplan calibrate "
        "--bench-out`; fitted by `autoplan tune`.",
    )
    framework_overhead_gib: float = Field(
        default=2.0, ge=0, description="Memory the CUDA context, allocator fragmentation and workspaces take."
    )
    overlap_interference: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Fraction of communication time hidden under compute that still costs compute time "
        "(NCCL kernels take SMs and HBM bandwidth from the GEMMs they overlap).",
    )


class PeakTFlops(_Frozen):
    """Dense tensor-core TFLOP/s by dtype (no sparsity)."""

    bf16: float | None = Field(default=None, gt=0, description="bf16 dense TFLOP/s.")
    fp16: float | None = Field(default=None, gt=0, description="fp16 dense TFLOP/s.")
    fp8: float | None = Field(default=None, gt=0, description="fp8 dense TFLOP/s.")
    tf32: float | None = Field(default=None, gt=0, description="tf32 dense TFLOP/s.")
    fp32: float | None = Field(default=None, gt=0, description="fp32 (non-tensor-core) TFLOP/s.")


class GPUSpec(_Frozen):
    """One accelerator: dense peak FLOP/s by dtype, HBM size and bandwidth, and its calibration."""

    name: str = Field(description="GPU name.")
    peak_tflops: PeakTFlops = Field(description="Dense tensor-core TFLOP/s by dtype (bf16, fp16, fp8, fp32...).")
    hbm_gib: float = Field(gt=0, description="Usable device memory, GiB.")
    hbm_gbps: float = Field(gt=0, description="Device memory bandwidth, GB/s.")
    calibration: GPUCalibration = Field(default_factory=GPUCalibration, description="Efficiency constants.")

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype`; fp8 falls back to bf16 on GPUs without fp8 tensor cores."""
        table = self.peak_tflops
        for key in (dtype, "bf16" if dtype in ("fp8", "fp16") else dtype, "fp16", "fp32"):
            value = getattr(table, key, None)
            if value:
                return value * 1e12
        raise SpecError(f"GPU {self.name} has no peak for dtype {dtype}", str(table), "add it to peak_tflops")


class LinkSpec(_Frozen):
    """A level of the network as one GPU sees it."""

    bandwidth_gbps: float = Field(gt=0, description="GB/s per GPU per direction.")
    latency_us: float = Field(default=5.0, ge=0, description="One-way latency of a message, microseconds.")
    efficiency: float = Field(
        default=0.80, gt=0, le=1, description="Fraction of the bandwidth large collectives reach (bus bandwidth)."
    )


class ClusterSpec(_Frozen):
    """Nodes of identical GPUs: a fast level inside a node, a slower one between nodes."""

    name: str = Field(description="Cluster name.")
    gpu: GPUSpec = Field(description="The accelerator of every node.")
    gpus_per_node: int = Field(gt=0, description="GPUs per node (the NVLink domain).")
    num_nodes: int = Field(gt=0, description="Nodes.")
    intra_node: LinkSpec = Field(description="Link between GPUs of a node (NVLink/NVSwitch).")
    inter_node: LinkSpec = Field(description="Link between nodes, per GPU (InfiniBand/RoCE).")
    backend: Literal["nccl", "gloo"] = Field(default="nccl", description="torch.distributed backend it runs.")
    # Oversubscription (CPU clusters, gloo): fitted by `autoplan tune`; inactive while cores_per_node is None.
    cores_per_node: int | None = Field(
        default=None, gt=0,
        description="CPU cores the processes of a node share; None for accelerators (one process per device).",
    )
    oversubscription_wait_us: float = Field(
        default=0.0, ge=0,
        description="Extra wait per message hop when a node runs more processes than cores: a peer is "
        "descheduled with probability 1 - cores/processes and the hop waits for the scheduler to run it "
        "(Linux CFS timeslices are milliseconds). Fitted by `autoplan tune`.",
    )
    step_wait_us: float = Field(
        default=0.0, ge=0,
        description="Further wait per message hop of a collective inside a training step on such a node, scaled "
        "by `crowded_fraction(members)`: there the node's processes outside the collective are running their own "
        "compute and a woken member waits for one of them to block or end its timeslice, while in a collective "
        "micro-benchmark every process idles in the same loop. Fitted by `autoplan tune` from the runs' measured "
        "collective waits; micro-benchmarks do not see it.",
    )

    crowding: tuple[int, float] | None = Field(
        default=None, exclude=True,
        description="Not part of a cluster file: set by the estimate on an oversubscribed CPU node for the "
        "configuration it prices, (processes of one pipeline stage, fraction of the step a stage computes: "
        "m/(m+pp-1)), for `crowded_fraction`.",
    )
    skew_wait_us: float = Field(
        default=0.0, ge=0,
        description="Wait per collective inside a training step on such a node for its last member to arrive, "
        "scaled by the descheduled fraction: the scheduler runs only `cores_per_node` of the node's processes at "
        "a time, so members that compute between collectives reach one up to a timeslice apart (Linux CFS "
        "timeslices are milliseconds), once per collective rather than per hop. Fitted by `autoplan tune`; "
        "micro-benchmarks, whose members do nothing between collectives, do not see it.",
    )

    @property
    def oversubscribed(self) -> bool:
        """Whether a node runs more processes than it has cores (CPU clusters only; accelerators: never)."""
        return self.cores_per_node is not None and self.gpus_per_node > self.cores_per_node

    @property
    def descheduled_fraction(self) -> float:
        """Probability that a peer process is not running: 1 - cores/processes when processes outnumber cores."""
        return self.member_descheduled_fraction(self.gpus_per_node)

    def member_descheduled_fraction(self, members: int) -> float:
        """Probability that the next member of a collective over `members` of a node's processes is not running
        when a ring step reaches it: the members block and wake in lockstep, so they compete for the cores among
        themselves, 1 - cores/members when they outnumber the cores (0 otherwise, and on accelerators)."""
        members = min(members, self.gpus_per_node)
        if self.cores_per_node is None or members <= self.cores_per_node:
            return 0.0
        return 1.0 - self.cores_per_node / members

    def crowded_fraction(self, members: int, pair: bool = False) -> float:
        """Inside a training step, the probability that a woken member of a collective over `members` of a node's
        processes finds every core taken by the node's processes outside it that are computing: with `busy`
        such processes plus itself runnable on `cores` cores, 1 - cores/(busy + 1) (0 while they leave a core
        free, and on accelerators, one process per device). Outside processes of the same pipeline stage compute
        alongside (other data-parallel replicas); those of other stages compute for the pipeline's busy fraction
        of the step (`crowding`, set by the estimate for the configuration it prices; without it every outside
        process counts as busy). `pair`: a pipeline message between two stages."""
        if not self.oversubscribed:
            return 0.0
        P = self.gpus_per_node
        if self.crowding is None:
            busy = max(0, P - members)
        else:
            stage, frac = self.crowding
            stage = min(P, stage)
            if pair:
                same, other = 2 * (stage - 1), P - 2 * stage
            else:
                same, other = stage - members, P - stage
            busy = max(0, same) + max(0, other) * frac
        return max(0.0, 1.0 - self.cores_per_node / (busy + 1))

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def with_gpus(self, n: int) -> ClusterSpec:
        """The same cluster resized to `n` GPUs (whole nodes, or part of one node)."""
        if n <= 0:
            raise SpecError("--gpus must be positive", f"got {n}", "pass a positive GPU count")
        if n <= self.gpus_per_node:
            return self.model_copy(update={"num_nodes": 1, "gpus_per_node": n})
        if n % self.gpus_per_node:
            raise SpecError(
                "--gpus must be whole nodes",
                f"{n} GPUs with {self.gpus_per_node} per node",
                f"use a multiple of {self.gpus_per_node}, e.g. {(n // self.gpus_per_node + 1) * self.gpus_per_node}",
            )
        return self.model_copy(update={"num_nodes": n // self.gpus_per_node})


# ------------------------------------------------------------------------------------------ training


# Bytes a parameter of each way of holding the master copy (TrainingSpec.master_weights); None: fp32 parameters
# are their own master.
MASTER_BYTES = {None: 0, "fp32": 4, "bf16": 2, "remainders": 2, "in-place": 0}


class TrainingSpec(_Frozen):
    """What is trained, and how the runtime behaves (which overlaps and kernels it has)."""

    global_batch_size: int = Field(gt=0, description="Sequences per optimizer step.")
    seq_length: int = Field(gt=0, description="Tokens per sequence.")
    dtype: Dtype = Field(default="bf16", description="Compute dtype of matmuls and activations.")
    grad_reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        default=None,
        description="Dtype gradients are accumulated and reduced in; None = the compute dtype (Megatron-Core's "
        "default, grad_reduce_in_fp32=False). Ignored under autocast_fp32_params (the gradients are fp32).",
    )
    flash_attention: bool = Field(
        default=True, description="Attention is one fused kernel (flash); false = explicit softmax and masks."
    )
    overlap_grad_reduce: bool = Field(
        default=True, description="Data-parallel gradient reduction overlaps the backward pass."
    )
    overlap_param_gather: bool = Field(
        default=True, description="ZeRO parameter all-gathers overlap the forward pass."
    )
    tp_comm_overlap: bool = Field(
        default=False, description="Tensor-parallel collectives overlap the GEMMs (Megatron userbuffers)."
    )
    tp_bwd_comm_overlap: bool = Field(
        default=False, description="In the backward pass, one TP collective per linear pair runs beside the "
        "weight-gradient GEMM (Megatron-LM's async tensor-parallel all-reduce / SP all-gather, 2022).")
    p2p_scatter_gather: bool = Field(
        default=False, description="Without sequence parallelism, pipeline activations cross stages split over the "
        "tp ranks and are all-gathered on arrival (SC21 sec. 4.1; Megatron-LM and DeepSpeed's PipelineEngine); "
        "false = every tp rank sends its whole hidden state to its peer (torch.distributed.pipelining: autoplan's "
        "runtime, torchtitan). Under sequence parallelism every runtime sends the rank's sequence shard.")
    p2p_overlap: bool | None = Field(
        default=True, description="Pipeline sends are asynchronous, overlapped with compute (their NCCL kernels "
        "still take SMs: overlap_interference); false = blocking p2p (Megatron-LM's and DeepSpeed's): a transfer "
        "starts only when the receiver posts it, so every received message is on the receiving stage's path; "
        "None = overlapped under the interleaved schedule only (Megatron-Core since 'Make overlap_p2p_comm the "
        "default', 4eeff55d, 2023-10; megatron/training/arguments.py turns it off without virtual stages).")
    grad_accum_fused: bool = Field(
        default=True, description="Weight-gradient GEMMs accumulate straight into the gradient buffer; false = "
        "each micro-batch's gradients are added into an fp32 buffer by a separate memory-bound pass (DeepSpeed).")
    grad_accum_cast_copy: bool = Field(
        default=False, description="The unfused accumulation pass first casts each 16-bit gradient to a "
        "temporary tensor in the buffer's dtype, then adds that into the buffer (DeepSpeed's BF16_Optimizer."
        "update_hp_grads: `hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype)...)`): the temporary is written and "
        "read once more per micro-batch; false = one fused read-add-write (Megatron v2's main_grad.add_). "
        "Only with grad_accum_fused false.")
    optimizer_separate_passes: bool = Field(
        default=False, description="The optimizer step runs Megatron-LM's Float16Optimizer passes beside the Adam "
        "kernel: zeroing the whole gradient buffer, casting 16-bit main grads to fp32, unscaling (fp16), and "
        "copying the fp32 master into the 16-bit weights (estimate.optimizer_time); false = one fused Adam "
        "that also writes the 16-bit copy.")
    flexible_rounds: bool = Field(
        default=True, description="The interleaved schedule may run m micro-batches in m // pp equal rounds longer "
        "than pp when pp does not divide m (pipeline.microbatch_group: torch.distributed.pipelining's "
        "Interleaved1F1B; Megatron-Core >= 0.10's --microbatch-group-size-per-virtual-pipeline-stage); false = "
        "m must be a multiple of pp (Megatron-LM before Megatron-Core 0.10).")
    short_1f1b: bool = Field(
        default=False, description="The 1F1B schedule runs with fewer micro-batches than pipeline stages, the "
        "pipeline never full (Megatron's forward_backward_pipelining_without_interleaving: `num_warmup_microbatches "
        "= min(pipeline_parallel_size - rank - 1, num_microbatches)`; DeepSpeed's TrainSchedule); false = m >= pp "
        "required (torch.distributed.pipelining's Schedule1F1B refuses fewer micro-batches than stages).")
    zero_stages: str = Field(
        default=ALL_ZERO_STAGES, pattern=r"^01?2?3?$",
        description="The ZeRO stages the stack runs, as digits in order, 0 (no sharding) always among them (`zero` "
        "must be one of them; the search tries only these): autoplan's runtime and FSDP2 stacks run all four; "
        "Megatron-Core has no ZeRO-2 (its distributed optimizer keeps the whole gradient buffer; ZeRO-3 is "
        "Megatron-FSDP); DeepSpeed's pipeline engine refuses ZeRO-2 and -3; Megatron-LM 2021 had no distributed "
        "optimizer.")
    schedules: str = Field(
        default=ALL_SCHEDULES,
        pattern=rf"^(none|({_SCHEDULE_ALT})(\+({_SCHEDULE_ALT}))*)$",
        description="The pipeline schedules the stack runs, joined by '+', or none (no pipeline parallelism): under "
        "pp > 1 `schedule` must be one of them; the search tries only these. torch.distributed.pipelining has all "
        "three; Megatron has 1F1B and the interleaved schedule (no GPipe); DeepSpeed's pipeline engine 1F1B only "
        "(its TrainSchedule).")
    seq_splits: str = Field(
        default=ALL_SEQ_SPLITS, pattern=r"^(none|sp|cp|sp\+cp)$",
        description="How the stack can split the sequence, 'sp+cp', 'sp', 'cp' or none (`sp` and `cp` > 1 must be "
        "among them; the search tries only these): sequence parallelism inside tensor parallelism (Megatron-LM "
        "from 2022-03) and context parallelism (Megatron-Core from 2023-08; torch's context_parallel).")
    recompute_modes: str = Field(
        default=ALL_RECOMPUTE_MODES, pattern=r"^(none|selective|full|selective\+full)$",
        description="The activation recomputation the stack has besides none, 'selective+full', 'selective', "
        "'full' or none (`recompute` must be among them; the search tries only these). Without selective, a "
        "stage that recomputes fully recomputes every layer it holds: autoplan's partial full recomputation "
        "(recompute_layers) recomputes a stage's other layers selectively. Megatron-LM checkpointed every layer "
        "(--checkpoint-activations) until the block method (2021-08) and selective recomputation (2022-05); "
        "DeepSpeed and Hugging Face models checkpoint whole layers.")
    partial_recompute: Literal["rest-selective", "rest-none", "every-nth", "off"] = Field(
        default="rest-selective", description="A stage that recomputes only its first k layers in full "
        "(recompute_layers): 'rest-selective' = its other layers recompute selectively (autoplan's runtime, "
        "runtime.parallelize.apply_recompute); 'rest-none' = they keep everything (Megatron's block method, "
        "--recompute-method block, from 2021-08: megatron/core/recompute.py checkpoints the first "
        "--recompute-num-layers of each chunk and runs the rest plainly); 'every-nth' = priced as rest-none, "
        "for a stack whose partial recomputation is every n-th block whole and the others plain (torchtitan's "
        "layer-selective AC, ac_freq): the same count per stage, which the search does not propose (it places the "
        "first k of each stage, the block method); 'off' = a stage recomputes every layer in full or none (Megatron-LM before "
        "2021-08, DeepSpeed, Hugging Face). 'rest-selective' needs selective among recompute_modes (without it "
        "partial full recomputation is off); 'off' needs recompute_modes without selective.")
    uneven_stages: bool = Field(
        default=True, description="Pipeline stages may hold different numbers of layers (an explicit layout, "
        "--uneven, the search's placement); false = layers split evenly over pp*vp stages, as Megatron-LM asserted "
        "until its uneven pipeline parallelism (2024-09, --decoder-first/last-pipeline-num-layers).")
    recompute_per_stage: bool = Field(
        default=True, description="Stages may recompute differently (autoplan's runtime applies each stage's own, "
        "runtime.parallelize.apply_recompute); false = one setting for every stage: nothing, selective, every "
        "layer in full, or the same first k layers of each stage in full, as Megatron's --recompute-granularity / "
        "--recompute-method / --recompute-num-layers (megatron/core/recompute.py: each model chunk recomputes its "
        "first N layers) and torchtitan's activation_checkpoint section apply it.")
    align_grad_reduce: bool = Field(
        default=False, description="Under the interleaved schedule, each model chunk's gradient reduction is "
        "launched pipeline-rank backward actions after the chunk's last backward, at the same time across the "
        "pipeline group (Megatron-Core's --align-grad-reduce, before 0.9 --delay-grad-reduce, on by default: "
        "schedules.py `grad_sync_microbatch_id = microbatch_id - pipeline_parallel_rank`); false = at the chunk's "
        "last backward (torch.distributed.pipelining's FSDP gradient sync). Prices only with overlap_grad_reduce "
        "and vp > 1 (estimate.chunk_sync_window).")
    loss_fusion: bool = Field(
        default=False, description="The LM head's vocab-parallel cross-entropy runs as Megatron-Core's fused "
        "kernels (--cross-entropy-loss-fusion; NeMo's cross_entropy_loss_fusion: true): megatron/core/fusions/"
        "fused_cross_entropy.py, three torch.compile'd functions (upcast + max, subtract + exp + sum, normalise) "
        "that move 22 bytes a logit where the eager one moves 38 (cost_models.profile.FUSED_CE_BYTES). autoplan's "
        "runtime computes the loss eagerly.")
    optimizer_dtype: Literal["fp32", "bf16"] = Field(
        default="fp32", description="Dtype of the optimizer's state: the master copy of 16-bit weights and Adam's "
        "two moments. 'bf16': all three in bf16, 6 bytes a parameter instead of 12, as apex's "
        "DistributedFusedAdam keeps them with dtype=bfloat16 (apex/contrib/optimizers/distributed_fused_adam.py: "
        "params_shard, exp_avg_shard and exp_avg_sq_shard are allocated in the optimizer's `dtype`; store_params "
        "defaults to true), which NeMo's `optim: {name: distributed_fused_adam, dtype: bf16}` runs (e.g. "
        "NeMo-Framework-Launcher 24.07 nemotron_340b.yaml). autoplan's runtime keeps fp32 state (torch's AdamW). "
        "How the master copy is held is `master_weights`.")
    master_weights: Literal["fp32", "bf16", "remainders", "in-place"] | None = Field(
        default=None, description="How the optimizer holds the master copy of 16-bit weights (none is held where "
        "the parameters are fp32). 'fp32': 4 bytes a parameter (Megatron's Float16OptimizerWithFloat16Params and "
        "distributed optimizer, DeepSpeed). 'bf16': a 16-bit master, 2 bytes (apex DistributedFusedAdam with "
        "store_params and a 16-bit dtype; Megatron's --main-params-dtype fp16). 'remainders': the fp32 master's "
        "low 16 bits beside the bf16 weights, 2 bytes (apex's store_param_remainders, which NeMo sets for "
        "optim.dtype fp32 over bf16 weights: nemo/collections/nlp/models/language_modeling/megatron_base_model.py "
        "`optim_dtype == torch.float32 and model_dtype == torch.bfloat16`; Megatron-Core's precision-aware "
        "optimizer under bf16, OptimizerConfig.store_param_remainders=True since f2ece182d8, 2025-02, TE >= 2.1). "
        "'in-place': no master, the 16-bit weights are stepped in place, 0 bytes (NeMo with optim.dtype equal to "
        "the weights' dtype: store_params=False). None: follows optimizer_dtype (fp32 -> 'fp32', bf16 -> 'bf16').")
    grad_sync_all_reduce: bool = Field(
        default=False, description="With ZeRO-1/2 the data-parallel gradients are still all-reduced whole (every "
        "rank receives the full reduced gradient, then steps only its shard and the parameters are all-gathered), "
        "instead of reduce-scattered: DeepSpeed's BF16_Optimizer under its pipeline engine.")
    sp_grads_coalesced: bool = Field(
        default=False, description="Under sequence parallelism the tp all-reduce of the partial gradients of "
        "replicated weights (norms, row-parallel biases) is one coalesced collective per step (Megatron's "
        "_allreduce_layernorm_grads); false = one per tensor (DTensor redistribution in autoplan's runtime and "
        "FSDP2).")
    autocast_fp32_params: bool = Field(
        default=True, description="16-bit training as autoplan's runtime runs it: fp32 parameters and gradients, "
        "the forward under torch.autocast (runtime.parallelize.apply_mixed_precision). Per micro-batch every GEMM "
        "weight is cast to 16 bits (and the copy kept for backward), every weight gradient cast to fp32 and added "
        "into .grad, the norms run in fp32 on the fp32 residual stream, and each linear reading a norm's output "
        "casts it again (cost_models.compute.autocast_terms; measured on an H200, session 12); false = 16-bit "
        "weights with fp32 master copies in the optimizer (Megatron-LM, DeepSpeed). No effect in fp32.")
    runtime_memory: bool = Field(
        default=True, description="The memory check prices what autoplan's runtime holds beyond the textbook "
        "(Megatron) per-rank memory: FSDP2 replicate's second parameter copy at ZeRO-0 with tp > 1, the "
        "unsharded parameter copy beside ZeRO-1/2's shard, experts whole on every tp rank and unsharded by ZeRO, "
        "FSDP2's copies of a tied LM head's own copy on the last pipeline stage (the copy itself is in every "
        "stack's count), a vocabulary-parallel embedding's whole gradient at ZeRO-0 (cost_models.estimate."
        "runtime_extra); and the tied embedding's all-reduce moves FSDP2's gradient shard under ZeRO >= 1 "
        "(estimate.tied_sync_bytes); false = the stack is other software (Megatron, DeepSpeed, torchtitan), "
        "priced as Megatron's memory model.")
    checkpoint_early_stop: bool | None = Field(
        default=None, description="Full recomputation runs under torch.utils.checkpoint without reentrance, which "
        "by default stops re-running a block once the last tensor its backward saved is back: a dense block's last "
        "GEMM (the MLP's output projection, whose output nothing saves) and the reduction after it are not run "
        "again (compute.early_stop_skips_last_gemm; measured FLOPs, session 21). true: autoplan's runtime "
        "(runtime.parallelize.apply_recompute) and torchtitan until 2025-08 (torch's checkpoint_wrapper, "
        "non-reentrant, torch's default early stop); false: a checkpoint that re-runs the whole forward "
        "(Megatron-LM's reentrant CheckpointFunction, DeepSpeed's activation checkpointing, torchtitan since its "
        "early_stop config defaulting to false, 25413d224, 2025-08-29). None: as "
        "`runtime_memory` says (true exactly for autoplan's runtime), the rule before the field existed.")

    cp_attention: Literal["ring", "all_gather", "all_gather_masked"] | None = Field(
        default=None, description="How context parallelism runs the attention core. 'ring': K and V travel round "
        "the cp ring, each step's transfer overlapped with the attention of the step before, fully masked "
        "chunks skipped (Megatron-Core with Transformer Engine; torch's ring attention, torchtitan); "
        "'all_gather': K and V all-gathered over the cp group before the attention and their gradients "
        "reduce-scattered after its backward, both exposed, only the causal chunks computed (Llama 3, "
        "arXiv 2407.21783 sec. 3.3.2); 'all_gather_masked': gathered as 'all_gather', then one masked SDPA per "
        "query chunk over the keys up to its end computes every score of those ((2cp+1)/(4cp) of the rank's "
        "queries against the whole sequence), and the gradients go back by an all-to-all and a sum (autoplan's runtime: runtime.parallelize.ContextParallelAttentionCore). None: as "
        "`runtime_memory` says ('all_gather_masked' exactly for autoplan's runtime, else 'ring').")

    @model_validator(mode="after")
    def _partial_vs_modes(self) -> TrainingSpec:
        if self.partial_recompute == "off" and "selective" in self.recompute_modes.split("+"):
            # the stage ILP has no family for "full on whole stages only" beside selective stages (no stack has it)
            raise SpecError("partial_recompute=off (every layer in full or none) beside selective recomputation is "
                            "not a stack autoplan can plan", f"recompute_modes={self.recompute_modes}",
                            "set partial_recompute=rest-none as well (Megatron's block method, which came before "
                            "selective recomputation) or keep recompute_modes=full")
        return self

    @model_validator(mode="after")
    def _remainders_need_bf16(self) -> TrainingSpec:
        if self.master_weights == "remainders" and self.dtype == "fp16":
            # an fp32 value splits into its bf16 head and 16 low bits; an fp16 weight is not the head of one
            raise SpecError("master_weights=remainders keeps the low 16 bits of an fp32 master beside bf16 weights",
                            "the weights are fp16 (dtype=fp16)", "use master_weights=fp32 or bf16, or dtype=bf16")
        return self

    @property
    def partial_rest(self) -> str | None:
        """What the layers after a stage's first k fully recomputed ones do: 'selective', 'none', or None where a
        stage recomputes all its layers in full or none (`partial_recompute`, resolved against recompute_modes)."""
        modes = self.recompute_modes.split("+")
        if "full" not in modes or self.partial_recompute == "off":
            return None
        if self.partial_recompute in ("rest-none", "every-nth"):
            return "none"
        return "selective" if "selective" in modes else None

    def p2p_overlapped(self, vp: int) -> bool:
        """`p2p_overlap`, resolved for `vp` virtual stages per pipeline rank."""
        return vp > 1 if self.p2p_overlap is None else self.p2p_overlap

    @property
    def cp_style(self) -> str:
        """`cp_attention`, resolved."""
        if self.cp_attention is not None:
            return self.cp_attention
        return "all_gather_masked" if self.runtime_memory else "ring"

    @property
    def recompute_stops_early(self) -> bool:
        """`checkpoint_early_stop`, resolved."""
        return self.runtime_memory if self.checkpoint_early_stop is None else self.checkpoint_early_stop

    @property
    def fused_kernels(self) -> bool:
        return self.kernels == "fused"

    @property
    def autocast(self) -> bool:
        """16-bit compute under torch.autocast over fp32 parameters (`autocast_fp32_params` in bf16 or fp16)."""
        return self.autocast_fp32_params and self.dtype in ("bf16", "fp16")

    @property
    def fp32_params(self) -> bool:
        """Parameters and their gradients are fp32 tensors: fp32 training, or `autocast`, whose 16-bit casts exist
        only inside the step."""
        return self.dtype in ("fp32", "tf32") or self.autocast

    @property
    def weight_bytes(self) -> int:
        """Bytes per parameter of the weights as held and moved (ZeRO-3's gathers): fp32 under `fp32_params`, else
        the 16-bit copies of Megatron-style mixed precision (whose fp32 master is optimizer state)."""
        return 4 if self.fp32_params else 2

    @property
    def master_kind(self) -> str | None:
        """How the master copy is held (`master_weights`, resolved); None where the parameters are fp32 already."""
        if self.fp32_params:
            return None
        return self.master_weights or ("bf16" if self.optimizer_dtype == "bf16" else "fp32")

    @property
    def master_bytes(self) -> int:
        """The optimizer's master copy per parameter (`master_kind`): none where the parameters are fp32 already."""
        return MASTER_BYTES[self.master_kind]

    @property
    def optimizer_state_bytes(self) -> int:
        """Optimizer state per parameter: the master copy (`master_bytes`) and Adam's two moments, 4 bytes each in
        fp32 (`optimizer_dtype`), 2 in bf16."""
        return self.master_bytes + (4 if self.optimizer_dtype == "bf16" else 8)

    @property
    def grad_dtype(self) -> str:
        """Dtype of the gradients held and reduced: fp32 under `fp32_params` (autoplan's runtime reduces the
        parameters' own fp32 gradients: DDP, and FSDP2 with no MixedPrecisionPolicy), else the reduce dtype
        (`grad_reduce_dtype`, by default the compute dtype; bf16 under fp8)."""
        if self.fp32_params:
            return "fp32"
        return self.grad_reduce_dtype or compute16(self.dtype)

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element held and reduced (`grad_dtype`)."""
        return DTYPE_BYTES[self.grad_dtype]

    selective_policy: Literal["attention_core", "every_other_matmul"] = Field(
        default="attention_core",
        description="What `recompute=selective` re-runs in the backward. 'attention_core': the attention core "
        "(Korthikanti et al. 2022's selective recomputation: Megatron-LM, and autoplan's runtime, which checkpoints "
        "the core); 'every_other_matmul': torchtitan's per-op selective checkpointing (SelectiveAC, `selective_ac_"
        "option = 'op'`), one checkpointed region per block that keeps the outputs of its matmuls and of the "
        "attention kernel except every second matmul, and re-runs everything else (the second matmuls, norms, "
        "activations, RoPE, and the collectives other than reduce-scatter).",
    )
    kernels: Literal["fused", "torch", "megatron"] = Field(
        default="fused",
        description="Kernel set: 'fused' = autoplan's Triton kernels as its runtime substitutes them (fused norms "
        "and activations; RoPE and the cross-entropy eager); 'torch' = eager PyTorch ops; 'megatron' = "
        "Megatron-LM/TE's (fused norms and "
        "activations, fp32 cross-entropy over materialised logits), used to model the published runs.",
    )


# ------------------------------------------------------------------------------ parallel configuration

_INT_KEYS = ("tp", "pp", "dp", "cp", "ep", "vp", "mbs", "zero")
_ALIASES = {"recomp": "recompute", "micro_batch": "mbs", "vpp": "vp"}


class ParallelConfig(_Frozen):
    """How the work is split. Printed and parsed as `tp=8,pp=8,dp=16,cp=1,ep=1,vp=3,mbs=1,...`."""

    tp: int = Field(default=1, ge=1, description="Tensor-parallel degree (innermost, inside a node).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel stages.")
    dp: int | None = Field(default=None, ge=1, description="Data-parallel degree; None = derived from world size.")
    cp: int = Field(default=1, ge=1, description="Context-parallel degree (sequence split across ranks).")
    ep: int = Field(default=1, ge=1, description="Expert-parallel degree; carved out of dp as in Megatron-LM.")
    vp: int = Field(default=1, ge=1, description="Virtual pipeline stages per rank (interleaved schedule).")
    mbs: int = Field(default=1, ge=1, description="Micro-batch size in sequences.")
    sp: bool = Field(default=False, description="Megatron sequence parallelism for norms/dropout inside TP.")
    zero: int = Field(default=0, ge=0, le=3, description="ZeRO stage: 1 optimizer, 2 +gradients, 3 +weights sharded.")
    recompute: Recompute = Field(default="none", description="Activation recomputation.")
    recompute_layers: int | None = Field(
        default=None, ge=0, description="With full recompute: layers per stage recomputed (None = all)."
    )
    schedule: Schedule = Field(default="1f1b", description="Pipeline schedule.")
    layout: str | None = Field(
        default=None, description="Explicit stage layout, Megatron-Core's string (E embedding, t block, L loss, "
        "| stage boundary; cost_models/layout.py); None = blocks spread evenly over pp*vp stages.")

    @model_validator(mode="after")
    def _schedule_vs_vp(self) -> ParallelConfig:
        if self.vp > 1 and self.schedule != "interleaved":
            object.__setattr__(self, "schedule", "interleaved")
        return self

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """Parse `tp=8,pp=2,sp=1,recompute=selective`; unknown keys and bad values raise ConfigError."""
        values: dict[str, object] = {}
        for raw in _items(text):
            if "=" not in raw:
                raise ConfigError(
                    "parallel configuration items are key=value", f"got {raw!r} in {text!r}", "write e.g. tp=8,pp=2"
                )
            key, val = raw.split("=", 1)
            key = _ALIASES.get(key.lower(), key.lower())
            if key not in cls.model_fields:
                raise ConfigError(
                    f"unknown parallel configuration key {key!r}",
                    f"in {text!r}",
                    "valid keys: " + ",".join(k for k in cls.model_fields),
                )
            if key in values:
                raise ConfigError(f"parallel configuration key {key!r} given twice", f"in {text!r}",
                                  f"give {key} once")
            values[key] = _parse_value(key, val)
        vp, sched = values.get("vp", 1), values.get("schedule")
        if isinstance(vp, int) and vp > 1 and sched not in (None, "interleaved"):
            # the model would quietly run the interleaved schedule instead of the one written
            raise ConfigError(f"vp>1 runs the interleaved schedule, not {sched}", f"vp={vp}, schedule={sched} in "
                              f"{text!r}", "drop vp (vp=1) to use that schedule, or write schedule=interleaved")
        try:
            return cls(**values)
        except SpecError:
            raise
        except Exception as e:  # pydantic.ValidationError: turn into one line
            raise ConfigError("invalid parallel configuration", f"{text!r}: {_first_error(e)}") from None

    def to_string(self) -> str:
        """The canonical string: every key, in DESIGN.md's order."""
        d = self.as_dict()
        return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in d.items() if v is not None)

    def as_dict(self) -> dict[str, object]:
        """The configuration as a mapping with the Plan's field names and types (`sp` is a bool, as in plan.json;
        only the configuration string writes it as 1/0)."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "cp": self.cp,
            "ep": self.ep,
            "vp": self.vp,
            "mbs": self.mbs,
            "sp": self.sp,
            "zero": self.zero,
            "recompute": self.recompute,
            "recompute_layers": self.recompute_layers,
            "schedule": self.schedule,
            **({"layout": self.layout} if self.layout else {}),
        }

    def __str__(self) -> str:
        return self.to_string()

    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def resolve(self, world_size: int) -> ParallelConfig:
        """Fill in dp from the world size, checking that the degrees multiply to it."""
        mp = self.model_parallel_size()
        if self.dp is None:
            if world_size % mp:
                raise ConfigError(
                    "world size must be a multiple of tp*pp*cp",
                    f"world={world_size}, tp*pp*cp={self.tp}*{self.pp}*{self.cp}={mp}",
                    "change tp/pp/cp or the GPU count",
                )
            return self.model_copy(update={"dp": world_size // mp})
        if mp * self.dp != world_size:
            raise ConfigError(
                "tp*pp*cp*dp must equal the world size",
                f"{self.tp}*{self.pp}*{self.cp}*{self.dp}={mp * self.dp} but the cluster has {world_size} GPUs",
                f"omit dp to derive it, or use --gpus {mp * self.dp}",
            )
        return self


def _items(text: str) -> list[str]:
    """The key=value items of a configuration string; a layout's own commas (Megatron writes `(tt|)*29,t|L`)
    stay with the layout: an item without '=' continues the layout item before it. Whitespace separates items as
    a comma does (`tp=2 pp=2` is two items, not `tp=2pp=2`); around '=' it is dropped (`tp = 2`)."""
    items: list[str] = []
    for raw in re.split(r"[,\s]+", re.sub(r"\s*=\s*", "=", text.strip())):
        if not raw:
            continue
        if "=" not in raw and items and items[-1].lower().startswith("layout="):
            items[-1] += "," + raw
        else:
            items.append(raw)
    return items


def _parse_value(key: str, val: str) -> object:
    if key in _INT_KEYS or key == "recompute_layers":
        try:
            return int(val)
        except ValueError:
            raise ConfigError(f"{key} must be an integer", f"got {key}={val}", f"write e.g. {key}=2") from None
    if key == "sp":
        low = val.lower()
        if low in ("1", "true", "on", "yes"):
            return True
        if low in ("0", "false", "off", "no"):
            return False
        raise ConfigError("sp must be 0 or 1", f"got sp={val}", "write sp=1 or sp=0")
    if key == "recompute":
        low = val.lower()
        if low in ("off", "0", "false"):
            return "none"
        if low not in ("none", "selective", "full"):
            raise ConfigError("recompute must be none|selective|full", f"got recompute={val}", "write recompute=full")
        return low
    if key == "layout":
        from .layout import normalize

        return normalize(val)
    if key == "schedule":
        low = val.lower().replace("-", "").replace("_", "")
        table = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved", "interleaved1f1b": "interleaved"}
        if low not in table:
            raise ConfigError("schedule must be gpipe|1f1b|interleaved", f"got schedule={val}", "write schedule=1f1b")
        return table[low]
    return val


def _first_error(e: Exception) -> str:
    errs = getattr(e, "errors", None)
    if callable(errs):
        first = errs()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        return f"{loc}: {first.get('msg')}"
    return str(e)


# ----------------------------------------------------------------------------------------- validation


def _nearest_zero(zero: int, stages: str) -> int:
    """The stack's ZeRO stage nearest `zero`, the lower one on a tie (less sharding, less communication)."""
    return min((int(c) for c in stages), key=lambda z: (abs(z - zero), z))


def _another_stack(knob: str, value: str, verb: str = "does run it") -> str:
    """The common end of a stack-capability fix: another stack, or the knob widened."""
    return f"another --stack (`autoplan stacks`), or --stack-set {knob}={value} for a stack that {verb}"


_EVEN_RULE = "this software stack splits the layers evenly over the pp*vp stages"
_EVEN_FIX = ("choose pp*vp dividing the layer count and drop --layout/--uneven, or --stack-set uneven_stages=true "
             "for a stack with uneven pipeline stages (Megatron-Core from 2024-09)")


def check_stack_runs(cfg: ParallelConfig, train: TrainingSpec, sizes: list[int] | None = None) -> None:
    """The configuration uses only what the software stack runs: its ZeRO stages, sequence splits, recomputation,
    stage layouts and pipeline schedules (TrainingSpec.zero_stages, .seq_splits, .recompute_modes,
    .uneven_stages, .schedules); each refusal names what to use instead. `sizes`: the blocks of each stage where
    known (None: placed later, by the search or a plan; check_config refuses an uneven split before)."""
    if str(cfg.zero) not in train.zero_stages:
        raise ConfigError(
            f"zero={cfg.zero} is not a ZeRO stage this software stack runs",
            f"the stack runs zero={', '.join(train.zero_stages)}",
            f"use zero={_nearest_zero(cfg.zero, train.zero_stages)}, "
            + _another_stack("zero_stages", "".join(sorted(set(train.zero_stages + str(cfg.zero))))),
        )
    splits = train.seq_splits.split("+")
    for name, used in (("sp", cfg.sp), ("cp", cfg.cp > 1)):
        if used and name not in splits:
            what = "sequence parallelism (sp=1)" if name == "sp" else f"context parallelism (cp={cfg.cp})"
            raise ConfigError(
                f"this software stack has no {what}",
                f"the stack splits the sequence with: {' and '.join(splits)}",
                f"use {'sp=0' if name == 'sp' else 'cp=1'}, "
                + _another_stack("seq_splits", "+".join(x for x in ("sp", "cp") if x in splits or x == name),
                                 "has it"),
            )
    # recompute_layers counts a pipeline rank's layers, ceil(k / vp) on each of its stages (estimate.even_layout)
    per_stage = None if cfg.recompute_layers is None else -(-cfg.recompute_layers // cfg.vp)
    check_recompute_runs(cfg.recompute, per_stage, max(sizes) if sizes else None, train)
    if sizes is not None:
        check_stage_sizes(sizes, train)
    if cfg.pp == 1:
        return
    runs = train.schedules.split("+")
    if runs == ["none"]:
        raise ConfigError("this software stack runs no pipeline parallelism", f"pp={cfg.pp}",
                          "use pp=1, " + _another_stack("schedules", "1f1b", "does run a pipeline"))
    if cfg.schedule not in runs:
        raise ConfigError(
            f"schedule={cfg.schedule} is not a pipeline schedule this software stack runs",
            f"the stack runs {', '.join(runs)}" + (f" (vp={cfg.vp} means the interleaved schedule)"
                                                   if cfg.vp > 1 else ""),
            f"use schedule={'1f1b' if '1f1b' in runs else runs[0]}{' and vp=1' if cfg.vp > 1 else ''}, "
            + _another_stack("schedules", "+".join(x for x in get_args(Schedule) if x in runs or x == cfg.schedule)),
        )


def check_stage_sizes(sizes: list[int], train: TrainingSpec) -> None:
    """Stages of `sizes` blocks are a layout the stack runs: any, or (uneven_stages false) the same number of
    blocks on every stage."""
    if train.uneven_stages or len(set(sizes)) <= 1:
        return
    raise ConfigError(_EVEN_RULE, f"stages of {min(sizes)} to {max(sizes)} layers", _EVEN_FIX)


def check_recompute_runs(mode: str, layers: int | None, blocks: int | None, train: TrainingSpec,
                         where: str = "a stage") -> None:
    """A stage (or every stage) recomputing `mode`, `layers` of its `blocks` in full, is what the stack runs
    (TrainingSpec.recompute_modes); `where` names the stage in the refusal."""
    modes = train.recompute_modes.split("+")
    partial = mode == "full" and layers is not None and blocks is not None and layers < blocks
    if mode == "none" or (mode in modes and not (partial and train.partial_rest is None)):
        return
    others = [m for m in ("none", "full", "selective") if m in modes or m == "none"]
    if partial:
        raise ConfigError(
            f"{where} recomputing {layers} of its {blocks} layers in full (the others "
            + ("selectively" if train.partial_recompute == "rest-selective" else "not at all")
            + ") is not a recomputation this software stack runs",
            f"the stack recomputes with: {train.recompute_modes}, partial_recompute={train.partial_recompute}",
            "recompute every layer in full (drop recompute_layers) or none, "
            + _another_stack("partial_recompute", "rest-none", "has Megatron's block method"),
        )
    # (a stack whose partial full recomputation is off has none beside selective: TrainingSpec._partial_vs_modes)
    widen = "selective+full" + (",partial_recompute=rest-none" if train.partial_recompute == "off" else "")
    raise ConfigError(
        f"recompute={mode} is not a recomputation this software stack runs"
        + ("" if where == "a stage" else f" ({where})"),
        f"the stack recomputes with: {train.recompute_modes}",
        f"use recompute={' or '.join(x for x in others if x != mode)}, "
        + _another_stack("recompute_modes", widen),
    )


def check_stages_run(stages: list[tuple[int, str, int]], train: TrainingSpec) -> None:
    """Stages given one by one, (blocks, recompute mode, fully recomputed blocks), are what the stack runs: each
    stage's recomputation (`check_recompute_runs`), their sizes (`check_stage_sizes`) and, where the stack applies
    one setting to every stage (recompute_per_stage false), one mode over the stages that hold blocks and, under
    full, the same first k blocks of each (min(k, blocks))."""
    for i, (n, mode, k) in enumerate(stages):
        check_recompute_runs(mode, k if mode == "full" else None, n, train, f"stage {i}")
    check_stage_sizes([n for n, _, _ in stages], train)
    held = [(i, n, mode, k if mode == "full" else 0) for i, (n, mode, k) in enumerate(stages) if n > 0]
    if train.recompute_per_stage or not held:
        return
    top = max(k for *_, k in held)
    mode0 = held[0][2]
    odd = next((s for s in held if s[2] != mode0 or s[3] != (min(s[1], top) if s[2] == "full" else 0)), None)
    if odd is None:
        return
    # the stage it disagrees with: the first one, or (the first being odd) one that recomputes the most
    ref = held[0] if odd is not held[0] else next(s for s in held if s[3] == top)
    what = [f"stage {j} {m}" + (f" ({kk} of {nn} layers)" if m == "full" else "")
            for j, nn, m, kk in sorted((ref, odd))]
    raise ConfigError(
        "this software stack applies one recomputation setting to every stage",
        f"{what[0]}, {what[1]}",
        "recompute alike in every stage (--parallel recompute=..., recompute_layers=k: the first k of each "
        "stage), or --stack-set recompute_per_stage=true (autoplan's runtime)",
    )


def check_config(
    cfg: ParallelConfig, model: ModelSpec, cluster: ClusterSpec, train: TrainingSpec, *, stage_layers: bool = True
) -> ParallelConfig:
    """Validate `cfg` against the model, cluster and training setup; returns it with dp resolved.

    Every rule raises a ConfigError naming the rule, the values and a way out. `stage_layers=False` skips the
    rule that layers divide evenly into pp*vp (plans with uneven stages check their own layout).
    """
    cfg = cfg.resolve(cluster.num_gpus)
    tp, pp, cp, dp, ep, vp = cfg.tp, cfg.pp, cfg.cp, int(cfg.dp or 1), cfg.ep, cfg.vp  # resolve() set dp
    if tp > cluster.gpus_per_node:
        raise ConfigError(
            "tp must stay inside a node",
            f"tp={tp} but a node of {cluster.name} has {cluster.gpus_per_node} GPUs",
            f"use tp<={cluster.gpus_per_node} and add pp or dp",
        )
    if model.num_attention_heads % tp:
        raise ConfigError(
            "attention heads must divide by tp",
            f"{model.name} has {model.num_attention_heads} heads, tp={tp}",
            "choose tp among the divisors of the head count",
        )
    if model.kv_heads % tp:
        raise ConfigError(
            "KV heads must divide by tp",
            f"{model.name} has {model.kv_heads} KV heads, tp={tp}",
            f"use tp<= {model.kv_heads} dividing it",
        )
    if model.moe is not None and model.moe.routed_scale != 1.0 and train.runtime_memory:
        raise ConfigError(
            "autoplan's runtime routes experts dropless without padding",
            f"moe.pad_to_capacity with capacity_factor={model.moe.capacity_factor:g} on the stack of autoplan's "
            "own runtime", "price Megatron's padded dispatch on its stack (--stack megatron-core), or drop "
            "pad_to_capacity",
        )
    if model.ffn % tp:
        raise ConfigError(
            "ffn_hidden_size must divide by tp", f"ffn={model.ffn}, tp={tp}", "choose tp dividing the FFN size"
        )
    # blocks per stage where known (None: the search or a plan places them later), for the recomputation checks
    sizes = [model.num_layers // (pp * vp)] * (pp * vp) if model.num_layers % (pp * vp) == 0 else None
    if cfg.layout is not None:
        from .layout import check_layout

        sizes = [s.blocks for s in check_layout(cfg.layout, num_layers=model.num_layers, pp=pp, vp=vp)]
    elif model.num_layers % (pp * vp) and not train.uneven_stages:  # whoever places the stages (TrainingSpec)
        raise ConfigError(_EVEN_RULE, f"{model.num_layers} layers do not divide into pp*vp={pp * vp} stages", _EVEN_FIX)
    elif stage_layers and model.num_layers % (pp * vp):
        raise ConfigError(
            "layers must divide evenly into pp*vp stages",
            f"{model.num_layers} layers, pp={pp}, vp={vp}",
            "pick pp*vp dividing the layer count, write the stages down (--layout, or --uneven first=N,last=M), or "
            "let `autoplan search` place uneven stages",
        )
    if pp * vp > model.num_layers and cfg.layout is None:
        raise ConfigError(
            "more pipeline stages than layers", f"pp*vp={pp * vp} > {model.num_layers} layers",
            "lower pp or vp, or give stages of only the embedding or the loss a --layout (e.g. 'E|(t|)*N,L')"
        )
    if vp > 1 and pp == 1:
        raise ConfigError("virtual stages need pp>1", f"vp={vp}, pp=1", "set vp=1 or pp>1")
    if cfg.schedule == "interleaved" and vp == 1:
        raise ConfigError("the interleaved schedule needs vp>1", f"vp={vp}", "set vp>=2 or schedule=1f1b")
    seq = train.seq_length
    if seq > model.max_seq_length and model.position == "learned":
        raise ConfigError(
            "sequence longer than the learned positions",
            f"seq={seq} > max_seq_length={model.max_seq_length}",
            "shorten --seq-len or raise max_seq_length",
        )
    if cp > 1 and seq % (2 * cp):
        raise ConfigError(
            "sequence must divide by 2*cp (load-balanced causal chunks)",
            f"seq={seq}, cp={cp}",
            "choose cp so that seq % (2*cp) == 0",
        )
    if cfg.sp and (seq // cp) % tp:
        raise ConfigError(
            "with sp, the sequence per cp rank must divide by tp",
            f"seq/cp={seq // cp}, tp={tp}",
            "choose tp dividing the sequence, or sp=0",
        )
    if cfg.sp and tp == 1:
        raise ConfigError("sequence parallelism needs tp>1", "sp=1 with tp=1", "set sp=0 or tp>1")
    if train.global_batch_size % (dp * cfg.mbs):
        raise ConfigError(
            "global batch must divide by dp*mbs",
            f"batch={train.global_batch_size}, dp={dp}, mbs={cfg.mbs}",
            f"use a batch that is a multiple of {dp * cfg.mbs}, or lower mbs/dp",
        )
    check_stack_runs(cfg, train, sizes)
    n_micro = train.global_batch_size // (dp * cfg.mbs)
    if pp > 1 and cfg.schedule == "1f1b" and n_micro < pp and not train.short_1f1b:
        raise ConfigError(
            "the 1F1B schedule of this stack needs at least pp micro-batches per step",
            f"{n_micro} micro-batches per step, pp={pp}",
            "raise the global batch, lower mbs or dp, or use schedule=gpipe (Megatron's and DeepSpeed's 1F1B run "
            "fewer: --stack-set short_1f1b=true prices such a run)",
        )
    if cfg.schedule == "interleaved" and not interleaved_rounds_fit(pp, n_micro, train.flexible_rounds):
        if not train.flexible_rounds:
            raise ConfigError(
                "the interleaved schedule of this stack needs the micro-batch count to be a multiple of pp "
                "(Megatron-LM before Megatron-Core 0.10)",
                f"{n_micro} micro-batches per step, pp={pp}",
                f"use a global batch that gives a multiple of {pp} micro-batches, schedule=1f1b, or "
                "--stack-set flexible_rounds=true for a Megatron-Core >= 0.10 or torch pipelining run",
            )
        ok = [k for k in range(max(pp, n_micro - 2 * pp), n_micro + 2 * pp + 1) if interleaved_rounds_fit(pp, k)]
        near = ", ".join(str(k) for k in sorted(ok, key=lambda k: (abs(k - n_micro), k))[:3])
        raise ConfigError(
            "the interleaved schedule runs the micro-batches in equal rounds of at least pp: m // pp rounds must "
            "divide m (torch.distributed.pipelining's Interleaved1F1B; Megatron-Core's micro-batch group)",
            f"{n_micro} micro-batches per step, pp={pp}",
            f"use a global batch that gives {near} micro-batches (global batch = m x dp x mbs), or schedule=1f1b",
        )
    if ep > 1:
        if not model.is_moe:
            raise ConfigError("ep>1 needs a MoE model", f"{model.name} is dense, ep={ep}", "set ep=1")
        if model.moe.num_experts % ep:
            raise ConfigError(
                "experts must divide by ep", f"{model.moe.num_experts} experts, ep={ep}", "choose ep dividing it"
            )
        if dp % ep:
            raise ConfigError(
                "ep must divide dp (expert parallelism is carved out of data parallelism)",
                f"dp={dp}, ep={ep}",
                "choose ep dividing dp",
            )
    if cfg.recompute_layers is not None and cfg.recompute != "full":
        raise ConfigError(
            "recompute_layers applies to full recomputation only",
            f"recompute={cfg.recompute}",
            "set recompute=full or drop recompute_layers",
        )
    # recompute_layers counts a pipeline rank's layers (estimate.even_layout)
    rank_blocks = max(sum(sizes[r::pp]) for r in range(pp)) if sizes else model.num_layers // (pp * vp) * vp
    if cfg.recompute_layers is not None and cfg.recompute_layers > rank_blocks:
        raise ConfigError(
            "recompute_layers exceeds the layers of a pipeline rank",
            f"recompute_layers={cfg.recompute_layers}, the most layers a rank holds={rank_blocks}",
            "lower recompute_layers",
        )
    if cfg.zero > 0 and dp * cp == 1:
        raise ConfigError("ZeRO needs dp>1", f"zero={cfg.zero}, dp={dp}", "set zero=0 or dp>1")
    return cfg
