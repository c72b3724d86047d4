"""Read a NeMo training config into Megatron-LM's flags, so that `megatron_import.read_megatron` reads it.

NeMo's published runs (its performance summaries, NeMo-Framework-Launcher's `conf/training/<family>/<model>.yaml`)
are configs, not command lines. Their `model` keys are Megatron-Core's TransformerConfig / ModelParallelConfig
fields under NeMo's names (NeMo's `build_transformer_config` copies them), so each is written as the Megatron flag
that sets the same field, and one reader (Megatron's defaults, the vocabulary padding, the stack knobs) serves
both. The launcher's Hydra interpolations that the keys read use are resolved (`${.key}`, `${model.key}`,
`${training.model.key}`, `${multiply:a,b}`, `${divide_ceil:a,b}`, `${divide_floor:a,b}`); any other is refused
with the key to set instead. Keys not read are listed (priced as if absent), never dropped silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from autoplan.cost_models.errors import ConfigError, SpecError

# NeMo key -> Megatron flag taking the value as it is
_VALUE_FLAGS = {
    "micro_batch_size": "--micro-batch-size", "global_batch_size": "--global-batch-size",
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size", "expert_model_parallel_size": "--expert-model-parallel-size",
    "encoder_seq_length": "--seq-length", "max_position_embeddings": "--max-position-embeddings",
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "kv_channels": "--kv-channels",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by", "hidden_dropout": "--hidden-dropout",
    "attention_dropout": "--attention-dropout", "rotary_base": "--rotary-base",
    "num_moe_experts": "--num-experts", "moe_router_topk": "--moe-router-topk",
    "moe_expert_capacity_factor": "--moe-expert-capacity-factor", "moe_token_dispatcher_type":
    "--moe-token-dispatcher-type",
}
# NeMo's activation names (nemo/collections/nlp/modules/common/megatron/utils.py) -> Megatron's flag
_ACTIVATIONS = {"gelu": None, "fast-swiglu": "--swiglu", "swiglu": "--swiglu", "squared-relu": "--squared-relu",
                "relu2": "--squared-relu"}
# Gated MLPs whose pointwise is not SiLU: the same three matrices, a pointwise of the same kind; priced as SwiGLU
_GATED = ("geglu", "fast-geglu", "reglu", "fast-reglu")
# NeMo's FSDP sharding strategies (nemo/collections/nlp/parts/nlp_overrides.py NLPFSDPStrategy) as Megatron's
_FSDP = {"full": "optim_grads_params", "grad": "optim_grads"}
# Keys read here beyond _VALUE_FLAGS; every other `model` key is listed as not priced.
_READ = {"virtual_pipeline_model_parallel_size", "num_query_groups", "activation", "normalization", "bias",
         "position_embedding_type", "share_embeddings_and_output_weights", "sequence_parallel",
         "activations_checkpoint_granularity", "activations_checkpoint_method", "activations_checkpoint_num_layers",
         "fp8", "fp8_hybrid", "fp8_e4m3", "ub_tp_comm_overlap", "overlap_p2p_comm", "cross_entropy_loss_fusion",
         "tokenizer", "optim", "mcore_gpt", "transformer_engine", "use_flash_attention", "megatron_amp_O2",
         "fp8_params", "gradient_accumulation_fusion", "fsdp", "fsdp_sharding_strategy", "bias_activation_fusion",
         "bias_dropout_add_fusion", "apply_rope_fusion", "moe_pad_expert_input_to_capacity", "window_size"}


@dataclass
class NemoConfig:
    """A NeMo config as Megatron's words, and what reading it noticed."""

    words: list[str]
    gpus: int | None  # trainer.num_nodes x trainer.devices
    notes: list[str] = field(default_factory=list)
    unpriced: list[str] = field(default_factory=list)  # `model` keys not read: priced as if absent
    stack_set: dict[str, object] = field(default_factory=dict)  # knobs no Megatron flag sets (the optimizer state)


def load_nemo(path: str | Path, sets: list[str] | None = None) -> dict:
    """The YAML at `path` (a launcher training config or NeMo's own: a mapping with `model`), with `sets`
    (`model.optim.grad_sync_dtype=bf16`, as Hydra overrides) applied."""
    import yaml

    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise SpecError("cannot read the NeMo config", f"{path}: {e.strerror}", "pass an existing YAML file") from None
    except yaml.YAMLError as e:
        raise SpecError("the NeMo config is not valid YAML", f"{path}: {str(e).splitlines()[0]}",
                        "fix the YAML") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise SpecError("not a NeMo training config", f"{path} has no `model:` mapping",
                        "pass a NeMo-Framework-Launcher conf/training/<family>/<model>.yaml or NeMo's model config")
    for item in sets or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set takes KEY=VALUE", f"got {item!r}", "write e.g. --set model.fp8=true")
        node = cfg
        *parents, leaf = key.strip().lstrip("+").split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError("--set names a key below a value", f"{key}", "name a mapping's key")
        node[leaf] = yaml.safe_load(raw) if raw.strip() else None
    return cfg


