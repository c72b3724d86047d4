"""`autoplan prepare-data`: text (a Hugging Face dataset directory, parquet or JSON lines) -> a Megatron-format token
dataset (PREFIX.bin + PREFIX.idx) that `autoplan run -- --data PREFIX` reads, with a Hugging Face `tokenizers`
tokenizer.

    autoplan prepare-data corpus.jsonl --tokenizer tokenizer.json -o data/corpus [--text-field text] [--eod]

Why this format: it records the dtype and the document boundaries in its header, so the runtime reads them
instead of guessing, and Megatron-LM users' existing datasets work unchanged. One document per input row; the
token dtype is uint16 when the tokenizer's vocabulary fits in it, else int32. Reading is streamed (pyarrow
record batches, JSON lines one at a time) and tokenised in batches (`Tokenizer.encode_batch`, Rust, threaded),
with a rich progress bar over the input rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from autoplan.cost_models.errors import SpecError

BATCH_ROWS = 1000  # rows per encode_batch call: large enough to amortise the call, small enough for a live bar


class PrepareDataError(SpecError):
    """The input text or the tokenizer cannot be read."""

    kind = "bad data input"


def input_files(path: Path) -> list[Path]:
    """The files of one input: a file, or a directory of .arrow (HF save_to_disk), .parquet or .jsonl files."""
    if not path.exists():
        raise PrepareDataError(f"input {path} does not exist", "", "pass a .jsonl/.parquet file or a dataset dir")
    if path.is_file():
        return [path]
    for pattern in ("**/*.arrow", "**/*.parquet", "**/*.jsonl", "**/*.json"):
        files = sorted(f for f in path.glob(pattern) if f.name not in ("dataset_info.json", "state.json"))
        if files:
            return files
    raise PrepareDataError(f"directory {path} holds no .arrow, .parquet or .jsonl files", "",
                           "pass a Hugging Face dataset directory (save_to_disk or parquet shards) or a file")


def _pyarrow():
    """pyarrow, or a clear error: parquet and arrow inputs need it (`pip install 'autoplan[data]'`)."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise PrepareDataError("reading .parquet/.arrow input needs pyarrow, which is not installed", "",
                               "pip install 'autoplan[data]' (or pyarrow), or pass JSON lines") from None
    return pyarrow


def count_rows(files: list[Path]) -> int | None:
    """Rows in the input when cheap to know (parquet/arrow metadata); None for JSON lines."""
    total = 0
    for f in files:
        if f.suffix == ".parquet":
            total += _pyarrow().parquet.ParquetFile(f).metadata.num_rows
        elif f.suffix == ".arrow":
            total += sum(b.num_rows for b in _arrow_batches(f))
        else:
            return None
    return total


def _arrow_batches(f: Path):
    pa = _pyarrow()

    try:
        with pa.memory_map(str(f)) as src:
            yield from pa.ipc.open_stream(src)
    except pa.ArrowInvalid:
        with pa.memory_map(str(f)) as src:
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)


def read_texts(files: list[Path], field: str) -> Iterator[list[str]]:
    """Batches of document texts from the input files, in order."""
    for f in files:
        if f.suffix in (".parquet", ".arrow"):
            if f.suffix == ".parquet":
                batches = _pyarrow().parquet.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS, columns=None)
            else:
                batches = _arrow_batches(f)
            for b in batches:
                if field not in b.schema.names:
                    raise PrepareDataError(f"{f} has no column {field!r}", f"columns {b.schema.names[:8]}",
                                           "pass --text-field with one of them")
                yield [x or "" for x in b.column(field).to_pylist()]
        else:
            batch: list[str] = []
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        raise PrepareDataError(f"{f} line {n} is not JSON", f"{type(e).__name__}: {str(e)[:80]}",
                                               "fix that line (JSON Lines: one JSON object per line)") from None
                    if not isinstance(row, dict) or field not in row:
                        keys = sorted(row)[:8] if isinstance(row, dict) else f"a JSON {type(row).__name__}"
                        strings = [k for k in (row if isinstance(row, dict) else ()) if isinstance(row[k], str)]
                        raise PrepareDataError(f"{f} line {n} has no text field {field!r}", f"it holds {keys}",
                                               f"pass --text-field {strings[0]}" if strings else
                                               "pass --text-field with the key holding the text, or fix that line")
                    text = row[field]
                    batch.append(text if isinstance(text, str) else str(text))
                    if len(batch) == BATCH_ROWS:
                        yield batch
                        batch = []
            if batch:
                yield batch


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise PrepareDataError(f"tokenizer {p} does not exist", "", "pass a tokenizer.json (or the model directory "
                               "holding it) saved by Hugging Face tokenizers/transformers")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:
        raise PrepareDataError(f"cannot read tokenizer {p}", f"{type(e).__name__}: {str(e)[:120]}",
                               "pass a tokenizer.json of the `tokenizers` library") from None


