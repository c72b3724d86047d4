"""Datasets: every layout sees exactly the same global batch at every step.

A dataset yields, for step t, the whole global batch of token ids, shape (global_batch, seq + 1) int64
(inputs are [:, :-1], labels [:, 1:]). Each rank then takes its own slice (`local_batch`): rows by data-parallel
rank, columns by context-parallel rank (load-balanced chunks). Reading the whole global batch on every rank
is what makes the data independent of the layout; it costs gbs*(s+1) ids per step, nothing next to a step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from autoplan.cost_models.errors import SpecError


class SyntheticDataset:
    """Token sequences drawn from a generator seeded by (seed, step): reproducible and layout-independent.

    Each sequence is an arithmetic progression modulo the vocabulary (random start and stride) with 10% of
    the tokens replaced by random ones, so there is something to learn: a short run shows the loss fall
    below the ln(vocab) of random tokens.
    """

    noise = 0.1

    def __init__(self, vocab_size: int, seq_length: int, global_batch: int, seed: int = 0) -> None:
        self.vocab, self.seq, self.gbs, self.seed = vocab_size, seq_length, global_batch, seed

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab, (self.gbs, 1), generator=g)
        stride = torch.randint(1, 8, (self.gbs, 1), generator=g)
        tokens = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        noise = torch.rand(self.gbs, self.seq + 1, generator=g) < self.noise
        return torch.where(noise, torch.randint(0, self.vocab, tokens.shape, generator=g), tokens)


class MemmapTokenDataset:
    """A flat binary file of token ids (uint16 or int32, native byte order), memory-mapped.

    Sequence i of the run starts at token (i * seq) mod (n - seq - 1); step t uses sequences
    t*gbs .. (t+1)*gbs - 1. The dtype is taken from the suffix (.u16/.uint16/.bin -> uint16, .i32/.int32 ->
    int32) or given explicitly.
    """

    def __init__(self, path: str | Path, seq_length: int, global_batch: int, vocab_size: int,
                 dtype: str | None = None) -> None:
        path = Path(path)
        if dtype is None:
            dtype = "int32" if path.suffix in (".i32", ".int32") else "uint16"
        if dtype not in ("uint16", "int32"):
            raise SpecError("token file dtype must be uint16 or int32", f"got {dtype}", "pass --data-dtype")
        try:
            self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        except (OSError, ValueError) as e:
            raise SpecError(f"cannot map token file {path}", str(e), "check the path and dtype") from None
        self.seq, self.gbs, self.vocab = seq_length, global_batch, vocab_size
        if len(self.tokens) < seq_length + 2:
            raise SpecError(f"token file {path} is too short", f"{len(self.tokens)} tokens < seq+2",
                            "use a longer file or a shorter --seq-len")
        hi = int(self.tokens.max()) if len(self.tokens) < 50_000_000 else None
        if hi is not None and hi >= vocab_size:
            raise SpecError(f"token file {path} has ids up to {hi}", f"but the model's vocabulary is {vocab_size}",
                            "tokenise with the model's vocabulary")

    def batch(self, step: int) -> torch.Tensor:
        span = len(self.tokens) - self.seq - 1
        rows = []
        for j in range(self.gbs):
            start = ((step * self.gbs + j) * self.seq) % span
            rows.append(np.asarray(self.tokens[start : start + self.seq + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


def write_token_file(path: str | Path, tokens, dtype: str = "uint16") -> Path:
    """Write token ids as a flat binary file (for tests and the demo)."""
    path = Path(path)
    np.asarray(tokens, dtype=np.dtype(dtype)).tofile(path)
    return path


def local_batch(batch: torch.Tensor, *, dp: int, dp_rank: int, cp_positions: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, labels): rows of its dp rank, columns of its cp chunks. (gbs, s+1) -> 2 x (gbs/dp, s_l)."""
    rows = batch.shape[0] // dp
    b = batch[dp_rank * rows : (dp_rank + 1) * rows]
    inputs, labels = b[:, :-1], b[:, 1:]
    if cp_positions is not None:
        idx = cp_positions.to(inputs.device)
        inputs, labels = inputs[:, idx], labels[:, idx]
    return inputs.contiguous(), labels.contiguous()
