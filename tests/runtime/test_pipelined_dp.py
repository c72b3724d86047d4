"""Which data parallelism a pipelined ZeRO-0 stage runs: torch's DDP where no parameter is a DTensor (tp == 1),
FSDP2's `replicate` where they are (tp > 1), and the cost model's `uses_replicate` says the same.

torch.distributed.pipelining recognises a DDP stage by `isinstance(submod, DistributedDataParallel)` and then
syncs its gradients once, in the last micro-batch's backward; a model whose forward merely runs through a DDP
would be all-reduced in every micro-batch. The stages are built on rank 0 of a fake process group (torch's
`fake` backend: collectives return at once), so 4- and 8-rank layouts are checked in one process, without
training; the numbers of these layouts are tests/dist/test_parity.py's.
"""

from __future__ import annotations

import pytest

from autoplan.api import make_plan
from autoplan.cost_models.estimate import uses_replicate
from autoplan.specs import TrainingSpec, load_cluster, load_model

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def _build(name: str, config: str, world: int):
    """(plan, this rank's ParallelModel) for `config` on rank 0 of a fake `world`-rank process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoplan.runtime.engine import loss_fn
    from autoplan.runtime.parallel_dims import ParallelDims
    from autoplan.runtime.parallelize import parallelize

    spec = load_model(name).model_copy(update={"dropout": 0.0})
    training = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32")
    plan = make_plan(spec, load_cluster("local-cpu").with_gpus(world), training, config)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    dims = ParallelDims.from_plan(plan, world).build_mesh()
    return plan, parallelize(spec, plan, dims, seed=0, device=torch.device("cpu"), n_microbatches=2,
                             loss_fn=loss_fn)


@pytest.fixture
def build():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    yield _build
    if dist.is_initialized():
        dist.destroy_process_group()


def _stage_modules(pm) -> list:
    schedule = pm.schedule
    stages = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
    return [s.submod for s in stages]


@pytest.mark.parametrize("name,config,local", [
    ("tiny-gpt", "pp=2,dp=2", 1),
    ("tiny-gpt", "pp=2,dp=2,schedule=gpipe", 1),
    ("tiny-gpt", "pp=2,vp=2,dp=2,schedule=interleaved", 2),
    ("tiny-llama", "pp=2,cp=2", 1),
    ("tiny-moe", "pp=2,dp=2,ep=2", 1),
])
def test_pipelined_zero0_stage_is_torch_ddp(build, name, config, local):
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from autoplan.runtime.parallelize import is_expert_param

    plan, pm = build(name, config, 4)
    cfg = plan.parallel
    assert not uses_replicate(tp=cfg.tp, zero=cfg.zero, dp_cp=cfg.dp * cfg.cp)
    subs = _stage_modules(pm)
    assert len(subs) == local
    for sub, model in zip(subs, pm.modules, strict=True):
        assert isinstance(sub, DistributedDataParallel)
        assert not any(isinstance(m, FSDPModule) for m in model.modules())
        assert sub.module.model is model  # the DDP wraps the stage's own model: one set of parameters
        # the rest of the runtime (names, checkpoints, the emitted program) keeps the model, not the DDP
        assert not any(n.startswith("module.") for n, _ in model.named_parameters())
        # forwards outside the schedule's no_sync (its shape inference) must leave no reduction pending
        assert sub.require_backward_grad_sync is False
        experts = {f"model.{n}" for n, _ in model.named_parameters() if is_expert_param(n)}
        assert experts == set(sub.parameters_to_ignore)  # reduced over the expert-dp ranks by the engine
        assert bool(experts) == (name == "tiny-moe")
    assert len({id(s) for s in subs}) == local  # one DDP (one reducer) per local stage


def test_pipelined_zero0_stage_with_tensor_parallelism_is_replicate(build):
    """DTensor parameters (tp > 1): DDP's reducer cannot take them, so FSDP2's replicate, as the cost model
    prices it."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    plan, pm = build("tiny-gpt", "tp=2,pp=2,dp=2", 8)
    cfg = plan.parallel
    assert uses_replicate(tp=cfg.tp, zero=cfg.zero, dp_cp=cfg.dp * cfg.cp)
    (sub,) = _stage_modules(pm)
    assert isinstance(sub, FSDPModule) and not isinstance(sub, DistributedDataParallel)
    assert not hasattr(sub, "_autoplan_ddp")
