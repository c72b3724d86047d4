"""Checkpoints: model + AdamW state + step counter with torch.distributed.checkpoint (DCP), loadable under any layout.

    DIR/step_<n>/            one checkpoint: DCP shards (*.distcp), DCP's .metadata, and autoplan_checkpoint.json
    DIR/latest               the name of the newest complete checkpoint ("step_<n>")

What is saved. `get_state_dict(model, optimizer, flatten_optimizer_state_dict=True)` over this rank's stages:
parameters under their global names ("layers.3.attention.wq.weight": every layout keeps the single-process
names) as DTensors or plain tensors, and the optimizer state per parameter ("state.<fqn>.exp_avg",
"param_groups.<fqn>.lr"), so a pipeline rank's state never depends on which other stages exist. DCP writes each
shard once and reshards on load, which is what lets dp2 save and pp2/tp2/one process resume. Next to them, in
the same DCP checkpoint, the step counter and the plan hash/model name; and autoplan_checkpoint.json (step, plan
hash, layout, model spec, training shape, data position) which is written last and read without torch.

Atomicity: every rank writes into DIR/.step_<n>.tmp; once DCP's collective save has finished (.metadata is written
after every shard), rank 0 writes autoplan_checkpoint.json, renames the directory to step_<n> and only then
replaces `latest` (os.replace). A save that fails midway leaves the previous checkpoint and `latest` untouched.

Checksums: after the rename target is complete, rank 0 writes autoplan-manifest.json last of all (`MANIFEST_NAME`,
`"writer": "autoplan"`, a version, and every file's byte count and sha256). `inspect` verifies it on every load, so a
truncated or bit-flipped shard is reported with the file that is wrong; `newest_complete` walks back from the
newest step_<n> to the first one that verifies (automatic resume after a restart). Retention (`prune`, --keep-last)
never deletes the checkpoint just written nor the one `latest` names. One owner per directory: `DirectoryLock`.

Checks before any collective: `inspect` (the directory exists, `latest` resolves, the JSON and DCP .metadata
parse, every shard file the metadata names exists and is long enough) and `check_compatible` (same model shape,
global batch and sequence length) run at start-up on every rank, before the process group exists. The shards'
sha256 are not hashed there by every rank (a checkpoint with its optimizer state is ~16 bytes a parameter: every
rank of a large job reading all of it would multiply the filesystem's load by the world size): once the process
group exists the ranks split them (`shard_share`, ~1/world of the bytes each) and agree on the result
(runtime.faults.agree_on_shards). The key check inside `load` is agreed by all ranks (one all_gather_object)
before DCP's collective load starts.

Tied embeddings: one process holds one tensor for tok_embeddings.weight and output.weight (one optimizer state,
under tok_embeddings.weight); a pipeline holds two synchronised copies on the first and last stage. Loading a
copy whose state is missing from the checkpoint reads it from tok_embeddings.weight.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from autoplan.cost_models.errors import AutoplanError

FORMAT = 1
META_FILE = "autoplan_checkpoint.json"
LATEST = "latest"
MANIFEST_NAME = "autoplan-manifest.json"
MANIFEST_VERSION = 1
LOCK_NAME = ".autoplan.lock"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Fields of ModelSpec that do not change the parameters' names or shapes.
_SHAPE_IRRELEVANT = {"dropout"}


class CheckpointError(AutoplanError):
    """A checkpoint is missing, incomplete, corrupt, of another model, or could not be written."""

    kind = "bad checkpoint"


class ManifestError(CheckpointError):
    """A checkpoint's autoplan-manifest.json is missing, unreadable, or was not written by autoplan."""

    kind = "bad checkpoint manifest"


class CheckpointLockedError(CheckpointError):
    """Another run holds the checkpoint directory."""

    kind = "checkpoint directory in use"


