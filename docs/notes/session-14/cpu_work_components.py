# ruff: noqa  (a measurement script kept as the record of a session-14 note, not project code)
"""cpu_work.py's question with the estimate's own parts as features: per pipeline rank, the model's compute (host
operators included), TP/CP/EP communication, pipeline-message time, gradient reduction, optimizer and FSDP extra,
priced on the same cluster with no oversubscription (cores_per_node = processes: no contention factor, no waits),
regressed against the measured CPU seconds per step. run: python docs/notes/session-14/cpu_work_components.py
"""
import gzip, json, statistics as st, sys
import numpy as np
sys.path.insert(0, "/work/main")
from autoplan.plan import Plan
from autoplan.cost_models.profile import profile_from_spec
from autoplan.cost_models.estimate import estimate, num_microbatches, _stages_by_rank, _rank_tails

SETS = {"V": "docs/notes/session-11/tune-set-V.json.gz", "W": "docs/notes/session-13/tune-set-W.json.gz",
        "X": "docs/notes/session-14/tune-set-X.json.gz"}
KEYS = ["compute", "comm", "p2p", "reduce", "opt", "fsdp", "one"]


def features(plan: Plan):
    cfg, training = plan.parallel, plan.training
    cluster = plan.cluster.model_copy(update={"cores_per_node": plan.cluster.gpus_per_node})
    profiles = profile_from_spec(plan.model)
    est = estimate(profiles, cluster, training, cfg, simulate_pipeline=False)
    m = num_microbatches(cfg, training)
    by_rank = _stages_by_rank(est.stages, cfg.pp)
    tails = _rank_tails(by_rank, cfg, cluster, training, m)
    out = []
    for stages, (red, tail, opt, fsdp) in zip(by_rank, tails):
        comp = sum(s.fwd_s + s.bwd_s - s.comm_s - s.p2p_s for s in stages) * m
        out.append({"compute": comp * 1e3, "comm": sum(s.comm_s for s in stages) * m * 1e3,
                    "p2p": sum(s.p2p_s for s in stages) * m * 1e3, "reduce": (red + tail) * 1e3,
                    "opt": opt * 1e3, "fsdp": fsdp * 1e3, "one": 1.0})
    return out


def rows_of(name):
    d = json.load(gzip.open(SETS[name]))
    out = []
    for c in d["tuned"] + d["held_out"]:
        t = c["log"]["timings"]
        ranks = t[0]["ranks"]
        if "cpu_s" not in ranks[0]:
            return []
        plan = Plan.model_validate(c["plan"])
        by_stage = {}
        for i, rk in enumerate(ranks):
            by_stage.setdefault(rk["pp_stage"], []).append(st.median(e["ranks"][i]["cpu_s"] for e in t))
        out.append({"parallel": c["parallel"], "feats": features(plan), "per_stage": len(ranks) // plan.parallel.pp,
                    "cpu": [st.mean(by_stage[s]) * 1e3 for s in sorted(by_stage)],
                    "step": st.median(max(x["step_s"] for x in e["ranks"]) for e in t) * 1e3})
    return out


def fit(rows):
    X = np.array([[f[k] for k in KEYS] for r in rows for f in r["feats"]])
    y = np.array([c for r in rows for c in r["cpu"]])
    coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
    return coef


def pred(f, coef):
    return float(np.dot([f[k] for k in KEYS], coef))


def report(train, test, data, show=False):
    tr = sum((data[n] for n in train), [])
    te = sum((data[n] for n in test), [])
    coef = fit(tr)
    u = st.median(sum(pred(f, coef) for f in r["feats"]) * r["per_stage"] / 2 / r["step"] for r in tr)
    cerr, serr = [], []
    for r in te:
        p = [pred(f, coef) for f in r["feats"]]
        cerr += [a / b - 1 for a, b in zip(p, r["cpu"])]
        s = sum(p) * r["per_stage"] / 2 / u
        serr.append(s / r["step"] - 1)
        if show:
            print(f"   {r['parallel'][:60]:60s} cpu " + " ".join(f"{c:6.1f}" for c in r["cpu"]) + " pred "
                  + " ".join(f"{x:6.1f}" for x in p) + f"  step {r['step']:7.1f} -> {s:7.1f} ({serr[-1]*100:+.0f}%)")
    print(f"fit on {'+'.join(train)} -> {'+'.join(test)}: " + " ".join(f"{k}={v:.3g}" for k, v in zip(KEYS, coef))
          + f" u={u:.2f}; cpu mean |err| {np.mean(np.abs(cerr))*100:.1f}%, step mean |err| "
          f"{np.mean(np.abs(serr))*100:.1f}% worst {np.max(np.abs(serr))*100:.0f}%")


data = {n: rows_of(n) for n in SETS}
report(["V", "W", "X"], ["V", "W", "X"], data, show=True)
for test in SETS:
    report([n for n in SETS if n != test], [test], data)
