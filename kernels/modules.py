"""Drop-in nn.Modules over the registry, for a codegen pass to substitute for torch modules.

Each module has the constructor arguments and parameter names of its torch counterpart
(`weight`, `bias`), so state dicts load either way; `from_torch(m)` builds one that shares the
original module's Parameter objects, and `fuse_module(m)` does that for any module it knows.
`impl` is passed to `autoplan.kernels.get` (None: Triton on CUDA, torch elsewhere; see kernels/__init__).
"""

from __future__ import annotations

import torch
from torch import nn

from autoplan import kernels


def _last_dim(op: str, normalized_shape) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(
            f"{op}: the fused kernel normalizes over the last dimension only, so normalized_shape must be an "
            f"int or a 1-tuple, got {normalized_shape!r}; keep the torch module for multi-dimension norms."
        )
    return int(shape[0])


class FusedRMSNorm(nn.Module):
    """torch.nn.RMSNorm over the last dimension, with the fused kernel."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None, impl: str | None = None):
        super().__init__()
        self.normalized_shape = (_last_dim("FusedRMSNorm", normalized_shape),)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.impl = impl
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.get("rms_norm", self.impl)(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"

    @classmethod
    def from_torch(cls, module: nn.RMSNorm, impl: str | None = None) -> FusedRMSNorm:
        fused = cls(module.normalized_shape, module.eps, elementwise_affine=False, impl=impl)
        fused.elementwise_affine = module.weight is not None
        fused.weight = module.weight
        return fused


class FusedLayerNorm(nn.Module):
    """torch.nn.LayerNorm over the last dimension, with the fused kernel."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, impl: str | None = None):
        super().__init__()
        self.normalized_shape = (_last_dim("FusedLayerNorm", normalized_shape),)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.impl = impl
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.get("layer_norm", self.impl)(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"

    @classmethod
    def from_torch(cls, module: nn.LayerNorm, impl: str | None = None) -> FusedLayerNorm:
        fused = cls(module.normalized_shape, module.eps, elementwise_affine=False, impl=impl)
        fused.elementwise_affine = module.weight is not None
        fused.weight, fused.bias = module.weight, module.bias
        return fused


class FusedGELU(nn.Module):
    """torch.nn.GELU (approximate 'none' or 'tanh'), with the fused kernel."""

    def __init__(self, approximate: str = "none", impl: str | None = None):
        super().__init__()
        self.approximate = approximate
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.get("bias_gelu", self.impl)(x, None, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"

    @classmethod
    def from_torch(cls, module: nn.GELU, impl: str | None = None) -> FusedGELU:
        return cls(module.approximate, impl=impl)


class FusedBiasGELU(nn.Module):
    """gelu(x + bias): takes over the bias of the Linear before it (build that Linear with bias=False)."""

    def __init__(self, num_features: int, approximate: str = "tanh", device=None, dtype=None,
                 impl: str | None = None):
        super().__init__()
        self.approximate = approximate
        self.impl = impl
        self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.get("bias_gelu", self.impl)(x, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"{self.bias.shape[0]}, approximate={self.approximate!r}"


class FusedSwiGLU(nn.Module):
    """silu(gate) * up; forward(gate, up) or forward(x) with x = [gate | up] on the last dimension."""

    def __init__(self, impl: str | None = None):
        super().__init__()
        self.impl = impl

    def forward(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.get("swiglu", self.impl)(gate, up)


class FusedScaledSoftmax(nn.Module):
    """softmax(scale * x) over the last dim, optionally with the causal mask (see kernels/softmax.py)."""

    def __init__(self, scale: float = 1.0, causal: bool = False, impl: str | None = None):
        super().__init__()
        self.scale, self.causal, self.impl = scale, causal, impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.get("softmax", self.impl)(x, self.scale, self.causal)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, causal={self.causal}"


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin tables (non-persistent buffers) and rotates q, k in place: forward(q, k, offset)."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0, interleaved: bool = False,
                 device=None, impl: str | None = None):
        super().__init__()
        from autoplan.kernels.rope import rope_cache  # torch only; the kernel itself loads on first call

        cos, sin = rope_cache(max_positions, head_dim, base, device=device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.head_dim, self.base, self.interleaved, self.impl = head_dim, base, interleaved, impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_offset: int = 0):
        return kernels.get("rope", self.impl)(q, k, self.cos, self.sin, position_offset, self.interleaved)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.cos.shape[0]}, base={self.base}"


class FusedLinearCrossEntropy(nn.Module):
    """Loss of the LM head without full fp32 logits: forward(hidden, weight, target) -> loss.

    `weight` is the LM head's weight [V, h] (kept by the head, or tied to the embedding). With a
    `group`, weight is this rank's vocabulary shard and the vocab-parallel variant runs.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", chunk_size: int | None = None,
                 group=None, impl: str | None = None):
        super().__init__()
        self.ignore_index, self.reduction, self.chunk_size = ignore_index, reduction, chunk_size
        self.group, self.impl = group, impl

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return kernels.get("cross_entropy", self.impl)(
                hidden, weight, target, self.ignore_index, self.reduction, self.chunk_size)
        return kernels.get("vocab_parallel_cross_entropy", self.impl)(
            hidden, weight, target, self.group, self.ignore_index, self.reduction, self.chunk_size)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, chunk_size={self.chunk_size}"


# torch module type -> fused counterpart (the types `fuse_module` replaces).
FUSABLE: dict[type, type] = {nn.LayerNorm: FusedLayerNorm, nn.RMSNorm: FusedRMSNorm, nn.GELU: FusedGELU}


def fuse_module(module: nn.Module, impl: str | None = None) -> nn.Module | None:
    """The fused replacement of `module`, sharing its parameters, or None if there is none.

    None also for norms over more than the last dimension, which the kernels do not cover.
    """
    fused_type = FUSABLE.get(type(module))
    if fused_type is None:
        return None
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and len(tuple(module.normalized_shape)) != 1:
        return None
    return fused_type.from_torch(module, impl=impl)
