"""The multi-node failure drill (``flashpar bench drill``), small: two network namespaces as two nodes of 2 ranks
(cp 2 x tp 2), torchrun with c10d rendezvous and ``--max-restarts 2``, ``--resume auto``; a rank of the second
node SIGKILLed at a random step after the first checkpoint, then one SIGSTOPped at a later step (found by its
peers' watchdog).  Both agents exit 0, the job finishes every step with the losses of a run without faults, and
nothing is left: no process in the namespaces, no namespace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashpar.bench.drill import plan
from flashpar.bench.netlink import links_available
from flashpar.train.watchdog import interval_of

HERE = Path(__file__).resolve().parent
WATCHDOG_S = 5.0  # steps take a fraction of a second here; a checkpoint save stamps its own phase
START_S = 30.0  # a restart's start-up on a loaded 2-core machine: 4 processes import torch, rendezvous, resume


def test_the_faults_fall_after_the_first_checkpoint_on_the_last_node_in_order():
    for seed in range(20):
        faults = plan(2, 2, 12, 3, ["kill", "stop"], seed)
        assert all(f.rank in (2, 3) for f in faults)
        assert 3 < faults[0].step < faults[1].step < 12
    with pytest.raises(ValueError, match="no room for 2 faults"):
        plan(2, 2, 5, 3, ["kill", "stop"], 0)  # steps 4 and 5 after the checkpoint: no step left after a fault


def test_a_two_node_job_restarts_by_itself_and_ends_with_the_losses_of_a_run_without_faults(tmp_path):
    ok, why = links_available()
    if not ok:
        pytest.skip(why)
    report = tmp_path / "drill.json"
    argv = [sys.executable, "-m", "flashpar.cli", "bench", "drill", "--out", str(tmp_path), "--reference",
            "--watchdog", str(WATCHDOG_S), "--steps", "8", "--save-every", "2", "--seed", "1", "--timeout", "300",
            "--json", str(report)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=420)
    assert proc.returncode == 0, out[-3000:]
    rep = json.loads(report.read_text())
    assert rep["agents_exit"] == [0, 0] and rep["leftover"] == [] and rep["last_step"] == rep["steps"], rep
    assert rep["losses_equal"] and rep["last_loss"] == rep["reference_last_loss"], rep
    kill, stop = rep["faults"]
    for f in (kill, stop):
        assert f["node"] == 1 and f["resumed_from"] is not None and 0 <= f["steps_lost"] < rep["save_every"], f
    assert kill["restart_s"] < START_S, kill
    # the stopped rank: its peers' watchdog (limit + four intervals), then the restart; torchrun alone would wait
    # its 30 s shutdown grace for the stopped process on top
    assert stop["restart_s"] < WATCHDOG_S + 4 * interval_of(WATCHDOG_S) + START_S, stop
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"fpnet{proc.pid}-" not in namespaces, namespaces
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"
    print(out.strip().splitlines()[-4:])
