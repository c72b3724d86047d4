"""The architecture of a Hugging Face causal LM as data: every config field that changes the forward pass.

Why a separate, torch-free description: the planner warns about fields it cannot honour without building a
model, the runtime refuses them before launch, and the model builder (`autoplan.models.blocks`) reads only this
record, never the raw config. Each family is one function below (`_llama`, `_gemma2`, `_gpt2`, ...) that maps
its config's field names onto the shared switches; the table `FAMILIES` lists them.

A field the blocks cannot honour is reported as an `Unsupported` (field, value, reason): `check(cfg)` returns
them (search/estimate print warnings) and `arch_from_hf(cfg)` raises `UnsupportedConfigError` naming the first.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplan.cost_models.errors import AutoplanError, SpecError


class UnsupportedConfigError(AutoplanError):
    """A Hugging Face config field that changes the forward pass and that autoplan's blocks cannot honour."""

    kind = "unsupported model config"


@dataclass(frozen=True)
class Unsupported:
    field: str
    value: Any
    reason: str

    def error(self, family: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(
            f"{family}: config field {self.field}={self.value!r} is not supported", self.reason,
            "use a config without it, or add it to autoplan/models (docs/models.md: adding a family)")


@dataclass(frozen=True)
class MoEArch:
    num_experts: int
    top_k: int
    expert_ffn: int
    norm_topk: bool = True  # Mixtral renormalises the top-k probabilities; Qwen2-MoE only if norm_topk_prob
    shared_ffn: int = 0  # Qwen2-MoE shared expert (0 = none), gated by sigmoid(shared_expert_gate(x))
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense MLP


@dataclass(frozen=True)
class Arch:
    """Everything the blocks need. Names follow autoplan's module layout (see blocks.py)."""

    family: str  # model_type, e.g. "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    max_positions: int
    norm: str = "rmsnorm"  # rmsnorm | rmsnorm_plus1 (Gemma: x * (1 + w)) | layernorm
    norm_eps: float = 1e-6
    norm_bias: bool = True  # LayerNorm only
    norm_affine: bool = True  # LayerNorm only (OPT layer_norm_elementwise_affine)
    act: str = "silu"  # silu | gelu | gelu_tanh | relu
    gated_mlp: bool = True  # w2(act(w1 x) * w3 x) vs w2(act(w1 x))
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    position: str = "rope"  # rope | learned
    pos_offset: int = 0  # OPT stores positions 2.. (padding offset)
    rope_theta: float = 10000.0
    rotary_dim: int = 0  # dims rotated (partial rotary: GPT-NeoX, Phi); 0 = head_dim
    rope_type: str = "default"  # default | linear | llama3
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max: int = 8192  # llama3
    attn_scale: float | None = None  # None = head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: tanh(scores / c) * c
    final_softcap: float | None = None  # Gemma 2 logits
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    residual: str = "pre"  # pre | parallel (GPT-NeoX) | post (OPT do_layer_norm_before=False)
    sandwich_norms: bool = False  # Gemma 2: post-attention and post-feedforward norms on each branch
    embed_scale: float = 1.0  # Gemma: sqrt(hidden), applied in the activation dtype
    final_norm: bool = True
    tie_embeddings: bool = False
    pad_token_id: int | None = None  # HF embeddings keep the padding row's gradient at zero
    moe: MoEArch | None = None
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)  # normalised config (for export)

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention" and bool(self.sliding_window)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]


# ------------------------------------------------------------------------------------- config reading


def read_hf_config(source: str | Path | dict) -> dict:
    """A config.json path, its directory, or a dict -> the config normalised by transformers (defaults filled,
    rope fields gathered into rope_parameters). transformers is the `hf` extra."""
    if isinstance(source, dict):
        raw = copy.deepcopy(source)  # transformers writes into nested dicts (rope_scaling) it is given
    else:
        p = Path(source)
        if p.is_dir():
            p = p / "config.json"
        try:
            raw = json.loads(p.read_text())
        except OSError as e:
            raise SpecError(f"cannot read {p}", e.strerror or str(e), "check the path") from None
        except json.JSONDecodeError as e:
            raise SpecError(f"{p} is not valid JSON", str(e), "fix the file") from None
    mtype = raw.get("model_type")
    if mtype not in FAMILIES:
        raise UnsupportedConfigError(
            f"model_type {mtype!r} is not a supported family", f"supported: {', '.join(sorted(FAMILIES))}",
            "train it as a module:factory, or add the family to autoplan/models (docs/models.md)")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise SpecError("reading a Hugging Face config needs transformers", "not installed",
                        "pip install 'autoplan[hf]'") from None
    kw = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    cfg = AutoConfig.for_model(mtype, **kw).to_dict()
    cfg["model_type"] = mtype
    return cfg


