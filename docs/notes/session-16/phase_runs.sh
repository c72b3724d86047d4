#!/bin/bash
# Session 16: per-rank wall/CPU time of the step's phases under autoplan's runtime (tiny-gpt, 4 processes, 20 steps):
# pipeline actions, the schedule, backward(), the step tail's parts. run: bash docs/notes/session-16/phase_runs.sh LAYOUT...
# e.g. "tp=1,pp=1,dp=4,mbs=2" "tp=1,pp=2,dp=2,mbs=4,schedule=gpipe"; each rank writes /tmp/phasepatch/out.RANK
HERE=$(cd "$(dirname "$0")" && pwd)
PATCH=$(mktemp -d); cp "$HERE/phase_sitecustomize.py" "$PATCH/sitecustomize.py"
for p in "$@"; do
  autoplan estimate --model tiny-gpt --cluster local-cpu --gpus 4 --global-batch 8 --seq-len 64 --dtype fp32 \
    --kernels torch --parallel "$p" -o "$PATCH/p.json" > /dev/null
  rm -rf /tmp/phasepatch; echo "== $p (wall/cpu ms, medians from step 4)"
  PYTHONPATH=$PATCH PHASEPATCH=1 autoplan run "$PATCH/p.json" -- --steps 20 --quiet 2>&1 | grep -i error | head -3
  cat /tmp/phasepatch/out.*
done
