# ruff: noqa
# per-layout: measured compute component / predicted compute (preset cluster), with the layout-dependent
# contention (as now) and with contention 1 (every process computing at once)
import gzip, json, sys, glob, collections
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
import tune_local as T
from autoplan.cost_models import estimate as E
from autoplan.api import make_plan
from autoplan.cost_models.fit import predict_run
sets = sorted(glob.glob("/work/main/docs/notes/session-*/tune-set-[K-Z].json.gz")) + sorted(glob.glob("/work/main/docs/notes/session-16/tune-set-S16*.json.gz"))
orig = E.crowded
agg = collections.defaultdict(lambda: [[], []])
for path in sets:
    d = json.loads(gzip.open(path, "rt").read())
    a = d["args"]
    model, cluster, training = T.workload(a.get("model", "tiny-gpt"), 4, int(a.get("global_batch", 8)), int(a.get("seq_len", 64)))
    rows = [(r["parallel"], r.get("components_measured") or r.get("components")) for r in d["held_out"]]
    rows += [(t["parallel"], t.get("components")) for t in d["tuned"]]
    for par, comp in rows:
        if not comp or not comp.get("compute"):
            continue
        try:
            E.crowded = orig
            p1 = make_plan(model, cluster.with_gpus(4), training, par, kernels="torch")
            E.crowded = lambda c, t, cfg: c
            p0 = make_plan(model, cluster.with_gpus(4), training, par, kernels="torch")
        except Exception as ex:
            continue
        finally:
            E.crowded = orig
        meas = comp["compute"]
        b1, b0 = p1.prediction.breakdown, p0.prediction.breakdown
        key = par.replace(",cp=1,ep=1,vp=1", "").replace(",schedule=1f1b", "").replace(",sp=0", "").replace(",recompute=none", "")
        # DDP's measured compute holds the gradient all-reduce (its hooks wait inside the backward)
        ddp = "pp=1" in par and "zero=0" in par and "tp=1," in par
        extra1 = b1.get("dp_comm", 0) if ddp else 0
        extra0 = b0.get("dp_comm", 0) if ddp else 0
        agg[key][0].append(meas / (b1["compute"] + extra1))
        agg[key][1].append(meas / (b0["compute"] + extra0))
print(f"{'layout':58s} n   meas/pred(now)  meas/pred(contention 1)")
for k, (a1, a0) in sorted(agg.items(), key=lambda kv: sum(kv[1][1]) / len(kv[1][1])):
    print(f"{k:58s} {len(a1):2d}   {sum(a1)/len(a1):6.2f}          {sum(a0)/len(a0):6.2f}")
