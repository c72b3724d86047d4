# ruff: noqa  (a measurement script kept as the record of a session-10 note, not project code)
# run: PYTHONPATH=$PWD:$PWD/benchmarks python docs/notes/session-10/fit_rows.py SET.json.gz [kinds,...]
"""Print the fit's rows (measured / refit) for a saved tune_local set."""
import gzip, json, sys
sys.argv += []
from autoplan.cost_models.fit import fit_cluster
import benchmarks.tune_local as tl
from autoplan.plan import Plan
from autoplan.cost_models.fit import CollectiveSample, GemmSample, RegionSample
from autoplan.cost_models.specs import ClusterSpec
d = json.load(gzip.open(sys.argv[1], "rt"))
model, cluster, training = tl.workload("tiny-gpt", 4, 8, 64)
saved = d["cluster"]; preset = cluster.gpu.calibration.model_dump()
cal = (saved.get("gpu") or {}).get("calibration") or {}
saved = {**saved, "gpu": {**saved.get("gpu", {}), "calibration": {**preset, **cal}}}
cluster = ClusterSpec.model_validate(saved)
b = d["bench"]
g = [GemmSample.model_validate(x) for x in b.get("gemm", [])]
c = [CollectiveSample.model_validate(x) for x in b.get("collectives", [])]
r = [RegionSample.model_validate(x) for x in b.get("recompute", [])]
tuned = [e for e in d["tuned"] if e.get("measured_s")]
samples = [tl._sample_of_saved(e, Plan.model_validate(e["plan"])) for e in tuned]
fit = fit_cluster(cluster, samples, g, c, r)
kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else None
for row in fit.rows:
    if kinds and row["kind"] not in kinds: continue
    print(f'{row["kind"]:12} {row["label"][:80]:80} meas {row["measured"]*1e3:9.3f} after {row["after"]*1e3:9.3f}  {row["after"]/row["measured"]:.2f}')
