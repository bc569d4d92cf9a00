# Stencil: `make serve` and `make test` set themselves up from nothing (idempotent), saying each step in
# one line (pip itself stays quiet, -q, so CI logs stay short); `stencil serve` then says what it loads
# and ends with the address and a curl to try.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
# Where pip finds a CPU build of torch: empty = pip's own configuration (this project's machines keep the CPU
# wheel on disk); elsewhere e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_INDEX ?=
STENCIL_CACHE_DIR ?= $(HOME)/.cache/stencil
# Test processes (pytest-xdist, one file's tests in one process): 2 runs the suite in about a third
# of one process's time on 2 cores (much of it waits on servers, subprocesses and the GIL).
TEST_WORKERS ?= 2
HOST ?= 127.0.0.1
PORT ?= 8000
export STENCIL_CACHE_DIR
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# `python -m` from the repository root would put the root on sys.path, where the kernels/ folder
# (stencil.kernels) shadows Hugging Face's `kernels`, which transformers imports.
export PYTHONSAFEPATH := 1

.PHONY: setup serve test test-fast bench clean-venv

$(VENV)/.torch-$(TORCH_VERSION):
	@test -x $(PY) || { echo "stencil: creating the virtual environment $(VENV) ..."; $(PYTHON) -m venv $(VENV); }
	@$(PIP) install -q --upgrade "pip>=24"
	@# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	@echo "stencil: installing CPU torch $(TORCH_VERSION) (a 192 MB download, 750 MB installed; once) ..."
	@$(PIP) install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),) torch==$(TORCH_VERSION)
	@touch $@

$(VENV)/.project: pyproject.toml $(VENV)/.torch-$(TORCH_VERSION)
	@echo "stencil: installing Stencil and its dependencies, test and benchmark extras included (1.2 GB installed; once) ..."
	@$(PIP) install -q -e ".[test,bench]"
	@touch $@

setup: $(VENV)/.project
	@$(PY) -m stencil.engine.models.default_model

serve: setup
	$(VENV)/bin/stencil serve --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15

test-fast: setup
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile -m "not slow"

clean-venv:
	rm -rf $(VENV)
