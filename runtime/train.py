"""Train a zoo model with exactly a Plan's layout, under torchrun.

    torchrun --nproc-per-node N -m autoplan.runtime.train -- --plan plan.json --steps 20 [--data tokens.bin] [--log log.jsonl]
        [--save DIR [--save-every K]] [--resume DIR]

(`--` keeps torchrun from reading --log as its own --log-dir; `--log-file` is the same option without it.)

Checkpoints (runtime.checkpoint, torch.distributed.checkpoint):
  --save DIR        write DIR/step_<n>/ at the end of the run (and every K steps with --save-every K): model,
                    AdamW state, step counter, plan hash, model name, data position. Written to a temporary
                    directory and renamed when complete; DIR/latest names the newest complete checkpoint, so a
                    save that fails midway never loses the previous one.
  --resume DIR      a step_<n> directory, or its parent (follows DIR/latest). Loads it before training and
                    continues at step n+1 with the data an uninterrupted run would see; --steps is the total,
                    so `--steps 20 --resume ckpt` after 12 saved steps runs steps 13..20. The plan may have any
                    layout (DCP reshards: saved with dp2, resumed with tp2, pp2 or one process); it must be for
                    the same model (names and shapes), global batch and sequence length. A missing, incomplete
                    or corrupt checkpoint, or one of another model, stops at start-up with one line.

Long runs (runtime.faults, runtime.indexed_data):
  --async-save      --save-every checkpoints are written by a background thread (DCP async_save) while training
                    goes on; the last save is synchronous. --keep-last K retention; --overwrite a --save DIR holding another run's checkpoints; --auto-resume from the
                    newest checkpoint that verifies (skipping broken ones; `autoplan run --max-restarts` passes it)
  --on-nonfinite    stop (default) or skip a step whose loss or gradient norm is NaN/inf; a NaN update is never
                    applied and never checkpointed. --loss-spike-factor F warns on spikes.
  --collective-timeout S   (default 300) a collective waiting longer ends the job, naming the missing rank.
  --data            Megatron PREFIX (.bin/.idx), a weighted blend "0.7 A 0.3 B", or a flat file with a declared
                    dtype. SIGTERM/SIGINT: every rank stops after the same step, saves, and exits.

Start-up checks run before any process group exists, so a wrong launch (a plan for 8 ranks started on 4, a
plan for another model) stops with one clear line instead of hanging in a collective. Rank 0 writes one JSON
object per step to --log: step, loss, step_time_s, tokens_per_s, peak_memory_gib, predicted_step_time_s
(plus predicted_memory_gib, memory_measured_step, rss_gib, grad_norm and lr). peak_memory_gib is tensor memory,
not the process RSS: the allocator's peak of each step on a GPU; on the CPU, MemTracker's peak of one step
(--memory-step, default 3) carried on the lines after it (null before). --profile-step N adds one
{"event": "profile", "step": N, "ranks": [{"rank", "pp_stage", "measured", "predicted"}]} record (measured with
autoplan.runtime.measure, predicted by autoplan.cost_models.counts) and prints it as a table. --time-from N adds,
for every step from N on (the profiled one excepted), one {"event": "timing", "step", "ranks": [{"rank",
"pp_stage", "step_s", "time_s", "cpu_s"}]} record: each rank's step time split by phase, FSDP work, the step tail
and the waits in collectives, and the CPU time its process used in the step (autoplan.runtime.timing; cheap: the
step runs at its normal speed). The process group is
destroyed on exit, error or not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from autoplan.cost_models.errors import AutoplanError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m autoplan.runtime.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True, help="plan.json made by `autoplan search|estimate -o`")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--data", default=None,
                    help="Megatron dataset PREFIX (.bin/.idx), a blend 'W1 PREFIX1 W2 PREFIX2', or a flat token file "
                         "(.u16/.i32, or --data-dtype)")
    ap.add_argument("--data-dtype", default=None, choices=["uint16", "int32"])
    ap.add_argument("--log", "--log-file", dest="log", default=None,
                    help="JSON-lines metrics file (rank 0). Under torchrun write --log-file, or put the training "
                         "arguments after `--`: torchrun itself rejects --log as an abbreviation of --log-dir")
    ap.add_argument("--tensorboard", default=None, metavar="DIR",
                    help="also write the log's metrics, measured MFU and timestamps to TensorBoard (rank 0)")
    ap.add_argument("--seed", type=int, default=0, help="weights and synthetic data")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=0, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--model", default=None,
                    help="the model you mean to train (preset or spec); refused if the plan was made for another")
    ap.add_argument("--save", default=None, metavar="DIR",
                    help="write a checkpoint to DIR/step_<n> at the end (and every --save-every steps)")
    ap.add_argument("--save-every", type=int, default=0, metavar="K", help="also checkpoint every K steps")
    ap.add_argument("--resume", default=None, metavar="DIR",
                    help="continue from a checkpoint (a step_<n> dir, or its parent with `latest`); any layout")
    ap.add_argument("--profile-step", type=int, default=0, metavar="N",
                    help="measure step N on every rank (FLOPs by phase, bytes per collective and mesh dimension, "
                         "memory by category) beside the cost model's prediction: one {\"event\": \"profile\"} "
                         "record in the log and a table on rank 0")
    ap.add_argument("--time-from", type=int, default=0, metavar="N",
                    help="split every step from N on (not the profiled one) into time components per rank "
                         "(compute by phase, waits in collectives by kind, FSDP, optimizer): one "
                         "{\"event\": \"timing\"} record per step in the log (what `autoplan tune` fits on)")
    ap.add_argument("--memory-step", type=int, default=None, metavar="N",
                    help="CPU: the step whose tensor-memory peak (MemTracker) the log lines carry (default: the "
                         "profiled step, else step 3, the first steady one, or the last of a shorter run); GPUs "
                         "measure every step")
    ap.add_argument("--keep-last", type=int, default=0, metavar="K",
                    help="keep only the K newest checkpoints in --save (never the newest complete one); 0 keeps all")
    ap.add_argument("--async-save", action="store_true",
                    help="write --save-every checkpoints from a background thread (torch.distributed.checkpoint."
                         "async_save): training stalls only for the copy to host memory. The last save is synchronous")
    ap.add_argument("--overwrite", action="store_true",
                    help="a new run (no --resume) into a --save DIR holding checkpoints deletes them first")
    ap.add_argument("--auto-resume", action="store_true",
                    help="resume from the newest checkpoint in --save that verifies (skipping broken ones), or "
                         "start fresh when there is none; `autoplan run --max-restarts N` passes it")
    ap.add_argument("--on-nonfinite", choices=["stop", "skip"], default="stop",
                    help="a NaN/inf loss or gradient norm: stop the run (default) or skip that step's update")
    ap.add_argument("--loss-spike-factor", type=float, default=None, metavar="F",
                    help="warn when a loss exceeds F times the mean of the previous 20")
    ap.add_argument("--collective-timeout", type=float, default=300.0, metavar="S",
                    help="seconds a collective may wait for a missing rank before the job ends (default 300)")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="start from a Hugging Face checkpoint (safetensors + config.json); the plan must be for "
                         "that config. Each rank reads only its slices. --resume takes precedence")
    ap.add_argument("--gc-every", type=int, default=50, metavar="K",
                    help="Python's cyclic garbage collector runs between steps, every K steps (generations 0-1), "
                         "instead of inside whichever step it lands in; 0 leaves it automatic")
    ap.add_argument("--quiet", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # torchrun ... -m autoplan.runtime.train -- --plan p.json --log f
        argv = argv[1:]
    return ap.parse_args(argv)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


_STARTUP_ERROR_GRACE_S = 10.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    # ---- checks that need no torch and no process group
    try:
        from autoplan.plan import load_plan

        from .parallel_dims import ParallelDims, check_model_matches

        plan = load_plan(args.plan)
        from autoplan.models import check_plan_model
        from autoplan.models.source import TRUSTED_MODULE_ENV, check_module_trusted, plan_module

        check_module_trusted(plan, os.environ.get(TRUSTED_MODULE_ENV),
                             f"launch it with `autoplan run PLAN --model {plan_module(plan)}` (which sets "
                             f"{TRUSTED_MODULE_ENV} for the workers) if you trust that code")
        check_plan_model(plan)  # the recorded architecture builds as planned (refuses unsupported fields)
        from .launch import check_dtype

        check_dtype(plan)  # also when the workers are started by hand, not by `autoplan run`
        if args.model:
            from autoplan.specs import load_model

            check_model_matches(plan, load_model(args.model))
        dims = ParallelDims.from_plan(plan, world)
        from .faults import prepare_save_dir, validate_training_args

        validate_training_args(args)
        if args.profile_step < 0 or args.profile_step > args.steps:
            raise AutoplanError("--profile-step must name a step of this run", f"got {args.profile_step} with "
                                f"--steps {args.steps}", f"pass --profile-step between 1 and {args.steps}")
        check_checkpoint_args(args, plan, rank)
        check_data_args(args, plan)
        lock = prepare_save_dir(args, plan, args.resume_path) if args.save and rank == 0 else None
        if args.steps < 1:
            raise AutoplanError("--steps must be >= 1", f"got {args.steps}", "pass --steps 10")
        if args.init_from:
            from .hf_init import check_init_from

            check_init_from(plan, args.init_from)
    except AutoplanError as e:
        if rank == 0:
            print(f"autoplan run: {type(e).__name__}: {e.one_line()}", file=sys.stderr, flush=True)
        else:
            # Every rank fails the same check; give rank 0 time to print the reason before torchrun, seeing
            # this rank exit, terminates the others (rank 0 may still be importing on a busy machine).
            time.sleep(_STARTUP_ERROR_GRACE_S)
        return 2
    try:
        return _run(args, plan, dims, rank, world)
    finally:
        if lock is not None:
            lock.release()


def check_checkpoint_args(args: argparse.Namespace, plan, rank: int = 0) -> None:
    """Start-up checks of --save/--resume/--auto-resume (every rank, before any process group): a bad checkpoint
    stops here (every file's size, the small files' sha256; the shards' sha256 are hashed by the ranks together
    once the process group exists: faults.agree_on_shards). Sets args.resume_path (the checkpoint to load, or
    None) and args.skipped_checkpoints."""
    if args.save_every < 0 or (args.save_every and not args.save):
        raise AutoplanError("--save-every needs --save DIR and K >= 1", f"got --save-every {args.save_every}",
                            "pass --save DIR --save-every K")
    if getattr(args, "async_save", False) and not args.save_every:
        raise AutoplanError("--async-save needs --save DIR --save-every K", "only the checkpoints taken during "
                            "training are written in the background (the last one is synchronous)",
                            "pass --save DIR --save-every K, or drop --async-save")
    from . import checkpoint
    from .faults import resolve_resume, warn_skipped

    args.resume_path, args.skipped_checkpoints = resolve_resume(args)
    warn_skipped(args.skipped_checkpoints, rank)
    if args.resume_path:
        meta = checkpoint.inspect(args.resume_path, shards=False)
        checkpoint.check_compatible(meta, plan)
        args.resume_path = meta["path"]


def check_data_args(args: argparse.Namespace, plan) -> None:
    """Open --data once before any process group: a missing, wrong-dtype, too-short or out-of-vocabulary file
    stops here with one line."""
    if args.data:
        from .indexed_data import open_dataset

        open_dataset(args.data, plan, dtype=args.data_dtype, seed=args.seed)


def _run(args, plan, dims, rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    use_cuda = plan.cluster.backend == "nccl" and torch.cuda.is_available()
    local = _env_int("LOCAL_RANK", 0)
    device = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dims.device_type = device.type
    backend = "nccl" if use_cuda else "gloo"
    from datetime import timedelta

    timeout = timedelta(seconds=args.collective_timeout)  # gloo's default is 30 minutes of silence
    args.store = None
    if "MASTER_ADDR" in os.environ:
        args.store = _attempt_store(world, timeout)
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if use_cuda else None,
                                timeout=timeout, store=args.store)
    else:  # plain `python -m autoplan.runtime.train` with a 1-rank plan
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        return train_loop(args, plan, dims, device)
    except AutoplanError as e:
        if rank == 0 or not getattr(e, "agreed", False):  # an agreed error is every rank's: said once
            print(f"[rank {rank}] autoplan run: {type(e).__name__}: {e.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"[rank {rank}] autoplan run: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # gloo: "Timed out waiting ...ms for recv operation" / a peer that closed
        if not _is_peer_failure(e):
            raise
        from .faults import Heartbeat

        hb = getattr(args, "heartbeat", None) or Heartbeat(None, rank)
        who = hb.missing(world)
        print(f"[rank {rank}] autoplan run: a collective did not complete within --collective-timeout "
              f"{args.collective_timeout:g} s: {who or 'another rank failed'} ({_first_line(e)[:120]}). fix: see "
              "that rank's own message; `autoplan run --max-restarts N` restarts the job from the last checkpoint",
              file=sys.stderr)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _attempt_store(world: int, timeout):
    """The process group's keys in a store of their own per torchrun attempt: torchrun shares its rendezvous
    TCPStore with the workers, and the previous attempt's gloo addresses left in it make the restarted ranks
    connect to dead peers (pytorch/pytorch#135712). The heartbeats (runtime.faults.Heartbeat) live there too."""
    import torch.distributed as dist

    from .faults import restart_count

    n = restart_count()
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout)
    return dist.PrefixStore(f"autoplan-attempt-{n}", base)


