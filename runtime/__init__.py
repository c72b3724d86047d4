"""Runtime: the torchrun entry point that trains a model with exactly a Plan's layout (mesh, pipeline
schedule, DP/ZeRO, mixed precision, optimizer, data, checkpoints, metrics)."""
