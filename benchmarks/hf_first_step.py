"""First-step loss of sharded runs initialised from a Hugging Face checkpoint, beside transformers' loss on the
same batch (fp32): the parity matrix of tests/models/test_hf_dist.py, printed as a table.

    python benchmarks/hf_first_step.py [--nproc 2] [CASE ...]      CASE = family:layout, e.g. gemma2:tp=2,sp=1

Each case: transformers' own model (tiny random config, tests/models/hf_configs.py) saved with save_pretrained;
a plan for that config with the layout fixed; the runtime's sharded model filled with --init-from (each rank
reading only its slices); one step. Runs tests/models/hf_parity_worker.py under one torchrun launch and prints
family, layout, autoplan's first-step loss, transformers', their relative difference and the worst relative
gradient difference after the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.models.test_hf_dist import CASES  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("cases", nargs="*", default=CASES)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="hf-first-step-")) / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(args.nproc),
           str(ROOT / "tests/models/hf_parity_worker.py"), "--out", str(out), *args.cases]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if not out.exists():
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"first step from a Hugging Face checkpoint, fp32, {args.nproc} ranks (gloo)")
    for col in ("family", "layout", "autoplan loss", "transformers loss", "rel. diff", "worst grad rel. diff"):
        table.add_column(col, justify="left" if col in ("family", "layout") else "right")
    for r in json.loads(out.read_text()):
        fam, layout = r["case"].split(":", 1)
        if "error" in r:
            table.add_row(fam, layout, "error", r["error"][:40], "", "")
            continue
        a, b = r["losses"][0], r["ref_losses"][0]
        table.add_row(fam, layout, f"{a:.7f}", f"{b:.7f}", f"{abs(a - b) / abs(b):.1e}", f"{r['max_grad_rel_err']:.1e}")
    Console(width=120).print(table)
    return 0 if all(r.get("ok") for r in json.loads(out.read_text())) else 1


if __name__ == "__main__":
    raise SystemExit(main())