# ----------------------------------------------------------------------------- manifest (checksums)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(step_dir: Path, step: int) -> dict[str, Any]:
    """Checksum every file of a finished checkpoint directory into MANIFEST_NAME (written last, fsynced)."""
    files = {}
    for f in sorted(step_dir.rglob("*")):
        if f.is_file() and f.name != MANIFEST_NAME:
            files[f.relative_to(step_dir).as_posix()] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    manifest = {"writer": "autoplan", "version": MANIFEST_VERSION, "step": step, "algorithm": "sha256",
                "files": files, "created_at": time.time()}
    _write_synced(step_dir / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(step_dir: str | Path) -> dict[str, Any]:
    """The manifest of one step_<n> directory; raises ManifestError if it is missing, corrupt or foreign."""
    step_dir = Path(step_dir)
    path = step_dir / MANIFEST_NAME
    hint = "resume from a checkpoint written by `autoplan run --save` (or an earlier complete one)"
    if not path.is_file():
        raise ManifestError(f"checkpoint {step_dir} is incomplete", f"no {MANIFEST_NAME} (written last)", hint)
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"checkpoint {step_dir} is corrupt", f"{MANIFEST_NAME}: {type(e).__name__}: {e}"[:200],
                            hint) from None
    if not isinstance(m, dict) or m.get("writer") != "autoplan":
        who = m.get("writer") if isinstance(m, dict) else type(m).__name__
        raise ManifestError(f"checkpoint {step_dir} was not written by autoplan", f"manifest writer {who!r}", hint)
    if m.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"checkpoint {step_dir} has manifest version {m.get('version')!r}",
                            f"this runtime reads {MANIFEST_VERSION}", "resume with the autoplan version that wrote it")
    files = m.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()):
        raise ManifestError(f"checkpoint {step_dir} is corrupt", f"{MANIFEST_NAME} has no valid file table", hint)
    for rel in files:
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ManifestError(f"checkpoint {step_dir} was not written by autoplan",
                                f"manifest names a file outside the checkpoint: {rel!r}", hint)
    return m


def verify(step_dir: str | Path, *, checksums: bool = True, shards: bool = True) -> dict[str, Any]:
    """Every file the manifest lists exists with its byte count (and sha256); no shard is unlisted. With
    shards=False the sha256 of the small files only (.metadata, autoplan's JSON): the ranks of a run hash the
    .distcp shards between them once the process group exists (`shard_checksum_failures`)."""
    step_dir = Path(step_dir)
    m = read_manifest(step_dir)
    hint = CORRUPT_HINT
    for rel, want in m["files"].items():
        kind = "shard" if rel.endswith(".distcp") else "file"
        f = step_dir / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {step_dir} is incomplete", f"{kind} {rel} is missing", hint)
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {step_dir} is corrupt",
                                  f"{kind} {rel} has {size} bytes, the manifest records {want['bytes']}", hint)
        if checksums and (shards or kind != "shard") and _sha256(f) != want["sha256"]:
            raise CheckpointError(f"checkpoint {step_dir} is corrupt", _sha256_failure(kind, rel), hint)
    extra = [f.name for f in step_dir.iterdir()
             if f.is_file() and f.name != MANIFEST_NAME and f.relative_to(step_dir).as_posix() not in m["files"]]
    if extra:
        raise CheckpointError(f"checkpoint {step_dir} holds files its manifest does not list", f"{sorted(extra)[:4]}",
                              "remove them, or resume from another checkpoint")
    return m


# what to do about a checkpoint whose files do not match its manifest
CORRUPT_HINT = "resume from an earlier checkpoint (automatic restarts do so themselves)"


def _sha256_failure(kind: str, rel: str) -> str:
    return f"{kind} {rel} fails its sha256 check (its contents changed after saving)"


def shard_share(manifest: dict[str, Any], rank: int, world: int) -> list[str]:
    """The .distcp shards rank `rank` of `world` checksums: largest first, each to the rank with the fewest bytes so
    far (ties to the lower rank), so every rank hashes about 1/world of the bytes. Deterministic: every rank
    computes every share the same way from the same manifest."""
    load = [0] * world
    mine = []
    shards = sorted(((v["bytes"], rel) for rel, v in manifest["files"].items() if rel.endswith(".distcp")),
                    key=lambda x: (-x[0], x[1]))
    for size, rel in shards:
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += size
        if r == rank:
            mine.append(rel)
    return mine


def shard_checksum_failures(step_dir: str | Path, rank: int, world: int) -> list[str]:
    """This rank's share of the shards' sha256 checks (`shard_share`): the reason for each shard that fails."""
    step_dir = Path(step_dir)
    m = read_manifest(step_dir)
    return [_sha256_failure("shard", rel) for rel in shard_share(m, rank, world)
            if _sha256(step_dir / rel) != m["files"][rel]["sha256"]]