def prepare(inp: str | Path, tokenizer: str, output: str | Path, *, text_field: str = "text",
            eod: str | None = None, model_vocab: int | None = None, progress: bool = True) -> dict:
    """Tokenise the input into OUTPUT.bin/.idx; returns a summary (documents, tokens, dtype, vocab)."""
    import numpy as np

    from autoplan.runtime.indexed_data import write_indexed

    files = input_files(Path(inp))
    tok = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if model_vocab is not None and vocab > model_vocab:
        raise PrepareDataError(f"the tokenizer has {vocab} ids but the model's vocabulary is {model_vocab}",
                               "ids beyond it would be out of range", "use the model's own tokenizer")
    eod_id = None
    if eod is not None:
        eod_id = tok.token_to_id(eod)
        if eod_id is None:
            raise PrepareDataError(f"end-of-document token {eod!r} is not in the tokenizer", "",
                                   "pass --eod with a token the tokenizer knows (e.g. '</s>' or '<|endoftext|>')")
    dtype = np.uint16 if vocab <= 65536 else np.int32
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    stats = {"documents": 0, "tokens": 0}

    def documents():
        for texts in read_texts(files, text_field):
            for enc in tok.encode_batch(texts, add_special_tokens=False):
                ids = enc.ids + ([eod_id] if eod_id is not None else [])
                if not ids:
                    continue
                stats["documents"] += 1
                stats["tokens"] += len(ids)
                yield ids
            bar.advance(task, len(texts))

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    total = count_rows(files)
    with Progress(TextColumn("tokenising"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=not progress, transient=True) as bar:
        task = bar.add_task("rows", total=total)
        bin_path, idx_path = write_indexed(out, documents(), dtype=dtype)
    return {**stats, "dtype": np.dtype(dtype).name, "vocab_size": vocab, "bin": str(bin_path), "idx": str(idx_path),
            "inputs": [str(f) for f in files]}


def cmd_prepare_data(args: argparse.Namespace) -> int:
    model_vocab = None
    if args.model:
        from autoplan.specs import load_model

        model_vocab = load_model(args.model).vocab_size
    summary = prepare(args.input, args.tokenizer, args.output, text_field=args.text_field, eod=args.eod,
                      model_vocab=model_vocab, progress=sys.stderr.isatty() and not args.json)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {summary['bin']} and {summary['idx']}: {summary['documents']} documents, {summary['tokens']} "
              f"tokens ({summary['dtype']}, vocabulary {summary['vocab_size']}); train with "
              f"`autoplan run plan.json -- --data {args.output}`")
    return 0


def register(sub) -> None:
    p = sub.add_parser("prepare-data", help="tokenise text (HF dataset dir, parquet, jsonl) into a .bin/.idx "
                                            "dataset for `autoplan run -- --data PREFIX`")
    p.add_argument("input", help="a .jsonl/.parquet/.arrow file, or a Hugging Face dataset directory")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (or a directory holding it)")
    p.add_argument("-o", "--output", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--text-field", default="text", help="the column / JSON key holding the text (default: text)")
    p.add_argument("--eod", default=None, metavar="TOKEN", help="append this token to every document")
    p.add_argument("--model", default=None, help="check that the tokenizer's ids fit this model's vocabulary")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_prepare_data)
