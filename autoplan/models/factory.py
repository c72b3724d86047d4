"""`package.module:factory` models at run time: the module the factory returns is the module that trains.

The factory (the same one capture calls: it returns (module, example_inputs), often on the meta device) is called
with the run's seed set; a meta-device module is materialised (tied weights kept tied) and every submodule's own
`reset_parameters` runs in a fixed order under that seed, so every rank holds the same initial weights (what
FSDP's param_init_fn does); a meta-device module holding parameters or buffers in a module without
`reset_parameters` is refused. `FactoryModel` wraps it for the runtime: forward returns the logits tensor (a
`.logits` attribute or the first element of a tuple is taken), and `layers` names the repeated blocks (the
largest ModuleList/ModuleDict) that FSDP wraps one by one.

What is sharded comes from the capture of the same module (`factory_structure`, autoplan.capture):
  * tensor parallelism (the stage program's table, `codegen.program.factory_tp_layout`, which the
    emitted stage program applies): the block GEMMs the capture marks column-parallel (reading the replicated residual stream)
    become ColwiseParallel, the ones reading their output RowwiseParallel; the token embedding RowwiseParallel
    (vocabulary rows) and the LM head ColwiseParallel (vocabulary columns) where that is safe. Head counts held
    in int attributes are divided by tp: `tp_head_counts` captures one rank's shard (linears narrowed, on meta)
    with the smallest subset of candidate attributes under which every attention gets heads/tp heads of the
    unchanged size. A module that reshapes by a literal count, splits a fused projection, or applies a weight
    outside nn.Linear is refused, naming the module and the reason.
  * pipeline parallelism (`cut_factory_stage`): every rank builds the whole module (same initial weights as one
    process), then blocks of other stages become pass-throughs, a later stage's embedding module returns the
    stage input, and an earlier stage's head modules pass through, so the user's own forward runs each stage.
    Only a forward that is a sequence embedding -> blocks -> head (one hidden-state tensor between them, no
    computation outside modules on that path) is cut; others are refused.
  * recomputation (`apply_factory_recompute`): full = checkpoint_wrapper on the first N blocks of a stage;
    selective = every scaled_dot_product_attention call of the block's forward checkpointed (refused when the
    attention is written as matmul/softmax).
Context, sequence and expert parallelism are refused (`check_factory_plan`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

SPLIT_OPS = {"split", "split_with_sizes", "chunk", "tensor_split", "slice", "narrow", "unbind"}
# where a module's head count can live: ints in a user module's own attributes (not torch's modules)
_TORCH_PREFIXES = ("torch.",)


class FactoryModel(nn.Module):
    def __init__(self, module: nn.Module, ref: str) -> None:
        super().__init__()
        self.module = module
        self.ref = ref
        self.positions = None  # the runtime's context-parallel hook (unused: cp is refused)
        object.__setattr__(self, "_stage_input", None)  # a later pipeline stage's input module (cut_factory_stage)

    @property
    def layers(self) -> dict[str, nn.Module]:
        """The repeated blocks this rank runs: children of the largest ModuleList/ModuleDict (FSDP units), else
        none; blocks a pipeline cut replaced by pass-throughs are left out."""
        best: nn.Module | None = None
        for m in self.module.modules():
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and (best is None or len(m) > len(best)):
                best = m
        if best is None:
            return {}
        items = best.items() if isinstance(best, nn.ModuleDict) else enumerate(best)
        return {str(k): v for k, v in items if not isinstance(v, _PassThrough)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        entry = self._stage_input
        if entry is not None:  # a later pipeline stage: `tokens` is the previous stage's hidden state
            entry.value = tokens
            try:
                out = self.module(torch.zeros(tokens.shape[:2], dtype=torch.long, device=tokens.device))
            finally:
                entry.value = None
        else:
            out = self.module(tokens)
        if hasattr(out, "logits"):
            return out.logits
        if isinstance(out, (tuple, list)):
            return out[0]
        return out


class _PassThrough(nn.Module):
    """Stands for a module another pipeline stage runs: returns its first input unchanged."""

    def forward(self, x, *args, **kwargs):
        return x


class _StageInput(nn.Module):
    """Stands for the embedding module on a later pipeline stage: returns the hidden state the stage received."""

    value: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        if self.value is None:
            raise RuntimeError("a later pipeline stage ran without its input (call FactoryModel, not the module)")
        return self.value


def load_on_meta(ref: str):
    """The factory's (module, inputs) on the meta device, built there when the factory allows it (it creates
    its tensors on the default device), so checks of a large CPU-built model allocate nothing."""
    from autoplan.capture import CaptureError, load_module_factory

    try:
        with torch.device("meta"):
            module, inputs = load_module_factory(ref)
    except CaptureError:  # the factory needs real tensors while building: build it, then move it
        module, inputs = load_module_factory(ref)
    return module.to("meta"), inputs


def build_factory(ref: str, *, device="cpu", seed: int = 0) -> FactoryModel:
    from autoplan.capture import load_module_factory

    torch.manual_seed(seed)
    if torch.device(device).type == "meta":
        return FactoryModel(load_on_meta(ref)[0], ref)
    module, _inputs = load_module_factory(ref)
    if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
        missing = uninitialisable(module)
        if missing:
            from autoplan.cost_models.errors import SpecError

            raise SpecError(f"module {ref} is built on the meta device and cannot be initialised",
                            f"{missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""),
                            "build the module on the CPU in the factory, or give that module a reset_parameters()")
        ties = _shared_parameters(module)
        module = module.to_empty(device=device)
        _retie(module, ties)  # to_empty gives each name its own tensor: a tied head would train untied
        torch.manual_seed(seed)
        with torch.no_grad():
            for m in module.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
    else:
        module = module.to(device)
    return FactoryModel(module, ref)


def uninitialisable(module: nn.Module) -> list[str]:
    """Modules of a meta-device module holding parameters or buffers of their own but no reset_parameters():
    materialised with to_empty, their values would be whatever memory held (a norm's weight, a rotary table)."""
    out = []
    for name, m in module.named_modules():
        own = [n for n, _ in m.named_parameters(recurse=False)] + [n for n, _ in m.named_buffers(recurse=False)]
        if own and not callable(getattr(m, "reset_parameters", None)):
            out.append(f"{name or type(module).__name__} ({type(m).__name__}) holds {', '.join(own)} and has no "
                       "reset_parameters()")
    return out


def _shared_parameters(module: nn.Module) -> list[tuple[str, str]]:
    """(name, first name) of every parameter registered under a second name (tied weights)."""
    first: dict[int, str] = {}
    out = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return out


def _retie(module: nn.Module, ties: list[tuple[str, str]]) -> None:
    for name, src in ties:
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, attr, module.get_parameter(src))


