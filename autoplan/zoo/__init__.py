"""Model zoo: real `nn.Module`s built from a `ModelSpec` (GPT, Llama, Mixtral-style MoE).

Used by capture, codegen, the runtime and the tests. torch is imported only inside this subpackage, so the
planner never pays for it. The interface is stable: `build_model(spec, device=, dtype=, seed=)`.
"""

from __future__ import annotations

from .model import (
    MLP,
    Activation,
    Attention,
    AttentionCore,
    Block,
    MoE,
    RMSNorm,
    TransformerLM,
    build_model,
    cross_entropy_loss,
    init_weights,
)

__all__ = [
    "MLP", "Activation", "Attention", "AttentionCore", "Block", "MoE", "RMSNorm", "TransformerLM",
    "build_model", "cross_entropy_loss", "init_weights", "num_parameters",
]


def num_parameters(model) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
