"""Capture entry points: an nn.Module, a ModelSpec (through the zoo), a Hugging Face config, a factory ref."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from autoplan.cost_models.specs import ModelSpec

from .errors import CaptureError
from .graph import ModelGraph

# The export traces at most this many tokens per sequence unless told otherwise. Every per-token quantity of a
# LayerProfile is independent of the sequence length except the attention core, which LayerProfile scales
# analytically (4*s*a*d per token), so a short trace loses nothing and keeps capture fast.
CAPTURE_SEQ = 16


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        if len(example_inputs) == 2 and isinstance(example_inputs[1], dict) and isinstance(example_inputs[0],
                                                                                            (tuple, list)):
            return tuple(example_inputs[0]), dict(example_inputs[1])
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _tokens_shape(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(batch, seq) from the first tensor input: (b, s) token ids, or (b, s, h) hidden states."""
    import torch

    for v in [*args, *kwargs.values()]:
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            if v.dim() == 1:
                return 1, int(v.shape[0])
            if v.is_floating_point() and v.dim() >= 3:
                return int(v.shape[0]), int(v.shape[1])
            return int(v.shape[0]), int(v.shape[1]) if v.dim() >= 2 else 1
    raise CaptureError("the example inputs hold no tensor", f"got {type(args).__name__} {args!r:.80}",
                       "pass token ids of shape (batch, seq)")


def capture(module: Any, example_inputs: Any, *, name: str | None = None, seq: int | None = None,
            method: str = "auto", strip_prefix: str = "") -> ModelGraph:
    """Capture `module(*example_inputs)` into a ModelGraph.

    `example_inputs` is a tensor, a tuple of positional inputs, a dict of keyword inputs, or (args, kwargs).
    Put the module and inputs on the meta device to allocate nothing. The module is traced in training mode
    (dropout active) and restored afterwards. `seq` is the sequence length per-token FLOPs are reported at
    (default: the traced one); `method` is "auto" (torch.export, then torch.fx), "export" or "fx".
    """
    from . import trace as tr
    from .analyze import analyze

    args, kwargs = _split_inputs(example_inputs)
    batch, s = _tokens_shape(args, kwargs)
    was_training = module.training
    module.train()
    try:
        raw = tr.trace(module, args, kwargs, method=method, strip=strip_prefix)
    finally:
        module.train(was_training)
    return analyze(raw, name=name or type(module).__name__, batch=batch, seq_captured=s, seq=seq or s)


def _with_loss(model: Any) -> Any:
    """Wrap a zoo LM so the captured graph ends in its training loss (the head then includes it)."""
    import torch

    from autoplan.zoo import cross_entropy_loss

    class WithLoss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, tokens, labels):
            return cross_entropy_loss(self.model(tokens), labels)

    return WithLoss(model)


def capture_spec(spec: ModelSpec | str, batch: int = 1, seq: int | None = None, *,
                 capture_seq: int | None = None) -> ModelGraph:
    """Build the zoo model for `spec` on the meta device (bf16) and capture it with its loss.

    The full-depth model is exported; the trace uses `batch` sequences of `capture_seq` tokens (default
    min(seq, 16)), and per-token FLOPs are reported at `seq` (default: the spec's max_seq_length). MoE layers
    are traced with balanced routing (see `trace.balanced_moe_dispatch`).
    """
    import torch

    from autoplan.specs import load_model

    spec = load_model(spec) if isinstance(spec, str) else spec
    try:
        from autoplan.zoo import build_model
    except ImportError as e:  # pragma: no cover - the zoo ships with the package
        raise CaptureError("the model zoo is not importable", str(e), "reinstall autoplan") from None
    from .trace import balanced_moe_dispatch

    seq = seq or spec.max_seq_length
    cs = capture_seq or min(seq, CAPTURE_SEQ)
    model = build_model(spec, device="meta", dtype=torch.bfloat16)
    balanced_moe_dispatch(model)
    tokens = torch.zeros(batch, cs, dtype=torch.long, device="meta")
    return capture(_with_loss(model), (tokens, tokens), name=spec.name, seq=seq, strip_prefix="model.")


# ------------------------------------------------------------------------------------------- loaders


