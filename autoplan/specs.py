"""Loading specs: presets, YAML/JSON spec files and Hugging Face `config.json` files.

The spec classes themselves live in `autoplan.cost_models.specs` (the cost model may import nothing else of ours);
they are re-exported here so users write `from autoplan.specs import ModelSpec`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from autoplan.cost_models.errors import AutoplanError, ConfigError, SpecError
from autoplan.cost_models.hardware import CLUSTER_PRESETS, GPU_PRESETS, cluster_preset, gpu_preset
from autoplan.cost_models.specs import (
    ClusterSpec,
    GPUCalibration,
    GPUSpec,
    LinkSpec,
    ModelSpec,
    MoESpec,
    ParallelConfig,
    TrainingSpec,
    check_config,
    moe_layer_spacing,
)

from .models.arch import hf_rope_theta, spec_activation
from .presets import MODEL_PRESETS

__all__ = [
    "AutoplanError", "ConfigError", "SpecError", "ClusterSpec", "GPUCalibration", "GPUSpec", "LinkSpec",
    "ModelSpec", "MoESpec", "ParallelConfig", "TrainingSpec", "check_config", "load_model", "load_cluster",
    "model_from_hf_config", "MODEL_PRESETS", "CLUSTER_PRESETS", "GPU_PRESETS",
]


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read {path}", e.strerror or str(e), "check the path") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise SpecError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}",
                        str(e).splitlines()[0], "fix the syntax") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path} must hold a mapping", f"got {type(data).__name__}", "see DESIGN.md for the format")
    return data


def _validated(cls: type, data: dict[str, Any], where: str):
    try:
        return cls(**data)
    except AutoplanError:
        raise
    except Exception as e:  # pydantic.ValidationError -> one line naming the field
        errs = e.errors() if hasattr(e, "errors") else []
        if errs:
            first = errs[0]
            loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
            more = f" ({len(errs)} problems in all)" if len(errs) > 1 else ""
            if first.get("type") == "missing":
                raise SpecError(f"{where}: field {loc!r} is required", "missing",
                                f"add {loc}: <value> (see DESIGN.md's spec format){more}") from None
            got = first.get("input")
            got = repr(got) if not isinstance(got, dict | list) else f"a {type(got).__name__}"
            raise SpecError(f"{where}: field {loc!r}: {first['msg'].lower()}", f"got {got[:80]}",
                            f"correct {loc}{more}") from None
        raise SpecError(f"{where}: invalid", str(e)) from None


# ---------------------------------------------------------------------------------------------- models


def _did_you_mean(ref: str, names) -> str:
    """' (did you mean 'x'?)' for the presets close to a name that is neither a preset nor a file (spelling, or a
    part of the name: 'cpu' -> 'local-cpu'), else ''."""
    import difflib

    key = ref.lower()
    close = difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)
    close += [n for n in names if len(key) >= 3 and key in n and n not in close]
    return " (did you mean " + " or ".join(repr(n) for n in close[:3]) + "?)" if close else ""


def load_model(ref: str | Path | ModelSpec) -> ModelSpec:
    """A preset name, a YAML/JSON model spec, or a Hugging Face config.json."""
    if isinstance(ref, ModelSpec):
        return ref
    ref = str(ref)
    if ref in MODEL_PRESETS:
        return MODEL_PRESETS[ref]
    if ref.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[ref.lower()]
    path = Path(ref)
    if not path.exists():
        raise SpecError(f"unknown model {ref!r}", "not a preset and no such file" + _did_you_mean(ref, MODEL_PRESETS),
                        "run `autoplan models` for presets, or pass a spec/config.json path")
    data = _read_mapping(path)
    if "model_type" in data or "architectures" in data:
        return model_from_hf_config(data, name=hf_config_name(path))
    data.setdefault("name", path.stem)
    return _validated(ModelSpec, data, str(path))


def _hf_get(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


# Hugging Face model types that are bidirectional encoders or encoder-decoders: not causal language models,
# so autoplan's cost model (causal attention, next-token loss over a decoder stack) does not describe them.
_NON_CAUSAL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "distilbert", "albert", "electra", "deberta", "deberta-v2",
    "mpnet", "camembert", "ernie", "modernbert", "nomic_bert", "longformer", "big_bird", "funnel", "convbert",
    "squeezebert", "layoutlm", "mobilebert", "t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian",
    "whisper", "vit", "clip",
})


def _check_causal(cfg: dict[str, Any], mtype: str, name: str) -> None:
    archs = [str(a) for a in cfg.get("architectures") or []]
    causal_arch = any(a.endswith(("CausalLM", "LMHeadModel")) for a in archs)
    encoder_arch = archs and not causal_arch and all(
        a.endswith(("MaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                    "ForPreTraining", "Model", "ForConditionalGeneration", "ForMultipleChoice")) for a in archs)
    if mtype in _NON_CAUSAL_TYPES or cfg.get("is_encoder_decoder") or (encoder_arch and not causal_arch):
        what = "an encoder-decoder" if cfg.get("is_encoder_decoder") else "a bidirectional encoder"
        raise SpecError("autoplan plans decoder-only causal language models",
                        f"{name}: model_type {mtype or '?'!r} ({', '.join(archs) or 'no architectures'}) is {what}",
                        "pass a decoder-only (GPT/Llama-style) config.json or a model spec")


def _hf_int(cfg: dict[str, Any], value: Any, what: str) -> int:
    """An integer field of a HF config, or a one-line error naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        ok = False
    else:
        try:
            ok = float(value) == int(float(value))
        except ValueError:
            ok = False
    if not ok:
        key = next((k for k, v in cfg.items() if v is value), what)
        raise SpecError(f"Hugging Face config field {key!r} must be an integer", f"got {value!r}",
                        f"write e.g. \"{key}\": 4096") from None
    return int(float(value))


