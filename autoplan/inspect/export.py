"""`autoplan export plan.json --format megatron|torchtitan`: the same plan as Megatron-LM flags or a torchtitan
TOML config, for users who keep those runtimes.

What a framework cannot express is not silently dropped: it comes back in `warnings` (printed to stderr by the
CLI), e.g. a per-stage recomputation pattern Megatron has no flag for.
"""

from __future__ import annotations

import shlex

from ..cost_models.compute import selective_is_free
from ..cost_models.estimate import num_microbatches
from ..cost_models.pipeline import microbatch_group
from ..plan import Plan
from .export_numerics import (
    SQUARED_RELU_WARNING,
    layer_pattern,
    megatron_model_numerics,
    rotary_base_flag,
    titan_model_notes,
)

# ------------------------------------------------------------------------------------------- Megatron-LM


def _layers_per_rank(plan: Plan) -> list[list[int]]:
    """Layers of each pipeline rank's virtual stages."""
    out: list[list[int]] = [[] for _ in range(plan.parallel.pp)]
    for s in plan.stages:
        out[s.pp_rank].append(s.num_layers)
    return out


def _megatron_layout(plan: Plan, warnings: list[str]) -> list[tuple[str, object]]:
    """Pipeline layout flags: even stages, interleaving, or uneven first/last pipeline ranks."""
    cfg = plan.parallel
    flags: list[tuple[str, object]] = []
    sizes = [s.num_layers for s in plan.stages]
    even = len(set(sizes)) == 1
    if cfg.pp == 1:
        return flags
    if even:
        if cfg.vp > 1:
            flags.append(("--num-layers-per-virtual-pipeline-stage", sizes[0]))
        return flags
    per_rank = _layers_per_rank(plan)
    first, last, middle = per_rank[0], per_rank[-1], per_rank[1:-1]
    mid_sizes = {n for r in middle for n in r}
    expressible = (len(set(first)) == 1 and len(set(last)) == 1 and len(mid_sizes) <= 1
                   and min(first + last) > 0)  # a stage of only the embedding or loss needs the layout string
    if expressible:
        mid = next(iter(mid_sizes)) if mid_sizes else None
        # Megatron splits the first/last pipeline rank's layers evenly over its virtual stages and the rest
        # evenly over the middle ranks (get_transformer_layer_offset).
        if cfg.vp > 1:
            flags.append(("--num-virtual-stages-per-pipeline-rank", cfg.vp))
        if mid is None or first[0] != mid:
            flags.append(("--decoder-first-pipeline-num-layers", sum(first)))
        if mid is None or last[0] != mid:
            flags.append(("--decoder-last-pipeline-num-layers", sum(last)))
        return flags
    # Not first/last-uneven: Megatron-Core's explicit layout string alone (it implies the virtual stage count;
    # Megatron refuses it beside --num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-...).
    # The plan's own (compact, same grammar) layout string when it has one.
    flags.append(("--pipeline-model-parallel-layout", cfg.layout or megatron_layout_string(plan)))
    warnings.append("the stage layout is not uneven only at the first/last pipeline rank; exported as "
                    "--pipeline-model-parallel-layout (Megatron-Core >= 0.13), stages in model order")
    return flags


def megatron_layout_string(plan: Plan) -> str:
    """Megatron-Core's layout string for the plan's stages in model order: E embedding, t a transformer layer,
    L the loss/head, | between virtual stages (megatron/core/transformer/pipeline_parallel_layer_layout.py)."""
    return "|".join(("E" if s.has_embedding else "") + "t" * s.num_layers + ("L" if s.has_head else "")
                    for s in plan.stages)


def _cp_warning(plan: Plan, tool: str, stack: str, warnings: list[str]) -> None:
    """Both tools run context parallelism as ring attention; a plan priced otherwise (autoplan's runtime gathers K
    and V, exposed, and computes its masked query chunks against their key prefixes: TrainingSpec.cp_attention)
    predicts another step time there."""
    if plan.training.cp_style != "ring":
        warnings.append(f"the plan prices context parallelism as cp_attention={plan.training.cp_style} (K and V "
                        f"all-gathered before the attention, exposed); {tool} passes them round a ring behind the "
                        f"attention and skips the masked chunks: a different step time (estimate the plan with "
                        f"--stack {stack} to see it)")


