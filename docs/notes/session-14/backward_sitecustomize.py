# ruff: noqa  (a measurement script kept as the record of a session-14 note, not project code)
import os, sys, time, statistics
if os.environ.get("LOCAL_RANK") is not None and os.environ.get("BWPATCH"):
    import torch
    rec = {}
    cnt = [0]
    f = torch.Tensor.backward
    def bw(self, *a, **k):
        t = time.perf_counter(); c = time.process_time()
        try: return f(self, *a, **k)
        finally:
            i = cnt[0] % int(os.environ["BWPATCH"]); cnt[0] += 1
            rec.setdefault(i, []).append((time.perf_counter() - t, time.process_time() - c))
            if cnt[0] % int(os.environ["BWPATCH"]) == 0:
                with open(f"/tmp/bwpatch/out.{os.getpid()}", "w") as fh:
                    fh.write(f"rank {os.environ['LOCAL_RANK']}: " + "  ".join(
                        f"bwd[{j}] {statistics.median(x[0] for x in v[3:])*1e3:.2f}/{statistics.median(x[1] for x in v[3:])*1e3:.2f}"
                        for j, v in sorted(rec.items()) if len(v) > 3) + "\n")
    torch.Tensor.backward = bw
