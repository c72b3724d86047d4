#!/bin/bash
# replay all 28 saved tune sets (sessions 9-20) with checkout $1; per-set lines to /tmp/replay21_$2.txt and the means
NOTES=/work/main/docs/notes
cd "${1:-/work/main}"
for f in $NOTES/session-9/tune-set-{K,L,M,N}.json.gz $NOTES/session-10/tune-set-{P,Q,R,S,T}.json.gz \
         $NOTES/session-11/tune-set-{U,V}.json.gz $NOTES/session-13/tune-set-W.json.gz $NOTES/session-14/tune-set-{X,Y}.json.gz \
         $NOTES/session-15/tune-set-Z.json.gz $NOTES/session-16/tune-set-S16b.json.gz $NOTES/session-16/tune-set-S16.json.gz \
         $NOTES/session-18/tune-set-S18{,b,c}.json.gz $NOTES/session-19/tune-set-S19{,b,c,d}.json.gz \
         $NOTES/session-20/tune-set-S20{,b,c,d}.json.gz; do
  n=$(basename $f .json.gz | sed 's/tune-set-//')
  echo "$n $(OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/main/.venv/bin/python benchmarks/tune_local.py --replay $f 2>&1 | grep '^tune:' | tail -1)"
done > /tmp/replay21_${2:-out}.txt
cat /tmp/replay21_${2:-out}.txt
awk '{for(i=1;i<=NF;i++) {if($i=="error") {e=$(i+1); gsub("%,","",e); s+=e; n++; if(e+0<=10) u++} if($i=="chosen/fastest") {c+=$(i+1); k++; if($(i+1)<=1.05) g++}}} END {printf "mean error %.2f%% over %d sets (<=10%% in %d); chosen/fastest mean %.3f, within 1.05 in %d of %d\n", s/n, n, u, c/k, g, k}' /tmp/replay21_${2:-out}.txt
