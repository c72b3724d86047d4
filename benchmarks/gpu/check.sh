#!/usr/bin/env bash
# One call on a lent GPU (one H100/H200): what only a GPU can show, in order of value, each part time-limited so a
# failure or hang costs only its own slot.
#   1. autoplan's own runtime on CUDA (nccl, bf16 autocast, the fused Triton kernels) for several one-GPU plans:
#      measured step time and allocator peak beside the plan's prediction, time components synchronised with the
#      device, and one profiled step (FLOPs and tensor memory counted on CUDA, where SDPA runs flash attention);
#   2. the GPU test tier (tests/gpu: Triton kernels compiled for the chip against their torch references);
#   3. benchmarks/kernels.py (fused kernels vs eager, achieved bandwidth);
#   4. autoplan calibrate with micro-benchmarks (GEMM efficiency at the model's shapes);
#   5. census: what one micro-batch saves for backward under CUDA autocast, by module and dtype (saved.py);
#   6. profile: a step's GPU time by kernel family beside the prediction (kernel_time.py);
#   7. launch: host vs device time per call of the fused modules and torch's (launch_overhead.py);
#   8. ckpt: what a checkpointed region costs the host, forward and backward (checkpoint_host.py, ~20 s);
#   9. cpcore: the context-parallel core's SDPA calls (lower-right causal bias, and masks) against the causal kernel, rate per computed score
#      (cp_core.py, ~10 s: the cost model prices them at the causal kernel's rate; session 24);
#  10. hostops: a step's host operators by self CPU time, no recompute / selective / full (kernel_time.py
#      --host-ops; ~120 s: session 20 found ~10 more operators per checkpointed core under bf16 autocast).
# Usage (the device tool, from the repository root; .whl holds the wheels the image lacks, see docs/notes):
#   bash benchmarks/gpu/check.sh [PARTS]        PARTS: any of "run tests kernels calibrate census profile launch
#                                               ckpt cpcore hostops"
#                                               (default: "calibrate run tests cpcore", ~450 s on an H200; each part
#                                               runs in the order of this file, calibrate first. Session 17:
#                                               "run tests census profile calibrate" needed ~600 s; session 20:
#                                               "calibrate run tests kernels" 419 s, calibrate ~45 s, the eight
#                                               plans 334 s, tests 15 s, kernels ~25 s)
#   SMOKE=1 bash benchmarks/gpu/check.sh run     the same commands on this CPU machine (local-cpu, tiny models;
#                                               session 23 added a ninth plan, the Llama config with torch's ops)
# Results: $OUT/summary.txt (the tables) and $OUT/all.tgz (plans, logs, outputs).
set -u
PARTS=${1:-"calibrate run tests cpcore"}
OUT=${OUT:-/tmp/gpu_check_out}
W=/tmp/gpu_check
mkdir -p "$OUT" "$W"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$W/pip.out" 2>&1 || { cat "$W/pip.out"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
AP="python3 -m autoplan"
pack() { tar czf "$OUT/all.tgz" -C "$W" . 2>/dev/null; }
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$W/env.txt" 2>&1
cat "$W/env.txt"

# L: the Hugging Face config (its family's own modules, torch's ops); LZ: the same shape as a spec file, built as
# autoplan's zoo model, which the fused kernels replace norms and activations of (session 23: before, the "fused"
# Llama run trained the config with torch's ops, the same CUDA kernels as the torch run)
CLUSTER=dgx-h200 SEQ=2048 G=gpt3-1.3b L=benchmarks/gpu/llama-3.2-1b.config.json LZ=benchmarks/gpu/llama-3.2-1b.yaml
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && CLUSTER=dgx-h100
[ -n "${SMOKE:-}" ] && CLUSTER=local-cpu SEQ=64 G=tiny-gpt L=tiny-llama LZ=tiny-llama
one_run() {  # NAME MODEL PARALLEL [estimate options...]
  local name=$1 model=$2 par=$3; shift 3
  local t0=$SECONDS
  [ -n "${SMOKE:-}" ] && model=tiny-gpt
  timeout 60 $AP estimate --model "$model" --cluster $CLUSTER --gpus 1 --global-batch 8 --seq-len $SEQ \
    --parallel "tp=1,pp=1,dp=1,$par" "$@" -o "$W/$name.plan.json" > "$W/$name.estimate.txt" 2>&1 \
    || { echo "$name: estimate failed"; tail -5 "$W/$name.estimate.txt"; return; }
  timeout 150 $AP run "$W/$name.plan.json" -- --steps 10 --time-from 6 $PROFILE --log-file "$W/$name.jsonl" \
    > "$W/$name.out" 2>&1 || { echo "$name: run failed"; tail -15 "$W/$name.out"; }
  echo "$name: $((SECONDS - t0)) s"
}

# calibrate first: the host constants the cost model's GPU terms take (fused_call_us, kernel_launch_us, the
# checkpoint region), in ~50 s
if [[ " $PARTS " == *" calibrate "* ]]; then
  timeout 90 $AP calibrate --nproc 1 --dtype bf16 -o "$W/calibrated.yaml" --bench-out "$W/bench.json" \
    --model gpt3-1.3b --seq-len 2048 --mbs 2 > "$W/calibrate.txt" 2>&1
  echo "calibrate rc=$?"; tail -25 "$W/calibrate.txt"; pack
fi