def _megatron_recompute(plan: Plan, warnings: list[str]) -> list[tuple[str, object]]:
    modes = {s.recompute for s in plan.stages}
    if modes == {"none"}:
        return []
    if len(modes) > 1:
        warnings.append(f"stages recompute differently ({', '.join(sorted(modes))}); Megatron applies one mode to "
                        "all stages: exported the strongest")
    mode = "full" if "full" in modes else "selective"
    if "selective" in modes and plan.training.selective_policy != "attention_core":
        warnings.append("the plan's selective recomputation is torchtitan's per-op policy (selective_policy="
                        f"{plan.training.selective_policy}); Megatron's selective granularity recomputes the "
                        "attention core only: a different step time and memory (re-plan with a Megatron --stack)")
    if mode == "selective":
        return [("--recompute-granularity", "selective")]
    full = [s for s in plan.stages if s.recompute == "full"]
    if all(s.recompute_layers >= s.num_layers for s in full):
        # Every layer recomputes: uniform, one layer per checkpoint (what Narayanan et al. 2021 ran).
        return [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                ("--recompute-num-layers", 1)]
    ks = {s.recompute_layers for s in full}
    if len(ks) > 1:
        warnings.append(f"stages recompute different numbers of layers ({sorted(ks)}); Megatron's block method "
                        "takes one number per stage: exported the largest")
    # autoplan's partial full recompute re-runs the attention core of a stage's other layers (selective:
    # estimate.stage_cost, runtime.parallelize.apply_recompute); Megatron's block method leaves them whole
    # (partial_recompute=rest-none, as the Megatron stacks price it), which is the same where selective
    # recomputation does nothing (a flash kernel whose outputs are kept)
    rest = max(s.num_layers - s.recompute_layers for s in full)
    if plan.training.partial_rest == "selective" and not selective_is_free(plan.training):
        warnings.append(f"the plan recomputes the attention core (selective) of up to {rest} layer(s) per stage "
                        f"beyond the {max(ks)} it recomputes in full; Megatron's block method recomputes nothing "
                        "there: they keep their whole activations, more memory than planned (not checked) and a "
                        "little less time")
    return [("--recompute-granularity", "full"), ("--recompute-method", "block"),
            ("--recompute-num-layers", max(ks))]


