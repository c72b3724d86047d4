#!/bin/bash
# replay all 28 saved tune sets with checkout $1, keep each replay's JSON (first line) in /tmp/pl_$2/, then
# aggregate the held-out signed errors by layout (python per_layout.py /tmp/pl_$2)
NOTES=/work/main/docs/notes
OUT=/tmp/pl_${2:-out}; mkdir -p $OUT
cd "${1:-/work/main}"
for f in $NOTES/session-9/tune-set-{K,L,M,N}.json.gz $NOTES/session-10/tune-set-{P,Q,R,S,T}.json.gz \
         $NOTES/session-11/tune-set-{U,V}.json.gz $NOTES/session-13/tune-set-W.json.gz $NOTES/session-14/tune-set-{X,Y}.json.gz \
         $NOTES/session-15/tune-set-Z.json.gz $NOTES/session-16/tune-set-S16b.json.gz $NOTES/session-16/tune-set-S16.json.gz \
         $NOTES/session-18/tune-set-S18{,b,c}.json.gz $NOTES/session-19/tune-set-S19{,b,c,d}.json.gz \
         $NOTES/session-20/tune-set-S20{,b,c,d}.json.gz; do
  n=$(basename $f .json.gz | sed 's/tune-set-//')
  OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/main/.venv/bin/python benchmarks/tune_local.py --replay $f --json 2>/dev/null | head -1 > $OUT/$n.json
done
/work/main/.venv/bin/python /work/main/docs/notes/session-22/per_layout.py $OUT
