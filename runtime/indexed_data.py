"""Training data from files: flat token files, Megatron-LM indexed datasets (.bin/.idx) and weighted blends of them.

Why a module of its own: the data's format and dtype must be *read*, never guessed (a Megatron int32 .bin read as
uint16 trains on garbage without a word), every bad file must stop with one line before any process trains, and
the sampling must be a pure function of (seed, global sample index) so a resumed run sees exactly the batches of
an uninterrupted one: the checkpoint's `data.next_step` is the whole position.

Megatron's index file (megatron/core/datasets/indexed_dataset.py, read from its documentation, not copied):
    b"MMIDIDX\\x00\\x00"   9-byte magic
    <Q version (1) · <B dtype code · <Q sequence count · <Q document count
    int32[sequence count]   tokens per sequence
    int64[sequence count]   byte offset of each sequence in the .bin
    int64[document count]   document boundaries as sequence indices (0 first, sequence count last)
dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.

Sampling (one dataset): each epoch shuffles the documents (seeded by seed and epoch), concatenates them and cuts
samples of seq+1 tokens at a stride of seq (the last token of a sample is the first of the next, as in
Megatron's GPT dataset), then visits the samples in a shuffled order. Global sample g is sample g mod n of epoch
g div n, so epochs continue without a seam. Step t's global batch is samples t*gbs .. (t+1)*gbs-1; every layout
sees the same batch and data-parallel rank r takes its rows (`runtime.data.local_batch`).
A blend ("0.7 a 0.3 b") assigns each global sample to a dataset by Megatron's greedy rule (the dataset furthest
below its share), computed once over a period of 10,000 samples and repeated, so the choice is O(1).
A flat token file is one document; its dtype comes from --data-dtype or the suffix (.u16/.uint16, .i32/.int32).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import torch

from autoplan.cost_models.errors import SpecError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
FLAT_SUFFIX = {".u16": "uint16", ".uint16": "uint16", ".i32": "int32", ".int32": "int32"}
BLEND_PERIOD = 10_000  # samples per blend pattern: weights are matched to 1e-4 within every period
_SCAN_LIMIT = 200_000_000  # tokens scanned for out-of-vocabulary ids (a 400 MB uint16 file takes ~0.3 s)


class DataError(SpecError):
    """A training data file is missing, malformed, of the wrong dtype, too short, or outside the vocabulary."""

    kind = "bad data"


# ----------------------------------------------------------------------------------------- Megatron index


def read_index(idx_path: Path) -> dict:
    """Parse and check a Megatron .idx file; returns dtype, sizes, pointers, doc_idx."""
    try:
        raw = idx_path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read index file {idx_path}", e.strerror or str(e), "check the path") from None
    fix = "rebuild it with Megatron's preprocess_data.py or `autoplan prepare-data`"
    if raw[:9] != MAGIC:
        raise DataError(f"{idx_path} is not a Megatron index file", f"header {raw[:9]!r}, expected {MAGIC!r}", fix)
    if len(raw) < 34:
        raise DataError(f"index file {idx_path} is truncated", f"{len(raw)} bytes", fix)
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, 9)
    if version != VERSION:
        raise DataError(f"index file {idx_path} has version {version}", f"this reader knows {VERSION}", fix)
    if code not in DTYPES:
        raise DataError(f"index file {idx_path} has dtype code {code}", f"known codes {sorted(DTYPES)}", fix)
    dtype = np.dtype(DTYPES[code])
    if dtype.kind == "f":
        raise DataError(f"index file {idx_path} declares {dtype} tokens", "token ids must be integers", fix)
    need = 34 + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if len(raw) < need:
        raise DataError(f"index file {idx_path} is truncated", f"{len(raw)} bytes, its counts need {need}", fix)
    sizes = np.frombuffer(raw, np.int32, n_seq, 34)
    pointers = np.frombuffer(raw, np.int64, n_seq, 34 + 4 * n_seq)
    doc_idx = np.frombuffer(raw, np.int64, n_doc, 34 + 12 * n_seq)
    if n_doc and (doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0)):
        raise DataError(f"index file {idx_path} has inconsistent document boundaries",
                        f"first {doc_idx[0]}, last {doc_idx[-1]}, {n_seq} sequences", fix)
    if n_seq and (np.any(sizes < 0) or np.any(pointers[1:] != pointers[:-1] + sizes[:-1].astype(np.int64)
                                               * dtype.itemsize)):
        raise DataError(f"index file {idx_path} has non-contiguous sequences",
                        "pointers are not the running sum of sizes", fix)
    return {"dtype": dtype, "sizes": sizes, "pointers": pointers, "doc_idx": doc_idx}


def write_indexed(prefix: str | Path, documents, dtype=np.int32) -> tuple[Path, Path]:
    """Write token documents (iterable of int arrays) as PREFIX.bin and PREFIX.idx, one sequence per document."""
    prefix = Path(prefix)
    dtype = np.dtype(dtype)
    sizes = []
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            a = np.asarray(doc, dtype=dtype)
            f.write(a.tobytes())
            sizes.append(len(a))
    sizes_a = np.asarray(sizes, np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes_a.astype(np.int64) * dtype.itemsize)[:-1]]).astype(np.int64) \
        if sizes else np.zeros(0, np.int64)
    doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODES[dtype], len(sizes), len(doc_idx)))
        f.write(sizes_a.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


# ----------------------------------------------------------------------------------------- one source


class TokenSource:
    """One file's tokens as documents (a flat file is one document), sampled epoch after epoch."""

    def __init__(self, path: str, seq: int, seed: int, dtype: str | None) -> None:
        self.seq, self.seed = seq, seed
        self.path, self.kind = _locate(path, dtype)
        if self.kind == "megatron":
            idx = read_index(self.path.with_suffix(".idx"))
            self.dtype = idx["dtype"]
            seq_sizes = idx["sizes"].astype(np.int64)
            docs = idx["doc_idx"]
            # tokens per document: the sequences between consecutive boundaries
            cum = np.concatenate([[0], np.cumsum(seq_sizes)])
            self.doc_sizes = cum[docs[1:]] - cum[docs[:-1]] if len(docs) > 1 else seq_sizes
            self.doc_starts = cum[docs[:-1]] if len(docs) > 1 else cum[:-1]
            bin_path = self.path.with_suffix(".bin")
            want = int(cum[-1]) * self.dtype.itemsize
            have = bin_path.stat().st_size
            if have != want:
                raise DataError(f"data file {bin_path} has {have} bytes", f"its index describes {want}",
                                "the .bin and .idx are from different runs: rebuild both")
            self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if want else np.zeros(0, self.dtype)
        else:
            self.dtype = np.dtype(dtype or FLAT_SUFFIX[self.path.suffix])
            size = self.path.stat().st_size
            if size % self.dtype.itemsize:
                raise DataError(f"token file {self.path} has {size} bytes, not a multiple of {self.dtype.itemsize}",
                                f"so it is not {self.dtype} tokens", "pass the right --data-dtype")
            self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype)
            self.doc_sizes = np.array([len(self.tokens)], np.int64)
            self.doc_starts = np.array([0], np.int64)
            _check_not_int32_as_uint16(self.path, self.tokens)
        self.n_tokens = int(self.doc_sizes.sum())
        self.n_samples = (self.n_tokens - 1) // seq if self.n_tokens > seq else 0
        self._epoch: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    def check(self, vocab: int, need_samples: int) -> None:
        if self.n_samples < need_samples:
            raise DataError(f"data {self.path} is shorter than one batch",
                            f"{self.n_tokens} tokens give {self.n_samples} samples of {self.seq}+1, a batch needs "
                            f"{need_samples}", "use more data, or a smaller global batch or --seq-len")
        n = min(len(self.tokens), _SCAN_LIMIT)
        lo, hi = 0, 0
        for i in range(0, n, 1 << 24):
            chunk = np.asarray(self.tokens[i:min(n, i + (1 << 24))])
            lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
        if hi >= vocab or lo < 0:
            raise DataError(f"data {self.path} has token ids in [{lo}, {hi}]",
                            f"the model's vocabulary is 0..{vocab - 1}",
                            "tokenise with the model's tokenizer (or a plan for a model with that vocabulary)")

    def _epoch_tables(self, epoch: int):
        if self._epoch is None or self._epoch[0] != epoch:
            g = np.random.default_rng([self.seed, epoch, 0x5EED])
            order = g.permutation(len(self.doc_sizes))
            cum = np.concatenate([[0], np.cumsum(self.doc_sizes[order])])
            samples = g.permutation(self.n_samples)
            self._epoch = (epoch, order, cum, samples)
        return self._epoch

    def sample(self, g: int) -> np.ndarray:
        """Global sample g (any epoch): seq+1 token ids as int64."""
        epoch, i = divmod(g, self.n_samples)
        _, order, cum, samples = self._epoch_tables(epoch)
        start = int(samples[i]) * self.seq
        end = start + self.seq + 1
        out, pos = [], start
        d = int(np.searchsorted(cum, start, side="right")) - 1
        while pos < end:
            doc = order[d]
            off = pos - int(cum[d])
            take = min(end - pos, int(self.doc_sizes[doc]) - off)
            s = int(self.doc_starts[doc]) + off
            out.append(np.asarray(self.tokens[s:s + take], dtype=np.int64))
            pos += take
            d += 1
        return np.concatenate(out)


