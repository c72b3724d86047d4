# ruff: noqa  (a measurement script kept as the record of a session-13 note, not project code)
import sys, torch, torch.distributed as dist
sys.path.insert(0, '/work/main')
from autoplan.api import make_plan
from autoplan.runtime.data import SyntheticDataset
from autoplan.runtime.engine import Trainer
from autoplan.runtime.parallel_dims import ParallelDims
from autoplan.specs import TrainingSpec, load_cluster, load_model
from autoplan.cost_models.estimate import casts_once_per_step
dist.init_process_group("gloo"); n = dist.get_world_size(); rank = dist.get_rank()
spec = load_model("tiny-moe").model_copy(update={"dropout": 0.0})
for cfg in sys.argv[1:]:
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype=__import__("os").environ.get("S13_DTYPE","bf16"))
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(n), training, cfg, kernels="torch")
    dims = ParallelDims.from_plan(plan, n).build_mesh()
    tr = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
    data = SyntheticDataset(spec.vocab_size, 64, 8, seed=0)
    losses = [float(tr.step(data.batch(s)).loss) for s in range(4)]
    p = plan.parallel
    if rank == 0: print(cfg, tr.step_cast_cache, casts_once_per_step(pp=p.pp, zero=p.zero, dp_cp=p.dp*p.cp, tp=p.tp), " ".join(f"{x:.5f}" for x in losses))
dist.destroy_process_group()