def hf_config_name(path: Path) -> str:
    """A Hugging Face config's model name: its checkpoint folder's for a config.json (`Meta-Llama-3-8B/config.json`),
    else the file's own (`llama8b.json`)."""
    if path.name == "config.json":
        return path.resolve().parent.name or path.stem
    return path.stem


def model_from_hf_config(cfg: dict[str, Any], name: str = "hf-model") -> ModelSpec:
    """Map a Hugging Face config (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, Mixtral field names) to a ModelSpec."""
    mtype = str(cfg.get("model_type", "")).lower()
    name = cfg.get("_name_or_path") or name
    _check_causal(cfg, mtype, str(name))
    layers = _hf_get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _hf_get(cfg, "hidden_size", "n_embd", "d_model")
    heads = _hf_get(cfg, "num_attention_heads", "n_head")
    vocab = _hf_get(cfg, "vocab_size")
    missing = [k for k, v in {"layers": layers, "hidden size": hidden, "heads": heads, "vocab_size": vocab}.items()
               if v is None]
    if missing:
        raise SpecError(f"Hugging Face config ({mtype or 'unknown type'}) lacks {', '.join(missing)}",
                        f"keys present: {sorted(cfg)[:12]}", "pass a complete config.json or a model spec file")
    kv = _hf_get(cfg, "num_key_value_heads", default=heads)
    seq = _hf_get(cfg, "max_position_embeddings", "n_positions", "n_ctx", "seq_length", default=2048)
    ffn = _hf_get(cfg, "intermediate_size", "n_inner", "ffn_dim")
    act = str(_hf_get(cfg, "hidden_act", "activation_function", default="gelu")).lower()
    gated = mtype in ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "gemma", "gemma2", "qwen3") or act in ("silu", "swish")
    activation = spec_activation(gated, act)
    rope = mtype not in ("gpt2", "opt", "bloom") and "n_positions" not in cfg
    norm = "rmsnorm" if ("rms_norm_eps" in cfg or mtype in ("llama", "mistral", "qwen2", "mixtral")) else "layernorm"
    if mtype == "gpt_neox":
        norm, rope = "layernorm", True
    moe = None
    n_exp = _hf_get(cfg, "num_local_experts", "num_experts")
    if n_exp and _hf_int(cfg, n_exp, "num_local_experts") > 1:
        # Qwen2-MoE's sparse layers: every decoder_sparse_step-th (`(layer_idx + 1) % decoder_sparse_step == 0`,
        # transformers' Qwen2MoeDecoderLayer) outside mlp_only_layers
        n_layers = _hf_int(cfg, layers, "num_hidden_layers")
        step = _hf_int(cfg, cfg.get("decoder_sparse_step") or 1, "decoder_sparse_step")
        dense = set(cfg.get("mlp_only_layers") or [])
        spacing = moe_layer_spacing([i not in dense and (i + 1) % step == 0 for i in range(n_layers)])
        if spacing is None:
            raise SpecError("the config has experts but no MoE layer", f"{name}: decoder_sparse_step={step}, "
                            f"mlp_only_layers={sorted(dense)}", "check the config's MoE keys")
        moe = MoESpec(num_experts=_hf_int(cfg, n_exp, "num_local_experts"),
                      top_k=_hf_int(cfg, _hf_get(cfg, "num_experts_per_tok", "top_k", default=2), "num_experts_per_tok"),
                      expert_ffn_hidden_size=_hf_get(cfg, "moe_intermediate_size", default=ffn), **spacing)
    data = dict(
        name=str(name), num_layers=_hf_int(cfg, layers, "num_hidden_layers"),
        hidden_size=_hf_int(cfg, hidden, "hidden_size"), num_attention_heads=_hf_int(cfg, heads, "num_attention_heads"),
        num_kv_heads=_hf_int(cfg, kv, "num_key_value_heads"), head_dim=_hf_get(cfg, "head_dim"),
        ffn_hidden_size=_hf_int(cfg, ffn, "intermediate_size") if ffn else None,
        vocab_size=_hf_int(cfg, vocab, "vocab_size"), max_seq_length=_hf_int(cfg, seq, "max_position_embeddings"), activation=activation, norm=norm,
        position="rope" if rope else "learned",
        tie_embeddings=bool(_hf_get(cfg, "tie_word_embeddings", default=mtype == "gpt2")),
        rope_theta=hf_rope_theta(cfg) if rope else 10000.0,
        bias=bool(_hf_get(cfg, "attention_bias", "use_bias", default=mtype in ("gpt2", "gpt_neox"))),
        moe=moe,
    )
    return _validated(ModelSpec, data, f"Hugging Face config {name}")


