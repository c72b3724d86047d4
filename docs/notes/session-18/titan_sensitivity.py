# ruff: noqa
"""Session 18: how the torchtitan held-out rows move with two inputs no source gives: the A100's
overlap_interference (0.2, a default never fitted) and the 64-A100 cluster's network (a DGX A100's assumed)."""
import yaml
from benchmarks import fidelity as F
from autoplan.cost_models.specs import GPUCalibration

runs = [r for r in yaml.safe_load(F.HELDOUT.read_text())["runs"] if r["stack"] == "torchtitan"]
base = F.GPU_CALIBRATION if hasattr(F, "GPU_CALIBRATION") else None
from autoplan.cost_models.hardware import GPU_PRESETS
a100 = GPU_PRESETS["a100-80g"].calibration
for label, cal in (("as is (interference 0.2)", None),
                   ("interference 0", {"a100-80g": a100.model_copy(update={"overlap_interference": 0.0})}),
                   ("interference 0.1", {"a100-80g": a100.model_copy(update={"overlap_interference": 0.1})})):
    errs = []
    for run in runs:
        model, cluster, cfg, est = F.predict(F.heldout_command(run), cal)
        pub = F.published_step(run, est)
        errs.append((est.step_time_s - pub) / pub)
    print(f"{label:28s} " + "  ".join(f"{100*e:+5.1f}%" for e in errs) + f"   mean |err| {100*sum(map(abs, errs))/len(errs):.2f}%")
