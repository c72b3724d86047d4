"""Training data files: Megatron .bin/.idx read from their header (checked against a writer written here from the
documented format, independently of the product's), flat files with a declared dtype, weighted blends,
deterministic sampling across epochs, `autoplan prepare-data`, and one-line errors for every bad file."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from autoplan.api import make_plan
from autoplan.runtime import indexed_data as idx
from autoplan.specs import TrainingSpec, load_cluster, load_model

SEQ, GBS, VOCAB = 16, 4, 128  # tiny-gpt's vocabulary is 128


def megatron_write(prefix: Path, docs: list[list[int]], code: int, np_dtype) -> None:
    """Megatron's format from its documentation: magic, <Q version, <B dtype code, <Q #sequences, <Q #documents,
    int32 sizes, int64 byte pointers, int64 document index (one sequence per document here)."""
    arrays = [np.asarray(d, dtype=np_dtype) for d in docs]
    Path(f"{prefix}.bin").write_bytes(b"".join(a.tobytes() for a in arrays))
    sizes = [len(a) for a in arrays]
    pointers, off = [], 0
    for a in arrays:
        pointers.append(off)
        off += a.nbytes
    head = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", len(docs)) \
        + struct.pack("<Q", len(docs) + 1)
    body = struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(pointers)}q", *pointers) \
        + struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1))
    Path(f"{prefix}.idx").write_bytes(head + body)


def docs_of(n_docs: int, seed: int = 0, lo: int = 5, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, VOCAB, rng.integers(lo, hi))) for _ in range(n_docs)]


def source(prefix, dtype=None, seed=0):
    return idx.TokenSource(str(prefix), SEQ, seed, dtype)


def test_reads_megatron_int32_from_its_header_and_matches_the_product_writer(tmp_path):
    docs = docs_of(30)
    megatron_write(tmp_path / "m", docs, 4, np.int32)
    s = source(tmp_path / "m")
    assert s.kind == "megatron" and s.dtype == np.int32
    assert s.n_tokens == sum(map(len, docs)) and s.n_samples == (s.n_tokens - 1) // SEQ
    assert list(s.doc_sizes) == [len(d) for d in docs]
    # every sample is seq+1 consecutive tokens of the documents concatenated in the epoch's shuffled order
    _, order, _, _ = s._epoch_tables(0)
    stream = np.concatenate([np.asarray(docs[i]) for i in order])
    for g in range(s.n_samples):
        j = int(s._epoch_tables(0)[3][g])
        assert np.array_equal(s.sample(g), stream[j * SEQ: j * SEQ + SEQ + 1])
    idx.write_indexed(tmp_path / "p", docs, dtype=np.int32)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"p{ext}").read_bytes() == (tmp_path / f"m{ext}").read_bytes()
    # the .bin, the .idx or the prefix all name the dataset
    assert source(tmp_path / "m.bin").n_tokens == source(tmp_path / "m.idx").n_tokens == s.n_tokens


def test_sampling_is_deterministic_and_continues_across_epochs(tmp_path):
    megatron_write(tmp_path / "m", docs_of(20, lo=10, hi=30), 8, np.uint16)
    a, b = source(tmp_path / "m"), source(tmp_path / "m")
    n = a.n_samples
    assert all(np.array_equal(a.sample(g), b.sample(g)) for g in range(2 * n + 3))
    e0 = sorted(tuple(a.sample(g)) for g in range(n))
    e1 = [tuple(a.sample(g)) for g in range(n, 2 * n)]
    assert [tuple(a.sample(g)) for g in range(n)] != e1  # a new shuffle every epoch
    assert len(e1) == n and all(len(x) == SEQ + 1 for x in e1) and e0 != []
    assert not np.array_equal(source(tmp_path / "m", seed=1).sample(0), a.sample(0)) or n == 1


def test_weighted_blend_follows_its_weights_and_batches_are_pure_functions_of_the_step(tmp_path):
    megatron_write(tmp_path / "a", [[1] * 40] * 20, 4, np.int32)  # every token 1
    megatron_write(tmp_path / "b", [[2] * 40] * 20, 8, np.uint16)  # every token 2
    ds = idx.BlendedDataset(f"0.75 {tmp_path / 'a'} 0.25 {tmp_path / 'b'}", SEQ, GBS, VOCAB)
    firsts = [int(ds.sample(g)[0]) for g in range(400)]
    assert firsts.count(1) == 300 and firsts.count(2) == 100
    same = idx.BlendedDataset(f"3:{tmp_path / 'a'},1:{tmp_path / 'b'}", SEQ, GBS, VOCAB)
    assert all(ds.batch(t).equal(same.batch(t)) for t in (0, 7, 123))
    assert ds.batch(5).shape == (GBS, SEQ + 1) and ds.describe()["weights"] == [0.75, 0.25]


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("idx_alone", "is a Megatron index file without its .bin"),
    ("flat_no_dtype", "has no index and no dtype"),
    ("int32_as_uint16", "almost certainly int32"),
    ("too_short", "shorter than one batch"),
    ("out_of_vocab", "token ids in [0, 500]"),
    ("bad_magic", "is not a Megatron index file"),
    ("float_dtype", "declares float32 tokens"),
    ("bin_idx_mismatch", "from different runs"),
    ("bad_blend", "is not a number"),
    ("dtype_for_megatron", "is read from the .idx header"),
])
def test_bad_data_is_one_line(tmp_path, case, message):
    spec, dtype = str(tmp_path / "d"), None
    if case == "idx_alone":
        megatron_write(tmp_path / "d", docs_of(10), 4, np.int32)
        (tmp_path / "d.bin").unlink()
        spec = str(tmp_path / "d.idx")
    elif case == "flat_no_dtype":
        np.arange(100, dtype=np.uint16).tofile(tmp_path / "d.bin")
        spec = str(tmp_path / "d.bin")
    elif case == "int32_as_uint16":
        np.arange(1000, dtype=np.int32).tofile(tmp_path / "d.bin")
        spec, dtype = str(tmp_path / "d.bin"), "uint16"
    elif case == "too_short":
        megatron_write(tmp_path / "d", [[1, 2, 3]] * 5, 4, np.int32)
    elif case == "out_of_vocab":
        megatron_write(tmp_path / "d", [list(range(0, 501))], 4, np.int32)
    elif case == "bad_magic":
        megatron_write(tmp_path / "d", docs_of(10), 4, np.int32)
        (tmp_path / "d.idx").write_bytes(b"NOTANIDX!" + (tmp_path / "d.idx").read_bytes()[9:])
    elif case == "float_dtype":
        megatron_write(tmp_path / "d", docs_of(10), 7, np.float32)
    elif case == "bin_idx_mismatch":
        megatron_write(tmp_path / "d", docs_of(10), 4, np.int32)
        with open(tmp_path / "d.bin", "ab") as f:
            f.write(b"\0" * 8)
    elif case == "bad_blend":
        spec = f"heavy {tmp_path / 'd'} 0.5 {tmp_path / 'e'}"
    elif case == "dtype_for_megatron":
        megatron_write(tmp_path / "d", docs_of(10), 4, np.int32)
        dtype = "int32"
    with pytest.raises(idx.DataError) as err:
        idx.BlendedDataset(spec, SEQ, GBS, VOCAB, dtype=dtype)
    line = err.value.one_line()
    assert message in line and "\n" not in line and "fix:" in line


def test_flat_files_take_their_declared_dtype(tmp_path):
    ids = np.random.default_rng(0).integers(0, VOCAB, 500)
    ids.astype(np.int32).tofile(tmp_path / "t.i32")
    ids.astype(np.uint16).tofile(tmp_path / "t.bin")
    a = idx.BlendedDataset(str(tmp_path / "t.i32"), SEQ, GBS, VOCAB)
    b = idx.BlendedDataset(str(tmp_path / "t.bin"), SEQ, GBS, VOCAB, dtype="uint16")
    assert a.batch(3).equal(b.batch(3)) and int(a.batch(0).max()) < VOCAB


def _tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([f"word{i}" for i in range(60)], trainers.WordLevelTrainer(special_tokens=["<unk>",
                                                                                                       "</s>"]))
    tok.save(str(path))
    return path


def test_prepare_data_from_jsonl_and_parquet_reads_back_the_tokenizer_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from autoplan.cli import main

    tok_path = _tokenizer(tmp_path / "tokenizer.json")
    texts = [" ".join(f"word{(i * 7 + k) % 60}" for k in range(3 + i % 11)) for i in range(200)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"body": texts}), tmp_path / "c.parquet")
    tok = Tokenizer.from_file(str(tok_path))
    want = [tok.encode(t, add_special_tokens=False).ids + [tok.token_to_id("</s>")] for t in texts]
    for name in ("c.jsonl", "c.parquet"):
        out = tmp_path / name.replace(".", "_")
        assert main(["prepare-data", str(tmp_path / name), "--tokenizer", str(tok_path), "-o", str(out),
                     "--text-field", "body", "--eod", "</s>", "--model", "tiny-gpt"]) == 0
        s = source(out)
        assert s.dtype == np.uint16 and list(s.doc_sizes) == [len(w) for w in want]
        assert np.array_equal(np.asarray(s.tokens), np.concatenate(want))


def test_prepare_data_errors_are_one_line(tmp_path, capsys):
    from autoplan.cli import main

    tok = _tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "word1"}) + "\n")
    assert main(["prepare-data", str(tmp_path / "c.jsonl"), "--tokenizer", str(tok), "-o", str(tmp_path / "o"),
                 "--text-field", "body"]) == 2
    err = capsys.readouterr().err
    assert "line 1 has no text field 'body': it holds ['text']. fix: pass --text-field text" in err
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "word1"}) + "\n{\"text\": word2\n")
    assert main(["prepare-data", str(tmp_path / "d.jsonl"), "--tokenizer", str(tok), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "d.jsonl line 2 is not JSON: JSONDecodeError" in err and "no text field" not in err
    assert main(["prepare-data", str(tmp_path / "nope"), "--tokenizer", str(tok), "-o", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_prepare_data_without_pyarrow_says_what_to_install(tmp_path, monkeypatch, capsys):
    from autoplan.cli import main

    tok = _tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    for mod in ("pyarrow", "pyarrow.parquet", "pyarrow.ipc"):
        monkeypatch.setitem(sys.modules, mod, None)  # an import of it now raises ImportError
    assert main(["prepare-data", str(tmp_path / "c.parquet"), "--tokenizer", str(tok), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "needs pyarrow" in err and "autoplan[data]" in err


def test_runtime_refuses_bad_data_before_training(tmp_path, monkeypatch, capsys):
    from autoplan.runtime import train

    for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    plan = make_plan(load_model("tiny-gpt"), load_cluster("local-cpu").with_gpus(1),
                     TrainingSpec(global_batch_size=4, seq_length=64, dtype="fp32"), "dp=1", kernels="torch")
    path = plan.save(tmp_path / "plan.json")
    np.arange(1000, dtype=np.int32).tofile(tmp_path / "tok.bin")
    assert train.main(["--plan", str(path), "--data", str(tmp_path / "tok.bin"), "--data-dtype", "uint16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "almost certainly int32" in err[0]
