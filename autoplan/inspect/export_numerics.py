"""What a plan's own model computes, beyond its shape, in the exported frameworks' terms.

A plan's `model` (ModelSpec) holds what the cost model prices: layers, widths, heads, the kind of MLP. A model
given as a Hugging Face config also fixes numerics that cost nothing but change training: the rotary base
(500,000 for Llama 3 against Megatron's default 10,000), rotary scaling, the norm epsilon, which linears carry
a bias (Qwen2: the QKV projection alone), the MLP activation, dropout per site, sliding windows. autoplan's
runtime builds the model from that config (`autoplan.models.arch`); an export that left them to the framework's
defaults would train another model, silently. Here the config's `Arch` becomes Megatron-LM flags, or the
comment lines a torchtitan user registers a flavour from, and every feature the framework cannot express
becomes a warning.
"""

from __future__ import annotations

import math

from ..cost_models.errors import AutoplanError
from ..plan import Plan

Flag = tuple[str, object]

SQUARED_RELU_WARNING = "the MLP uses ReLU; Megatron has no plain ReLU MLP: exported --squared-relu (ReLU squared)"

# Megatron-LM's llama3 rotary scaling fixes these (megatron/core/models/common/embeddings/
# rotary_pos_embedding.py, RotaryEmbedding._apply_scaling defaults); only the factor is a flag.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def plan_arch(plan: Plan, warnings: list[str], framework: str):
    """The `Arch` of the plan's Hugging Face config, or None (a zoo model: the shape is the whole model; a
    user's module: a warning says its numerics are the framework's defaults)."""
    src = plan.model_source or {}
    if "factory" in src:
        warnings.append(f"the plan's model is your module {src['factory']}: {framework} builds its own model from "
                        "the shape, with its default numerics (rotary base, norm epsilon, biases, activation, "
                        "dropout); compare them with your module")
        return None
    cfg = src.get("hf_config")
    if cfg is None:
        return None
    from ..models.arch import read_arch

    try:
        arch, problems = read_arch(cfg)
    except AutoplanError as e:  # transformers missing: the config cannot be normalised
        warnings.append(f"the plan's model is a Hugging Face config whose numerics (rotary base, norm epsilon, "
                        f"biases) were not read ({e.rule}: {e.detail}); exported with {framework}'s defaults. "
                        f"{e.hint}")
        return None
    for p in problems:
        warnings.append(f"{arch.family} config field {p.field}={p.value!r}: autoplan's runtime cannot honour it "
                        f"either ({p.reason})")
    return arch


def layer_pattern(bits: list[int]) -> str:
    """A per-layer 0/1 list as the shortest Python list expression Megatron's *_freq arguments evaluate."""
    n = len(bits)
    for period in range(1, n + 1):
        if n % period == 0 and bits == bits[:period] * (n // period):
            body = "[" + ",".join(map(str, bits[:period])) + "]"
            return body if period == n else f"{body}*{n // period}"
    raise AssertionError("unreachable: the whole list is its own period")


def pattern_bits(text: str) -> list[int] | None:
    """A per-layer 0/1 list from a list expression of ints with + and * (Megatron's pattern arguments,
    "([0]*3+[1])*4"; `layer_pattern`'s inverse), computed without running it; None for anything else."""
    import ast

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add) and isinstance(a, list) and isinstance(b, list):
                return a + b
            if isinstance(node.op, ast.Mult) and isinstance(a, list) != isinstance(b, list):
                k = b if isinstance(a, list) else a
                if 0 <= k <= 100_000:
                    return a * k if isinstance(a, list) else b * k
        raise ValueError(node)
    try:
        value = ev(ast.parse(text.strip(), mode="eval"))
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(value, list) or not all(isinstance(x, int) and x in (0, 1) for x in value):
        return None
    return value


def rotary_base_flag(theta: float, warnings: list[str]) -> Flag:
    """Megatron's --rotary-base (an int, default 10000) for a rotary base; a warning where it must round."""
    if theta != int(theta):
        warnings.append(f"rope_theta={theta:g}: Megatron's --rotary-base is an integer: exported {round(theta)}")
    return ("--rotary-base", int(round(theta)))