def step_of(step_dir: str | Path) -> int:
    """The step number a step_<n> directory's name carries."""
    m = _STEP_DIR.match(Path(step_dir).name)
    if m is None:
        raise CheckpointError(f"{step_dir} is not a step_<n> checkpoint directory", "",
                              "pass a step_<n> directory or its parent")
    return int(m.group(1))


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """The step_<n> directories under root, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(out, reverse=True)


def newest_complete(root: str | Path, *, shards: bool = True,
                    older_than: int | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest checkpoint under root (before step `older_than`, if given) that verifies, and one line per newer
    one that did not (skipped). shards=False leaves the shards' checksums to the ranks (`verify`)."""
    skipped = []
    for step, p in step_dirs(root):
        if older_than is not None and step >= older_than:
            continue
        try:
            return inspect(p, shards=shards), skipped
        except CheckpointError as e:
            skipped.append(e.one_line())
    return None, skipped


def prune(root: str | Path, keep_last: int, *, keep: Path | None = None) -> list[str]:
    """Delete all but the newest `keep_last` step_<n> directories; never `keep` nor the one `latest` names.
    A directory is renamed away first, so a half-deleted checkpoint is never taken for a complete one."""
    root = Path(root)
    if keep_last < 1:
        return []
    protected = {keep.name if keep else None}
    if (root / LATEST).is_file():
        protected.add((root / LATEST).read_text().strip())
    removed = []
    for _, p in step_dirs(root)[keep_last:]:
        if p.name in protected:
            continue
        doomed = root / f".{p.name}.deleting"
        try:
            os.rename(p, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(p.name)
        except OSError:
            pass
    return removed


class DirectoryLock:
    """An exclusive lock on DIR/.autoplan.lock (fcntl.flock, released by the kernel when the process dies, so a
    killed run never leaves a stale lock). Rank 0 holds it for the run's lifetime."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        import fcntl
        import socket

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointLockedError(f"checkpoint directory {self.root} is in use by another run",
                                        f"lock {self.path} held by {holder}",
                                        "wait for that run to end, or pass another --save DIR") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ----------------------------------------------------------------------------- finding and checking (no torch.dist)


def resolve(path: str | Path) -> Path:
    """The checkpoint directory named by `path`: a checkpoint itself, or a parent holding `latest`."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist", "",
                              "pass a directory written by --save (step_<n>) or its parent (which holds `latest`)")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} is not a directory", "",
                              "pass a directory written by --save (step_<n>) or its parent")
    latest = p / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        target = p / name
        if not name or "/" in name or name.startswith(".") or not target.is_dir():
            raise CheckpointError(f"{latest} points to {name!r}, which is not a checkpoint directory",
                                  f"contents of {p}: {sorted(x.name for x in p.iterdir())[:8]}",
                                  "pass one of the step_<n> directories explicitly")
        return target
    if (p / ".metadata").exists() or (p / META_FILE).exists() or (p / MANIFEST_NAME).exists():
        return p
    steps = sorted(x.name for x in p.iterdir() if x.name.startswith("step_"))
    raise CheckpointError(f"{p} is not a checkpoint", "no .metadata, no `latest`"
                          + (f"; it holds {steps[:4]}" if steps else ""),
                          "pass a step_<n> directory written by --save, or its parent")


# The keys autoplan's own checkpoint file always holds (see `save`).
_AUTOPLAN_KEYS = ("format", "step", "plan_hash", "layout", "model", "global_batch_size", "seq_length")


