"""Sharded runs of Hugging Face families against the unsharded transformers model, under torchrun.

For each case (family, parallel configuration), rank 0 saves transformers' own randomly initialised model with
save_pretrained; the plan is made with the planner's API and records the HF config; the runtime's Trainer builds
the sharded model with autoplan.models and fills it with --init-from (each rank reading its slices); then 3
training steps. Rank 0 compares the losses of every step, and the gradients of the first step (after clipping,
mapped to autoplan's names), with transformers' model trained on the full batch by torch's AdamW.

    torchrun --nproc-per-node 2 tests/models/hf_parity_worker.py --out results.json FAMILY:CONFIG ...
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from autoplan.api import make_plan  # noqa: E402
from autoplan.models import arch_from_hf, hf_weights  # noqa: E402
from autoplan.models.blocks import spec_of  # noqa: E402
from autoplan.models.source import attach  # noqa: E402
from autoplan.runtime.data import SyntheticDataset  # noqa: E402
from autoplan.runtime.engine import Trainer  # noqa: E402
from autoplan.runtime.parallel_dims import ParallelDims  # noqa: E402
from autoplan.specs import TrainingSpec, load_cluster  # noqa: E402
from tests.dist.worker_loop import (  # noqa: E402
    capture_first_grads,
    compare_with_reference,
    reference_run,
    worker_main,
)
from tests.models.hf_configs import CONFIGS, hf_model  # noqa: E402

STEPS, GBS, SEQ, LR, WD, BETAS, CLIP, SEED = 3, 4, 16, 1e-3, 0.1, (0.9, 0.95), 0.5, 0
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dropout": 0.0, "attention_dropout": 0.0,
              "hidden_dropout": 0.0}


def config(family: str) -> dict:
    cfg = dict(CONFIGS[family])
    cfg.update({k: v for k, v in NO_DROPOUT.items() if k in cfg or family.startswith(("gpt2", "opt"))})
    return cfg


def reference(model) -> tuple[list[float], dict[str, torch.Tensor]]:
    model.train()
    return reference_run(model, model.config.vocab_size, steps=STEPS, gbs=GBS, seq=SEQ, lr=LR, betas=BETAS,
                         weight_decay=WD, clip=CLIP, seed=SEED, forward=lambda ids: model(input_ids=ids).logits)


def run_case(case: str, world: int, tmp: Path) -> dict:
    family, layout = case.split(":", 1)
    rank = dist.get_rank()
    t0 = time.perf_counter()
    cfg = config(family)
    arch = arch_from_hf(cfg)
    ckpt = tmp / family
    ref = None
    if rank == 0:
        ref = hf_model(cfg, seed=SEED)
        if not ckpt.exists():
            ref.save_pretrained(ckpt)
    dist.barrier()
    training = TrainingSpec(global_batch_size=GBS, seq_length=SEQ, dtype="fp32")
    uneven = [(0, 2), (2, 3)] if "pp=2" in layout and arch.num_layers == 3 else None  # searched plans do this
    plan = attach(make_plan(spec_of(arch), load_cluster("local-cpu").with_gpus(world), training, layout,
                            kernels="torch", stage_layers=uneven), cfg)
    dims = ParallelDims.from_plan(plan, world).build_mesh()
    trainer = Trainer(plan, dims, device=torch.device("cpu"), seed=SEED, lr=LR, weight_decay=WD, betas=BETAS,
                      max_grad_norm=CLIP, init_from=str(ckpt))
    # a tied head's gradient is the embedding's (transformers names the shared weight after the embedding)
    captured = capture_first_grads(
        trainer, lambda n: "tok_embeddings.weight" if arch.tie_embeddings and n == "output.weight" else n)
    data = SyntheticDataset(arch.vocab_size, SEQ, GBS, seed=SEED)
    losses = [trainer.step(data.batch(s)).loss for s in range(STEPS)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, captured)
    result = {"case": case, "seconds": 0.0}
    if rank == 0:
        ref_losses, hf_grads = reference(ref)
        shapes = {n: p.shape for n, p in spec_model_shapes(arch).items()}
        ref_grads = hf_weights.from_hf(hf_grads, arch, shapes)
        result.update(compare_with_reference(gathered, losses, ref_losses, ref_grads))
    result["seconds"] = time.perf_counter() - t0
    return result


def spec_model_shapes(arch) -> dict:
    from autoplan.models.blocks import CausalLM

    with torch.device("meta"):
        return dict(CausalLM(arch).named_parameters())


def main() -> int:
    def runner(world: int, rank: int):
        box = [tempfile.mkdtemp(prefix="hfparity-") if rank == 0 else None]  # one directory for every rank
        dist.broadcast_object_list(box)
        tmp = Path(box[0])
        return lambda case: run_case(case, world, tmp)

    return worker_main(runner)

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from autoplan.runtime.train import exit_process

    exit_process(main())