# ------------------------------------------------------------------------------ what the capture found


@dataclass
class FactoryStructure:
    """What the capture of a factory's module says about sharding it. Module paths are relative to the user's
    module; `col`/`row` are relative to a block (the same in every block)."""

    ref: str
    blocks: list[str]
    col: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)
    linears: list[tuple[str, str]] = field(default_factory=list)  # (path in a block, "col" | "row"), forward order
    # modules in a block whose output only column linears read, several of them (a norm before q, k, v): made a
    # replicated DTensor once, so its input gradient is all-reduced once rather than once per linear
    fanout: list[str] = field(default_factory=list)
    embedding: str | None = None  # nn.Embedding looking up the input token ids (vocabulary rows)
    head: str | None = None  # nn.Linear producing the vocabulary logits
    head_is_output: bool = False  # the logits leave the forward unchanged (only views after the head)
    tied: bool = False  # head and embedding share a weight
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    sdpa: bool = False  # every block's attention core is one scaled_dot_product_attention call
    attention: str = ""  # the module running the first block's attention core
    pre_modules: list[str] = field(default_factory=list)  # modules before the first block (outermost first)
    post_modules: list[str] = field(default_factory=list)  # modules after the last block
    vocab: int = 0
    hidden: int = 0
    tp_problems: list[str] = field(default_factory=list)
    pp_problems: list[str] = field(default_factory=list)
    selective_problems: list[str] = field(default_factory=list)
    num_parameters: int = 0
    # int attributes holding a head count, found on the first block: (module path in the block, name, value)
    head_attrs: list[tuple[str, str, int]] = field(default_factory=list)
    uninitialisable: list[str] = field(default_factory=list)  # built on meta: modules build_factory cannot init

    @property
    def attention_scope(self) -> str:
        """The attention module's path relative to its block ("" when the block's own forward calls it)."""
        b = self.blocks[0]
        return self.attention[len(b) + 1:] if self.attention.startswith(b + ".") else ""


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _outer_module(path: str, stack: str) -> str | None:
    """The outermost module holding `path` that does not also hold the block stack (None: the op runs in a
    forward that also runs the blocks, e.g. the root's)."""
    parts = path.split(".") if path else []
    for i in range(1, len(parts) + 1):
        cand = ".".join(parts[:i])
        if not _under(stack, cand):
            return cand
    return None


