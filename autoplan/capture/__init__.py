"""Capture real PyTorch models into a ModelGraph the planner can cost.

`capture(module, example_inputs)` traces with `torch.export` (non-strict) on the meta device, falling back
to `torch.fx.symbolic_trace`, and derives per-layer `LayerProfile`s (see `analyze` for the rules);
`capture_spec(spec)` does it for the zoo model of a ModelSpec. torch is imported only when a capture runs, so
`import autoplan.capture` is cheap and the planner never pays for torch unless it captures.
"""

from __future__ import annotations

from .errors import CaptureError
from .graph import BlockGroup, LayerInfo, ModelGraph, OpNode, TensorMeta

_LAZY = {
    "capture": "core", "capture_spec": "core", "capture_hf_config": "core", "capture_hf_model": "core",
    "capture_model_ref": "core", "hf_model_from_config": "core", "load_module_factory": "core",
    "render_model_tree": "report", "graph_summary_json": "report",
}

__all__ = ["BlockGroup", "CaptureError", "LayerInfo", "ModelGraph", "OpNode", "TensorMeta", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
