# The two commands of the README. Both work on a fresh machine: they create .venv, install torch only
# when it is not importable (so a CUDA build already present is kept), install the project, then run.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.autoplan-installed
TORCH_PIN ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint setup clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): $(VPY) pyproject.toml
	@$(VPY) -c "import torch" 2>/dev/null || { echo "installing $(TORCH_PIN)"; $(VPY) -m pip install -q $(TORCH_PIN); }
	$(VPY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/autoplan demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
