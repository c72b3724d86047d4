# ruff: noqa  (a measurement script kept as the record of a session-14 note, not project code)
# host time per operator, tiny-gpt fwd+bwd at one token; run one copy alone, then four at once:
# PYTHONPATH=$PWD OMP_NUM_THREADS=1 python docs/notes/session-14/host_ops_concurrent.py NAME
import time, statistics, torch, sys
torch.set_num_threads(1)
from autoplan.zoo.model import build_model
from autoplan.specs import load_model
from autoplan.cost_models.profile import profile_from_spec
spec = load_model("tiny-gpt"); model = build_model(spec)
ops = 3 * sum(p.kernels_fwd for p in profile_from_spec(spec))
x = torch.randint(0, spec.vocab_size, (1, 1))
ts, cs = [], []
for i in range(200):
    t0 = time.perf_counter(); c0 = time.process_time()
    model(x).float().sum().backward()
    ts.append(time.perf_counter() - t0); cs.append(time.process_time() - c0)
print(f"{sys.argv[1]}: ops {ops}, wall median {statistics.median(ts[20:])/ops*1e6:.1f} us/op, min {min(ts[20:])/ops*1e6:.1f}, cpu median {statistics.median(cs[20:])/ops*1e6:.1f}", flush=True)