def _analyse(graph, ref: str) -> FactoryStructure:
    """Torch-free: the FactoryStructure of a captured ModelGraph (see the module docstring)."""
    blocks = list(graph.blocks)
    st = FactoryStructure(ref=ref, blocks=blocks, num_parameters=graph.num_parameters)
    profiles = {p.name: p for p in graph.profiles}
    att = next((profiles[b].attention for b in blocks if profiles[b].attention is not None), None)
    if att is not None:
        st.heads, st.kv_heads, st.head_dim = att.heads, att.kv_heads, att.head_dim
    st.hidden = next((profiles[b].hidden for b in blocks), 0)
    users: dict[str, list[str]] = {}
    for o in graph.ops.values():
        for i in o.inputs:
            users.setdefault(i, []).append(o.name)
    _find_linears(st, graph, profiles, users)
    _find_attention_core(st, graph, profiles)
    _find_vocabulary(st, graph, users)
    _find_pipeline_cuts(st, graph)
    return st


def _rel(path: str, block: str) -> str:
    return path[len(block) + 1:] if path.startswith(block + ".") else ""


def _find_linears(st: FactoryStructure, graph, profiles: dict, users: dict[str, list[str]]) -> None:
    """Column/row roles of the first block's nn.Linear modules (the capture's LayerProfile.gemms), and what keeps
    tensor parallelism off them: weights outside nn.Linear, experts, fused projections, differing blocks."""
    ops, blocks = graph.ops, st.blocks
    stack = blocks[0].rsplit(".", 1)[0] if "." in blocks[0] else ""
    roles = {g.name: g.tp for g in profiles[blocks[0]].gemms}
    col_inputs: dict[str, list[str]] = {}  # base tensor -> column GEMMs reading it
    # blocks may differ (a sliding window on some, another attention core) as long as their linears and roles do
    kinds = {tuple((g.name, g.tp) for g in profiles[grp.first].gemms) for grp in graph.block_groups}
    if len(kinds) > 1:
        other = next(grp.first for grp in graph.block_groups
                     if tuple((g.name, g.tp) for g in profiles[grp.first].gemms) != tuple(roles.items()))
        st.tp_problems.append(f"{other}: its linears differ from {blocks[0]}'s; one tensor-parallel layout is "
                              "applied to every block")
    for n in graph.layer(blocks[0]).order:
        o = ops[n]
        if o.kind != "gemm":
            continue
        r = _rel(o.module, blocks[0])
        if o.opname != "linear" or o.module_type != "Linear" or not r:
            st.tp_problems.append(f"{o.module or stack}: applies a weight with {o.opname} outside an nn.Linear "
                                  "(ColwiseParallel/RowwiseParallel shard nn.Linear modules)")
            continue
        role = roles.get(r)
        if role not in ("col", "row") or any(p.isdigit() for p in r.split(".")):
            st.tp_problems.append(f"{o.module}: a {role or 'expert'} GEMM (mixture of experts): experts are not "
                                  "sharded over tp for module:factory models")
            continue
        target = st.col if role == "col" else st.row
        if r not in target:
            target.append(r)
            st.linears.append((r, role))
        split = _split_along_features(n, ops, users) if role == "col" else None
        if role == "col":
            col_inputs.setdefault(_base(o.inputs[0], ops), []).append(n)
        if split:
            st.tp_problems.append(
                f"{o.module}: its output is split along its {o.out.shape[-1]} features ({split}) into several "
                "tensors (a fused projection such as q/k/v); a contiguous column shard would give each rank parts "
                "of each, not whole heads: use one nn.Linear per projection")
    _find_fanout(st, graph, col_inputs, users)


