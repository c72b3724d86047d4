"""`autoplan export-weights CHECKPOINT --format hf -o DIR`: a training checkpoint of any layout -> Hugging Face files.

The DCP checkpoint (runtime.checkpoint) stores every parameter under its single-process name whatever the layout
(TP/FSDP shards, pipeline stages, expert ranks), so one process reads just the model entries (not the optimizer
state) with DCP, resharded to full tensors, maps them to the family's names and layouts
(autoplan.models.hf_weights) and writes safetensors (sharded past 5 GB, with an index) + config.json +
generation_config.json. The config is the one recorded in the checkpoint (autoplan_checkpoint.json
model_source), so the files load with transformers' AutoModelForCausalLM.from_pretrained.
"""

from __future__ import annotations

from pathlib import Path


def read_model_state(path: str | Path) -> tuple[dict, dict]:
    """(checkpoint metadata, {our parameter name: full tensor}) read in this process, without a process group."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from autoplan.runtime import checkpoint

    meta = checkpoint.inspect(path)
    md = checkpoint.read_dcp_metadata(Path(meta["path"]))
    want = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    import warnings

    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(want, storage_reader=dcp.FileSystemReader(meta["path"]), no_dist=True)
    return meta, {k[len("model."):]: v for k, v in want.items()}


def export_hf(checkpoint_path: str | Path, out_dir: str | Path, *, dtype: str | None = None) -> list[Path]:
    """Write the HF files of a checkpoint; returns the paths written."""
    import torch

    from autoplan.runtime.checkpoint import CheckpointError

    from . import arch_from_hf, hf_weights

    meta, state = read_model_state(checkpoint_path)
    src = meta.get("model_source") or {}
    if "hf_config" not in src:
        raise CheckpointError(f"checkpoint {meta['path']} is of {meta['model']['name']}, not of a Hugging Face "
                              "architecture", "export-weights --format hf needs the config the run was planned with",
                              "train a plan made with --model <HF config.json or directory>")
    arch = arch_from_hf(src["hf_config"])
    if dtype:
        cast = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        state = {k: v.to(cast) for k, v in state.items()}
    if arch.tie_embeddings:
        state.pop("output.weight", None)  # a pipeline's second copy of the tied head (equal to the embedding)
    return hf_weights.save(state, arch, out_dir)
