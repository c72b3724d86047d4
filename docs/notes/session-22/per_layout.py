# ruff: noqa
"""Aggregate replays' held-out errors by layout: mean signed error (refit / measured - 1), mean |error|, count,
and the mean of each component's (refit - measured) in ms."""
import json, sys, statistics
from collections import defaultdict
from pathlib import Path
rows = defaultdict(list); comps = defaultdict(lambda: defaultdict(list)); errs = []; chosen = []
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    try:
        d = json.loads(f.read_text())
    except Exception:
        print("bad", f); continue
    errs.append(d["mean_error_after"]); chosen.append(d["chosen_over_fastest"])
    for h in d["held_out"]:
        key = h["parallel"].replace(",cp=1,ep=1,vp=1", "").replace(",schedule=1f1b", "")
        rows[key].append(h["after_s"] / h["measured_s"] - 1)
        for c, m in (h.get("components_measured") or {}).items():
            r = (h.get("components_refit") or {}).get(c, 0.0)
            comps[key][c].append((r - m) * 1e3)
tot = sum(abs(x) for v in rows.values() for x in v)
for k, v in sorted(rows.items(), key=lambda kv: -sum(abs(x) for x in kv[1])):
    cs = " ".join(f"{c} {statistics.mean(x):+.1f}" for c, x in comps[k].items() if abs(statistics.mean(x)) >= 0.5)
    print(f"{k:75s} n={len(v):2d} signed {statistics.mean(v)*100:+6.1f}% |e| {statistics.mean(map(abs, v))*100:5.1f}% share {sum(map(abs, v))/tot*100:4.1f}%  {cs}")
print(f"mean error {statistics.mean(errs)*100 if errs[0] < 1 else statistics.mean(errs):.2f} over {len(errs)} sets; chosen/fastest within 1.05 in {sum(c <= 1.05 for c in chosen)}")
