# ruff: noqa  (a measurement script kept as the record of a session-13 note, not project code)
import json, subprocess, os, sys, collections, statistics
root = sys.argv[1] if len(sys.argv) > 1 else '/work/main'
N='/work/main/docs/notes'
sets = [f'{N}/session-9/tune-set-{s}.json.gz' for s in 'KLMN'] + [f'{N}/session-10/tune-set-{s}.json.gz' for s in 'PQRST'] + [f'{N}/session-11/tune-set-{s}.json.gz' for s in 'UV']
by = collections.defaultdict(list); rows=[]
for f in sets:
    out = subprocess.run([sys.executable, 'benchmarks/tune_local.py', '--replay', f, '--json'], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=root)).stdout
    d = json.loads(out.splitlines()[0])
    json.dump(d, open('/tmp/s13/'+os.path.basename(f)+'.replay.json','w'))
    for r in d['held_out']:
        if r['measured_s']:
            k = r['parallel'].replace('cp=1,ep=1,vp=1,', '').replace('schedule=', '')
            by[k].append(r['after_s'] / r['measured_s'] - 1)
for k, v in sorted(by.items(), key=lambda kv: statistics.mean(kv[1])):
    print(f"{k:60s} mean {statistics.mean(v)*100:+6.1f}%  " + " ".join(f"{x*100:+4.0f}" for x in v))
allv = [abs(x) for v in by.values() for x in v]
print("mean abs", statistics.mean(allv)*100)
print("bias-removed mean abs", statistics.mean([abs(x-statistics.mean(v)) for v in by.values() for x in v])*100)
