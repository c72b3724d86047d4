"""Code generation: a Plan and a model become each rank's sharded program (stages, TP/SP/CP, recompute,
fused-kernel substitution), emitted as readable Python source."""
