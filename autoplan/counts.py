"""The cost model's per-rank counts (cost_models.counts) for a Plan: the adapter the runtime and `show` use."""

from __future__ import annotations

from autoplan.cost_models.counts import predict_counts
from autoplan.cost_models.estimate import StageLayout
from autoplan.cost_models.profile import profile_from_spec


def counts_of_plan(plan) -> list[dict]:
    """Per pipeline rank: FLOPs by phase, collectives and memory categories of one step of `plan` (its stages,
    recomputation and kernels as planned; the analytic profile of its model)."""
    training = plan.training
    if training.kernels != plan.kernels:
        training = training.model_copy(update={"kernels": plan.kernels})
    layout = [StageLayout(tuple(s.layers), s.recompute, s.recompute_layers) for s in plan.stages]
    return predict_counts(profile_from_spec(plan.model), plan.cluster, training, plan.parallel, layout)
