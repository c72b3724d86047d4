"""Hand-written modules: the fx fall-back, factories, errors naming what stopped the capture, import cost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.capture import CaptureError, capture, capture_model_ref, load_module_factory
from autoplan.cost_models.errors import AutoplanError

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def models(request):
    sys.path.insert(0, str(HERE))
    request.addfinalizer(lambda: sys.path.remove(str(HERE)))
    import _models

    return _models


def _expected(v=96, h=32, layers=3):
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    params = v * h + layers * block + 2 * h + v * h
    return params, block


def test_factory_ref_and_counts(models):
    module, inputs = load_module_factory(f"{HERE / '_models.py'}:tiny_lm")
    g = capture(module, inputs)
    params, _ = _expected()
    assert g.num_parameters == params == sum(p.params for p in g.profiles)
    assert g.blocks == ["blocks.0", "blocks.1", "blocks.2"] and g.block_groups[0].count == 3
    assert (g.capture_batch, g.capture_seq) == (2, 8)
    h, v, s = 32, 96, 8
    assert g.flops_per_token() == pytest.approx(3 * (2 * 12 * h * h + 4 * s * h) + 2 * v * h)
    blk = g.profiles[1]
    assert [gm.tp for gm in blk.gemms] == ["col", "row", "col", "row"]
    assert blk.attention.heads == 4 and blk.attention.kv_heads == 4
    assert g.profiles[-1].gemms[0].tp == "vocab"  # n == vocabulary of the token embedding
    # the dotted form goes through importlib
    sys.path.insert(0, str(HERE))
    try:
        again = capture_model_ref("_models:tiny_lm")
    finally:
        sys.path.remove(str(HERE))
    assert again.num_parameters == params


def test_fx_fallback_gives_the_same_profile(models):
    import torch

    with torch.device("meta"):
        model = models.TinyLM()
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    fx = capture(model, (tokens,), method="fx")
    ex = capture(model, (tokens,), method="export")
    assert fx.method == "torch.fx" and ex.method == "torch.export"
    assert fx.blocks == ex.blocks and fx.num_parameters == ex.num_parameters
    assert fx.flops_per_token() == pytest.approx(ex.flops_per_token())
    for a, b in zip(fx.profiles, ex.profiles):
        assert a.gemms == b.gemms and a.attention == b.attention and a.params == b.params, a.name


def test_data_dependent_control_flow_names_the_construct(models):
    import torch

    with torch.device("meta"):
        model = models.TinyLM(branchy=True)
    tokens = torch.zeros(1, 8, dtype=torch.long, device="meta")
    with pytest.raises(CaptureError) as e:
        capture(model, (tokens,))
    err = e.value
    assert isinstance(err, AutoplanError)
    assert "data-dependent" in err.rule and "TinyLM" in err.rule
    assert "x.sum() > 0" in err.detail  # the offending line of the user's code
    assert err.hint


def test_model_without_a_block_stack_is_refused():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    with pytest.raises(CaptureError, match="no stack of transformer blocks"):
        capture(Net().to("meta"), (torch.zeros(2, 4, 8, device="meta"),))


@pytest.mark.parametrize("ref,match", [
    ("no_colon_here", "package.module:factory"),
    ("no_such_pkg_xyz.mod:f", "cannot import"),
    (f"{HERE / '_models.py'}:missing", "no callable"),
    (f"{HERE / '_models.py'}:not_a_pair", r"must return \(module, example_inputs\)"),
])
def test_factory_errors(ref, match):
    with pytest.raises(CaptureError, match=match):
        load_module_factory(ref)


def test_importing_capture_does_not_import_torch():
    code = ("import sys, autoplan, autoplan.capture, autoplan.capture.report, autoplan.capture.analyze;"
            "from autoplan.capture import ModelGraph, CaptureError;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_batched_expert_weights_and_several_weights_in_one_module(models):
    import torch

    with torch.device("meta"):
        model = models.ExpertLM()
    g = capture(model, (torch.zeros(2, 8, dtype=torch.long, device="meta"),))
    h, f, e, v = 16, 24, 4, 64
    blk = {gm.name: gm for gm in g.profiles[1].gemms}
    assert set(blk) == {"q", "o", "einsum", "bmm"}
    assert (blk["q"].tp, blk["o"].tp) == ("col", "row")
    up, down = blk["einsum"], blk["bmm"]
    assert (up.n, up.k, up.count, up.expert, up.tp) == (f, h, e, True, "col")
    assert (down.n, down.k, down.count, down.expert, down.tp) == (h, f, e, True, "row")
    # every token goes through one expert: rows per token = 1 in total over the experts
    assert up.tokens_per_token == pytest.approx(1.0) and g.profiles[1].moe_experts == e
    assert g.num_parameters == sum(p.params for p in g.profiles)
    assert g.flops_per_token() == pytest.approx(2 * (4 * h * h + 4 * h * f) + 2 * v * h)
