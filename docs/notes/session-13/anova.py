# ruff: noqa  (a measurement script kept as the record of a session-13 note, not project code)
import json, glob, statistics, collections, os, sys
d = {}
for f in sorted(glob.glob('/tmp/s13/*.replay.json')):
    s = os.path.basename(f).split('-')[2][0]
    for r in json.load(open(f))['held_out']:
        if r['measured_s']:
            k = r['parallel'].replace('cp=1,ep=1,vp=1,', '')
            d[(s,k)] = r['after_s']/r['measured_s']-1
sets = sorted({s for s,_ in d}); lays = sorted({k for _,k in d})
sm = {s: statistics.mean(v for (a,_),v in d.items() if a==s) for s in sets}
print({s: round(100*v,1) for s,v in sm.items()})
print("set-removed", statistics.mean(abs(v-sm[s]) for (s,k),v in d.items())*100)
# two-way iterative
a = {s:0 for s in sets}; b={k:0 for k in lays}
for _ in range(50):
    for s in sets: a[s]=statistics.mean(v-b[k] for (x,k),v in d.items() if x==s)
    for k in lays: b[k]=statistics.mean(v-a[s] for (s,x),v in d.items() if x==k)
print("both-removed", statistics.mean(abs(v-a[s]-b[k]) for (s,k),v in d.items())*100)
print(json.load(open(sorted(glob.glob('/tmp/s13/*.replay.json'))[-1])).keys())
