"""Read a Megatron-LM command line into autoplan's terms: the model, the parallel configuration, the stack.

The inverse of `autoplan export --format megatron` (`export.megatron_flags`). A user with a Megatron launch (their
own script, or flags copied from a paper or a blog post) asks what autoplan predicts for exactly that, before asking
what autoplan would choose instead. Flags are read as Megatron-LM reads them (megatron/training/arguments.py: the
default FFN and head sizes, the vocabulary padded to a multiple of 128 x tp, bf16 gradients reduced in fp32 unless
--grad-reduce-in-bf16); a flag that changes what runs in a way the cost model does not price gets a note saying which
way the price is off (_EFFECTS); every other flag not read (learning rate, data, checkpoints, logging, ...) is listed as
priced as if absent, never dropped silently; a model the cost model cannot express is refused with the reason.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.specs import ModelSpec, MoESpec, ParallelConfig, moe_layer_spacing
from autoplan.inspect.export_numerics import pattern_bits

# Megatron's own defaults (megatron/training/arguments.py) where a flag is absent
_MAKE_VOCAB_DIVISIBLE_BY = 128  # --make-vocab-size-divisible-by
_DROPOUT = 0.1  # --hidden-dropout, --attention-dropout
_ROTARY_BASE = 10000.0  # --rotary-base
# The vocabulary of Megatron's built-in tokenizers that need no file to know it
_TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257}
# Flags read here; every other one is listed as not priced.
_READ = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--sequence-parallel", "--micro-batch-size", "--global-batch-size",
    "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", "--standalone-embedding-stage",
    "--microbatch-group-size-per-virtual-pipeline-stage", "--recompute-activations", "--checkpoint-activations",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules",
    "--use-distributed-optimizer", "--use-megatron-fsdp", "--use-torch-fsdp2", "--data-parallel-sharding-strategy",
    "--bf16", "--fp16", "--fp8-format", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
    "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap", "--no-align-grad-reduce",
    "--cross-entropy-loss-fusion", "--attention-backend", "--use-flash-attn", "--use-precision-aware-optimizer",
    "--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-params-dtype", "--overlap-p2p-communication",
    "--no-overlap-p2p-communication",
    "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
    "--max-position-embeddings", "--vocab-size", "--make-vocab-size-divisible-by", "--tokenizer-type",
    "--group-query-attention", "--num-query-groups", "--kv-channels", "--swiglu", "--squared-relu",
    "--normalization", "--position-embedding-type", "--rotary-base", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--hidden-dropout", "--attention-dropout", "--num-experts", "--moe-router-topk",
    "--moe-ffn-hidden-size", "--moe-layer-freq", "--moe-token-dispatcher-type", "--moe-expert-capacity-factor",
    "--moe-pad-expert-input-to-capacity", "--quick-geglu", "--no-gradient-accumulation-fusion",
    "--window-attn-skip-freq",  # said with --window-size (_EFFECTS)
    "--activations-checkpoint-method", "--activations-checkpoint-num-layers", "--DDP-impl",
    "--deepspeed", "--deepspeed-config", "--zero-stage", "--pp-partition-method", "--pad-vocab-size-to",
    "--mlp-type", "--topk", "--expert-interval", "--moe-train-capacity-factor", "--disable-moe-token-dropping",
    "--moe-expert-parallel-size",
}
# Flags that change what Megatron runs in ways the cost model does not price: each gets a note saying which way the
# price is off, instead of a place in the "not read" list.
_EFFECTS = {
    "--window-size": "sliding-window attention (with --window-attn-skip-freq: on some layers) priced as full causal "
                     "attention: more attention work and memory than runs",
    "--fp8-param-gather": "weights held and all-gathered in fp8 priced as 16-bit weights and gathers: more weight "
                          "memory and gather traffic than runs",
    "--moe-shared-expert-intermediate-size": "the shared expert beside the routed ones is not priced: less MLP "
                                             "work, weight and activation memory than runs",
    "--mtp-num-layers": "the multi-token-prediction layers after the last block are not priced: less work and "
                        "memory than runs on the last stage",
    "--no-bias-dropout-fusion": "bias + dropout + residual priced as one fused kernel: less memory traffic than runs",
    "--no-bias-gelu-fusion": "bias + GELU priced as one fused kernel: less memory traffic than runs",
    "--no-bias-swiglu-fusion": "the SwiGLU pointwise priced as one fused kernel: less memory traffic than runs",
    "--no-rope-fusion": "RoPE priced as a fused kernel: less memory traffic than runs",
    "--qk-layernorm": "the query and key norms are not priced: less pointwise work than runs",
    "--distribute-checkpointed-activations": "the checkpointed layer inputs split over the tp ranks are priced "
                                             "whole on each: more activation memory than runs",
    "--distribute-saved-activations": "the checkpointed layer inputs split over the tp ranks are priced whole on "
                                      "each: more activation memory than runs",
}
# Flags that change the model into one autoplan cannot describe: refused, with what to do.
_REFUSED = {  # flag: (what is not expressible, why it matters, what to do)
    "--multi-latent-attention": ("multi-latent attention is not expressible", "its low-rank query and key-value "
                                 "projections change the attention's weights and work", "drop the flag to price "
                                 "multi-head attention of the same head count, knowing it is a different model"),
    "--hybrid-override-pattern": ("Mamba / hybrid layer patterns are not expressible", "autoplan prices "
                                  "transformer blocks", "price a transformer of the same size instead"),
    "--experimental-attention-variant": ("experimental attention variants are not expressible", "autoplan prices "
                                         "softmax attention", "drop the flag to price standard attention"),
}
# Training scripts whose own defaults fill a flag the command leaves out (pretrain_gpt.py: args_defaults).
_SCRIPT_DEFAULTS = {"pretrain_gpt.py": {"--tokenizer-type": "GPT2BPETokenizer"},
                    "pretrain_hybrid.py": {"--tokenizer-type": "GPT2BPETokenizer"}}
# Flags read whose other values autoplan does not price (a note says so).
_UNPRICED_SETTINGS = {
    "--moe-token-dispatcher-type": ("alltoall", "expert routing is priced as all-to-all (cost_models/comm.py)"),
}


@dataclass
class MegatronRun:
    """What a Megatron command line says, in autoplan's terms."""

    parallel: ParallelConfig
    seq_len: int
    dtype: str
    stack_set: dict[str, object]  # the stack knobs the flags decide (over the chosen --stack's)
    global_batch: int | None  # None: Megatron's default, micro-batch x data-parallel size
    model: ModelSpec | None  # None: the flags give no shape (--num-layers absent)
    gpus: int | None = None  # torchrun's --nnodes x --nproc-per-node, where the command has them
    notes: list[str] = field(default_factory=list)
    unpriced: list[str] = field(default_factory=list)  # flags not read: priced as if absent
    stack: str | None = None  # the stack the command's own software implies (--deepspeed: megatron-deepspeed)


