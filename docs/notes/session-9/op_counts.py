# ruff: noqa: E701, E702, UP031  (a measurement script kept as the record of a note, not project code)
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.api import make_plan
from autoplan.runtime.data import SyntheticDataset
from autoplan.runtime.engine import Trainer
from autoplan.runtime.parallel_dims import ParallelDims
from autoplan.specs import TrainingSpec, load_cluster, load_model

counts = {"dt": 0}
class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        isdt = any(t is DTensor or issubclass(t, DTensor) for t in types)
        key = ("DT " if isdt else "pl ") + str(func)
        counts["dt" if isdt else "plain"] = counts.get("dt" if isdt else "plain", 0) + 1
        counts[key] = counts.get(key, 0) + 1
        return func(*args, **kwargs)

def main(config):
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    spec = load_model("tiny-gpt")
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32")
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(n), training, config, kernels="torch")
    dims = ParallelDims.from_plan(plan, n).build_mesh()
    trainer = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
    data = SyntheticDataset(spec.vocab_size, 64, 8, seed=0)
    trainer.step(data.batch(0)); trainer.step(data.batch(1))
    t=time.perf_counter()
    with Count():
        trainer.step(data.batch(2))
    el=time.perf_counter()-t
    if dist.get_rank() == 0:
        top = sorted(((v,k) for k,v in counts.items() if k not in ("dt","plain")), reverse=True)[:25]
        print(config, "dtensor ops/step", counts.get("dt"), "plain", counts.get("plain"), "step", round(el*1e3,1), "ms")
        for v,k in top: print("   ", v, k)
    dist.destroy_process_group()
main(sys.argv[1])
