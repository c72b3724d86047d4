# ruff: noqa  (a measurement script kept as the record of a session-14 note, not project code)
"""The same layout (same code, same work) measured in three sets: how far apart are its CPU seconds per step, not
its wall time? run: python docs/notes/session-14/cpu_noise.py"""
import gzip, json, math, statistics as st
SETS = {"V": "docs/notes/session-11/tune-set-V.json.gz", "W": "docs/notes/session-13/tune-set-W.json.gz",
        "X": "docs/notes/session-14/tune-set-X.json.gz"}
by = {}
for n, f in SETS.items():
    d = json.load(gzip.open(f))
    for c in d["tuned"] + d["held_out"]:
        t = c["log"]["timings"]
        cpu = sum(st.median(e["ranks"][i]["cpu_s"] for e in t) for i in range(len(t[0]["ranks"])))
        step = st.median(max(x["step_s"] for x in e["ranks"]) for e in t)
        by.setdefault(c["parallel"], {})[n] = (cpu, step)
devs_c, devs_s = [], []
for p, v in by.items():
    if len(v) < 3:
        continue
    lc = [math.log(v[n][0]) for n in SETS]
    ls = [math.log(v[n][1]) for n in SETS]
    devs_c += [abs(x - st.mean(lc)) for x in lc]
    devs_s += [abs(x - st.mean(ls)) for x in ls]
    print(f"{p[:64]:64s} node CPU ms/step " + " ".join(f"{n} {v[n][0]*1e3:7.1f}" for n in SETS)
          + f"  max/min {math.exp(max(lc) - min(lc)):.2f}   step max/min {math.exp(max(ls) - min(ls)):.2f}")
print(f"mean |deviation from the layout's mean over V, W, X|: CPU {st.mean(devs_c)*100:.1f}%, step {st.mean(devs_s)*100:.1f}%")
