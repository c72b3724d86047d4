"""`package.module:factory` models at run time: the module the factory returns is the module that trains.

The factory (the same one capture calls: it returns (module, example_inputs), often on the meta device) is called
with the run's seed set; a meta-device module is materialised and every submodule's own `reset_parameters` runs
in a fixed order under that seed, so every rank holds the same initial weights (what FSDP's param_init_fn does).
`FactoryModel` wraps it for the runtime: forward returns the logits tensor (a `.logits` attribute or the first
element of a tuple is taken), and `layers` names the repeated blocks (the largest ModuleList/ModuleDict) that
FSDP wraps one by one.

This version shards user modules with data parallelism only (replicate, FSDP ZeRO-1/2/3); tensor, pipeline,
context and expert parallelism and recomputation need autoplan's module layout and are refused before launch
(`check_factory_plan`), naming the module and the reason.
"""

from __future__ import annotations

import torch
from torch import nn


class FactoryModel(nn.Module):
    def __init__(self, module: nn.Module, ref: str) -> None:
        super().__init__()
        self.module = module
        self.ref = ref
        self.positions = None  # the runtime's context-parallel hook (unused: cp is refused)

    @property
    def layers(self) -> dict[str, nn.Module]:
        """The repeated blocks: children of the largest ModuleList/ModuleDict (FSDP units), else none."""
        best: nn.Module | None = None
        for m in self.module.modules():
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and (best is None or len(m) > len(best)):
                best = m
        if best is None:
            return {}
        items = best.items() if isinstance(best, nn.ModuleDict) else enumerate(best)
        return {str(k): v for k, v in items}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.module(tokens)
        if hasattr(out, "logits"):
            return out.logits
        if isinstance(out, (tuple, list)):
            return out[0]
        return out


def build_factory(ref: str, *, device="cpu", seed: int = 0) -> FactoryModel:
    from autoplan.capture import load_module_factory

    torch.manual_seed(seed)
    module, _inputs = load_module_factory(ref)
    if torch.device(device).type == "meta":
        return FactoryModel(module.to("meta"), ref)
    if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
        module = module.to_empty(device=device)
        torch.manual_seed(seed)
        with torch.no_grad():
            for m in module.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
    else:
        module = module.to(device)
    return FactoryModel(module, ref)


def check_factory_plan(plan) -> None:
    """Refuse, before launch, what this version cannot do to a user module (see the module docstring)."""
    from autoplan.cost_models.errors import ConfigError

    ref = plan.model_source["factory"]
    c = plan.parallel
    bad = [f"{k}={v}" for k, v in (("tp", c.tp), ("pp", c.pp), ("cp", c.cp), ("ep", c.ep)) if v > 1]
    bad += [f"recompute={s.recompute} (stage {s.index})" for s in plan.stages if s.recompute != "none"][:1]
    if bad:
        raise ConfigError(f"module {ref} cannot be sharded as planned",
                          f"{', '.join(bad)}: user modules are trained with data parallelism (replicate, FSDP "
                          "ZeRO-1/2/3) only; tp/pp/cp/ep and recomputation need autoplan's module layout",
                          "re-plan with --fix tp=1 --fix pp=1 --fix cp=1 --fix ep=1 --fix recompute=none, or "
                          "return an autoplan.models model from the factory")