def _locate(path: str, dtype: str | None) -> tuple[Path, str]:
    """(path, "megatron" | "flat"): a Megatron prefix, .bin or .idx, or a flat token file with a known dtype."""
    p = Path(path)
    for cand in (p, Path(f"{p}.bin")):
        base = cand.with_suffix("") if cand.suffix in (".bin", ".idx") else None
        if base is not None and Path(f"{base}.idx").is_file() and Path(f"{base}.bin").is_file():
            if dtype:
                raise DataError(f"--data-dtype {dtype} given for the Megatron dataset {base}",
                                "its dtype is read from the .idx header", "drop --data-dtype")
            return Path(f"{base}.bin"), "megatron"
    if p.suffix == ".idx" or (p.is_file() and p.open("rb").read(9) == MAGIC):
        raise DataError(f"{p} is a Megatron index file without its .bin", f"no {p.with_suffix('.bin')}",
                        "pass the dataset prefix (PREFIX for PREFIX.bin + PREFIX.idx) with both files present")
    if not p.is_file():
        raise DataError(f"data file {p} does not exist", "no file, no PREFIX.bin/.idx pair",
                        "check the path, or make one with `autoplan prepare-data`")
    if dtype is None and p.suffix not in FLAT_SUFFIX:
        raise DataError(f"token file {p} has no index and no dtype", f"a flat file's dtype cannot be read from it "
                        f"(suffix {p.suffix or '(none)'!r})", "pass --data-dtype uint16|int32, name it .u16/.i32, "
                        "or convert it with `autoplan prepare-data`")
    return p, "flat"


