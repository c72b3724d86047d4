# ruff: noqa
"""How many operators run as DTensors per step under tp with and without SP, and what each costs the host:
tiny-gpt at one token on a one-process mesh (no collective runs), plain vs tp sp=0 vs tp sp=1."""
import os, statistics, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor import DTensor
from autoplan.runtime.parallelize import apply_tp
from autoplan.specs import load_model
from autoplan.zoo.model import build_model
from autoplan.cost_models.profile import profile_from_spec

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
name = sys.argv[1] if len(sys.argv) > 1 else "tiny-gpt"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1
spec = load_model(name)
print("model kernels_fwd (profile):", sum(p.kernels_fwd for p in profile_from_spec(spec)), [p.kernels_fwd for p in profile_from_spec(spec)][:3])
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
models = {"plain": build_model(spec)}
for sp in (False, True):
    m = build_model(spec); apply_tp(m, mesh, sp=sp); models[f"sp={int(sp)}"] = m
x = torch.randint(0, spec.vocab_size, (1, tokens))

from torch.utils._pytree import tree_leaves

from torch.utils._python_dispatch import TorchDispatchMode
class Count(TorchDispatchMode):
    def __init__(s): super().__init__(); s.n = 0; s.d = 0
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.n += 1
        s.d += any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs)))
        return func(*args, **(kwargs or {}))

def step(m):
    t0 = time.perf_counter()
    with loss_parallel():
        F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    return time.perf_counter() - t0

for k, m in models.items():
    with Count() as c:
        step(m)
    print(f"{k}: aten ops {c.n}, with DTensor args {c.d}")
for _ in range(5):
    for m in models.values(): step(m)
ts = {k: [] for k in models}
for _ in range(41):
    for k, m in models.items(): ts[k].append(step(m))
med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
print({k: round(v, 3) for k, v in med.items()}, "ms per step")
dist.destroy_process_group()
