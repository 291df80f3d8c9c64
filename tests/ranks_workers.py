"""Rank functions for tests/test_ranks.py (module level: the ranks unpickle them by name)."""

from __future__ import annotations

import os
import sys


def report(rank: int, n: int) -> dict:
    """What the rank sees: the variable the test set, its parent, and a line on its stdout and stderr."""
    os.write(1, f"rank {rank} stdout\n".encode())
    print(f"rank {rank} stderr", file=sys.stderr, flush=True)
    # flashpar.train.loop: in the server's PRELOAD, imported by neither the harness nor this module
    return {"var": os.environ.get("FLASHPAR_RANKS_TEST"), "parent": os.getppid(),
            "preloaded": "flashpar.train.loop" in sys.modules}
