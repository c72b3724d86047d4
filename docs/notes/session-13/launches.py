# ruff: noqa  (a measurement script kept as the record of a session-13 note, not project code)
# launch one layout N times (pinned or not) and print launch medians
import sys, os, tempfile, statistics
from pathlib import Path
sys.path.insert(0, '/work/main/benchmarks'); sys.path.insert(0, '/work/main')
from tune_local import workload
from autoplan.api import make_plan
from autoplan.tune.core import Candidate, run_candidate
cfg, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, cluster, training = workload('tiny-gpt', 4, 8, 64)
plan = make_plan(model, cluster, training, cfg, kernels="torch")
meds = []
with tempfile.TemporaryDirectory() as tmp:
    for i in range(n):
        c = Candidate(plan=plan, why='x')
        run_candidate(c, Path(tmp), steps=steps, profile_step=None, time_from=3, memory_step=2)
        t = c.log.step_times_s[2:]
        meds.append(c.measured_s)
        print(f"{cfg} pin={os.environ.get('S13_PIN','')} launch {i}: median {c.measured_s*1e3:.1f} ms  steps " + " ".join(f"{x*1e3:.0f}" for x in t), flush=True)
print(f"{cfg} pin={os.environ.get('S13_PIN','')} medians", " ".join(f"{x*1e3:.1f}" for x in meds), f"spread {max(meds)/min(meds)-1:.2f}")
