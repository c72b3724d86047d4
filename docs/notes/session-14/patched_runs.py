# ruff: noqa  (a measurement script kept as the record of a session-14 note, not project code)
# run: PYTHONPATH=docs/notes/session-14/<patch dir> TAILPATCH=1 python docs/notes/session-14/patched_runs.py LAYOUT... (the patch writes /tmp/tailpatch/out.PID)
import sys, tempfile, glob, os
from pathlib import Path
sys.path.insert(0, '/work/main/benchmarks'); sys.path.insert(0, '/work/main')
from tune_local import workload
from autoplan.api import make_plan
from autoplan.tune.core import Candidate, run_candidate
model, cluster, training = workload('tiny-gpt', 4, 8, 64)
for cfg in sys.argv[1:]:
    for f in glob.glob('/tmp/tailpatch/out.*'): os.remove(f)
    plan = make_plan(model, cluster, training, cfg, kernels="torch")
    with tempfile.TemporaryDirectory() as tmp:
        c = Candidate(plan=plan, why='x')
        run_candidate(c, Path(tmp), steps=20, profile_step=None, time_from=3, memory_step=2)
    print(f"== {cfg}: median step {c.measured_s*1e3:.1f} ms (wall/cpu ms)", c.error or "")
    for f in sorted(glob.glob('/tmp/tailpatch/out.*')): print("  " + open(f).read().strip())