def _is_peer_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return any(k in text for k in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe"))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def train_loop(args: argparse.Namespace, plan, dims, device) -> int:
    """Build the mesh, the trainer and the data, resume, train to --steps, save. Needs a process group (every rank
    calls it); several calls may share one group (tests run many layouts in one launch)."""
    import torch
    import torch.distributed as dist

    from . import checkpoint, faults
    from .engine import Trainer, tokens_per_step
    from .measure import StepMemory, memory_step, profile_record
    from .timing import timing_record

    rank = dist.get_rank()
    log = tb = saver = collector = None
    stop = faults.StopFlag()
    try:
        dims.build_mesh()
        faults.agree_on_shards(args, rank, dist.get_world_size())
        # Dropout RNG: different across data/context/pipeline ranks (different tokens), the same across tp ranks
        # (their replicated activations must stay identical). Weights do not use it (init is by name). Seeded
        # again at every step when the model has dropout, so a resumed run draws the masks an uninterrupted one
        # would (same layout); without dropout nothing draws from it and the step is not seeded.
        rng_seed = args.seed + 1_000_003 * (dims.rank("dp") * dims.cp + dims.rank("cp")) + 7_919 * dims.rank("pp")
        trainer = Trainer(plan, dims, device=device, seed=args.seed, lr=args.lr,
                          weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                          init_from=None if getattr(args, "resume_path", args.resume) else args.init_from,
                          stop_flag=stop)
        data, data_desc = _open_data(args, plan)
        start = 0
        resume_path = getattr(args, "resume_path", args.resume)
        if resume_path:
            meta = checkpoint.load(trainer, resume_path)
            start = meta["step"]
            if rank == 0 and not args.quiet:
                print(f"resumed from {meta['path']} at step {start} (saved with {meta.get('layout')}, plan "
                      f"{meta.get('plan_hash')})", flush=True)
                saved = {k: v for k, v in meta.get("data", {}).items() if k in data_desc}
                if saved != data_desc:
                    print(f"note: the checkpoint was trained on {saved}, this run reads {data_desc}", flush=True)
        if rank == 0:
            log = _open_log_and_record_restart(args, start, resume_path)
        if rank == 0 and args.tensorboard:
            from .tensorboard_log import TensorBoardLog

            tb = TensorBoardLog(args.tensorboard, plan)
        if rank == 0 and not args.quiet:
            print(f"plan {plan.short_hash}: {plan.model.name}, {plan.parallel.to_string()}, {dims.describe()}, "
                  f"{trainer.n_micro} micro-batches of {trainer.mbs}, {device.type}", flush=True)
            if start >= args.steps:
                print(f"checkpoint is at step {start}, --steps is {args.steps}: nothing to train", flush=True)
        n_params = trainer_parameter_count(trainer)  # the whole model's, summed over the pipeline stages
        predicted = plan.prediction.step_time_s
        # this rank's pipeline stage: the memory the plan predicts for it (on a GPU, compare with the allocator's
        # peak; on the CPU the measured figure is the process's RSS, interpreter and libraries included)
        predicted_mem = plan.prediction.memory_gib["per_stage"][dims.rank("pp")]
        mem = StepMemory(device, args.memory_step or args.profile_step or min(3, args.steps))
        spikes = faults.SpikeDetector(args.loss_spike_factor)
        heartbeat = args.heartbeat = faults.Heartbeat.for_job(rank) if dims.world_size > 1 else \
            faults.Heartbeat(None, rank)
        stop.install()
        # Per-step work outside the step is kept to what a plain script does: the RNG is re-seeded only when
        # the model draws from it (dropout), the learning rate is written only when warm-up changes it, and the
        # metrics (memory, JSON) are made on rank 0 only.
        saver = checkpoint.AsyncSaver() if getattr(args, "async_save", False) else None
        reseed = plan.model.dropout > 0
        lr = args.lr
        _set_lr(trainer.optimizer, lr)
        collector = GarbageCollection(getattr(args, "gc_every", 0))
        summary = RunSummary(plan, dims.rank("pp"), args.plan)
        for step in range(start, args.steps):
            collector.between_steps(step - start)
            if reseed:
                torch.manual_seed((rng_seed * 1_000_033 + step) % (2**63))
            if args.warmup and step < args.warmup:
                lr = args.lr * (step + 1) / args.warmup
                _set_lr(trainer.optimizer, lr)
            mem.before(step + 1)
            profile = None
            if step + 1 == args.profile_step:
                res, profile = profile_record(trainer, step + 1, data.batch(step))
                if profile:  # rank 0, the rank that writes the log
                    mem.record(step + 1, _my_peak(profile, rank))
            elif mem.wants(step + 1):
                res, m = memory_step(trainer, data.batch(step))
                mem.record(step + 1, m["peak"])
            elif getattr(args, "time_from", 0) and step + 1 >= args.time_from:
                res, profile = timing_record(trainer, step + 1, data.batch(step))
            else:
                res = trainer.step(data.batch(step))
            nonfinite = faults.check_finite(res.loss, res.grad_norm, step + 1, args.on_nonfinite)  # every rank
            if rank == 0:
                rec = {
                    "step": step + 1,
                    "loss": res.loss,
                    "step_time_s": res.step_time_s,
                    "tokens_per_s": tokens_per_step(plan) / res.step_time_s,
                    **mem.fields(step + 1),  # tensor peak (not RSS): peak_memory_gib, memory_measured_step, rss_gib
                    "predicted_step_time_s": predicted,
                    "predicted_memory_gib": predicted_mem,
                    "grad_norm": res.grad_norm,
                    "parameters_trained": n_params,
                    "lr": lr,
                    "time": time.time(),
                }
                if nonfinite:
                    rec["skipped"] = nonfinite
                summary.add(rec)
                _report_step(args, log, rec, predicted, spikes, profile)
                if tb:
                    tb.write(rec)
            if saver is not None and step == start and trainer.optimizer.state:
                saver.prepare(trainer)  # the host copy for --async-save, filled in the background
            heartbeat.beat(step + 1)
            faults.maybe_inject_fault(rank, step + 1)
            signum = res.stop_signal  # agreed by every rank in the step's loss all-reduce
            last = step + 1 == args.steps or signum is not None
            if args.save and ((args.save_every and (step + 1) % args.save_every == 0) or last):
                if saver is not None and not last:
                    _report_saved(args, rank, saver.wait())
                    saver.start(trainer, args.save, step + 1, data=data_desc, keep_last=args.keep_last)
                else:
                    if saver is not None:
                        _report_saved(args, rank, saver.wait())
                    path = checkpoint.save(trainer, args.save, step + 1, data=data_desc, keep_last=args.keep_last)
                    _report_saved(args, rank, path)
            if signum is not None:
                if rank == 0:
                    _print_stopped(args, signum, step + 1)
                break
        if rank == 0 and not args.quiet:
            for line in summary.lines():
                print(line, flush=True)
        return 0
    finally:
        if collector is not None:
            collector.close()
        stop.restore()
        if saver is not None:
            saver.close()
        if getattr(args, "heartbeat", None) is not None:
            args.heartbeat.close()
        if log:
            log.close()
        if tb:
            tb.close()


class GarbageCollection:
    """Python's cyclic garbage collector between steps instead of inside them.

    Left automatic, it runs whenever container allocations outnumber deallocations by 700 (generation 0; FSDP2's
    hooks allocate thousands per step), and a full collection walks every object the process holds -- about 325k
    after importing torch and building a tiny model, 0.6 s measured on this machine, landing inside one step. With
    many ranks a pause on one rank stalls every collective it takes part in. So during training the collector is
    off and generations 0 and 1 are collected every `every` steps, between steps (torchtitan's `gc_freq` does the
    same). Garbage piles up between collections only where torch makes cycles: measured per step on tiny models,
    none under DDP/FSDP/cp/ep, ~150 small objects under pipelining and 1.8k (tp) to 5.5k (tp+sp) under DTensor
    TP (closures and tuples of its dispatch, no tensors): at K=50 a few tens of MB of host memory at most. The
    collector's state is restored at the end (tests run several trainings in one process)."""

    def __init__(self, every: int) -> None:
        import gc

        self.every = every
        self.was_enabled = gc.isenabled()
        if every > 0:
            gc.collect(1)
            gc.disable()

    def between_steps(self, steps_done: int) -> None:
        if self.every > 0 and steps_done > 0 and steps_done % self.every == 0:
            import gc

            gc.collect(1)

    def close(self) -> None:
        import gc

        if self.every > 0 and self.was_enabled:
            gc.enable()


def _size(gib: float) -> str:
    """A tensor size as read at a glance: MiB below 1 GiB (a small model's 0.007 GiB hides a 20% miss)."""
    return f"{gib * 1024:.1f} MiB" if abs(gib) < 1 else f"{gib:.2f} GiB"


class RunSummary:
    """Rank 0's closing lines: the steady step time against the plan's prediction, the tensor-memory peak against
    this stage's predicted tensors, the loss; and, when the time is far from the prediction, which command makes
    the cluster spec describe this machine (the run lines alone show a ratio on every step and say nothing)."""

    # outside this band of measured/predicted the spec, not noise, is the likely cause: launches of one plan differ
    # by 10-30% on a shared host (what `autoplan tune` measures of repeated launches) and small steps more (the
    # demo's 20 ms steps: measured/predicted 0.79-1.02 between launches)
    BAND = (2 / 3, 1.5)

    def __init__(self, plan, stage: int, plan_path: str = "plan.json") -> None:
        self.plan = plan
        self.stage = stage
        self.plan_path = plan_path
        self.rows: list[dict] = []

    def add(self, rec: dict) -> None:
        self.rows.append(rec)

    def lines(self) -> list[str]:
        import statistics

        if not self.rows:
            return []
        plan, rows = self.plan, self.rows
        steady = rows[1:] or rows  # the first step of a launch builds buffers, optimizer state and caches
        measured = statistics.median(r["step_time_s"] for r in steady)
        predicted = plan.prediction.step_time_s
        ratio = measured / predicted if predicted > 0 else float("nan")
        span = f"steps {steady[0]['step']}-{steady[-1]['step']}" if len(steady) > 1 else f"step {steady[0]['step']}"
        out = [f"done: {rows[-1]['step']} steps; step time {measured * 1e3:.1f} ms (median of {span}) = "
               f"{ratio:.2f} x the predicted {predicted * 1e3:.1f} ms; loss {rows[0]['loss']:.4f} -> "
               f"{rows[-1]['loss']:.4f}"]
        peak, at = rows[-1].get("peak_memory_gib"), rows[-1].get("memory_measured_step")
        if peak is not None:
            overhead = plan.cluster.gpu.calibration.framework_overhead_gib
            tensors = plan.prediction.memory_gib["per_stage"][self.stage] - overhead
            share = f" = {peak / tensors:.2f} x the" if tensors > 0 else " against"
            out.append(f"tensor memory {_size(peak)} (step {at}){share} {_size(tensors)} predicted for stage "
                       f"{self.stage} ({overhead:g} GiB of framework overhead priced beside it)")
        lo, hi = self.BAND
        if not lo <= ratio <= hi:
            how = "slower" if ratio > 1 else "faster"
            out.append(f"note: this machine runs the plan {max(ratio, 1 / ratio):.1f}x {how} than cluster spec "
                       f"'{plan.cluster.name}' prices it. `autoplan tune --plan {self.plan_path} --cluster-out "
                       "tuned.yaml` runs a few layouts and refits the spec to what they measure (`autoplan "
                       "calibrate -o mine.yaml`: micro-benchmarks only); plan with --cluster tuned.yaml")
        return out


def _my_peak(profile: dict, rank: int) -> float:
    return next(r["measured"]["memory_bytes"]["peak"] for r in profile["ranks"] if r["rank"] == rank)


def _open_data(args: argparse.Namespace, plan):
    """The dataset (--data: flat tokens, Megatron .bin/.idx or a weighted blend; else synthetic) and its record."""
    from .data import SyntheticDataset

    t = plan.training
    if args.data:
        from .indexed_data import open_dataset

        data = open_dataset(args.data, plan, dtype=args.data_dtype, seed=args.seed)
        return data, data.describe()
    return (SyntheticDataset(plan.model.vocab_size, t.seq_length, t.global_batch_size, seed=args.seed),
            {"kind": "synthetic", "seed": args.seed})


def _open_log_and_record_restart(args: argparse.Namespace, start: int, resume_path: str | None):
    """Rank 0: the log rewritten up to the resumed step, with a restart row when torchrun restarted us."""
    from . import faults

    event = faults.restart_event(start, resume_path, getattr(args, "skipped_checkpoints", []), args.log)
    if event and not args.quiet:
        print(f"restart {event['restart']}: resuming at step {start} from {resume_path or 'the start'} "
              f"({event['steps_redone']} logged steps will be redone)", flush=True)
    if not args.log:
        return None
    log = faults.open_log(args.log, start)
    if event:
        log.write(json.dumps(event) + "\n")
        log.flush()
    return log


def _report_step(args: argparse.Namespace, log, rec: dict, predicted: float, spikes, profile: dict | None) -> None:
    if log and profile:
        log.write(json.dumps(profile) + "\n")
    if profile and profile.get("event") == "profile" and not args.quiet:
        from .measure import render_profile

        render_profile(profile)
    if log:
        log.write(json.dumps(rec) + "\n")
        log.flush()
    if "skipped" in rec:
        print(f"step {rec['step']}: skipped, not finite ({rec['skipped']}); the update was not applied",
              file=sys.stderr, flush=True)
    mean = spikes.check(rec["loss"])
    if mean is not None:
        print(f"warning: loss spike at step {rec['step']}: {rec['loss']:.4f} > {args.loss_spike_factor:g} x "
              f"recent mean {mean:.4f}", file=sys.stderr, flush=True)
    if not args.quiet:
        print(f"step {rec['step']:4d}  loss {rec['loss']:.4f}  {rec['step_time_s'] * 1e3:8.1f} ms "
              f"(predicted {predicted * 1e3:.1f} ms)  {rec['tokens_per_s']:.0f} tok/s", flush=True)


def _report_saved(args: argparse.Namespace, rank: int, path) -> None:
    if path is not None and rank == 0 and not args.quiet:
        print(f"saved {path}", flush=True)


def _print_stopped(args: argparse.Namespace, signum: int, step: int) -> None:
    import shlex
    import signal

    name = signal.Signals(signum).name
    if args.save:
        how = (f"checkpoint {Path(args.save) / f'step_{step}'} saved; resume with the same command plus "
               f"--resume {shlex.quote(str(args.save))}")
    else:
        how = "nothing saved (no --save DIR); pass --save DIR to make a run resumable"
    print(f"autoplan run: stopped by {name} after step {step}: {how}", file=sys.stderr, flush=True)


def trainer_parameter_count(trainer) -> int:
    """Parameters of the whole model being trained (global shapes, tied weights once), summed over pipeline
    stages: what the capture counts for the same model."""
    import torch.distributed as dist

    local = sum(p.numel() for _, p in trainer.pm.named_parameters() if not _tied_copy(trainer, _))
    dims = trainer.dims
    if not dims.pp_enabled:
        return local
    import torch

    t = torch.tensor([local], dtype=torch.int64)
    group = dims["pp"].get_group()
    dist.all_reduce(t, group=group)
    return int(t.item())


def _tied_copy(trainer, name: str) -> bool:
    """A pipeline's second copy of a tied LM head (the first stage holds the embedding it mirrors)."""
    from autoplan.models import layout_spec

    return (name == "output.weight" and layout_spec(trainer.plan).tie_embeddings
            and not any(s.plan.has_embedding for s in trainer.pm.stages))


def _set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def exit_process(rc: int) -> NoReturn:
    """Leave a torch.distributed worker with `rc`, skipping the interpreter's finalisation.

    Why: a gloo worker thread releases its reference to a finished collective (and so to the Python tensors the
    collective used) a moment after the caller's wait() returns. If that release lands while the interpreter is
    finalising, taking the GIL ends the thread with a forced unwind through a noexcept destructor, and the process
    dies with "terminate called without an active exception" (SIGABRT) after a run that succeeded: 1 in ~15-30
    two-process runs on this CI machine (core dump: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork ->
    decref_pyobject -> PyEval_AcquireThread during Py_FinalizeEx). Everything this process writes is closed or
    flushed by now, so os._exit loses nothing.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    exit_process(main())
