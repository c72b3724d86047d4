# ruff: noqa: E701, E702, UP031  (a measurement script kept as the record of a note, not project code)
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from autoplan.api import make_plan
from autoplan.runtime.data import SyntheticDataset
from autoplan.runtime.engine import Trainer
from autoplan.runtime.parallel_dims import ParallelDims
from autoplan.specs import TrainingSpec, load_cluster, load_model

dist.init_process_group("gloo"); n = dist.get_world_size()
spec = load_model("tiny-gpt")
training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32")
for config in sys.argv[1:]:
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(n), training, config, kernels="torch")
    dims = ParallelDims.from_plan(plan, n).build_mesh()
    trainer = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
    data = SyntheticDataset(spec.vocab_size, 64, 8, seed=0)
    for i in range(3): trainer.step(data.batch(i))
    ts=[]
    for i in range(15):
        t=time.perf_counter(); trainer.step(data.batch(i)); ts.append(time.perf_counter()-t)
    ts.sort()
    if dist.get_rank()==0: print(config, "median %.1f ms  min %.1f"%(ts[len(ts)//2]*1e3, ts[0]*1e3), flush=True)
