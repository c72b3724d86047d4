"""Code generation: a Plan and a model become each rank's sharded program (stages, TP/SP/CP, recompute,
fused-kernel substitution), emitted as readable Python source.

    codegen.emit.write_program(plan, out_dir) -> [Path]   what `autoplan codegen plan.json -o DIR` writes
    codegen.program.stage_programs(plan)                  the per-stage description (no torch)
    codegen.fuse.substitute_kernels(model, mode)          kernels.modules substitution (imports torch)

The runtime executes the same emitted source (runtime.parallelize.load_stage_program). Importing this package
and `autoplan.codegen.emit` does not import torch.
"""

from .emit import emit_source, stage_source, write_program

__all__ = ["emit_source", "stage_source", "write_program"]