# The Megatron flag that sets each field built from the flags: a value the field refuses names its flag.
_FLAG_OF = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads":
            "--num-attention-heads", "num_kv_heads": "--num-query-groups", "head_dim": "--kv-channels",
            "ffn_hidden_size": "--ffn-hidden-size", "vocab_size": "--vocab-size", "max_seq_length":
            "--max-position-embeddings", "num_experts": "--num-experts", "top_k": "--moe-router-topk",
            "expert_ffn_hidden_size": "--moe-ffn-hidden-size", "every_n_layers": "--moe-layer-freq",
            "first_layer": "--moe-layer-freq",
            "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size", "cp":
            "--context-parallel-size", "ep": "--expert-model-parallel-size", "vp":
            "--num-virtual-stages-per-pipeline-rank", "mbs": "--micro-batch-size", "recompute_layers":
            "--recompute-num-layers"}


def _built(cls: type, **fields: object):
    """`cls(**fields)`, a value it refuses reported in one line naming the Megatron flag that gave it."""
    try:
        return cls(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else ""
        flag = _FLAG_OF.get(name, name or cls.__name__)
        raise ConfigError(f"the Megatron flags give an invalid {flag}",
                          f"{first['msg'].lower()}: got {first.get('input')!r}", f"correct {flag}") from None


def command_tokens(text: str) -> list[str]:
    """The words of a launch command or script: comments and line continuations removed, shell quoting undone."""
    return shlex.split(text.replace("\\\n", " "), comments=True)


def _split_launcher(tokens: list[str]) -> tuple[list[str], list[str]]:
    """(launcher words, Megatron words): everything up to the training script (a word ending in .py) is the
    launcher's (torchrun, environment assignments); without a script every word is Megatron's."""
    for i, t in enumerate(tokens):
        if t.endswith(".py"):
            return tokens[:i], tokens[i + 1:]
    return [], tokens


def _flags(words: list[str]) -> dict[str, list[str]]:
    """`--flag value ...` and `--flag=value` into {flag: values}; the last occurrence wins, as with argparse."""
    out: dict[str, list[str]] = {}
    key = None
    for w in words:
        if w.startswith("--"):
            name, eq, value = w.partition("=")
            key = name.replace("_", "-")
            out[key] = [value] if eq else []
        elif key is not None:
            out[key].append(w)
        else:
            raise ConfigError("a Megatron command line is --flags and their values",
                              f"{w!r} comes before any flag", "pass the flags after the training script")
    return out


def _launcher_gpus(words: list[str]) -> int | None:
    """torchrun's world size, where its --nnodes (default 1) and --nproc-per-node are plain integers (DeepSpeed's
    launcher: --num_nodes and --num_gpus, both written); 1 where the training script is started by a bare `python`
    (one process: Megatron's world size without a launcher)."""
    plain = [w for w in words if not re.fullmatch(r"[A-Za-z_]\w*=.*|-u|-O|-B", w)]
    if plain and all(re.fullmatch(r"(\S*/)?python[0-9.]*", w) for w in plain):
        return 1
    f: dict[str, str] = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            name, eq, value = w.partition("=")
            if eq or i + 1 < len(words):
                f[name.replace("_", "-")] = value if eq else words[i + 1]
    if any(w.rsplit("/", 1)[-1] == "deepspeed" for w in words):
        # DeepSpeed's launcher (deepspeed/launcher/runner.py): --num_nodes x --num_gpus; without them it takes the
        # hostfile's nodes and every GPU on each, which only the cluster knows
        nodes, procs = f.get("--num-nodes", ""), f.get("--num-gpus", "")
    else:
        nodes, procs = f.get("--nnodes", "1"), f.get("--nproc-per-node", "")
    return int(nodes) * int(procs) if nodes.isdigit() and procs.isdigit() else None


def _unknown(value: str) -> str:
    """What kind of shell word `value` holds that a reading (not a run) of the script leaves as written."""
    if "$(" in value or "`" in value:
        return "a command substitution (autoplan runs nothing)"
    if re.search(r"\$\{?[0-9@*#]", value):
        return "a positional parameter of the script"
    return "a shell variable set neither in the script nor in the environment"


class _Reader:
    """Typed access to the flags, with errors that name the flag."""

    def __init__(self, flags: dict[str, list[str]]) -> None:
        self.f = flags

    def has(self, name: str) -> bool:
        return name in self.f

    def value(self, name: str) -> str | None:
        vals = self.f.get(name)
        if vals is None:
            return None
        if len(vals) != 1:
            raise ConfigError(f"{name} takes one value", f"got {' '.join(vals) or 'none'}",
                              f"write {name} VALUE")
        v = vals[0]
        if "$" in v or "`" in v:
            raise ConfigError(f"{name} is {v}, which autoplan cannot know without running the shell", _unknown(v),
                              f"set it in the environment (NAME=VALUE autoplan from-megatron ...), or pass {name} "
                              "VALUE after --")
        return v

    def _number(self, name: str, default, cast, what: str, placeholder: str):
        v = self.value(name)
        if v is None:
            return default
        try:
            return cast(v)
        except ValueError:
            raise ConfigError(f"{name} takes {what}", f"got {v!r}", f"write {name} {placeholder}") from None

    def int(self, name: str, default: int | None = None) -> int | None:
        return self._number(name, default, int, "an integer", "N")

    def float(self, name: str, default: float) -> float:
        return self._number(name, default, float, "a number", "X")


def _model(r: _Reader, tp: int, seq: int, notes: list[str]) -> ModelSpec | None:
    """The transformer the flags describe, with Megatron's defaults for what they leave out."""
    layers = r.int("--num-layers")
    if layers is None:
        return None
    h, heads = r.int("--hidden-size"), r.int("--num-attention-heads")
    if h is None or heads is None:
        raise ConfigError("a Megatron model needs --hidden-size and --num-attention-heads beside --num-layers",
                          f"hidden {h}, heads {heads}", "add both flags")
    swiglu = r.has("--swiglu")
    # arguments.py: the FFN defaults to 4h, or for SwiGLU to 2/3 of it rounded down to a multiple of 64
    ffn = r.int("--ffn-hidden-size", int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h)
    if r.has("--quick-geglu"):  # argument_utils.py: gated_linear_unit=True with quick_gelu (the FFN default stays 4h)
        swiglu = True
        notes.append("--quick-geglu: a gated MLP (Megatron sets gated_linear_unit) with quick-GELU, priced as SwiGLU: "
                     "the same three matrices and a pointwise of the same kind")
    vocab = r.int("--vocab-size")
    tokenizer = r.value("--tokenizer-type")
    if vocab is None and tokenizer in _TOKENIZER_VOCAB:
        vocab = _TOKENIZER_VOCAB[tokenizer]
    # Megatron-DeepSpeed's --pad-vocab-size-to N (bigscience-workshop/Megatron-DeepSpeed, megatron/tokenizer/
    # tokenizer.py `_vocab_size_with_padding`: "after = args.pad_vocab_size_to", refused below the tokenizer's size):
    # the embedding's rows, whatever the tokenizer's files hold (BLOOM: 250880)
    pad_to = r.int("--pad-vocab-size-to")
    if vocab is None and pad_to is None:
        raise ConfigError("the vocabulary size is not in the flags", "Megatron reads it from the tokenizer's files",
                          "add --vocab-size N (the tokenizer's size, e.g. 128256 for Llama 3, 32000 for Llama 2)")
    if pad_to is not None:
        if vocab is not None and pad_to < vocab:
            raise ConfigError("--pad-vocab-size-to is below the vocabulary", f"{pad_to} < {vocab}",
                              f"pad to at least {vocab}, as Megatron-DeepSpeed requires")
        padded = pad_to
        notes.append(f"vocabulary {pad_to}: --pad-vocab-size-to (Megatron-DeepSpeed pads the tokenizer's to it)")
    else:
        multiple = r.int("--make-vocab-size-divisible-by", _MAKE_VOCAB_DIVISIBLE_BY) * tp
        padded = int(math.ceil(vocab / multiple) * multiple)  # vocab_size_with_padding
        if padded != vocab:
            notes.append(f"vocabulary {vocab} padded to {padded} (a multiple of "
                         f"{multiple // tp} x tp, as Megatron pads it)")
    kv = r.int("--num-query-groups") if r.has("--group-query-attention") else None
    # alibi: Megatron-DeepSpeed's (bigscience-workshop fork, PositionEmbeddingType.alibi; BLOOM)
    position = {"rope": "rope", "learned_absolute": "learned", "alibi": "alibi",
                None: "learned"}.get(r.value("--position-embedding-type"))
    if position is None:
        raise ConfigError("unsupported --position-embedding-type", f"got {r.value('--position-embedding-type')}",
                          "autoplan prices rope, learned_absolute and (Megatron-DeepSpeed's) alibi positions")
    norm = r.value("--normalization") or "LayerNorm"
    if norm not in ("LayerNorm", "RMSNorm"):
        raise ConfigError("unsupported --normalization", f"got {norm}", "autoplan prices LayerNorm and RMSNorm")
    hidden_do, attn_do = r.float("--hidden-dropout", _DROPOUT), r.float("--attention-dropout", _DROPOUT)
    if hidden_do != attn_do:
        notes.append(f"dropout: hidden {hidden_do:g}, attention {attn_do:g}; autoplan has one rate, priced at "
                     f"{max(hidden_do, attn_do):g}")
    moe = None
    counts = r.f.get("--num-experts") or []
    if len(set(counts)) > 1:  # Megatron-DeepSpeed's --num-experts is nargs='+': pyramid MoE (PR-MoE)
        raise ConfigError("--num-experts gives a count per layer group (Megatron-DeepSpeed's pyramid MoE)",
                          f"got {' '.join(counts)}", "autoplan prices one expert count on every MoE layer: pass "
                          "--num-experts N after -- to price that model instead")
    if len(counts) > 1:
        r.f["--num-experts"] = counts[:1]
    experts = r.int("--num-experts")
    if experts is not None and experts > 1 and r.has("--deepspeed"):
        moe = _built(MoESpec, num_experts=experts, **_deepspeed_moe(r, notes))
    elif experts is not None and experts > 1:
        cf = r.float("--moe-expert-capacity-factor", None)
        pad_experts = cf is not None and cf > 1 and r.has("--moe-pad-expert-input-to-capacity")
        moe = _built(MoESpec, num_experts=experts, top_k=r.int("--moe-router-topk", 2),
                      expert_ffn_hidden_size=r.int("--moe-ffn-hidden-size"),
                      **_moe_layers(r.value("--moe-layer-freq"), layers),
                      **({"capacity_factor": cf, "pad_to_capacity": True} if pad_experts else {}))
    return _built(
        ModelSpec, name="megatron-args", num_layers=layers, hidden_size=h, num_attention_heads=heads, num_kv_heads=kv,
        head_dim=r.int("--kv-channels"), ffn_hidden_size=ffn, vocab_size=padded,
        max_seq_length=r.int("--max-position-embeddings", seq),
        activation="swiglu" if swiglu else "relu2" if r.has("--squared-relu") else "gelu",
        norm="rmsnorm" if norm == "RMSNorm" else "layernorm", position=position,
        tie_embeddings=not r.has("--untie-embeddings-and-output-weights"),
        rope_theta=r.float("--rotary-base", _ROTARY_BASE) if position == "rope" else _ROTARY_BASE,
        bias=not r.has("--disable-bias-linear"), dropout=max(hidden_do, attn_do), moe=moe,
    )


def _moe_layers(freq: str | None, layers: int) -> dict[str, object]:
    """Megatron-Core's --moe-layer-freq as MoESpec's placement: an integer N puts experts on layers 0, N, 2N, ...
    (`1 if (i % moe_layer_freq == 0)`, megatron/core/models/gpt/gpt_layer_specs.py); a Python list expression of
    0/1 per layer (arguments.py moe_freq_type, e.g. "([0]*3+[1]*1)*3"), computed without running it."""
    if freq is None or freq == "1":
        return {}
    if freq.isdigit():
        return {"every_n_layers": int(freq), "first_layer": 0}
    bits = pattern_bits(freq)
    if bits is None or len(bits) != layers or not any(bits):
        raise ConfigError("--moe-layer-freq is not a 0/1 list of one entry per layer", f"got {freq} for {layers} "
                          "layers", "write N (one MoE layer every N, from layer 0) or a list expression such as "
                          "\"([0]*3+[1])*4\" of --num-layers entries")
    return moe_layer_spacing([bool(b) for b in bits]) or {}


def _deepspeed_moe(r: _Reader, notes: list[str]) -> dict[str, object]:
    """DeepSpeed-MoE as Megatron-DeepSpeed runs it (megatron/arguments.py, deepspeed/moe/sharded_moe.py): experts
    on every --expert-interval-th layer (default 2; `layer_num % expert_interval == 0`, autoplan's every_n_layers),
    --topk gating (default 1), and each expert's input a dense [experts, capacity, hidden] tensor whose capacity is
    --moe-train-capacity-factor (default 1.0) x k x the balanced load: padded to capacity, tokens over it dropped;
    with --disable-moe-token-dropping the capacity is the busiest expert's load."""
    if (r.value("--mlp-type") or "standard") != "standard":
        raise ConfigError(f"--mlp-type {r.value('--mlp-type')} (Residual MoE) is not expressible",
                          "a dense MLP runs beside the experts and their outputs are mixed",
                          "drop the flag to price the standard MoE of the same experts")
    cf = r.float("--moe-train-capacity-factor", 1.0)
    out: dict[str, object] = {"top_k": r.int("--topk", 1), "every_n_layers": r.int("--expert-interval", 2)}
    if r.has("--disable-moe-token-dropping"):
        notes.append("--disable-moe-token-dropping: DeepSpeed pads every expert to the busiest one's load; priced "
                     "at the balanced load (less expert work than runs where the load is uneven)")
    elif cf > 1:
        out.update(capacity_factor=cf, pad_to_capacity=True)
    elif cf < 1:
        notes.append(f"--moe-train-capacity-factor {cf:g} drops tokens over the capacity: priced dropless at the "
                     "balanced load (more expert work than runs)")
    return out


def _recompute(r: _Reader, vp: int, notes: list[str]) -> dict[str, object]:
    """--recompute-granularity / -method / -num-layers (and the older --recompute-activations,
    --checkpoint-activations) as autoplan's recompute and recompute_layers (a pipeline rank's layers)."""
    if r.has("--checkpoint-activations"):  # Megatron-LM before 2023-04: every layer, uniform
        return {"recompute": "full"}
    # Megatron-LM 2021-08 to 2022-05 (c1e0689d92 to the selective-recompute rename): a method alone turned full
    # recomputation on (the SC21 scripts, examples/academic_paper_scripts/sc21, pass only the method)
    old_method = r.value("--activations-checkpoint-method")
    granularity = r.value("--recompute-granularity") or ("selective" if r.has("--recompute-activations") else None)
    granularity = granularity or ("full" if old_method else None)
    if granularity is None:
        return {}
    if granularity == "selective":
        modules = r.f.get("--recompute-modules")
        if modules and set(modules) != {"core_attn"}:
            notes.append(f"--recompute-modules {' '.join(modules)}: priced as the attention core's recomputation "
                         "only (Megatron's default selective set)")
        return {"recompute": "selective"}
    if granularity != "full":
        raise ConfigError("unknown --recompute-granularity", f"got {granularity}", "use full or selective")
    method = r.value("--recompute-method") or old_method or "uniform"
    n = r.int("--recompute-num-layers", r.int("--activations-checkpoint-num-layers", 1))
    if method == "uniform":
        if n > 1:
            notes.append(f"--recompute-method uniform --recompute-num-layers {n}: every layer recomputes, priced "
                         f"with a checkpoint per layer (Megatron keeps one per {n} layers: less memory)")
        return {"recompute": "full"}
    if method == "block":  # each model chunk recomputes its first n layers: n per virtual stage, n * vp per rank
        return {"recompute": "full", "recompute_layers": n * vp}
    raise ConfigError("unknown --recompute-method", f"got {method}", "use uniform or block")


def _end_stage_layout(r: _Reader, layers: int | None, pp: int, vp: int, layout: str | None,
                      uneven_given: bool) -> str | None:
    """The layout the flags that lighten the end stages give, else `layout` (an explicit one, or the one
    --decoder-first/last-pipeline-num-layers gave: `uneven_given`). Megatron-LM 2022's --standalone-embedding-stage
    (`_standalone_embedding`); Megatron-Core's --account-for-embedding-in-pipeline-split /
    --account-for-loss-in-pipeline-split: the embedding and the loss each count as one layer when the layers are
    split over pp x vp virtual stages, and the first (last) virtual stage builds one transformer layer fewer
    (megatron/core/transformer/transformer_block.py get_num_layers_to_build: `num_layers += 1` per flag,
    `num_layers_to_build -= 1` on the first / last stage)."""
    emb, loss = r.has("--account-for-embedding-in-pipeline-split"), r.has("--account-for-loss-in-pipeline-split")
    if r.has("--standalone-embedding-stage") and pp > 1:
        return _standalone_embedding(layers, pp, vp, layout, uneven_given or emb or loss)
    explicit = layout is not None and not uneven_given  # --pipeline-model-parallel-layout places every layer
    if not (emb or loss) or pp < 2 or explicit:
        return layout
    if uneven_given:  # transformer_block.py asserts the same
        raise ConfigError("--account-for-embedding/loss-in-pipeline-split cannot be combined with "
                          "--decoder-first/last-pipeline-num-layers", "Megatron refuses the pair",
                          "keep one way of making the end stages lighter")
    if layers is None:
        raise ConfigError("the embedding/loss pipeline split needs the layer count", "no --num-layers",
                          "add --num-layers")
    total, n = layers + emb + loss, pp * vp
    if total % n:
        raise ConfigError("with the embedding and loss counted as layers, the layers do not split evenly",
                          f"{layers} + {int(emb)} + {int(loss)} = {total} over pp x vp = {n} virtual stages",
                          "Megatron asserts the same: change --num-layers, pp or vp")
    sizes = [total // n] * n
    sizes[0] -= emb
    sizes[-1] -= loss
    if min(sizes) < 0:
        raise ConfigError("a virtual stage would hold fewer than zero layers", f"sizes {sizes}",
                          "Megatron asserts the same: fewer virtual stages")
    from autoplan.cost_models.layout import normalize

    parts = [f"t*{c}" if c else "" for c in sizes]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return normalize("|".join(parts))


def _standalone_embedding(layers: int | None, pp: int, vp: int, layout: str | None, other: bool) -> str:
    """Megatron-LM 2022's --standalone-embedding-stage (1fa6990c, 2022-01; gone from Megatron-Core): pipeline rank 0
    holds the input embedding alone and the blocks split evenly over the other pp - 1 ranks (megatron/mpu/
    initialize.py get_num_layers: "num_layers must be divisible by transformer_pipeline_model_parallel_size",
    0 layers on rank 0)."""
    if other or layout is not None:
        raise ConfigError("--standalone-embedding-stage cannot be combined with another stage layout flag",
                          "it places the layers itself", "keep one way of laying out the stages")
    if vp > 1:  # rank 0's later model chunks would hold nothing at all (Megatron's no-op layers)
        raise ConfigError("--standalone-embedding-stage with virtual stages leaves rank 0's later chunks empty",
                          f"vp={vp}", "autoplan lays out empty stages only where the embedding or the loss is: "
                          "write the layout with --pipeline-model-parallel-layout instead")
    if layers is None or layers % (pp - 1):
        raise ConfigError("--standalone-embedding-stage splits the layers over the other pp - 1 ranks",
                          f"{layers} layers over {pp - 1} ranks", "Megatron asserts the same: change --num-layers or pp")
    from autoplan.cost_models.layout import normalize

    return normalize("E|" + "|".join([f"t*{layers // (pp - 1)}"] * (pp - 1)) + "L")


def _capacity_note(r: _Reader, notes: list[str]) -> None:
    """--moe-expert-capacity-factor (absent: dropless, Megatron-Core's default): autoplan prices routing under a
    balanced load, where a capacity of at least that load drops nothing (MoESpec.capacity_factor). Below it
    tokens are dropped (not priced: the note says so); padded to it (--moe-pad-expert-input-to-capacity) every expert
    computes cf x the balanced load (priced: MoESpec.pad_to_capacity, which the note names)."""
    cf = r.float("--moe-expert-capacity-factor", None)
    if cf is None:
        return
    if cf < 1:
        notes.append(f"--moe-expert-capacity-factor {cf:g} drops tokens over the capacity: priced dropless (more "
                     "expert work than runs)")
    elif cf > 1 and r.has("--moe-pad-expert-input-to-capacity"):
        notes.append(f"--moe-pad-expert-input-to-capacity at capacity factor {cf:g}: each expert computes, and the "
                     f"all-to-alls move, {cf:g} x the balanced load (moe.pad_to_capacity)")


def _deepspeed_config(r: _Reader, notes: list[str], files: Mapping[str, str]) -> None:
    """Megatron-DeepSpeed (--deepspeed): the DeepSpeed JSON's batch, ZeRO stage and precision fill the flags the
    command leaves out, as DeepSpeed's engine takes them (train_micro_batch_size_per_gpu, train_batch_size,
    zero_optimization.stage, bf16 / fp16 .enabled); --zero-stage is Megatron-DeepSpeed's own flag for the stage.
    A file the launch script writes (`files`, a here-document) is read as the script leaves it."""
    import json
    from pathlib import Path

    written = r.f.get("--deepspeed-config") or []
    # a path the script both writes and passes is the same file whatever its unexpanded parts ($SLURM_JOB_ID) hold
    if len(written) == 1 and written[0] not in files and ("$" in written[0] or "`" in written[0]):
        notes.append(f"--deepspeed_config {written[0]} not read (its name holds {_unknown(written[0])}): the flags "
                     "alone are read; pass --deepspeed-config FILE after -- to read it")
        return
    path = written[0] if len(written) == 1 and written[0] in files else r.value("--deepspeed-config")
    if path is None:
        notes.append("--deepspeed without --deepspeed_config: the flags alone are read")
        return
    try:
        if path in files:
            notes.append(f"--deepspeed_config {path}: as the script writes it (a here-document)")
            ds = json.loads(files[path])
        else:
            ds = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        notes.append(f"--deepspeed_config {path} not read ({getattr(e, 'strerror', None) or e}): the flags alone are "
                     "read; run from the folder the path is relative to")
        return
    if not isinstance(ds, dict):
        raise ConfigError("the DeepSpeed config is not a JSON object", f"{path}", "pass DeepSpeed's JSON config")
    def table(key: str) -> dict:
        v = ds.get(key) or {}
        if not isinstance(v, dict):
            raise ConfigError(f"the DeepSpeed config's {key} is not an object", f"{path}: {key} = {v!r}",
                              f'write "{key}": {{...}} as DeepSpeed takes it')
        return v

    fill = {"--micro-batch-size": ds.get("train_micro_batch_size_per_gpu"),
            "--global-batch-size": ds.get("train_batch_size"),
            "--zero-stage": table("zero_optimization").get("stage")}
    for flag, value in fill.items():
        if isinstance(value, int) and not isinstance(value, bool) and not r.has(flag):
            r.f[flag] = [str(value)]
            notes.append(f"{flag} {value} from --deepspeed_config {path}")
    for key, flag in (("bf16", "--bf16"), ("fp16", "--fp16")):
        if table(key).get("enabled") is True and not (r.has("--bf16") or r.has("--fp16")):
            r.f[flag] = []
            notes.append(f"{flag} from --deepspeed_config {path}")


def _deepspeed_partition(r: _Reader, layers: int | None, pp: int, notes: list[str]) -> str | None:
    """Megatron-DeepSpeed's --pp-partition-method (GPTModelPipe's PipelineModule partition_method, default
    'type:transformer': the blocks split evenly). 'type:transformer|embedding' (BLOOM's) counts the input embedding
    and the tied output embedding as one layer each, so the end stages hold one block fewer where the split is
    even; other methods (parameters, uniform, an uneven split) are said, priced as even stages."""
    method = r.value("--pp-partition-method")
    if method is None or pp == 1 or layers is None or method == "type:transformer":
        return None
    units = layers + 2
    if method.startswith("type:") and "embedding" in method.split(":", 1)[1].split("|") and units % pp == 0:
        from autoplan.cost_models.layout import uneven

        return uneven(layers, pp, 1, units // pp - 1, units // pp - 1)  # the end ranks hold an embedding each
    notes.append(f"--pp-partition-method {method}: DeepSpeed balances the stages its own way; priced as even "
                 "transformer stages (write --layout to price its split)")
    return None


def _zero(r: _Reader, notes: list[str]) -> int:
    if r.has("--deepspeed"):  # DeepSpeed's ZeRO (its pipeline engine takes stages 0 and 1)
        stage = r.int("--zero-stage", 0)
        if stage == 0 and r.has("--bf16"):
            # DeepSpeed's engine runs bf16 without ZeRO through BF16_Optimizer (runtime/engine.py
            # `_configure_bf16_optimizer`), which keeps the fp32 master and Adam states partitioned over the
            # data-parallel group and all-gathers the bf16 weights after its step (runtime/bf16_optimizer.py): ZeRO-1
            # in autoplan's terms (BLOOM's "bf16 must use z0! it implements its own zero stage 1 equivalent")
            notes.append("--zero-stage 0 with bf16: DeepSpeed's BF16_Optimizer shards the fp32 master and Adam "
                         "states over data parallelism itself, priced as zero=1")
            return 1
        return stage
    if r.has("--use-megatron-fsdp") or r.has("--use-torch-fsdp2"):
        strategy = r.value("--data-parallel-sharding-strategy") or "optim_grads_params"
        return {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}[strategy]
    return 1 if r.has("--use-distributed-optimizer") else 0


def _stack_knobs(r: _Reader, dtype: str) -> dict[str, object]:
    """The stack knobs Megatron's flags decide; the rest stay the chosen stack's."""
    knobs: dict[str, object] = {
        "overlap_grad_reduce": r.has("--overlap-grad-reduce"),
        "overlap_param_gather": r.has("--overlap-param-gather"),
        "tp_comm_overlap": r.has("--tp-comm-overlap"),
        "align_grad_reduce": not r.has("--no-align-grad-reduce"),
        "loss_fusion": r.has("--cross-entropy-loss-fusion"),
    }
    if r.value("--DDP-impl") == "torch":  # Megatron-LM 2021-22: torch DDP all-reduces its buckets in the backward
        knobs["overlap_grad_reduce"] = True
    if r.has("--no-gradient-accumulation-fusion"):  # the weight-gradient GEMMs write 16-bit grads, added apart
        knobs["grad_accum_fused"] = False
    # Megatron-LM overlaps pipeline p2p under the interleaved schedule only: by default since 2023-10 (4eeff55d,
    # --no-overlap-p2p-communication turns it off), before that with --overlap-p2p-communication; absent, the stack's
    if r.has("--no-overlap-p2p-communication"):
        knobs["p2p_overlap"] = False
    elif r.has("--overlap-p2p-communication"):
        knobs["p2p_overlap"] = None
    backend = r.value("--attention-backend") or ("flash" if r.has("--use-flash-attn") else None)
    if backend is not None:  # absent: the stack's (Megatron-LM before 2023 had no flash attention)
        if backend not in ("flash", "fused", "unfused", "local", "auto"):
            raise ConfigError("unknown --attention-backend", f"got {backend}", "use flash, fused, unfused or auto")
        # flash, TE's fused attention and auto (which picks one of them on Hopper and later) keep no s x s scores
        knobs["flash_attention"] = backend in ("flash", "fused", "auto")
    if dtype in ("bf16", "fp8"):
        # "bfloat16 requires gradient accumulation and all-reduce to be done in fp32" unless --grad-reduce-in-bf16
        knobs["grad_reduce_dtype"] = "bf16" if r.has("--grad-reduce-in-bf16") else "fp32"
    return knobs


def precision_aware_master(dtype: str, main_params_16bit: bool) -> str:
    """How Megatron-Core's precision-aware optimizer holds the master copy (TrainingSpec.master_weights): int16
    remainders beside bf16 weights (OptimizerConfig.store_param_remainders, default true since f2ece182d8, 2025-02,
    with TE >= 2.1: distrib_optimizer.py allocates the master_param shard as torch.int16 "if
    self.config.store_param_remainders and self.config.bf16"), else in --main-params-dtype (fp32 or fp16)."""
    if dtype in ("bf16", "fp8"):
        return "remainders"
    return "bf16" if main_params_16bit else "fp32"  # 'bf16': a 16-bit master, 2 bytes


def _optimizer_state(r: _Reader, dtype: str, notes: list[str]) -> dict[str, object]:
    """--use-precision-aware-optimizer (TransformerEngine's FusedAdam) as optimizer_dtype and master_weights
    (`precision_aware_master`)."""
    if not r.has("--use-precision-aware-optimizer"):
        return {}
    knobs: dict[str, object] = {}
    master = precision_aware_master(dtype, r.value("--main-params-dtype") == "fp16")
    if master != "fp32":
        knobs["master_weights"] = master
    moments = [r.value(f) or "fp32" for f in ("--exp-avg-dtype", "--exp-avg-sq-dtype")]
    if all(m in ("bf16", "fp16") for m in moments):
        knobs["optimizer_dtype"] = "bf16"
    elif any(m != "fp32" for m in moments):
        # autoplan holds Adam's two moments in one dtype; pricing the wider keeps the memory an upper bound
        notes.append(f"--exp-avg-dtype {moments[0]} --exp-avg-sq-dtype {moments[1]}: priced with both moments in "
                     f"{'fp32' if 'fp32' in moments else 'bf16'} (autoplan holds them in one dtype; fp8 moments "
                     "as 2 bytes)")
        knobs["optimizer_dtype"] = "fp32" if "fp32" in moments else "bf16"
    return knobs


def read_megatron(tokens: list[str], model: ModelSpec | None = None,
                 files: Mapping[str, str] | None = None) -> MegatronRun:
    """A Megatron-LM command line (the launcher's words included or not) in autoplan's terms; `model` is the
    model when the flags give no shape (its layer count places virtual and uneven stages); `files`: what the
    launch script writes before the command runs (`ScriptCommand.files`), read instead of the disk's."""
    launcher, words = _split_launcher(tokens)
    flags = _flags(words)
    r = _Reader(flags)
    notes: list[str] = []
    script = next((t.rsplit("/", 1)[-1] for t in tokens if t.endswith(".py")), None)
    for flag, value in _SCRIPT_DEFAULTS.get(script, {}).items():
        if flag not in flags:
            flags[flag] = [value]
            if flag == "--tokenizer-type" and "--vocab-size" not in flags:
                notes.append(f"no --tokenizer-type: {script}'s default, {value}")
    for flag, (what, why, fix) in _REFUSED.items():
        if r.has(flag):
            raise ConfigError(f"{flag}: {what}", why, fix)
    if r.has("--deepspeed"):
        _deepspeed_config(r, notes, files or {})
    tp = r.int("--tensor-model-parallel-size", 1)
    pp = r.int("--pipeline-model-parallel-size", 1)
    seq = r.int("--seq-length")
    if seq is None:
        raise ConfigError("the flags give no --seq-length", "Megatron requires it", "add --seq-length N")
    for flag in ("--seq-length", "--global-batch-size", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size"):
        v = r.int(flag)
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be positive", f"got {flag} {v}", f"correct {flag}")
    shaped = _model(r, tp, seq, notes)
    layers = (shaped or model).num_layers if (shaped or model) else None
    vp, layout = 1, r.value("--pipeline-model-parallel-layout")
    if r.has("--num-virtual-stages-per-pipeline-rank"):
        vp = r.int("--num-virtual-stages-per-pipeline-rank")
    elif r.has("--num-layers-per-virtual-pipeline-stage"):
        per = r.int("--num-layers-per-virtual-pipeline-stage")
        if layers is None or per <= 0 or (layers // pp) % per:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage must divide each pipeline rank's layers",
                              f"{layers} layers, pp={pp}, {per} per virtual stage", "fix the flag (or add --num-layers)")
        vp = layers // pp // per
    if layout is not None:
        from autoplan.cost_models.layout import normalize, parse_layout

        layout = normalize(layout)
        vp = max(1, len(parse_layout(layout)) // pp)
    first, last = r.int("--decoder-first-pipeline-num-layers"), r.int("--decoder-last-pipeline-num-layers")
    if (first is not None or last is not None) and layout is None:
        if layers is None:
            raise ConfigError("uneven first/last pipeline ranks need the layer count", "no --num-layers",
                              "add --num-layers")
        from autoplan.cost_models.layout import uneven

        layout = uneven(layers, pp, vp, first, last)
    layout = _end_stage_layout(r, layers, pp, vp, layout, first is not None or last is not None)
    if layout is None and r.has("--deepspeed"):
        layout = _deepspeed_partition(r, layers, pp, notes)
    dtype = "fp8" if r.has("--fp8-format") else "bf16" if r.has("--bf16") else "fp16" if r.has("--fp16") else "fp32"
    parallel = _built(
        ParallelConfig, tp=tp, pp=pp, cp=r.int("--context-parallel-size", 1),
        ep=r.int("--moe-expert-parallel-size" if r.has("--deepspeed") else "--expert-model-parallel-size", 1), vp=vp,
        mbs=r.int("--micro-batch-size", 1), sp=r.has("--sequence-parallel") and tp > 1, zero=_zero(r, notes),
        schedule="interleaved" if vp > 1 else "1f1b", layout=layout, **_recompute(r, vp, notes),
    )
    if not r.has("--micro-batch-size"):
        notes.append("no --micro-batch-size (Megatron requires one): 1 assumed")
    if r.has("--sequence-parallel") and tp == 1:
        notes.append("--sequence-parallel with tp=1: Megatron turns it off (\"Disabling sequence parallelism because "
                     "tensor model parallelism is disabled\"), and so does autoplan")
    gated = r.has("--swiglu") or r.has("--quick-geglu")
    moot = {"--no-bias-gelu-fusion": gated or r.has("--squared-relu") or r.has("--disable-bias-linear"),
            "--no-bias-swiglu-fusion": not gated}  # mlp.py fuses bias + GELU only with a bias, SwiGLU when gated
    for flag, effect in _EFFECTS.items():
        if r.has(flag) and not moot.get(flag, False):
            notes.append(f"{flag}: {effect}")
    group = r.int("--microbatch-group-size-per-virtual-pipeline-stage")
    if group is not None and group != pp:
        notes.append(f"--microbatch-group-size-per-virtual-pipeline-stage {group}: autoplan's interleaved schedule "
                     "picks its own round length (torch's Interleaved1F1B); the one priced may differ")
    _capacity_note(r, notes)
    for flag, (want, why) in _UNPRICED_SETTINGS.items():
        v = r.value(flag)
        if v is not None and v != want:
            notes.append(f"{flag} {v}: {why}")
    unpriced = sorted(k for k in flags if k not in _READ and (k not in _EFFECTS or moot.get(k, False))
                      and k not in _SCRIPT_DEFAULTS.get(script, {}))
    knobs = {**_stack_knobs(r, dtype), **_optimizer_state(r, dtype, notes)}
    if r.has("--deepspeed"):  # DeepSpeed's engine, not Megatron's DDP and optimizer: the megatron-deepspeed stack's
        for k in ("overlap_grad_reduce", "overlap_param_gather", "align_grad_reduce", "grad_reduce_dtype"):
            knobs.pop(k, None)
    if layout is not None:  # the Megatron that takes these flags runs uneven stages, whichever --stack is chosen
        knobs["uneven_stages"] = True
    return MegatronRun(parallel=parallel, seq_len=seq, dtype=dtype, stack_set=knobs,
                       global_batch=r.int("--global-batch-size"), model=shaped, gpus=_launcher_gpus(launcher),
                       notes=notes, unpriced=unpriced, stack="megatron-deepspeed" if r.has("--deepspeed") else None)
