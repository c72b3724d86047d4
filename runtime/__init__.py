"""Runtime: the torchrun entry point that trains a model with exactly a Plan's layout (mesh, pipeline
schedule, DP/ZeRO, mixed precision, optimizer, data, metrics).

    runtime.train          `python -m autoplan.runtime.train --plan plan.json --steps N ...` (under torchrun)
    runtime.launch.run     launch that under torchrun for a plan (what `autoplan run` calls)
    runtime.parallel_dims  ParallelDims: the validated mesh object, start-up checks
    runtime.parallelize    one apply_<technique> per parallelism, composed by `parallelize`
    runtime.engine         Trainer: micro-batches / pipeline schedule, gradient sync, clipping, AdamW
    runtime.data           synthetic and memory-mapped token datasets, per-rank slicing

Importing this package does not import torch.
"""
