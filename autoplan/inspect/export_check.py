"""Check an export with the target framework's own code, when that framework is importable.

`autoplan export --check` and the export tests use it: a Megatron-LM export goes through Megatron's
`parse_args` -> `validate_args` -> `core_transformer_config_from_args` (the same calls `pretrain_gpt.py`
makes before building the model); a torchtitan export is loaded by torchtitan's own config manager. Nothing
here imports a framework at module import time, so the planner stays light; a missing framework is a
`FrameworkUnavailable`, never a pass.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import typing


class FrameworkUnavailable(RuntimeError):
    """The framework (or the part of it the check needs) cannot be imported here."""


def _megatron_training():
    """Megatron-LM's `megatron.training.arguments` (a checkout on PYTHONPATH or $MEGATRON_LM; the
    megatron-core wheel does not ship `megatron.training`)."""
    root = os.environ.get("MEGATRON_LM")
    if root and root not in sys.path:
        sys.path.insert(0, root)
    if not hasattr(typing, "override"):
        # Megatron-LM >= 0.17 imports typing.override (Python 3.12); it is a no-op decorator.
        typing.override = lambda f: f  # type: ignore[attr-defined]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from megatron.training import arguments
            from megatron.training.argument_utils import core_transformer_config_from_args
    except ImportError as e:
        raise FrameworkUnavailable(f"megatron.training is not importable ({e}); put a Megatron-LM checkout on "
                                   "PYTHONPATH or set MEGATRON_LM") from None
    return arguments, core_transformer_config_from_args


def megatron_available() -> bool:
    try:
        _megatron_training()
    except FrameworkUnavailable:
        return False
    return True


@contextlib.contextmanager
def _as_on_gpu(arch_major: int):
    """Answer Megatron's two questions about the machine as the target cluster would: the GPU's compute
    capability (torch.cuda queries, which fail on a CPU build) and whether Transformer Engine's fused RoPE is
    there (it is on every NVIDIA Megatron container). Nothing else is stubbed: every other check is Megatron's."""
    import types

    import torch
    from megatron.core.models.common.embeddings import rope_utils

    saved = (torch.cuda.get_device_capability, torch.cuda.get_device_properties,
             rope_utils.fused_apply_rotary_pos_emb)
    torch.cuda.get_device_capability = lambda *a, **k: (arch_major, 0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=arch_major, minor=0)
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = lambda *a, **k: None
    try:
        yield
    finally:
        (torch.cuda.get_device_capability, torch.cuda.get_device_properties,
         rope_utils.fused_apply_rotary_pos_emb) = saved


def check_megatron(args: list[str], world_size: int, env: dict[str, str] | None = None,
                   arch_major: int = 9) -> str | None:
    """None when Megatron-LM accepts `args` for `world_size` ranks under the launch environment `env`, else
    the first line of its complaint."""
    arguments, to_config = _megatron_training()
    keys = ("WORLD_SIZE", "RANK", "CUDA_DEVICE_MAX_CONNECTIONS")
    old_argv, old_env = sys.argv, {k: os.environ.get(k) for k in keys}
    # A data source and an iteration count are the training script's business, not the plan's.
    sys.argv = ["pretrain_gpt.py", *args, "--tokenizer-type", "NullTokenizer", "--mock-data",
                "--train-iters", "10", "--lr", "1e-4"]
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", **(env or {}))
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), _as_on_gpu(arch_major):
            ns = arguments.parse_args()
            arguments.validate_args(ns)
            to_config(ns)
    except SystemExit:
        lines = [x for x in sink.getvalue().splitlines() if "error" in x.lower()]
        return (lines[-1] if lines else sink.getvalue().strip().splitlines()[-1]).strip()
    except Exception as e:  # noqa: BLE001 - Megatron validates with assert/ValueError/RuntimeError alike
        msg = str(e).strip().splitlines()
        return f"{type(e).__name__}: {msg[0] if msg else ''}"
    finally:
        sys.argv = old_argv
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return None


def check_torchtitan(plan) -> str | None:
    raise FrameworkUnavailable("todo")
