"""The optimizer step's host time over DTensor parameters goes per tensor (estimate.dtensor_optimizer_time): the
profiles count the tensors the runtime's optimizer steps, and which of them are DTensors follows the runtime's
layout (FSDP2: all; tensor parallelism alone: all but the norms and a learned position table)."""

from __future__ import annotations

import pytest

from autoplan.api import make_plan
from autoplan.cost_models.estimate import estimate
from autoplan.cost_models.fit import with_knobs
from autoplan.cost_models.profile import profile_from_spec
from autoplan.specs import TrainingSpec, load_cluster, load_model

torch = pytest.importorskip("torch")

TINY = ["tiny-gpt", "tiny-llama", "tiny-moe"]


@pytest.mark.parametrize("name", [*TINY, "gpt3-125m", "llama3-8b", "mixtral-8x7b"])
def test_profiles_count_the_models_parameter_tensors(name):
    from autoplan.zoo.model import build_model

    spec = load_model(name)
    model = build_model(spec, device="meta")
    assert sum(p.param_tensors for p in profile_from_spec(spec)) == len(list(model.parameters()))


@pytest.mark.parametrize("name", TINY)
def test_capture_counts_what_the_analytic_profile_counts(name):
    from autoplan.capture import capture_spec

    spec = load_model(name)
    assert [p.param_tensors for p in capture_spec(spec).profiles] == \
        [p.param_tensors for p in profile_from_spec(spec)]


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_tensor_parallelism_leaves_the_profiles_plain_tensors_plain(name):
    """runtime.parallelize.apply_tp on a 2-rank tp mesh (torch's fake process group): the parameters left plain
    tensors are the ones `LayerProfile.tp_plain_tensors` names."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoplan.runtime.parallelize import apply_tp
    from autoplan.zoo.model import build_model

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    spec = load_model(name)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = build_model(spec)
        apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sp=False)
        plain = sum(1 for p in model.parameters() if not isinstance(p, DTensor))
    finally:
        dist.destroy_process_group()
    assert plain == sum(p.tp_plain_tensors() for p in profile_from_spec(spec))


def _optimizer(cluster, cfg: str) -> float:
    model = load_model("tiny-gpt")
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", kernels="torch")
    plan = make_plan(model, cluster, training, cfg, kernels="torch")
    return estimate(profile_from_spec(model), cluster, training, plan.parallel).breakdown["optimizer"]


@pytest.mark.parametrize("cfg,dtensors", [
    ("dp=4", 0),                # torch's DDP: plain tensors
    ("dp=4,zero=1", 68),        # FSDP2: every tensor of tiny-gpt
    ("dp=4,zero=3", 68),
    ("tp=2,dp=2", 68),          # FSDP2's replicate under tp
    ("tp=4", 68 - 19),          # tp alone: the 18 norm tensors and the position table stay plain
    ("pp=4", 0),
])
def test_the_optimizer_pays_per_dtensor_parameter(cfg, dtensors):
    base = load_cluster("local-cpu", gpus=4)
    without = _optimizer(with_knobs(base, {"dtensor_param_us": 0.0}), cfg)
    with_it = _optimizer(with_knobs(base, {"dtensor_param_us": 50.0}), cfg)
    assert with_it - without == pytest.approx(dtensors * 50e-6, rel=1e-9, abs=1e-12)
