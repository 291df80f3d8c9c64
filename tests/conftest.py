"""Session fixtures shared by several test files."""

from __future__ import annotations

import os

import pytest

# Nothing is downloaded at run time: Hugging Face libraries stay offline (tests build their models locally).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory):
    """The shared ``flashpar train`` runs of ``tests/train_runs.py``, made once per session on first use."""
    from train_runs import make_runs

    return make_runs(tmp_path_factory.mktemp("train-runs"))
