# ruff: noqa
"""Re-estimate each lent-GPU plan with the current model; print measured / predicted."""
import json, statistics, sys
from pathlib import Path
sys.path.insert(0, "benchmarks/gpu")
from summary import summarise
from autoplan.plan import Plan
from autoplan.estimate_api import estimate_config
d = Path(sys.argv[1])  # a folder of NAME.plan.json and NAME.jsonl (gunzip the logs here first)
for plan_path in sorted(d.glob("*.plan.json")):
    name = plan_path.name[:-len(".plan.json")]
    plan = Plan.model_validate_json(plan_path.read_text())
    row = summarise(name, json.loads(plan_path.read_text()), d / f"{name}.jsonl")
    from autoplan.cost_models.hardware import GPU_PRESETS
    cluster = plan.cluster.model_copy(update={"gpu": GPU_PRESETS["h200"]})
    est = estimate_config(plan.model, cluster, plan.training, plan.parallel, profiles=plan.profiles or None)
    bd = {k: round(v, 4) for k, v in est.breakdown.items() if v} if hasattr(est, "breakdown") else ""
    print(f"{name:22s} meas {row['measured_s']:.4f} stored {row['predicted_s']:.4f} ({row['measured_s']/row['predicted_s']:.2f}) now {est.step_time_s:.4f} ({row['measured_s']/est.step_time_s:.2f}) {bd}")
