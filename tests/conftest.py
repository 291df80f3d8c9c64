"""Session fixtures shared by several test files."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Nothing is downloaded at run time: Hugging Face libraries stay offline (tests build their models locally).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# torch.compile's on-disk caches (inductor's kernels, AOT graphs) in a folder of this session's, shared by its
# spawned ranks and CLI runs: the tests compile from scratch, never from what an earlier run left on the machine
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache = tempfile.mkdtemp(prefix="flashpar-inductor-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory):
    """The shared ``flashpar train`` runs of ``tests/train_runs.py``, made once per session on first use."""
    from train_runs import make_runs

    return make_runs(tmp_path_factory.mktemp("train-runs"))
