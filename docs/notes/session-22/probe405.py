# ruff: noqa
"""Why the stage ILP for llama3-405b (tp8 pp16 dp32 cp4 vp7 mbs1 sp zero1) no longer yields the old
none/selective layout: closed form (the ILP's objective) and simulation of both layouts."""
import sys
from autoplan.plan import load_plan
from autoplan.search.core import _Searcher, profile_from_spec, parse_fix
from autoplan.search.space import Mesh, Knobs
from autoplan.search.problem import StageChoice, evaluate, feasible, FULL, NONE, SELECTIVE
from autoplan.search.ilp import solve_stage_problem
from autoplan.cost_models.estimate import estimate, StageLayout
from autoplan.search.core import check_config, to_config, _label

plan = load_plan(sys.argv[1])
model, cluster, training = plan.model, plan.cluster, plan.training
prof = profile_from_spec(model)
s = _Searcher(model, cluster, training, prof, parse_fix({}), 5, None)
p = plan.parallel
mesh = Mesh(tp=p.tp, cp=p.cp, ep=p.ep, pp=p.pp, dp=p.dp, mbs=p.mbs, sp=p.sp)
for vp in (int(a) for a in sys.argv[2:] or [p.vp]):
    kn = Knobs(p.zero, p.schedule, vp)
    prob = s.problem(mesh, kn)
    sol = solve_stage_problem(prob)
    print(f"vp={vp} ILP: obj {sol.objective:.4f}  modes", [(c.stop - c.start, c.recompute[0], c.recompute_layers) for c in sol.stages if c.recompute != NONE][:6])
    def sim(stages):
        mode, rl = _label(stages, mesh.pp, vp, s.L)
        cfg = check_config(to_config(mesh, kn, mode, rl), model, cluster, s.training, stage_layers=False)
        lay = [StageLayout((c.start, c.stop), c.recompute, c.recompute_layers) for c in stages]
        e = estimate(s.profiles, cluster, s.training, cfg, lay)
        print('      breakdown', {k: round(v,3) for k,v in e.breakdown.items()}, 'crit', e.critical_rank)
        return e.step_time_s, e.fits, e.peak_memory_gib
    print("   ILP layout sim:", sim(sol.stages))
    if vp == p.vp:
        old = tuple(StageChoice(st.layers[0], st.layers[1], st.recompute, st.recompute_layers or 0) for st in plan.stages)
        obj, mem = evaluate(prob, old)
        print(f"   old layout closed form {obj:.4f} feasible {feasible(prob, mem)}  sim:", sim(old))
        print("   old modes", sorted({(c.stop - c.start, c.recompute) for c in old}))

from autoplan.search.problem import stage_work_act
def ranks(stages):
    w = [0.0] * mesh.pp; n = [0] * mesh.pp; k = [0] * mesh.pp
    for i, c in enumerate(stages):
        w[i % mesh.pp] += stage_work_act(prob, i, c)[0]; n[i % mesh.pp] += c.stop - c.start
        k[i % mesh.pp] += c.recompute_layers if c.recompute == FULL else 0
    return [round(x * 1e3, 1) for x in w], n, k
print("m", prob.m, "ILP ranks", ranks(sol.stages))
print("old ranks", ranks(old))
