# ruff: noqa  (a measurement script kept as the record of a session-11 note, not project code)
# run: python docs/notes/session-11/pattern.py $PWD   -- per-layout signed held-out error over the nine saved sets
import json, subprocess, os, sys, collections, statistics
root = sys.argv[1] if len(sys.argv) > 1 else '/work/wt/exp'
sets = [f'/work/main/docs/notes/session-9/tune-set-{s}.json.gz' for s in 'KLMN'] + [f'/work/main/docs/notes/session-10/tune-set-{s}.json.gz' for s in 'PQRST']
by = collections.defaultdict(list)
for f in sets:
    out = subprocess.run([sys.executable, 'benchmarks/tune_local.py', '--replay', f, '--json'], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=root)).stdout
    d = json.loads(out.splitlines()[0])
    for r in d['held_out']:
        if r['measured_s']:
            k = r['parallel'].replace('cp=1,ep=1,vp=1,', '').replace('schedule=', '')
            by[k].append(r['after_s'] / r['measured_s'] - 1)
for k, v in sorted(by.items(), key=lambda kv: statistics.mean(kv[1])):
    print(f"{k:70s} mean {statistics.mean(v)*100:+6.1f}%  " + " ".join(f"{x*100:+4.0f}" for x in v))
allv = [abs(x) for v in by.values() for x in v]
print("mean abs", statistics.mean(allv)*100)
