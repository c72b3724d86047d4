"""What a long run needs to survive: argument checks, one owner per checkpoint directory, non-finite losses,
preemption signals, restart records and a rewritten log. Kept out of `train.py` so the training loop stays a loop.

Everything here runs either before the process group exists (argument and directory checks: a bad run stops with
one line before any collective) or once per step (the stop flag, the finiteness check).

Preemption: SIGTERM/SIGINT set a flag; after each step the ranks agree on it (one 1-element MAX all-reduce, so a
rank that got the signal a step later is not left alone in a collective), save a checkpoint and exit. A second
signal leaves at once. Restarts: torchrun's elastic agent sets TORCHELASTIC_RESTART_COUNT; a restarted worker
resumes from the newest checkpoint that verifies and rank 0 records a `"event": "restart"` row in the log.
Fault injection (tests): AUTOPLAN_FAULT="kill:RANK:STEP" makes that rank SIGKILL itself after STEP on the first
attempt only, which is a real killed process, not a simulated one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from autoplan.cost_models.errors import AutoplanError


class TrainingArgsError(AutoplanError):
    """A training argument is out of its range."""

    kind = "bad training argument"


class NonFiniteError(AutoplanError):
    """The loss or the gradient norm became NaN or infinite."""

    kind = "non-finite training state"


class DataDirError(AutoplanError):
    """The checkpoint directory cannot be used (not writable, too little space, holds another run's checkpoints)."""

    kind = "bad checkpoint directory"


# ------------------------------------------------------------------------------------------------ arguments


def validate_training_args(args) -> None:
    """Every numeric training argument in its range; one line naming the argument, the value and a way out."""

    def bad(name: str, value, rule: str, fix: str) -> None:
        raise TrainingArgsError(f"{name} {rule}", f"got {value}", fix)

    if args.steps < 1:
        bad("--steps", args.steps, "must be >= 1", "pass --steps 10")
    # 0 is allowed: a run that evaluates and round-trips weights without changing them (AdamW's decay is lr-scaled)
    if not (math.isfinite(args.lr) and args.lr >= 0):
        bad("--lr", args.lr, "must be a finite number >= 0", "pass e.g. --lr 3e-4")
    if args.lr > 10:
        bad("--lr", args.lr, "is above 10, which diverges any AdamW run", "pass e.g. --lr 3e-4")
    if args.warmup < 0:
        bad("--warmup", args.warmup, "must be >= 0", "pass --warmup 0 (no warm-up) or a step count")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        bad("--weight-decay", args.weight_decay, "must be a finite number >= 0", "pass --weight-decay 0.1")
    if not (math.isfinite(args.max_grad_norm) and args.max_grad_norm >= 0):
        bad("--max-grad-norm", args.max_grad_norm, "must be >= 0 (0 turns clipping off; a negative norm would "
            "turn clipping into gradient ascent)", "pass --max-grad-norm 1.0")
    if args.keep_last < 0:
        bad("--keep-last", args.keep_last, "must be >= 0 (0 keeps every checkpoint)", "pass --keep-last 3")
    if args.keep_last and not args.save:
        bad("--keep-last", args.keep_last, "needs --save DIR", "pass --save DIR --keep-last K")
    if args.auto_resume and not args.save:
        bad("--auto-resume", "without --save", "needs --save DIR (where it looks for checkpoints)",
            "pass --save DIR")
    if args.auto_resume and args.resume:
        bad("--auto-resume", f"with --resume {args.resume}", "and --resume exclude each other",
            "pass one of them")
    if args.loss_spike_factor is not None and not (args.loss_spike_factor > 1):
        bad("--loss-spike-factor", args.loss_spike_factor, "must be > 1", "pass e.g. --loss-spike-factor 3")
    if args.collective_timeout <= 0:
        bad("--collective-timeout", args.collective_timeout, "must be > 0 seconds", "pass --collective-timeout 300")


# ------------------------------------------------------------------------------------------------ checkpoint dir


def checkpoint_bytes(plan) -> int:
    """What one checkpoint of the plan's model takes: fp32 weights and AdamW's two fp32 moments (4 bytes each,
    the runtime's master precision), whatever the layout (DCP writes each shard once)."""
    from autoplan.cost_models.profile import profile_from_spec

    params = sum(p.params for p in profile_from_spec(plan.model))
    return 3 * 4 * params


def prepare_save_dir(args, plan, resume_path: str | None):
    """Rank 0, before training: take the directory's lock, refuse a new run over old checkpoints (unless
    --overwrite), check it is writable and has room for one checkpoint. Returns the held lock."""
    from . import checkpoint

    root = Path(args.save)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataDirError(f"cannot create --save directory {root}", str(e), "pass a writable --save DIR") from None
    try:
        probe = root / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise DataDirError(f"--save directory {root} is not writable", f"{type(e).__name__}: {e.strerror or e}",
                           "pass a writable --save DIR (or fix its permissions)") from None
    lock = checkpoint.DirectoryLock(root).acquire()
    try:
        existing = [p.name for _, p in checkpoint.step_dirs(root)]
        resuming_here = resume_path is not None and Path(resume_path).resolve().parent == root.resolve()
        if existing and not (args.auto_resume or resuming_here):
            if not args.overwrite:
                raise DataDirError(f"--save directory {root} already holds checkpoints",
                                   f"{', '.join(existing[:4])}; a new run would replace `latest`",
                                   "pass --resume DIR to continue that run, --overwrite to start over, "
                                   "or another --save DIR")
            for name in existing:  # --overwrite: the old run's checkpoints go, before the new run writes any
                shutil.rmtree(root / name, ignore_errors=True)
            (root / checkpoint.LATEST).unlink(missing_ok=True)
        need = checkpoint_bytes(plan)
        free = shutil.disk_usage(root).free
        if free < need:
            raise DataDirError(f"--save directory {root} has too little free space for one checkpoint",
                               f"{free / 2**20:.1f} MiB free, one checkpoint needs about {need / 2**20:.1f} MiB",
                               "free space or pass another --save DIR")
    except BaseException:
        lock.release()
        raise
    return lock


def resolve_resume(args) -> tuple[str | None, list[str]]:
    """The checkpoint to resume from: --resume as given, or with --auto-resume the newest complete one under
    --save (None when there is none: a fresh start). Also the lines for checkpoints skipped as broken."""
    from . import checkpoint

    if args.resume:
        return args.resume, []
    if not args.auto_resume:
        return None, []
    meta, skipped = checkpoint.newest_complete(args.save, shards=False)
    return (meta["path"] if meta else None), skipped


def agree_on_shards(args, rank: int, world: int) -> None:
    """Once the process group exists (every rank): hash the resume checkpoint's shards between the ranks
    (`checkpoint.shard_share`) and agree on the result with one all_gather_object. A shard that fails stops every
    rank with the same error (printed once, by rank 0: `agreed`), or with --auto-resume moves all of them to the
    next older checkpoint that verifies, as start-up's walk-back does for a missing or short file. Updates
    args.resume_path and args.skipped_checkpoints."""
    import torch.distributed as dist

    from . import checkpoint

    path = getattr(args, "resume_path", None)
    if path is None and getattr(args, "resume", None) and not hasattr(args, "resume_path"):
        path = str(checkpoint.resolve(args.resume))  # a caller that skipped check_checkpoint_args (tests)
    while path:
        mine = checkpoint.shard_checksum_failures(path, rank, world)
        every: list[list[str] | None] = [None] * world
        dist.all_gather_object(every, mine)
        failed = sorted(x for got in every for x in (got or []))
        if not failed:
            break
        err = checkpoint.CheckpointError(f"checkpoint {path} is corrupt", failed[0] + (
            f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""), checkpoint.CORRUPT_HINT)
        if args.resume or not args.auto_resume:
            err.agreed = True  # every rank raises it: runtime.train prints it once
            raise err
        meta, skipped = checkpoint.newest_complete(args.save, shards=False, older_than=checkpoint.step_of(path))
        skipped = [err.one_line(), *skipped]
        warn_skipped(skipped, rank)
        args.skipped_checkpoints = [*getattr(args, "skipped_checkpoints", []), *skipped]
        path = meta["path"] if meta else None
    args.resume_path = path


def warn_skipped(lines: list[str], rank: int) -> None:
    """Rank 0: one warning per checkpoint passed over as broken."""
    if rank == 0:
        for line in lines:
            print(f"autoplan run: warning: skipped a broken checkpoint: {line}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ log


def open_log(path: str, start: int):
    """The run log, rewritten from the resumed step: rows of steps after `start` (a run that went further
    before it died) are dropped, so a resumed run never duplicates a step."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if start > 0 and p.is_file():
        for line in p.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a row cut short by the kill
            if "step" in rec and rec["step"] <= start or "event" in rec and rec.get("at_step", 0) <= start:
                kept.append(json.dumps(rec))
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, p)
    return open(p, "a")  # noqa: SIM115 (the caller closes it)


def restart_count() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def restart_event(start: int, resume_path: str | None, skipped: list[str], log_path: str | None) -> dict | None:
    """The log row of an automatic restart: when, why, from which step, and how many steps were redone."""
    n = restart_count()
    if n == 0:
        return None
    last = 0
    if log_path and Path(log_path).is_file():
        for line in Path(log_path).read_text().splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                last = max(last, int(json.loads(line).get("step", 0)))
    return {"event": "restart", "restart": n, "time": time.time(), "at_step": start,
            "reason": "a worker of the previous attempt failed (torchrun elastic restart)",
            "resumed_from": resume_path, "last_logged_step": last, "steps_redone": max(0, last - start),
            "skipped_checkpoints": skipped}


# ------------------------------------------------------------------------------------------------ numbers


def check_finite(loss: float, grad_norm: float, step: int, policy: str) -> str | None:
    """None when both are finite; else 'skip' (the step's update was not applied) or raises NonFiniteError."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return None
    what = f"loss {loss}, gradient norm {grad_norm}"
    if policy == "skip":
        return what
    raise NonFiniteError(f"training stopped at step {step}: the loss or gradient norm is not finite", what,
                         "lower --lr (or raise --warmup), or pass --on-nonfinite skip to skip such steps; the last "
                         "checkpoint was saved before this step and holds no NaN")


class SpikeDetector:
    """Optional: warn when a loss exceeds `factor` times the mean of the previous `window` losses."""

    def __init__(self, factor: float | None, window: int = 20) -> None:
        self.factor, self.window, self.hist = factor, window, []

    def check(self, loss: float) -> float | None:
        if self.factor is None or not math.isfinite(loss):
            return None
        mean = sum(self.hist) / len(self.hist) if len(self.hist) >= 5 else None
        self.hist = (self.hist + [loss])[-self.window:]
        return mean if mean is not None and loss > self.factor * mean else None


# ------------------------------------------------------------------------------------------------ signals


class StopFlag:
    """SIGTERM/SIGINT -> stop after the current step (checkpoint, then exit); a second signal exits at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread (tests driving train_loop from a thread)
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            sys.stderr.write(f"[pid {os.getpid()}] second {signal.Signals(signum).name}: leaving without a "
                             "checkpoint\n")
            os._exit(128 + signum)
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the order of the flags in encode/decode: SIGTERM wins a tie

    @classmethod
    def encode(cls, signum: int | None) -> list[float]:
        """One flag per handled signal, to be summed over ranks (Trainer._reduce_loss sends them with the loss)."""
        return [1.0 if signum == s else 0.0 for s in cls.SIGNALS]

    @classmethod
    def decode(cls, summed: list[float]) -> int | None:
        """The signal every rank acts on, from the flags summed over ranks (None: nobody was asked to stop)."""
        return next((int(s) for s, n in zip(cls.SIGNALS, summed, strict=True) if n > 0), None)


class Heartbeat:
    """Each rank publishes "<last finished step> <wall time>" to the job's store every `PERIOD_S` from a thread
    of its own (no per-step cost), so a rank that times out in a collective can name the missing ones: those
    whose heartbeat stopped (killed, SIGSTOPped, a dead host) or that are behind it."""

    PERIOD_S = 1.0
    STALE_S = 5.0  # a heartbeat older than this (5 periods, room for a loaded machine) means the rank is gone

    def __init__(self, store, rank: int) -> None:
        import threading

        self.store, self.rank, self.step = store, rank, 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if store is not None:
            self._thread = threading.Thread(target=self._publish, daemon=True, name="autoplan-heartbeat")
            self._thread.start()

    @classmethod
    def for_job(cls, rank: int):
        """A heartbeat on its own client of torchrun's store (the process group's client stays untouched)."""
        if "MASTER_ADDR" not in os.environ:
            return cls(None, rank)
        try:
            import torch.distributed as dist

            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=__import__("datetime").timedelta(seconds=30))
            return cls(dist.PrefixStore(f"autoplan-heartbeat-{restart_count()}", base), rank)
        except Exception:
            return cls(None, rank)

    def beat(self, step: int) -> None:
        self.step = step

    def _set(self) -> None:
        with self._lock:
            self.store.set(f"hb/{self.rank}", f"{self.step} {time.time()}")

    def _publish(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a heartbeat must never stop training
                self._set()
            self._stop.wait(self.PERIOD_S)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def missing(self, world: int) -> str | None:
        """'missing: rank 1 (no heartbeat for 12 s, last finished step 2); this rank finished step 2' or None."""
        if self.store is None:
            return None
        now, gone = time.time(), []
        for r in range(world):
            if r == self.rank:
                continue
            try:
                with self._lock:
                    raw = self.store.get(f"hb/{r}").decode() if self.store.check([f"hb/{r}"]) else None
            except Exception:
                return None
            if raw is None:
                gone.append(f"rank {r} (never started)")
                continue
            step, at = raw.split()
            if now - float(at) > self.STALE_S:
                gone.append(f"rank {r} (no heartbeat for {now - float(at):.0f} s, last finished step {step})")
            elif int(step) < self.step:
                gone.append(f"rank {r} (alive but behind: last finished step {step})")
        if not gone:
            return None
        return f"missing: {', '.join(gone[:8])}; this rank finished step {self.step}"


def maybe_inject_fault(rank: int, step: int) -> None:
    """AUTOPLAN_FAULT="kill:RANK:STEP" SIGKILLs that rank after STEP, "hang:RANK:STEP" SIGSTOPs it there (a hung
    rank: alive, never reaching the next collective); both on the first attempt only (tests)."""
    spec = os.environ.get("AUTOPLAN_FAULT", "")
    if not spec.startswith(("kill:", "hang:")) or restart_count() > 0:
        return
    kind, r, s = spec.split(":")
    if int(r) == rank and int(s) == step:
        stamp = os.environ.get("AUTOPLAN_FAULT_STAMP")
        if stamp:
            Path(stamp).write_text(json.dumps({"fault": kind, "at": time.time(), "rank": rank, "after_step": step}))
        os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