def check_trusted(step_dir: str | Path, *, checksums: bool = True, shards: bool = True) -> dict[str, Any]:
    """Refuse a checkpoint directory that autoplan did not write, before anything in it is unpickled.

    DCP's `.metadata` is a pickle: loading it runs whatever code it names (SECURITY.md), so `--resume` reads it
    only from a directory whose checksum manifest (`read_manifest`: `"writer": "autoplan"`, written last) verifies
    and which holds autoplan's own checkpoint file. This tells autoplan's checkpoints from other tools' DCP
    directories, unfinished saves and files changed after saving; it is not a signature (anyone can write a
    manifest), so a checkpoint from someone else must still be trusted like their code. Returns the parsed
    autoplan_checkpoint.json.
    """
    ckpt = Path(step_dir)
    hint = ("resume only from a checkpoint written by `autoplan run --save` that you trust (SECURITY.md), or an "
            "earlier complete one (the parent's `latest` names it)")
    if not (ckpt / MANIFEST_NAME).is_file():
        raise ManifestError(f"checkpoint {ckpt} is incomplete or was not written by autoplan",
                              f"no {MANIFEST_NAME} (autoplan writes it last, after every shard); its DCP .metadata "
                              "is a pickle and is not read", hint)
    verify(ckpt, checksums=checksums, shards=shards)  # manifest: writer, version, every file's size (and sha256)
    meta_path = ckpt / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} is incomplete or was not written by autoplan",
                              f"no {META_FILE} (autoplan writes it after every shard); its DCP .metadata is a pickle "
                              "and is not read", hint)
    try:
        meta = json.loads(meta_path.read_text())
        missing = [k for k in _AUTOPLAN_KEYS if k not in meta]
        if missing:
            raise KeyError(", ".join(missing))
        meta["step"] = int(meta["step"])
        meta["model"]["name"]  # noqa: B018 (presence check)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt or was not written by autoplan",
                              f"{META_FILE}: {type(e).__name__}: {e}"[:300], hint) from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {ckpt} has format {meta.get('format')!r}", f"this runtime reads {FORMAT}",
                              "resume with the autoplan version that wrote it")
    return meta


def inspect(path: str | Path, *, checksums: bool = True, shards: bool = True) -> dict[str, Any]:
    """Validate a checkpoint without any process group (manifest and checksums first, then autoplan's own file);
    returns its autoplan_checkpoint.json plus "path". shards=False: the shards' sizes, not their sha256."""
    ckpt = resolve(path)
    incomplete_hint = "resume from an earlier checkpoint (the parent's `latest` names the last complete one)"
    meta = check_trusted(ckpt, checksums=checksums, shards=shards)  # before read_dcp_metadata: a foreign .metadata is never unpickled
    step = meta["step"]
    md = read_dcp_metadata(ckpt)
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = ckpt / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is incomplete", f"shard {rel} is missing", incomplete_hint)
        if f.stat().st_size < size:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt",
                                  f"shard {rel} has {f.stat().st_size} bytes, the metadata needs {size}",
                                  incomplete_hint)
    meta["path"] = str(ckpt)
    meta["step"] = step
    return meta


def read_dcp_metadata(ckpt: Path):
    from torch.distributed.checkpoint import FileSystemReader

    if not (ckpt / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {ckpt} is incomplete", "no DCP .metadata file",
                              "resume from an earlier checkpoint")
    try:
        md = FileSystemReader(str(ckpt)).read_metadata()
        _ = md.state_dict_metadata, md.storage_data
    except Exception as e:  # a truncated or overwritten pickle raises anything from EOFError to UnpicklingError
        raise CheckpointError(f"checkpoint {ckpt} is corrupt", f".metadata: {type(e).__name__}: {e}"[:300],
                              "resume from an earlier checkpoint") from None
    if not isinstance(md.storage_data, dict):
        raise CheckpointError(f"checkpoint {ckpt} is corrupt", ".metadata has no storage table",
                              "resume from an earlier checkpoint")
    return md


def check_compatible(meta: dict[str, Any], plan) -> None:
    """The checkpoint must hold the plan's model (names and shapes) and the same batch shape (data position)."""
    saved, want = meta["model"], plan.model.model_dump(mode="json")
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs plan {want.get(k)!r}"
            for k in sorted(set(saved) | set(want)) if k not in _SHAPE_IRRELEVANT and saved.get(k) != want.get(k)]
    if diff:
        what = (f"is of model {saved.get('name')!r}, not the plan's {want['name']!r}" if saved.get("name") != want["name"]
                else f"was saved for a {want['name']} of another shape")
        raise CheckpointError(f"checkpoint {meta['path']} {what}", "; ".join(diff[:4]),
                              f"resume with a plan for {saved.get('name')}, or train {want['name']} without --resume")
    t = plan.training
    got = (meta.get("global_batch_size"), meta.get("seq_length"))
    if got != (t.global_batch_size, t.seq_length):
        raise CheckpointError(f"checkpoint {meta['path']} was trained with global batch {got[0]} x sequence {got[1]}",
                              f"the plan has {t.global_batch_size} x {t.seq_length}: the data position would not "
                              "line up", "resume with a plan for the same global batch and sequence length")


