"""Bytes moved per element by each fusable op, fused vs eager PyTorch, forward and backward (16-bit activations).

A copy of the totals in `kernels/traffic.py` (the cost model may import nothing else of ours; a unit test
checks the two agree). The kernels' file has the read/write counts behind every number.
"""

from __future__ import annotations

# op -> (fused fwd, fused bwd, eager fwd, eager bwd), bytes per element at 2-byte activations
BYTES_PER_ELEMENT: dict[str, tuple[float, float, float, float]] = {
    "rms_norm": (4.0, 6.0, 36.0, 76.0),
    "layer_norm": (4.0, 6.0, 4.0, 10.0),
    "bias_gelu": (4.0, 6.0, 8.0, 8.0),
    "swiglu": (6.0, 10.0, 10.0, 18.0),
    "rope": (4.0, 4.0, 20.0, 30.0),
}


def eager_extra(op: str) -> tuple[float, float]:
    """(forward, backward) bytes per element that eager PyTorch moves beyond the fused kernel."""
    ff, fb, ef, eb = BYTES_PER_ELEMENT[op]
    return ef - ff, eb - fb
