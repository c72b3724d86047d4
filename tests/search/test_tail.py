"""The search's data-parallel tail prices what the estimate prices: the same functions (dp_sync with the
runtime's per-unit reduction, FSDP's per-unit work, the optimizer and the step's scalar all-reduces) for every
ZeRO stage, on a gloo cluster where FSDP's per-unit collectives and host work are charged."""

from __future__ import annotations

import pytest

from autoplan.cost_models.estimate import _rank_tails, _stages_by_rank, estimate, num_microbatches
from autoplan.cost_models.fit import with_knobs
from autoplan.cost_models.profile import profile_from_spec
from autoplan.cost_models.specs import ParallelConfig, check_config
from autoplan.search.core import _Searcher
from autoplan.search.space import Mesh
from autoplan.specs import TrainingSpec, load_cluster, load_model


@pytest.mark.parametrize("layout", ["dp=4", "dp=2,pp=2", "dp=2,tp=2", "dp=2,tp=2,pp=1,mbs=2"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_search_tail_parts_equal_the_estimate(layout, zero):
    model = load_model("tiny-gpt")
    cluster = with_knobs(load_cluster("local-cpu", gpus=4).model_copy(update={"cores_per_node": 2}),
                         {"fsdp_collective_overhead_us": 2000.0, "oversubscription_wait_us": 500.0})
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    profiles = profile_from_spec(model)
    cfg = check_config(ParallelConfig.parse(f"{layout},zero={zero}"), model, cluster, training)
    est = estimate(profiles, cluster, training, cfg)
    m = num_microbatches(cfg, training)
    want = _rank_tails(_stages_by_rank(est.stages, cfg.pp), cfg, cluster, training, m)
    s = _Searcher(model, cluster, training, profiles, {}, 1, None)
    mesh = Mesh(tp=cfg.tp, cp=cfg.cp, ep=cfg.ep, pp=cfg.pp, dp=cfg.dp, mbs=cfg.mbs, sp=cfg.sp)
    got = dict(s._dp_parts(mesh, zero, cfg.vp))
    assert got, layout
    for r, (red, tail, rest) in got.items():
        w_red, w_tail, w_opt, w_gather = want[r]
        assert (red, tail, rest) == pytest.approx((w_red, w_tail, w_opt + w_gather), rel=1e-9), (r, layout, zero)
    if zero >= 1:
        assert max(p[2] for p in got.values()) > 0
