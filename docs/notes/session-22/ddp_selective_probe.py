# ruff: noqa
"""torchrun --nproc-per-node N: the runtime's Trainer on tiny-gpt (local-cpu plan, dp=N, mbs 1), recompute none vs
selective vs full, median step after warm-up, alternating: what selective costs a region under DDP with N processes
on this machine's 2 cores."""
import statistics, sys, time
import torch, torch.distributed as dist
from autoplan.api import make_plan
from autoplan.runtime.data import SyntheticDataset
from autoplan.runtime.engine import Trainer
from autoplan.runtime.parallel_dims import ParallelDims
from autoplan.specs import TrainingSpec, load_cluster, load_model

dist.init_process_group("gloo")
world = dist.get_world_size()
torch.set_num_threads(1)
spec = load_model("tiny-gpt")
training = TrainingSpec(global_batch_size=2 * world, seq_length=64, dtype=sys.argv[1] if len(sys.argv) > 1 else "fp32")
trainers = {}
for mode in ("none", "selective", "full"):
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(world), training, f"dp={world},mbs=1,recompute={mode}",
                     kernels="torch")
    dims = ParallelDims.from_plan(plan, world).build_mesh()
    trainers[mode] = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
data = SyntheticDataset(spec.vocab_size, 64, 2 * world, seed=0)
ts = {k: [] for k in trainers}
for s in range(25):
    for k, t in trainers.items():
        dist.barrier()
        t0 = time.perf_counter()
        t.step(data.batch(s))
        if s >= 5:
            ts[k].append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
    L, m = spec.num_layers, 2
    print(f"{world} processes: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()),
          f"| per region: selective +{(med['selective'] - med['none']) / (L * m) * 1e3:.0f} us, "
          f"full +{(med['full'] - med['none']) / (L * m) * 1e3:.0f} us")
dist.destroy_process_group()