def _check_not_int32_as_uint16(path: Path, tokens: np.ndarray) -> None:
    """Little-endian int32 ids below 65536 read as uint16 give a zero every second id: refuse that reading."""
    if tokens.dtype != np.uint16 or len(tokens) < 64:
        return
    head = np.asarray(tokens[: min(len(tokens), 1 << 20) // 2 * 2])
    if not np.any(head[1::2]) and np.any(head[0::2]):
        raise DataError(f"token file {path} read as uint16 has a zero at every odd position",
                        "it is almost certainly int32 tokens", "pass --data-dtype int32 (or name it .i32)")


# ----------------------------------------------------------------------------------------- the dataset


def parse_blend(spec: str) -> list[tuple[float, str]]:
    """'PATH', or weighted 'W1 PATH1 W2 PATH2 ...' / 'W1:PATH1,W2:PATH2' (Megatron's --data-path style)."""
    parts = [x for x in re.split(r"[\s,]+", spec.strip()) if x]
    if len(parts) == 1 and ":" not in parts[0]:
        return [(1.0, parts[0])]
    pairs: list[tuple[str, str]] = []
    if all(":" in x for x in parts):
        pairs = [tuple(x.split(":", 1)) for x in parts]  # type: ignore[misc]
    elif len(parts) % 2 == 0:
        pairs = list(zip(parts[0::2], parts[1::2], strict=True))
    else:
        raise DataError(f"--data {spec!r} is not a path nor a weighted blend", "an odd number of items",
                        "pass PATH, or 'W1 PATH1 W2 PATH2 ...'")
    out = []
    for w, p in pairs:
        try:
            weight = float(w)
        except ValueError:
            raise DataError(f"--data blend weight {w!r} is not a number", f"in {spec!r}",
                            "pass 'W1 PATH1 W2 PATH2 ...'") from None
        if not weight > 0:
            raise DataError(f"--data blend weight {w} must be > 0", f"in {spec!r}", "drop that dataset instead")
        out.append((weight, p))
    return out


class BlendedDataset:
    """The runtime's dataset: batch(step) -> (global_batch, seq+1) int64, the same on every rank and layout."""

    def __init__(self, spec: str, seq: int, gbs: int, vocab: int, *, dtype: str | None = None, seed: int = 0):
        blend = parse_blend(spec)
        self.seq, self.gbs, self.seed = seq, gbs, seed
        self.sources = [TokenSource(p, seq, seed + 7919 * i, dtype) for i, (_, p) in enumerate(blend)]
        total = sum(w for w, _ in blend)
        self.weights = [w / total for w, _ in blend]
        for s in self.sources:
            s.check(vocab, 1 if len(blend) > 1 else gbs)
        if len(blend) > 1 and sum(s.n_samples for s in self.sources) < gbs:
            raise DataError("the blended data is shorter than one batch", f"{gbs} samples needed",
                            "use more data or a smaller global batch")
        self.pattern, self.local, self.per_period = _blend_pattern(self.weights, BLEND_PERIOD)

    def sample(self, g: int) -> np.ndarray:
        block, k = divmod(g, BLEND_PERIOD)
        d = int(self.pattern[k])
        return self.sources[d].sample(block * int(self.per_period[d]) + int(self.local[k]))

    def batch(self, step: int) -> torch.Tensor:
        rows = [self.sample(step * self.gbs + j) for j in range(self.gbs)]
        return torch.from_numpy(np.stack(rows))

    def describe(self) -> dict:
        return {"kind": "tokens", "sources": [{"path": str(s.path.resolve()), "format": s.kind,
                                                "dtype": str(s.dtype), "tokens": s.n_tokens} for s in self.sources],
                "weights": self.weights, "seed": self.seed}


def _blend_pattern(weights: list[float], period: int):
    """Megatron's greedy blending over one period: sample k goes to the dataset with the largest deficit
    weight*(k+1) - taken; returns (dataset per k, index within that dataset per k, samples per dataset)."""
    w = np.asarray(weights)
    taken = np.zeros(len(w), np.int64)
    pattern = np.zeros(period, np.int64)
    local = np.zeros(period, np.int64)
    for k in range(period):
        d = int(np.argmax(w * (k + 1) - taken))
        pattern[k], local[k] = d, taken[d]
        taken[d] += 1
    return pattern, local, taken


def open_dataset(spec: str, plan, *, dtype: str | None = None, seed: int = 0) -> BlendedDataset:
    t = plan.training
    return BlendedDataset(spec, t.seq_length, t.global_batch_size, plan.model.vocab_size, dtype=dtype, seed=seed)
