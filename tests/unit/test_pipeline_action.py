"""The runtime's pipeline schedule costs host time per action (`GPUCalibration.pipeline_action_us`): priced on CPU
processes for autoplan's own runtime, as compute (the runtime times the schedule's own work so), and nowhere else;
the search prices it as the estimate does."""

from __future__ import annotations

import pytest

from autoplan.cost_models.estimate import estimate, num_microbatches
from autoplan.cost_models.fit import with_knobs
from autoplan.cost_models.hardware import cluster_preset
from autoplan.cost_models.profile import profile_from_spec
from autoplan.cost_models.specs import ParallelConfig, TrainingSpec, check_config
from autoplan.presets import MODEL_PRESETS

MODEL = MODEL_PRESETS["tiny-gpt"]
TRAIN = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")


def _cpu(action_us: float):
    return with_knobs(cluster_preset("local-cpu").model_copy(update={"cores_per_node": 2}),
                      {"pipeline_action_us": action_us})


def _est(cluster, parallel: str, training=TRAIN):
    cfg = check_config(ParallelConfig.parse(parallel), MODEL, cluster, training)
    return estimate(profile_from_spec(MODEL), cluster, training, cfg), cfg


@pytest.mark.parametrize("parallel", ["pp=2,dp=2,mbs=1", "pp=4,mbs=1", "pp=2,dp=2,mbs=4,schedule=gpipe",
                                      "pp=2,dp=1,tp=2,vp=2,mbs=1,schedule=interleaved"])
def test_every_action_of_the_critical_rank_costs_the_schedule_s_host_time_as_compute(parallel):
    without, cfg = _est(_cpu(0.0), parallel)
    with_it, _ = _est(_cpu(300.0), parallel)
    m = num_microbatches(cfg, TRAIN)
    # each of the rank's vp stages runs a forward and a backward per micro-batch
    expected = m * 2 * cfg.vp * 300e-6
    assert with_it.breakdown["compute"] - without.breakdown["compute"] == pytest.approx(expected, rel=1e-9)
    assert with_it.step_time_s - without.step_time_s >= expected * 0.99  # on the critical path of a host-bound rank


def test_nothing_without_a_pipeline_on_a_gpu_host_or_on_another_stack():
    for cluster, parallel, training in (
            (_cpu(300.0), "dp=4,mbs=1", TRAIN),  # no pipeline: no schedule
            # a GPU host runs the schedule ahead of its kernels
            (with_knobs(cluster_preset("dgx-h100"), {"pipeline_action_us": 300.0}).with_gpus(8), "pp=2,dp=4", TRAIN),
            # Megatron-LM's schedule is another program's
            (_cpu(300.0), "pp=2,dp=2,mbs=1", TRAIN.model_copy(update={"runtime_memory": False}))):
        base = with_knobs(cluster, {"pipeline_action_us": 0.0})
        assert _est(cluster, parallel, training)[0].step_time_s == _est(base, parallel, training)[0].step_time_s


def test_the_search_prices_the_actions_as_the_estimate_does():
    """The search (closed form with the stages' extra time, `SearchState.occupancy`) equals brute force over
    every configuration's estimate when the actions are dear; and pinned to a pipeline, it takes the fewest
    micro-batches there, which it does not without their price."""
    from autoplan.search.core import search
    from benchmarks.search_exactness import brute_force_best

    cluster = _cpu(5000.0).with_gpus(4)
    bf = brute_force_best(MODEL, cluster, TRAIN)[0]
    best = search(MODEL, cluster, TRAIN).best.step_time_s
    assert bf * (1 - 1e-9) <= best <= bf * 1.03
    dear = search(MODEL, cluster, TRAIN, fix={"pp": "2", "dp": "2"}).best.config
    cheap = search(MODEL, _cpu(0.0).with_gpus(4), TRAIN, fix={"pp": "2", "dp": "2"}).best.config
    assert num_microbatches(dear, TRAIN) == 1 < num_microbatches(cheap, TRAIN), (dear, cheap)