def _megatron_model(plan: Plan, warnings: list[str]) -> list[tuple[str, object]]:
    m, tr = plan.model, plan.training
    numerics = megatron_model_numerics(plan, warnings)  # a Hugging Face config's own; None for a zoo model
    f: list[tuple[str, object]] = [
        ("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads), ("--ffn-hidden-size", m.ffn),
        ("--seq-length", tr.seq_length), ("--max-position-embeddings", m.max_seq_length),
        ("--vocab-size", m.vocab_size),
    ]
    if m.kv_heads != m.num_attention_heads:
        f += [("--group-query-attention", None), ("--num-query-groups", m.kv_heads)]
    if m.head_dim is not None:
        f.append(("--kv-channels", m.head_dim))
    if numerics is None and m.activation == "swiglu":
        f.append(("--swiglu", None))
    elif numerics is None and m.activation == "relu":
        warnings.append(SQUARED_RELU_WARNING)
        f.append(("--squared-relu", None))
    elif numerics is None and m.activation == "relu2":
        f.append(("--squared-relu", None))
    if m.norm == "rmsnorm":
        f.append(("--normalization", "RMSNorm"))
    if m.position == "rope":
        f.append(("--position-embedding-type", "rope"))
        if numerics is None:  # a zoo model: its spec's rotary base (a config's comes with its numerics)
            f.append(rotary_base_flag(m.rope_theta, warnings))
    elif m.position == "alibi":
        warnings.append("ALiBi positions: Megatron-LM has none (Megatron-DeepSpeed's --position-embedding-type alibi "
                        "does); the command runs learned absolute positions, a little more memory and no bias add")
    if not m.tie_embeddings:
        f.append(("--untie-embeddings-and-output-weights", None))
    if numerics is None:
        if not m.has_bias:
            f.append(("--disable-bias-linear", None))
        f += [("--hidden-dropout", m.dropout), ("--attention-dropout", m.dropout)]
    if m.moe is not None:
        f += [("--num-experts", m.moe.num_experts), ("--moe-router-topk", m.moe.top_k)]
        if m.moe.expert_ffn_hidden_size:
            f.append(("--moe-ffn-hidden-size", m.moe.expert_ffn_hidden_size))
        bits = [int(m.is_moe_layer(i)) for i in range(m.num_layers)]
        if bits == [int(i % m.moe.every_n_layers == 0) for i in range(m.num_layers)]:  # Megatron's int N
            if m.moe.every_n_layers > 1:
                f.append(("--moe-layer-freq", m.moe.every_n_layers))
        else:  # another first MoE layer (Hugging Face's and DeepSpeed's n-1): the per-layer list
            f.append(("--moe-layer-freq", layer_pattern(bits)))
        if m.moe.pad_to_capacity and m.moe.capacity_factor > 1:
            f += [("--moe-expert-capacity-factor", m.moe.capacity_factor), ("--moe-pad-expert-input-to-capacity", None)]
        # The cost model prices expert routing as all-to-all (cost_models/comm.py); Megatron's default differs.
        f.append(("--moe-token-dispatcher-type", "alltoall"))
    if numerics is not None:  # the config's own flags replace any the shape implied (e.g. --moe-layer-freq)
        names = {k for k, _ in numerics}
        f = [x for x in f if x[0] not in names] + numerics
    return f


def _megatron_sharding(plan: Plan, warnings: list[str]) -> list[tuple[str, object]]:
    """ZeRO stage -> Megatron's optimizer/FSDP flags."""
    zero = plan.parallel.zero
    if zero == 0:
        return []
    if zero == 3:
        # Megatron-FSDP shards parameters, gradients and optimizer state (optim_grads_params); Torch-FSDP2 in
        # Megatron refuses expert parallelism and the distributed optimizer, Megatron-FSDP takes both.
        return [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads_params"),
                ("--use-distributed-optimizer", None), ("--ckpt-format", "fsdp_dtensor")]
    if zero == 2:
        warnings.append("zero=2: Megatron's distributed optimizer shards optimizer state and reduce-scatters "
                        "gradients, but keeps the full gradient buffer (the plan assumed it sharded)")
    return [("--use-distributed-optimizer", None)]


def _megatron_optimizer_state(plan: Plan, warnings: list[str]) -> list[tuple[str, object]]:
    """Bf16 moments or a 2-byte master -> Megatron-Core's precision-aware optimizer (TransformerEngine's FusedAdam),
    which needs the distributed optimizer (megatron/core/optimizer/__init__.py: "--use-precision-aware-optimizer
    only supported with distributed optimizer"), and holds the master as `precision_aware_master` says (no flag
    turns the bf16 remainders off). Where the plan holds its master otherwise, the warning says by how much."""
    from autoplan.cost_models.specs import MASTER_BYTES

    from .megatron_import import precision_aware_master

    tr = plan.training
    master = tr.master_kind
    if tr.optimizer_dtype != "bf16" and master not in ("bf16", "remainders"):
        if master == "in-place":
            warnings.append("master_weights=in-place: Megatron-Core keeps a master copy (fp32, or remainders with "
                            "--use-precision-aware-optimizer): exported with fp32, 4 bytes a parameter more optimizer "
                            "state than planned, before ZeRO's sharding")
        return []
    if plan.parallel.zero == 0:
        warnings.append(f"optimizer_dtype={tr.optimizer_dtype}, master_weights={master}: Megatron-Core holds 16-bit "
                        "optimizer state only with the distributed optimizer (zero >= 1); exported with fp32 state, "
                        f"{12 - tr.optimizer_state_bytes} bytes a parameter more than planned")
        return []
    flags: list[tuple[str, object]] = [("--use-precision-aware-optimizer", None)]
    if tr.optimizer_dtype == "bf16":
        flags += [("--exp-avg-dtype", "bf16"), ("--exp-avg-sq-dtype", "bf16")]
    held = precision_aware_master(tr.dtype, master == "bf16")
    if held == "bf16":
        flags.append(("--main-params-dtype", "fp16"))
    extra = MASTER_BYTES[held] - MASTER_BYTES[master]
    if extra:
        warnings.append(f"master_weights={master}: Megatron-Core's precision-aware optimizer holds the master "
                        f"{'as 16-bit remainders' if held == 'remainders' else 'in ' + held}: {abs(extra)} bytes a "
                        f"parameter {'more' if extra > 0 else 'less'} optimizer state than planned, before ZeRO's "
                        "sharding")
    return flags


# Megatron-LM's validate_args: with tensor or context parallelism on GPUs before Blackwell (compute capability
# < 10) the launch must set CUDA_DEVICE_MAX_CONNECTIONS=1 so communication kernels are scheduled in order;
# (Megatron-)FSDP refuses that value.
_ARCH_MAJOR = {"a100-40g": 8, "a100-80g": 8, "h100-sxm": 9, "h200": 9, "b200": 10}


def megatron_arch(plan: Plan) -> int:
    """The cluster GPU's compute-capability major (9, Hopper, for an inline GPU table)."""
    return _ARCH_MAJOR.get(plan.cluster.gpu.name, 9)


def megatron_env(plan: Plan) -> dict[str, str]:
    cfg = plan.parallel
    arch = megatron_arch(plan)
    if (cfg.tp > 1 or cfg.cp > 1) and cfg.zero < 3 and arch < 10:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def megatron_flags(plan: Plan) -> tuple[list[tuple[str, object]], list[str]]:
    """(flag, value-or-None) pairs in a readable order, and warnings."""
    cfg, tr = plan.parallel, plan.training
    warnings: list[str] = []
    f: list[tuple[str, object]] = [
        ("--tensor-model-parallel-size", cfg.tp),
        ("--pipeline-model-parallel-size", cfg.pp),
    ]
    f += _megatron_layout(plan, warnings)
    if cfg.sp:
        f.append(("--sequence-parallel", None))
    if cfg.cp > 1:
        f.append(("--context-parallel-size", cfg.cp))
        _cp_warning(plan, "Megatron-Core's (Transformer Engine)", "megatron-core", warnings)
    if plan.model.is_moe:
        f.append(("--expert-model-parallel-size", cfg.ep))
    f += [("--micro-batch-size", cfg.mbs), ("--global-batch-size", tr.global_batch_size)]
    f += _megatron_recompute(plan, warnings)
    f += _megatron_sharding(plan, warnings)
    f += _megatron_optimizer_state(plan, warnings)
    if cfg.schedule == "gpipe" and cfg.pp > 1:
        warnings.append("Megatron-LM has no GPipe schedule; it will run 1F1B (less activation memory)")
    if cfg.schedule == "interleaved" and cfg.vp > 1:
        group = microbatch_group(cfg.pp, num_microbatches(cfg, tr))
        if group != cfg.pp:  # rounds longer than pp (pipeline.microbatch_group): Megatron-Core >= 0.10
            f.append(("--microbatch-group-size-per-virtual-pipeline-stage", group))
    if tr.dtype == "bf16":
        f.append(("--bf16", None))
    elif tr.dtype == "fp16":
        f.append(("--fp16", None))
    elif tr.dtype == "fp8":
        f += [("--bf16", None), ("--fp8-format", "hybrid")]
    # What the plan's cost assumed, stated rather than left to Megatron's defaults: gradients reduced in the
    # training dtype unless the plan says fp32 (Megatron reduces its fp32 main grads unless
    # --grad-reduce-in-bf16), the attention kernel, and (below) the MoE dispatcher.
    reduce = tr.grad_dtype  # fp32 on the autoplan stack (autocast over fp32 parameters): Megatron's default
    if reduce == "bf16":
        f.append(("--grad-reduce-in-bf16", None))
    elif reduce == "fp16":
        warnings.append("the plan reduces gradients in fp16; Megatron has no fp16 gradient reduce: it reduces "
                        "the fp32 main grads (twice the data-parallel bytes the plan assumed)")
    f.append(("--attention-backend", "flash" if tr.flash_attention else "unfused"))
    if tr.overlap_grad_reduce and (cfg.dp or 1) * cfg.cp > 1:
        f.append(("--overlap-grad-reduce", None))
        if cfg.vp > 1 and not tr.align_grad_reduce:
            # the plan priced each chunk's reduction launched at its last backward (estimate.chunk_sync_launches);
            # Megatron aligns the launches across the pipeline group unless told not to
            f.append(("--no-align-grad-reduce", None))
    if tr.overlap_param_gather and cfg.zero in (1, 2):
        f.append(("--overlap-param-gather", None))
    if tr.tp_comm_overlap and cfg.tp > 1:
        f.append(("--tp-comm-overlap", None))
    if tr.loss_fusion:  # megatron/core/fusions/fused_cross_entropy.py (TrainingSpec.loss_fusion)
        f.append(("--cross-entropy-loss-fusion", None))
    if not tr.grad_accum_fused:  # the plan priced 16-bit weight gradients added to the fp32 buffer apart
        f.append(("--no-gradient-accumulation-fusion", None))
    if cfg.pp > 1 and cfg.vp > 1 and not tr.p2p_overlapped(cfg.vp):
        # Megatron overlaps p2p under the interleaved schedule by default (TrainingSpec.p2p_overlap); the plan
        # priced blocking sends. (Without virtual stages Megatron blocks whatever the plan's stack did: a stack
        # property, as its kernels are, which `autoplan show --stack megatron-core` prices.)
        f.append(("--no-overlap-p2p-communication", None))
    f += _megatron_model(plan, warnings)
    return f, warnings


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def export_megatron(plan: Plan, script: str = "pretrain_gpt.py") -> dict:
    flags, warnings = megatron_flags(plan)
    args: list[str] = []
    for k, v in flags:
        args.append(k)
        if v is not None:
            args.append(_fmt(v))
    cl = plan.cluster
    env = megatron_env(plan)
    launch = "".join(f"{k}={v} " for k, v in env.items())
    launch += f"torchrun --nnodes {cl.num_nodes} --nproc-per-node {cl.gpus_per_node} {script}"
    lines = [launch]
    for k, v in flags:
        lines.append(f"    {k}" + ("" if v is None else f" {shlex.quote(_fmt(v))}"))
    command = " \\\n".join(lines)
    return {"format": "megatron", "plan": plan.short_hash, "args": args,
            "flags": {k: (True if v is None else v) for k, v in flags},
            "launch": {"nnodes": cl.num_nodes, "nproc_per_node": cl.gpus_per_node}, "env": env,
            "command": command, "warnings": warnings}


# -------------------------------------------------------------------------------------------- torchtitan
#
# torchtitan >= 0.3 configures a run with Python: `--module M --config F` calls the function F of M (or of
# M.config_registry), which returns a `Trainer.Config`; there is no TOML file any more. 0.2.x read a TOML file
# (`--job.config_file`). Both are exported from the same settings; `version` picks the form.

TORCHTITAN_VERSIONS = ("0.3", "0.2")

# torchtitan 0.3's name of the LM head module (0.2 called it `output`)
TITAN_HEAD = "lm_head"
# torchtitan's registered Llama 3 trainer configs (torchtitan/models/llama3/config_registry.py) and the
# model flavours behind them (torchtitan/models/llama3/__init__.py).
_TITAN_CONFIGS = {"llama3-8b": ("llama3", "llama3_8b", "8B"), "llama3-70b": ("llama3", "llama3_70b", "70B"),
                  "llama3-405b": ("llama3", "llama3_405b", "405B")}
# The rotary base of every llama3 flavour (torchtitan/models/llama3/__init__.py: rope_theta=500000 for 8B, 70B, 405B)
_TITAN_ROPE_THETA = 500000.0
# TrainingConfig.mixed_precision_param is Literal["bfloat16", "float32"]; mixed_precision_reduce is
# Literal["float32"] (torchtitan/config/configs.py, 0.2.2 and 0.3.0).
_TITAN_PARAM_DTYPE = {"bf16": "bfloat16", "fp32": "float32", "tf32": "float32", "fp16": "bfloat16",
                      "fp8": "bfloat16"}
_TITAN_SCHEDULE = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}