# ----------------------------------------------------------------------------------- state dicts (torch)


def _model_view(modules):
    """One nn.Module whose parameter names are the global ones, over this rank's stage modules. One stage: the
    module itself. Several (interleaved pipeline): a container re-parenting their children, layers merged."""
    from torch import nn

    if len(modules) == 1:
        return modules[0]
    view = nn.Module()
    layers = nn.ModuleDict()
    for m in modules:
        for name, child in m.named_children():
            if name == "layers":
                for k, block in child.items():
                    layers[k] = block
            elif child is not None:
                if hasattr(view, name) and getattr(view, name) is not child:
                    raise CheckpointError("two stages of one rank both hold " + name, "", "report this plan")
                setattr(view, name, child)
    view.layers = layers
    return view


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def state_dict(trainer) -> dict[str, Any]:
    """Flat {"model.<fqn>": tensor, "optim.state.<fqn>.exp_avg": tensor, "optim.param_groups.<fqn>.lr": ...}."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(_model_view(trainer.pm.modules), trainer.optimizer, options=_options())
    return {**{f"model.{k}": v for k, v in msd.items()}, **{f"optim.{k}": v for k, v in osd.items()}}


def _agree(error: str | None) -> None:
    """Every rank raises if any rank found a problem (instead of one rank leaving the others in a collective)."""
    import torch.distributed as dist

    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, error)
    if error:
        raise CheckpointError(error)
    for r, e in enumerate(errs):
        if e:
            raise CheckpointError(f"rank {r}: {e}")


def _begin(root: Path, step: int) -> tuple[Path, Path]:
    """Collective: rank 0 makes an empty DIR/.step_<n>.tmp (a save that died earlier is cleared); all agree."""
    import torch.distributed as dist

    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    err = None
    if dist.get_rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save that died earlier
            tmp.mkdir()
        except OSError as e:
            err = f"cannot create checkpoint directory {tmp}: {e}"
    _agree(err)
    return final, tmp


def _saved_state(trainer, step: int) -> dict[str, Any]:
    plan = trainer.plan
    sd = state_dict(trainer)
    sd.update({"autoplan.step": step, "autoplan.plan_hash": plan.short_hash, "autoplan.model": plan.model.name})
    return sd


def _meta(plan, step: int, data: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "format": FORMAT, "step": step, "plan_hash": plan.short_hash, "layout": plan.parallel.to_string(),
        "world_size": plan.world_size, "model": plan.model.model_dump(mode="json"),
        "model_source": plan.model_source,  # the HF config (autoplan export-weights writes it back out)
        "global_batch_size": plan.training.global_batch_size, "seq_length": plan.training.seq_length,
        "data": {**(data or {}), "next_step": step, "sequences_consumed": step * plan.training.global_batch_size},
        "saved_at": time.time(),
    }


def _write_failed(final: Path, root: Path, e: BaseException) -> CheckpointError:
    """One line for a failed save. DCP's CheckpointException carries each failing rank's exception with its
    traceback in its text: report the first rank's exception itself ("rank 1: OSError: disk full")."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        why = f"rank {rank}: {type(inner).__name__}: {inner}"
    else:
        why = f"{type(e).__name__}: {e}"
    return CheckpointError(f"saving checkpoint {final} failed", " ".join(why.split())[:300],
                           f"the previous checkpoint in {root} is untouched")


def _commit(meta: dict[str, Any], root: Path, tmp: Path, final: Path, keep_last: int) -> str | None:
    """Rank 0, once every rank's shards and DCP's .metadata are in tmp: write autoplan_checkpoint.json and the
    manifest, rename tmp to step_<n>, point `latest` at it, prune. Returns an error line, or None."""
    try:
        _write_synced(tmp / META_FILE, json.dumps(meta, indent=1) + "\n")
        write_manifest(tmp, meta["step"])
        old = root / f".step_{meta['step']}.old"
        if final.exists():  # the same step saved again: keep the old one until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _write_synced(root / f".{LATEST}.tmp", final.name + "\n")
        os.replace(root / f".{LATEST}.tmp", root / LATEST)
        prune(root, keep_last, keep=final)
        return None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"finishing checkpoint {final} failed: {e}"


