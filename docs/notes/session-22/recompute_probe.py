# ruff: noqa
"""What a checkpointed region costs on this CPU, selective (the attention core) vs full (the block), one process, one
thread: tiny-gpt forward+backward at (1, 64) and (2, 64) with the runtime's apply_recompute, against no recompute;
the extra per region and micro-batch, beside what the preset's calibration prices (region_us + ops x op_us, plus the
core's re-run)."""
import statistics, time
import torch, torch.nn.functional as F
from autoplan.specs import load_model
from autoplan.zoo.model import build_model
from autoplan.runtime.parallelize import apply_recompute
from autoplan.plan import StagePlan

torch.set_num_threads(1)
spec = load_model("tiny-gpt")
L = spec.num_layers

def model(mode):
    torch.manual_seed(0)
    m = build_model(spec)
    if mode != "none":
        st = StagePlan(index=0, pp_rank=0, layers=(0, L), has_embedding=True, has_head=True, recompute=mode,
                       recompute_layers=L if mode == "full" else 0, forward_s=0, backward_s=0)
        apply_recompute(m, st)
    return m

ms = {k: model(k) for k in ("none", "selective", "full")}
def run(m, b):
    x = torch.randint(0, spec.vocab_size, (b, 64))
    t0 = time.perf_counter()
    F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    return time.perf_counter() - t0
for b in (1, 2):
    for _ in range(5):
        for m in ms.values(): run(m, b)
    ts = {k: [] for k in ms}
    for _ in range(61):
        for k, m in ms.items(): ts[k].append(run(m, b))
    med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
    print(f"batch {b}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items()),
          f"| per region: selective +{(med['selective'] - med['none']) / L * 1e3:.0f} us, full +{(med['full'] - med['none']) / L * 1e3:.0f} us")
