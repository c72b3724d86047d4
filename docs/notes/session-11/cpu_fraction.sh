#!/bin/bash
# Session 11: each rank's CPU time per second of its step (the runtime's new cpu_s, RunLog.cpu_fraction), tiny-gpt
# on 4 processes / 2 cores. A node is saturated when the fractions sum to its cores (2: a mean of 0.5 per rank).
# run: bash docs/notes/session-11/cpu_fraction.sh   (from the repository root, machine otherwise quiet)
cd "$(dirname "$0")/../../.."
for P in dp=4,mbs=2 pp=2,dp=2,mbs=4,schedule=gpipe pp=4,mbs=1 dp=4,mbs=2,zero=2 tp=2,dp=2,mbs=1; do
  d=$(mktemp -d)
  PYTHONPATH=$PWD .venv/bin/python -m autoplan.cli estimate --model tiny-gpt --cluster local-cpu --gpus 4 \
    --global-batch 8 --seq-len 64 --dtype fp32 --kernels torch --parallel "$P" -o $d/plan.json --json > /dev/null
  OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 \
    -m autoplan.runtime.train -- --plan $d/plan.json --steps 12 --time-from 3 --log $d/log.jsonl --quiet > /dev/null 2>&1
  PYTHONPATH=$PWD .venv/bin/python -c "
from autoplan.tune.records import read_run_log
import statistics
log = read_run_log('$d/log.jsonl')
ranks = {}
for t in log.timings[1:]:
    for r in t.ranks:
        ranks.setdefault(r.rank, []).append(r.cpu_s / r.step_s)
print('%-32s step %6.1f ms  cpu/step per rank %s  mean %.2f' % ('$P', log.measured_step_s() * 1e3,
      ' '.join('%.2f' % statistics.median(v) for _, v in sorted(ranks.items())), log.cpu_fraction()))"
done
