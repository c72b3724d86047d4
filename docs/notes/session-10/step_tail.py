# ruff: noqa  (a measurement script kept as the record of a session-10 note, not project code)
# run: torchrun --nproc-per-node 4 docs/notes/session-10/step_tail.py [layouts...]
"""Time the step tail's pieces per rank (medians over 12 steps): _finalize_grads, grad_norm, clipping, AdamW, the loss all-reduce."""
import sys, time, statistics
import torch, torch.distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from autoplan.api import make_plan
from autoplan.runtime.data import SyntheticDataset
from autoplan.runtime.engine import Trainer
from autoplan.runtime.parallel_dims import ParallelDims
from autoplan.specs import TrainingSpec, load_cluster, load_model
dist.init_process_group("gloo"); n = dist.get_world_size(); rank = dist.get_rank()
spec = load_model("tiny-gpt")
training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32")
for config in sys.argv[1:]:
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(n), training, config, kernels="torch")
    dims = ParallelDims.from_plan(plan, n).build_mesh()
    tr = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
    data = SyntheticDataset(spec.vocab_size, 64, 8, seed=0)
    acc = {}
    def wrap(name, fn):
        def w(*a, **k):
            t = time.perf_counter(); r = fn(*a, **k); acc.setdefault(name, []).append(time.perf_counter() - t); return r
        return w
    tr._finalize_grads = wrap("finalize", tr._finalize_grads)
    tr.grad_norm = wrap("norm", tr.grad_norm)
    tr._clip_grads = wrap("clip(incl norm)", tr._clip_grads)
    tr.optimizer.step = wrap("adamw", tr.optimizer.step)
    tr._reduce_loss = wrap("loss", tr._reduce_loss)
    for i in range(3): tr.step(data.batch(i))
    acc.clear()
    for i in range(12): tr.step(data.batch(i))
    nparams = sum(1 for _ in tr.pm.named_parameters())
    line = f"rank {rank} {config} params {nparams}: " + ", ".join(f"{k} {statistics.median(v)*1e3:.2f}" for k, v in acc.items())
    out = [None] * n; dist.all_gather_object(out, line)
    if rank == 0: print("\n".join(out), flush=True)
dist.destroy_process_group()
