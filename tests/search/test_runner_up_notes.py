"""The search table's "why not #1" note says what the step-time difference is made of, without overstating it."""

from __future__ import annotations

from types import SimpleNamespace

from autoplan.search.core import _why_slower


def _est(step: float, **parts: float) -> SimpleNamespace:
    keys = ("compute", "recompute", "tp_cp_ep_comm", "pp_comm", "bubble", "dp_comm", "embedding_comm", "optimizer")
    return SimpleNamespace(step_time_s=step, breakdown={k: parts.get(k, 0.0) for k in keys})


BEST = _est(10.0, compute=8.0, bubble=1.0, dp_comm=1.0)


def test_one_part_making_most_of_the_difference_is_named_as_most_of_it():
    assert _why_slower(_est(11.0, compute=8.1, bubble=1.9, dp_comm=1.0), BEST) == \
        "+10.0% step time; most of it bubble (+0.900 s)"


def test_a_part_larger_than_the_difference_names_what_got_cheaper():
    # bubble +3, compute -2: "most of it" would say 3 s of a 1 s difference
    assert _why_slower(_est(11.0, compute=6.0, bubble=4.0, dp_comm=1.0), BEST) == \
        "+10.0% step time; bubble +3.000 s, compute -2.000 s"


def test_a_spread_difference_names_its_largest_part():
    assert _why_slower(_est(11.0, compute=8.3, bubble=1.3, dp_comm=1.4, optimizer=0.0), BEST) == \
        "+10.0% step time; largest part dp comm (+0.400 s)"


def test_no_slower_is_a_tie():
    assert _why_slower(_est(10.0, compute=8.0, bubble=1.0, dp_comm=1.0), BEST) == "ties with the best plan"