def _find_fanout(st: FactoryStructure, graph, col_inputs: dict[str, list[str]], users: dict[str, list[str]]) -> None:
    """Modules of the first block whose output is read, through views, only by several column linears."""
    ops, b = graph.ops, st.blocks[0]
    order = graph.layer(b).order
    for base, gemms in col_inputs.items():
        p = ops[base]
        m = _rel(p.module, b)
        if len(gemms) < 2 or not m:
            continue
        readers, todo = set(), [base]
        while todo:
            for u in users.get(todo.pop(), []):
                if ops[u].kind in ("view", "alias"):
                    todo.append(u)
                elif ops[u].kind != "skip":
                    readers.add(u)
        after = [n for n in order[order.index(base) + 1:] if _under(ops[n].module, p.module)]
        if readers == set(gemms) and not after and m not in st.fanout:  # the module's last op is its output
            st.fanout.append(m)


def _base(name: str, ops: dict) -> str:
    o = ops[name]
    while o.kind in ("view", "alias") and o.inputs:
        o = ops[o.inputs[0]]
    return o.name


def _split_along_features(name: str, ops: dict, users: dict[str, list[str]]) -> str | None:
    """The op (name) that splits GEMM `name`'s output along its whole feature dimension, looking through views."""
    n_out = ops[name].out.shape[-1]
    todo = [name]
    while todo:
        for u in users.get(todo.pop(), []):
            uo = ops[u]
            if uo.opname in SPLIT_OPS and uo.in_meta and uo.in_meta[0] is not None and \
                    uo.in_meta[0].shape[-1] == n_out and any(m.shape[-1] < n_out for m in uo.outputs):
                return uo.opname
            if uo.kind in ("view", "alias") and uo.opname not in SPLIT_OPS:
                todo.append(u)
    return None


def _find_attention_core(st: FactoryStructure, graph, profiles: dict) -> None:
    """The module calling the first block's attention core, and whether every block's core is one
    scaled_dot_product_attention call (what selective recompute checkpoints)."""
    ops = graph.ops

    def core(block: str) -> tuple[list, list]:
        order = graph.layer(block).order
        return ([ops[n] for n in order if ops[n].kind == "attention"],
                [ops[n] for n in order if ops[n].opname in ("softmax", "_softmax", "_safe_softmax")])

    sdpa, soft = core(st.blocks[0])
    st.attention = (sdpa or soft)[0].module if (sdpa or soft) else st.blocks[0]
    for b in st.blocks:
        b_sdpa, b_soft = core(b)
        if not b_sdpa and profiles[b].attention is not None:
            st.selective_problems.append(f"{(b_soft[0].module if b_soft else b)}: the attention core is written as "
                                         "matmul/softmax, not one scaled_dot_product_attention call, so it cannot "
                                         "be recomputed on its own")
            break
    st.sdpa = not st.selective_problems and bool(sdpa)


def _find_vocabulary(st: FactoryStructure, graph, users: dict[str, list[str]]) -> None:
    """The vocabulary head (the head GEMM making the logits), sharded when it is an nn.Linear; the token embedding,
    sharded when nothing else reads its table (a head applying it with F.linear would meet a sharded weight);
    otherwise both stay replicated. The capture's rules, which price the same layout (autoplan.capture.analyze:
    `vocab_parallel_lookup`, the head GEMM's role, `logits_transformed`)."""
    from autoplan.capture.analyze import logits_transformed, param_of, vocab_parallel_lookup

    ops = graph.ops
    head = graph.profiles[-1]
    head_gemm = next((g for g in head.gemms if g.tp == "vocab"), None)
    st.vocab = head.logits_per_token or (head_gemm.n if head_gemm is not None else 0)
    head_param = None
    for n in graph.layer("head").order:
        o = ops[n]
        if o.kind == "gemm" and o.out is not None and o.out.shape[-1] == st.vocab and st.vocab:
            if o.module_type != "Linear":
                break  # F.linear / matmul with a weight: the head stays replicated
            st.head = o.module
            head_param = next((p for i in o.inputs if (p := param_of(i, ops)) is not None), None)
            st.head_is_output = not logits_transformed(n, users, ops)  # the capture's rule, which prices it
            break
    for n in graph.layer("embedding").order:
        o = ops[n]
        if o.kind == "embedding" and o.token_dependent and o.module_type == "Embedding":
            split = vocab_parallel_lookup(o, ops, st.vocab, st.head)
            st.embedding = o.module if split else st.embedding
            st.tied = split and head_param is not None and param_of(o.inputs[0], ops) == head_param
            break


