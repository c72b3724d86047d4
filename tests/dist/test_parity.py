"""Loss and gradient parity of every parallel layout against a single-process run (gloo, real processes).

Two torchrun launches (2 and 4 processes) each run many layouts in sequence (tests/dist/parity_worker.py);
each case below is one pytest item reading its launch's result: losses of 10 steps and gradients after the
first step equal to the single-process reference with rtol 1e-5 (fp32). Plans are made with the planner's
API (`make_plan` with the configuration fixed), never hand-wired.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.worker_loop import assert_parity, launch_workers

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("parity_worker.py")

DENSE_2 = [
    "dp=2", "tp=2", "tp=2,sp=1", "cp=2", "pp=2", "pp=2,vp=2", "pp=2,schedule=gpipe",
    "dp=2,zero=1", "dp=2,zero=3", "dp=2,recompute=full", "cp=2,recompute=selective",
]
CASES_2 = [f"{m}:{c}" for m in ("tiny-gpt", "tiny-llama") for c in DENSE_2] + [
    "tiny-gpt:dp=2,zero=2",
    "tiny-gpt:tp=2,sp=1,recompute=selective",
    "tiny-gpt:pp=2,recompute=full",
    "tiny-moe:dp=2,ep=2",
    "tiny-moe:dp=2,ep=2,zero=3",
    # experts replicated over dp (ep=1): reduced with the rest (they are left out of DDP/FSDP, session 13 found
    # them never reduced)
    "tiny-moe:dp=2",
    "tiny-moe:dp=2,zero=2",
    "tiny-moe:tp=2,sp=1",
    "tiny-llama:dp=2|fused",
    "tiny-gpt:tp=2|fused",
    # explicit layouts (blocks per stage): virtual stages holding only the embedding / only the loss
    "tiny-gpt:pp=2,vp=2,layout=0/2/2/0",
    "tiny-llama:pp=2,layout=1/3",
    # three micro-batches on pp=2: the interleaved schedule in one round of three (pipeline.microbatch_group)
    "tiny-gpt:pp=2,vp=2,mbs=1@gbs=3",
]
DENSE_4 = ["tp=2,pp=2", "dp=2,tp=2", "dp=2,pp=2"]
CASES_4 = [f"{m}:{c}" for m in ("tiny-gpt", "tiny-llama") for c in DENSE_4] + [
    "tiny-llama:cp=2,tp=2,sp=1",
    "tiny-gpt:dp=2,tp=2,zero=3",
    "tiny-llama:pp=2,vp=2,tp=2,recompute=full",
    "tiny-moe:dp=4,ep=2",
    "tiny-moe:pp=2,dp=2,ep=2",
    # pipelined ZeRO-0 stages are torch's DDP (runtime.parallelize.apply_ddp): every schedule, one DDP per
    # virtual stage, the tied embedding (tiny-gpt) and context parallelism in the DDP group
    "tiny-gpt:dp=2,pp=2,schedule=gpipe",
    "tiny-gpt:dp=2,pp=2,vp=2,schedule=interleaved",
    "tiny-llama:pp=2,cp=2",
    # four cp ranks: the position-ordered gather of eight chunks, GQA, each query chunk against its key prefix
    "tiny-llama:cp=4,recompute=full",
    "tiny-moe:dp=2,tp=2,ep=2|fused",
]


def _launch(nproc: int, cases: list[str], tmp: Path) -> dict[str, dict]:
    return launch_workers(WORKER, nproc, cases, tmp / f"parity{nproc}.json", ROOT)


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    return _launch(2, CASES_2, tmp_path_factory.mktemp("parity2"))


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return _launch(4, CASES_4, tmp_path_factory.mktemp("parity4"))


def _check(results: dict, case: str) -> None:
    r = assert_parity(results, case)
    if case.endswith("|fused"):
        assert r["fused_modules"] > 0, f"{case}: no kernels.modules substituted"
    else:
        assert r["fused_modules"] == 0
    assert r["ok"]


@pytest.mark.parametrize("case", CASES_2)
def test_parity_2_processes(results2, case):
    _check(results2, case)


@pytest.mark.parametrize("case", CASES_4)
def test_parity_4_processes(results4, case):
    _check(results4, case)
