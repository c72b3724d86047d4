r"""The stage ILP: contiguous layer -> stage assignment and per-stage recomputation, solved with pulp (HiGHS, or CBC).

One candidate (tp, cp, ep, pp, dp, vp, mbs, sp, ZeRO, schedule) fixes every per-block cost; what is left is
where the stage boundaries go and how much each stage recomputes. Notation (`problem.StageProblem`):

    S = pp * vp stages, stage s on rank r(s) = s mod pp; L blocks; m micro-batches; v = vp.
    per block i: w_i (fwd+bwd), rs_i / rf_i (extra time selective / full), an_i, as_i, af_i (activation
    bytes none / selective / full, af_i <= as_i <= an_i), st_i (static bytes), e_i = an_i - af_i (transient of a
    fully recomputed block); the embedding (stage 0) and head (stage S-1) add constants c^w_s, c^a_s, c^st_s,
    and every stage's pipeline messages add work c^w_s (`StageProblem.stage_extra`).
    inflight_r micro-batches held by rank r (the schedule's warm-up), capacity Cap_r bytes.

Minimise  (m - 1/v) * T + (1/v) * sum_s W_s                  (closed-form makespan of the schedule)
subject to (family names as in the `add_<family>_constraint` methods; every constraint is named
`<family>_s<stage>` or `<family>_r<rank>` so an infeasible or surprising answer can be traced):

  bottleneck      T >= sum_{s: r(s)=r} W_s                                          for every rank r
  memory          sum_{s on r} (static_s + inflight_r * A_s) + X_r <= Cap_r         for every rank r
  transient       X_r >= e * [stage s recomputes a block fully]                      for s on r
  work            W_s >= c^w_s + work of its blocks + rf of its full blocks + rs of the rest if sigma_s
  activation      A_s >= c^a_s + af of its full blocks + (as if sigma_s else an) of the rest
  full_selective  a stage that recomputes fully recomputes the rest selectively (sigma_s = 1)
  full_plain      ... or, under Megatron's block method (`StageProblem.rest_none`), the rest not at all:
                  a stage either recomputes selectively or has a full prefix (sigma_s + phi_s <= 1)
  cover / order   the stages partition the blocks contiguously, each stage >= 1 block; under interleaving the
                  first stage may hold only the embedding and the last only the head
                  (`StageProblem.empty_end_stages`: N_r >= vp - 1 on their ranks in the compact form, every
                  start one block earlier or later in the positional one)
  pin             `--fix recompute=...` fixes every stage's mode
  no_full         no stage recomputes a block fully (`StageProblem.no_full`: the search's second layout)
  no_selective    no block is recomputed selectively, so a stage that recomputes fully does so for every block
                  (`StageProblem.no_selective`: a software stack without selective recomputation), unless
                  its other blocks recompute nothing anyway (rest_none: then sigma_s = 0)

"if sigma_s" terms are linearised with big-M: W_s >= base + rs_rest - M_w (1 - sigma_s) and W_s >= base;
A_s >= base + as_rest and A_s >= base + an_rest - M_a sigma_s, with M_a >= any stage's savings (an >= as).
Minimisation drives W_s and A_s down onto the true values, so every feasible ILP point is a real layout
whose true memory is within capacity, and the optimum is the true optimum of the objective above.

Two formulations, chosen automatically:

* compact (all blocks identical, the usual case): per stage integers n_s (blocks) and k_s (fully recomputed
  blocks), binaries sigma_s, phi_s (k_s >= 1), and u_s = sigma_s * (n_s - k_s) linearised as
  u_s >= n_s - k_s - L (1 - sigma_s). Only counts matter when blocks are identical, and any count vector is
  realised contiguously. About 6 S variables.
* positional (heterogeneous blocks, e.g. MoE every other layer or a captured model): one-hot binaries
  y_{s,j} (stage s starts at block j) and z_{s,j} (stage s's fully recomputed prefix ends at j). With prefix
  sums P^x[j] = sum_{i<j} x_i every stage quantity is linear: e.g. the work of stage s is
  sum_j P^w[j] (y_{s+1,j} - y_{s,j}). The transient is exact per block: block i is fully recomputed in
  stage s iff sum_{j<=i} y_{s,j} - sum_{j<=i} z_{s,j} = 1.

The objective is the schedule's closed form, not the simulated pipeline: the search re-estimates the chosen
candidates with `autoplan.cost_models.estimate.estimate` (simulation) before ranking them. CBC runs single-threaded
with a fixed seed, so the same problem always gives the same answer (ties between equal-objective layouts
are broken by CBC's deterministic search, not by a rule of ours).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import pulp

from .problem import FULL, NONE, SELECTIVE, StageChoice, StageProblem, StageSolution, evaluate, feasible


class InfeasibleStageProblem(Exception):
    """No layout fits; `families` names the constraint families that cannot all hold."""

    def __init__(self, families: list[str]) -> None:
        self.families = families
        super().__init__("infeasible: " + ", ".join(families))


def ilp_solver_name() -> str:
    """'highs' (in-process through highspy, the default where it is installed) or 'cbc' (pulp's bundled CBC,
    run as a subprocess per solve); $AUTOPLAN_ILP_SOLVER picks one."""
    want = os.environ.get("AUTOPLAN_ILP_SOLVER", "").strip().lower()
    if want in ("cbc", "highs"):
        return want
    return "highs" if _highs_available() else "cbc"


@functools.lru_cache(maxsize=1)
def _highs_available() -> bool:
    try:
        return bool(pulp.HiGHS(msg=False).available())
    except Exception:  # noqa: BLE001 - a pulp without the HiGHS API
        return False


@contextlib.contextmanager
def _quiet_stdout(on: bool):
    """HiGHS prints its banner from C++ to file descriptor 1 when a solver object is made, before pulp can set
    output_flag=False; `search --json` must print JSON only, so fd 1 points at /dev/null for the solve."""
    if not on:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


# Relative optimality gap at which the solvers stop. Their defaults (HiGHS mip_rel_gap 1e-4, CBC's ratio gap)
# accept a layout up to 0.01% slower than the best: a near-tie then goes to the worse layout (hypothesis found
# one 1.2e-6 above brute force, tests/search/test_ilp.py). The stage problems are small; closing the gap is cheap.
MIP_REL_GAP = 1e-9


def ilp_solver(time_limit_s: float):
    if ilp_solver_name() == "highs" and _highs_available():
        # threads=1: deterministic and fair on a shared machine; HiGHS's default random seed is fixed.
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1, gapRel=MIP_REL_GAP)
    return pulp.PULP_CBC_CMD(msg=False, threads=1, timeLimit=time_limit_s, gapRel=MIP_REL_GAP,
                             options=["randomSeed 1", "randomCbcSeed 1"])


class StageILP:
    """Builds and solves the stage ILP of one `StageProblem` (see the module docstring)."""

    def __init__(self, problem: StageProblem, *, time_limit_s: float = 30.0) -> None:
        self.p = problem
        self.time_limit_s = time_limit_s
        self.compact = problem.identical_blocks
        self.prob = pulp.LpProblem("stage_layout", pulp.LpMinimize)
        S, L, pp, v = problem.num_stages, problem.num_blocks, problem.pp, problem.vp
        self.S, self.L = S, L
        # Units inside the ILP, so that CBC sees numbers of order 1-100 whatever the instance: times relative
        # to the largest single layer, bytes relative to the largest capacity.
        biggest = max([b.work for b in problem.blocks] + [problem.first.work, problem.last.work, 1e-30])
        self._MS = 10.0 / biggest
        self._GB = 100.0 / max(max(problem.capacity), 1e-30)
        self.T = self._var("T", lowBound=0)
        self.X = [self._var(f"X_r{r}", lowBound=0) for r in range(pp)]
        if self.compact:
            # Rank level: N_r blocks, K_r of them fully recomputed, U_r selectively (the rest not at all).
            floor = [problem.min_blocks(r) for r in range(pp)]
            hi = L - sum(floor) + max(floor)
            self.R = [self._var(f"R_r{r}", lowBound=0) for r in range(pp)]
            self.A = [self._var(f"A_r{r}", lowBound=0) for r in range(pp)]
            self.N = [self._var(f"N_r{r}", lowBound=floor[r], upBound=hi, cat="Integer") for r in range(pp)]
            self.K = [self._var(f"K_r{r}", lowBound=0, upBound=hi, cat="Integer") for r in range(pp)]
            self.U = [self._var(f"U_r{r}", lowBound=0, upBound=hi, cat="Integer" if v > 1 else "Continuous")
                      for r in range(pp)]
            self.phi = [self._var(f"phi_r{r}", cat="Binary") for r in range(pp)]
            self.sigma = [self._var(f"sigma_r{r}", cat="Binary") for r in range(pp)]
        else:
            self.W = [self._var(f"W_s{s}", lowBound=0) for s in range(S)]
            self.A = [self._var(f"A_s{s}", lowBound=0) for s in range(S)]
            self.sigma = [self._var(f"sigma_s{s}", cat="Binary") for s in range(S)]
            # y[s][j]: stage s starts at block j (s = 1..S-1); z[s][j]: its full prefix ends at block j. With empty
            # end stages allowed every start may lie one block earlier (stage 0 empty) or later (stage S-1 empty).
            self.e = 1 if problem.empty_end_stages else 0
            self.y: list[dict[int, pulp.LpVariable]] = [{} for _ in range(S)]
            self.z: list[dict[int, pulp.LpVariable]] = [{} for _ in range(S)]
            for s in range(1, S):
                for j in range(max(0, s - self.e), min(L, L - (S - s) + self.e) + 1):
                    self.y[s][j] = self._var(f"y_s{s}_j{j}", cat="Binary")
            for s in range(S):
                for j in range(max(0, s - self.e), min(L, L - (S - s - 1) + self.e) + 1):
                    self.z[s][j] = self._var(f"z_s{s}_j{j}", cat="Binary")
            self.prefix = {f: self._prefix(f) for f in ("work", "rec_full", "rec_sel", "act_none", "act_sel",
                                                          "act_full", "static")}

    # ------------------------------------------------------------------------------ building blocks

    def _var(self, name: str, lowBound=None, upBound=None, cat: str = "Continuous"):  # noqa: N803 (pulp's names)
        return self.prob.add_variable(name, lowBound=lowBound, upBound=upBound, cat=cat)

    def _prefix(self, field: str) -> list[float]:
        out = [0.0]
        for b in self.p.blocks:
            out.append(out[-1] + getattr(b, field))
        return out

    def _start(self, s: int):
        """Position of stage s's first block (an expression; s = S gives L)."""
        if s == 0:
            return 0
        if s == self.S:
            return self.L
        return pulp.lpSum(j * v for j, v in self.y[s].items())

    def _at_start(self, s: int, field: str):
        """P^field at stage s's first block."""
        P = self.prefix[field]
        if s == 0:
            return 0.0
        if s == self.S:
            return P[self.L]
        return pulp.lpSum(P[j] * v for j, v in self.y[s].items())

    def _at_full(self, s: int, field: str):
        P = self.prefix[field]
        return pulp.lpSum(P[j] * v for j, v in self.z[s].items())

    def _full_end(self, s: int):
        return pulp.lpSum(j * v for j, v in self.z[s].items())

    def _const(self, s: int, field: str) -> float:
        c = self.p.extra_work(s) if field == "work" else 0.0
        if s == 0:
            c += getattr(self.p.first, field)
        if s == self.S - 1:
            c += getattr(self.p.last, field)
        return c

    def _rank_const(self, r: int, field: str) -> float:
        return sum(self._const(s, field) for s in self._stages_of(r))

    def _stages_of(self, r: int) -> list[int]:
        return list(range(r, self.S, self.p.pp))

    def _add(self, constraint, name: str) -> None:
        self.prob += constraint, name

    # ------------------------------------------------------------------------- constraint families

    def add_cover_constraint(self) -> None:
        """The stages partition the blocks contiguously, each holding at least one block (the first and the last
        possibly none where `StageProblem.empty_end_stages`)."""
        if self.compact:  # N_r >= min_blocks(r) (its bounds) and the ranks' blocks add up to L
            self._add(pulp.lpSum(self.N) == self.L, "cover_all")
            return
        for s in range(1, self.S):
            self._add(pulp.lpSum(self.y[s].values()) == 1, f"cover_s{s}")
        for s in range(self.S):
            self._add(pulp.lpSum(self.z[s].values()) == 1, f"cover_full_s{s}")

    def add_order_constraint(self) -> None:
        """Positional form only: stage s+1 starts after stage s (>= 1 block each), and the fully recomputed
        prefix of stage s lies inside it."""
        if self.compact:
            return
        for s in range(self.S):
            if self.S > 1 and s < self.S - 1:
                least = 0 if (s == 0 and self.e) else 1  # the first stage may be empty; the last by y's domain
                self._add(self._start(s + 1) - self._start(s) >= least, f"order_s{s}")
            self._add(self._full_end(s) - self._start(s) >= 0, f"order_full_lo_s{s}")
            self._add(self._start(s + 1) - self._full_end(s) >= 0, f"order_full_hi_s{s}")

    def _add_rank_counts(self, family: str) -> None:
        """Rank level: K_r + U_r <= N_r; phi_r = [K_r >= 1]."""
        for r in range(self.p.pp if self.compact else 0):
            N, K, U, phi = self.N[r], self.K[r], self.U[r], self.phi[r]
            self._add(K + U - N <= 0, f"{family}_count_r{r}")
            self._add(K - self.L * phi <= 0, f"{family}_phi_r{r}")
            self._add(phi - K <= 0, f"{family}_phi_lo_r{r}")

    def add_full_selective_constraint(self) -> None:
        """A stage with fully recomputed blocks recomputes its other blocks selectively (StageLayout semantics on
        autoplan's runtime; `add_full_plain_constraint` under `rest_none`).

        Rank level (`_add_rank_counts`). With one stage per rank (vp = 1) the stage is either selective or not:
        U_r = sigma_r (N_r - K_r), and K_r >= 1 forces sigma_r = 1. With vp >= 2 stages per rank any split of the
        rank's blocks into none / selective / full is realisable by stages (put the non-recomputed blocks in
        stages of their own), so U_r is free."""
        if self.p.rest_none:
            return
        L = self.L
        self._add_rank_counts("full_selective")
        for r in range(self.p.pp if self.compact else 0):
            N, K, U, phi, sig = self.N[r], self.K[r], self.U[r], self.phi[r], self.sigma[r]
            if self.p.vp == 1:
                self._add(phi - sig <= 0, f"full_selective_sigma_r{r}")
                self._add(U - (N - K) + L * (1 - sig) >= 0, f"full_selective_u_r{r}")
                self._add(U - L * sig <= 0, f"full_selective_u_hi_r{r}")
        for s in range(0 if self.compact else self.S):
            self._add(self._full_end(s) - self._start(s) - self.L * self.sigma[s] <= 0, f"full_selective_s{s}")

    def add_full_plain_constraint(self) -> None:
        """`StageProblem.rest_none` (Megatron's block method): a stage with fully recomputed blocks recomputes its
        other blocks not at all, so a stage recomputes selectively or has a full prefix, not both.

        Rank level (`_add_rank_counts`). With vp = 1: U_r = sigma_r N_r and phi_r + sigma_r <= 1. With vp >= 2
        any split into none / selective / full is realisable (the selective blocks in stages of their own, the
        full ones first in the others, `_rank_chunks`), so U_r is free. Per stage: the prefix is empty where
        sigma_s = 1."""
        if not self.p.rest_none:
            return
        L = self.L
        self._add_rank_counts("full_plain")
        for r in range(self.p.pp if self.compact else 0):
            N, U, phi, sig = self.N[r], self.U[r], self.phi[r], self.sigma[r]
            if self.p.vp == 1:
                self._add(phi + sig <= 1, f"full_plain_sigma_r{r}")
                self._add(U - N + L * (1 - sig) >= 0, f"full_plain_u_r{r}")
                self._add(U - L * sig <= 0, f"full_plain_u_hi_r{r}")
        for s in range(0 if self.compact else self.S):
            self._add(self._full_end(s) - self._start(s) + self.L * self.sigma[s] <= self.L, f"full_plain_s{s}")

    def add_work_constraint(self) -> None:
        """Work (forward + backward + recomputation of one micro-batch): per rank R_r, or per stage W_s."""
        if self.compact:
            b = self.p.blocks[0]
            for r in range(self.p.pp):
                c = self._rank_const(r, "work")
                self._add(self.R[r] - self._MS * (c + b.work * self.N[r] + b.rec_full * self.K[r] + b.rec_sel * self.U[r])
                          == 0, f"work_r{r}")
            return
        for s in range(self.S):
            c = self._const(s, "work") * self._MS
            base = c + self._MS * (self._at_start(s + 1, "work") - self._at_start(s, "work")
                                   + self._at_full(s, "rec_full") - self._at_start(s, "rec_full"))
            rest_sel = self._MS * (self._at_start(s + 1, "rec_sel") - self._at_full(s, "rec_sel"))
            big = self._MS * self.prefix["rec_sel"][self.L]
            self._add(self.W[s] - base >= 0, f"work_s{s}")
            self._add(self.W[s] - base - rest_sel + big * (1 - self.sigma[s]) >= 0, f"work_selective_s{s}")

    def add_activation_constraint(self) -> None:
        """Activation bytes kept per micro-batch in flight: per rank A_r, or per stage A_s."""
        if self.compact:
            b = self.p.blocks[0]
            for r in range(self.p.pp):
                c = self._rank_const(r, "act_none")
                none = self.N[r] - self.K[r] - self.U[r]
                self._add(self.A[r] - self._GB * (c + b.act_full * self.K[r] + b.act_sel * self.U[r] + b.act_none * none)
                          == 0, f"activation_r{r}")
            return
        for s in range(self.S):
            c = self._const(s, "act_none") * self._GB
            full = self._at_full(s, "act_full") - self._at_start(s, "act_full")
            sel = self._at_start(s + 1, "act_sel") - self._at_full(s, "act_sel")
            none = self._at_start(s + 1, "act_none") - self._at_full(s, "act_none")
            big = self.prefix["act_none"][self.L] - self.prefix["act_sel"][self.L]
            self._add(self.A[s] - (c + self._GB * (full + sel)) >= 0, f"activation_s{s}")
            self._add(self.A[s] - (c + self._GB * (full + none - big * self.sigma[s])) >= 0, f"activation_none_s{s}")

    def add_transient_constraint(self) -> None:
        """X_r: the largest block a rank recomputes fully is materialised again during its backward."""
        if self.compact:
            e = self.p.blocks[0].transient * self._GB
            for r in range(self.p.pp):
                self._add(self.X[r] - e * self.phi[r] >= 0, f"transient_r{r}")
            return
        for s in range(self.S):
            r = s % self.p.pp
            ys, zs = self.y[s], self.z[s]
            for i in range(max(0, s - self.e), min(self.L, self.L - (self.S - s - 1) + self.e)):
                b = self.p.blocks[i]
                started = (1 if s == 0 else pulp.lpSum(v for j, v in ys.items() if j <= i))
                full_ended = pulp.lpSum(v for j, v in zs.items() if j <= i)
                self._add(self.X[r] - b.transient * self._GB * (started - full_ended) >= 0, f"transient_s{s}_i{i}")

    def add_memory_constraint(self) -> None:
        """Static bytes + in-flight activations + transient of each rank within its capacity."""
        for r in range(self.p.pp):
            static = self._rank_const(r, "static") * self._GB
            if self.compact:
                static += self.p.blocks[0].static * self._GB * self.N[r]
                acts = self.A[r]
            else:
                for s in self._stages_of(r):
                    static += self._GB * (self._at_start(s + 1, "static") - self._at_start(s, "static"))
                acts = pulp.lpSum(self.A[s] for s in self._stages_of(r))
            self._add(static + self.p.inflight[r] * acts + self.X[r] <= self.p.capacity[r] * self._GB, f"memory_r{r}")

    def add_bottleneck_constraint(self) -> None:
        """T bounds every rank's work (the steady state of the schedule runs at the slowest rank)."""
        for r in range(self.p.pp):
            work = self.R[r] if self.compact else pulp.lpSum(self.W[s] for s in self._stages_of(r))
            self._add(self.T - work >= 0, f"bottleneck_r{r}")

    def add_pin_constraint(self) -> None:
        """`--fix recompute=none|selective|full`: every stage uses that mode (full: every block)."""
        pin = self.p.pin
        if pin is None:
            return
        if self.compact:
            for r in range(self.p.pp):
                if pin == FULL:
                    self._add(self.K[r] - self.N[r] == 0, f"pin_full_r{r}")
                else:
                    self._add(self.K[r] == 0, f"pin_nofull_r{r}")
                    self._add(self.U[r] - (self.N[r] if pin == SELECTIVE else 0) == 0, f"pin_selective_r{r}")
            return
        for s in range(self.S):  # (a stage recomputed whole in full has no rest; full_plain wants sigma_s = 0)
            sig = 0 if pin == NONE or (pin == FULL and self.p.rest_none) else 1
            self._add(self.sigma[s] == sig, f"pin_sigma_s{s}")
            if pin == FULL:
                self._add(self._full_end(s) - self._start(s + 1) == 0, f"pin_full_s{s}")
            else:
                self._add(self._full_end(s) - self._start(s) == 0, f"pin_nofull_s{s}")

    def add_no_full_constraint(self) -> None:
        """`StageProblem.no_full`: no block is recomputed fully (stages recompute nothing or selectively)."""
        if not self.p.no_full:
            return
        if self.compact:
            for r in range(self.p.pp):
                self._add(self.K[r] == 0, f"no_full_r{r}")
            return
        for s in range(self.S):
            self._add(self._full_end(s) - self._start(s) == 0, f"no_full_s{s}")

    def add_no_selective_constraint(self) -> None:
        """`StageProblem.no_selective`: no block is recomputed selectively. Rank level U_r = 0 (with vp = 1 the
        full_selective rows then force K_r = 0 or N_r; with vp >= 2 the rank's fully recomputed blocks fill stages
        of their own, `_rank_chunks`); per stage, sigma_s = 1 only where the full prefix is the whole stage, or
        (rest_none, where the rest of a partly full stage recomputes nothing) sigma_s = 0."""
        if not self.p.no_selective:
            return
        if self.compact:
            for r in range(self.p.pp):
                self._add(self.U[r] == 0, f"no_selective_r{r}")
            return
        for s in range(self.S):
            if self.p.rest_none:
                self._add(self.sigma[s] == 0, f"no_selective_s{s}")
            else:
                self._add(self._start(s + 1) - self._full_end(s) + self.L * self.sigma[s] <= self.L,
                          f"no_selective_s{s}")

    def add_objective(self) -> None:
        v = self.p.vp
        work = self.R if self.compact else self.W
        self.prob += (self.p.m - 1.0 / v) * self.T + (1.0 / v) * pulp.lpSum(work), "makespan"

    # ------------------------------------------------------------------------------------- solving

    def build(self) -> StageILP:
        self.add_objective()
        self.add_cover_constraint()
        self.add_order_constraint()
        self.add_full_selective_constraint()
        self.add_full_plain_constraint()
        self.add_work_constraint()
        self.add_activation_constraint()
        self.add_transient_constraint()
        self.add_memory_constraint()
        self.add_bottleneck_constraint()
        self.add_pin_constraint()
        self.add_no_full_constraint()
        self.add_no_selective_constraint()
        return self

    def solve(self) -> StageSolution:
        with warnings.catch_warnings():  # pulp 3 deprecates PULP_CBC_CMD (the bundled CBC) in favour of pulp[cbc]
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = ilp_solver(self.time_limit_s)
            with _quiet_stdout(isinstance(solver, pulp.HiGHS)):
                status = self.prob.solve(solver)
        if pulp.LpStatus[status] != "Optimal":
            raise InfeasibleStageProblem(self.binding_families())
        return self._extract()

    def binding_families(self) -> list[str]:
        """Constraint families that cannot all hold. Every family but memory (and the pins, no_full and
        no_selective) is always satisfiable on its own (any contiguous layout satisfies cover/order/work/activation/
        transient/bottleneck), so an infeasible problem is one whose memory rows cannot be met."""
        return ["memory_r*"] + (["pin_*"] if self.p.pin else []) + (["no_full_*"] if self.p.no_full else []) \
            + (["no_selective_*"] if self.p.no_selective else [])

    def _extract(self) -> StageSolution:
        p, S = self.p, self.S
        if self.compact:
            stages = _stages_from_ranks(p, [round(x.value()) for x in self.N], [round(x.value()) for x in self.K],
                                        [round(x.value()) for x in self.U])
        else:
            stages = []
            starts = [0] + [max(self.y[s], key=lambda j, s=s: self.y[s][j].value()) for s in range(1, S)] + [self.L]
            for s in range(S):
                c = max(self.z[s], key=lambda j, s=s: self.z[s][j].value())
                sig = round(self.sigma[s].value())
                stages.append(_choice(p, starts[s], starts[s + 1], c - starts[s], sig))
        stages_t = tuple(stages)
        obj, mem = evaluate(p, stages_t)
        return StageSolution(stages_t, obj, mem, "ilp-rank" if self.compact else "ilp")