def _find_pipeline_cuts(st: FactoryStructure, graph) -> None:
    """The modules before the first and after the last block, and what keeps the forward from being cut at the
    block boundaries: embedding -> blocks -> head with one hidden-state tensor between consecutive parts, and no
    computation on it outside modules."""
    ops, blocks = graph.ops, st.blocks
    stack = blocks[0].rsplit(".", 1)[0] if "." in blocks[0] else ""
    order = ["embedding", *blocks, "head"]
    nxt = {a: b for a, b in zip(order, order[1:])}
    for a, b, tensors in graph.layers.edges(data="tensors"):
        derived = sorted(t for t in tensors if ops[t].token_dependent and ops[t].out is not None
                         and not ops[t].out.is_float)
        if derived and a == "embedding":  # a later stage runs the root's code on dummy token ids
            st.pp_problems.append(f"the forward computes {', '.join(derived)} from the token ids and passes it to {b}: "
                                  "a later pipeline stage receives only the hidden state (a padding mask?)")
        live = sorted(t for t in tensors if ops[t].token_dependent and ops[t].out is not None and ops[t].out.is_float)
        if not live:
            continue  # position tables, causal masks: recomputed by every stage from the input's shape
        if nxt.get(a) != b or len(live) > 1:
            st.pp_problems.append(f"the forward passes {', '.join(live)} from {a} to {b}: pipeline stages exchange one "
                                  "hidden-state tensor between consecutive parts (embedding -> blocks -> head)")
    for lname, where in (("embedding", st.pre_modules), ("head", st.post_modules)):
        for n in graph.layer(lname).order:
            o = ops[n]
            if not o.token_dependent or o.kind == "skip" or (lname == "head" and o.kind in ("view", "alias")):
                continue  # views of the last hidden state (HF's logits slice) pass through; the dry run checks shapes
            outer = _outer_module(o.module, stack)
            if outer is None:
                st.pp_problems.append(
                    f"the model's own forward computes {o.opname} "
                    f"{'before the first' if lname == 'embedding' else 'after the last'} block, outside any module: "
                    "a pipeline stage runs whole modules (move it into the embedding or head module)")
                break
            if outer not in where:
                where.append(outer)
    for b in blocks:
        stray = [ops[n] for n in graph.layer(b).order if ops[n].token_dependent and not _under(ops[n].module, b)
                 and ops[n].kind not in ("view", "skip")]
        if stray:
            st.pp_problems.append(f"the forward computes {stray[0].opname} between {b} and the next block, outside "
                                  "any block: a pipeline cut there would lose it")
            break
    if not st.pre_modules:
        st.pp_problems.append("no module runs before the first block (the embedding) to hand a later stage its "
                              "input")
    if st.tied:
        st.pp_problems.append(f"{st.head} shares its weight with {st.embedding}: the first and last pipeline stages "
                              "would each hold a copy (not supported for module:factory models)")


@functools.lru_cache(maxsize=8)
def factory_structure(ref: str) -> FactoryStructure:
    """Capture the factory's module (meta device) and analyse it; cached per process (runs once per rank)."""
    from autoplan.capture import capture, load_module_factory

    module, inputs = load_module_factory(ref)
    st = _analyse(capture(module, inputs, name=ref.rpartition(":")[2]), ref)
    st.head_attrs = _head_attributes(module.get_submodule(st.blocks[0]), {st.heads, st.kv_heads} - {0},
                                     st.attention_scope)
    if any(p.is_meta for p in module.parameters()):
        st.uninitialisable = uninitialisable(module)
    return st


# ------------------------------------------------------------------------------------ module surgery


def _set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)


