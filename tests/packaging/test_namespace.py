"""The installed distribution exposes `autoplan` only, so it installs beside Hugging Face's `kernels` package
(which transformers probes for) and transformers without shadowing either.

Builds the wheel (pip wheel, no build isolation: setuptools from this environment), checks its top-level
names and top_level.txt, installs it into a scratch folder and imports everything from there in a fresh
process whose path does not contain this source tree (whose top-level `kernels/` folder would shadow HF's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Without this tree on PYTHONPATH: its top-level kernels/ folder would shadow Hugging Face's `kernels`,
    # whose setuptools hooks pip's build imports.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        str(ROOT), "-w", str(out)], capture_output=True, text=True, cwd=out, env=env)
    if r.returncode != 0:
        pytest.skip(f"cannot build the wheel here: {r.stderr.strip().splitlines()[-1:]}")
    return next(out.glob("autoplan-*.whl"))


def test_wheel_top_level_is_autoplan_only(wheel):
    z = zipfile.ZipFile(wheel)
    names = z.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"autoplan"}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert z.read(top_level).decode().split() == ["autoplan"]
    for sub in ("cost_models", "codegen", "runtime", "kernels"):
        assert f"autoplan/{sub}/__init__.py" in names, sub


def test_installed_beside_hf_kernels_and_transformers(wheel, tmp_path):
    target = tmp_path / "site"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        str(wheel)], capture_output=True, text=True, env=clean, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    code = """
import importlib.util, json
out = {}
import autoplan.kernels, autoplan.cost_models, autoplan.runtime, autoplan.codegen
out["autoplan"] = autoplan.kernels.__file__
spec = importlib.util.find_spec("kernels")
out["kernels"] = spec.origin if spec else None
if spec:
    import kernels
    out["hf_api"] = hasattr(kernels, "get_kernel")
try:
    import transformers
    from transformers.integrations import hub_kernels  # noqa: F401 - what probes for `kernels`
    out["transformers"] = transformers.__version__
except ImportError:
    out["transformers"] = None
print(json.dumps(out))
"""
    env = {**clean, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["autoplan"].startswith(str(target))
    if out["kernels"] is None:
        pytest.skip("Hugging Face `kernels` is not installed (pip install kernels); autoplan alone imports")
    assert not out["kernels"].startswith(str(target)), "autoplan's wheel must not provide a top-level kernels"
    assert out["hf_api"], "`import kernels` must be Hugging Face's package (get_kernel)"
    if out["transformers"] is None:
        pytest.skip("transformers is not installed")