def _split(total: int, parts: int) -> list[int]:
    if parts == 0:
        return []
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _rank_chunks(n: int, k: int, u: int, v: int) -> list[tuple[int, int, int]]:
    """A rank's n blocks (k fully, u selectively recomputed) over v >= 1 stages, each (blocks, full, selective-mode
    flag): blocks that recompute nothing go to stages of their own (as few as possible), the others are spread
    evenly over the remaining stages, each taking full-recompute blocks first."""
    none, rec = n - k - u, k + u
    if none == 0:
        j = 0
    elif rec == 0:
        j = v
    else:
        j = max(1, v - rec)
    sizes = _split(none, j) + _split(rec, v - j)
    out, left = [], k
    for i, size in enumerate(sizes):
        if i < j:
            out.append((size, 0, 0))
        else:
            kk = min(size, left)
            left -= kk
            out.append((size, kk, 1))
    return out


def _rank_chunks_plain(n: int, k: int, u: int, v: int) -> list[tuple[int, int, int]]:
    """`_rank_chunks` under `StageProblem.rest_none`: the selectively recomputed blocks go to stages of their own
    (as few as possible), the others are spread evenly over the remaining stages, each taking full-recompute blocks
    first and running the rest plainly."""
    other = n - u
    j = 0 if u == 0 else v if other == 0 else max(1, v - other)
    assert j < v or other == 0, "a rank with one stage recomputes selectively everywhere or not at all"
    out = [(size, 0, 1) for size in _split(u, j)]
    left = k
    for size in _split(other, v - j):
        kk = min(size, left)
        left -= kk
        out.append((size, kk, 0))
    return out


