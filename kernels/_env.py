"""Environment questions the registry asks without importing triton or torch."""

from __future__ import annotations

import functools
import importlib.util
import os

_TRUE = ("1", "true", "yes", "on", "y")  # the spellings triton.knobs accepts for a true env_bool


def interpret_enabled() -> bool:
    """True when TRITON_INTERPRET asks for the Triton CPU interpreter (read at each call)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


@functools.cache
def triton_installed() -> bool:
    """True when the triton package can be imported; does not import it."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a finder refused it, or sys.modules["triton"] is None
        return False
