"""The cost model's per-rank counts (cost_models.counts) for a Plan: the adapter the runtime and `show` use."""

from __future__ import annotations

from autoplan.cost_models.counts import predict_counts
from autoplan.cost_models.estimate import StageLayout
from autoplan.cost_models.profile import profile_from_spec


def counts_of_plan(plan) -> list[dict]:
    """Per pipeline rank: FLOPs by phase, collectives and memory categories of one step of `plan` (its stages,
    recomputation and kernels as planned; the profiles its prediction was made from: `plan_profiles`)."""
    training = plan.training
    if training.kernels != plan.kernels:
        training = training.model_copy(update={"kernels": plan.kernels})
    layout = [StageLayout(tuple(s.layers), s.recompute, s.recompute_layers) for s in plan.stages]
    return predict_counts(plan_profiles(plan), plan.cluster, training, plan.parallel, layout)


def plan_profiles(plan):
    """The layer profiles `plan` was priced with: a user module's (module:factory) from its capture, as estimate
    and search price it (autoplan.workload.resolve_model); the analytic profile of the model spec otherwise."""
    factory = (plan.model_source or {}).get("factory")
    if factory:
        from autoplan.workload import resolve_model

        profiles = resolve_model(factory)[1]
        if profiles:
            return profiles
    return profile_from_spec(plan.model)
