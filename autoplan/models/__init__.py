"""The model layer: one entry point from any `--model` source to the nn.Module that is captured, planned and run.

    autoplan.models.load(source, *, init_from=None, device="cpu", seed=0) -> nn.Module   (tokens -> logits)

`source` is anything `--model` accepts:
  * a preset name or a model spec file (YAML/JSON)  -> the zoo's TransformerLM (the "zoo" family)
  * a Hugging Face config.json, its directory, or a config dict -> `blocks.CausalLM`, the family's own
    architecture (arch.FAMILIES: llama, mistral, mixtral, qwen2, qwen2_moe, gemma, gemma2, phi3, gpt2,
    gpt_neox, opt), every forward-relevant config field honoured or refused (`UnsupportedConfigError`)
  * `package.module:factory` (or `path/file.py:factory`) -> the module the factory returns (factory.FactoryModel:
    materialised and seeded if built on meta; forward returns the logits)

`init_from=DIR` loads a Hugging Face safetensors checkpoint (hf_weights); its config must describe the same model.
Weights are otherwise initialised deterministically by (seed, parameter name), as the runtime does.
torch is imported lazily: the planner imports `autoplan.models.arch` only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .arch import (
    FAMILIES,
    Arch,
    Unsupported,
    UnsupportedConfigError,
    arch_from_hf,
    check,
    read_hf_config,
    spec_activation,
)

__all__ = ["FAMILIES", "Arch", "Unsupported", "UnsupportedConfigError", "arch_from_hf", "check", "hf_config_of",
           "is_factory", "load", "build", "read_hf_config", "resolve_arch"]


def is_factory(ref: str) -> bool:
    return ":" in ref and not Path(ref).exists() and not ref.endswith(".json")


def hf_config_of(source: Any) -> dict | None:
    """The raw HF config dict when `source` is one (dict, config.json or a directory holding one), else None."""
    if isinstance(source, dict):
        return source if ("model_type" in source or "architectures" in source) else None
    if not isinstance(source, (str, Path)):
        return None
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    if not (p.is_file() and p.suffix == ".json"):
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and ("model_type" in data or "architectures" in data) else None


def resolve_arch(source: Any) -> Arch | None:
    """The Arch of a Hugging Face source, None for presets/spec files/factories."""
    if isinstance(source, Arch):
        return source
    cfg = hf_config_of(source)
    return arch_from_hf(cfg) if cfg is not None else None


def build(source: Any, *, device="cpu", seed: int = 0):
    """The module for `source` with deterministic weights (nothing allocated on device="meta")."""
    import torch

    arch = resolve_arch(source)
    if arch is not None:
        from .blocks import CausalLM, init_weights

        with torch.device(device):
            model = CausalLM(arch)
        if torch.device(device).type != "meta":
            init_weights(model, seed)
        return model
    if isinstance(source, str) and is_factory(source):
        from .factory import build_factory

        return build_factory(source, device=device, seed=seed)
    from autoplan.specs import load_model
    from autoplan.zoo import build_model

    return build_model(load_model(source), device=device, seed=seed)


def load(source: Any, *, init_from: str | Path | None = None, device="cpu", seed: int = 0):
    """An nn.Module mapping input_ids (b, s) to logits (b, s, V) for `source` (see the module docstring)."""
    model = build(source, device=device if init_from is None else "meta", seed=seed)
    if init_from is not None:
        load_hf_weights(model, init_from, device=device)
    return model


def load_hf_weights(model, directory: str | Path, *, device="cpu") -> None:
    """Fill a CausalLM (possibly on meta) from a HF checkpoint directory; its config must match the model's."""
    import torch

    from autoplan.cost_models.errors import SpecError

    from . import hf_weights
    from .blocks import CausalLM

    if not isinstance(model, CausalLM):
        raise SpecError("--init-from loads Hugging Face checkpoints into Hugging Face architectures",
                        f"the model is {type(model).__name__}", "pass --model DIR/config.json (the checkpoint's)")
    check_same_arch(model.arch, directory)
    shapes = {n: p.shape for n, p in model.state_dict().items()}
    state = hf_weights.load_full(directory, model.arch, shapes)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        if model.arch.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
    with torch.no_grad():
        for n, p in model.state_dict().items():
            if n in state:
                p.copy_(state[n])


