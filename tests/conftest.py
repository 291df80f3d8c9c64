"""Session fixtures shared by several test files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory):
    """The shared ``flashpar train`` runs of ``tests/train_runs.py``, made once per session on first use."""
    from train_runs import make_runs

    return make_runs(tmp_path_factory.mktemp("train-runs"))
