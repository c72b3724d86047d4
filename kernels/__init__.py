"""Fused Triton kernels with autograd wrappers and plain-torch references, behind a registry.

    from autoplan import kernels
    rms_norm = kernels.get("rms_norm")          # picks the implementation at each call
    y = rms_norm(x, weight, eps=1e-6)

Rule for `impl=None` (decided per call from the first tensor argument):
  * CUDA tensor and triton installed            -> the Triton kernel
  * CPU tensor and TRITON_INTERPRET=1 (+triton) -> the Triton kernel, run by the Triton interpreter
  * anything else (CPU, meta, no triton)        -> the plain-torch reference
`get(name, impl="triton" | "torch")` forces one. Both implementations of an op take the same
arguments and are autograd-aware.

Importing this package imports neither torch nor triton and does not touch CUDA: the kernel
files are imported on first use, so the planner can read `autoplan.kernels.traffic` cheaply.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from autoplan.kernels._env import interpret_enabled, triton_installed

IMPLS = ("triton", "torch")

# name -> (module, Triton function, torch reference); both functions have the same signature.
_OPS: dict[str, tuple[str, str, str]] = {
    "rms_norm": ("autoplan.kernels.rms_norm", "rms_norm", "rms_norm_reference"),
    "layer_norm": ("autoplan.kernels.layer_norm", "layer_norm", "layer_norm_reference"),
    "bias_gelu": ("autoplan.kernels.bias_gelu", "bias_gelu", "bias_gelu_reference"),
    "swiglu": ("autoplan.kernels.swiglu", "swiglu", "swiglu_reference"),
    "rope": ("autoplan.kernels.rope", "rope", "rope_reference"),
    "softmax": ("autoplan.kernels.softmax", "softmax", "softmax_reference"),
    "cross_entropy": ("autoplan.kernels.cross_entropy", "cross_entropy", "cross_entropy_reference"),
    "vocab_parallel_cross_entropy": (
        "autoplan.kernels.cross_entropy",
        "vocab_parallel_cross_entropy",
        "vocab_parallel_cross_entropy_reference",
    ),
}


def available() -> list[str]:
    """Names accepted by `get`, sorted."""
    return sorted(_OPS)


def select_impl(device: Any) -> str:
    """'triton' or 'torch': what `get(name)` runs for tensors on `device` right now."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if not triton_installed():
        return "torch"
    if kind == "cuda" or (kind == "cpu" and interpret_enabled()):
        return "triton"
    return "torch"


_LOADED: dict[tuple[str, str], Callable] = {}


def _load(name: str, impl: str) -> Callable:
    fn = _LOADED.get((name, impl))
    if fn is None:
        module, triton_fn, torch_fn = _OPS[name]
        fn = _LOADED[(name, impl)] = getattr(importlib.import_module(module),
                                             triton_fn if impl == "triton" else torch_fn)
    return fn


def _first_tensor(args: tuple, kwargs: dict):
    for value in (*args, *kwargs.values()):
        if hasattr(value, "device") and hasattr(value, "dtype"):
            return value
    return None


class KernelOp:
    """A registry entry: call it like the op; `.impl` is None (automatic), 'triton' or 'torch'."""

    def __init__(self, name: str, impl: str | None = None):
        self.name = name
        self.impl = impl

    def __repr__(self) -> str:
        return f"autoplan.kernels.get({self.name!r}, impl={self.impl!r})"

    def impl_for(self, *args: Any, **kwargs: Any) -> str:
        """The implementation a call with these arguments would run."""
        if self.impl is not None:
            return self.impl
        tensor = _first_tensor(args, kwargs)
        return "torch" if tensor is None else select_impl(tensor.device)

    @property
    def triton(self) -> Callable:
        return _load(self.name, "triton")

    @property
    def torch(self) -> Callable:
        return _load(self.name, "torch")

    def __call__(self, *args: Any, **kwargs: Any):
        return _load(self.name, self.impl_for(*args, **kwargs))(*args, **kwargs)


def get(name: str, impl: str | None = None) -> KernelOp:
    """The op `name` (see `available()`); `impl` None picks per call, 'triton'/'torch' forces one."""
    if not isinstance(name, str) or name not in _OPS:
        raise ValueError(f"unknown kernel {name!r}; available: {', '.join(available())}.")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be None (automatic), 'triton' or 'torch', got {impl!r}.")
    return KernelOp(name, impl)


__all__ = ["IMPLS", "KernelOp", "available", "get", "interpret_enabled", "select_impl", "triton_installed"]
