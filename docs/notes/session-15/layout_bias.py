# ruff: noqa
# Session 15: per-layout signed and absolute held-out error over the replayed tune sets. Fill /tmp/rj_tune-set-*.json first:
# for f in <sets>; do OMP_NUM_THREADS=1 python benchmarks/tune_local.py --replay $f --json | grep "^{" > /tmp/rj_$(basename $f .json.gz).json; done
import json,glob,collections,sys
agg=collections.defaultdict(list)
for f in sorted(glob.glob('/tmp/rj_tune-set-*.json')):
    d=json.loads(open(f).read())
    for r in d["held_out"]:
        if r["measured_s"] and r["after_s"]:
            k=r["parallel"].replace(",cp=1,ep=1,vp=1","").replace(",schedule=1f1b","")
            agg[k].append(r["after_s"]/r["measured_s"]-1)
print("| held-out layout | sets | mean signed | mean abs |")
print("|---|---:|---:|---:|")
for k,v in sorted(agg.items(), key=lambda kv: -abs(sum(kv[1])/len(kv[1]))):
    print(f"| {k} | {len(v)} | {100*sum(v)/len(v):+.1f}% | {100*sum(map(abs,v))/len(v):.1f}% |")
