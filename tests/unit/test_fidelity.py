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
