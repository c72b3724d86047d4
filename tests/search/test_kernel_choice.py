"""The search runs torch's kernels where autoplan's fused modules' host time would make the step slower
(search.core._choose_kernels): only for autoplan's own runtime on a GPU, only when the user left the kernel set
to the stack, and the plan's prediction is then the torch kernels' own."""

from __future__ import annotations

import pytest

from autoplan.api import make_plan
from autoplan.search.core import search
from autoplan.specs import TrainingSpec, load_cluster, load_model

MODEL = load_model("gpt3-1.3b")
TRAINING = TrainingSpec(global_batch_size=8, seq_length=2048, dtype="bf16")  # autoplan's stack: fused kernels


def _h200(fused_call_us: float | None = None):
    cluster = load_cluster("dgx-h200", gpus=1)
    if fused_call_us is None:
        return cluster
    cal = cluster.gpu.calibration.model_copy(update={"fused_call_us": fused_call_us})
    return cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"calibration": cal})})


def test_host_bound_step_runs_torch_kernels():
    """GPT-1.3B at 2 x 2048 tokens on an H200: the forward is bound by the host (measured 0.382 s a step with
    torch's kernels, 0.429 with the fused ones, session 17), and the search says so."""
    res = search(MODEL, _h200(), TRAINING, fix={"mbs": "2"})
    assert res.plan.kernels == "torch" and res.plan.training.kernels == "torch"
    own = make_plan(MODEL, _h200(), TRAINING, res.plan.parallel, kernels="torch")
    fused = make_plan(MODEL, _h200(), TRAINING, res.plan.parallel, kernels="fused")
    assert res.plan.prediction.step_time_s == pytest.approx(own.prediction.step_time_s, rel=1e-9)
    assert own.prediction.step_time_s < fused.prediction.step_time_s
    assert "torch's kernels" in res.stats.kernels_note
    assert res.as_json()["kernels"] == "torch"


@pytest.mark.parametrize("case", ["pinned", "no host time", "device-bound"])
def test_fused_kernels_stay_where_they_should(case):
    """--kernels fused pins the set; a cluster that has not measured the fused modules' host time, or a step the
    GPU bounds (8 sequences a micro-batch), keeps the stack's fused kernels."""
    kw, cluster, fix = {}, _h200(), {"mbs": "2"}
    if case == "pinned":
        kw = {"kernels": "fused"}
    elif case == "no host time":
        cluster = _h200(0.0)
    else:
        fix = {"mbs": "8"}
    res = search(MODEL, cluster, TRAINING, fix=fix, **kw)
    assert res.plan.kernels == "fused" and res.stats.kernels_note == ""


def test_estimate_says_when_torch_kernels_would_be_faster(capsys):
    """`autoplan estimate` prices the configuration it is given with the stack's kernels, and where torch's are
    predicted faster says so (text and --json); with --kernels given it says nothing."""
    import json

    from autoplan.cli import main

    args = ["estimate", "--model", "gpt3-1.3b", "--cluster", "dgx-h200", "--gpus", "1", "--global-batch", "8",
            "--seq-len", "2048", "--parallel", "tp=1,pp=1,dp=1,mbs=2"]
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    own = make_plan(MODEL, _h200(), TRAINING, "tp=1,pp=1,dp=1,mbs=2", kernels="torch")
    assert d["faster_kernels"]["kernels"] == "torch"
    assert d["faster_kernels"]["step_time_s"] == pytest.approx(own.prediction.step_time_s, rel=1e-9)
    assert d["faster_kernels"]["step_time_s"] < d["step_time_s"]
    assert main(args) == 0
    assert "--kernels torch" in capsys.readouterr().out.replace("\n", " ")
    assert main([*args, "--kernels", "fused", "--json"]) == 0
    assert "faster_kernels" not in json.loads(capsys.readouterr().out)