def _megatron_rope(arch, warnings: list[str]) -> list[Flag]:
    f: list[Flag] = [rotary_base_flag(arch.rope_theta, warnings)]
    if arch.rot_dim != arch.head_dim:
        f.append(("--rotary-percent", arch.rot_dim / arch.head_dim))
    if arch.rope_type == "linear":
        if arch.rope_factor == int(arch.rope_factor):
            f.append(("--rotary-seq-len-interpolation-factor", int(arch.rope_factor)))
        else:
            warnings.append(f"linear rotary scaling by {arch.rope_factor:g}: Megatron's "
                            "--rotary-seq-len-interpolation-factor is an integer: not exported")
    elif arch.rope_type == "llama3":
        f += [("--use-rope-scaling", None), ("--rope-scaling-factor", arch.rope_factor)]
        have = {"low_freq_factor": arch.rope_low_freq_factor, "high_freq_factor": arch.rope_high_freq_factor,
                "original_max_position_embeddings": arch.rope_original_max}
        off = {k: v for k, v in have.items() if v != MEGATRON_LLAMA3_ROPE[k]}
        if off:
            warnings.append(f"llama3 rotary scaling with {off}: Megatron fixes "
                            f"{ {k: MEGATRON_LLAMA3_ROPE[k] for k in off} } (only the factor is a flag)")
    return f


def _megatron_mlp(arch, warnings: list[str]) -> list[Flag]:
    if arch.gated_mlp:
        if arch.act != "silu":
            warnings.append(f"the MLP is gated by {arch.act} (GeGLU); Megatron's gated MLP flag is --swiglu "
                            "(SiLU): exported SwiGLU, another activation")
        return [("--swiglu", None)]
    if arch.act == "gelu_tanh":
        return [("--openai-gelu", None)]  # Megatron's tanh approximation (transformer/utils.py gelu_impl)
    if arch.act == "relu":
        warnings.append(SQUARED_RELU_WARNING)
        return [("--squared-relu", None)]
    if arch.act == "relu2":
        return [("--squared-relu", None)]
    if arch.act == "silu":
        warnings.append("the MLP is SiLU without a gate; Megatron has no such flag: exported its default GeLU")
    return []


def _megatron_bias(arch, warnings: list[str]) -> list[Flag]:
    """Megatron biases every linear (its default), none (--disable-bias-linear), or the QKV projection alone
    (--disable-bias-linear --add-qkv-bias)."""
    have = (arch.qkv_bias, arch.o_bias, arch.mlp_bias)
    if all(have):
        return []
    if not any(have):
        return [("--disable-bias-linear", None)]
    if arch.qkv_bias:
        if arch.o_bias or arch.mlp_bias:
            warnings.append(f"biases on qkv={arch.qkv_bias} o={arch.o_bias} mlp={arch.mlp_bias}: Megatron biases all "
                            "linears, none or QKV alone: exported QKV alone")
        return [("--disable-bias-linear", None), ("--add-qkv-bias", None)]
    warnings.append(f"biases on o={arch.o_bias} mlp={arch.mlp_bias} without QKV: Megatron biases all linears, none "
                    "or QKV alone: exported none")
    return [("--disable-bias-linear", None)]


def _megatron_window(arch) -> list[Flag]:
    sliding = [arch.is_sliding(i) for i in range(arch.num_layers)]
    if not any(sliding):
        return []
    # autoplan (as transformers) lets a query see the `window` keys ending at itself; flash attention's
    # (left, right) window counts the keys before it: left = window - 1, right = 0
    f: list[Flag] = [("--window-size", f"({arch.sliding_window - 1},0)")]
    if not all(sliding):  # Megatron's list form: 1 = sliding-window layer, 0 = full attention
        f.append(("--window-attn-skip-freq", layer_pattern([int(x) for x in sliding])))
    return f


def _unexpressible(arch) -> list[str]:
    """Features of the config no Megatron GPT (or torchtitan llama3) flag expresses."""
    out = []
    if arch.attn_scale is not None and not math.isclose(arch.attn_scale, arch.head_dim ** -0.5):
        out.append(f"attention scale {arch.attn_scale:.6g} (not 1/sqrt(head_dim))")
    if arch.attn_softcap:
        out.append(f"attention logit soft-capping {arch.attn_softcap:g}")
    if arch.final_softcap:
        out.append(f"final logit soft-capping {arch.final_softcap:g}")
    if arch.sandwich_norms:
        out.append("post-attention and post-MLP norms (sandwich)")
    if arch.embed_scale != 1.0:
        out.append(f"embeddings scaled by {arch.embed_scale:.6g}")
    if arch.residual != "pre":
        out.append(f"{arch.residual} residual")
    if arch.norm == "layernorm" and not (arch.norm_bias and arch.norm_affine):
        out.append("LayerNorm without bias or affine weights")
    return out


