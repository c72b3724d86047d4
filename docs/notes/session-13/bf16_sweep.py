# ruff: noqa  (a measurement script kept as the record of a session-13 note, not project code)
import sys, torch, torch.distributed as dist
sys.path.insert(0, '/work/main')
from autoplan.api import make_plan
from autoplan.runtime.data import SyntheticDataset
from autoplan.runtime.engine import Trainer
from autoplan.runtime.parallel_dims import ParallelDims
from autoplan.specs import TrainingSpec, load_cluster, load_model
dist.init_process_group("gloo"); n = dist.get_world_size(); rank = dist.get_rank()
spec = load_model("tiny-gpt")
out = {}
for cfg in sys.argv[2:]:
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype=sys.argv[1])
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(n), training, cfg, kernels="torch")
    dims = ParallelDims.from_plan(plan, n).build_mesh()
    tr = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
    data = SyntheticDataset(spec.vocab_size, 64, 8, seed=0)
    losses = []
    for s in range(6):
        r = tr.step(data.batch(s))
        losses.append(float(r["loss"]) if isinstance(r, dict) else float(r.loss) if hasattr(r, "loss") else float(r))
    out[cfg] = losses
if rank == 0:
    for k, v in out.items(): print(sys.argv[1], k, " ".join(f"{x:.5f}" for x in v))
dist.destroy_process_group()
