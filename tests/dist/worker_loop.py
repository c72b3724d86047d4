"""The body every parity worker shares under torchrun: run each case on every rank, keep going past a failed
case only when the ranks are still in step (they are not after an exception: stop), print one line per case on
rank 0 and write the results there as JSON. The workers (tests/dist/parity_worker.py, tests/models/*_worker.py)
supply only how one case runs."""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def worker_main(make_runner: Callable[[int, int], Callable[[str], dict]],
                describe: Callable[[dict], str] = lambda r: "") -> int:
    """`make_runner(world, rank)` returns the function that runs one case (its result dict has "ok", "seconds"
    and, for the summary line, "max_loss_rel_err" / "max_grad_rel_err"); `describe` adds to that line."""
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # a hung collective (session 19 once; session 24 once, in make test, the 2-process parity launch) is stopped
    # by launch_workers after LAUNCH_TIMEOUT_S: shortly before, every rank writes its threads' stacks to stderr,
    # which the failure message carries, so the next one says where it hung
    faulthandler.dump_traceback_later(LAUNCH_TIMEOUT_S - 20, exit=False)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results: list[dict] = []
    try:
        run = make_runner(world, rank)
        for case in args.cases:
            try:
                r = run(case)
            except Exception as e:  # one broken layout must not hide the others
                r = {"case": case, "ok": False, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()[-3000:]}
                print(f"[rank {rank}] {case}: {r['error']}", file=sys.stderr, flush=True)
                results.append(r)
                break  # ranks may now be out of step; stop here, the test reports the rest as not run
            results.append(r)
            if rank == 0:
                print(f"{case}: ok={r.get('ok')} loss_err={r.get('max_loss_rel_err')} "
                      f"grad_err={r.get('max_grad_rel_err')}{describe(r)} ({r['seconds']:.1f}s)", flush=True)
        if rank == 0:
            Path(args.out).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------ what every parity case checks

RTOL = 1e-5  # fp32: losses, gradients and replicas of one gradient agree to this (relative)
GRAD_FLOOR = 1e-3  # relative errors are taken against max(|ref grad|, 1e-3 * largest gradient entry)


def rel_err(a, b, floor: float = 0.0) -> float:
    """max |a - b| relative to max |b|; `floor` keeps mathematically-zero gradients (e.g. the key bias, which
    softmax cancels) from turning rounding noise into a huge relative error."""
    return float((a - b).abs().max() / max(float(b.abs().max()), floor, 1e-30))


def compare_with_reference(gathered: list[dict], losses: list[float], ref_losses: list[float],
                           ref_grads: dict) -> dict:
    """The parity verdict of one case (rank 0): every rank's full first-step gradients (`gathered`, name ->
    tensor; replicas must agree) and the run's losses against the single-process reference."""
    merged, replica_err = {}, 0.0
    for d in gathered:
        for n, g in d.items():
            if n in merged:  # replicas (dp, tp-replicated weights, tied copies) must agree
                replica_err = max(replica_err, rel_err(g, merged[n]))
            else:
                merged[n] = g
    missing, extra = sorted(set(ref_grads) - set(merged)), sorted(set(merged) - set(ref_grads))
    floor = GRAD_FLOOR * max(float(g.abs().max()) for g in ref_grads.values())
    grad_errs = {n: rel_err(merged[n], ref_grads[n], floor) for n in ref_grads if n in merged}
    worst = max(grad_errs, key=grad_errs.get) if grad_errs else None
    loss_errs = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)]
    ok = (not missing and not extra and worst is not None and max(loss_errs) <= RTOL
          and grad_errs[worst] <= RTOL and replica_err <= RTOL)
    return {"losses": losses, "ref_losses": ref_losses, "max_loss_rel_err": max(loss_errs),
            "max_grad_rel_err": grad_errs[worst] if worst else None, "worst_grad": worst,
            "replica_rel_err": replica_err, "missing": missing, "extra": extra, "ok": ok}