# -------------------------------------------------------------------------------------------- clusters


def load_cluster(ref: str | Path | ClusterSpec, gpus: int | None = None, *, notes: list[str] | None = None
                 ) -> ClusterSpec:
    """A preset name or a YAML cluster file (which may name a GPU preset and override single fields).

    `gpus` resizes it: a preset is a template and grows or shrinks to any whole number of nodes (a line in
    `notes` says when it grows past the preset's size); a file that states `num_nodes` describes a real
    cluster, so asking for more GPUs than it has is an error; a file without `num_nodes` takes it from `gpus`."""
    if gpus is not None and (isinstance(gpus, bool) or gpus <= 0):
        raise SpecError("--gpus must be a positive GPU count", f"got {gpus}", "pass e.g. --gpus 64")
    if isinstance(ref, ClusterSpec):
        cluster = ref
    elif str(ref).lower() in CLUSTER_PRESETS:
        cluster = cluster_preset(str(ref))
        if gpus is not None and gpus > cluster.num_gpus and notes is not None:
            notes.append(f"--gpus {gpus} grows preset {cluster.name} from {cluster.num_gpus} to {gpus} GPUs "
                         f"({-(-gpus // cluster.gpus_per_node)} nodes of {cluster.gpus_per_node})")
    else:
        path = Path(str(ref))
        if not path.exists():
            raise SpecError(f"unknown cluster {ref!r}", "not a preset and no such file" +
                            _did_you_mean(str(ref), CLUSTER_PRESETS),
                            "run `autoplan clusters` for presets, or pass a YAML cluster file")
        data = _read_mapping(path)
        sized = "num_nodes" in data or isinstance(data.get("base"), str)  # the file says how big it is
        if not sized:
            if gpus is None:
                raise SpecError(f"{path}: field 'num_nodes' is required", "missing and no --gpus given",
                                "add num_nodes: N to the file, or pass --gpus")
            per = data.get("gpus_per_node")
            if isinstance(per, int) and per > 0:
                data["num_nodes"] = max(1, -(-gpus // per))  # with_gpus below checks whole nodes
        cluster = cluster_from_mapping(data, where=str(path))
        if gpus is not None and gpus > cluster.num_gpus and sized:
            raise SpecError(f"--gpus {gpus} is more than {path} has",
                            f"num_nodes={cluster.num_nodes} x {cluster.gpus_per_node} = {cluster.num_gpus} GPUs",
                            f"raise num_nodes in the file, drop num_nodes to size it from --gpus, or pass "
                            f"--gpus <= {cluster.num_gpus}")
    return cluster.with_gpus(gpus) if gpus is not None else cluster


def cluster_from_mapping(data: dict[str, Any], where: str = "cluster") -> ClusterSpec:
    data = dict(data)
    base: ClusterSpec | None = None
    if isinstance(data.get("base"), str):
        base = cluster_preset(data.pop("base"))
    gpu = data.get("gpu")
    if isinstance(gpu, str):
        data["gpu"] = gpu_preset(gpu)
    elif isinstance(gpu, dict):
        g = dict(gpu)
        if isinstance(g.get("preset"), str):  # a preset with single fields overridden
            merged = gpu_preset(g.pop("preset")).model_dump()
            merged.update(g)
            g = merged
        g.setdefault("name", "custom-gpu")
        data["gpu"] = _validated(GPUSpec, g, f"{where}: gpu")
    if base is not None:
        merged = base.model_dump()
        merged.update({k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in data.items()})
        data = merged
    data.setdefault("name", Path(where).stem)
    return _validated(ClusterSpec, data, where)
