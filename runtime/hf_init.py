"""--init-from: fill this rank's parameters, in any layout, from a Hugging Face safetensors checkpoint.

Every local parameter (a pipeline stage's, a TP/SP or FSDP DTensor shard, an expert-parallel rank's experts) is
the box [offset, offset + local shape) of a global tensor (torch's compute_local_shape_and_global_offset); the
box is read with safetensors' get_slice through the family's name/layout rule (autoplan.models.hf_weights), so
each rank reads only its slices and no rank ever holds the whole model. The checkpoint's config.json must
describe the planned model (autoplan.models.check_same_arch), and its tensor names must be exactly the family's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


def plan_arch(plan):
    """The Arch of a plan made for a Hugging Face config, else a SpecError (only those take HF weights)."""
    from autoplan.cost_models.errors import SpecError
    from autoplan.models import arch_from_hf

    src = plan.model_source or {}
    if "hf_config" not in src:
        raise SpecError("--init-from needs a plan made for a Hugging Face config",
                        f"plan {plan.short_hash} is for {plan.model.name} ({'a module factory' if src else 'zoo'})",
                        "plan with --model DIR (the checkpoint directory) or DIR/config.json")
    return arch_from_hf(src["hf_config"])


def check_init_from(plan, directory: str | Path) -> None:
    """Start-up check (no process group yet): a HF plan, and the checkpoint's config is the planned model."""
    from autoplan.models import check_same_arch
    from autoplan.models.hf_weights import CheckpointFiles, check_names

    arch = plan_arch(plan)
    check_same_arch(arch, directory)
    check_names(CheckpointFiles(directory), arch)


def load_hf_checkpoint(pm, directory: str | Path, plan) -> int:
    """Fill the ParallelModel `pm` from `directory`; returns the number of elements read by this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from autoplan.models import check_same_arch
    from autoplan.models.blocks import CausalLM
    from autoplan.models.hf_weights import CheckpointFiles, check_names, read_box, rule_index

    arch = plan_arch(plan)
    check_same_arch(arch, directory)
    files = CheckpointFiles(directory)
    check_names(files, arch)
    index = rule_index(arch)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in CausalLM(arch).named_parameters(remove_duplicate=False)}
    read = 0
    with torch.no_grad():
        for name, p in pm.named_parameters():
            rule, j = index[name]
            part_shapes = [shapes[n] for n in rule.ours]
            if isinstance(p, DTensor):
                size, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                dst = p.to_local()
            else:
                size, offset, dst = tuple(p.shape), (0,) * p.dim(), p
            if dst.numel() == 0:
                continue
            box = read_box(files, rule, j, part_shapes, tuple(offset), tuple(size), arch)
            dst.copy_(box.reshape(dst.shape))
            read += box.numel()
    return read