def megatron_model_numerics(plan: Plan, warnings: list[str]) -> list[Flag] | None:
    """Flags for the activation, biases, dropout and numerics of the plan's Hugging Face config; None for a
    model that is its shape (the caller exports its ModelSpec's activation, bias and dropout)."""
    arch = plan_arch(plan, warnings, "Megatron-LM")
    if arch is None:
        return None
    f = _megatron_mlp(arch, warnings) + _megatron_bias(arch, warnings)
    if arch.norm == "rmsnorm_plus1":
        f.append(("--apply-layernorm-1p", None))  # x * (1 + w), zero-centred gamma
    f.append(("--norm-epsilon", arch.norm_eps))
    if arch.position == "rope":
        f += _megatron_rope(arch, warnings)
    f += _megatron_window(arch)
    # Megatron drops out the embeddings with --hidden-dropout too
    f += [("--hidden-dropout", arch.resid_dropout), ("--attention-dropout", arch.attn_dropout)]
    if arch.embd_dropout != arch.resid_dropout:
        warnings.append(f"embedding dropout {arch.embd_dropout:g} differs from the residual dropout "
                        f"{arch.resid_dropout:g}; Megatron uses --hidden-dropout for both")
    if arch.moe is not None:
        f += _megatron_moe(arch)
    bad = _unexpressible(arch)
    if bad:
        warnings.append(f"{plan.model.name} has {', '.join(bad)}: Megatron's GPT model has no flag for "
                        f"{'it' if len(bad) == 1 else 'them'}; the exported run trains another model")
    return f


def _megatron_moe(arch) -> list[Flag]:
    moe = arch.moe
    f: list[Flag] = []
    if not moe.norm_topk:  # softmax over all experts, then the top k unrenormalised (Qwen2-MoE)
        f.append(("--moe-router-pre-softmax", None))
    if moe.shared_ffn:
        f += [("--moe-shared-expert-intermediate-size", moe.shared_ffn), ("--moe-shared-expert-gate", None)]
    if not all(moe.sparse_layers):  # 1 = MoE layer, 0 = dense
        f.append(("--moe-layer-freq", layer_pattern([int(x) for x in moe.sparse_layers])))
    return f


def titan_model_notes(plan: Plan, warnings: list[str]) -> list[str]:
    """Comment lines with the numerics a torchtitan flavour of the plan's Hugging Face config must carry, and
    warnings for what torchtitan's llama3 model cannot express."""
    arch = plan_arch(plan, warnings, "torchtitan")
    if arch is None:
        return []
    rope = f"rope_theta={arch.rope_theta:g}"
    if arch.rope_type != "default":
        rope += (f" rope_scaling={arch.rope_type} factor={arch.rope_factor:g} low_freq_factor="
                 f"{arch.rope_low_freq_factor:g} high_freq_factor={arch.rope_high_freq_factor:g} "
                 f"original_max_position_embeddings={arch.rope_original_max}")
    bad = _unexpressible(arch)
    if arch.qkv_bias or arch.o_bias or arch.mlp_bias:
        bad.append("linear biases")
    if any(arch.is_sliding(i) for i in range(arch.num_layers)):
        bad.append(f"sliding-window attention ({arch.sliding_window})")
    if not arch.gated_mlp or arch.act != "silu":  # torchtitan's llama3 MLP is SwiGLU
        bad.append(f"{'gated ' if arch.gated_mlp else ''}{arch.act} MLP")
    if arch.attn_dropout or arch.resid_dropout or arch.embd_dropout:
        bad.append("dropout")
    if bad:
        warnings.append(f"{plan.model.name} has {', '.join(bad)}: torchtitan's llama3 model has none of them; "
                        "the exported run trains another model")
    return [f"model numerics (register the flavour with them): {rope} norm_eps={arch.norm_eps:g}"]
