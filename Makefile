# Setup, tests and the main job.  `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0: on this project's CPU machines pip takes the CPU wheel from local disk; elsewhere set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build, or leave it empty on a GPU machine.
TORCH_INDEX ?=
TORCH_PIN := torch==2.13.0

.PHONY: setup test lint docs run bench soak gpu-check clean

# pip's own lines and download bars where someone watches (standard error a terminal); elsewhere (CI, a log) only
# its errors.  Either way each step says first what it installs and about how long it takes.
PIP_SHOWS := $(shell [ -t 2 ] && echo --progress-bar on || echo -q)

$(VENV)/.installed: pyproject.toml
	@echo "make setup: 1/3 a virtual environment in $(VENV) (seconds)"
	$(PYTHON) -m venv $(VENV)
	@echo "make setup: 2/3 $(TORCH_PIN)$(if $(TORCH_INDEX), from $(TORCH_INDEX)) and its dependencies, some 750 MB" \
	      "installed (15 s from local wheels on 2 cores; minutes where the wheels are downloaded)"
	$(PY) -m pip install $(PIP_SHOWS) $(TORCH_PIN) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "make setup: 3/3 flashpar (editable) and its extras: pytest, ruff, hypothesis, transformers, pyarrow," \
	      "matplotlib, mkdocs and their dependencies, some 70 packages (30 s from local wheels; minutes downloaded)"
	$(PY) -m pip install $(PIP_SHOWS) -e '.[dev,plot,docs]'
	touch $@
	@echo "make setup: done; $(VENV)/bin/flashpar --help lists the commands"

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check src tests

# The documentation site (mkdocs.yml: docs/ and the API reference from the docstrings) into site/; --strict: a
# broken link, anchor or reference fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q

test: lint docs
	$(PY) -m pytest

# The main job, on its tiny default: the Llama-style model trained with TP-SP + CP on real packed
# documents, 4 CPU processes (tp=2, cp=2), 400 steps; then a one-step --check.  Where the time goes: from a
# fresh clone `setup` comes first (a virtual environment, torch and the extras installed: minutes, more than
# the run; 5.5 minutes in all were measured once from a fresh clone), then the run itself, about 2 minutes
# on 2 idle cores (4 ranks starting, 400 steps, the plot), then the check (one launch and one step).
run: setup
	$(VENV)/bin/flashpar train --plot
	$(VENV)/bin/flashpar train --check

# Benchmarks: every overlap mode (about 4 minutes) and every context-parallel strategy (about 2 minutes).
bench: setup
	$(VENV)/bin/flashpar bench overlap --nproc 2 --link-rate 1gbit --rounds 3
	$(VENV)/bin/flashpar bench cp --nproc 4 --link-rate 300mbit --packs 2 --rounds 5

# The default job for 2,000 steps, watched for leaks: resident memory per rank must grow < 5% after a
# 200-step warm-up, and threads, file descriptors, process groups and child processes must not grow
# (flashpar.train.soak; about 10 minutes on 2 idle cores, 29 measured under load).  Not in CI.
soak: setup
	$(PY) -m flashpar.train.soak --steps 2000 --out runs/soak

# On one CUDA GPU, under 8 minutes: the CUDA-only tests, the CP kernels' and split GEMMs' rates, the trainer at
# world size 1; the report goes to $OUT, else runs/gpu-check (flashpar.gpu_check).  No venv: a GPU machine's
# python3 holds PyTorch with CUDA.  GPU_CHECK_ARGS=--dry-run rehearses it on the CPU at tiny sizes.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?= --device cuda
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m flashpar.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