def _titan_stage_layout(plan: Plan, head: str) -> dict[str, object]:
    """The plan's pipeline stages as torchtitan counts them. torchtitan treats the embedding and the output
    head as `first/last_stage_less_layers` extra layers (distributed/pipeline_parallel.py
    _generate_llm_fqn_per_model_part): with k layers in every middle stage, stage 0 holding n0 and the last
    nL, layers_per_stage=k with first/last less layers k-n0 and k-nL reproduces the plan exactly. Other
    layouts are given as explicit module lists per stage."""
    sizes = [s.num_layers for s in plan.stages]
    middle = set(sizes[1:-1]) or {max(sizes)}
    if len(middle) == 1:
        k = next(iter(middle))
        if sizes[0] <= k and sizes[-1] <= k:
            return {"pipeline_parallel_layers_per_stage": k, "pipeline_parallel_first_stage_less_layers": k - sizes[0],
                    "pipeline_parallel_last_stage_less_layers": k - sizes[-1]}
    return {"module_fqns_per_model_part": _titan_stage_layout_explicit(plan, head)}


def titan_sac_counts(n: int, chunks: list[tuple[int, int]]) -> list[int]:
    """The blocks torchtitan 0.2's layer-selective AC (`selective_ac_option = "n"`) checkpoints in each model chunk,
    `chunks` being (pipeline rank, blocks) in stage order: one counter per process runs across a rank's chunks and
    checkpoints the blocks it reaches at multiples of n (activation_checkpoint.py at v0.2.2, `_layer_sac_count %
    ac_freq == 0`), so a chunk after c blocks on its rank holding b checkpoints floor((c + b) / n) - floor(c / n)."""
    seen: dict[int, int] = {}
    out = []
    for rank, b in chunks:
        c = seen.get(rank, 0)
        out.append((c + b) // n - c // n)
        seen[rank] = c + b
    return out


def titan_layer_sac(plan: Plan) -> int | None:
    """The n of torchtitan 0.2's layer-selective AC (`selective_ac_option = "n"`) that checkpoints as many blocks
    of each stage as the plan recomputes in full, the others plain; None where no n does. torchtitan counts the
    blocks it wraps in one per-process counter, across a rank's model chunks in stage order, and checkpoints
    those whose count is a multiple of n (activation_checkpoint.py at v0.2.2, `_layer_sac_count % ac_freq == 0`):
    a chunk after c blocks on its rank holding b checkpoints floor((c + b) / n) - floor(c / n). The plan must
    leave its other blocks plain (partial_recompute rest-none or every-nth, not autoplan's rest-selective)."""
    stages = plan.stages
    if {s.recompute for s in stages} != {"full"} or plan.training.partial_rest != "none":
        return None
    if all(s.recompute_layers >= s.num_layers for s in stages):
        return None  # every block: mode full
    ordered = sorted(stages, key=lambda s: s.index)
    want = [min(s.recompute_layers, s.num_layers) for s in ordered]
    for n in range(2, max(s.num_layers for s in stages) + 2):
        if titan_sac_counts(n, [(s.pp_rank, s.num_layers) for s in ordered]) == want:
            return n
    return None


def _titan_recompute(plan: Plan, warnings: list[str], version: str = "0.3") -> str:
    """'none' | 'selective' | 'full' | 'layer:n' (0.2's layer-selective AC) for the whole model (torchtitan
    applies one policy to every block)."""
    modes = {s.recompute for s in plan.stages}
    if modes == {"none"}:
        return "none"
    if modes == {"selective"} and plan.training.selective_policy != "every_other_matmul":
        warnings.append("the plan's selective recomputation re-runs the attention core (selective_policy="
                        f"{plan.training.selective_policy}); torchtitan's SelectiveAC keeps the matmul and attention "
                        "outputs except every second matmul and re-runs the rest: a different step time and memory "
                        "(estimate the plan with --stack torchtitan to see them)")
    if "full" in modes:
        full = [s for s in plan.stages if s.recompute == "full"]
        if len(modes) > 1:
            warnings.append(f"stages recompute differently ({', '.join(sorted(modes))}); torchtitan applies one "
                            "policy to all blocks: exported full recomputation everywhere")
        elif not all(s.recompute_layers >= s.num_layers for s in full):
            n = titan_layer_sac(plan)
            if n is not None and version == "0.2":
                return f"layer:{n}"
            frac = sum(s.recompute_layers for s in full) / sum(s.num_layers for s in full)
            why = ("torchtitan 0.3 has no layer-selective AC (removed in 114151ad4, 2026-03; "
                   "--torchtitan-version 0.2 writes it)" if n is not None else
                   "torchtitan recomputes some blocks only as every n-th block (layer-selective AC, 0.2), and no n "
                   "gives this plan's count on every stage" if plan.training.partial_rest == "none" else
                   "torchtitan's layer-selective AC (0.2) leaves the other blocks plain, where the plan recomputes "
                   "their attention core")
            warnings.append(f"the plan recomputes {frac:.0%} of the layers in full; {why}: exported full "
                            "recomputation of every block (slower than planned)")
        if version == "0.3" and plan.training.recompute_stops_early:
            warnings.append("the plan priced full recomputation stopping before each block's last GEMM (torch's "
                            "early stop); torchtitan 0.3's FullAC re-runs the whole block (early_stop=False): "
                            "slower than planned (estimate with --stack torchtitan for its price)")
        return "full"
    return "selective"


def torchtitan_settings(plan: Plan, version: str = "0.3") -> tuple[dict[str, dict], list[str]]:
    """torchtitan config sections (training, parallelism, activation_checkpoint, model) and warnings naming
    everything the plan assumes that torchtitan cannot express."""
    if version not in TORCHTITAN_VERSIONS:
        from autoplan.cost_models.errors import SpecError

        raise SpecError("unknown torchtitan version", f"got {version!r}",
                        f"pass one of {', '.join(TORCHTITAN_VERSIONS)}")
    cfg, tr, m = plan.parallel, plan.training, plan.model
    dp = cfg.dp or 1
    warnings: list[str] = []
    module, config_fn, flavor = _TITAN_CONFIGS.get(m.name, ("llama3", "llama3_8b", m.name))
    if m.name not in _TITAN_CONFIGS:
        warnings.append(f"torchtitan has no config for {m.name}: the export starts from {config_fn}; register a "
                        "model flavour with the shape in the header comment and use it")
    elif m.position == "rope" and m.rope_theta != _TITAN_ROPE_THETA:
        warnings.append(f"{m.name} rotates with rope_theta={m.rope_theta:g}; torchtitan's {flavor} flavour uses "
                        f"{_TITAN_ROPE_THETA:g}: register a flavour with rope_theta={m.rope_theta:g} and use it")
    if m.activation != "swiglu" or m.position != "rope" or m.norm != "rmsnorm":
        warnings.append(f"{m.name} is not a Llama-style model (activation={m.activation}, position={m.position}, "
                        f"norm={m.norm}); torchtitan's llama3 model will not reproduce it")
    if tr.optimizer_dtype != "fp32" or tr.master_kind not in (None, "fp32"):
        warnings.append(f"optimizer_dtype={tr.optimizer_dtype}, master_weights={tr.master_kind}: torchtitan's AdamW "
                        "keeps fp32 moments over fp32 parameters, their own master: the plan priced "
                        f"{tr.optimizer_state_bytes} bytes a parameter of optimizer state, torchtitan holds 8 beside "
                        "4-byte weights")
    if tr.loss_fusion:
        warnings.append("loss_fusion: the plan priced Megatron-Core's fused cross-entropy (22 bytes a logit); "
                        "torchtitan runs torch's cross-entropy, fused only as far as torch.compile takes it")
    if m.moe is not None:
        warnings.append("MoE model: torchtitan's MoE models (deepseek_v3, llama4, qwen3) each route differently; "
                        "pick the one that matches and register the shape")
    # Batch: with pipelining one step runs all of a rank's micro-batches through the schedule, so the local
    # batch is the rank's share of the global batch; without it torchtitan accumulates gradients over
    # global / (local x dp) steps, so the local batch is the plan's micro-batch.
    local = tr.global_batch_size // dp if cfg.pp > 1 else cfg.mbs
    training: dict[str, object] = {"local_batch_size": local, "global_batch_size": tr.global_batch_size,
                                   "seq_len": tr.seq_length, "mixed_precision_param": _TITAN_PARAM_DTYPE[tr.dtype],
                                   "mixed_precision_reduce": "float32"}
    if tr.dtype == "fp16":
        warnings.append("torchtitan has no fp16 mixed precision: exported bfloat16")
    if tr.dtype == "fp8" and (version != "0.3" or m.name not in _TITAN_CONFIGS):
        warnings.append("fp8: torchtitan runs Float8 through a model converter (Float8LinearConverter, the LM head "
                        "filtered out); the export sets it for the registered llama3 flavours under 0.3 only: "
                        "exported bfloat16 parameters without it")
    reduce = tr.grad_dtype
    if reduce != "fp32":
        warnings.append(f"the plan reduces gradients in {reduce}; torchtitan reduces in float32 only "
                        "(mixed_precision_reduce), twice the data-parallel bytes the plan assumed")
    par: dict[str, object] = {}
    if cfg.zero == 0:
        par.update(data_parallel_replicate_degree=dp, data_parallel_shard_degree=1)
    else:
        par.update(data_parallel_replicate_degree=1, data_parallel_shard_degree=dp)
        # "default" reshards after the forward only without pipelining (parallelize.py at v0.2.2: `not
        # pp_enabled`): a ZeRO-3 plan with pp > 1 says "always"
        par["fsdp_reshard_after_forward"] = ("always" if cfg.pp > 1 else "default") if cfg.zero >= 3 else "never"
        if cfg.zero < 3:
            warnings.append(f"zero={cfg.zero}: torchtitan's FSDP2 also shards the weights (like ZeRO-3, with "
                            "reshard_after_forward='never' they stay gathered between forward and backward)")
    par["tensor_parallel_degree"] = cfg.tp
    if cfg.tp > 1:
        if version == "0.3":
            par["enable_sequence_parallel"] = bool(cfg.sp)
        elif not cfg.sp:
            warnings.append("torchtitan 0.2 always uses sequence parallelism with TP; the plan has sp=0")
        if tr.tp_comm_overlap and tr.kernels != "fused":
            warnings.append("tp_comm_overlap: torchtitan runs async TP only under torch.compile (maybe_enable_async_tp "
                            "refuses it otherwise), and the plan priced eager kernels (kernels=torch): not set")
        elif tr.tp_comm_overlap and version == "0.2":
            par["enable_async_tensor_parallel"] = True
    par["pipeline_parallel_degree"] = cfg.pp
    if cfg.pp > 1:
        par["pipeline_parallel_schedule"] = _TITAN_SCHEDULE[cfg.schedule]
        par["pipeline_parallel_microbatch_size"] = cfg.mbs
        if version == "0.3":
            par.update(_titan_stage_layout(plan, TITAN_HEAD))
        else:  # 0.2: explicit module lists per stage (the head module was called `output` then)
            par["module_fqns_per_model_part"] = _titan_stage_layout_explicit(plan, "output")
    par["context_parallel_degree"] = cfg.cp
    if cfg.cp > 1:
        _cp_warning(plan, "torchtitan's (torch's ring attention)", "torchtitan", warnings)
    if m.moe is not None:
        par["expert_parallel_degree"] = cfg.ep
    ac = _titan_recompute(plan, warnings, version)
    # torch.compile is what fuses the elementwise ops the plan priced fused (the torchtitan stack's kernels=fused);
    # under 0.3 async TP is one of its options (CompileConfig.enable_async_tensor_parallel)
    comp: dict[str, object] = {"enable": tr.kernels == "fused", "components": ["model", "loss"]}
    if version == "0.3" and tr.tp_comm_overlap and cfg.tp > 1 and tr.kernels == "fused":
        comp["enable_async_tensor_parallel"] = True
    sections = {"model": {"module": module, "config": config_fn, "flavor": flavor}, "training": training,
                "parallelism": par, "activation_checkpoint": _titan_ac_section(ac, plan, version), "compile": comp}
    return sections, warnings


def _titan_ac_section(ac: str, plan: Plan, version: str) -> dict:
    """The activation_checkpoint section. 0.2's full and layer-selective AC take `early_stop` (a config since
    25413d224, 2025-08-29, default false): written as the plan priced it. 0.2's per-op policy is
    selective_ac_option "op"."""
    if version == "0.3":
        return {"mode": ac}
    early = {"early_stop": plan.training.recompute_stops_early}
    if ac.startswith("layer:"):
        return {"mode": "selective", "selective_ac_option": ac.split(":")[1], **early}
    if ac == "selective":
        return {"mode": "selective", "selective_ac_option": "op"}
    return {"mode": ac, **early} if ac == "full" else {"mode": ac}


def _titan_stage_layout_explicit(plan: Plan, head: str) -> list[list[str]]:
    return [(["tok_embeddings"] if s.has_embedding else []) + [f"layers.{i}" for i in range(*s.layers)]
            + (["norm", head] if s.has_head else []) for s in plan.stages]


def _titan_comments(plan: Plan, notes: list[str]) -> list[str]:
    """The export's header; `notes`: the numerics of a Hugging Face config (`titan_model_notes`)."""
    cfg, m = plan.parallel, plan.model
    return [f"autoplan plan {plan.short_hash}: {cfg.to_string()}",
            f"predicted step {plan.prediction.step_time_s:.3f} s, MFU {100 * plan.prediction.mfu:.1f}%",
            f"model shape: layers={m.num_layers} hidden={m.hidden_size} heads={m.num_attention_heads} "
            f"kv_heads={m.kv_heads} ffn={m.ffn} vocab={m.vocab_size}"
            + (f" rope_theta={m.rope_theta:g}" if m.position == "rope" and not notes else ""), *notes]


def _titan_python(plan: Plan, sections: dict[str, dict], module_name: str, notes: list[str]) -> str:
    """A torchtitan 0.3 config module: one function returning the registered config with the plan applied.
    Every value is written with repr() of a Python literal, so nothing from the plan becomes code."""
    mdl = sections["model"]
    ac = sections["activation_checkpoint"]["mode"]
    lines = [f'"""torchtitan config for autoplan plan {plan.short_hash}.', "", *_titan_comments(plan, notes), "",
             f"launch: PYTHONPATH=<this folder> torchrun ... -m torchtitan.train --module {module_name} "
             "--config autoplan_config", '"""', "",
             f"from torchtitan.models.{mdl['module']}.config_registry import {mdl['config']} as _base", ""]
    if ac == "full":
        lines.append("from torchtitan.distributed.activation_checkpoint import FullAC")
    elif ac == "selective":
        lines.append("from torchtitan.distributed.activation_checkpoint import SelectiveAC")
    registered = plan.model.name in _TITAN_CONFIGS
    float8 = registered and plan.training.dtype == "fp8"
    if registered:
        lines.append(f"from torchtitan.models.{mdl['module']} import model_registry")
    if float8:
        lines.append("from torchtitan.components.quantization import Float8LinearConverter")
    lines += ["", "", "def autoplan_config():", "    config = _base()"]
    if float8:  # the block linears in Float8, the head in bf16, as the plan prices them (compute.float8_gemm)
        lines += ["    compiled = config.compile.enable and \"model\" in config.compile.components",
                  f"    config.model_spec = model_registry({mdl['flavor']!r}, converters=[",
                  f"        Float8LinearConverter.Config(filter_fqns=[{TITAN_HEAD!r}], model_compile_enabled=compiled)])"]
    elif registered:  # the registered config may add Float8 converters (llama3_405b): the plan trains in bf16/fp32
        lines.append(f"    config.model_spec = model_registry({mdl['flavor']!r})")
    for k, v in sections["training"].items():
        lines.append(f"    config.training.{k} = {v!r}")
    if plan.parallel.pp > 1:
        lines.append("    config.training.disable_cuda_graphs = True  # torchtitan: CUDA graphs do not support PP")
    for k, v in sections["parallelism"].items():
        lines.append(f"    config.parallelism.{k} = {v!r}")
    for k, v in sections["compile"].items():
        lines.append(f"    config.compile.{k} = {v!r}")
    lines.append("    config.activation_checkpoint = " +
                 {"none": "None", "full": "FullAC.Config()", "selective": "SelectiveAC.Config()"}[ac])
    lines += ["    return config", ""]
    return "\n".join(lines)


def export_torchtitan(plan: Plan, version: str = "0.3") -> dict:
    sections, warnings = torchtitan_settings(plan, version)
    notes = titan_model_notes(plan, warnings)  # and what torchtitan's llama3 model cannot express of it
    cl = plan.cluster
    out = {"format": "torchtitan", "version": version, "plan": plan.short_hash, "config": sections,
           "warnings": warnings}
    torchrun = f"torchrun --nnodes {cl.num_nodes} --nproc-per-node {cl.gpus_per_node} -m torchtitan.train"
    if version == "0.3":
        module_name = f"autoplan_{plan.short_hash}"
        out.update(module=module_name, python=_titan_python(plan, sections, module_name, notes),
                   command=f"PYTHONPATH=. {torchrun} --module {module_name} --config autoplan_config")
        out["text"] = out["python"]
        return out
    import tomli_w

    mdl = sections["model"]
    body = {"job": {"description": f"autoplan plan {plan.short_hash}: {plan.model.name} on {cl.num_gpus} x "
                                   f"{cl.gpu.name}"},
            "model": {"name": mdl["module"], "flavor": mdl["flavor"]},
            "training": sections["training"], "parallelism": sections["parallelism"],
            "activation_checkpoint": sections["activation_checkpoint"], "compile": sections["compile"]}
    header = "".join(f"# {c}\n" for c in [*_titan_comments(plan, notes),
                                          f"launch: {torchrun} --job.config_file <this file>"])
    out.update(toml=header + "\n" + tomli_w.dumps(body), command=f"{torchrun} --job.config_file <this file>")
    out["toml_config"] = body
    out["text"] = out["toml"]
    return out