def _head_attributes(block: nn.Module, counts: set[int], scope: str) -> list[tuple[str, str, int]]:
    """(module path in the block, attribute, value): int attributes equal to a captured head or KV-head count, of
    the user-defined modules from the block down to `scope` (the module calling the attention core, relative to
    the block), which a rank holding 1/tp of the heads must divide. Other modules (the MLP's) are not searched."""
    out = []
    for path, m in block.named_modules():
        if type(m).__module__.startswith(_TORCH_PREFIXES) or not (path == "" or _under(scope, path)):
            continue
        for k, v in vars(m).items():
            if not k.startswith("_") and type(v) is int and v in counts:
                out.append((path, k, v))
    return out


def _narrow(lin: nn.Module, dim: int, tp: int) -> None:
    """Meta-device stand-in for one rank's shard of an nn.Linear (dim 0: columns, 1: rows)."""
    w = lin.weight
    shape = list(w.shape)
    shape[dim] //= tp
    lin.weight = nn.Parameter(torch.empty(shape, device="meta", dtype=w.dtype))
    if dim == 0:
        lin.out_features = shape[0]
        if lin.bias is not None:
            lin.bias = nn.Parameter(torch.empty(shape[0], device="meta", dtype=lin.bias.dtype))
    else:
        lin.in_features = shape[1]


def _dry_run_tp(st: FactoryStructure, tp: int, attrs: list[tuple[str, str, int]]) -> list[str]:
    """Capture one rank's shard of the module on the meta device: the column linears narrowed to 1/tp of their
    outputs, the row linears to 1/tp of their inputs, the head-count attributes `attrs` (paths in a block)
    divided. Every block's attention must get heads/tp heads and KV heads/tp KV heads of the unchanged size.
    Returns the problems found (the same tracer as planning, so code that only traces, e.g. with .item() on
    shapes, is checked too)."""
    from autoplan.capture import CaptureError, capture

    module, inputs = load_on_meta(st.ref)
    found = ", ".join(f"{p + '.' if p else ''}{k}={v}" for p, k, v in attrs) or "none"
    for b in st.blocks:
        block = module.get_submodule(b)
        for p, role in st.linears:
            dim = 0 if role == "col" else 1
            lin = block.get_submodule(p)
            if lin.weight.shape[dim] % tp:
                return [f"{b}.{p}: {lin.weight.shape[dim]} {'output' if dim == 0 else 'input'} features do not "
                        f"divide over tp={tp}"]
            _narrow(lin, dim, tp)
        divide_head_counts(block, tp, [(p, k) for p, k, _ in attrs])
    where = st.attention or st.blocks[0]
    try:
        graph = capture(module, inputs, name="shard")
    except CaptureError as e:
        return [f"{where}: with its linears split over tp={tp} and its head-count attributes ({found}) divided, its "
                f"forward fails ({e.detail[:200]}); reshape by attributes holding the head counts (self.n_heads) "
                "and -1, not by the hidden size"]
    want_q, want_kv = st.heads // tp, st.kv_heads // tp
    for prof in graph.profiles:
        att = prof.attention
        if prof.kind != "block" or att is None:
            continue
        if att.heads != want_q or att.head_dim != st.head_dim or att.kv_heads != want_kv:
            return [f"{where}: with its linears split over tp={tp} the attention gets {att.heads} heads of size "
                    f"{att.head_dim} ({att.kv_heads} KV heads) per rank instead of {want_q} of size {st.head_dim} "
                    f"({want_kv} KV heads): the reshape does not take the head count from an attribute (a literal "
                    f"count, or one computed from the hidden size; attributes divided: {found})"]
    return []