def reference_run(model, vocab: int, *, steps: int, gbs: int, seq: int, lr: float, betas, weight_decay: float,
                  clip: float, seed: int, forward: Callable | None = None) -> tuple[list[float], dict]:
    """One process, plain PyTorch: AdamW, clip_grad_norm_, the runtime's synthetic data. (losses per step, the
    first step's clipped gradients by parameter name). `forward(token_ids) -> logits` where calling the model
    does not return the logits (a Hugging Face model returns an output object)."""
    import torch

    from autoplan.runtime.data import SyntheticDataset
    from autoplan.zoo import cross_entropy_loss

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)
    data = SyntheticDataset(vocab, seq, gbs, seed=seed)
    losses, grads = [], {}
    for step in range(steps):
        b = data.batch(step)
        opt.zero_grad()
        loss = cross_entropy_loss((forward or model)(b[:, :-1]), b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads


# ------------------------------------------------------------------------------------------ the test side


LAUNCH_TIMEOUT_S = 420  # seconds; well above any batch of this suite alone on the 2-core CI machine


def launch_workers(worker: Path, nproc: int, cases: list[str], out: Path, root: Path) -> dict[str, dict]:
    """Run `worker` under torchrun on `nproc` gloo processes for `cases`; {case: result} (pytest.fail with the
    launch's stderr when no result file was written)."""
    import os
    import subprocess

    import pytest

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), str(worker), "--out", str(out), *cases]
    # a session of its own, stopped as tune stops a launch on a timeout: a hung gloo collective (seen once, session
    # 19) otherwise leaves the workers spinning after torchrun is killed, slowing every later test on 2 cores
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        from autoplan.tune.core import stop_launch

        stop_launch(proc)
        stdout, stderr = proc.communicate()
        done = [line.rsplit(": ok=", 1)[0] for line in stdout.splitlines() if ": ok=" in line]
        running = next((c for c in cases if c not in done), "none")
        pytest.fail(f"{worker.name} launch with {nproc} processes ({' '.join(cases)}) hung for "
                    f"{LAUNCH_TIMEOUT_S} s in case {running} ({len(done)} done); it was stopped, its workers with "
                    f"it. The ranks' stacks and stderr:\n{stderr[-8000:]}")
    if not out.exists():
        pytest.fail(f"{worker.name} launch with {nproc} processes failed (rc {proc.returncode}):\n"
                    f"{stderr[-4000:]}")
    results = {r["case"]: r for r in json.loads(out.read_text())}
    # rank 0 writes the results: a case another rank broke shows there only as its collective's reset, so the
    # other ranks' own lines ("[rank N] case: error") go with every failed case (a gloo "Connection reset by peer"
    # in tiny-moe:tp=2,sp=1 was seen once, session 37, without them)
    others = [line for line in stderr.splitlines() if line.startswith("[rank ") and not line.startswith("[rank 0]")]
    for r in results.values():
        if "error" in r and others:
            r["other_ranks"] = "\n".join(others[-20:])
    return results


def assert_parity(results: dict, case: str, against: str = "one process") -> dict:
    """The case ran, no parameter is missing or extra, and losses, gradients and replicas agree within RTOL."""
    import pytest

    r = results.get(case)
    if r is None:
        pytest.fail(f"{case} did not run (an earlier layout of the same launch failed)")
    assert "error" not in r, f"{case}: {r['error']}\n{r.get('traceback', '')}\n{r.get('other_ranks', '')}"
    assert not r["missing"] and not r["extra"], f"{case}: parameters missing {r['missing']} extra {r['extra']}"
    assert r["max_loss_rel_err"] <= RTOL, f"{case}: losses {r['losses']} vs {against} {r['ref_losses']}"
    assert r["max_grad_rel_err"] <= RTOL, f"{case}: gradient {r['worst_grad']} off by {r['max_grad_rel_err']:.2e}"
    assert r["replica_rel_err"] <= RTOL, f"{case}: replicas disagree by {r['replica_rel_err']:.2e}"
    return r


def capture_first_grads(trainer, rename: Callable[[str], str] = lambda n: n) -> dict:
    """Install a hook on `trainer` that keeps the first step's clipped gradients, whole (DTensors gathered), by
    parameter name (`rename` maps the runtime's name to the reference's); returns the dict it fills."""
    from torch.distributed.tensor import DTensor

    captured: dict = {}

    def hook(pm):
        if captured:
            return
        for n, p in pm.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                captured[rename(n)] = g.clone()

    trainer.last_grads_hook = hook
    return captured
