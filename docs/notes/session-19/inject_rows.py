# ruff: noqa
# Session 19: copies of the 17 saved tune sets (K..S16) with calibrate's host-time rows added where a set has none:
# the host time per operator (kernel_launch_us, one process: 5.8 us, session 18's calibrate on this machine) and,
# with --actions US, per pipeline action (pipeline_action_us, two processes: bench_pipeline_actions). A what-if on
# old measurements (the rows were measured on this machine, later than the runs), not a live result.
# python inject_rows.py OUTDIR [--actions US]
import gzip, json, sys
from pathlib import Path
NOTES = Path(__file__).resolve().parent.parent
SETS = [f"session-9/tune-set-{k}" for k in "KLMN"] + [f"session-10/tune-set-{k}" for k in "PQRST"] + \
       [f"session-11/tune-set-{k}" for k in "UV"] + ["session-13/tune-set-W", "session-14/tune-set-X",
       "session-14/tune-set-Y", "session-15/tune-set-Z", "session-16/tune-set-S16b", "session-16/tune-set-S16"]
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
actions = float(sys.argv[sys.argv.index("--actions") + 1]) if "--actions" in sys.argv else None
for s in SETS:
    d = json.load(gzip.open(NOTES / f"{s}.json.gz", "rt"))
    bench = d.setdefault("bench", {}) or {}
    d["bench"] = bench
    rows = bench.setdefault("host_op", [])
    if not any(r.get("knob", "kernel_launch_us") == "kernel_launch_us" for r in rows):
        rows.append({"seconds": 5.8e-6, "processes": 1})
    if actions is not None:
        rows.append({"seconds": actions * 1e-6, "processes": 2, "knob": "pipeline_action_us"})
    with gzip.open(out / (Path(s).name + ".json.gz"), "wt") as f:
        json.dump(d, f)
