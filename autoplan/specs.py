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
)

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
            raise SpecError(f"{where}: field {loc!r}: {first['msg']}", f"got {first.get('input')!r}"[:120],
                            f"fix {loc} ({len(errs)} problem(s) in all)") from None
        raise SpecError(f"{where}: invalid", str(e)) from None


# ---------------------------------------------------------------------------------------------- models


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
        raise SpecError(f"unknown model {ref!r}", "not a preset and no such file",
                        "run `autoplan models` for presets, or pass a spec/config.json path")
    data = _read_mapping(path)
    if "model_type" in data or "architectures" in data:
        return model_from_hf_config(data, name=path.parent.name or path.stem)
    data.setdefault("name", path.stem)
    return _validated(ModelSpec, data, str(path))


def _hf_get(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def model_from_hf_config(cfg: dict[str, Any], name: str = "hf-model") -> ModelSpec:
    """Map a Hugging Face config (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, Mixtral field names) to a ModelSpec."""
    mtype = str(cfg.get("model_type", "")).lower()
    name = cfg.get("_name_or_path") or name
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
    activation = "swiglu" if gated else ("relu" if act == "relu" else "gelu")
    rope = mtype not in ("gpt2", "opt", "bloom") and "n_positions" not in cfg
    norm = "rmsnorm" if ("rms_norm_eps" in cfg or mtype in ("llama", "mistral", "qwen2", "mixtral")) else "layernorm"
    if mtype == "gpt_neox":
        norm, rope = "layernorm", True
    moe = None
    n_exp = _hf_get(cfg, "num_local_experts", "num_experts")
    if n_exp and int(n_exp) > 1:
        moe = MoESpec(num_experts=int(n_exp), top_k=int(_hf_get(cfg, "num_experts_per_tok", "top_k", default=2)),
                      expert_ffn_hidden_size=_hf_get(cfg, "moe_intermediate_size", default=ffn))
    data = dict(
        name=str(name), num_layers=int(layers), hidden_size=int(hidden), num_attention_heads=int(heads),
        num_kv_heads=int(kv), head_dim=_hf_get(cfg, "head_dim"), ffn_hidden_size=int(ffn) if ffn else None,
        vocab_size=int(vocab), max_seq_length=int(seq), activation=activation, norm=norm,
        position="rope" if rope else "learned",
        tie_embeddings=bool(_hf_get(cfg, "tie_word_embeddings", default=mtype == "gpt2")),
        bias=bool(_hf_get(cfg, "attention_bias", "use_bias", default=mtype in ("gpt2", "gpt_neox"))),
        moe=moe,
    )
    return _validated(ModelSpec, data, f"Hugging Face config {name}")


# -------------------------------------------------------------------------------------------- clusters


def load_cluster(ref: str | Path | ClusterSpec, gpus: int | None = None) -> ClusterSpec:
    """A preset name or a YAML cluster file (which may name a GPU preset and override single fields)."""
    if isinstance(ref, ClusterSpec):
        cluster = ref
    elif str(ref).lower() in CLUSTER_PRESETS:
        cluster = cluster_preset(str(ref))
    else:
        path = Path(str(ref))
        if not path.exists():
            raise SpecError(f"unknown cluster {ref!r}", "not a preset and no such file",
                            "run `autoplan clusters` for presets, or pass a YAML cluster file")
        cluster = cluster_from_mapping(_read_mapping(path), where=str(path))
    return cluster.with_gpus(gpus) if gpus else cluster


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
