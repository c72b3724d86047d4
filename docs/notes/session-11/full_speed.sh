#!/bin/bash
# Session 11: does a process's compute run at a whole core's speed on an oversubscribed node? The same work per
# process (tiny-gpt, 2 sequences of 64 tokens, all blocks) on 2 processes / 2 cores and on 4 processes / 2 cores.
# run: bash docs/notes/session-11/full_speed.sh   (from the repository root, machine otherwise quiet)
cd "$(dirname "$0")/../../.."
run() {  # run NPROC GLOBAL_BATCH PARALLEL
  d=$(mktemp -d)
  PYTHONPATH=$PWD .venv/bin/python -m autoplan.cli estimate --model tiny-gpt --cluster local-cpu --gpus $1 \
    --global-batch $2 --seq-len 64 --dtype fp32 --kernels torch --parallel "$3" -o $d/plan.json --json > /dev/null
  OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node $1 \
    -m autoplan.runtime.train -- --plan $d/plan.json --steps 14 --time-from 3 --log $d/log.jsonl --quiet > /dev/null 2>&1
  PYTHONPATH=$PWD .venv/bin/python -c "
from autoplan.tune.records import read_run_log
log = read_run_log('$d/log.jsonl')
c = log.time_components()
print('$1 processes, $3: step %.1f ms; ' % (log.measured_step_s() * 1e3) + ', '.join('%s %.1f' % (k, v * 1e3) for k, v in c.items() if v > 1e-4))"
}
for rep in 1 2; do
  run 2 4 dp=2,mbs=2,zero=2
  run 4 8 dp=4,mbs=2,zero=2
  run 2 4 dp=2,mbs=2
  run 4 8 dp=4,mbs=2
  run 1 2 dp=1,mbs=2
done
