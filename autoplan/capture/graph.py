"""The data a capture produces: ops with shapes, layers holding their op subgraphs, and the ModelGraph.

Plain dataclasses over networkx, no torch: a ModelGraph can be built, inspected, rendered and costed without
importing torch (only `autoplan.capture.trace` imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from autoplan.cost_models.profile import LayerProfile

FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64",
                "complex128"}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor. Symbolic (data-dependent) sizes are stored as -1."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= max(d, 0)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def __str__(self) -> str:
        dims = ",".join("?" if d < 0 else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"


@dataclass
class OpNode:
    """One node of the captured graph.

    `kind` is one of: input, param, buffer, constant (placeholders); gemm (a matmul with a parameter
    operand), matmul (activation x activation), attention, norm, embedding, loss, dropout, view, elementwise,
    creation, other. `inputs` are the producing nodes of the tensor arguments in argument order.
    """

    name: str
    op: str
    opname: str
    kind: str
    inputs: tuple[str, ...]
    in_meta: tuple[TensorMeta | None, ...]
    outputs: tuple[TensorMeta, ...]
    module: str = ""
    module_type: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)
    param: str | None = None  # for param/buffer placeholders: the canonical parameter name
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    param_bytes: float = 0.0
    # filled in by the analysis
    layer: str = ""
    requires_grad: bool = False
    token_dependent: bool = False

    @property
    def out(self) -> TensorMeta | None:
        return self.outputs[0] if self.outputs else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "op": self.op, "kind": self.kind, "module": self.module,
            "inputs": list(self.inputs), "input_shapes": [str(m) if m else None for m in self.in_meta],
            "output_shapes": [str(m) for m in self.outputs], "flops": self.flops, "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written, "param_bytes": self.param_bytes,
        }


@dataclass
class RawCapture:
    """What tracing produced, before any analysis."""

    nodes: list[OpNode]
    params: dict[str, TensorMeta]  # canonical name -> meta
    outputs: list[str]  # names of nodes the graph returns
    method: str
    notes: list[str] = field(default_factory=list)


@dataclass
class LayerInfo:
    """One layer of the model (the embedding part, a transformer block, or the head) and its op subgraph."""

    name: str
    kind: str  # embedding | block | head
    index: int  # block index (0-based), -1 for embedding and head
    ops: nx.DiGraph  # nodes are op names with attribute "op" (OpNode), edges are data flow inside the layer
    order: list[str]  # op names in execution order
    params: int = 0  # parameters this layer owns (a tied weight belongs to the layer that uses it first)
    param_names: list[str] = field(default_factory=list)
    flops: float = 0.0  # all forward FLOPs of its ops at the captured shapes
    model_flops: float = 0.0  # GEMM + attention-core FLOPs at the captured shapes
    signature: str = ""  # structural hash; equal signatures = identical blocks
    group: int | None = None  # index into ModelGraph.block_groups
    parts: dict[str, dict[str, float]] = field(default_factory=dict)  # per sub-module: params, flops


@dataclass
class BlockGroup:
    """Structurally identical transformer blocks (same ops, shapes and parameters, names aside)."""

    members: list[str]
    signature: str

    @property
    def first(self) -> str:
        return self.members[0]

    @property
    def count(self) -> int:
        return len(self.members)

    def label(self) -> str:
        if self.count == 1:
            return self.first
        return f"{self.members[0]} … {self.members[-1]} ×{self.count} identical"


@dataclass
class ModelGraph:
    """A captured model: a networkx DiGraph of layers plus the derived per-layer cost inputs.

    `layers` has one node per layer (attribute "info": LayerInfo), in execution order, with edges where one
    layer consumes another's output (attribute "bytes": activation bytes passed at the captured shapes).
    `profiles` is [embedding, blocks..., head], the structure `cost_models` costs. Quantities at the captured
    shapes (per-op FLOPs and bytes) use `capture_batch` x `capture_seq` tokens; per-token quantities and
    `flops_per_token` are reported at `seq`.
    """

    name: str
    layers: nx.DiGraph
    ops: dict[str, OpNode]
    profiles: list[LayerProfile]
    block_groups: list[BlockGroup]
    pre: list[str]
    blocks: list[str]
    post: list[str]
    num_parameters: int
    capture_batch: int
    capture_seq: int
    seq: int
    method: str  # "torch.export" or "torch.fx"
    dtype: str  # dtype of the model's floating-point parameters as captured
    notes: list[str] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        """Transformer blocks."""
        return len(self.blocks)

    def layer(self, name: str) -> LayerInfo:
        return self.layers.nodes[name]["info"]

    def max_positions(self) -> int | None:
        """Rows of the model's learned position table -- a lookup whose indices do not depend on the tokens, in a
        table that is a parameter -- the longest sequence it can take; None without one (rotary or no
        positions: the capture knows no limit)."""
        rows = [o.in_meta[0].shape[0] for o in self.ops.values()
                if o.kind == "embedding" and not o.token_dependent and len(o.inputs) >= 2 and o.in_meta
                and o.in_meta[0] is not None and o.in_meta[0].shape and self.ops[o.inputs[0]].kind == "param"]
        return max(rows) if rows else None

    def layer_infos(self) -> list[LayerInfo]:
        return [self.layer(n) for n in [*self.pre, *self.blocks, *self.post]]

    def flops_per_token(self, seq: int | None = None) -> float:
        """Forward model FLOPs per token (GEMMs + attention, causal counted in full) at sequence length `seq`."""
        s = self.seq if seq is None else seq
        return sum(p.model_flops_per_token(s) for p in self.profiles)

    def model_flops_per_step(self, global_batch: int, seq: int | None = None) -> float:
        """Model FLOPs of one training step (forward + backward = 3x forward), no recomputation."""
        s = self.seq if seq is None else seq
        return 3.0 * global_batch * s * self.flops_per_token(s)

    def repeated_block(self) -> BlockGroup | None:
        """The largest group of identical blocks (the repeated transformer block)."""
        return max(self.block_groups, key=lambda g: g.count, default=None)
