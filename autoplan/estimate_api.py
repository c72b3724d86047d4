"""Estimate one fixed configuration: the analytic profile (or a captured one) through the cost model."""

from __future__ import annotations

from autoplan.cost_models.estimate import Estimate, StageLayout, estimate
from autoplan.cost_models.profile import LayerProfile, profile_from_spec
from autoplan.cost_models.specs import (
    ClusterSpec,
    ModelSpec,
    ParallelConfig,
    TrainingSpec,
    check_config,
    check_stages_run,
)


def estimate_config(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, cfg: ParallelConfig | str,
                    *, profiles: list[LayerProfile] | None = None, layout: list[StageLayout] | None = None,
                    keep_timeline: bool = False) -> Estimate:
    """Validate `cfg` against the model and cluster, then predict its step."""
    if isinstance(cfg, str):
        cfg = ParallelConfig.parse(cfg)
    cfg = check_config(cfg, model, cluster, training, stage_layers=layout is None)
    if layout is not None:
        check_stages_run([(s.layers[1] - s.layers[0], s.recompute, s.recompute_layers) for s in layout], training)
    profiles = profiles or profile_from_spec(model)
    return estimate(profiles, cluster, training, cfg, layout, keep_timeline=keep_timeline)