def save(trainer, root: str | Path, step: int, *, data: dict[str, Any] | None = None, keep_last: int = 0) -> Path:
    """Collective: write DIR/step_<step> atomically and point DIR/latest at it. Returns the checkpoint path."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final, tmp = _begin(root, step)
    rank = dist.get_rank()
    sd = _saved_state(trainer, step)
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp)))
    except (KeyboardInterrupt, SystemExit):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException as e:  # DCP's CheckpointException (a full disk, a dead peer) is a BaseException
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(final, root, e) from None
    _agree(_commit(_meta(trainer.plan, step, data), root, tmp, final, keep_last) if rank == 0 else None)
    return final


def _host_stager():
    """DCP's blocking stager keeping one host copy of the state between saves (`cache_staged_state_dict`).

    Why not a fresh copy per save (DCP's default): on this machine the copy into fresh memory is page faults
    (1.5 GiB: 5.2 s the first time, 0.19 s into the same buffer again). The library's cached stager pins its
    buffer, which needs an accelerator; on the CPU the buffer is plain memory. `prepare` allocates the buffer and
    touches its pages from a thread, so not even the first background save pays the faults on the critical path."""
    import threading

    import torch
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import BlockingAsyncStager
    from torch.distributed.tensor import DTensor

    pin = torch.cuda.is_available()

    class HostCopy(BlockingAsyncStager):
        def __init__(self) -> None:
            super().__init__(cache_staged_state_dict=True)
            self._filling: threading.Thread | None = None

        def prepare(self, state: dict[str, Any]) -> None:
            buf = _create_cpu_state_dict(state, pin_memory=pin)
            leaves = [v._local_tensor if isinstance(v, DTensor) else v for v in buf.values() if torch.is_tensor(v)]
            self._filling = threading.Thread(target=lambda: [t.zero_() for t in leaves], daemon=True,
                                             name="autoplan-checkpoint-buffer")
            self._filling.start()
            self.state_dict_cache = buf

        def stage(self, state: dict[str, Any]) -> dict[str, Any]:
            if self._filling is not None:
                self._filling.join()
                self._filling = None
            if self.state_dict_cache is None:
                self.state_dict_cache = _create_cpu_state_dict(state, pin_memory=pin)
            return _copy_state_dict(state, self.state_dict_cache)

        def close(self) -> None:
            if self._filling is not None:
                self._filling.join()
            self.state_dict_cache = None

    return HostCopy()


class AsyncSaver:
    """`--async-save`: checkpoints written by a background thread while training goes on.

    `start` copies this rank's state to host memory (DCP's stager: new CPU tensors, so the steps that follow
    cannot change what is written) and returns; `dcp.async_save` then writes the shards from a thread, over a
    process group of its own (gloo; the training collectives keep theirs, so the two never interleave on one
    group). When rank 0's save completes (every rank's shards and DCP's .metadata are written: rank 0 is the
    coordinator of DCP's finish step), rank 0 commits it exactly as a synchronous save does (metadata, manifest,
    rename, `latest`, retention) from that thread, with no collective. A crash before the commit leaves only
    .step_<n>.tmp, which nothing reads: the previous checkpoint stays the newest complete one.

    `wait` is collective (every rank calls it at the same step: before the next save starts, before a final
    synchronous save, at the end of the run) and raises on every rank if any rank's save failed. What stalls
    training is the copy to host memory, not the write (benchmarks/async_save.py measures both); the copy goes
    into one host buffer reused by every save (`_host_stager`), which costs one copy of the model and optimizer
    state in host memory for the run.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self._group = dist.new_group(backend="gloo")  # collective: every rank constructs the saver
        self._pending = None  # (future, final, committed event, [error]) of the save in flight
        self._stager = _host_stager()

    def prepare(self, trainer) -> None:
        """Once the optimizer has its state (after the first step): allocate the host copy and touch its pages
        in the background, so that the first save's stall is a copy, not page faults."""
        self._stager.prepare(_saved_state(trainer, 0))

    def close(self) -> None:
        """Release the host copy (after the last `wait`)."""
        self._stager.close()

    def start(self, trainer, root: str | Path, step: int, *, data: dict[str, Any] | None = None,
              keep_last: int = 0) -> Path:
        import threading

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        root = Path(root)
        final, tmp = _begin(root, step)
        rank = dist.get_rank()
        meta = _meta(trainer.plan, step, data) if rank == 0 else None
        committed, error = threading.Event(), [None]
        try:
            future = dcp.async_save(_saved_state(trainer, step), storage_writer=dcp.FileSystemWriter(str(tmp)),
                                    process_group=self._group, async_stager=self._stager)
        except BaseException as e:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise _write_failed(final, root, e) from None

        def done(f) -> None:  # DCP's writer thread, after this rank's save (on rank 0: everyone's) is complete
            try:
                exc = f.exception()
                if exc is not None:
                    error[0] = _write_failed(final, root, exc).one_line()
                    if rank == 0:
                        shutil.rmtree(tmp, ignore_errors=True)
                elif rank == 0:
                    error[0] = _commit(meta, root, tmp, final, keep_last)
            finally:
                committed.set()

        future.add_done_callback(done)
        self._pending = (future, final, committed, error)
        return final

    def writing(self) -> bool:
        """Whether a save is still being written (local; not a collective: do not branch collectives on it)."""
        return self._pending is not None and not self._pending[2].is_set()

    def wait(self) -> Path | None:
        """Collective: finish the save in flight (if any); its path, or None when none was in flight."""
        if self._pending is None:
            return None
        _, final, committed, error = self._pending
        self._pending = None
        committed.wait()
        _agree(error[0])
        return final

    def abandon(self) -> None:
        """Leave without waiting (an error path): an uncommitted save stays a .tmp directory, never `latest`."""
        self._pending = None


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def load(trainer, path: str | Path) -> dict[str, Any]:
    """Collective: load a checkpoint into this rank's stages and optimizer, resharding as needed. Returns its
    autoplan_checkpoint.json (step, data position, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    err, meta, request, alias = None, None, {}, {}
    view = _model_view(trainer.pm.modules)
    # the optimizer's state must exist to be loaded into (get_state_dict initialises it with a zero-lr step)
    msd, osd = get_state_dict(view, trainer.optimizer, options=_options())
    want = {**{f"model.{k}": v for k, v in msd.items()}, **{f"optim.{k}": v for k, v in osd.items()}}
    try:
        meta = inspect(path, checksums=False)  # start-up verified the checksums before any collective
        check_compatible(meta, trainer.plan)
        keys = set(read_dcp_metadata(Path(meta["path"])).state_dict_metadata)
        tied = trainer.plan.model.tie_embeddings
        missing = []
        for k, v in want.items():
            if k in keys:
                request[k] = v
                continue
            a = k.replace("output.weight", "tok_embeddings.weight") if tied and "output.weight" in k else None
            if a is not None and a in keys and a not in want:
                request[a], alias[k] = v, a
            else:
                missing.append(k)
        if missing:
            raise CheckpointError(f"checkpoint {meta['path']} lacks {len(missing)} entries this layout needs",
                                  f"e.g. {missing[:3]}", "resume with a plan for the model it was saved from")
        request["autoplan.step"] = -1
    except CheckpointError as e:
        err = e.one_line()
    _agree(err)
    dcp.load(request, storage_reader=dcp.FileSystemReader(meta["path"]))
    if int(request.pop("autoplan.step")) != meta["step"]:
        raise CheckpointError(f"checkpoint {meta['path']} is inconsistent", f"{META_FILE} says step {meta['step']}",
                              "resume from another checkpoint")
    for k, a in alias.items():
        request[k] = request.pop(a)
    set_state_dict(view, trainer.optimizer,
                   model_state_dict={k[6:]: v for k, v in request.items() if k.startswith("model.")},
                   optim_state_dict={k[6:]: v for k, v in request.items() if k.startswith("optim.")},
                   options=_options())
    return meta
