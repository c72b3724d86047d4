"""Sharded training of Hugging Face families against transformers' unsharded model (gloo, one torchrun launch).

Each case: transformers' model saved with save_pretrained, the runtime's sharded model loaded from it with
--init-from (every rank reading its own slices), 3 AdamW steps; losses of every step and first-step gradients
equal to transformers' full-batch run within rtol 1e-5 (fp32). See tests/models/hf_parity_worker.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.worker_loop import assert_parity, launch_workers

pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("hf_parity_worker.py")

CASES = [
    "llama:tp=2", "phi3:tp=2", "mistral:tp=2",  # tp (Phi-3's fused qkv/gate_up read as column slices)
    "gemma2:tp=2,sp=1", "gpt_neox:tp=2,sp=1", "opt-postnorm:tp=2,sp=1", "gpt2:tp=2,sp=1",  # sp
    "llama:pp=2", "gemma:pp=2", "gpt2:pp=2",  # pipeline (gemma, gpt2: heads tied across stages)
    "phi3:dp=2,zero=3", "opt:dp=2,zero=3", "qwen2:dp=2,zero=3",  # fsdp
    "mixtral:dp=2,ep=2", "qwen2_moe:dp=2,ep=2",  # ep (files keep one tensor per expert)
    "llama:cp=2",  # cp
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch_workers(WORKER, 2, CASES, tmp_path_factory.mktemp("hfparity") / "results.json", ROOT)


@pytest.mark.parametrize("case", CASES)
def test_sharded_hf_family_matches_transformers(results, case):
    r = assert_parity(results, case, against="transformers")
    assert r["ok"]
