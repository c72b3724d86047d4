"""`autoplan export-weights`: training checkpoints out to the Hugging Face format (autoplan.models.export)."""

from __future__ import annotations

import argparse


def cmd_export_weights(args: argparse.Namespace) -> int:
    from .export import export_hf

    written = export_hf(args.checkpoint, args.output, dtype=args.dtype)
    for p in written:
        print(p)
    return 0


def register(sub) -> None:
    p = sub.add_parser("export-weights", help="write a training checkpoint (any layout) as Hugging Face files")
    p.add_argument("checkpoint", help="a --save directory (step_<n>, or its parent holding `latest`)")
    p.add_argument("--format", default="hf", choices=["hf"], help="hf: safetensors + config.json")
    p.add_argument("-o", "--output", required=True, help="directory to write (AutoModelForCausalLM.from_pretrained)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="cast the weights (default: as saved)")
    p.set_defaults(func=cmd_export_weights)
