"""Python API: make a Plan for a fixed configuration (what `autoplan estimate -o` writes).

`autoplan.search` builds on the same pieces to choose the configuration itself.
"""

from __future__ import annotations

import platform

from cost_models.specs import ClusterSpec, ModelSpec, ParallelConfig, TrainingSpec, check_config

from . import __version__
from .plan import MemoryBreakdown, Plan, Prediction, Provenance, StagePlan


def even_stages(model: ModelSpec, cfg: ParallelConfig) -> list[tuple[int, int]]:
    """Layer ranges [start, stop) of pp*vp stages, as even as possible (earlier stages get the remainder)."""
    n = cfg.pp * cfg.vp
    base, extra = divmod(model.num_layers, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def make_plan(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, parallel: ParallelConfig | str,
              *, kernels: str = "fused", stage_layers: list[tuple[int, int]] | None = None) -> Plan:
    """A Plan for exactly this configuration, with the cost model's prediction.

    TEMPORARY (until the cost model lands): predictions are zeros. The stage layout and configuration are final.
    """
    if isinstance(parallel, str):
        parallel = ParallelConfig.parse(parallel)
    cfg = check_config(parallel, model, cluster, training, stage_layers=stage_layers is None)
    ranges = stage_layers or even_stages(model, cfg)
    n = len(ranges)
    stages = [
        StagePlan(index=i, pp_rank=i % cfg.pp, layers=r, has_embedding=i == 0, has_head=i == n - 1,
                  recompute=cfg.recompute,
                  recompute_layers=(r[1] - r[0]) if cfg.recompute == "full" else 0,
                  forward_s=0.0, backward_s=0.0)
        for i, r in enumerate(ranges)
    ]
    zero_mem = MemoryBreakdown(weights=0, gradients=0, optimizer=0, activations=0, other=0, total=0)
    pred = Prediction(step_time_s=0, tflops_per_gpu=0, mfu=0, hfu=0, tokens_per_s=0,
                      memory_gib={"per_stage": [0.0] * cfg.pp, "peak": 0.0},
                      memory_breakdown=[zero_mem] * cfg.pp, breakdown={}, fits=True)
    prov = Provenance(autoplan_version=__version__, python_version=platform.python_version(), inputs_hash="")
    return Plan(model=model, cluster=cluster, training=training, parallel=cfg, stages=stages, kernels=kernels,
                prediction=pred, provenance=prov).sealed()
