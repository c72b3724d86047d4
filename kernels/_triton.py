"""Access to Triton for the kernel files: a lazy `jit`, interpreter selection, and launch capture.

Why this exists instead of plain `@triton.jit`:

* `triton.jit` decides between the compiler and the CPU interpreter when the decorator runs, i.e.
  when a kernel file is imported. The registry's rule is decided per call ("Triton on CPU tensors
  when TRITON_INTERPRET=1"), and a kernel file may have been imported before a test sets the
  variable. `jit` below keeps the Python function and builds the interpreted or the compiled
  kernel at launch time, from the environment as it is then.
* Importing a kernel file does not import Triton (the `tl` the kernels use is bound on their
  first launch), so the torch references next to the kernels cost nothing extra and work without
  Triton installed (it is the optional `kernels` extra); launching a kernel then raises
  `KernelUnavailableError` with the way out.
* `capture_launches()` records launches instead of running them. The tests use it to compile
  every launch the real launchers make, with their real block sizes, for an H100 (sm_90) on a
  machine without a GPU.

Kernels written with this `jit` must not call other kernels of this package (the compiler only
inlines real `JITFunction`s), so shared math is written out in each kernel; Triton's own library
(tl.sum, tl.sigmoid, ...) is fine, see `_jit_calls_interpreted`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from autoplan.kernels._env import interpret_enabled, triton_installed  # noqa: F401  (re-exported)


class _LanguagePlaceholder:
    """What `tl` is in a kernel file until its first launch binds the real `triton.language`.

    Kernel files use `from __future__ import annotations`, so `x: tl.constexpr` is not evaluated
    at import, and importing a kernel file never imports triton.
    """

    def __getattr__(self, name: str):
        raise RuntimeError(f"triton.language.{name} used outside a launched kernel")


tl = _LanguagePlaceholder()


class KernelUnavailableError(RuntimeError):
    """A Triton kernel was asked to run where it cannot (no Triton, or CPU without the interpreter)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def num_warps_for(block_elems: int) -> int:
    """Warps for a program that holds `block_elems` fp32 values live.

    16 values per thread (512 per 32-lane warp) keeps a row in registers without spilling on
    sm_80/sm_90 (255 registers per thread); clamped to [1, 16] warps, 16 being the most a CTA
    of 512 threads gets while leaving room for 4 CTAs per SM.
    """
    return max(1, min(16, block_elems // 512))


def num_warps_for_backward(block_elems: int) -> int:
    """Warps for a norm backward program over `block_elems` values per row block.

    The backward keeps about four row-sized fp32 arrays live at once (x_hat, w*dy, dy and the
    weight-gradient accumulator), so it gets twice the warps of the forward: 8 values per thread
    per array (256 per warp), up to 32 warps (1024 threads, the CTA maximum). Compiled for sm_90,
    this is the smallest count without register spills at rows of 8192 and 16384 (16 warps
    spilled 16-600 bytes per thread); tests/kernels/test_kernels_compile_sm90.py checks it.
    """
    return max(4, min(32, block_elems // 256))


def persistent_programs(device, work_items: int) -> int:
    """How many programs a grid-stride (persistent) kernel launches over `work_items` items.

    On CUDA: 4 per SM, enough resident CTAs to hide HBM latency while the per-program partial
    buffers stay small (4 x 132 SMs x hidden x 4 B = 35 MB at hidden 16384 on an H100). In the
    interpreter each program costs ~2 ms of Python, so 8 programs keep tests fast while still
    exercising the cross-program reduction.
    """
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(work_items, 4 * sms))
    return max(1, min(work_items, 8))


@dataclass
class Launch:
    """One recorded kernel launch (see `capture_launches`)."""

    kernel: Kernel
    grid: tuple
    args: tuple
    kwargs: dict = field(default_factory=dict)


_CAPTURE: list[Launch] | None = None


@contextlib.contextmanager
def capture_launches():
    """Record kernel launches instead of running them; yields the list they are appended to.

    Used with meta tensors to see the exact grids, block sizes and argument types a launcher
    would use at realistic shapes, without memory or a GPU.
    """
    global _CAPTURE
    previous, _CAPTURE = _CAPTURE, []
    try:
        yield _CAPTURE
    finally:
        _CAPTURE = previous


class Kernel:
    """A Triton kernel whose compiled/interpreted form is chosen at launch time."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._compiled = None
        self._interpreted = None

    def __repr__(self) -> str:
        return f"<kernels Triton kernel {self.fn.__module__}.{self.fn.__name__}>"

    def compiled(self):
        """The `triton.JITFunction` (compiler path)."""
        self._require_triton()
        if self._compiled is None:
            from triton.runtime.jit import JITFunction

            self._compiled = JITFunction(self.fn)
        return self._compiled

    def interpreted(self):
        """The interpreter's function (CPU path, TRITON_INTERPRET=1)."""
        self._require_triton()
        if self._interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted

    def _require_triton(self) -> None:
        if triton_installed():
            import triton.language

            self.fn.__globals__["tl"] = triton.language  # replaces the placeholder, see above
            return
        raise KernelUnavailableError(
            f"Triton kernel {self.fn.__name__!r} needs the triton package, which is not installed; "
            "install it with `pip install 'autoplan[kernels]'` or use the torch reference "
            "(kernels.get(name, impl='torch'))."
        )

    def __getitem__(self, grid):
        def launch(*args: Any, **kwargs: Any):
            # Fused multiply-add contraction, Triton's default through 3.9, stated explicitly: 3.9
            # warns when it is left unset and 3.10 turns the default off.
            kwargs.setdefault("enable_fp_fusion", True)
            if _CAPTURE is not None:
                _CAPTURE.append(Launch(self, tuple(grid), args, kwargs))
                return None
            if interpret_enabled():
                interpreted = self.interpreted()
                with _jit_calls_interpreted():
                    return interpreted[grid](*args, **kwargs)
            return self.compiled()[grid](*args, **kwargs)

        return launch


_INTERPRETED_LIBRARY: dict = {}


@contextlib.contextmanager
def _jit_calls_interpreted():
    """Let an interpreted kernel call Triton's own @jit library functions (tl.sum, tl.sigmoid, ...).

    Triton builds its library functions for the interpreter only when TRITON_INTERPRET is set at
    the time triton is imported; otherwise they are compiler `JITFunction`s, which refuse to be
    called from Python. For the duration of an interpreted launch, such calls run the function
    through the interpreter instead. Outside interpreted launches nothing changes.
    """
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__

    def call_interpreted(self, *args, **kwargs):
        fn = _INTERPRETED_LIBRARY.get(self.fn)
        if fn is None:
            fn = _INTERPRETED_LIBRARY[self.fn] = interpreter.InterpretedFunction(self.fn)
        # InterpretedFunction.__call__ patches triton.language for the interpreter and never
        # undoes it, which breaks later compilation in the same process; undo it here.
        scope = interpreter._patch_lang(fn.fn)
        try:
            return fn.rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    JITFunction.__call__ = call_interpreted
    try:
        yield
    finally:
        JITFunction.__call__ = original


def jit(fn) -> Kernel:
    """Decorator for the kernels in this package (see the module docstring)."""
    return Kernel(fn)
