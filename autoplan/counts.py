"""The cost model's per-rank counts (cost_models.counts) for a Plan: the adapter the runtime and `show` use."""

from __future__ import annotations

from autoplan.cost_models.counts import predict_counts
from autoplan.cost_models.estimate import StageLayout
from autoplan.cost_models.profile import profile_from_spec


def counts_of_plan(plan, *, module_loaded: bool = False) -> list[dict]:
    """Per pipeline rank: FLOPs by phase, collectives and memory categories of one step of `plan` (its stages,
    recomputation and kernels as planned; the profiles its prediction was made from: `plan_profiles`, with
    `module_loaded` as there)."""
    training = plan.training
    if training.kernels != plan.kernels:
        training = training.model_copy(update={"kernels": plan.kernels})
    layout = [StageLayout(tuple(s.layers), s.recompute, s.recompute_layers) for s in plan.stages]
    return predict_counts(plan_profiles(plan, module_loaded=module_loaded), plan.cluster, training, plan.parallel,
                          layout)


def plan_profiles(plan, *, module_loaded: bool = False):
    """The layer profiles `plan` was priced with: a user module's (module:factory) from its capture, as estimate
    and search price it (autoplan.workload.resolve_model), but only where the caller already runs that module
    (`module_loaded`: the runtime, which built it to train it). A plan file is data (SECURITY.md): reading one
    never imports the module it names, so `show` and the other inspections count such a plan from the analytic
    profile of its model spec, as they do every other plan (`is_captured_elsewhere` says when), unless the plan
    records the profiles it was priced from (Plan.profiles, written by search, estimate and tune)."""
    if plan.profiles:  # recorded with the plan (data): what it was priced from
        return plan.profiles
    factory = (plan.model_source or {}).get("factory")
    if factory and module_loaded:
        from autoplan.workload import resolve_model

        profiles = resolve_model(factory)[1]
        if profiles:
            return profiles
    return profile_from_spec(plan.model)


def is_captured_elsewhere(plan) -> bool:
    """Whether `plan` was priced from a capture of a user module that inspecting the plan does not import: its
    counts and re-estimates here are the analytic profile's of its model spec, not the plan's own."""
    return bool((plan.model_source or {}).get("factory")) and not plan.profiles
