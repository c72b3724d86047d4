"""Parity worker, run under torchrun by tests/dist/test_parity.py: many layouts in one launch.

For each case (model, parallel configuration) it makes a Plan with the planner's API (`make_plan` with the
configuration fixed), trains 10 steps with the runtime's Trainer and compares, on rank 0, the losses of every
step and the gradients of the first step (after clipping, before the update) with an independent
single-process reference: the zoo model, the full global batch at once, torch's clip_grad_norm_ and AdamW.

    torchrun --nproc-per-node 2 tests/dist/parity_worker.py --out results.json CASE [CASE ...]
    CASE = model:config[|fused], e.g. tiny-gpt:tp=2,sp=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.distributed.tensor import DTensor  # noqa: E402

from autoplan.api import make_plan  # noqa: E402
from autoplan.specs import TrainingSpec, load_cluster, load_model  # noqa: E402
from autoplan.zoo import build_model, cross_entropy_loss  # noqa: E402
from autoplan.runtime.data import SyntheticDataset  # noqa: E402
from autoplan.runtime.engine import Trainer  # noqa: E402
from autoplan.runtime.parallel_dims import ParallelDims  # noqa: E402
from benchmarks.counts import case_parts  # noqa: E402
from tests.dist.worker_loop import compare_with_reference, reference_run, worker_main  # noqa: E402

STEPS, GBS, SEQ, LR, WD, BETAS, CLIP, SEED = 10, 4, 64, 1e-3, 0.1, (0.9, 0.95), 0.5, 0


def spec_of(name: str):
    # Dropout draws layout-dependent random masks: parity is defined without it.
    return load_model(name).model_copy(update={"dropout": 0.0})


def training(gbs: int = GBS, **knobs: str) -> TrainingSpec:
    return TrainingSpec(global_batch_size=gbs, seq_length=SEQ, dtype="fp32", **knobs)


def reference(name: str, gbs: int = GBS) -> tuple[list[float], dict[str, torch.Tensor]]:
    spec = spec_of(name)
    return reference_run(build_model(spec, seed=SEED), spec.vocab_size, steps=STEPS, gbs=gbs, seq=SEQ, lr=LR,
                         betas=BETAS, weight_decay=WD, clip=CLIP, seed=SEED)


def full_grads(pm, tied: bool) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in pm.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if tied and n == "output.weight":
            n = "tok_embeddings.weight"
        out[n] = g.detach().clone()
    return out


def run_case(case: str, world: int, refs: dict) -> dict:
    layout_case, _, kernels = case.partition("|")  # "model:config|fused" runs with the fused-kernel substitution
    name, config, gbs, knobs = case_parts(layout_case, GBS)  # "model:config@gbs=N@knob=v" (benchmarks/counts.py)
    rank = dist.get_rank()
    t0 = time.perf_counter()
    spec = spec_of(name)
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(world), training(gbs, **knobs), config,
                     kernels=kernels or "torch")
    dims = ParallelDims.from_plan(plan, world).build_mesh()
    trainer = Trainer(plan, dims, device=torch.device("cpu"), seed=SEED, lr=LR, weight_decay=WD, betas=BETAS,
                      max_grad_norm=CLIP)
    captured: dict = {}

    def hook(pm):
        if not captured:
            captured.update(full_grads(pm, spec.tie_embeddings))

    trainer.last_grads_hook = hook
    data = SyntheticDataset(spec.vocab_size, SEQ, gbs, seed=SEED)
    losses = [trainer.step(data.batch(s)).loss for s in range(STEPS)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, captured)
    fused = sum(type(m).__name__.startswith("Fused") for mod in trainer.pm.modules for m in mod.modules())
    result = {"case": case, "plan": plan.short_hash, "seconds": 0.0, "fused_modules": fused}
    if rank == 0:
        if (name, gbs) not in refs:
            refs[name, gbs] = reference(name, gbs)
        ref_losses, ref_grads = refs[name, gbs]
        result.update(compare_with_reference(gathered, losses, ref_losses, ref_grads))
    result["seconds"] = time.perf_counter() - t0
    return result


def main() -> int:
    refs: dict = {}
    return worker_main(lambda world, rank: lambda case: run_case(case, world, refs))

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from autoplan.runtime.train import exit_process

    exit_process(main())
