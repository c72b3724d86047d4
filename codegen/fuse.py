"""Fused-kernel substitution: replace norm and activation modules of a (zoo) model by `autoplan.kernels.modules`.

`substitute_kernels(model, "fused")` finds what it can fuse; `substitute_kernels(model, {path: class_name})`
applies an explicit table (what the emitted stage source passes, from codegen.program.kernel_substitutions).
The replacements share the original parameters, so weights, names and optimizer state are unchanged. A
missing `autoplan.kernels.modules` (or a class it does not have) is skipped with a note, never an error.
"""

from __future__ import annotations

from torch import nn


def _fusable(model: nn.Module) -> dict[str, str]:
    from autoplan.zoo.model import Activation

    table = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.RMSNorm):
            table[name] = "FusedRMSNorm"
        elif isinstance(m, nn.LayerNorm):
            table[name] = "FusedLayerNorm"
        elif isinstance(m, Activation) and m.kind in ("swiglu", "gelu"):
            table[name] = "FusedSwiGLU" if m.kind == "swiglu" else "FusedGELU"
    return table


def _replacement(mod, cls_name: str, old: nn.Module) -> nn.Module | None:
    cls = getattr(mod, cls_name, None)
    if cls is None:
        return None
    if cls_name in ("FusedRMSNorm", "FusedLayerNorm"):
        return cls.from_torch(old)
    if cls_name == "FusedGELU":
        return cls(approximate="tanh")  # the zoo's GeLU is the tanh approximation (GPT-2/Megatron)
    return cls()


def substitute_kernels(model: nn.Module, mode: str | dict[str, str]) -> list[str]:
    """Replace modules in place; returns one note per substitution (or why none happened)."""
    if mode == "torch" or not mode:
        return []
    table = _fusable(model) if mode == "fused" else dict(mode)
    try:
        import autoplan.kernels.modules as km
    except Exception as e:  # kernels not installed or broken: keep torch modules
        return [f"autoplan.kernels.modules unavailable ({type(e).__name__}): torch modules kept"]
    notes = []
    for path, cls_name in table.items():
        parent_path, _, leaf = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path) if parent_path else model
            old = getattr(parent, leaf)
        except AttributeError:
            notes.append(f"{path}: not in this model, skipped")
            continue
        new = _replacement(km, cls_name, old)
        if new is None:
            notes.append(f"{path}: kernels.modules has no {cls_name}, kept {type(old).__name__}")
            continue
        setattr(parent, leaf, new)
        notes.append(f"{path}: {type(old).__name__} -> {cls_name}")
    return notes
