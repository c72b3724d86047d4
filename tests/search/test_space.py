"""Every enumerated candidate is legal (check_config) and pins restrict the space."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autoplan.cost_models.errors import ConfigError
from autoplan.search.space import all_configs, parse_fix
from autoplan.specs import TrainingSpec, check_config, load_cluster, load_model

CASES = [
    ("tiny-gpt", "dgx-a100-80g", 8, 16, 64),
    ("tiny-llama", "dgx-h100", 16, 32, 64),
    ("tiny-moe", "dgx-h100", 16, 32, 64),
    ("gpt3-1.3b", "dgx-a100-80g", 32, 64, 2048),
]


@pytest.mark.parametrize("model,cluster,gpus,batch,seq", CASES)
def test_every_candidate_passes_check_config(model, cluster, gpus, batch, seq):
    m, c = load_model(model), load_cluster(cluster, gpus=gpus)
    tr = TrainingSpec(global_batch_size=batch, seq_length=seq)
    n = 0
    for cfg in all_configs(m, c, tr):
        checked = check_config(cfg, m, c, tr, stage_layers=False)
        assert checked.tp * checked.pp * checked.cp * checked.dp == c.num_gpus
        assert c.gpus_per_node % checked.tp == 0  # tp innermost, inside a node
        n += 1
    assert n > 0


def test_fix_restricts_enumeration():
    m, c = load_model("tiny-gpt"), load_cluster("dgx-a100-80g", gpus=8)
    tr = TrainingSpec(global_batch_size=16, seq_length=64)
    fix = parse_fix({"tp": "2", "schedule": "interleaved"})
    cfgs = list(all_configs(m, c, tr, fix))
    assert cfgs and all(x.tp == 2 and x.schedule == "interleaved" and x.vp > 1 for x in cfgs)


def test_fix_rejects_unknown_key():
    with pytest.raises(ConfigError):
        parse_fix({"warp": "9"})


def test_search_path_does_not_import_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import autoplan.search.core, autoplan.search.cli"],
                         capture_output=True, text=True, check=True)
    assert "torch" not in out.stderr
