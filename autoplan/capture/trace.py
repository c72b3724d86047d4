"""Tracing: torch.export (non-strict) first, torch.fx.symbolic_trace as the fall-back; the only torch user.

Both paths produce the same flat list of `OpNode`s in execution order: op name, tensor inputs, output shapes
and dtypes (from the exported graph's fake-tensor metadata, or from running the fx graph on meta tensors),
the module path the op ran in (`nn_module_stack`), and parameter placeholders with canonical names (tied
weights map to the first name they are registered under).
"""

from __future__ import annotations

import contextlib
import operator
import re
import types
from typing import Any

import torch
import torch.fx

from .errors import CaptureError
from .graph import OpNode, RawCapture, TensorMeta

# ------------------------------------------------------------------------------------------------ metas


def _meta(v: Any) -> TensorMeta | None:
    if not isinstance(v, torch.Tensor):
        return None
    shape = []
    for d in v.shape:
        try:
            shape.append(int(d))
        except Exception:  # unbacked SymInt (data-dependent size)
            shape.append(-1)
    return TensorMeta(tuple(shape), str(v.dtype).replace("torch.", ""), v.element_size())


def _metas(v: Any) -> tuple[TensorMeta, ...]:
    if isinstance(v, (tuple, list)):
        return tuple(m for m in (_meta(x) for x in v) if m is not None)
    m = _meta(v)
    return (m,) if m is not None else ()


def _short(op: str) -> str:
    """aten.linear.default -> linear; getitem stays getitem."""
    parts = op.split(".")
    if parts[0] == "aten" and len(parts) >= 2:
        return parts[1]
    return parts[-1] if op.startswith("torch.") else op


def _scalar_attrs(n: torch.fx.Node, short: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    if "scaled_dot_product" in short or short == "flex_attention":
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
        vals = dict(zip(names, n.args))
        vals.update(n.kwargs)
        attrs["dropout_p"] = float(vals.get("dropout_p", 0.0) or 0.0)
        attrs["is_causal"] = bool(vals.get("is_causal", False))
        attrs["has_mask"] = isinstance(vals.get("attn_mask"), torch.fx.Node)
        attrs["enable_gqa"] = bool(vals.get("enable_gqa", False))
    elif short in ("dropout", "native_dropout", "feature_dropout"):
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.0)
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
        attrs["p"] = float(p) if isinstance(p, (int, float)) else 0.0
        attrs["train"] = bool(train) if isinstance(train, bool) else True
    elif short == "einsum":
        attrs["equation"] = n.args[0] if n.args and isinstance(n.args[0], str) else ""
    elif short == "getitem":
        attrs["index"] = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], int) else 0
    elif short == "wrap_with_set_grad_enabled":
        attrs["grad_enabled"] = bool(n.args[0]) if n.args else True
    return attrs


def _tensor_inputs(n: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), lambda a: found.append(a) or a)
    return found


def _stack(n: torch.fx.Node, strip: str) -> tuple[str, str]:
    st = n.meta.get("nn_module_stack")
    if not st:
        return "", ""
    path, typ = list(st.values())[-1]
    typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    path = _strip(path, strip)
    return path, typ.rsplit(".", 1)[-1]


def _strip(path: str, prefix: str) -> str:
    if prefix and (path == prefix.rstrip(".") or path.startswith(prefix)):
        return path[len(prefix):] if path.startswith(prefix) else ""
    return path


