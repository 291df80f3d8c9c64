"""Workers restarted by torchrun (``--max-restarts``) make their default group again: ``flashpar.mesh.init_world``
puts each attempt's keys under its own prefix of the agent's store, which torchrun keeps across restarts (torch's
``env://`` rendezvous alone reads the dead workers' addresses there and fails to connect, "Connection refused")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_a_worker_killed_by_sigkill_is_restarted_and_the_new_attempt_connects():
    """2 workers under ``torchrun --max-restarts 1``: rank 1 of the first attempt is SIGKILLed after one all-reduce;
    torchrun restarts both, their default group comes up and all-reduces (sum 2 then 4), and torchrun exits 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                "--monitor-interval", "0.5"]
    proc = subprocess.run([*torchrun, str(HERE / "restart_worker.py")], capture_output=True, text=True, env=env,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the workers share torchrun's stdout: their lines may interleave, so the reports are found, not split by line
    done = sorted(re.findall(r"attempt (\d+) rank (\d+) sum (\d+)", proc.stdout))
    assert done == [("1", "0", "4"), ("1", "1", "4")], proc.stdout
