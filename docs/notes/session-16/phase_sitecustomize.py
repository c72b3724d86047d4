# ruff: noqa
# Session 16: wall and CPU time of each pipeline action (forward_one_chunk / backward_one_chunk) and of each
# backward() call and the whole Trainer.step, per rank (measurement only; PHASEPATCH=1).
import os, sys, time, statistics
if os.environ.get("LOCAL_RANK") is not None and os.environ.get("PHASEPATCH"):
    import builtins
    _orig_import = builtins.__import__
    rec = {}
    def timed(name, f):
        def g(*a, **k):
            t = time.perf_counter(); c = time.process_time()
            try: return f(*a, **k)
            finally: rec.setdefault(name, []).append((time.perf_counter() - t, time.process_time() - c))
        return g
    def dump():
        os.makedirs("/tmp/phasepatch", exist_ok=True)
        n = len(rec.get("step", []))
        with open(f"/tmp/phasepatch/out.{os.environ['RANK']}", "w") as fh:
            parts = []
            for k, v in sorted(rec.items()):
                per = len(v) // max(1, n)
                v = v[3 * per:]
                if not v: continue
                parts.append(f"{k} x{per} {statistics.median(x[0] for x in v)*1e3:.2f}/{statistics.median(x[1] for x in v)*1e3:.2f}")
            fh.write(f"rank {os.environ['RANK']}: " + "  ".join(parts) + "\n")
    done = [False]
    def hook(name, *a, **k):
        m = _orig_import(name, *a, **k)
        if not done[0] and hasattr(sys.modules.get('autoplan.runtime.engine'), 'Trainer'):
            done[0] = True
            import autoplan.runtime.engine as e
            st = e.Trainer.step
            first = [True]
            def step(self, *a, **k):
                if first[0]:
                    first[0] = False; patch()
                r = timed("step", st)(self, *a, **k); dump(); return r
            e.Trainer.step = step
        return m
    def patch():
        if True:
            import torch
            torch.Tensor.backward = timed("tensor.backward", torch.Tensor.backward)
            from torch.distributed.pipelining import stage as S
            S._PipelineStageBase.forward_one_chunk = timed("pp.fwd", S._PipelineStageBase.forward_one_chunk)
            S._PipelineStageBase.backward_one_chunk = timed("pp.bwd", S._PipelineStageBase.backward_one_chunk)
            from torch.distributed.pipelining import schedules as SC
            for cls in (SC.PipelineScheduleSingle, SC.PipelineScheduleMulti):
                cls.step = timed("pp.schedule", cls.step)
            torch.optim.AdamW.step = timed("adamw", torch.optim.AdamW.step)
            import autoplan.runtime.engine as e
            for n in ("_finalize_grads", "_clip_grads", "_reduce_loss"):
                setattr(e.Trainer, n, timed(n, getattr(e.Trainer, n)))
            import torch.nn.functional as F
            e.loss_fn = timed("loss_fn", e.loss_fn)
    builtins.__import__ = hook
