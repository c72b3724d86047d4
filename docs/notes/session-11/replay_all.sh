#!/bin/bash
# Session 11 (W added in session 13, X in session 14): replay every saved tune set measured on the current runtime with a checkout's code and print the
# held-out mean error per set and over all. run: bash docs/notes/session-11/replay_all.sh [CHECKOUT]
# (CHECKOUT: a worktree to judge, default this one; the sets are read from this repository's notes)
NOTES=$(cd "$(dirname "$0")/.." && pwd)
cd "${1:-$NOTES/../..}"
for f in $NOTES/session-9/tune-set-{K,L,M,N}.json.gz $NOTES/session-10/tune-set-{P,Q,R,S,T}.json.gz \
         $NOTES/session-11/tune-set-{U,V}.json.gz $NOTES/session-13/tune-set-W.json.gz $NOTES/session-14/tune-set-X.json.gz; do
  n=$(basename $f .json.gz | sed 's/tune-set-//')
  echo "$n $(OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/tune_local.py --replay $f 2>&1 | grep '^tune:' | tail -1)"
done | tee /tmp/replay_out.txt
awk '{for(i=1;i<=NF;i++) if($i=="error") {gsub("%,","",$(i+1)); s+=$(i+1); n++}} END {printf "mean %.2f%% over %d sets\n", s/n, n}' /tmp/replay_out.txt