@functools.lru_cache(maxsize=16)
def tp_head_counts(ref: str, tp: int) -> tuple[tuple[tuple[str, str, int], ...], tuple[str, ...]]:
    """(head-count attributes to divide, problems) for tensor parallelism of degree tp, cached per process.

    The candidates are the int attributes equal to a captured head or KV-head count (`FactoryStructure.head_attrs`);
    one equal by coincidence (Hugging Face's `num_key_value_groups` = heads / KV heads, here equal to the KV
    heads) must not be divided. The dry run tries the subsets of the candidates, smallest first (divide only what
    the shapes need: a reshape with -1 needs nothing), and keeps the first one under which the module traces and
    every attention gets heads/tp heads of the unchanged size; no subset: the problems of dividing them all."""
    import itertools

    st = factory_structure(ref)
    problems = list(st.tp_problems)
    for what, n in (("heads", st.heads), ("KV heads", st.kv_heads)):
        if n and n % tp:
            problems.append(f"{st.attention}: {n} attention {what} do not divide over tp={tp}")
    if problems:
        return (), tuple(problems)
    cands = list(st.head_attrs)
    last: list[str] = []
    for r in range(len(cands) + 1):
        for subset in itertools.combinations(cands, r):
            found = _dry_run_tp(st, tp, list(subset))
            if not found:
                return tuple(subset), ()
            last = found  # the problems with every candidate divided are the ones reported
    return (), tuple(last)


def _dry_run_pp(st: FactoryStructure, plan) -> list[str]:
    """Cut the module (meta) as each stage of the plan and trace it (torch.export, as capture does, so code that
    only traces is checked too): a stage must turn its input (token ids or the previous stage's hidden state)
    into a hidden state of the same shape, or the last into logits."""
    from autoplan.capture.trace import _quiet

    _, inputs = load_on_meta(st.ref)
    tokens = (inputs[0] if isinstance(inputs, (tuple, list)) else inputs).to("meta")
    hidden = torch.empty(*tokens.shape[:2], st.hidden, device="meta")
    for stage in plan.stages:
        model = build_factory(st.ref, device="meta")
        cut_factory_stage(model, stage, st)
        try:
            with _quiet():
                ep = torch.export.export(model, (tokens if stage.has_embedding else hidden,), strict=False)
            out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0][0].meta["val"]
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            return [f"stage {stage.index} (blocks {stage.layers[0]}..{stage.layers[1] - 1}) fails when the other "
                    f"stages' modules pass their input through ({type(e).__name__}: {msg[:160]})"]
        want = (*tokens.shape[:2], st.vocab if stage.has_head else st.hidden)
        if tuple(out.shape) != want:
            return [f"stage {stage.index} returns shape {tuple(out.shape)}, expected {want}"]
    return []


# ----------------------------------------------------------------------------- applied per stage


def cut_factory_stage(model: FactoryModel, stage, st: FactoryStructure | None = None) -> list[str]:
    """Pipeline cut of a (materialised or meta) FactoryModel at the captured block boundaries: blocks outside
    `stage.layers` pass their input through; without the embedding the first pre-block module returns the
    stage's input (the others pass through); without the head the post-block modules pass through.
    Parameter names of what is kept are unchanged (global block keys)."""
    st = st or factory_structure(model.ref)
    lo, hi = stage.layers
    for i, b in enumerate(st.blocks):
        if not lo <= i < hi:
            _set_module(model.module, b, _PassThrough())
    notes = [f"blocks {lo}..{hi - 1} of {len(st.blocks)}"]
    if not stage.has_embedding:
        entry = _StageInput()
        _set_module(model.module, st.pre_modules[0], entry)
        for p in st.pre_modules[1:]:
            _set_module(model.module, p, _PassThrough())
        object.__setattr__(model, "_stage_input", entry)
        notes.append(f"{st.pre_modules[0]} returns the stage input")
    if not stage.has_head:
        for p in st.post_modules:
            _set_module(model.module, p, _PassThrough())
    return notes


def head_count_attributes(st: FactoryStructure, layers: tuple[int, int], tp: int) -> list[tuple[str, str]]:
    """(module path, attribute) of every head-count attribute tp divides in blocks `layers` (tp_head_counts)."""
    attrs = tp_head_counts(st.ref, tp)[0]
    return [(f"{b}.{p}" if p else b, k) for b in st.blocks[layers[0]:layers[1]] for p, k, _ in attrs]


