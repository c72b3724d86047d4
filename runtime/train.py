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

Start-up checks run before any process group exists, so a wrong launch (a plan for 8 ranks started on 4, a
plan for another model) stops with one clear line instead of hanging in a collective. Rank 0 writes one JSON
object per step to --log: step, loss, step_time_s, tokens_per_s, peak_memory_gib, predicted_step_time_s
(plus grad_norm and lr). The process group is destroyed on exit, error or not.
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
    ap.add_argument("--data", default=None, help="flat binary token file (uint16, or int32 with --data-dtype)")
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
        if args.model:
            from autoplan.specs import load_model

            check_model_matches(plan, load_model(args.model))
        dims = ParallelDims.from_plan(plan, world)
        if args.steps < 1:
            raise AutoplanError("--steps must be >= 1", f"got {args.steps}", "pass --steps 10")
        check_checkpoint_args(args, plan)
    except AutoplanError as e:
        if rank == 0:
            print(f"autoplan run: {type(e).__name__}: {e.one_line()}", file=sys.stderr, flush=True)
        else:
            # Every rank fails the same check; give rank 0 time to print the reason before torchrun, seeing
            # this rank exit, terminates the others (rank 0 may still be importing on a busy machine).
            time.sleep(_STARTUP_ERROR_GRACE_S)
        return 2
    return _run(args, plan, dims, rank, world)


def check_checkpoint_args(args: argparse.Namespace, plan) -> None:
    """Start-up checks of --save/--resume (every rank, before any process group): a bad checkpoint stops here."""
    if args.save_every < 0 or (args.save_every and not args.save):
        raise AutoplanError("--save-every needs --save DIR and K >= 1", f"got --save-every {args.save_every}",
                            "pass --save DIR --save-every K")
    if args.resume:
        from . import checkpoint

        checkpoint.check_compatible(checkpoint.inspect(args.resume), plan)


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
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if use_cuda else None)
    else:  # plain `python -m autoplan.runtime.train` with a 1-rank plan
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return train_loop(args, plan, dims, device)
    except AutoplanError as e:
        print(f"[rank {rank}] autoplan run: {type(e).__name__}: {e.one_line()}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train_loop(args: argparse.Namespace, plan, dims, device) -> int:
    """Build the mesh, the trainer and the data, resume, train to --steps, save. Needs a process group (every rank
    calls it); several calls may share one group (tests run many layouts in one launch)."""
    import torch
    import torch.distributed as dist

    from . import checkpoint
    from .data import MemmapTokenDataset, SyntheticDataset
    from .engine import Trainer, peak_memory_gib, tokens_per_step

    rank = dist.get_rank()
    log = tb = None
    try:
        dims.build_mesh()
        # Dropout RNG: different across data/context/pipeline ranks (different tokens), the same across tp ranks
        # (their replicated activations must stay identical). Weights do not use it (init is by name). Seeded
        # again at every step, so a resumed run draws the masks an uninterrupted one would (same layout).
        rng_seed = args.seed + 1_000_003 * (dims.rank("dp") * dims.cp + dims.rank("cp")) + 7_919 * dims.rank("pp")
        trainer = Trainer(plan, dims, device=device, seed=args.seed, lr=args.lr,
                          weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm)
        t = plan.training
        if args.data:
            data = MemmapTokenDataset(args.data, t.seq_length, t.global_batch_size, plan.model.vocab_size,
                                      dtype=args.data_dtype)
            data_desc = {"kind": "memmap", "path": str(Path(args.data).resolve()), "dtype": args.data_dtype}
        else:
            data = SyntheticDataset(plan.model.vocab_size, t.seq_length, t.global_batch_size, seed=args.seed)
            data_desc = {"kind": "synthetic", "seed": args.seed}
        start = 0
        if args.resume:
            meta = checkpoint.load(trainer, args.resume)
            start = meta["step"]
            if rank == 0 and not args.quiet:
                print(f"resumed from {meta['path']} at step {start} (saved with {meta.get('layout')}, plan "
                      f"{meta.get('plan_hash')})", flush=True)
                saved = {k: v for k, v in meta.get("data", {}).items() if k in data_desc}
                if saved != data_desc:
                    print(f"note: the checkpoint was trained on {saved}, this run reads {data_desc}", flush=True)
        if rank == 0 and args.log:
            Path(args.log).parent.mkdir(parents=True, exist_ok=True)
            log = open(args.log, "a" if args.resume else "w")  # noqa: SIM115 (closed in finally)
        if rank == 0 and args.tensorboard:
            from .tensorboard_log import TensorBoardLog

            tb = TensorBoardLog(args.tensorboard, plan)
        if rank == 0 and not args.quiet:
            print(f"plan {plan.short_hash}: {plan.model.name}, {plan.parallel.to_string()}, {dims.describe()}, "
                  f"{trainer.n_micro} micro-batches of {trainer.mbs}, {device.type}", flush=True)
            if start >= args.steps:
                print(f"checkpoint is at step {start}, --steps is {args.steps}: nothing to train", flush=True)
        predicted = plan.prediction.step_time_s
        # this rank's pipeline stage: the memory the plan predicts for it (on a GPU, compare with the allocator's
        # peak; on the CPU the measured figure is the process's RSS, interpreter and libraries included)
        predicted_mem = plan.prediction.memory_gib["per_stage"][dims.rank("pp")]
        for step in range(start, args.steps):
            torch.manual_seed((rng_seed * 1_000_033 + step) % (2**63))
            lr = args.lr * min(1.0, (step + 1) / args.warmup) if args.warmup else args.lr
            for group in trainer.optimizer.param_groups:
                group["lr"] = lr
            res = trainer.step(data.batch(step))
            rec = {
                "step": step + 1,
                "loss": res.loss,
                "step_time_s": res.step_time_s,
                "tokens_per_s": tokens_per_step(plan) / res.step_time_s,
                "peak_memory_gib": peak_memory_gib(device),
                "predicted_step_time_s": predicted,
                "predicted_memory_gib": predicted_mem,
                "grad_norm": res.grad_norm,
                "lr": lr,
            }
            if rank == 0:
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                if tb:
                    tb.write(rec)
                if not args.quiet:
                    print(f"step {step + 1:4d}  loss {res.loss:.4f}  {res.step_time_s * 1e3:8.1f} ms "
                          f"(predicted {predicted * 1e3:.1f} ms)  {rec['tokens_per_s']:.0f} tok/s", flush=True)
            if args.save and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
                path = checkpoint.save(trainer, args.save, step + 1, data=data_desc)
                if rank == 0 and not args.quiet:
                    print(f"saved {path}", flush=True)
        return 0
    finally:
        if log:
            log.close()
        if tb:
            tb.close()


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