def load_module_factory(ref: str) -> tuple[Any, Any]:
    """Call the user factory `package.module:factory` (or `path/to/file.py:factory`) -> (module, inputs)."""
    if ":" not in ref:
        raise CaptureError("a module factory reference is `package.module:factory`", f"got {ref!r}",
                           "write e.g. mypkg.models:build")
    mod_name, _, attr = ref.rpartition(":")
    try:
        if mod_name.endswith(".py") or "/" in mod_name:
            path = Path(mod_name)
            if not path.exists():
                raise CaptureError(f"no such file {path}", f"in factory reference {ref!r}", "check the path")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules.setdefault(path.stem, module)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except CaptureError:
        raise
    except Exception as e:
        raise CaptureError(f"cannot import {mod_name}", f"{type(e).__name__}: {e}",
                           "check the module path and that it is importable (PYTHONPATH)") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CaptureError(f"{mod_name} has no callable {attr!r}", f"in factory reference {ref!r}",
                           "name a function returning (module, example_inputs)")
    try:
        result = factory()
    except Exception as e:
        raise CaptureError(f"factory {ref} raised", f"{type(e).__name__}: {e}", "fix the factory") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise CaptureError(f"factory {ref} must return (module, example_inputs)",
                           f"got {type(result).__name__}", "return a 2-tuple")
    import torch

    if not isinstance(result[0], torch.nn.Module):
        raise CaptureError(f"factory {ref} must return an nn.Module first", f"got {type(result[0]).__name__}",
                           "return (module, example_inputs)")
    return result[0], result[1]


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise CaptureError("Hugging Face configs need the `transformers` package", "it is not installed",
                           "pip install 'autoplan[hf]'") from None
    return transformers


def capture_hf_model(model: Any, batch: int = 1, seq: int | None = None, *, name: str | None = None,
                     capture_seq: int | None = None) -> ModelGraph:
    """Capture a Hugging Face causal LM (ideally on meta) with labels, so the loss is in the head."""
    import torch

    cfg = model.config
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
    seq = seq or max_pos
    cs = capture_seq or min(seq, CAPTURE_SEQ)
    dev = next((p.device for p in model.parameters()), torch.device("meta"))
    ids = torch.zeros(batch, cs, dtype=torch.long, device=dev)
    return capture(model, {"input_ids": ids, "labels": ids, "use_cache": False},
                   name=name or getattr(cfg, "_name_or_path", None) or type(model).__name__, seq=seq)


def hf_model_from_config(config: Any) -> Any:
    """Build the Hugging Face causal LM for a config (object or dict) on the meta device, in bf16."""
    transformers = _require_transformers()
    import torch

    if isinstance(config, dict):
        data = dict(config)
        mtype = data.pop("model_type", None)
        if not mtype:
            raise CaptureError("Hugging Face config has no model_type", f"keys: {sorted(data)[:10]}",
                               "add \"model_type\" (e.g. \"llama\")")
        try:
            config = transformers.AutoConfig.for_model(mtype, **data)
        except Exception as e:
            first = (str(e).splitlines() or [""])[0].split(". Should contain")[0]  # not the list of every type
            raise CaptureError(f"transformers does not know model_type {mtype!r}", first[:200],
                               "upgrade transformers or pass a model spec") from None
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except Exception as e:
        raise CaptureError(f"cannot build a causal LM for {type(config).__name__}",
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           "use a decoder-only config (AutoModelForCausalLM) or a model spec") from None


def capture_hf_config(path: str | Path, batch: int = 1, seq: int | None = None) -> ModelGraph:
    """Build the Hugging Face model of a local config.json (or a directory holding one) on meta; capture it."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise CaptureError(f"cannot read {p}", e.strerror or str(e), "check the path") from None
    except json.JSONDecodeError as e:
        raise CaptureError(f"{p} is not valid JSON", str(e), "fix the file") from None
    return capture_arch_model(p, data, batch, seq, name=p.parent.name or p.stem)


def capture_arch_model(p: Path, data: dict, batch: int = 1, seq: int | None = None, *, name: str) -> ModelGraph:
    """Capture the module `autoplan run` trains for a Hugging Face config: `autoplan.models.build` (the one entry
    point the runtime, codegen and tests use), on meta in bf16, with its loss. Configs autoplan cannot represent
    are captured as transformers builds them (`hf_model_from_config`), so `search` still plans them (the run
    refuses them with the field and value)."""
    import torch

    from autoplan.models import build, resolve_arch

    try:
        arch = resolve_arch(p)
    except Exception:  # a field autoplan does not honour: plan transformers' own module, refuse at run time
        arch = None
    if arch is None:
        return capture_hf_model(hf_model_from_config(data), batch, seq, name=name)
    from .trace import balanced_moe_dispatch

    model = build(p, device="meta").to(torch.bfloat16)
    balanced_moe_dispatch(model)
    max_pos = data.get("max_position_embeddings") or data.get("n_positions") or 2048
    seq = seq or max_pos
    cs = min(seq, CAPTURE_SEQ)
    tokens = torch.zeros(batch, cs, dtype=torch.long, device="meta")
    return capture(_with_loss(model), (tokens, tokens), name=name, seq=seq, strip_prefix="model.")


def _is_hf_config(p: Path) -> bool:
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file() or p.suffix != ".json":
        return False
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and ("model_type" in data or "architectures" in data)


def capture_model_ref(ref: str, batch: int = 1, seq: int | None = None) -> ModelGraph | None:
    """A graph for `module:factory` refs and Hugging Face config paths; None for presets and spec files."""
    p = Path(ref)
    if _is_hf_config(p):
        return capture_hf_config(p, batch, seq)
    if ":" in ref and not p.exists():
        module, inputs = load_module_factory(ref)
        return capture(module, inputs, name=ref.rpartition(":")[2], seq=seq)
    return None
