# ruff: noqa  (a measurement script kept as the record of a session-14 note, not project code)
"""Is a rank's CPU time per step on this oversubscribed node linear in what the cost model already counts?

For every layout of the saved tune sets that recorded per-rank CPU time (V, W), take each pipeline rank's mean
measured CPU seconds per step and regress it on per-rank features built from the cost model's own counts
(cost_models.counts.predict_counts and the layer profiles): FLOPs, eager operators (plain and DTensor), FSDP units
x micro-batches, collective calls by kind and their bytes. Then predict the step as the node's CPU work over
cores x u (work-conserving), u fitted as one number. Leave-one-set-out: fit on V, predict W, and the reverse.
run: python docs/notes/session-14/cpu_work.py
"""
import gzip, json, statistics as st, sys
import numpy as np
sys.path.insert(0, "/work/main")
from autoplan.plan import Plan
from autoplan.cost_models.profile import profile_from_spec
from autoplan.cost_models.counts import predict_counts
from autoplan.cost_models.estimate import num_microbatches, even_layout


SETS = {"V": "docs/notes/session-11/tune-set-V.json.gz", "W": "docs/notes/session-13/tune-set-W.json.gz"}
COLLS = ["all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast", "all_to_all"]


def features(plan: Plan):
    """Per pipeline rank: dict of features for one optimizer step."""
    cfg = plan.parallel
    profiles = profile_from_spec(plan.model)
    counts = predict_counts(profiles, plan.cluster, plan.training, cfg)
    m = num_microbatches(cfg, plan.training)
    blocks = profiles[1:-1]
    per_rank = []
    L = len(blocks) // cfg.pp
    for r, c in enumerate(counts):
        lay = blocks[r * L:(r + 1) * L]
        ops = sum(p.kernels_fwd for p in lay) + (profiles[0].kernels_fwd if r == 0 else 0) \
            + (profiles[-1].kernels_fwd if r == cfg.pp - 1 else 0)
        rec = {"none": 0, "selective": 0.15, "full": 1.0}[cfg.recompute]
        ops_step = ops * m * (3 + rec)  # forward once, backward ~2x its ops, recompute re-runs a share
        f = {"flops": sum(c["flops"].values()) / 1e9,
             "ops": ops_step / 1e3,
             "dt_ops": (ops_step / 1e3) if cfg.tp > 1 else 0.0,
             "fsdp": (L + 1) * m / 1e3 if cfg.zero >= 1 and cfg.dp > 1 else 0.0,
             "calls": sum(e["count"] for e in c["comm"]) / 1e3,
             "mbytes": sum(e["bytes"] for e in c["comm"]) / 1e6,
             "one": 1.0}
        per_rank.append(f)
    return per_rank


def rows_of(name):
    d = json.load(gzip.open(SETS[name]))
    out = []
    for c in d["tuned"] + d["held_out"]:
        t = c["log"]["timings"]
        ranks = t[0]["ranks"]
        plan = Plan.model_validate(c["plan"])
        feats = features(plan)
        cpu_by_stage = {}
        for i, rk in enumerate(ranks):
            cpu_by_stage.setdefault(rk["pp_stage"], []).append(st.median(e["ranks"][i]["cpu_s"] for e in t))
        step = st.median(max(x["step_s"] for x in e["ranks"]) for e in t)
        per_stage = len(ranks) // plan.parallel.pp
        out.append({"parallel": c["parallel"], "step": step, "feats": feats, "per_stage": per_stage,
                    "cpu": [st.mean(cpu_by_stage[s]) for s in sorted(cpu_by_stage)],
                    "held": c in d["held_out"]})
    return out


KEYS = ["flops", "ops", "dt_ops", "fsdp", "calls", "mbytes", "one"]


def fit(rows):
    X = np.array([[f[k] for k in KEYS] for r in rows for f in r["feats"]])
    y = np.array([c for r in rows for c in r["cpu"]])
    w = 1 / y  # relative errors
    coef, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
    return coef


def node_work(r, coef):
    return sum(float(np.dot([f[k] for k in KEYS], coef)) * r["per_stage"] for f in r["feats"])


def main():
    data = {n: rows_of(n) for n in SETS}
    for train, test in (("V", "W"), ("W", "V"), ("V+W", "V+W")):
        tr = sum((data[n] for n in train.split("+")), [])
        te = sum((data[n] for n in test.split("+")), [])
        coef = fit(tr)
        u = st.median(node_work(r, coef) / 2 / r["step"] for r in tr)
        print(f"fit on {train}: " + " ".join(f"{k}={v:.4g}" for k, v in zip(KEYS, coef)) + f"  u={u:.2f}")
        cerr, serr = [], []
        for r in te:
            pred = [float(np.dot([f[k] for k in KEYS], coef)) for f in r["feats"]]
            cerr += [p / c - 1 for p, c in zip(pred, r["cpu"])]
            s = node_work(r, coef) / 2 / u
            serr.append(s / r["step"] - 1)
            if train == "V" or train == "V+W":
                print(f"   {r['parallel'][:60]:60s} cpu meas " + " ".join(f"{c*1e3:6.1f}" for c in r["cpu"])
                      + "  pred " + " ".join(f"{p*1e3:6.1f}" for p in pred)
                      + f"  step {r['step']*1e3:7.1f} pred {s*1e3:7.1f} ({serr[-1]*100:+.0f}%)")
        print(f"  on {test}: cpu mean |err| {np.mean(np.abs(cerr))*100:.1f}%, step mean |err| "
              f"{np.mean(np.abs(serr))*100:.1f}% worst {np.max(np.abs(serr))*100:.1f}% over {len(te)} layouts")


main()
