"""Python API: make a Plan for a fixed configuration (what `autoplan estimate -o` writes).

`autoplan.search` builds on the same pieces to choose the configuration itself.
"""

from __future__ import annotations

import hashlib
import json
import platform

from autoplan.cost_models.counts import runtime_semantics
from autoplan.cost_models.estimate import GIB, Estimate, StageLayout, even_layout
from autoplan.cost_models.profile import LayerProfile
from autoplan.cost_models.specs import ClusterSpec, ModelSpec, ParallelConfig, TrainingSpec, check_config

from . import __version__
from .estimate_api import estimate_config
from .plan import MemoryBreakdown, Plan, Prediction, Provenance, RunnerUp, StagePlan


def inputs_hash(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, extra: dict | None = None) -> str:
    body = {"model": model.model_dump(mode="json"), "cluster": cluster.model_dump(mode="json"),
            "training": training.model_dump(mode="json"), "extra": extra or {}}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def prediction_of(est: Estimate) -> Prediction:
    mem = [MemoryBreakdown(**{k: round(v, 6) for k, v in m.gib().items()}) for m in est.memory]
    d = est.as_dict()
    return Prediction(
        step_time_s=est.step_time_s, tflops_per_gpu=est.tflops_per_gpu, mfu=est.mfu, hfu=est.hfu,
        tokens_per_s=est.tokens_per_s, memory_gib=d["memory_gib"], memory_breakdown=mem,
        breakdown=d["breakdown"], fits=est.fits,
    )


def plan_from_estimate(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, est: Estimate, *,
                       kernels: str | None = None, runners_up: list[RunnerUp] | None = None,
                       search_time_s: float | None = None, command: str = "", extra: dict | None = None) -> Plan:
    kernels = kernels or ("torch" if training.kernels == "torch" else "fused")
    cfg = est.config
    n = len(est.stages)
    stages = [
        StagePlan(index=s.index, pp_rank=s.index % cfg.pp, layers=s.layout.layers, has_embedding=s.index == 0,
                  has_head=s.index == n - 1, recompute=s.layout.recompute,
                  recompute_layers=s.layout.recompute_layers, forward_s=s.fwd_s, backward_s=s.bwd_s)
        for s in est.stages
    ]
    prov = Provenance(autoplan_version=__version__, python_version=platform.python_version(),
                      inputs_hash=inputs_hash(model, cluster, training, extra), search_time_s=search_time_s,
                      command=command)
    return Plan(model=model, cluster=cluster, training=training, parallel=cfg, stages=stages, kernels=kernels,
                prediction=prediction_of(est), runners_up=runners_up or [], provenance=prov,
                runtime_semantics=runtime_semantics(cfg)).sealed()


def make_plan(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, parallel: ParallelConfig | str,
              *, kernels: str = "fused", stage_layers: list[tuple[int, int]] | None = None,
              profiles: list[LayerProfile] | None = None) -> Plan:
    """A Plan for exactly this configuration (even stages unless `stage_layers` is given), with the cost
    model's prediction."""
    if isinstance(parallel, str):
        parallel = ParallelConfig.parse(parallel)
    if training.kernels != kernels:  # predict with the kernels the plan will run
        training = training.model_copy(update={"kernels": kernels})
    cfg = check_config(parallel, model, cluster, training, stage_layers=stage_layers is None)
    layout = None
    if stage_layers is not None:
        base = even_layout(model.num_layers, cfg)
        if len(stage_layers) != len(base):
            from autoplan.cost_models.errors import ConfigError
            raise ConfigError("stage_layers must list pp*vp stages", f"got {len(stage_layers)}, need {len(base)}",
                              "give one (start, stop) per stage")
        layout = [StageLayout(tuple(r), cfg.recompute, (r[1] - r[0]) if cfg.recompute == "full" else 0)
                  for r in stage_layers]
    est = estimate_config(model, cluster, training, cfg, profiles=profiles, layout=layout)
    return plan_from_estimate(model, cluster, training, est, kernels=kernels)


__all__ = ["make_plan", "plan_from_estimate", "prediction_of", "inputs_hash", "GIB"]
