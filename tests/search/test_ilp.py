"""The stage ILP equals exhaustive enumeration of every contiguous layout and per-stage recomputation."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplan.search.ilp import StageILP, solve_stage_problem
from autoplan.search.problem import (
    BlockCost,
    StageChoice,
    StageProblem,
    brute_force,
    evaluate,
    feasible,
    greedy_bound,
)

GIB = 2**30


@st.composite
def blocks(draw):
    work = draw(st.floats(0.5, 2.0))
    an = draw(st.floats(1.0, 4.0)) * GIB
    sel = draw(st.sampled_from([1.0, 0.7]))  # 1.0: flash attention (selective is free and saves nothing)
    return BlockCost(work=work, rec_sel=0.0 if sel == 1.0 else 0.1 * work, rec_full=work / 3,
                     act_none=an, act_sel=an * sel, act_full=draw(st.floats(0.05, 0.5)) * GIB,
                     static=draw(st.floats(1.0, 6.0)) * GIB)


@st.composite
def problems(draw):
    L = draw(st.integers(1, 6))
    pp = draw(st.integers(1, min(3, L)))
    vp = draw(st.integers(1, max(1, min(2, L // pp)))) if pp > 1 else 1
    hetero = draw(st.booleans())
    b = draw(blocks())
    bl = tuple(draw(blocks()) for _ in range(L)) if hetero else (b,) * L
    m = draw(st.integers(1, 8))
    infl = tuple(float(min(pp - r, m)) for r in range(pp))
    cap = tuple(draw(st.floats(8.0, 60.0)) * GIB for _ in range(pp))
    first = BlockCost(work=0.3, act_none=0.5 * GIB, static=2 * GIB)
    # a head as heavy as a few blocks (a large vocabulary) makes a last stage of only the head worth its place
    last = BlockCost(work=draw(st.sampled_from([0.6, 3.0])), act_none=1.5 * GIB, static=2 * GIB)
    pin = draw(st.sampled_from([None, None, None, "none", "selective", "full"]))
    # pipeline messages' occupancy: a stage with two neighbours pays twice an end stage's (p2p_occupancy)
    msg = draw(st.sampled_from([0.0, 0.05, 0.4])) if pp * vp > 1 else 0.0
    S = pp * vp
    extra = tuple(msg * ((s > 0) + (s < S - 1)) for s in range(S)) if msg else ()
    return StageProblem(bl, first, last, pp, vp, m, infl, cap, pin, stage_extra=extra)


def _ilp_as_brute_force(p, solve=solve_stage_problem):
    """The ILP's layout for `p` (None where brute force finds none, and then the ILP must not either): feasible and
    as good as the exhaustive optimum."""
    bf = brute_force(p)
    sol = solve(p) if bf is not None else solve_stage_problem(p)
    if bf is None:
        assert sol is None
        return None
    assert sol is not None
    obj, mem = evaluate(p, sol.stages)
    assert feasible(p, mem)
    assert abs(obj - bf.objective) <= 1e-6 * bf.objective
    g = greedy_bound(p)  # the ranking proxy is a feasible layout's objective, where it finds one
    if p.identical_blocks and g != float("inf"):
        assert g >= bf.objective * (1 - 1e-9)
    return sol


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_ilp_equals_brute_force(p):
    sol = _ilp_as_brute_force(p, lambda q: StageILP(q).build().solve())
    if sol is None:
        return
    # the layout is a contiguous cover with at least one block per stage, but the first and last stage of an
    # interleaved pipeline, which may hold only the embedding or the head
    assert sol.stages[0].start == 0 and sol.stages[-1].stop == p.num_blocks
    assert all(a.stop == b.start for a, b in zip(sol.stages, sol.stages[1:], strict=False))
    inner = sol.stages[1:-1] if p.empty_end_stages else sol.stages
    assert all(s.stop > s.start for s in inner)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems().filter(lambda p: p.pin is None))
def test_ilp_without_full_recompute_equals_brute_force(p):
    """The search's second layout per candidate (`StageProblem.no_full`)."""
    p = replace(p, no_full=True)
    bf = brute_force(p)
    sol = solve_stage_problem(p)
    if bf is None:
        assert sol is None
        return
    assert sol is not None and all(c.recompute != "full" for c in sol.stages)
    assert abs(evaluate(p, sol.stages)[0] - bf.objective) <= 1e-6 * bf.objective


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems().filter(lambda p: p.pin in (None, "none", "full")), st.booleans())
def test_ilp_without_selective_recompute_equals_brute_force(p, no_full):
    """A software stack without selective recomputation (`StageProblem.no_selective`, TrainingSpec.recompute_modes
    "full" or "none"): no stage recomputes selectively, and one that recomputes fully does so for every block."""
    p = replace(p, no_selective=True, no_full=no_full and p.pin is None)
    bf = brute_force(p)
    sol = solve_stage_problem(p)
    if bf is None:
        assert sol is None
        return
    assert sol is not None
    assert all(c.recompute == "none" or (c.recompute == "full" and c.recompute_layers == c.stop - c.start
                                         and not p.no_full) for c in sol.stages)
    assert abs(evaluate(p, sol.stages)[0] - bf.objective) <= 1e-6 * bf.objective
    g = greedy_bound(p)
    if p.identical_blocks and g != float("inf"):
        assert g >= bf.objective * (1 - 1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.booleans())
