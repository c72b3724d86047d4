"""Memory traffic of each fused kernel vs eager PyTorch, per element, for the cost model.

Pure Python (no torch, no triton) so the planner can import it. Each count is the number of
tensor-sized reads plus writes that one implementation makes, split into passes over tensors of
the activation dtype (`act`, `dtype_bytes` each, 2 for bf16/fp16) and over fp32 temporaries
(`fp32`, 4 bytes each). An "element" is one element of the tensor named in `OpTraffic.element`.
Not counted: per-row scalars (mean, rstd: rows x 4 B), parameter vectors (weight/bias: hidden x
dtype bytes, read once per program from L2) and the per-program partial sums of the weight/bias
gradients (programs x hidden x 4 B, about 1% of the tensor at 4 x 132 programs and 64K tokens).

The eager counts follow the PyTorch ops that the named eager implementation dispatches, one
kernel per op, each reading its inputs and writing its output from and to HBM; the backward
counts follow the autograd formulas of those ops. They assume a 16-bit activation dtype: for
fp32 activations the `.float()`/`.to()` casts in the eager paths are no-ops and the counts
overstate eager traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32_BYTES = 4


@dataclass(frozen=True)
class Traffic:
    """Tensor-sized passes: `act` in the activation dtype, `fp32` in fp32 temporaries."""

    act: float
    fp32: float = 0.0

    def bytes_per_element(self, dtype_bytes: int = 2) -> float:
        return self.act * dtype_bytes + self.fp32 * FP32_BYTES


@dataclass(frozen=True)
class OpTraffic:
    element: str  # what one "element" is for this op
    eager_impl: str  # the eager PyTorch code whose kernels were counted
    fused_fwd: Traffic
    fused_bwd: Traffic
    eager_fwd: Traffic
    eager_bwd: Traffic


TRAFFIC: dict[str, OpTraffic] = {
    "rms_norm": OpTraffic(
        element="element of x [tokens, hidden]",
        eager_impl="HF LlamaRMSNorm: w * (x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(dtype)",
        # fused fwd: read x, write y
        fused_fwd=Traffic(act=2),
        # fused bwd: read x, dy; write dx (dw from per-program partials)
        fused_bwd=Traffic(act=3),
        # eager fwd: x.float() (act r, fp32 w) | pow (fp32 r+w) | mean (fp32 r) | h*rstd (fp32 r+w)
        #            | .to(dtype) (fp32 r, act w) | w*h (act r+w)            -> act 4, fp32 7
        eager_fwd=Traffic(act=4, fp32=7),
        # eager bwd: w*h: dy*w (act r+w), dw = sum(dy*h) (act r,r,w + r) | .to backward (act r, fp32 w)
        #            | h*rstd: g*rstd (fp32 r+w), sum(g*h) (fp32 r,r,w + r) | mean backward expand (fp32 w)
        #            | pow backward 2*h*g (fp32 r,r,w) | accumulate two grads of h (fp32 r,r,w)
        #            | x.float() backward cast (fp32 r, act w)                   -> act 8, fp32 15
        eager_bwd=Traffic(act=8, fp32=15),
    ),
    "layer_norm": OpTraffic(
        element="element of x [tokens, hidden]",
        eager_impl="torch.nn.functional.layer_norm (native CUDA kernels)",
        fused_fwd=Traffic(act=2),  # read x, write y
        fused_bwd=Traffic(act=3),  # read x, dy; write dx (dw, db from per-program partials)
        eager_fwd=Traffic(act=2),  # the native forward is already one fused kernel: read x, write y
        # native backward: one kernel reads dy, x and writes dx; a second reads dy, x again for dw/db
        eager_bwd=Traffic(act=5),
    ),
    "bias_gelu": OpTraffic(
        element="element of x [tokens, ffn_hidden]",
        eager_impl="F.gelu(x + bias, approximate='tanh')",
        fused_fwd=Traffic(act=2),  # read x, write y (x + bias recomputed in the backward)
        fused_bwd=Traffic(act=3),  # read x, dy; write dx (dbias from per-program partials)
        eager_fwd=Traffic(act=4),  # add: r x, w u | gelu: r u, w y
        eager_bwd=Traffic(act=4),  # gelu_backward: r dy, r u, w du | dbias = du.sum(0): r du
    ),
    "swiglu": OpTraffic(
        element="element of the output y [tokens, ffn_hidden] (the input holds two per y)",
        eager_impl="F.silu(gate) * up",
        fused_fwd=Traffic(act=3),  # read gate, up; write y
        fused_bwd=Traffic(act=5),  # read dy, gate, up; write dgate, dup
        eager_fwd=Traffic(act=5),  # silu: r g, w s | mul: r s, r u, w y
        # mul backward: dy*u (r, r, w) and dy*s (r, r, w) | silu_backward: r ds, r g, w dg
        eager_bwd=Traffic(act=9),
    ),
    "rope": OpTraffic(
        element="element of q or k [batch, seq, heads, head_dim]",
        eager_impl="HF apply_rotary_pos_emb: q * cos + rotate_half(q) * sin (cos/sin reads not counted)",
        fused_fwd=Traffic(act=2),  # read q, write q in place
        fused_bwd=Traffic(act=2),  # read dq, write the rotated gradient
        # q*cos: r, w | rotate_half: neg of half (r .5, w .5), cat (r 1, w 1) | *sin: r, w | add: r, r, w
        eager_fwd=Traffic(act=10),
        # grad*sin: r, w | neg backward (r .5, w .5) | two slice backwards, each zeros (w 1) plus a
        # half copy (r .5, w .5) | grad*cos: r, w | two additions accumulating three grads: (r, r, w) x 2
        eager_bwd=Traffic(act=15),
    ),
    "softmax": OpTraffic(
        element="element of the scores [batch, heads, seq_q, seq_k]",
        eager_impl="softmax(x * scale).masked_fill(causal) in the input dtype (Megatron's unfused path)",
        fused_fwd=Traffic(act=2),  # read x, write y (mask built from indices)
        fused_bwd=Traffic(act=3),  # read y, dy; write dx
        eager_fwd=Traffic(act=6),  # mul: r, w | masked_fill: r, w | softmax: r, w
        eager_bwd=Traffic(act=7),  # softmax_backward: r y, r dy, w | masked_fill backward: r, w | mul: r, w
    ),
    "cross_entropy": OpTraffic(
        element="element of the logits [tokens, vocab] (the LM-head matmuls, equal in both, not counted)",
        eager_impl="F.cross_entropy(logits.float(), target) (HF causal LM loss)",
        # fused "fwd" computes the gradient too: stats kernel r | gradient kernel r, w (in place)
        fused_fwd=Traffic(act=3),
        # fused "bwd" only scales dhidden [tokens, hidden] and dweight [vocab, hidden]: none per logit
        fused_bwd=Traffic(act=0),
        # .float(): r act, w fp32 | log_softmax: r fp32 twice (max, sum), w fp32 | nll_loss: gathers
        eager_fwd=Traffic(act=1, fp32=4),
        # nll_loss_backward: w fp32 (scatter into zeros) | log_softmax_backward: r, r, w fp32
        # | .float() backward: r fp32, w act
        eager_bwd=Traffic(act=1, fp32=5),
    ),
}
TRAFFIC["vocab_parallel_cross_entropy"] = TRAFFIC["cross_entropy"]  # per local logit element, same kernels

_DIRECTIONS = ("fwd", "bwd", "total")
_IMPLS = ("fused", "eager")


def bytes_per_element(op: str, impl: str = "fused", direction: str = "fwd", dtype_bytes: int = 2) -> float:
    """Bytes moved per element (see OpTraffic.element) by `impl` ('fused' | 'eager') in `direction`
    ('fwd' | 'bwd' | 'total') with activations of `dtype_bytes` bytes."""
    if op not in TRAFFIC:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(sorted(TRAFFIC))}.")
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}.")
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be one of {_DIRECTIONS}, got {direction!r}.")
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {dtype_bytes!r}.")
    t = TRAFFIC[op]
    fwd, bwd = (t.fused_fwd, t.fused_bwd) if impl == "fused" else (t.eager_fwd, t.eager_bwd)
    parts = {"fwd": (fwd,), "bwd": (bwd,), "total": (fwd, bwd)}[direction]
    return sum(p.bytes_per_element(dtype_bytes) for p in parts)


def bytes_moved(op: str, numel: int, impl: str = "fused", direction: str = "fwd", dtype_bytes: int = 2) -> float:
    """Total bytes moved for `numel` elements."""
    return numel * bytes_per_element(op, impl, direction, dtype_bytes)


def traffic_ratio(op: str, direction: str = "total", dtype_bytes: int = 2) -> float:
    """eager bytes / fused bytes (> 1 means the fused kernel moves less)."""
    fused = bytes_per_element(op, "fused", direction, dtype_bytes)
    eager = bytes_per_element(op, "eager", direction, dtype_bytes)
    return float("inf") if fused == 0 else eager / fused


# Cross-entropy memory. Eager: at the peak (inside log_softmax_backward) the 16-bit logits (kept by
# the model output), the fp32 log-probabilities (saved by log_softmax), the fp32 gradient coming
# from nll_loss and the fp32 gradient being written are alive: tokens x vocab x (b + 3 x 4) bytes.
# Fused: one [chunk, vocab] buffer in the activation dtype, plus dhidden [tokens, hidden] and
# dweight [vocab, hidden] allocated during the forward (eager allocates those in the backward too,
# after the logits are freed, so they are counted for the fused path only), plus 4 fp32 values
# per token (row max, sum-exp, target logit, loss).
_CE_MIN_CHUNK_ROWS = 1024  # kernels/cross_entropy.py _MIN_CHUNK_ROWS


def cross_entropy_default_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """Rows per chunk that kernels/cross_entropy.py picks when chunk_size is None."""
    return max(1, min(tokens, max(_CE_MIN_CHUNK_ROWS, -(-tokens * hidden // vocab))))


def cross_entropy_peak_bytes(tokens: int, vocab: int, hidden: int, impl: str = "fused", dtype_bytes: int = 2,
                             chunk_size: int | None = None) -> float:
    """Peak bytes the loss adds on top of the hidden states and the LM-head weight."""
    if impl == "eager":
        return tokens * vocab * (dtype_bytes + 3 * FP32_BYTES)
    if impl != "fused":
        raise ValueError(f"impl must be 'fused' or 'eager', got {impl!r}.")
    chunk = min(tokens, chunk_size or cross_entropy_default_chunk(tokens, vocab, hidden))
    return chunk * vocab * dtype_bytes + (tokens + vocab) * hidden * dtype_bytes + 4 * tokens * FP32_BYTES
