# ruff: noqa
"""Re-estimate each lent-GPU plan with the current model (the dgx-h200 preset's calibration, not the one the plan
recorded); print measured / predicted step time and the allocator peak against the peak less the framework
overhead.

    python docs/notes/session-17/repredict.py DIR   # NAME.plan.json and NAME.jsonl pairs (gunzip the logs first)
"""
import json, sys
from pathlib import Path

sys.path.insert(0, "benchmarks/gpu")
from summary import summarise
from autoplan.plan import Plan
from autoplan.estimate_api import estimate_config
from autoplan.cost_models.hardware import GPU_PRESETS

d = Path(sys.argv[1])
for plan_path in sorted(d.glob("*.plan.json")):
    name = plan_path.name[:-len(".plan.json")]
    plan = Plan.model_validate_json(plan_path.read_text())
    row = summarise(name, json.loads(plan_path.read_text()), d / f"{name}.jsonl")
    cluster = plan.cluster.model_copy(update={"gpu": GPU_PRESETS["h200"]})
    est = estimate_config(plan.model, cluster, plan.training, plan.parallel, profiles=plan.profiles or None)
    other = cluster.gpu.calibration.framework_overhead_gib
    mem = est.peak_memory_gib - other
    print(f"{name:22s} step meas {row['measured_s']:.4f} pred {est.step_time_s:.4f} m/p {row['measured_s'] / est.step_time_s:.2f}"
          f"  |  peak meas {row['measured_peak_gib']:.2f} pred-other {mem:.2f} ({100 * (row['measured_peak_gib'] / mem - 1):+.1f}%)")