def _stages_from_ranks(p: StageProblem, N: list[int], K: list[int], U: list[int]) -> list[StageChoice]:
    """Turn rank totals (blocks, fully and selectively recomputed blocks) into the rank's vp stages
    (`_rank_chunks`); a rank of the first or last stage holding one block fewer than it has stages leaves that
    stage empty (only the embedding or the head: `StageProblem.empty_end_stages`)."""
    v, pp = p.vp, p.pp
    chunker = _rank_chunks_plain if p.rest_none else _rank_chunks
    per_stage: dict[int, tuple[int, int, int]] = {}  # stage -> (blocks, full, selective-mode flag)
    for r in range(pp):
        if N[r] < v:  # N[r] = v - 1 (the ILP's bound): the end stage holds no block
            chunks = chunker(N[r], K[r], U[r], v - 1)
            chunks = [(0, 0, 0), *chunks] if r == 0 else [*chunks, (0, 0, 0)]
            assert r in (0, pp - 1) and p.empty_end_stages
        else:
            chunks = chunker(N[r], K[r], U[r], v)
        for i, s in enumerate(range(r, pp * v, pp)):
            per_stage[s] = chunks[i]
    out, start = [], 0
    for s in range(pp * v):
        size, k, sig = per_stage[s]
        out.append(_choice(p, start, start + size, k, sig))
        start += size
    return out


def _choice(p: StageProblem, start: int, stop: int, k: int, sigma: int) -> StageChoice:
    """Label a stage: full if it recomputes blocks fully; selective only where it changes something (with a
    flash kernel selective recomputation is free and saves nothing, so it is reported as none) or is pinned."""
    if k > 0:
        return StageChoice(start, stop, FULL, k)
    if sigma and (p.pin == SELECTIVE or any(b.rec_sel > 0 or b.act_sel < b.act_none for b in p.blocks[start:stop])):
        return StageChoice(start, stop, SELECTIVE, 0)
    return StageChoice(start, stop, NONE, 0)


_CACHE: dict[StageProblem, StageSolution | None] = {}


def solve_stage_problem(problem: StageProblem) -> StageSolution | None:
    """The ILP's optimum for `problem` (None when nothing fits); identical problems are solved once."""
    if problem in _CACHE:
        return _CACHE[problem]
    try:
        sol = StageILP(problem).build().solve()
        if not feasible(problem, sol.memory, tol=1e-5):
            sol = None
    except InfeasibleStageProblem:
        sol = None
    _CACHE[problem] = sol
    return sol


def is_cached(problem: StageProblem) -> bool:
    return problem in _CACHE
