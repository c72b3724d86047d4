# ruff: noqa  (a measurement script kept as the record of a session-14 note, not project code)
# time the step tail's parts per rank (measurement only)
import os, sys, time, atexit, statistics
if os.environ.get("LOCAL_RANK") is not None and os.environ.get("TAILPATCH"):
    import builtins
    _orig_import = builtins.__import__
    rec = {}
    def wrap(cls, name):
        f = getattr(cls, name)
        def g(self, *a, **k):
            t = time.perf_counter(); cp = time.process_time()
            try: return f(self, *a, **k)
            finally:
                rec.setdefault(name, []).append(((time.perf_counter()-t), time.process_time()-cp))
                if name == 'step': dump()
        setattr(cls, name, g)
    done = [False]
    def hook(name, *a, **k):
        m = _orig_import(name, *a, **k)
        if not done[0] and hasattr(sys.modules.get('autoplan.runtime.engine'), 'Trainer'):
            done[0] = True
            import autoplan.runtime.engine as e
            for n in ("_finalize_grads", "grad_norm", "_reduce_loss", "step"):
                wrap(e.Trainer, n)
            import torch
            f = torch.optim.AdamW.step
            def s(self, *a, **k):
                t = time.perf_counter(); cp = time.process_time()
                try: return f(self, *a, **k)
                finally: rec.setdefault("adamw", []).append((time.perf_counter()-t, time.process_time()-cp))
            torch.optim.AdamW.step = s
        return m
    builtins.__import__ = hook
    def dump():
        out = f"rank {os.environ['LOCAL_RANK']}: " + "  ".join(f"{k} {statistics.median(x[0] for x in v[3:])*1e3:.2f}/{statistics.median(x[1] for x in v[3:])*1e3:.2f}" for k, v in rec.items() if len(v) > 3)
        with open(f"/tmp/tailpatch/out.{os.getpid()}", "w") as fh: fh.write(out + "\n")
    atexit.register(dump)
