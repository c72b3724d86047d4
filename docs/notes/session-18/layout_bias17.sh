#!/bin/bash
# per-layout bias over 17 sets for checkout $1 -> /tmp/rj18_$2_*.json
NOTES=/work/main/docs/notes
cd "$1"
for f in $NOTES/session-9/tune-set-{K,L,M,N}.json.gz $NOTES/session-10/tune-set-{P,Q,R,S,T}.json.gz \
         $NOTES/session-11/tune-set-{U,V}.json.gz $NOTES/session-13/tune-set-W.json.gz $NOTES/session-14/tune-set-{X,Y}.json.gz $NOTES/session-15/tune-set-Z.json.gz $NOTES/session-16/tune-set-S16b.json.gz $NOTES/session-16/tune-set-S16.json.gz; do
  OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/main/.venv/bin/python benchmarks/tune_local.py --replay $f --json 2>/dev/null | grep "^{" > /tmp/rj18_$2_$(basename $f .json.gz).json
done
/work/main/.venv/bin/python - "$2" <<'PY'
import json,glob,collections,sys
agg=collections.defaultdict(list)
for f in sorted(glob.glob(f'/tmp/rj18_{sys.argv[1]}_tune-set-*.json')):
    d=json.loads(open(f).read())
    for r in d["held_out"]:
        if r["measured_s"] and r["after_s"]:
            k=r["parallel"].replace(",cp=1,ep=1,vp=1","").replace(",schedule=1f1b","").replace(",sp=0","").replace(",recompute=none","")
            agg[k].append(r["after_s"]/r["measured_s"]-1)
for k,v in sorted(agg.items(), key=lambda kv: -abs(sum(kv[1])/len(kv[1]))):
    print(f"{k:55s} {len(v):3d} {100*sum(v)/len(v):+6.1f}% {100*sum(map(abs,v))/len(v):5.1f}%")
PY
