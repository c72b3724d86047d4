# ruff: noqa  (a measurement script kept as the record of a session-14 note, not project code)
# time Trainer's loss_fn per micro-batch on every rank: copy as sitecustomize.py into a folder on PYTHONPATH, LOSSPATCH=1
import os, sys, time, builtins, statistics
if os.environ.get("LOCAL_RANK") is not None and os.environ.get("LOSSPATCH"):
    _imp = builtins.__import__
    done = [False]; rec = []
    def hook(name, *a, **k):
        m = _imp(name, *a, **k)
        if not done[0] and hasattr(sys.modules.get('autoplan.runtime.engine'), 'Trainer'):
            done[0] = True
            e = sys.modules['autoplan.runtime.engine']
            f = e.loss_fn
            def g(*a, **k):
                t = time.perf_counter(); c = time.process_time()
                try: return f(*a, **k)
                finally:
                    rec.append((time.perf_counter() - t, time.process_time() - c))
                    if len(rec) % 16 == 0:
                        with open(f"/tmp/losspatch/out.{os.getpid()}", "w") as fh:
                            fh.write(f"rank {os.environ['LOCAL_RANK']}: loss_fn median wall {statistics.median(x[0] for x in rec[16:] or rec)*1e3:.2f} ms cpu {statistics.median(x[1] for x in rec[16:] or rec)*1e3:.2f} ms over {len(rec)}\n")
            e.loss_fn = g
        return m
    builtins.__import__ = hook