def check_same_arch(arch: Arch, directory: str | Path) -> None:
    """The checkpoint's config.json describes `arch` (same forward pass), else SpecError naming the fields."""
    from autoplan.cost_models.errors import SpecError

    other = resolve_arch(Path(directory))
    if other is None:
        raise SpecError(f"{directory} has no Hugging Face config.json", "cannot check it is the plan's model",
                        "pass the directory written by save_pretrained or autoplan export-weights")
    diff = [f for f in arch.__dataclass_fields__ if f != "hf_config" and getattr(arch, f) != getattr(other, f)]
    if diff:
        f = diff[0]
        raise SpecError(f"the checkpoint in {directory} is another model than the one planned",
                        f"{f}: planned {getattr(arch, f)!r}, checkpoint {getattr(other, f)!r}"
                        + (f" (+{len(diff) - 1} more fields)" if len(diff) > 1 else ""),
                        "plan with --model DIR/config.json of this checkpoint")


def init_weights(model, seed: int = 0) -> None:
    """Deterministic (seed, name) initialisation of a zoo or Hugging Face-family model (or a pipeline stage of
    one); the runtime calls it after materialising a meta-device stage."""
    from .blocks import CausalLM

    if isinstance(model, CausalLM):
        from .blocks import init_weights as init_hf

        init_hf(model, seed)
    else:
        from autoplan.zoo import init_weights as init_zoo

        init_zoo(model, seed)


class LayoutSpec:
    """What codegen's layout tables read from a ModelSpec (position, activation, norm, MoE layers), answered
    from an Arch, so tensor parallelism follows the real module tree (irregular MoE layers, Gemma 2's
    sandwich norms, a gated MLP whatever the activation)."""

    def __init__(self, arch: Arch) -> None:
        self.arch = arch
        self.position = arch.position
        self.activation = spec_activation(arch.gated_mlp, arch.act)
        self.norm = arch.norm
        self.sandwich_norms = arch.sandwich_norms
        self.residual = arch.residual
        self.final_norm = arch.final_norm
        self.moe = arch.moe
        self.tie_embeddings = arch.tie_embeddings
        self.num_layers = arch.num_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.arch.is_moe_layer(i)


def layout_spec(plan):
    """The plan's model as codegen's tables read it: the ModelSpec for the zoo, a LayoutSpec for HF families."""
    src = plan.model_source or {}
    if "hf_config" in src:
        return LayoutSpec(arch_from_hf(src["hf_config"]))
    return plan.model


def check_plan_model(plan) -> None:
    """Start-up check of `autoplan run` (before any process group): the plan's recorded model can be built as
    planned. Refuses unsupported config fields (UnsupportedConfigError), a config whose sizes differ from the
    plan's ModelSpec, and layouts the family's attention cannot take (context parallelism with windows,
    soft-caps or a non-default scale, which the cp attention core does not implement)."""
    from autoplan.cost_models.errors import ConfigError, PlanError

    if plan.model.position == "alibi":
        raise PlanError(f"plan {plan.short_hash}: autoplan's runtime has no ALiBi attention",
                        f"model {plan.model.name} has position: alibi (priced for estimates of runs such as BLOOM)",
                        "estimate it with autoplan estimate/search; to train, use position rope or learned")
    src = plan.model_source or {}
    if "factory" in src:
        from .factory import check_factory_plan

        check_factory_plan(plan)
        return
    if "hf_config" not in src:
        return
    arch = arch_from_hf(src["hf_config"])
    m = plan.model
    for name, planned, built in (("num_layers", m.num_layers, arch.num_layers),
                                 ("hidden_size", m.hidden_size, arch.hidden_size),
                                 ("num_attention_heads", m.num_attention_heads, arch.num_heads),
                                 ("kv_heads", m.kv_heads, arch.num_kv_heads),
                                 ("vocab_size", m.vocab_size, arch.vocab_size)):
        if planned != built:
            raise PlanError("the plan's model summary and its recorded Hugging Face config disagree",
                            f"{name}: summary {planned}, config {built}", "re-plan with autoplan search")
    c = plan.parallel
    if c.cp > 1:
        why = [f for f, bad in (("sliding_window", any(arch.is_sliding(i) for i in range(arch.num_layers))),
                                ("attn_logit_softcapping", arch.attn_softcap is not None),
                                ("query_pre_attn_scalar", arch.attn_scale is not None)) if bad]
        if why:
            raise ConfigError(f"context parallelism does not implement {arch.family}'s {why[0]}",
                              f"cp={c.cp}", "re-plan with --fix cp=1")
