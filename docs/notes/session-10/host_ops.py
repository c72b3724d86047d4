# ruff: noqa  (a measurement script kept as the record of a session-10 note, not project code)
# run: OMP_NUM_THREADS=1 PYTHONPATH=$PWD python docs/notes/session-10/host_ops.py
"""Host time per operator: tiny-gpt's block, forward + backward, at one token (device time ~0), one process."""
import time, statistics, torch
from autoplan.zoo.model import build_model
from autoplan.specs import load_model
from autoplan.cost_models.profile import profile_from_spec
torch.set_num_threads(1)
spec = load_model("tiny-gpt")
model = build_model(spec)

prof = profile_from_spec(spec)
k = prof[1].kernels_fwd
print("kernels_fwd per block", k, "embedding", prof[0].kernels_fwd, "head", prof[-1].kernels_fwd)
for T in (1, 8, 64):
    x = torch.randint(0, spec.vocab_size, (1, T))
    ts = []
    for i in range(60):
        t0 = time.perf_counter()
        loss = model(x).float().sum()
        loss.backward()
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts[10:])
    ops = 3 * (k * spec.num_layers + prof[0].kernels_fwd + prof[-1].kernels_fwd)
    print(f"T={T}: fwd+bwd {t*1e3:.2f} ms, {ops} host-op units -> {t/ops*1e6:.1f} us per op")
