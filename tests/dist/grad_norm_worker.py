"""Worker of test_grad_norm.py (torchrun, 4 ranks, gloo): the gradient norm of tiny-gpt at tp=2,dp=2, whose
parameters are 2-D DTensors on several FSDP2-built mesh objects, against the norm of the full gradients, and the
collectives grad_norm issues per mesh dimension."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autoplan.api import make_plan  # noqa: E402
from autoplan.runtime import measure  # noqa: E402
from autoplan.runtime.data import SyntheticDataset  # noqa: E402
from autoplan.runtime.engine import Trainer  # noqa: E402
from autoplan.runtime.parallel_dims import ParallelDims  # noqa: E402
from autoplan.specs import TrainingSpec, load_cluster, load_model  # noqa: E402


def main(out: str, config: str) -> int:
    dist.init_process_group("gloo")
    spec = load_model("tiny-gpt").model_copy(update={"dropout": 0.0})
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32")
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(4), training, config, kernels="torch")
    dims = ParallelDims.from_plan(plan, 4).build_mesh()
    trainer = Trainer(plan, dims, device=torch.device("cpu"), seed=0, max_grad_norm=0.0)
    data = SyntheticDataset(spec.vocab_size, 64, 8, seed=0)
    trainer.step(data.batch(0))  # gradients stay after the step (clipping off)
    meshes = {id(p.grad.device_mesh) for p, _ in trainer._norm_params if isinstance(p.grad, DTensor)}
    ref = torch.zeros((), dtype=torch.float64)
    for p, _ in trainer._norm_params:
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        ref += g.to(torch.float64).pow(2).sum()
    counter = measure.CommCounter(measure.group_names(dims))
    with counter:
        norm = trainer.grad_norm()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"norm": float(norm), "ref": float(ref.sqrt()), "meshes": len(meshes),
                                         "comm": counter.as_list()}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from autoplan.runtime.train import exit_process  # a worker leaves without finalising: see there

    exit_process(main(sys.argv[1], sys.argv[2]))
