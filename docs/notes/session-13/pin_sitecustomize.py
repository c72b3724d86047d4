# ruff: noqa  (a measurement script kept as the record of a session-13 note, not project code)
import os
r = os.environ.get("LOCAL_RANK")
if r is not None and os.environ.get("S13_PIN"):
    n = os.cpu_count()
    os.sched_setaffinity(0, {int(r) % n})