if [[ " $PARTS " == *" run "* ]]; then
  PROFILE="--profile-step 3"
  one_run gpt1.3b-mbs2 gpt3-1.3b mbs=2
  one_run llama1b-mbs2 $LZ mbs=2
  PROFILE=""
  one_run gpt1.3b-mbs2-torch gpt3-1.3b mbs=2 --kernels torch
  one_run gpt1.3b-mbs2-full gpt3-1.3b mbs=2,recompute=full
  one_run gpt1.3b-mbs2-sel gpt3-1.3b mbs=2,recompute=selective  # the checkpointed core's host time (session 17)
  one_run llama1b-mbs2-torch $LZ mbs=2 --kernels torch           # the search's kernel choice, on Llama
  one_run llama1b-hf-mbs2 $L mbs=2                                # the config: torch's ops, priced so
  one_run gpt1.3b-mbs4 gpt3-1.3b mbs=4
  one_run gpt2.7b-mbs2 gpt3-2.7b mbs=2
  python3 benchmarks/gpu/summary.py "$W" > "$W/summary.txt" 2>&1
  cat "$W/summary.txt"; cp "$W/summary.txt" "$OUT/summary.txt"; pack
fi

if [[ " $PARTS " == *" tests "* ]]; then
  timeout 150 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -x > "$W/pytest.txt" 2>&1
  echo "pytest rc=$?"; tail -5 "$W/pytest.txt"; pack
fi

if [[ " $PARTS " == *" kernels "* ]]; then
  timeout 120 python3 benchmarks/kernels.py --no-compile --json "$W/kernels.json" > "$W/kernels.txt" 2>&1
  echo "kernels rc=$?"; tail -30 "$W/kernels.txt"; pack
fi

if [[ " $PARTS " == *" census "* ]]; then
  for args in "$G $SEQ --mbs 2 --kernels torch" "$G $SEQ --mbs 2 --kernels fused" \
              "$LZ $SEQ --mbs 2 --kernels torch" "$LZ $SEQ --mbs 2 --kernels fused"; do
    timeout 60 python3 benchmarks/gpu/saved.py $args >> "$W/census.jsonl" 2>> "$W/census.err" || echo "census failed: $args"
  done
  python3 -c "
import json
for l in open('$W/census.jsonl'):
    d = json.loads(l)
    print(d['model'][-24:], d['kernels'], 'weights/param %.2f' % d['weight_copies_bytes_per_param'],
          'peak fwd %.2f step %.2f GiB' % (d.get('peak_forward_gib', 0), d.get('peak_step_gib', 0)),
          {g: {k: round(v, 2) for k, v in x.items()} for g, x in d['saved_bytes_per_token_h'].items()})
" 2>&1 | tee "$W/census.txt"; pack
fi

if [[ " $PARTS " == *" profile "* ]]; then
  for spec in "gpt1.3b-mbs2 $G" "gpt1.3b-mbs2-torch $G --kernels torch" "llama1b-mbs2 $LZ"; do
    set -- $spec; name=$1 model=$2; shift 2
    timeout 60 $AP estimate --model "$model" --cluster $CLUSTER --gpus 1 --global-batch 8 --seq-len $SEQ \
      --parallel tp=1,pp=1,dp=1,mbs=2 "$@" -o "$W/prof-$name.json" > /dev/null 2>&1
    timeout 90 python3 benchmarks/gpu/kernel_time.py "$W/prof-$name.json" > "$W/prof-$name.txt" 2>&1 \
      || { echo "profile failed: $name"; tail -5 "$W/prof-$name.txt"; }
    python3 -c "
import json, sys
t = open('$W/prof-$name.txt').read(); d = json.loads(t[t.index('{'):])
print('$name', 'pred %.4f wall %.4f busy %.4f' % (d['predicted_s'], d['wall_s'], d['gpu_busy_s']), d['families_ms'])
" 2>&1 | tee -a "$W/profile.txt"
  done
  pack
fi

if [[ " $PARTS " == *" launch "* ]]; then
  for shape in "--tokens 4096 --hidden 2048" "--tokens 8192 --hidden 4096"; do
    timeout 60 python3 benchmarks/gpu/launch_overhead.py $shape 2>&1 | grep -v '^\[' | tee -a "$W/launch.txt"
  done
  pack
fi

if [[ " $PARTS " == *" ckpt "* ]]; then
  timeout 60 python3 benchmarks/gpu/checkpoint_host.py 2>&1 | grep -v Warn | tee "$W/ckpt.txt"; pack
fi

if [[ " $PARTS " == *" cpcore "* ]]; then
  CP_ARGS=""
  [ -n "${SMOKE:-}" ] && CP_ARGS="--seq 1024 --heads 2 --head-dim 32 --dtype fp32"
  timeout 120 python3 benchmarks/gpu/cp_core.py $CP_ARGS 2>&1 | tee "$W/cp_core.txt"; pack
fi

if [[ " $PARTS " == *" hostops "* ]]; then
  for r in none selective full; do
    timeout 40 $AP estimate --model $G --cluster $CLUSTER --gpus 1 --global-batch 8 --seq-len $SEQ \
      --parallel tp=1,pp=1,dp=1,mbs=2,recompute=$r -o "$W/hostops-$r.plan.json" > /dev/null 2>&1
    timeout 90 python3 benchmarks/gpu/kernel_time.py "$W/hostops-$r.plan.json" --steps 2 --host-ops 25 \
      > "$W/hostops-$r.json" 2> "$W/hostops-$r.err" || { echo "hostops failed: $r"; tail -5 "$W/hostops-$r.err"; }
    python3 -c "
import json
t = open('$W/hostops-$r.json').read(); d = json.loads(t[t.index('{'):])
print('$r', 'wall %.4f busy %.4f (under the profiler)' % (d['wall_s'], d['gpu_busy_s']))
for k, v in d['host_ops_ms'].items(): print('   ', k, 'ms/step %.2f calls %d' % tuple(v))
" 2>&1 | tee -a "$W/hostops.txt"
  done
  pack
fi

date -u