def test_ilp_with_plain_rest_equals_brute_force(p, no_selective):
    """Megatron's block method (`StageProblem.rest_none`, TrainingSpec.partial_recompute=rest-none): a stage's
    blocks after its fully recomputed prefix recompute nothing, so a stage is selective or has a full prefix."""
    p = replace(p, rest_none=True, no_selective=no_selective and p.pin != "selective")
    sol = _ilp_as_brute_force(p)
    assert sol is None or not p.no_selective or all(c.recompute != "selective" for c in sol.stages)


def test_a_partly_full_stage_prices_its_rest_as_the_stack_runs_it():
    """Two of four blocks in full: the other two recompute their attention core (autoplan's runtime), or nothing
    (rest_none): less work, their whole activations kept."""
    b = BlockCost(work=1.0, rec_sel=0.1, rec_full=0.3, act_none=4 * GIB, act_sel=3 * GIB, act_full=0.5 * GIB,
                  static=GIB)
    p = StageProblem((b,) * 4, BlockCost(work=0.0), BlockCost(work=0.0), 1, 1, 2, (1.0,), (100 * GIB,))
    stage = (StageChoice(0, 4, "full", 2),)
    (sel_obj, (sel_mem,)), (plain_obj, (plain_mem,)) = evaluate(p, stage), evaluate(replace(p, rest_none=True), stage)
    assert abs(sel_obj - plain_obj - 2 * (2 * 0.1)) < 1e-9  # objective (m - 1/v) W + W / v = 2 W; two blocks' rec_sel
    assert plain_mem - sel_mem == 2 * (4 - 3) * GIB


@settings(max_examples=40, deadline=None)
@given(problems())
def test_greedy_is_feasible_upper_bound_for_identical_blocks(p):
    if not p.identical_blocks:
        return
    g = greedy_bound(p)
    bf = brute_force(p)
    if bf is None:
        assert g == float("inf")
    elif g != float("inf"):
        assert g >= bf.objective * (1 - 1e-9)


def test_a_heavy_head_gets_a_virtual_stage_of_its_own():
    """Interleaved, with a head as heavy as six blocks: the best layout (brute force over every split, the end
    stages allowed to be empty) leaves the last virtual stage to the head alone, and the ILP finds it; the greedy
    proxy may use the empty stage too and stays an upper bound."""
    b = BlockCost(work=1.0, act_none=1 * GIB, act_sel=1 * GIB, act_full=0.1 * GIB, static=1 * GIB)
    p = StageProblem((b,) * 8, BlockCost(work=0.1, static=1 * GIB), BlockCost(work=6.0, static=1 * GIB), 2, 2, 8,
                     (3.0, 2.0), (80 * GIB, 80 * GIB), "none")
    assert p.empty_end_stages and [p.min_blocks(r) for r in range(2)] == [1, 1]  # both ranks hold an end
    bf = brute_force(p)
    sol = solve_stage_problem(p)
    assert sol is not None and abs(sol.objective - bf.objective) <= 1e-9 * bf.objective
    assert [s.stop - s.start for s in sol.stages][-1] == 0
    # the same problem with every stage holding a block is strictly worse
    blocked = min(evaluate(p, tuple(StageChoice(a, b_, "none") for a, b_ in zip(c, c[1:], strict=False)))[0]
                  for c in ([0, n0, n0 + n1, n0 + n1 + n2, 8] for n0 in range(1, 6) for n1 in range(1, 6)
                            for n2 in range(1, 6)) if c[3] < 8)
    assert bf.objective < blocked
    assert greedy_bound(p) >= bf.objective * (1 - 1e-9)


def test_the_positional_ilp_also_leaves_the_head_alone():
    """Heterogeneous blocks (the positional ILP: every stage start one block earlier or later where the end stages
    may be empty) on the problem above: the ILP's optimum equals the exhaustive one, whose last stage is empty."""
    mk = [BlockCost(work=w, act_none=1 * GIB, act_sel=1 * GIB, act_full=0.1 * GIB, static=1 * GIB)
          for w in (0.9, 1.1)]
    p = StageProblem(tuple(mk[i % 2] for i in range(8)), BlockCost(work=0.1, static=1 * GIB),
                     BlockCost(work=6.0, static=1 * GIB), 2, 2, 8, (3.0, 2.0), (80 * GIB, 80 * GIB), "none")
    assert not p.identical_blocks and p.empty_end_stages
    bf = brute_force(p)
    sol = StageILP(p).build().solve()
    assert sol.method == "ilp" and abs(sol.objective - bf.objective) <= 1e-9 * bf.objective
    assert sol.stages[-1].stop == sol.stages[-1].start == 8
