# Setup, tests and the main job.  `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0: on this project's CPU machines pip takes the CPU wheel from local disk; elsewhere set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build, or leave it empty on a GPU machine.
TORCH_INDEX ?=
TORCH_PIN := torch==2.13.0

.PHONY: setup test lint run bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check src tests

test: lint
	$(PY) -m pytest

# The main job, on a small default: every overlapped op (TP, sharded DP, Ulysses) and mode side by side
# at N=2 on an emulated 1 Gbit/s link (about 4 minutes).
run: setup
	$(VENV)/bin/flashpar bench overlap --nproc 2 --link-rate 1gbit --rounds 3

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
