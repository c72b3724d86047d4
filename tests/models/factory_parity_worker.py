"""Sharded runs of a user's own module (`module:factory`) against the same module in one process, under torchrun.

For each case (factory reference, parallel configuration) the plan is made with the planner's API from the
module's capture and checked as `autoplan run` checks it (check_plan_model); the runtime's Trainer builds the
sharded module (tensor parallelism on the captured column/row linears, pipeline cuts at the captured blocks,
recomputation, FSDP) and trains 3 steps. Rank 0 compares the losses of every step and the gradients of the first
step (after clipping; the second step runs under the run's memory tracker) with the factory's module trained on the full batch by torch's AdamW in one process, and
records the parameter count the run log would report next to the capture's.

    torchrun --nproc-per-node 2 tests/models/factory_parity_worker.py --out results.json CONFIG ...
    CONFIG = [ref@]layout, e.g. tp=2 or tests/capture/_models.py:split_lm@pp=2
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from autoplan.api import make_plan  # noqa: E402
from autoplan.models import check_plan_model  # noqa: E402
from autoplan.models.factory import build_factory, factory_structure  # noqa: E402
from autoplan.models.source import attach  # noqa: E402
from autoplan.runtime.data import SyntheticDataset  # noqa: E402
from autoplan.runtime.engine import Trainer  # noqa: E402
from autoplan.runtime.measure import memory_step, profile_record  # noqa: E402
from autoplan.runtime.parallel_dims import ParallelDims  # noqa: E402
from autoplan.runtime.train import trainer_parameter_count  # noqa: E402
from autoplan.specs import TrainingSpec, load_cluster  # noqa: E402
from autoplan.tune.records import parse_profile_record  # noqa: E402
from autoplan.workload import resolve_model  # noqa: E402
from tests.dist.worker_loop import capture_first_grads, compare_with_reference, reference_run, worker_main  # noqa: E402

REF = "tests/capture/_models.py:split_lm"
STEPS, GBS, SEQ, LR, WD, BETAS, CLIP, SEED = 3, 4, 16, 1e-3, 0.1, (0.9, 0.95), 0.5, 0


def reference(ref: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_factory(ref, seed=SEED)
    vocab = model(torch.zeros(1, 1, dtype=torch.long)).shape[-1]
    return reference_run(model, vocab, steps=STEPS, gbs=GBS, seq=SEQ, lr=LR, betas=BETAS, weight_decay=WD,
                         clip=CLIP, seed=SEED)


def _tp_sharded(p) -> bool:
    """A parameter split over the tp mesh dimension (FSDP's dp shards do not count)."""
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" in names and p.placements[names.index("tp")].is_shard()


def run_case(case: str, world: int, refs: dict) -> dict:
    ref, _, layout = case.rpartition("@")
    ref = ref or REF
    rank = dist.get_rank()
    t0 = time.perf_counter()
    spec, profiles = resolve_model(ref)
    training = TrainingSpec(global_batch_size=GBS, seq_length=SEQ, dtype="fp32")
    uneven = [(0, 2), (2, 3)] if "pp=2" in layout and spec.num_layers == 3 else None  # searched plans do this
    plan = attach(make_plan(spec, load_cluster("local-cpu").with_gpus(world), training, layout, kernels="torch",
                            stage_layers=uneven), ref)
    check_plan_model(plan)  # what `autoplan run` and runtime.train check before any collective
    dims = ParallelDims.from_plan(plan, world).build_mesh()
    trainer = Trainer(plan, dims, device=torch.device("cpu"), seed=SEED, lr=LR, weight_decay=WD, betas=BETAS,
                      max_grad_norm=CLIP)
    n_params = trainer_parameter_count(trainer)
    # what this rank holds, so the test can tell a layout was applied (not silently run unsharded)
    mods = [m for s in trainer.pm.stages for m in s.module.modules()]
    held = {"local_params": sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                                for _, p in trainer.pm.named_parameters()),
            "tp_sharded": sum(1 for _, p in trainer.pm.named_parameters() if _tp_sharded(p)),
            "checkpointed": sum(isinstance(m, CheckpointWrapper) or hasattr(m, "_autoplan_recompute") for m in mods),
            "stages": [s.plan.index for s in trainer.pm.stages],
            "blocks": sum(len(s.module.layers) for s in trainer.pm.stages)}
    captured = capture_first_grads(trainer)
    data = SyntheticDataset(spec.vocab_size, SEQ, GBS, seed=SEED)
    # step 2 runs under the memory tracker, as `autoplan run` measures it on the CPU (runtime.measure), and step 3
    # is profiled as `--profile-step` does: its counts against the plan's (autoplan.counts.counts_of_plan)
    losses, record = [], None
    for s in range(STEPS):
        if s == 1:
            res = memory_step(trainer, data.batch(s))[0]
        elif s == STEPS - 1:
            res, record = profile_record(trainer, s + 1, data.batch(s))
        else:
            res = trainer.step(data.batch(s))
        losses.append(res.loss)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, captured)
    ranks: list = [None] * world
    dist.all_gather_object(ranks, held)
    result = {"case": case, "seconds": 0.0, "parameters_trained": n_params,
              "parameters_captured": factory_structure(ref).num_parameters, "ranks": ranks}
    if rank == 0:
        parsed = parse_profile_record(record)
        result["count_mismatches"] = parsed.count_mismatches()
        result["call_mismatches"] = parsed.call_mismatches()
        if ref not in refs:
            refs[ref] = reference(ref)
        ref_losses, ref_grads = refs[ref]
        result.update(compare_with_reference(gathered, losses, ref_losses, ref_grads))
        result["ok"] = result["ok"] and n_params == result["parameters_captured"]
    result["seconds"] = time.perf_counter() - t0
    return result


def main() -> int:
    refs: dict = {}
    return worker_main(lambda world, rank: lambda case: run_case(case, world, refs),
                       describe=lambda r: f" params={r.get('parameters_trained')}")

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from autoplan.runtime.train import exit_process

    exit_process(main())