def _canonical_names(module: torch.nn.Module) -> dict[str, str]:
    """Every parameter/buffer name -> the first name the same tensor is registered under (tied weights)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        out[name] = first.setdefault(id(p), name)
    return out


# ----------------------------------------------------------------------------------------- torch.export


def export_capture(module: torch.nn.Module, args: tuple, kwargs: dict, strip: str = "") -> RawCapture:
    """Trace with `torch.export.export(strict=False)` and turn the ATen graph into OpNodes."""
    ep = torch.export.export(module, args, kwargs, strict=False)
    sig = ep.graph_signature
    canon = _canonical_names(module)
    to_param = dict(sig.inputs_to_parameters)
    to_buffer = dict(sig.inputs_to_buffers)
    to_const = {**getattr(sig, "inputs_to_lifted_tensor_constants", {})}
    user_inputs = set(sig.user_inputs)
    nodes: list[OpNode] = []
    params: dict[str, TensorMeta] = {}
    outputs: list[str] = []
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            metas = _metas(n.meta.get("val"))
            if n.name in to_param or n.name in to_buffer:
                is_param = n.name in to_param
                fqn = to_param.get(n.name) or to_buffer[n.name]
                cname = _strip(canon.get(fqn, fqn), strip)
                kind = "param" if is_param else "buffer"
                if is_param and metas:
                    params[cname] = metas[0]
                nodes.append(OpNode(n.name, f"placeholder:{kind}", kind, kind, (), (), metas, param=cname))
            elif n.name in to_const:
                nodes.append(OpNode(n.name, "placeholder:constant", "constant", "constant", (), (), metas))
            else:
                kind = "input" if n.name in user_inputs else "constant"
                nodes.append(OpNode(n.name, f"placeholder:{kind}", kind, kind, (), (), metas))
            continue
        if n.op == "output":
            torch.fx.node.map_arg(n.args, lambda a: outputs.append(a.name) or a)
            continue
        if n.op != "call_function":
            continue  # get_attr of higher-order-op submodules: their effect is in the HOP's outputs
        tgt = n.target
        if tgt is operator.getitem:
            op = "getitem"
        elif isinstance(tgt, torch._ops.OpOverload):
            op = str(tgt)
        else:
            op = getattr(tgt, "__name__", None)
            if not isinstance(op, str):
                op = str(tgt)
        short = _short(op)
        ins = [a for a in _tensor_inputs(n) if _metas(a.meta.get("val"))]
        metas = _metas(n.meta.get("val"))
        if short == "getitem":
            val = n.meta.get("val")
            metas = _metas(val)
        path, typ = _stack(n, strip)
        nodes.append(OpNode(
            name=n.name, op=op, opname=short, kind="", inputs=tuple(a.name for a in ins),
            in_meta=tuple(_metas(a.meta.get("val"))[0] if _metas(a.meta.get("val")) else None for a in ins),
            outputs=metas, module=path, module_type=typ, attrs=_scalar_attrs(n, short),
        ))
    return RawCapture(nodes, params, outputs, "torch.export")


# ------------------------------------------------------------------------------------ torch.fx fallback

# torch-level callables and methods of a symbolic trace -> the ATen op names the analysis knows
_FX_FUNCS = {
    "linear": "linear", "scaled_dot_product_attention": "scaled_dot_product_attention", "layer_norm": "layer_norm",
    "rms_norm": "rms_norm", "embedding": "embedding", "dropout": "dropout", "gelu": "gelu", "silu": "silu",
    "relu": "relu", "softmax": "softmax", "log_softmax": "log_softmax", "cross_entropy": "cross_entropy_loss",
    "matmul": "matmul", "bmm": "bmm", "mm": "mm", "einsum": "einsum", "add": "add", "iadd": "add", "sub": "sub",
    "mul": "mul", "imul": "mul", "truediv": "div", "div": "div", "neg": "neg", "getitem": "getitem",
    "cat": "cat", "stack": "stack", "arange": "arange", "tanh": "tanh", "sigmoid": "sigmoid", "rsqrt": "rsqrt",
    "pow": "pow", "mean": "mean", "sum": "sum", "exp": "exp",
}
_FX_MODULES = {
    "Linear": "linear", "Embedding": "embedding", "LayerNorm": "layer_norm", "RMSNorm": "rms_norm",
    "Dropout": "dropout", "GELU": "gelu", "SiLU": "silu", "ReLU": "relu", "Tanh": "tanh", "Softmax": "softmax",
}


def fx_capture(module: torch.nn.Module, args: tuple, kwargs: dict, strip: str = "") -> RawCapture:
    """Fall-back: `torch.fx.symbolic_trace`, shapes by running the traced graph on the (meta) inputs.

    Leaf modules (nn.Linear, nn.Embedding, norms, dropout, activations) become one op each; torch functions
    and tensor methods are mapped to the ATen names the analysis knows, by name.
    """
    if kwargs:
        raise CaptureError("the torch.fx fall-back takes positional example inputs only",
                           f"got keyword inputs {sorted(kwargs)}", "pass the inputs as a tuple")
    gm = torch.fx.symbolic_trace(module)
    from torch.fx.passes.shape_prop import ShapeProp

    vals: dict[str, Any] = {}

    class _Record(ShapeProp):
        def run_node(self, n):  # noqa: D401 - ShapeProp hook
            r = super().run_node(n)
            vals[n.name] = r
            return r

    _Record(gm).propagate(*args)
    canon = _canonical_names(module)
    mods = dict(gm.named_modules())
    nodes: list[OpNode] = []
    params: dict[str, TensorMeta] = {}
    outputs: list[str] = []
    param_nodes: dict[str, str] = {}

    def param_node(fqn: str) -> str:
        cname = _strip(canon.get(fqn, fqn), strip)
        if cname not in param_nodes:
            t = gm.get_parameter(fqn) if fqn in dict(gm.named_parameters()) else gm.get_buffer(fqn)
            meta = _meta(t)
            kind = "param" if isinstance(t, torch.nn.Parameter) else "buffer"
            if kind == "param" and meta:
                params[cname] = meta
            pname = "p_" + re.sub(r"\W", "_", cname)
            nodes.append(OpNode(pname, f"placeholder:{kind}", kind, kind, (), (), (meta,) if meta else (),
                                param=cname))
            param_nodes[cname] = pname
        return param_nodes[cname]

    for n in gm.graph.nodes:
        metas = _metas(vals.get(n.name))
        if n.op == "placeholder":
            nodes.append(OpNode(n.name, "placeholder:input", "input", "input", (), (), metas))
            continue
        if n.op == "output":
            torch.fx.node.map_arg(n.args, lambda a: outputs.append(a.name) or a)
            continue
        if n.op == "get_attr":
            pn = param_node(n.target)
            nodes.append(OpNode(n.name, "alias", "alias", "", (pn,), (), metas))
            continue
        ins = [a.name for a in _tensor_inputs(n) if _metas(vals.get(a.name))]
        path, typ = "", ""
        if n.op == "call_module":
            sub = mods[n.target]
            typ = type(sub).__name__
            path = _strip(n.target, strip)
            short = _FX_MODULES.get(typ)
            if short is None:
                raise CaptureError(f"torch.fx fall-back: unsupported leaf module {typ}", f"at {n.target}",
                                   "make the model exportable with torch.export")
            pins = [param_node(f"{n.target}.{pn}" if n.target else pn) for pn, _ in sub.named_parameters()]
            ins = pins + ins if short == "embedding" else ins + pins  # ATen argument order
            attrs: dict[str, Any] = {}
            if short == "dropout":
                attrs = {"p": float(sub.p), "train": sub.training}
            op = f"aten.{short}.default"
        else:
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            short = _FX_FUNCS.get(name, name)
            op = f"aten.{short}.default"
            attrs = {}
            if short == "scaled_dot_product_attention":
                attrs = {"dropout_p": float(n.kwargs.get("dropout_p", 0.0)), "is_causal":
                         bool(n.kwargs.get("is_causal", False)), "has_mask": n.kwargs.get("attn_mask") is not None,
                         "enable_gqa": bool(n.kwargs.get("enable_gqa", False))}
            elif short == "getitem":
                idx = n.args[1] if len(n.args) > 1 else 0
                attrs = {"index": idx if isinstance(idx, int) else 0}
            st = n.meta.get("nn_module_stack")
            if st:
                path = _strip(list(st.values())[-1][0], strip)
        if not metas and short != "getitem":
            continue  # python scalars (sizes) flowing through the trace
        nodes.append(OpNode(n.name, op, short, "", tuple(ins), tuple(None for _ in ins), metas, module=path,
                            module_type=typ, attrs=attrs))
    by_name = {o.name: o for o in nodes}
    for o in nodes:  # input metas now that every producer is known
        o.in_meta = tuple(by_name[i].outputs[0] if i in by_name and by_name[i].outputs else None for i in o.inputs)
    return RawCapture(nodes, params, outputs, "torch.fx")


# ------------------------------------------------------------------------------------------ entry point


def _explain(e: BaseException) -> tuple[str, str]:
    """(rule, detail) for an exception raised while tracing: which construct or op stopped it."""
    msg = str(e)
    first = next((ln.strip() for ln in msg.splitlines() if ln.strip()), type(e).__name__)
    where = ""
    m = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\s*\n\s*(.+)', msg)
    user = [x for x in m if "site-packages/torch" not in x[0]]
    if user:
        f, line, fn, code = user[-1]
        where = f" at {f.rsplit('/', 1)[-1]}:{line} in {fn}: {code.strip()}"
    if "data-dependent" in msg or "GuardOnDataDependentSymNode" in type(e).__name__:
        return "data-dependent control flow or value (the output of an op decides Python control flow)", \
            first + where
    op = re.search(r"aten::(\w+)", msg)
    if op and ("Meta" in msg or "NotImplemented" in type(e).__name__):
        return f"op aten.{op.group(1)} has no meta/fake implementation", first + where
    if "symbolically traced variables cannot be used as inputs to control flow" in msg:
        return "data-dependent control flow (a traced tensor decides an if/while)", first + where
    return f"{type(e).__name__} while tracing", first + where


def trace(module: torch.nn.Module, args: tuple, kwargs: dict, *, method: str = "auto",
          strip: str = "") -> RawCapture:
    """Trace `module(*args, **kwargs)`: torch.export first, then torch.fx.symbolic_trace ("auto")."""
    errors: list[tuple[str, BaseException]] = []
    if method in ("auto", "export"):
        try:
            with _quiet():
                return export_capture(module, args, kwargs, strip)
        except CaptureError:
            raise
        except Exception as e:
            errors.append(("torch.export", e))
    if method in ("auto", "fx"):
        try:
            with _quiet():
                raw = fx_capture(module, args, kwargs, strip)
            if errors:
                raw.notes.append("torch.export failed (" + _explain(errors[0][1])[1][:200] + "); used torch.fx")
            return raw
        except CaptureError:
            if not errors:
                raise
        except Exception as e:
            errors.append(("torch.fx", e))
    name, err = errors[0]
    rule, detail = _explain(err)
    others = "; ".join(f"{n}: {_explain(x)[1][:160]}" for n, x in errors[1:])
    raise CaptureError(
        f"{name} could not trace {type(module).__name__}: {rule}",
        detail + (f" (also {others})" if others else ""),
        "make the forward traceable on the meta device (no .item()/.tolist(), no Python branches on tensor "
        "values), or plan from a model spec file instead",
    ) from None


@contextlib.contextmanager
def _quiet():
    """Silence torch.export while tracing: its warning logs, and the partial graph it prints to stderr when
    it fails (the CaptureError says what went wrong in one line)."""
    import io
    import logging

    loggers = [logging.getLogger(n) for n in ("torch._export", "torch.export", "torch._dynamo",
                                              "torch.fx.experimental.symbolic_shapes")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, old):
            lg.setLevel(lv)


# -------------------------------------------------------------------------------------- model helpers


def balanced_moe_dispatch(model: torch.nn.Module) -> int:
    """Make zoo-style MoE layers traceable: route an equal share of tokens to every expert.

    The zoo's `MoE.dispatch(routed, counts)` splits the routed tokens by `counts.tolist()`, a data-dependent
    size that no tracer on the meta device can follow. For capture we replace `dispatch` (the hook expert
    parallelism replaces too) on each instance by one that gives every expert T*k/E rows, the balanced load
    the cost model assumes. Returns the number of layers patched.
    """
    patched = 0
    for mod in model.modules():
        if not (hasattr(mod, "dispatch") and hasattr(mod, "experts") and hasattr(mod, "num_experts")):
            continue
        experts = mod.experts

        def dispatch(self, routed, counts, _experts=experts):
            t, e = routed.shape[0], self.num_experts
            sizes = [t // e + (1 if i < t % e else 0) for i in range(e)]
            outs, start = [], 0
            for i, n in enumerate(sizes):
                chunk = routed[start:start + n]
                outs.append(_experts[str(i)](chunk) if n else chunk * 0)
                start += n
            return torch.cat(outs)

        mod.dispatch = types.MethodType(dispatch, mod)
        patched += 1
    return patched