def hf_rope_theta(cfg: dict) -> float:
    """The rotary base of a Hugging Face config, raw or normalised: rope_parameters (transformers 5), rope_theta,
    or GPT-NeoX's rotary_emb_base; 10000 when none is given (every family's default)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    value = params.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", 10000.0)))
    try:
        theta = float(value)
    except (TypeError, ValueError):
        raise SpecError("Hugging Face config: rope_theta must be a number", f"got {value!r}",
                        "fix rope_theta in config.json") from None
    if not theta > 0:
        raise SpecError("Hugging Face config: rope_theta must be positive", f"got {value!r}",
                        "fix rope_theta in config.json")
    return theta


def _rope(cfg: dict, head_dim: int, problems: list[Unsupported]) -> dict:
    rp = dict(cfg.get("rope_parameters") or {})
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    out: dict[str, Any] = {"rope_theta": hf_rope_theta(cfg)}
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0
    out["rotary_dim"] = int(head_dim * prf)
    if rtype == "linear":
        out.update(rope_type="linear", rope_factor=float(rp["factor"]))
    elif rtype == "llama3":
        out.update(rope_type="llama3", rope_factor=float(rp["factor"]),
                   rope_low_freq_factor=float(rp["low_freq_factor"]),
                   rope_high_freq_factor=float(rp["high_freq_factor"]),
                   rope_original_max=int(rp["original_max_position_embeddings"]))
    elif rtype != "default":
        problems.append(Unsupported("rope_parameters.rope_type", rtype,
                                    "rotary scaling implemented: default, linear, llama3"))
    return out


def _layer_types(cfg: dict, n: int) -> tuple[str, ...]:
    lt = cfg.get("layer_types")
    return tuple(lt) if lt else ("full_attention",) * n


def _common(cfg: dict, problems: list[Unsupported]) -> dict:
    """Fields named alike across the Llama-like families."""
    h, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or h // nh)
    n = int(cfg["num_hidden_layers"])
    out = dict(
        vocab_size=int(cfg["vocab_size"]), hidden_size=h, num_layers=n, num_heads=nh,
        num_kv_heads=int(cfg.get("num_key_value_heads") or nh), head_dim=hd,
        ffn_size=int(cfg.get("intermediate_size") or 4 * h),
        max_positions=int(cfg.get("max_position_embeddings") or 2048),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), act=_act(cfg.get("hidden_act", "silu"), problems),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), pad_token_id=cfg.get("pad_token_id"),
        attn_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        layer_types=_layer_types(cfg, n), sliding_window=cfg.get("sliding_window") or None,
    )
    out.update(_rope(cfg, hd, problems))
    if int(cfg.get("pretraining_tp", 1) or 1) != 1:
        problems.append(Unsupported("pretraining_tp", cfg["pretraining_tp"], "sliced linears are not implemented"))
    return out


_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
         "gelu_fast": "gelu_tanh", "relu": "relu", "relu2": "relu2"}


def spec_activation(gated: bool, act: str) -> str:
    """ModelSpec.activation of an MLP (the cost model's kinds): swiglu when gated, relu / relu2 as they are, else
    gelu (the GeLU variants cost alike)."""
    return "swiglu" if gated else (act if act in ("relu", "relu2") else "gelu")


def _act(name: str, problems: list[Unsupported]) -> str:
    if name not in _ACTS:
        problems.append(Unsupported("hidden_act", name, f"activations implemented: {', '.join(sorted(_ACTS))}"))
        return "silu"
    return _ACTS[name]


# ---------------------------------------------------------------------------------------------- families


def _llama(cfg: dict, p: list[Unsupported]) -> dict:
    c = _common(cfg, p)
    bias = bool(cfg.get("attention_bias", False))
    return dict(c, qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


def _mistral(cfg: dict, p: list[Unsupported]) -> dict:
    c = _common(cfg, p)
    if c["sliding_window"]:  # MistralModel masks every layer with the window when sliding_window is set
        c["layer_types"] = ("sliding_attention",) * c["num_layers"]
    return c


def _qwen2(cfg: dict, p: list[Unsupported]) -> dict:
    c = _common(cfg, p)  # Qwen2Config turns use_sliding_window/max_window_layers into layer_types
    return dict(c, qkv_bias=bool(cfg.get("qkv_bias", True)))


def _mixtral(cfg: dict, p: list[Unsupported]) -> dict:
    c = _mistral(cfg, p)
    if float(cfg.get("router_jitter_noise", 0.0) or 0.0):
        p.append(Unsupported("router_jitter_noise", cfg["router_jitter_noise"], "router noise is not implemented"))
    n = c["num_layers"]
    moe = MoEArch(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                  expert_ffn=c["ffn_size"], norm_topk=True, sparse_layers=(True,) * n)
    return dict(c, moe=moe)


def _qwen2_moe(cfg: dict, p: list[Unsupported]) -> dict:
    c = _qwen2(cfg, p)
    n, step = c["num_layers"], int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    ne = int(cfg.get("num_experts") or 0)
    sparse = tuple(i not in dense and ne > 0 and (i + 1) % step == 0 for i in range(n))
    moe = MoEArch(num_experts=ne, top_k=int(cfg["num_experts_per_tok"]), expert_ffn=int(cfg["moe_intermediate_size"]),
                  norm_topk=bool(cfg.get("norm_topk_prob", False)),
                  shared_ffn=int(cfg.get("shared_expert_intermediate_size") or 0), sparse_layers=sparse)
    return dict(c, moe=moe)


def _gemma(cfg: dict, p: list[Unsupported]) -> dict:
    c = _common(cfg, p)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    bias = bool(cfg.get("attention_bias", False))
    return dict(c, norm="rmsnorm_plus1", act=_act(act, p), embed_scale=math.sqrt(c["hidden_size"]),
                qkv_bias=bias, o_bias=bias)


def _gemma2(cfg: dict, p: list[Unsupported]) -> dict:
    c = _gemma(cfg, p)
    if cfg.get("use_bidirectional_attention"):
        p.append(Unsupported("use_bidirectional_attention", True, "only causal attention is implemented"))
    return dict(c, sandwich_norms=True, attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
                attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"))


def _phi3(cfg: dict, p: list[Unsupported]) -> dict:
    c = _common(cfg, p)
    if c["sliding_window"]:  # Phi3Model masks every layer with the window when it is set
        c["layer_types"] = ("sliding_attention",) * c["num_layers"]
    return dict(c, resid_dropout=float(cfg.get("resid_pdrop", 0.0) or 0.0),
                embd_dropout=float(cfg.get("embd_pdrop", 0.0) or 0.0))


def _gpt2(cfg: dict, p: list[Unsupported]) -> dict:
    h, nh, n = int(cfg["n_embd"]), int(cfg["n_head"]), int(cfg["n_layer"])
    if cfg.get("scale_attn_by_inverse_layer_idx"):
        p.append(Unsupported("scale_attn_by_inverse_layer_idx", True, "per-layer attention scaling not implemented"))
    if cfg.get("add_cross_attention"):
        p.append(Unsupported("add_cross_attention", True, "decoder-only models only"))
    # reorder_and_upcast_attn only changes the precision of the scores (fp32 upcast): exact in fp32 runs.
    return dict(
        vocab_size=int(cfg["vocab_size"]), hidden_size=h, num_layers=n, num_heads=nh, num_kv_heads=nh,
        head_dim=h // nh, ffn_size=int(cfg.get("n_inner") or 4 * h), max_positions=int(cfg["n_positions"]),
        norm="layernorm", norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        act=_act(cfg.get("activation_function", "gelu_new"), p), gated_mlp=False, qkv_bias=True, o_bias=True,
        mlp_bias=True, position="learned", attn_scale=None if cfg.get("scale_attn_weights", True) else 1.0,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attn_dropout=float(cfg.get("attn_pdrop", 0.0)), resid_dropout=float(cfg.get("resid_pdrop", 0.0)),
        embd_dropout=float(cfg.get("embd_pdrop", 0.0)), layer_types=("full_attention",) * n,
    )


def _gpt_neox(cfg: dict, p: list[Unsupported]) -> dict:
    c = _common(cfg, p)
    bias = bool(cfg.get("attention_bias", True))
    return dict(c, norm="layernorm", norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), gated_mlp=False,
                qkv_bias=bias, o_bias=bias, mlp_bias=True, num_kv_heads=c["num_heads"],
                residual="parallel" if cfg.get("use_parallel_residual", True) else "pre",
                resid_dropout=float(cfg.get("hidden_dropout", 0.0) or 0.0), sliding_window=None)


def _opt(cfg: dict, p: list[Unsupported]) -> dict:
    h, nh, n = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    if int(cfg.get("word_embed_proj_dim") or h) != h:
        p.append(Unsupported("word_embed_proj_dim", cfg["word_embed_proj_dim"],
                             f"embedding projections (project_in/project_out) are not implemented (hidden {h})"))
    if float(cfg.get("layerdrop", 0.0) or 0.0):
        p.append(Unsupported("layerdrop", cfg["layerdrop"], "layer drop is not implemented"))
    pre = bool(cfg.get("do_layer_norm_before", True))
    bias = bool(cfg.get("enable_bias", True))
    return dict(
        vocab_size=int(cfg["vocab_size"]), hidden_size=h, num_layers=n, num_heads=nh, num_kv_heads=nh,
        head_dim=h // nh, ffn_size=int(cfg["ffn_dim"]), max_positions=int(cfg["max_position_embeddings"]),
        norm="layernorm", norm_eps=1e-5, norm_affine=bool(cfg.get("layer_norm_elementwise_affine", True)),
        act=_act(cfg.get("activation_function", "relu"), p), gated_mlp=False, qkv_bias=bias, o_bias=bias,
        mlp_bias=bias, position="learned", pos_offset=2, residual="pre" if pre else "post",
        final_norm=pre and not cfg.get("_remove_final_layer_norm", False),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), pad_token_id=cfg.get("pad_token_id"),
        attn_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0), resid_dropout=float(cfg.get("dropout", 0.0)),
        layer_types=("full_attention",) * n,
    )


FAMILIES: dict[str, Callable[[dict, list[Unsupported]], dict]] = {
    "llama": _llama, "mistral": _mistral, "mixtral": _mixtral, "qwen2": _qwen2, "qwen2_moe": _qwen2_moe,
    "gemma": _gemma, "gemma2": _gemma2, "phi3": _phi3, "gpt2": _gpt2, "gpt_neox": _gpt_neox, "opt": _opt,
}


def _map(cfg: dict) -> tuple[Arch, list[Unsupported]]:
    problems: list[Unsupported] = []
    fields = FAMILIES[cfg["model_type"]](cfg, problems)
    arch = Arch(family=cfg["model_type"], hf_config=cfg, **fields)
    if arch.layer_types and len(arch.layer_types) != arch.num_layers:
        problems.append(Unsupported("layer_types", len(arch.layer_types), f"needs {arch.num_layers} entries"))
    if arch.num_heads % arch.num_kv_heads:
        problems.append(Unsupported("num_key_value_heads", arch.num_kv_heads,
                                    f"must divide num_attention_heads={arch.num_heads}"))
    return arch, problems


def read_arch(source: str | Path | dict) -> tuple[Arch, list[Unsupported]]:
    """The Arch of a Hugging Face config and the fields autoplan cannot honour (exports describe the model
    either way; the runtime refuses the second list)."""
    return _map(read_hf_config(source))


def check(source: str | Path | dict) -> list[Unsupported]:
    """The config fields autoplan cannot honour (empty when the model runs as transformers defines it)."""
    return read_arch(source)[1]


def arch_from_hf(source: str | Path | dict) -> Arch:
    """The Arch of a Hugging Face config; UnsupportedConfigError names the first field that cannot be honoured."""
    arch, problems = read_arch(source)
    if problems:
        raise problems[0].error(arch.family)
    return arch
