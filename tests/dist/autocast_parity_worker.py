"""Worker of test_autocast_parity.py (torchrun, 4 ranks, gloo): tiny-gpt trained in bf16 (torch.autocast over fp32
parameters) for a few steps under several data-parallel layouts, from the same seed and batches; rank 0 writes
each layout's losses and whether its Trainer kept one autocast cache for the step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autoplan.api import make_plan  # noqa: E402
from autoplan.runtime.data import SyntheticDataset  # noqa: E402
from autoplan.runtime.engine import Trainer  # noqa: E402
from autoplan.runtime.parallel_dims import ParallelDims  # noqa: E402
from autoplan.specs import TrainingSpec, load_cluster, load_model  # noqa: E402

STEPS = 4


def main(out: str, configs: list[str]) -> int:
    dist.init_process_group("gloo")
    spec = load_model("tiny-gpt")
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="bf16")
    result = {}
    for config in configs:
        plan = make_plan(spec, load_cluster("local-cpu").with_gpus(4), training, config, kernels="torch")
        dims = ParallelDims.from_plan(plan, 4).build_mesh()
        trainer = Trainer(plan, dims, device=torch.device("cpu"), seed=0)
        data = SyntheticDataset(spec.vocab_size, 64, 8, seed=0)
        losses = [float(trainer.step(data.batch(s)).loss) for s in range(STEPS)]
        result[config] = {"losses": losses, "step_cast_cache": trainer.step_cast_cache,
                          "parallel": plan.parallel.model_dump()}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from autoplan.runtime.train import exit_process  # a worker leaves without finalising: see there

    exit_process(main(sys.argv[1], sys.argv[2:]))
