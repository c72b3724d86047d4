#!/bin/bash
# Measured in session 11: node busy fraction while tiny-gpt trains on 4 processes (see issue-13-tune.md, section 2)
# usage: run.sh PARALLEL  -> CPU utilisation of the node during steps (sampled 20-30 s in) and the step time
cd /work/main
P=$1
PYTHONPATH=$PWD .venv/bin/python -m autoplan.cli estimate --model tiny-gpt --cluster local-cpu --gpus 4 --global-batch 8 --seq-len 64 --dtype fp32 --kernels torch --parallel "$P" -o /tmp/util/plan.json --json > /dev/null || exit 1
rm -f /tmp/util/log.jsonl
OMP_NUM_THREADS=1 PYTHONPATH=$PWD timeout 60 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 -m autoplan.runtime.train -- --plan /tmp/util/plan.json --steps 100000 --log /tmp/util/log.jsonl --quiet > /dev/null 2>&1 &
sleep 20
read -r _ u1 n1 s1 i1 w1 q1 sq1 st1 _ < /proc/stat
sleep 10
read -r _ u2 n2 s2 i2 w2 q2 sq2 st2 _ < /proc/stat
tot=$(( (u2+n2+s2+i2+w2+q2+sq2+st2) - (u1+n1+s1+i1+w1+q1+sq1+st1) ))
idle=$(( (i2+w2) - (i1+w1) ))
echo "$P busy $(( 100 * (tot - idle) / tot ))% (user $(( 100*((u2+n2)-(u1+n1))/tot ))% sys $(( 100*(s2-s1)/tot ))%)"
wait