def divide_head_counts(module: nn.Module, tp: int, attributes: list[tuple[str, str]]) -> None:
    """Each rank holds 1/tp of the heads: divide the attributes the module reshapes by."""
    for path, name in attributes:
        owner = module.get_submodule(path)
        setattr(owner, name, getattr(owner, name) // tp)


class _RecomputeAttention(torch.overrides.TorchFunctionMode):
    """Active during a block's forward: every scaled_dot_product_attention call runs under activation
    checkpointing (its inputs saved, the kernel recomputed in the backward pass), the other ops as usual. (Torch's
    selective activation checkpointing with an op policy was tried first: it failed in pipelined runs under the
    runtime's CPU memory tracker, 'aten.mul.Scalar encountered during backward but not found in storage'.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            from torch.utils.checkpoint import checkpoint

            return checkpoint(func, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        return func(*args, **kwargs)


def _recompute_attention(block: nn.Module) -> None:
    forward = block.forward

    @functools.wraps(forward)
    def selective_forward(*args, **kwargs):
        with _RecomputeAttention():
            return forward(*args, **kwargs)

    block.forward = selective_forward
    block._autoplan_recompute = "selective"


def apply_factory_recompute(model: FactoryModel, stage, st: FactoryStructure | None = None,
                            rest: str | None = "selective") -> list[str]:
    """full: the first `stage.recompute_layers` blocks of the stage checkpointed whole (checkpoint_wrapper), the
    stage's other blocks selectively, or plainly where `rest` is 'none' (TrainingSpec.partial_rest; as the stage ILP
    and the estimate price a partly full stage); selective: in
    every block of the stage, each scaled_dot_product_attention call is checkpointed (the attention core, as the
    zoo's selective recompute; a function call in the user's code, so it is caught by a TorchFunctionMode around
    the block's forward rather than wrapped as a module)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    st = st or factory_structure(model.ref)
    lo = stage.layers[0]
    n_full, n_sel = stage.recompute_split(rest)
    notes = []
    if n_full:
        keys = st.blocks[lo:lo + n_full]
        for b in keys:
            _set_module(model.module, b, checkpoint_wrapper(model.module.get_submodule(b), preserve_rng_state=True))
        notes.append(f"full: {', '.join(keys)}")
    rest = st.blocks[lo + n_full:lo + n_full + n_sel]
    for b in rest:
        _recompute_attention(model.module.get_submodule(b))
    if rest:
        notes.append(f"selective (scaled_dot_product_attention): {', '.join(rest)}")
    return notes


# -------------------------------------------------------------------------------------- the check


def check_factory_plan(plan) -> None:
    """Refuse, before launch, what cannot be done to this user module (see the module docstring)."""
    from autoplan.cost_models.errors import ConfigError

    ref = plan.model_source["factory"]
    c = plan.parallel

    def refuse(knob: str, reason: str, fix: str) -> None:
        raise ConfigError(f"module {ref} cannot be sharded as planned", f"{knob}: {reason}", fix)

    bad = [f"{k}={v}" for k, v in (("cp", c.cp), ("ep", c.ep)) if v > 1]
    if bad:
        refuse(", ".join(bad), "context and expert parallelism need autoplan's own attention and MoE modules",
               "re-plan with --fix cp=1 --fix ep=1, or return an autoplan.models model from the factory")
    if c.sp and c.tp > 1:
        refuse("sp=1", "sequence parallelism needs the norms and residual stream of autoplan's own blocks; user "
               "modules get tensor parallelism without it", "re-plan with --fix sp=0")
    st = factory_structure(ref)  # the capture of the module (once per process)
    if st.uninitialisable:
        refuse("initialisation", f"the factory builds it on the meta device and {st.uninitialisable[0]}",
               "build the module on the CPU in the factory, or give that module a reset_parameters()")
    selective = any(s.recompute == "selective" for s in plan.stages)
    if c.tp == 1 and c.pp == 1 and not selective:
        return
    if c.tp > 1:
        problems = tp_head_counts(ref, c.tp)[1]
        if problems:
            refuse(f"tp={c.tp}", problems[0], "re-plan with --fix tp=1, or change the module as the reason says")
    if c.pp > 1:
        problems = st.pp_problems or _dry_run_pp(st, plan)
        if problems:
            refuse(f"pp={c.pp}", problems[0], "re-plan with --fix pp=1, or make the forward embedding -> blocks -> "
                   "head with the computation inside those modules")
    if selective and st.selective_problems:
        refuse("recompute=selective", st.selective_problems[0], "re-plan with --fix recompute=full or none")
