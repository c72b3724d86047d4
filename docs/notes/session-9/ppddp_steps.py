# ruff: noqa: E701, E702, UP031  (a measurement script kept as the record of a note, not project code)
"""Step time and Python calls per step of autoplan's runtime on one layout (torchrun, gloo, CPU).
Imports autoplan from PYTHONPATH (main or the worktree). Rank 0 prints one JSON line."""
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

from autoplan.api import make_plan
from autoplan.runtime.data import SyntheticDataset
from autoplan.runtime.engine import Trainer
from autoplan.runtime.parallel_dims import ParallelDims
from autoplan.specs import TrainingSpec, load_cluster, load_model

name, config = sys.argv[1].split(":", 1)
warm, timed, prof = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
spec = load_model(name).model_copy(update={"dropout": 0.0})
tr = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32")
plan = make_plan(spec, load_cluster("local-cpu").with_gpus(world), tr, config)
dims = ParallelDims.from_plan(plan, world).build_mesh()
t = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
data = SyntheticDataset(spec.vocab_size, tr.seq_length, tr.global_batch_size, seed=0)
s = 0
for _ in range(warm):
    t.step(data.batch(s)); s += 1
times = []
cpu0 = time.process_time()
for _ in range(timed):
    dist.barrier()
    r = t.step(data.batch(s)); s += 1
    times.append(r.step_time_s)
cpu_ms = 1e3 * (time.process_time() - cpu0) / timed
pr = cProfile.Profile()
dist.barrier()
pr.enable()
for _ in range(prof):
    t.step(data.batch(s)); s += 1
pr.disable()
calls = pstats.Stats(pr).total_calls / prof
out = [None] * world
dist.all_gather_object(out, {"rank": rank, "median_ms": 1e3 * statistics.median(times),
                             "calls_per_step": calls, "cpu_ms": cpu_ms, "loss": r.loss})
if rank == 0:
    print(json.dumps({"case": sys.argv[1], "ranks": out}))
dist.destroy_process_group()
