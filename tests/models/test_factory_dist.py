"""A user's own module (`module:factory`) sharded as planned: tensor parallelism on the column/row linears its
capture found, pipeline stages cut at its captured blocks, recomputation, FSDP; two torchrun launches (2 and 4
ranks), each running its layouts in sequence.

Each case trains 3 AdamW steps with the runtime's Trainer; the losses of every step and the first-step gradients
equal the same module trained in one process on the full batch within rtol 1e-5 (fp32, gloo), and the parameter
count the run log reports equals the capture's. See tests/models/factory_parity_worker.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.dist.worker_loop import assert_parity, launch_workers

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("factory_parity_worker.py")
MIXED = "tests/capture/_models.py:mixed_core_lm"
SOFTCAP = "tests/capture/_models.py:softcap_lm"
TIED = "tests/capture/_models.py:tied_lm"
HF = "tests/capture/_models.py:hf_llama"

CASES = [
    "tp=2",  # q/k/v/w1/w3 column-, wo/w2 row-parallel; n_heads and n_kv_heads attributes halved
    "pp=2",  # blocks 0-1 | block 2, head; the later stage's embedding module returns the stage input
    "dp=2,recompute=full",
    "tp=2,recompute=selective",  # only the attention kernel recomputed (selective activation checkpointing)
    "pp=2,recompute=selective",
    f"{MIXED}@tp=2",  # blocks alternate SDPA and matmul/softmax attention: two kinds of block, one set of linears
    f"{SOFTCAP}@tp=2",  # the root forward soft-caps the logits: the head's output is gathered over the vocabulary
    f"{TIED}@tp=2",  # head and embedding share one vocabulary-sharded weight
    f"{TIED}@dp=2,zero=3",  # the tie survives materialising the meta-device module
    "tests/capture/_models.py:split_lm4@pp=2,vp=2",  # interleaved 1F1B, one block per virtual stage
    "tests/capture/_models.py:functional_head_lm@tp=2",  # logits by F.linear on the embedding: vocab replicated
    "tests/capture/_models.py:viewed_ids_lm@tp=2",  # ids viewed before the lookup: the embedding still split
]
if importlib.util.find_spec("transformers") is not None:  # transformers' own LlamaForCausalLM as the user's module
    CASES += [f"{HF}@tp=2", f"{HF}@pp=2,recompute=selective"]
CASES_4 = ["dp=2,tp=2", "tp=2,pp=2", "dp=2,pp=2,zero=3", "dp=2,tp=2,zero=3,recompute=full",
           "dp=2,pp=2"]  # ZeRO-0 pipelined stages are torch's DDP: every parameter of a cut stage is used


def _launch(nproc: int, cases: list[str], out: Path) -> dict[str, dict]:
    return launch_workers(WORKER, nproc, cases, out, ROOT)


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    return _launch(2, CASES, tmp_path_factory.mktemp("factory2") / "results.json")


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return _launch(4, CASES_4, tmp_path_factory.mktemp("factory4") / "results.json")


@pytest.mark.parametrize("case", CASES)
def test_factory_module_sharded_matches_one_process(results2, case):
    _check(results2, case, 2)


@pytest.mark.parametrize("case", CASES_4)
def test_factory_module_sharded_over_4_ranks_matches_one_process(results4, case):
    _check(results4, case, 4)


def _check(results: dict, case: str, world: int) -> None:
    r = assert_parity(results, case)
    assert r["parameters_trained"] == r["parameters_captured"]
    # the profiled step's FLOPs and bytes per collective and mesh dimension equal the plan's counts, which follow
    # the module's capture (autoplan.counts.plan_profiles); a head whose logits the forward transforms
    # (soft-capping) included: its logits are gathered over the vocabulary, with no vocab-parallel loss
    assert r["count_mismatches"] == [], case
    assert r["call_mismatches"] == [], case  # and as many calls of each (the loss's few-byte all-reduces too)
    # the layout was applied, not run unsharded
    layout = case.rpartition("@")[2]
    ranks = r["ranks"]
    pp, vp = (2 if "pp=2" in layout else 1), (2 if "vp=2" in layout else 1)
    blocks = [x["blocks"] for x in ranks]  # blocks each rank runs
    if "tp=2" in layout:
        assert all(x["tp_sharded"] >= 7 * b for x, b in zip(ranks, blocks)), ranks  # 7 linears per block
    if pp == 2:  # pp rank r holds stages r, r + pp, ... (ranks: tp innermost, then dp, then pp)
        assert [x["stages"] for x in ranks] == [list(range(i * pp // world, pp * vp, pp)) for i in range(world)]
        assert all(0 < b < sum(blocks) * pp // world for b in blocks), ranks
    held, n = sum(x["local_params"] for x in ranks), r["parameters_captured"]
    if "dp=2" not in layout and "tp=2" in layout:  # linears split over tp; norms and biases of row linears not
        assert n < held < 2 * n
    elif "dp=2" not in layout:  # pipeline stages: each parameter on exactly one rank
        assert held == n
    if "recompute" in layout:
        assert [x["checkpointed"] for x in ranks] == blocks, ranks
    assert r["ok"]