def _split_args(text: str) -> list[str]:
    """The top-level comma-separated arguments of a resolver call (nested `${...}` kept whole)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    return [*out, cur.strip()]


def _literal(text: str) -> object:
    """A resolver argument: a nested interpolation as written, else its YAML value (`4` -> 4)."""
    import yaml

    return text if "${" in text else yaml.safe_load(text)


class _Resolver:
    """The launcher's interpolations that the read keys use, resolved against the config (see the docstring)."""

    _OPS = {"multiply": lambda a, b: a * b, "divide_ceil": lambda a, b: math.ceil(a / b),
            "divide_floor": lambda a, b: a // b}

    def __init__(self, root: dict) -> None:
        self.root = root
        self.model = root["model"]

    def value(self, key: str, raw: object, depth: int = 0) -> object:
        if not isinstance(raw, str) or "${" not in raw:
            return raw
        text = raw.strip()
        if depth > 8 or not (text.startswith("${") and text.endswith("}")):
            raise self._refuse(key, raw)
        inner = text[2:-1]
        name, colon, args = inner.partition(":")
        if colon and name in self._OPS:
            parts = _split_args(args)
            if len(parts) != 2:
                raise self._refuse(key, raw)
            a, b = (self._number(key, self.value(key, _literal(x), depth + 1)) for x in parts)
            return self._OPS[name](a, b)
        if colon:
            raise self._refuse(key, raw)
        return self.value(key, self._lookup(key, raw, inner), depth + 1)

    def _lookup(self, key: str, raw: str, ref: str) -> object:
        if ref.startswith("."):
            node, path = self.model, ref[1:].split(".")
        else:
            path = ref.split(".")
            if path[0] == "training":  # the launcher nests the training config under `training`
                path = path[1:]
            node = self.root
        for p in path:
            if not isinstance(node, dict) or p not in node:
                raise self._refuse(key, raw)
            node = node[p]
        return node

    def _number(self, key: str, v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"NeMo key {key}: an interpolation's argument is not a number", f"got {v!r}",
                              f"set it with --set model.{key}=VALUE")
        return v

    @staticmethod
    def _refuse(key: str, raw: object) -> ConfigError:
        return ConfigError(f"NeMo key {key} is an interpolation autoplan does not resolve", f"{key}: {raw}",
                           f"set it with --set model.{key}=VALUE")


def _precision(trainer: dict) -> str | None:
    p = str(trainer.get("precision", "32")).lower()
    if p in ("bf16", "bf16-mixed"):
        return "--bf16"
    if p in ("16", "16-mixed", "fp16"):
        return "--fp16"
    if p in ("32", "32-true", "fp32"):
        return None
    raise ConfigError("unknown trainer.precision", f"got {p}", "use bf16, 16 or 32")


def _kernel_words(get, act: str) -> list[str]:
    """The Megatron flags of the `model` keys that turn a kernel fusion off, a padded MoE dispatch on, a sliding
    window, fp8 weights, or the fused weight-gradient accumulation off: the reader prices or notes each."""
    words: list[str] = []
    if get("bias_activation_fusion") is False and ("glu" in act or act == "gelu"):  # relu2 has no fused kernel
        words.append("--no-bias-swiglu-fusion" if "glu" in act else "--no-bias-gelu-fusion")
    if get("bias_dropout_add_fusion") is False:
        words.append("--no-bias-dropout-fusion")
    if get("apply_rope_fusion") is False and str(get("position_embedding_type", "")).lower() == "rope":
        words.append("--no-rope-fusion")
    if get("gradient_accumulation_fusion") is False:
        words.append("--no-gradient-accumulation-fusion")
    if get("moe_pad_expert_input_to_capacity"):
        words.append("--moe-pad-expert-input-to-capacity")
    window = get("window_size")
    if window is not None:
        words += ["--window-size", ",".join(str(v) for v in window) if isinstance(window, list) else str(window)]
    if get("fp8_params"):
        words.append("--fp8-param-gather")
    return words


def nemo_words(cfg: dict, vocab_size: int | None = None) -> NemoConfig:
    """`cfg` (`load_nemo`) as Megatron-LM's flags; `vocab_size` where the tokenizer is not Megatron's GPT-2 BPE
    (NeMo takes the vocabulary from the tokenizer file, which the config only names)."""
    r = _Resolver(cfg)
    model = cfg["model"]
    notes: list[str] = []

    def get(key: str, default: object = None) -> object:
        return r.value(key, model.get(key, default))

    words: list[str] = []
    for key, flag in _VALUE_FLAGS.items():
        v = get(key)
        if v is not None:
            words += [flag, str(v)]
    vp = get("virtual_pipeline_model_parallel_size")
    if vp is not None and int(vp) > 1:
        words += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
    groups, heads = get("num_query_groups"), get("num_attention_heads")
    if groups is not None and groups != heads:
        words += ["--group-query-attention", "--num-query-groups", str(groups)]
    act = str(get("activation", "gelu")).lower()
    if act in _GATED:
        notes.append(f"activation {act}: a gated MLP, priced as SwiGLU (the same three matrices, a pointwise of the "
                     "same kind)")
        words.append("--swiglu")
    elif act not in _ACTIVATIONS:
        raise ConfigError("NeMo activation autoplan does not price", f"activation: {act}",
                          "use gelu, swiglu, squared-relu or a gated geglu / reglu")
    else:
        words += [_ACTIVATIONS[act]] if _ACTIVATIONS[act] else []
    words += _kernel_words(get, act)
    norm = str(get("normalization", "layernorm")).lower()
    if norm == "rmsnorm":
        words += ["--normalization", "RMSNorm"]
    elif norm == "layernorm1p":
        notes.append("normalization layernorm1p (LayerNorm with a zero-centred gain): priced as LayerNorm, which "
                     "does the same work")
    elif norm != "layernorm":
        raise ConfigError("NeMo normalization autoplan does not price", f"normalization: {norm}",
                          "use layernorm or rmsnorm")
    if get("bias", True) is False:
        words.append("--disable-bias-linear")
    pos = str(get("position_embedding_type", "learned_absolute")).lower()
    if pos == "rope":
        words += ["--position-embedding-type", "rope"]
    elif pos != "learned_absolute":
        raise ConfigError("NeMo position embedding autoplan does not price", f"position_embedding_type: {pos}",
                          "use learned_absolute or rope")
    if get("share_embeddings_and_output_weights", True) is False:
        words.append("--untie-embeddings-and-output-weights")
    if get("sequence_parallel"):
        words.append("--sequence-parallel")
    if get("fsdp"):
        strategy = str(get("fsdp_sharding_strategy") or "full")
        if strategy not in _FSDP:
            raise ConfigError("NeMo FSDP sharding autoplan does not price", f"fsdp_sharding_strategy: {strategy}",
                              "use full (ZeRO-3) or grad (ZeRO-2); hybrid sharding is not expressible")
        notes.append(f"fsdp (NeMo's torch FSDP, {strategy} sharding): priced as Megatron's torch FSDP2 with the "
                     "same sharding")
        words += ["--use-torch-fsdp2", "--data-parallel-sharding-strategy", _FSDP[strategy]]
    granularity = get("activations_checkpoint_granularity")
    if granularity is not None:
        words += ["--recompute-granularity", str(granularity)]
        if granularity == "full":
            words += ["--recompute-method", str(get("activations_checkpoint_method") or "uniform"),
                      "--recompute-num-layers", str(get("activations_checkpoint_num_layers") or 1)]
    precision = _precision(cfg.get("trainer") or {})
    if get("fp8"):
        words += ["--fp8-format", "hybrid" if get("fp8_hybrid") or not get("fp8_e4m3") else "e4m3"]
    if precision:
        words.append(precision)
    if get("ub_tp_comm_overlap"):
        words.append("--tp-comm-overlap")
    if get("overlap_p2p_comm") is False and vp is not None and int(vp) > 1:
        words.append("--no-overlap-p2p-communication")  # Megatron-Core's default under interleaving is on
    if get("cross_entropy_loss_fusion"):
        words.append("--cross-entropy-loss-fusion")
    if get("use_flash_attention") is False:
        words += ["--attention-backend", "fused" if get("transformer_engine") else "unfused"]
    if get("mcore_gpt") is False:
        notes.append("mcore_gpt false (NeMo's own transformer): priced as Megatron-Core's")
    words += _optim_words(r, model.get("optim") or {}, notes)
    words += _tokenizer_words(model.get("tokenizer") or {}, vocab_size)
    trainer = cfg.get("trainer") or {}
    nodes, devices = trainer.get("num_nodes"), trainer.get("devices")
    gpus = int(nodes) * int(devices) if isinstance(nodes, int) and isinstance(devices, int) else None
    unpriced = sorted(k for k in model if k not in _VALUE_FLAGS and k not in _READ)
    state = _optimizer_state(r, model, precision, notes)
    return NemoConfig(words=words, gpus=gpus, notes=notes, unpriced=unpriced, stack_set=state)


def _optimizer_state(r: _Resolver, model: dict, precision: str | None, notes: list[str]) -> dict[str, object]:
    """How apex's DistributedFusedAdam holds the state as NeMo sets it up (megatron_base_model.py
    setup_optimization, the same at v2.0.0rc0, 2024-06, NeMo 24.07's): its `dtype` (optim.dtype, default fp32) for
    the moments, and the master by store_params / store_param_remainders, which NeMo chooses where the config does
    not: kept (fp8_params), none (the optimizer's dtype is the weights': stepped in place), the fp32 master's low
    16 bits (fp32 over bf16 weights), else kept in `dtype`. The weights are 16-bit under megatron_amp_O2.
    Megatron-Core's optimizer (mcore_distributed_optim) reads none of these keys (modelPT.py
    setup_megatron_optimization): fp32 master and moments, the stack's default."""
    optim = model.get("optim") or {}
    name = str(optim.get("name", ""))
    raw = str(r.value("optim.dtype", optim.get("dtype", "fp32"))).lower()
    dtypes = {"fp32": "fp32", "float32": "fp32", "32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
              "fp16": "fp16", "float16": "fp16", "16": "fp16"}
    if raw not in dtypes:
        raise ConfigError("NeMo optim.dtype autoplan does not price", f"got {raw}", "use fp32 or bf16")
    opt = dtypes[raw]
    if name != "distributed_fused_adam":
        if opt != "fp32":
            notes.append(f"optim.dtype {raw}: {name or 'this optimizer'} does not read it (fp32 state priced)")
        return {}
    moments = "fp32" if opt == "fp32" else "bf16"
    if not r.value("megatron_amp_O2", model.get("megatron_amp_O2", False)):
        notes.append("megatron_amp_O2 false (fp32 weights under autocast): priced with 16-bit weights and an fp32 "
                     "master copy, as O2 holds them")
        return {"optimizer_dtype": moments, "master_weights": "fp32"}
    weights = {"--bf16": "bf16", "--fp16": "fp16"}.get(precision or "", "fp32")
    store = r.value("optim.store_params", optim.get("store_params"))
    remainders = bool(r.value("optim.store_param_remainders", optim.get("store_param_remainders", False)))
    if store is None:
        if r.value("fp8_params", model.get("fp8_params", False)):
            store = True
        elif opt == weights:
            store = False
        elif opt == "fp32" and weights == "bf16":
            store, remainders = False, True
        else:
            store = True
    if store:
        master = "fp32" if opt == "fp32" else "bf16"
    else:
        master = "remainders" if remainders else "in-place"
    return {"optimizer_dtype": moments, "master_weights": master}


def _optim_words(r: _Resolver, optim: dict, notes: list[str]) -> list[str]:
    """NeMo's distributed optimizers (apex's distributed_fused_adam, Megatron-Core's mcore_distributed_optim) are
    Megatron's --use-distributed-optimizer; they reduce gradients in fp32 unless grad_sync_dtype says otherwise
    (nemo/core/optim/distributed_adam.py: "grad_sync_dtype ... default: same as dtype", the optimizer's dtype fp32)."""
    name = str(optim.get("name", ""))
    if name not in ("distributed_fused_adam", "mcore_distributed_optim"):
        if name:
            notes.append(f"optim.name {name}: no distributed optimizer (zero=0)")
        return []
    words = ["--use-distributed-optimizer"]
    if r.value("optim.overlap_grad_sync", optim.get("overlap_grad_sync", False)):
        words.append("--overlap-grad-reduce")
    if r.value("optim.overlap_param_sync", optim.get("overlap_param_sync", False)):
        words.append("--overlap-param-gather")
    # apex's default is the optimizer's dtype; Megatron-Core's DDP reduces in fp32 unless told (NeMo's
    # megatron_gpt_model.py: grad_reduce_in_fp32=(optim.get('grad_sync_dtype', 'fp32') == 'fp32'))
    default = optim.get("dtype", "fp32") if name == "distributed_fused_adam" else "fp32"
    dtype = str(r.value("optim.grad_sync_dtype", optim.get("grad_sync_dtype", default))).lower()
    if dtype in ("bf16", "bfloat16"):
        words.append("--grad-reduce-in-bf16")
    elif dtype not in ("fp32", "float32", "32"):
        raise ConfigError("NeMo optim.grad_sync_dtype autoplan does not price", f"got {dtype}", "use fp32 or bf16")
    return words


def _tokenizer_words(tok: dict, vocab_size: int | None) -> list[str]:
    if vocab_size is not None:
        return ["--vocab-size", str(vocab_size)]
    if str(tok.get("library", "")).lower() == "megatron" and tok.get("type") == "GPT2BPETokenizer":
        return ["--tokenizer-type", "GPT2BPETokenizer"]
    raise SpecError("the NeMo config names its tokenizer by file, which sets the vocabulary",
                    f"tokenizer library {tok.get('library')!r}, model {tok.get('model')!r}",
                    "pass --vocab-size N (e.g. 32000 for Llama 2, 128256 for Llama 3, 256000 for Nemotron-4)")
