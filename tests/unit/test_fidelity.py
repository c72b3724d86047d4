"""Regression guard on the cost model's fidelity against the published runs (benchmarks/fidelity.py).

The calibration constants were fitted per GPU type on these runs (benchmarks/calibrate_fit.py), so this
test says the model still reproduces them within the issue's bounds — it is not evidence of accuracy on
unseen runs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from benchmarks.fidelity import DEFAULT_REF, evaluate

pytestmark = pytest.mark.skipif(not Path(DEFAULT_REF).exists(), reason="shared/reference not present")


def test_step_time_error_within_bounds_on_both_tables():
    rows = evaluate(DEFAULT_REF)
    assert len(rows) == 19
    for table in {r["table"] for r in rows}:
        errs = [abs(r["step_error"]) for r in rows if r["table"] == table]
        assert statistics.mean(errs) <= 0.03, (table, errs)
        assert max(errs) <= 0.07, (table, errs)
    # every published configuration fits in memory under the model
    assert all(r["fits"] for r in rows)


def test_heldout_runs_are_cli_commands_and_stay_guarded():
    """The held-out published runs (never fitted on) go through the CLI's own path; this guards the current
    errors (mean 8.2%, worst 14.8% in session 4; 8.2% / 14.9% in session 5 with corrected inputs; session 6:
    Korthikanti's interleaving and iteration times from the paper, BLOOM's logged iteration time, six more
    Korthikanti rows, 6.8% / 14.9% over 16 runs) against regressions. It is NOT the issue's target (3.5% / 7%),
    which these runs do not meet yet: see docs/cost_model.md."""
    from benchmarks.fidelity import evaluate_heldout, trend

    rows = evaluate_heldout()
    assert len(rows) >= 10 and {r["stack"] for r in rows} >= {"megatron-2022", "megatron-deepspeed", "megatron-core",
                                                              "torchtitan"}
    assert all(r["command"].startswith("autoplan estimate --model ") for r in rows)
    assert any("--layout" in r["command"] for r in rows) and any("--stack-set" in r["command"] for r in rows)
    nemo = [abs(r["step_error"]) for r in rows if r["source"].startswith("NeMo 24.07")]
    errs = [abs(r["step_error"]) for r in rows if not r["source"].startswith("NeMo 24.07")]
    # the 24 rows of sessions 6-18: 3.87% / 11.62% since session 22 (the worst, MT-NLG's 3360-GPU row)
    assert len(errs) == 24 and statistics.mean(errs) <= 0.045 and max(errs) <= 0.125, errs
    # NeMo 24.07's H100 FP8 table, all twelve pre-training rows (session 29): 5.8% / 18.7% (Nemotron 340B);
    # session 30 (TE's backward TP overlap without userbuffers, fp8 gathers, the fused cross-entropy where the
    # configs set it, interleaved gradient sync chunk by chunk): 3.7% / 9.5% (GPT-3 20B)
    assert len(nemo) == 12 and statistics.mean(nemo) <= 0.045 and max(nemo) <= 0.105, nemo
    assert all("--dtype fp8" in r["command"] for r in rows if r["source"].startswith("NeMo 24.07"))
    by_gpus = trend(rows, "gpus", ((1, 512), (513, 1 << 30)))
    assert len(by_gpus) == 2 and all(b["runs"] >= 4 for b in by_gpus)


def test_a_heldout_command_runs_from_the_command_line(capsys):
    import json as _json

    import yaml

    from autoplan.cli import main
    from benchmarks.fidelity import HELDOUT, heldout_command

    run = next(r for r in yaml.safe_load(HELDOUT.read_text())["runs"] if r.get("layout"))  # BLOOM's layout
    assert main(heldout_command(run) + ["--json"]) == 0
    d = _json.loads(capsys.readouterr().out)
    assert d["stack"] == run["stack"] and d["parallel"]["layout"]


def test_published_tokens_per_gpu_second_is_a_step_time():
    """torchtitan publishes throughput as tokens per second per GPU ("WPS"): the step is the global batch's tokens
    over the whole cluster's rate (Llama 3 8B on 64 A100: 64 x 8192 tokens at 2904 per GPU = 2.821 s)."""
    from benchmarks.fidelity import published_step

    run = {"global_batch": 64, "seq_len": 8192, "gpus": 64, "published": {"tokens_per_gpu_s": 2904}}
    assert abs(published_step(run, None) - 64 * 8192 / (2904 * 64)) < 1e-12
    assert abs(published_step(run, None) - 2.8209) < 1e-3


def test_pair_runs_resolve_and_their_scale_pairs_stay_guarded():
    """Runs compared only with each other (benchmarks/published/pair_runs.yaml: torchtitan's H100 tables, measured
    at a 500 W power limit whose clock no source states) go through the CLI's path; every pair names two of them,
    and none enters the held-out means. The data-parallel pairs (8 -> 128 GPUs, all else equal) are guarded at
    what session 28 measured: step-time ratio within 2.5% of the published one, memory change within 1 GiB.
    Async TP's pair is not guarded: the model over-credits it (-12.8%, docs/cost_model.md)."""
    from benchmarks.fidelity import pair_runs, pairs

    only, more = pair_runs()
    names = {r["model"] for r in only}
    assert len(only) >= 8 and all(r["table"] == "pairs only" for r in only)
    assert all(a in names and b in names for _, a, b in more)
    assert all(r["command"].startswith("autoplan estimate --model ") for r in only)
    scale = [p for p in pairs(only, more) if p["pair"].startswith("data parallelism 8 -> 128")]
    assert len(scale) == 3
    for p in scale:
        assert abs(p["residual"]) <= 0.025, p
        assert abs(p["predicted_memory_delta_gib"] - p["published_memory_delta_gib"]) <= 1.0, p
    # Float8 and torch.compile at 8 GPUs: -23.4% before the fp8 GEMMs' casts and the 16-bit attention and head
    # were priced (session 28), -1.5% after; compile +0.3%
    (float8,) = [p for p in pairs(only, more) if p["pair"].startswith("Float8")]
    (compiled,) = [p for p in pairs(only, more) if p["pair"].startswith("torch.compile")]
    assert abs(float8["residual"]) <= 0.03 and abs(compiled["residual"]) <= 0.03, (float8, compiled)
