"""Input checks shared by the launchers: each failure names the rule, the values and a fix."""

from __future__ import annotations

import torch

from autoplan.kernels._triton import KernelUnavailableError, interpret_enabled

# The dtypes every kernel here accepts for activations; math inside runs in fp32.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(op: str, name: str, t, *, dtypes=FLOAT_DTYPES, min_dim: int = 1) -> None:
    """`t` is a tensor of one of `dtypes` with at least `min_dim` dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{op}: {name} has dtype {str(t.dtype).replace('torch.', '')}; supported: {allowed}. "
            f"Cast it first, e.g. {name}.to(torch.bfloat16)."
        )
    if t.dim() < min_dim:
        raise ValueError(f"{op}: {name} needs at least {min_dim} dimension(s), got shape {tuple(t.shape)}.")


def check_same_device(op: str, **tensors) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"{op}: all tensors must be on one device, got {where}. Move them with .to(device).")


def check_vector(op: str, name: str, t, size: int) -> None:
    """`t` is None or a 1-D tensor of length `size` whose elements are adjacent."""
    if t is None:
        return
    check_tensor(op, name, t)
    if t.dim() != 1 or t.shape[0] != size:
        raise ValueError(
            f"{op}: {name} must have shape ({size},) to match the last dimension of the input, "
            f"got {tuple(t.shape)}."
        )
    if t.stride(0) != 1:
        raise ValueError(f"{op}: {name} must be contiguous (stride 1), got stride {t.stride(0)}; "
                         f"pass {name}.contiguous().")


def as_rows(op: str, name: str, x: torch.Tensor) -> torch.Tensor:
    """View `x` as [rows, last_dim] without copying; the last dimension must be contiguous."""
    if x.shape[-1] == 0 or x.numel() == 0:
        raise ValueError(f"{op}: {name} is empty (shape {tuple(x.shape)}); nothing to compute.")
    if x.stride(-1) != 1:
        raise ValueError(
            f"{op}: the last dimension of {name} must be contiguous (stride 1), got strides "
            f"{tuple(x.stride())}; pass {name}.contiguous()."
        )
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError as exc:
        raise ValueError(
            f"{op}: {name} with shape {tuple(x.shape)} and strides {tuple(x.stride())} cannot be viewed as "
            f"rows of its last dimension without a copy; pass {name}.contiguous()."
        ) from exc


def check_triton_device(op: str, x: torch.Tensor) -> None:
    """The Triton path runs on CUDA, or on the CPU under the interpreter (TRITON_INTERPRET=1)."""
    if x.device.type == "cuda" or x.device.type == "meta" or interpret_enabled():
        return
    raise KernelUnavailableError(
        f"{op}: the Triton kernel runs on CUDA tensors, or on the CPU with TRITON_INTERPRET=1 "
        f"(the Triton interpreter); got a tensor on {x.device}. Set TRITON_INTERPRET=1, move the "
        f"tensors to CUDA, or use the torch reference: kernels.get({op!r}, impl='torch')."
    )


def check_max_row(op: str, n: int, element_size: int) -> None:
    """A row must fit one program's registers: 64 KiB of input per row, as in the Triton tutorials."""
    limit = 65536 // element_size
    if n > limit:
        raise ValueError(
            f"{op}: the last dimension is {n}, above the {limit} elements (64 KiB) one program holds "
            f"for this dtype; use the torch reference (kernels.get({op!r}, impl='torch')) for such rows."
        )
