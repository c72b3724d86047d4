#!/bin/bash
# Session 19: replay every tune set in directory $2 with checkout $1; per-set lines and the means (as
# docs/notes/session-16/replay_sets.sh does for the saved sets). bash replay_dir.sh CHECKOUT DIR NAME
cd "$1"
for n in K L M N P Q R S T U V W X Y Z S16b S16; do
  echo "$n $(OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/main/.venv/bin/python benchmarks/tune_local.py --replay $2/tune-set-$n.json.gz 2>&1 | grep '^tune:' | tail -1)"
done > /tmp/replaydir_$3.txt
cat /tmp/replaydir_$3.txt
awk '{for(i=1;i<=NF;i++) {if($i=="error") {e=$(i+1); gsub("%,","",e); s+=e; n++} if($i=="chosen/fastest") {c+=$(i+1); k++; if($(i+1)<=1.05) g++}}} END {printf "mean error %.2f%% over %d sets; chosen/fastest mean %.3f, within 1.05 in %d of %d\n", s/n, n, c/k, g, k}' /tmp/replaydir_$3.txt
