"""From a traced op list to a ModelGraph: op costs, layers, repeated blocks and per-layer LayerProfiles.

No torch here: everything works on the `OpNode` records `trace` produced. The rules, in order:

Op costs (at the captured shapes). GEMMs and activation matmuls 2*M*N*K; the attention core 4*b*a*s_q*s_k*d
(causal counted in full, as Korthikanti et al. eq. 7); other ops one FLOP per output element (these are not
model FLOPs). Bytes read/written are the tensors in and out; views move nothing; a gather (embedding, index)
reads the rows it returns, not the whole table.

Layers. An op belongs to the transformer block named by the first numbered component of its module path
(`layers.3`, `model.layers.3`, `transformer.h.3`); ops outside blocks before the first block form the
`embedding` layer, after the last block the `head` layer (final norm, LM head, loss); an op outside any block
between two blocks joins the block before it. Blocks with the same structural signature (ops, relative module
paths, shapes, dtypes, relative parameter names, wiring) form a BlockGroup; the LayerProfile is derived once
per group and copied.

Tensor-parallel roles come from propagating "replicated" (R, the residual stream) / "split" (S) through the
block: a GEMM reading R is column-parallel (its output S), one reading S row-parallel (output R, one
all-reduce); a GEMM whose n equals the layer's expert count is the router (replicated); GEMMs under a numbered
sub-module (`experts.3.w1`) or with a 3-D weight are expert GEMMs, grouped over experts; in the head, the GEMM
producing the vocabulary logits is vocab-parallel. Norms output R, attention S, elementwise ops inherit.

Elementwise traffic counts one fused kernel per maximal region of element-wise ops (casts, views and gathers
included) that no other kernel separates (ops are merged only at equal "stage", the number of GEMMs,
attention cores, norms or losses on the longest path to them, so fusion never creates a cycle), each norm
module (or norm op) as one kernel, and the loss as LOSS_PASSES logits-sized passes in KERNELS_LOSS launches.
A kernel reads its inputs from outside the region and writes the outputs used outside it, plus a 1-byte mask
per dropout; traffic is in activation elements of the model's precision (bytes / parameter itemsize, so a
fp32 upcast of bf16 logits reads 1 and writes 2). Ops that do not depend on the model's data input (position
tables, RoPE cos/sin, causal masks, weight casts) are treated as precomputed constants and cost nothing per
token. Kernel launches: one per GEMM (experts grouped), attention core, norm and region (a region repeated
per expert counts once), KERNELS_VOCAB_LOOKUP for a region holding the vocabulary lookup, KERNELS_LOSS for
the loss.

Saved activations approximate autograd by op type (not by running backward): a GEMM saves its activation
input; attention saves q, k, v and its output, with k/v counted before any GQA head repetition (a fused GQA
kernel reads the KV heads directly); a norm saves its input; a fused elementwise region saves the external
inputs its non-linear ops need (gelu/silu/tanh/exp/... their input; mul needs the other operand of a
grad-requiring one; mul by a constant, add, cast, view, gather need nothing); dropout saves a 1-byte mask;
the loss saves a tensor the size and dtype of its input (the fp32 log-softmax). Tensors are de-duplicated
through views. Bytes are normalised to 2-byte activations (scaled by 2 / itemsize of the model's parameters),
so an explicit fp32 upcast in a bf16 model counts 4 bytes. The unfused attention scores (x seq) are reported as
`act_scores_per_seq`; for a fused SDPA the value is what its unfused equivalent would store (2 bytes per
score, +3 with dropout), as `profile_from_spec` does, since the cost model picks flash vs unfused.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx

from autoplan.cost_models.profile import Attention, Gemm, LayerProfile

from .errors import CaptureError
from .graph import BlockGroup, LayerInfo, ModelGraph, OpNode, RawCapture, TensorMeta

VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "expand", "expand_as", "unsqueeze", "squeeze",
    "flatten", "unflatten", "select", "slice", "split", "split_with_sizes", "chunk", "unbind", "getitem", "alias",
    "detach", "contiguous", "clone", "as_strided", "narrow", "view_as", "diagonal", "movedim", "swapaxes",
    "lift_fresh_copy", "view_as_real", "view_as_complex", "unfold", "_reshape_alias", "tensor_split",
}
CAST_OPS = {"to", "_to_copy", "type_as", "float", "half", "bfloat16", "double", "_to_dtype"}
GEMM_OPS = {"linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "einsum"}
ATTENTION_OPS = {
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "flex_attention",
}
NORM_OPS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "batch_norm",
            "native_batch_norm", "instance_norm"}
EMBED_OPS = {"embedding", "embedding_bag"}
LOSS_OPS = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "mse_loss", "l1_loss",
            "binary_cross_entropy_with_logits", "binary_cross_entropy", "smooth_l1_loss", "kl_div"}
DROPOUT_OPS = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout"}
SOFTMAX_OPS = {"softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax"}
CREATION_OPS = {
    "arange", "zeros", "ones", "full", "empty", "empty_like", "zeros_like", "ones_like", "full_like", "new_ones",
    "new_zeros", "new_empty", "new_full", "scalar_tensor", "tensor", "rand", "randn", "randint", "eye", "linspace",
    "tril_indices", "triu_indices", "empty_strided", "rand_like", "randn_like",
}
# Non-linear element-wise ops whose backward needs their input (or, equivalently sized, their output).
NONLINEAR_OPS = {
    "gelu", "silu", "relu", "tanh", "sigmoid", "exp", "log", "pow", "rsqrt", "sqrt", "sin", "cos", "reciprocal",
    "erf", "abs", "elu", "leaky_relu", "mish", "softplus", "hardswish", "hardsigmoid", "var", "std", "var_mean",
    "log1p", "expm1", "gelu_", "relu_", "prelu", "glu", "logsigmoid", "norm", "linalg_vector_norm", "square",
    "amax", "max", "min", "topk", "clamp", "clamp_min", "clamp_max", "maximum", "minimum",
} | SOFTMAX_OPS
# Ops whose backward needs nothing of their inputs (linear in them, or index bookkeeping).
LINEAR_OPS = {"add", "sub", "neg", "sum", "mean", "cat", "stack", "where", "masked_fill", "index", "index_select",
              "gather", "index_copy", "index_add", "scatter", "scatter_add", "rsub", "cumsum", "pad",
              "constant_pad_nd", "roll", "flip", "repeat", "repeat_interleave", "tril", "triu", "fill"} | CAST_OPS
GATHER_OPS = {"embedding", "index", "index_select", "gather", "take_along_dim"}
REPEAT_OPS = VIEW_OPS | {"repeat_interleave", "repeat", "expand"}
SKIP_OPS = {"_assert_tensor_metadata", "sym_size", "_assert_scalar", "sym_constrain_range_for_size",
            "_assert_async", "sym_constrain_range"}
_DEBUG = bool(os.environ.get("AUTOPLAN_CAPTURE_DEBUG"))
NORM_MODULE = re.compile(r"norm", re.IGNORECASE)
# Constructs that are one op in the graph but several kernels at run time; the same conventions as
# `autoplan.cost_models.profile.profile_from_spec`, so that a capture and a spec of the same model cost the same.
# Cross-entropy over logits (eager PyTorch / Megatron): max (read), subtract and exp (read 2, write 2), sum
# (read), normalise for backward (read, write): 8 logits-sized passes, 7 launches with the target gather
# and the mean.
LOSS_PASSES = 8
KERNELS_LOSS = 7
KERNELS_VOCAB_LOOKUP = 3  # vocab-parallel embedding: mask out-of-shard ids, gather, zero the masked rows


def _classify(o: OpNode) -> str:
    s = o.opname
    if o.op.startswith("placeholder:"):
        return o.kind
    if s in SKIP_OPS or not o.outputs:
        return "skip"
    if s in VIEW_OPS:
        return "view"
    if s in ATTENTION_OPS:
        return "attention"
    if s in GEMM_OPS:
        return "matmul"  # refined to "gemm" when an operand is a parameter
    if s in NORM_OPS:
        return "norm"
    if s in EMBED_OPS:
        return "embedding"
    if s in LOSS_OPS:
        return "loss"
    if s in DROPOUT_OPS:
        return "dropout"
    if s in CREATION_OPS:
        return "creation"
    return "elementwise"


# ------------------------------------------------------------------------------------------ the context


def param_of(name: str, ops: dict[str, OpNode]) -> str | None:
    """The parameter operand `name` is (through views and casts), if any."""
    o = ops[name]
    while (o.kind in ("view", "alias") or o.opname in CAST_OPS) and o.inputs:
        o = ops[o.inputs[0]]
    return o.param if o.kind == "param" else None


@dataclass
class _Ctx:
    ops: dict[str, OpNode]
    order: list[str]
    consumers: dict[str, list[str]]
    outputs: set[str]
    tokens: int
    batch: int
    ref_itemsize: int
    params: dict[str, TensorMeta]
    owner: dict[str, str] = field(default_factory=dict)  # param -> layer that owns it
    vocab: int | None = None
    hidden: int | None = None
    head_linear: str | None = None  # the vocabulary-parallel head's module (`_find_head`)
    logits_width: int = 0  # the logits' width (the head profile's logits_per_token)

    def base(self, name: str) -> str:
        """Follow views back to the op that produced the storage."""
        o = self.ops[name]
        while o.kind in ("view", "alias") and o.inputs:
            o = self.ops[o.inputs[0]]
        return o.name

    def param_of(self, name: str) -> str | None:
        """The parameter an operand is (through views and casts), if any."""
        return param_of(name, self.ops)

    def per_token(self, meta: TensorMeta | None) -> float:
        """Memory traffic of one tensor per token, in activation elements of the model's precision (bytes /
        itemsize of the parameters), so an fp32 upcast in a bf16 model counts double."""
        return meta.nbytes / self.ref_itemsize / self.tokens if meta is not None else 0.0

    def act_bytes(self, meta: TensorMeta | None) -> float:
        """Bytes per token of a saved activation, normalised to 2-byte activations."""
        if meta is None or not meta.is_float:
            return 0.0
        return meta.numel * meta.itemsize * (2.0 / self.ref_itemsize) / self.tokens

    def live(self, name: str) -> bool:
        """A float tensor that depends on the data input (a per-token activation)."""
        o = self.ops[name]
        return o.token_dependent and o.out is not None and o.out.is_float

    def users(self, name: str) -> list[str]:
        """Consumers of `name`, looking through views."""
        out, stack = [], list(self.consumers.get(name, ()))
        while stack:
            c = stack.pop()
            if self.ops[c].kind in ("view", "alias"):
                stack.extend(self.consumers.get(c, ()))
                if c in self.outputs:
                    out.append("<output>")
            elif self.ops[c].kind != "skip":  # metadata asserts read nothing
                out.append(c)
        return out


def _gemm_operands(o: OpNode, g: _Ctx) -> tuple[int, int, str | None]:
    """(activation operand index, weight operand index, weight parameter name or None)."""
    s = o.opname
    if s == "linear":
        cands = [(0, 1)]
    elif s in ("addmm", "baddbmm"):
        cands = [(1, 2)]
    elif s == "einsum":
        cands = [(1 - i, i) for i in range(min(2, len(o.inputs)))][::-1] if len(o.inputs) == 2 else []
    else:
        cands = [(0, 1), (1, 0)]
    for xi, wi in cands:
        if wi < len(o.inputs) and xi < len(o.inputs):
            p = g.param_of(o.inputs[wi])
            if p is not None:
                return xi, wi, p
    xi = 1 if s in ("addmm", "baddbmm") else 0
    return xi, xi + 1, None


def _einsum_dims(o: OpNode, xi: int, wi: int) -> tuple[int, int, int]:
    """(n, k, count) of an einsum with a parameter operand: k contracted, n kept, count = batch (experts)."""
    eq = str(o.attrs.get("equation", "")).replace(" ", "")
    if "->" not in eq or "," not in eq:
        raise CaptureError("einsum without an explicit output", f"equation {eq!r} at {o.module}",
                           "write the einsum as 'ab,bc->ac'")
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    xt, wt = terms[xi], terms[wi]
    wm = o.in_meta[wi]
    size = dict(zip(wt, wm.shape)) if wm else {}
    n = k = c = 1
    for ch in wt:
        if ch in xt and ch in out:
            c *= size[ch]
        elif ch in xt:
            k *= size[ch]
        elif ch in out:
            n *= size[ch]
    return n, k, c


def _op_costs(o: OpNode, g: _Ctx) -> None:
    """FLOPs, bytes read/written and parameter bytes of one op at the captured shapes."""
    out = o.out
    if o.kind in ("view", "alias", "skip", "creation") or o.op.startswith("placeholder:") or out is None:
        return
    seen: set[str] = set()
    read = pbytes = 0.0
    for name, meta in zip(o.inputs, o.in_meta):
        if meta is None or name in seen:
            continue
        seen.add(name)
        if g.param_of(name) is not None:
            pbytes += meta.nbytes
        if o.opname in GATHER_OPS and meta.is_float:
            continue  # a gather reads the rows it returns (added below), not the whole table
        read += meta.nbytes
    if o.opname in GATHER_OPS:
        read += out.nbytes
    o.bytes_read, o.bytes_written, o.param_bytes = read, float(sum(m.nbytes for m in o.outputs)), pbytes
    if o.kind in ("gemm", "matmul"):
        if o.opname == "einsum":
            letters: dict[str, int] = {}
            eq = str(o.attrs.get("equation", "")).replace(" ", "").split("->")[0]
            for term, meta in zip(eq.split(","), o.in_meta):
                if meta is not None:
                    letters.update(zip(term, meta.shape))
            prod = 1
            for v in letters.values():
                prod *= v
            o.flops = 2.0 * prod
        else:
            xi = 1 if o.opname in ("addmm", "baddbmm") else 0
            xm = o.in_meta[xi] if xi < len(o.in_meta) else None
            k = xm.shape[-1] if xm is not None and xm.shape else 1
            o.flops = 2.0 * out.numel * k
    elif o.kind == "attention":
        q, k = o.in_meta[0], o.in_meta[1]
        sk = k.shape[-2] if k is not None and len(k.shape) >= 2 else 1
        o.flops = 2.0 * q.numel * sk + 2.0 * out.numel * sk if q is not None else 0.0
    else:
        o.flops = float(out.numel)


# ------------------------------------------------------------------------------------------- analysis


def _block_of(path: str, stacks: set[str] | None = None) -> str | None:
    parts = path.split(".") if path else []
    for i, p in enumerate(parts):
        if p.isdigit():
            blk = ".".join(parts[: i + 1])
            if stacks is None or ".".join(parts[:i]) in stacks:
                return blk
            return None
    return None


def analyze(raw: RawCapture, *, name: str, batch: int, seq_captured: int, seq: int) -> ModelGraph:
    """Turn a RawCapture into a ModelGraph (see the module docstring for the rules)."""
    g, dtype = _context(raw, batch * seq_captured, batch)
    _mark_dependence(raw, g)
    for o in raw.nodes:
        _op_costs(o, g)
    _find_vocabulary(raw, g)
    blocks, layer_ops, stacks = _assign_layers(raw, g)
    _assign_owners(raw, g, layer_ops, blocks, stacks)
    infos = {lname: _layer_info(lname, names, blocks, g) for lname, names in layer_ops.items()}
    block_groups = _group_blocks(blocks, infos)
    _find_head(infos["head"], g)
    profiles = _profiles(blocks, infos, g)
    total = sum(m.numel for m in raw.params.values())
    prof_total = sum(p.params for p in profiles)
    notes = list(raw.notes)
    if prof_total != total:
        notes.append(f"profiles hold {prof_total:,} parameters, the model {total:,}")
    return ModelGraph(
        name=name, layers=_layer_graph(layer_ops, infos, g), ops=g.ops, profiles=profiles, block_groups=block_groups,
        pre=["embedding"], blocks=blocks, post=["head"], num_parameters=total, capture_batch=batch,
        capture_seq=seq_captured, seq=seq, method=raw.method, dtype=dtype, notes=notes,
    )


def _context(raw: RawCapture, tokens: int, batch: int) -> tuple[_Ctx, str]:
    """The analysis context (ops classified, consumers) and the model's dtype: the itemsize holding most
    floating-point parameter elements is the reference activation width."""
    ops = {o.name: o for o in raw.nodes}
    consumers: dict[str, list[str]] = defaultdict(list)
    for o in raw.nodes:
        o.kind = _classify(o)
        for i in dict.fromkeys(o.inputs):
            consumers[i].append(o.name)
    float_params = [m for m in raw.params.values() if m.is_float]
    ref = max(set(m.itemsize for m in float_params), key=lambda s: sum(m.numel for m in float_params
                                                                           if m.itemsize == s), default=2)
    dtype = next((m.dtype for m in float_params if m.itemsize == ref), "bfloat16")
    g = _Ctx(ops, [o.name for o in raw.nodes], consumers, set(raw.outputs), tokens, batch, ref, raw.params)
    return g, dtype


def _mark_dependence(raw: RawCapture, g: _Ctx) -> None:
    """Data dependence and requires-grad of every op, in execution order; a matmul with a parameter operand
    becomes a GEMM."""
    for o in raw.nodes:
        if o.kind == "input":
            o.token_dependent, o.requires_grad = True, False
            continue
        if o.kind in ("param", "buffer", "constant"):
            o.token_dependent, o.requires_grad = False, o.kind == "param"
            continue
        ins = [g.ops[i] for i in o.inputs]
        o.token_dependent = any(i.token_dependent for i in ins) and o.kind != "creation"
        flt = o.out is not None and o.out.is_float
        o.requires_grad = flt and any(i.requires_grad for i in ins) and o.opname != "detach"
        if o.opname == "wrap_with_set_grad_enabled" and not o.attrs.get("grad_enabled", True):
            o.requires_grad = False
        if o.opname == "getitem" and ins:
            o.requires_grad = flt and ins[0].requires_grad
        if o.kind == "matmul" and _gemm_operands(o, g)[2] is not None:
            o.kind = "gemm"


def _find_vocabulary(raw: RawCapture, g: _Ctx) -> None:
    """The token embedding gives the vocabulary size (the LM head's n, vocab-parallel lookups) and the width."""
    for o in raw.nodes:
        if o.kind == "embedding" and o.token_dependent and len(o.inputs) >= 2:
            p = g.param_of(o.inputs[0])
            if p is not None and raw.params[p].shape:
                g.vocab = raw.params[p].shape[0]
                g.hidden = raw.params[p].shape[-1]
                return


def _assign_layers(raw: RawCapture, g: _Ctx) -> tuple[list[str], dict[str, list[str]], set[str]]:
    """(blocks in execution order, layer -> its ops, block stacks): the block stacks are containers with numbered children
    holding GEMMs or attention; ops before the first block form the embedding, after the last the head, and
    an op outside any block between two blocks joins the block before it. Sets each op's `layer`."""
    stack_ops: dict[str, set[str]] = defaultdict(set)
    for o in raw.nodes:
        if o.kind in ("gemm", "attention", "matmul"):
            b = _block_of(o.module)
            if b:
                stack_ops[b.rsplit(".", 1)[0]].add(b)
    if not stack_ops:
        mods = sorted({o.module.split(".")[0] for o in raw.nodes if o.module})[:8]
        raise CaptureError(
            "no stack of transformer blocks found",
            f"no module path with a numbered component (like layers.0) holds a matmul; top-level modules: {mods}",
            "keep the blocks in an nn.ModuleList/ModuleDict, or plan from a model spec file",
        )
    stacks = set(stack_ops)
    compute = [o for o in raw.nodes if not o.op.startswith("placeholder:") and o.kind != "skip"]
    blocks: list[str] = []
    for o in compute:
        b = _block_of(o.module, stacks)
        if b and b not in blocks:
            blocks.append(b)
    first_i = next(i for i, o in enumerate(compute) if _block_of(o.module, stacks))
    last_i = max(i for i, o in enumerate(compute) if _block_of(o.module, stacks))
    current = None
    layer_ops: dict[str, list[str]] = {n: [] for n in ["embedding", *blocks, "head"]}
    for i, o in enumerate(compute):
        b = _block_of(o.module, stacks)
        if b:
            current = b
        elif i < first_i:
            b = "embedding"
        elif i > last_i:
            b = "head"
        else:
            b = current
        o.layer = b
        layer_ops[b].append(o.name)
    return blocks, layer_ops, stacks


def _assign_owners(raw: RawCapture, g: _Ctx, layer_ops: dict[str, list[str]], blocks: list[str],
                   stacks: set[str]) -> None:
    """Parameter ownership: the first layer whose ops read it (tied weights stay with their first user); an
    unused parameter by its name, else the embedding. Also the width when no embedding gave it."""
    for lname in layer_ops:
        for n in layer_ops[lname]:
            for i in g.ops[n].inputs:
                p = g.param_of(i)
                if p is not None:
                    g.owner.setdefault(p, lname)
    for p in raw.params:
        if p not in g.owner:
            b = _block_of(p, stacks)
            g.owner[p] = b if b in layer_ops else "embedding"
    if g.hidden is None:
        ext = [i for n in layer_ops[blocks[0]] for i in g.ops[n].inputs if g.ops[i].layer != blocks[0] and g.live(i)]
        g.hidden = g.ops[ext[0]].out.shape[-1] if ext else 0


def _layer_info(lname: str, names: list[str], blocks: list[str], g: _Ctx) -> LayerInfo:
    """A layer's op subgraph, owned parameters, FLOPs, structural signature and parts."""
    kind = "embedding" if lname == "embedding" else "head" if lname == "head" else "block"
    sub = nx.DiGraph()
    members = set(names)
    for n in names:
        sub.add_node(n, op=g.ops[n])
        for i in g.ops[n].inputs:
            if i in members:
                sub.add_edge(i, n)
    owned = sorted(p for p, lay in g.owner.items() if lay == lname)
    info = LayerInfo(
        name=lname, kind=kind, index=blocks.index(lname) if kind == "block" else -1, ops=sub, order=names,
        params=sum(g.params[p].numel for p in owned), param_names=owned,
        flops=sum(g.ops[n].flops for n in names),
        model_flops=sum(g.ops[n].flops for n in names if g.ops[n].kind in ("gemm", "attention", "matmul")),
    )
    info.signature = _signature(info, g) if kind == "block" else lname
    info.parts = _parts(info, g)
    return info


def _group_blocks(blocks: list[str], infos: dict[str, LayerInfo]) -> list[BlockGroup]:
    """Blocks with the same structural signature form a group; each info learns its group's index."""
    groups: dict[str, BlockGroup] = {}
    for b in blocks:
        sig = infos[b].signature
        groups.setdefault(sig, BlockGroup([], sig)).members.append(b)
    block_groups = list(groups.values())
    for gi, grp in enumerate(block_groups):
        for m in grp.members:
            infos[m].group = gi
    return block_groups


def _profiles(blocks: list[str], infos: dict[str, LayerInfo], g: _Ctx) -> list[LayerProfile]:
    """Profiles of the embedding, every block (derived once per group of identical blocks) and the head."""
    profiles: list[LayerProfile] = [_profile(infos["embedding"], g)]
    derived: dict[int, LayerProfile] = {}
    for b in blocks:
        gi = infos[b].group
        if gi not in derived:
            derived[gi] = _profile(infos[b], g)
            profiles.append(derived[gi])
        else:
            profiles.append(derived[gi].model_copy(update={"name": b}))
    profiles.append(_profile(infos["head"], g))
    return profiles


def _layer_graph(layer_ops: dict[str, list[str]], infos: dict[str, LayerInfo], g: _Ctx) -> nx.DiGraph:
    """Layers as nodes; an edge per (producer, consumer) layer pair with the bytes of the tensors crossing it."""
    layer_graph = nx.DiGraph()
    for lname in layer_ops:
        layer_graph.add_node(lname, info=infos[lname])
    for lname, names in layer_ops.items():
        for n in names:
            for i in g.ops[n].inputs:
                src = g.ops[i].layer
                if src and src != lname and g.ops[i].out is not None:
                    ed = layer_graph.get_edge_data(src, lname)
                    if ed is None:
                        layer_graph.add_edge(src, lname, bytes=0.0, tensors=set())
                        ed = layer_graph.get_edge_data(src, lname)
                    if i not in ed["tensors"]:
                        ed["tensors"].add(i)
                        ed["bytes"] += g.ops[i].out.nbytes
    return layer_graph


def _rel(path: str, prefix: str) -> str:
    return path[len(prefix) + 1:] if path.startswith(prefix + ".") else ("" if path == prefix else path)


def _signature(info: LayerInfo, g: _Ctx) -> str:
    """Structural hash of a block: ops, relative module paths, shapes, wiring, relative parameter names."""
    local = {n: i for i, n in enumerate(info.order)}
    h = hashlib.sha1()
    for n in info.order:
        o = g.ops[n]
        ins = []
        for i in o.inputs:
            if i in local:
                ins.append(str(local[i]))
            elif g.ops[i].kind == "param":
                ins.append("P:" + _rel(g.ops[i].param or "", info.name) + str(g.ops[i].out))
            else:
                ins.append("X:" + str(g.ops[i].out))
        h.update(repr((o.opname, _rel(o.module, info.name), o.module_type, [str(m) for m in o.outputs], ins,
                       sorted(o.attrs.items()))).encode())
    return h.hexdigest()[:16]


def _parts(info: LayerInfo, g: _Ctx) -> dict[str, dict[str, float]]:
    """Per direct sub-module of the layer: parameters owned and FLOPs (for the tree view)."""
    parts: dict[str, dict[str, float]] = {}

    def key(path: str) -> str:
        rel = _rel(path, info.name) if info.kind == "block" else path
        return rel.split(".")[0] if rel else "(functional)"

    for n in info.order:
        o = g.ops[n]
        d = parts.setdefault(key(o.module), {"params": 0, "flops": 0.0, "model_flops": 0.0})
        d["flops"] += o.flops
        if o.kind in ("gemm", "attention", "matmul"):
            d["model_flops"] += o.flops
    for p in info.param_names:
        mod = p.rsplit(".", 1)[0] if "." in p else ""
        d = parts.setdefault(key(mod), {"params": 0, "flops": 0.0, "model_flops": 0.0})
        d["params"] += g.params[p].numel
    return parts


# --------------------------------------------------------------------------------------- the profile


def _needs(o: OpNode, g: _Ctx) -> list[str]:
    """Tensors the backward of element-wise op `o` needs (see the module docstring)."""
    s = o.opname
    ins = [i for i in o.inputs]
    rg = [g.ops[i].requires_grad for i in ins]
    if s in LINEAR_OPS or s in VIEW_OPS or s in DROPOUT_OPS or s in EMBED_OPS:
        return []
    if s in SOFTMAX_OPS or s == "relu":
        return [o.name] if o.requires_grad else []
    if s in ("mul", "div") and len(ins) >= 2:
        need = []
        if rg[0]:
            need.append(ins[1])
        if rg[1]:
            need.append(ins[0])
            if s == "div":
                need.append(ins[1])
        return need
    if s in ("mul", "div"):
        return []
    if s in NONLINEAR_OPS:
        return [ins[0]] if ins and rg[0] else []
    return [i for i, r in zip(ins, rg) if r]  # unknown op: assume it needs every grad-requiring input


def _gqa_source(name: str, g: _Ctx) -> tuple[str, float]:
    """(saved tensor, elements per token) of an attention k/v operand, walking back through views and head
    repetition (GQA) to the smallest tensor on the way: the KV heads before they were repeated."""
    o = g.ops[name]
    best = o
    while o.opname in REPEAT_OPS and o.inputs and g.ops[o.inputs[0]].out is not None:
        o = g.ops[o.inputs[0]]
        if o.out.numel < best.out.numel:
            best = o
    return g.base(best.name), best.out.numel / g.tokens


def _attention_cores(names: list[str], g: _Ctx) -> list[tuple[set[str], OpNode, OpNode]]:
    """Explicit matmul -> softmax -> matmul attention: (member ops, qk matmul, pv matmul)."""
    cores = []
    members_all: set[str] = set()
    for n in names:
        o = g.ops[n]
        if o.opname not in SOFTMAX_OPS or not g.live(n) or n in members_all:
            continue
        path, cur = [n], o
        qk = None
        for _ in range(12):  # back: scale, mask, cast
            prev = [i for i in cur.inputs if g.live(i)]
            if len(prev) != 1:
                break
            cur = g.ops[prev[0]]
            if cur.kind == "matmul":
                qk = cur
                break
            path.append(cur.name)
        if qk is None:
            continue
        cur, pv = o, None
        for _ in range(12):  # forward: dropout, cast, view
            nxt = [c for c in g.consumers.get(cur.name, ()) if g.ops[c].kind != "skip"]
            if len(nxt) != 1:
                break
            c = g.ops[nxt[0]]
            if c.kind == "matmul" and c.inputs and g.base(c.inputs[0]) == g.base(cur.name):
                pv = c
                break
            if c.kind == "matmul":
                break
            path.append(c.name)
            cur = c
        if pv is None:
            continue
        mem = set(path) | {qk.name, pv.name}
        members_all |= mem
        cores.append((mem, qk, pv))
    return cores


@dataclass
class _Layer:
    """One layer's ops and the structure every concern of its profile reads: the expert count, the explicit
    attention cores, the norm and loss groups, and the tensor-parallel shard ("R"/"S") of every op."""
    info: LayerInfo
    g: _Ctx
    ops: list[OpNode]
    members: set[str]
    n_experts: int = 0
    cores: list[tuple[set[str], OpNode, OpNode]] = field(default_factory=list)
    core_members: set[str] = field(default_factory=set)
    norm_of: dict[str, str] = field(default_factory=dict)  # op -> its norm group (module path or the op)
    loss_ops: list[OpNode] = field(default_factory=list)
    loss_members: set[str] = field(default_factory=set)
    shard: dict[str, str] = field(default_factory=dict)  # op -> "R" (replicated) or "S" (split)
    roles: dict[str, str] = field(default_factory=dict)  # GEMM op -> col / row / vocab / replicated

    @property
    def kind(self) -> str:
        return self.info.kind

    @property
    def T(self) -> int:
        return self.g.tokens

    def sh(self, n: str) -> str:
        """The shard of tensor `n` (through views); tensors outside the layer are replicated."""
        return self.shard.get(self.g.base(n), "R") if n in self.g.ops else "R"

    def rel(self, path: str) -> str:
        return _rel(path, self.info.name) if self.kind == "block" else path

    def expert_key(self, o: OpNode) -> tuple[str, int | None]:
        """(module path with expert indices starred, expert index) of a GEMM."""
        rel = self.rel(o.module)
        parts = rel.split(".") if rel else [o.opname]
        idx = next((int(p) for p in parts if p.isdigit()), None)
        return ".".join("*" if p.isdigit() else p for p in parts), idx

    def weight_key(self, param: str | None) -> str:
        rel = self.rel(param or "").removesuffix(".weight")
        return ".".join("*" if p.isdigit() else p for p in rel.split("."))


def _profile(info: LayerInfo, g: _Ctx) -> LayerProfile:
    """The LayerProfile of one layer: its structure, then each concern in its own function."""
    L = _layer(info, g)
    counted, params_rep, params_shard = _parameters(L)
    gemms = _gemms(L, counted)
    attention, n_cores = _attention(L)
    regions = _fused_regions(L)
    ew, kernels = _traffic(L, regions)
    act_tp, act_seq, scores_per_seq = _saved_activations(L, regions)
    act_input, hidden = _layer_input(L)
    top_k = round(max((gm.tokens_per_token for gm in gemms if gm.expert), default=0))
    row_groups = sum(1 for gm in gemms if gm.tp == "row")
    vocab_lookup = any(_vocab_parallel_lookup(o, g) for o in L.ops)
    head_gemm = next((gm for gm in gemms if gm.tp == "vocab"), None)
    # the logits: the vocab-parallel GEMM, or a replicated one making them (a weight applied with F.linear)
    logits_gemm = head_gemm or max((gm for gm in gemms if L.kind == "head"), key=lambda gm: gm.n, default=None)
    fus = _fusable_ops(L.ops, L.norm_of, L.T, attention, L.kind, g)
    return LayerProfile(
        **fus,
        name=info.name, kind=L.kind, gemms=gemms, attention=attention, hidden=hidden,
        params_replicated=params_rep, params_sharded=params_shard, param_tensors=len(info.param_names),
        elementwise_tp=ew["S"], elementwise_seq=ew["R"], kernels_fwd=kernels + len(gemms) + n_cores,
        act_tp=act_tp, act_seq=act_seq, act_scores_per_seq=scores_per_seq, act_input=act_input,
        # blocks: one per row-parallel group; the vocab-parallel lookup reduces its output, the vocabulary-parallel
        # LM head its input's gradient (profile.profile_from_spec says where Megatron and the runtime do it)
        tp_allreduces=(row_groups if L.kind == "block" else 1 if (L.kind == "embedding" and vocab_lookup)
                       or (L.kind == "head" and head_gemm is not None) else 0),
        moe_top_k=top_k if L.n_experts else 0, moe_experts=L.n_experts,
        logits_per_token=logits_gemm.n if logits_gemm is not None and L.kind == "head" else 0,
        logits_gathered=any(r == "vocab" and L.shard[n] == "R" for n, r in L.roles.items()),
        saves_after_last_gemm=L.kind == "block" and _saves_after_last_gemm(L),
    )


def _saves_after_last_gemm(L: _Layer) -> bool:
    """Whether an op after the layer's last token-dependent GEMM (in execution order) keeps a tensor for the
    backward: a dropout (its mask), a norm (its input), another GEMM or attention core, or an op whose backward
    needs a grad-requiring input (`_needs`). torch.utils.checkpoint's early stop re-runs the forward until the
    last tensor the backward saved is back, so then that GEMM runs again (compute.early_stop_skips_last_gemm;
    session 23: GPT-1.3B with dropout 0.1 re-ran w2 on an H200, 4.618e13 FLOPs measured against 3.299e13)."""
    g = L.g
    last = max((k for k, o in enumerate(L.ops) if o.kind == "gemm" and o.token_dependent), default=None)
    if last is None:
        return False
    for o in L.ops[last + 1:]:
        if not o.token_dependent:
            continue
        if _is_dropout(o) or o.name in L.norm_of or o.kind in ("gemm", "matmul", "attention", "norm"):
            return True
        if o.kind == "elementwise" and any(g.live(t) and g.ops[t].requires_grad for t in _needs(o, g)):
            return True
    return False


# --------------------------------------------------------------------------- a layer's structure


def _layer(info: LayerInfo, g: _Ctx) -> _Layer:
    """Experts, attention cores, norm and loss groups, then the shards (which read all of them)."""
    L = _Layer(info, g, [g.ops[n] for n in info.order], set(info.order))
    L.n_experts = _expert_count(L)  # first: the router is recognised by n == number of experts
    if L.kind == "block":
        L.cores = _attention_cores(info.order, g)
        L.core_members = set().union(*(c[0] for c in L.cores)) if L.cores else set()
    L.core_members |= _gqa_repeats(L)
    L.norm_of = _norm_groups(L)
    L.loss_ops, L.loss_members = _loss_groups(L)
    _propagate_shards(L)
    return L


def _expert_count(L: _Layer) -> int:
    """Experts of a MoE layer: numbered sub-modules holding GEMMs, or the leading dimension of 3-D weights."""
    experts_seen: dict[str, set[int]] = defaultdict(set)
    batched = 0
    for o in L.ops:
        if o.kind != "gemm":
            continue
        key, idx = L.expert_key(o)
        if idx is not None:
            experts_seen[key].add(idx)
        wm = o.in_meta[_gemm_operands(o, L.g)[1]]
        if o.opname != "linear" and wm is not None and len(wm.shape) == 3:
            batched = max(batched, wm.shape[0])
    return max([len(v) for v in experts_seen.values()] + [batched, 0])


def _gqa_repeats(L: _Layer) -> set[str]:
    """GQA head repetition feeding an attention core: it belongs to the attention (a GQA kernel reads the KV
    heads directly)."""
    out: set[str] = set()
    for o in L.ops:
        if o.kind == "attention" or o.name in L.core_members and o.kind == "matmul":
            for i in o.inputs[1:3]:
                cur = L.g.ops[i]
                while cur.opname in REPEAT_OPS and cur.inputs and cur.name in L.members:
                    if cur.kind != "view":
                        out.add(cur.name)
                    cur = L.g.ops[cur.inputs[0]]
    return out


def _norm_groups(L: _Layer) -> dict[str, str]:
    """op -> norm group: the ops of a norm module, or a lone norm op."""
    norm_of: dict[str, str] = {}
    for o in L.ops:
        if not o.token_dependent or o.kind in ("view", "skip"):
            continue
        if o.module_type and NORM_MODULE.search(o.module_type):
            norm_of[o.name] = o.module
        elif o.kind == "norm":
            norm_of[o.name] = o.name
    return norm_of


def _loss_groups(L: _Layer) -> tuple[list[OpNode], set[str]]:
    """The loss ops and their members: a loss op absorbs the log-softmax that feeds an nll_loss."""
    loss_ops = [o for o in L.ops if o.kind == "loss" and o.token_dependent]
    members = {o.name for o in loss_ops}
    for o in loss_ops:
        if o.opname.startswith("nll_loss") and o.inputs and L.g.ops[L.g.base(o.inputs[0])].opname in SOFTMAX_OPS:
            members.add(L.g.base(o.inputs[0]))
    return loss_ops, members


def _gemm_shape(o: OpNode, g: _Ctx) -> tuple[int, int, int]:
    """(n, k, weights applied) of a GEMM with a parameter operand."""
    xi, wi, _ = _gemm_operands(o, g)
    wm = o.in_meta[wi]
    if o.opname == "linear":
        return wm.shape[0], wm.shape[-1], 1
    if o.opname == "einsum":
        return _einsum_dims(o, xi, wi)
    return wm.shape[-1], wm.shape[-2], wm.shape[0] if len(wm.shape) == 3 else 1


def _gemm_role(L: _Layer, o: OpNode) -> str:
    """Tensor-parallel role of a GEMM: a block's router (n == experts, reading R) is replicated, else a GEMM
    reading R is column-parallel and one reading S row-parallel; the head's logits GEMM is vocab-parallel."""
    n, _, count = _gemm_shape(o, L.g)
    expert = L.expert_key(o)[1] is not None or count > 1
    x_sh = L.sh(o.inputs[_gemm_operands(o, L.g)[0]])
    if L.kind == "block":
        if not expert and L.n_experts and n == L.n_experts and x_sh == "R":
            return "replicated"
        return "row" if x_sh == "S" else "col"
    if L.kind == "head" and (n == L.g.vocab or _feeds_loss(o.name, L.g)):
        return "vocab" if _is_linear_module(o) else "replicated"
    return "replicated"


def _is_linear_module(o: OpNode) -> bool:
    """An nn.Linear call: the only weight use tensor parallelism shards (ColwiseParallel / RowwiseParallel act on
    modules). A weight applied with F.linear or a matmul -- a tied head written by hand -- stays replicated
    (autoplan.models.factory: the head, and its tp layout, codegen.program.factory_tp_layout)."""
    return o.opname == "linear" and o.module_type == "Linear"


def logits_transformed(name: str, consumers: dict[str, list[str]], ops: dict[str, OpNode]) -> bool:
    """Whether the forward computes on the logits op `name` makes (soft-capping, scaling) rather than returning
    them as they are or handing them to the loss (nothing but views, casts and a log-softmax between them and a
    captured cross-entropy: what loss_parallel computes over vocabulary shards). The vocabulary-parallel head's
    logits are then gathered whole over tp and the loss runs on them replicated: autoplan.models.factory
    applies this rule (FactoryStructure.head_is_output) and the capture prices it (LayerProfile.logits_gathered)."""
    todo = [name]
    while todo:
        for u in consumers.get(todo.pop(), ()):
            o = ops[u]
            if o.kind in ("view", "alias", "skip") or o.opname in CAST_OPS or o.opname in SOFTMAX_OPS:
                todo.append(u)
            elif o.kind != "loss":
                return True
    return False


def _vocab_parallel_lookup(o: OpNode, g: _Ctx) -> bool:
    return vocab_parallel_lookup(o, g.ops, g.logits_width, g.head_linear)


def vocab_parallel_lookup(o: OpNode, ops: dict[str, OpNode], vocab: int, head: str | None) -> bool:
    """Whether tensor parallelism splits token embedding `o` over vocabulary rows: an nn.Embedding looking up
    token ids, in a table of `vocab` rows (the logits' width) that nothing else reads but the vocabulary-parallel
    nn.Linear head module `head` it is tied to. Any other reader (a head applying the table with F.linear, another
    lookup) would meet a sharded table, so it stays replicated; so does a table of another size (token types).
    The one rule: autoplan.models.factory applies it (FactoryStructure.embedding, which the runtime's tp layout
    shards) and the capture prices it (the embedding's sharded parameters and its all-reduce)."""
    if not (o.kind == "embedding" and o.token_dependent and o.module_type == "Embedding" and len(o.inputs) >= 2):
        return False
    table = param_of(o.inputs[0], ops)
    if table is None or o.in_meta[0] is None or not o.in_meta[0].shape or o.in_meta[0].shape[0] != vocab:
        return False
    for other in ops.values():
        if other is o or other.kind in ("view", "alias", "param") or other.opname in CAST_OPS:
            continue  # a view or cast of the table is followed to whatever reads it
        reads = any(param_of(i, ops) == table for i in other.inputs)
        if reads and not (other.kind == "gemm" and _is_linear_module(other) and head and other.module == head):
            return False
    return True


def _propagate_shards(L: _Layer) -> None:
    """R/S through the layer in execution order (module docstring): GEMMs by role, attention S, norms and loss
    R, every other op S if any live input is."""
    for o in L.ops:
        if o.kind == "gemm":
            L.roles[o.name] = _gemm_role(L, o)
            L.shard[o.name] = "S" if L.roles[o.name] in ("col", "vocab") else "R"
            if L.roles[o.name] == "vocab" and logits_transformed(o.name, L.g.consumers, L.g.ops):
                L.shard[o.name] = "R"  # gathered whole over tp: what the forward does to them runs replicated
        elif o.kind == "attention" or o.name in L.core_members:
            L.shard[o.name] = "S"
        elif o.name in L.norm_of or o.name in L.loss_members:
            L.shard[o.name] = "R"
        else:
            L.shard[o.name] = "S" if any(L.sh(i) == "S" for i in o.inputs if L.g.live(i)) else "R"


def _find_head(info: LayerInfo, g: _Ctx) -> None:
    """The head GEMM making the logits, before any layer is profiled (the embedding's split depends on it): the
    first nn.Linear GEMM of the head making `g.vocab` outputs or feeding the loss (the vocabulary-parallel one,
    `_gemm_role`), else the widest GEMM there (a weight applied with F.linear: replicated)."""
    gemms = [g.ops[n] for n in info.order if g.ops[n].kind == "gemm"]
    head = next((o for o in gemms if _is_linear_module(o)
                 and (_gemm_shape(o, g)[0] == g.vocab or _feeds_loss(o.name, g))), None)
    g.head_linear = head.module if head is not None else None
    widths = [_gemm_shape(o, g)[0] for o in ([head] if head is not None else gemms)]
    g.logits_width = max(widths, default=0)


# ------------------------------------------------------------------------------- parameters


def _parameters(L: _Layer) -> tuple[set[str], int, int]:
    """(GEMMs whose weight this layer owns and counts first, replicated elements, tensor-parallel-sharded
    elements). A parameter counts once, at its first reader in the layer that owns it: a column-parallel or
    vocab-parallel GEMM's bias and a token embedding table are sharded, everything else replicated."""
    g = L.g
    seen: set[str] = set()
    counted: set[str] = set()
    rep = shard = 0

    def own(p: str | None) -> bool:
        if p is None or p in seen or g.owner.get(p) != L.info.name:
            return False
        seen.add(p)
        return True

    for o in L.ops:
        if o.kind == "gemm":
            if own(_gemm_operands(o, g)[2]):
                counted.add(o.name)
            bias = o.inputs[0] if o.opname in ("addmm", "baddbmm") else (o.inputs[2] if len(o.inputs) > 2 else None)
            bp = g.param_of(bias) if bias is not None and o.opname in ("linear", "addmm", "baddbmm") else None
            if own(bp):
                if L.roles[o.name] in ("col", "vocab"):
                    shard += g.params[bp].numel
                else:
                    rep += g.params[bp].numel
        for i in o.inputs:
            p = g.param_of(i)
            if own(p):
                if _vocab_parallel_lookup(o, g):
                    shard += g.params[p].numel
                else:
                    rep += g.params[p].numel
    rep += sum(g.params[p].numel for p in L.info.param_names if p not in seen)  # owned, never read
    return counted, rep, shard


# ------------------------------------------------------------------------------------ FLOPs


def _gemms(L: _Layer, counted: set[str]) -> list[Gemm]:
    """One Gemm per (module, weight): the experts of one projection share it; rows per token from the ops'
    FLOPs; count = the weights the layer owns (an expert GEMM's experts)."""
    groups: dict[tuple[str, str], dict] = {}
    for o in L.ops:
        if o.kind != "gemm":
            continue
        n, k, count = _gemm_shape(o, L.g)
        key, idx = L.expert_key(o)
        grp = groups.setdefault((key, L.weight_key(_gemm_operands(o, L.g)[2])), {
            "n": n, "k": k, "tp": L.roles[o.name], "expert": idx is not None or count > 1, "rows": 0.0,
            "count": 0})
        grp["rows"] += o.flops / (2.0 * n * k)
        if o.name in counted:
            grp["count"] += count if idx is None else 1
    by_module: dict[str, int] = defaultdict(int)
    for mkey, _ in groups:
        by_module[mkey] += 1
    # named by module path, or by weight where one module applies several weights (F.linear calls)
    return [Gemm(name=mkey if by_module[mkey] == 1 else wkey, n=d["n"], k=d["k"], tp=d["tp"], expert=d["expert"],
                 tokens_per_token=d["rows"] / L.T, count=d["count"]) for (mkey, wkey), d in groups.items()]


def _attention(L: _Layer) -> tuple[Attention | None, int]:
    """(the layer's Attention, number of attention cores): fused SDPA ops, then explicit matmul-softmax cores.
    K/V heads are counted before any GQA repetition."""
    g = L.g
    atts = []
    for o in L.ops:
        if o.kind == "attention" and o.token_dependent:
            q = o.in_meta[0]
            heads, d = q.shape[-3], q.shape[-1]
            atts.append((heads, max(1, round(_gqa_source(o.inputs[1], g)[1] / d)), d,
                         bool(o.attrs.get("is_causal") or o.attrs.get("has_mask")), o.attrs.get("dropout_p", 0.0) > 0))
    for mem, qk, _pv in L.cores:
        sm = qk.out
        heads = sm.shape[-3] if len(sm.shape) >= 4 else max(1, sm.shape[0] // g.batch)
        d = qk.in_meta[0].shape[-1]
        drop = any(g.ops[m].kind == "dropout" and g.ops[m].attrs.get("p", 0) > 0 for m in mem)
        atts.append((heads, max(1, round(_gqa_source(qk.inputs[1], g)[1] / d)), d, True, drop))
    if not atts:
        return None, 0
    dims = {a[2] for a in atts}
    if len(dims) > 1:
        raise CaptureError("attention cores of one layer differ in head_dim", f"{L.info.name}: {sorted(dims)}",
                           "give the layers the same head size")
    return Attention(heads=sum(a[0] for a in atts), kv_heads=sum(a[1] for a in atts), head_dim=dims.pop(),
                     causal=all(a[3] for a in atts), dropout=any(a[4] for a in atts)), len(atts)


# ------------------------------------------------------------------------------ bytes moved


def _fused_regions(L: _Layer) -> list[list[str]]:
    """Maximal regions of element-wise ops that no other kernel separates (module docstring), in order."""
    g = L.g
    cand = {o.name for o in L.ops if o.token_dependent and o.kind in ("elementwise", "dropout", "embedding")
            and o.out is not None and o.out.is_float and o.name not in L.core_members and o.name not in L.norm_of
            and o.name not in L.loss_members}
    parent = {n: n for n in cand}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    # Fusion stays legal only between ops separated by no other kernel: an op's stage counts the kernels
    # (GEMMs, attention, norms, loss) on the longest path to it; only ops of equal stage are merged.
    def anchor(n: str) -> bool:
        o = g.ops[n]
        return n in L.members and (o.kind in ("gemm", "matmul", "attention", "norm", "loss") or n in L.norm_of
                                   or n in L.core_members or n in L.loss_members)

    stage: dict[str, int] = {}
    for o in L.ops:
        stage[o.name] = max((stage.get(i, 0) + anchor(i) for i in o.inputs), default=0)
    for n in L.info.order:
        if n not in cand:
            continue
        for i in g.ops[n].inputs:
            b = g.base(i)
            if b in cand and stage[b] == stage[n]:
                parent[find(b)] = find(n)
    regions: dict[str, list[str]] = defaultdict(list)
    for n in L.info.order:
        if n in cand:
            regions[find(n)].append(n)
    return list(regions.values())


def _traffic(L: _Layer, regions: list[list[str]]) -> tuple[dict[str, float], int]:
    """({"R": ..., "S": ...} element-wise traffic per token, in activation elements, by shard; kernel launches
    besides GEMMs and attention cores): norm groups, the loss, the fused regions."""
    g = L.g
    ew = {"R": 0.0, "S": 0.0}
    kernels = 0
    for grp_ops in _by_norm(L).values():  # a norm group reads its input and writes its output: 2 x width
        gs = set(grp_ops)
        ext_in = {i for n in grp_ops for i in g.ops[n].inputs if g.live(i) and g.base(i) not in gs}
        outs = [n for n in grp_ops if g.live(n) and any(u not in gs for u in g.users(n))]
        ew["R"] += sum(g.per_token(g.ops[i].out) for i in ext_in) + sum(g.per_token(g.ops[n].out) for n in outs)
        if _DEBUG:
            print(f"[capture] {L.info.name} norm {sorted(ext_in)} -> {outs}")
        kernels += 1
    for o in L.loss_ops:  # LOSS_PASSES input-sized passes in KERNELS_LOSS launches
        src = _loss_input(L, o)
        ew[L.sh(src)] += LOSS_PASSES * g.per_token(g.ops[src].out)
        kernels += KERNELS_LOSS
    expert_regions: set[tuple[str, ...]] = set()
    for reg in regions:
        region_shard = "S" if any(L.shard.get(n) == "S" for n in reg) else "R"
        traffic = _region_traffic(L, reg)
        ew[region_shard] += traffic
        if _DEBUG:
            print(f"[capture] {L.info.name} region {region_shard} {traffic:.1f} {reg}")
        rels = [_rel(g.ops[n].module, L.info.name) for n in reg]
        repeated = False
        if L.kind == "block" and all(any(p.isdigit() for p in r.split(".")) for r in rels):
            key = tuple(sorted({".".join("*" if p.isdigit() else p for p in r.split(".")) for r in rels}))
            repeated = key in expert_regions  # the same kernel of another expert: one grouped launch
            expert_regions.add(key)
        vocab_lookup = any(g.ops[n].kind == "embedding" and g.ops[n].inputs and g.param_of(g.ops[n].inputs[0])
                           is not None and g.params[g.param_of(g.ops[n].inputs[0])].shape[0] == g.vocab
                           for n in reg)
        if not repeated:
            kernels += KERNELS_VOCAB_LOOKUP if vocab_lookup else 1
    return ew, kernels


def _by_norm(L: _Layer) -> dict[str, list[str]]:
    by_norm: dict[str, list[str]] = defaultdict(list)
    for n, key in L.norm_of.items():
        by_norm[key].append(n)
    return by_norm


def _loss_input(L: _Layer, o: OpNode) -> str:
    """The logits a loss op reads (before the log-softmax it absorbs)."""
    src = o.inputs[0]
    if L.g.ops[L.g.base(src)].opname in SOFTMAX_OPS and L.g.base(src) in L.loss_members:
        src = L.g.ops[L.g.base(src)].inputs[0]
    return src


def _region_traffic(L: _Layer, reg: list[str]) -> float:
    """Per token: the region's inputs from outside it (each tensor once), the rows it gathers from a table, the
    outputs used outside it, and a 1-byte mask per dropout."""
    g = L.g
    rs = set(reg)
    read: dict[str, float] = defaultdict(float)  # per base tensor: bytes read through its views
    for n in reg:
        o = g.ops[n]
        for i, meta in zip(o.inputs, o.in_meta):
            if g.base(i) in rs or not g.live(i) or meta is None:
                continue
            read[g.base(i)] += g.per_token(meta)
    # several views of one tensor read it at most once
    traffic = sum(min(v, g.per_token(g.ops[b].out)) for b, v in read.items())
    for n in reg:
        o = g.ops[n]
        if o.opname in GATHER_OPS and o.inputs and g.param_of(o.inputs[0]) is not None:
            traffic += g.per_token(o.out)  # rows read from the table
        if any(u not in rs for u in g.users(n)) or n in g.outputs:
            traffic += g.per_token(o.out)
        if _is_dropout(o):
            traffic += o.out.numel / g.ref_itemsize / L.T  # the 1-byte mask
    return traffic


def _is_dropout(o: OpNode) -> bool:
    return o.kind == "dropout" and o.attrs.get("p", 0) > 0 and o.attrs.get("train", True)


# ------------------------------------------------------------------------- activations kept


def _saved_activations(L: _Layer, regions: list[list[str]]) -> tuple[float, float, float]:
    """(act_tp, act_seq, act_scores_per_seq): bytes per token of what the backward keeps (module docstring),
    split by shard, and the unfused attention scores per token per sequence position."""
    g = L.g
    saved: dict[str, tuple[float, str]] = {}  # base tensor -> (bytes per token, shard)

    def save(n: str | None) -> None:
        if n is None or not g.live(n):
            return
        b = g.base(n)
        if b not in saved and b in g.ops and g.ops[b].out is not None:
            saved[b] = (g.act_bytes(g.ops[b].out), L.sh(b))

    scores_per_seq = _attention_saved(L, save)
    for grp_ops in _by_norm(L).values():  # a norm saves its input
        gs = set(grp_ops)
        for i in {i for n in grp_ops for i in g.ops[n].inputs if g.live(i) and g.base(i) not in gs}:
            if g.ops[i].requires_grad or g.ops[g.base(i)].requires_grad:
                save(i)
    for o in L.loss_ops:  # the loss saves a tensor the size of its input (the log-softmax)
        src = _loss_input(L, o)
        if g.live(src):
            b = g.base(src)
            saved.setdefault(b, (g.act_bytes(g.ops[b].out), L.sh(src)))
    for o in L.ops:  # GEMMs save their activation input; explicit matmuls both
        if o.kind == "gemm" and o.token_dependent:
            save(o.inputs[_gemm_operands(o, g)[0]])
        elif o.kind == "matmul" and o.token_dependent and o.name not in L.core_members:
            for i in o.inputs:
                save(i)
    masks = {"R": 0.0, "S": 0.0}
    for reg in regions:
        for n in reg:
            if _is_dropout(g.ops[n]):
                masks[L.sh(n)] += g.ops[n].out.numel / L.T  # 1 byte per element
    for reg in regions:
        _region_saved(L, reg, save)
    act_tp = sum(b for b, s in saved.values() if s == "S") + masks["S"]
    act_seq = sum(b for b, s in saved.values() if s == "R") + masks["R"]
    return act_tp, act_seq, scores_per_seq


def _attention_saved(L: _Layer, save) -> float:
    """Saves q, k, v (before GQA repetition) and the output of every attention core; returns the scores an
    unfused core keeps per token per sequence position (2 bytes per score, +3 with dropout, for a fused SDPA;
    what softmax and dropout keep for an explicit core)."""
    g = L.g
    scores_per_seq = 0.0
    for o in L.ops:
        if o.kind == "attention" and o.token_dependent:
            heads = o.in_meta[0].shape[-3]
            scores_per_seq += heads * (2 + (3 if o.attrs.get("dropout_p", 0.0) > 0 else 0))
            save(o.inputs[0])
            save(_gqa_source(o.inputs[1], g)[0])
            save(_gqa_source(o.inputs[2], g)[0])
            save(o.name)
    for mem, qk, pv in L.cores:
        save(qk.inputs[0])
        save(_gqa_source(qk.inputs[1], g)[0])
        save(_gqa_source(pv.inputs[1], g)[0])
        sk = qk.out.shape[-1]
        score_saved: set[str] = set()
        for m in mem:
            mo = g.ops[m]
            if mo.opname in SOFTMAX_OPS:
                score_saved.add(m)
            if mo.kind == "dropout" and mo.attrs.get("p", 0) > 0:
                scores_per_seq += mo.out.numel / (L.T * sk)  # 1-byte mask per score
        score_saved.add(g.base(pv.inputs[0]))
        for m in score_saved:
            scores_per_seq += g.act_bytes(g.ops[m].out) / sk
    return scores_per_seq


def _region_saved(L: _Layer, reg: list[str], save) -> None:
    """What a fused region's non-linear ops need, taken from outside the region (inside it is recomputed)."""
    g = L.g
    rs = set(reg)
    for n in reg:
        for t in _needs(g.ops[n], g):
            if not g.live(t):
                continue
            if g.base(t) not in rs:
                save(t)
                continue
            stack, seen = [g.base(t)], set()
            while stack:
                c = stack.pop()
                if c in seen:
                    continue
                seen.add(c)
                for i in g.ops[c].inputs:
                    if not g.live(i) or not g.ops[i].requires_grad:
                        continue
                    if g.base(i) in rs:
                        stack.append(g.base(i))
                    else:
                        save(i)


def _layer_input(L: _Layer) -> tuple[float, int]:
    """(bytes per token of a block's input, kept by full recompute; the residual-stream width)."""
    g = L.g
    ext = [i for n in L.info.order for i in g.ops[n].inputs if g.live(i) and g.ops[i].layer != L.info.name]
    if ext and L.kind == "block":
        return g.act_bytes(g.ops[ext[0]].out), g.ops[ext[0]].out.shape[-1]
    return 0.0, g.hidden or 0


def _fusable_ops(ops: list[OpNode], norm_of: dict[str, str], T: float, attention, layer_kind: str,
                 g: _Ctx) -> dict:
    """What the fusable ops of a layer process (the cost model prices them per kernel set): the norms'
    elements per token (one output per norm group) and kind, the MLP activation's kind and output elements,
    and the q/k elements rotated when the layer computes rotary tables (cos/sin)."""
    out: dict = {}
    groups: dict[str, list[OpNode]] = defaultdict(list)
    for o in ops:
        if o.name in norm_of:
            groups[norm_of[o.name]].append(o)
    if groups:
        names = " ".join(f"{o.opname} {o.module_type or ''}" for grp in groups.values() for o in grp).lower()
        out["norm_kind"] = "rmsnorm" if "rms" in names else "layernorm"
        # a norm group's output is its last op's
        out["norm_elems"] = float(sum(grp[-1].out.numel / T for grp in groups.values() if grp[-1].out))
    if layer_kind != "block":
        return out
    for kind, opnames in (("swiglu", ("silu", "silu_")), ("gelu", ("gelu", "gelu_")), ("relu", ("relu", "relu_"))):
        acts = [o for o in ops if o.opname in opnames and o.token_dependent and o.out is not None]
        if acts:
            out["act_kind"] = kind
            out["act_elems"] = float(sum(o.out.numel / T for o in acts))
            break
    rotate_half = any(o.opname == "cat" and any(g.ops[i].opname == "neg" for i in o.inputs if i in g.ops)
                      for o in ops)  # cat(-x2, x1): Hugging Face's rotate_half
    if attention is not None and (rotate_half or any(o.opname == "mul" and any(_from_trig(i, g) for i in o.inputs)
                                                     for o in ops)):
        out["rope_elems"] = float((attention.heads + attention.kv_heads) * attention.head_dim)
    return out


def _from_trig(name: str, g: _Ctx, depth: int = 8) -> bool:
    """Whether tensor `name` is a cos/sin table, possibly reshaped, cast or indexed (rotary embeddings,
    computed in the block or passed in from the model's root as Hugging Face does)."""
    cur = g.ops.get(name)
    for _ in range(depth):
        if cur is None:
            return False
        if cur.opname in ("cos", "sin"):
            return True
        if not cur.inputs or (cur.kind not in ("view", "alias") and cur.opname not in CAST_OPS
                              and cur.opname not in ("unsqueeze", "expand", "index", "slice", "select", "getitem",
                                                     "mul", "clone", "contiguous")):
            return False
        cur = g.ops.get(cur.inputs[0])
    return False


def _feeds_loss(name: str, g: _Ctx) -> bool:
    stack, seen = [name], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for c in g.consumers.get(n, ()):
            o = g.ops[c]
            if o.kind == "loss":
                return True
            if o.kind in ("view", "alias") or o.opname in CAST_OPS or o.opname in SOFTMAX_OPS:
                stack.append(c)
    return False
