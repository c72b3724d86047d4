"""Plans made by the planner API for the inspect tests: interleaved, uneven stages, barely fitting, pp=1."""

from __future__ import annotations

import pytest

from autoplan.api import make_plan
from autoplan.plan import RunnerUp
from autoplan.specs import TrainingSpec, load_cluster, load_model


@pytest.fixture(scope="session")
def gpt175():
    return (load_model("gpt3-175b"), load_cluster("dgx-a100-80g", gpus=1024),
            # Megatron's 16-bit weights: the published run's memory (autoplan's autocast over fp32 parameters keeps
            # a bf16 weight copy per in-flight micro-batch, and this layout would not fit)
            TrainingSpec(global_batch_size=1536, seq_length=2048, autocast_fp32_params=False))


@pytest.fixture(scope="session")
def plan_interleaved(gpt175):
    """gpt3-175b on 1024 A100s, tp=8 pp=8 vp=3, with two runners-up attached."""
    m, c, tr = gpt175
    plan = make_plan(m, c, tr, "tp=8,pp=8,vp=3,mbs=1,sp=1,recompute=selective")
    ups = []
    for cfg, note in (("tp=8,pp=16,mbs=1,sp=1,recompute=selective", "larger bubble"),
                      ("tp=4,pp=16,vp=3,mbs=1,sp=1,recompute=selective", "")):
        other = make_plan(m, c, tr, cfg)
        ups.append(RunnerUp(parallel=other.parallel.as_dict(), step_time_s=other.prediction.step_time_s,
                            mfu=other.prediction.mfu, peak_memory_gib=other.prediction.memory_gib["peak"],
                            note=note))
    return plan.model_copy(update={"runners_up": ups, "content_hash": ""}).sealed()


@pytest.fixture(scope="session")
def plan_1f1b(gpt175):
    m, c, tr = gpt175
    return make_plan(m, c, tr, "tp=8,pp=16,mbs=1,sp=1,recompute=full")


# 96 layers over 8 stages: 11 on the first, 12 on each middle one, 13 on the last (any first/last shape will do;
# Megatron expresses it with --decoder-first/last-pipeline-num-layers).
UNEVEN = [(0, 11), (11, 23), (23, 35), (35, 47), (47, 59), (59, 71), (71, 83), (83, 96)]


@pytest.fixture(scope="session")
def plan_uneven(gpt175):
    """pp=8 with the first stage one layer short and the last one long: Megatron's first/last form."""
    m, c, tr = gpt175
    return make_plan(m, c, tr, "tp=8,pp=8,mbs=1,sp=1,recompute=selective", stage_layers=UNEVEN)


@pytest.fixture(scope="session")
def plan_uneven_vp(gpt175):
    """pp=4 x vp=2 with uneven virtual stages that are not uneven only at the first/last rank."""
    m, c, tr = gpt175
    layers = [10, 12, 12, 12, 13, 12, 12, 13]
    bounds, start = [], 0
    for n in layers:
        bounds.append((start, start + n))
        start += n
    return make_plan(m, c, tr, "tp=8,pp=4,vp=2,mbs=1,sp=1,recompute=full", stage_layers=bounds)


@pytest.fixture(scope="session")
def plan_barely():
    """A plan that barely fits: the GPU's memory set just above the configuration's predicted peak, so the
    test does not depend on the cost model's exact numbers."""
    m = load_model("gpt3-13b")
    tr = TrainingSpec(global_batch_size=512, seq_length=2048)
    cfg = "tp=2,pp=2,mbs=4,sp=1,recompute=none"
    c = load_cluster("dgx-a100-80g", gpus=64)
    peak = make_plan(m, c, tr, cfg).prediction.memory_gib["peak"]
    gpu = c.gpu.model_copy(update={"hbm_gib": round(peak + 0.4, 1)})
    c = c.model_copy(update={"gpu": gpu, "name": "tight-a100"})
    plan = make_plan(m, c, tr, cfg)
    assert plan.prediction.fits and c.gpu.hbm_gib - plan.prediction.memory_gib["peak"] < 0.5
    return plan


@pytest.fixture(scope="session")
def plan_pp1():
    """No pipeline: gpt3-1.3b data-parallel on 8 GPUs with full recomputation."""
    m = load_model("gpt3-1.3b")
    tr = TrainingSpec(global_batch_size=64, seq_length=2048)
    return make_plan(m, load_cluster("dgx-a100-80g", gpus=8), tr, "tp=1,pp=1,mbs=2,recompute=full")


@pytest.fixture(scope="session")
def all_plans(plan_interleaved, plan_1f1b, plan_uneven, plan_uneven_vp, plan_barely, plan_pp1):
    return {"interleaved": plan_interleaved, "1f1b": plan_1f1b, "uneven": plan_uneven,
            "uneven_vp": plan_uneven_vp, "barely": plan_barely, "pp1": plan_pp1}
