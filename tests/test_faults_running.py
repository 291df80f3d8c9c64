"""Failure drills of the running job (the checkpoint and input drills are ``tests/test_faults.py``, a stopped rank
found by the watchdog ``tests/test_watchdog.py``): a rank killed in the middle of a step, a link that stops carrying
traffic.  Each ends the job within ``--timeout`` with one line, and no rank process is left behind.  A rank whose
wait times out reads the ranks' phase stamps (``flashpar.train.where``) and names the ranks behind it, with their
process state (stopped, for a SIGSTOPped one), or says that a transfer stopped."""

from __future__ import annotations

import functools
import os
import time

from flashpar.train import where
from flashpar.train.config import TrainConfig
from flashpar.train.loop import Hooks
from flashpar.train.run import launch
from train_workers import kill_during

LINK_TIMEOUT_S = 15.0  # also the rendezvous's: four fresh processes import torch at once before they join


def test_a_rank_killed_mid_step_ends_the_job_with_one_line(tmp_path, capsys):
    """Rank 2 is SIGKILLed 150 ms into step 2 (a timer its own hook starts): the launcher names the rank and the
    signal, stops the others, and the job ends long before the timeout (the others do not wait it out)."""
    config = TrainConfig(steps=4, seq_len=128, max_docs=40, workers=0, timeout=60.0, out=str(tmp_path))
    t0 = time.monotonic()
    rc = launch(config, hooks=Hooks(before_step=functools.partial(kill_during, rank=2, at=2, after_s=0.15)))
    took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and "a rank failed: process 2 terminated with signal SIGKILL" in err[-1], err[-3:]
    stamps = where.read(tmp_path / ".where")
    assert stamps[2][1] == 2, f"rank 2 died in step {stamps[2][1]} ({stamps[2][3]}), not step 2"
    assert not [r for r, s in stamps.items() if os.path.exists(f"/proc/{s[0]}")], "no rank process left"
    assert took < 60, took
    print(f"killed in step 2 {stamps[2][3]}; job ended after {took:.1f} s")


def test_blame_names_ranks_behind_or_says_none_is(tmp_path):
    for r, (step, phase) in enumerate([(4, "forward"), (4, "data"), (3, "optimizer")]):
        s = where.Stamps(tmp_path, r)
        s.begin_step(step)
        if phase != "data":
            s.enter("input check")
            s.enter(phase)
        s.close()
    line = where.blame(0, tmp_path)
    assert line.startswith("did not arrive: rank 2 (") and "in step 3 optimizer; rank 1 (" in line
    assert line.endswith("rank 0 waited in step 4 forward")
    assert "no rank is behind rank 2" in where.blame(2, tmp_path)
    assert where.blame(7, tmp_path) == ""


def test_blame_says_a_transfer_stopped_when_the_ranks_behind_wait_in_an_exchange(tmp_path):
    """A rank behind, alive, in the step's input check (one collective) is itself waiting for a transfer: the
    line says a transfer stopped.  The same rank stopped (SIGSTOP), or alive in a phase that computes, is
    named as the one that did not arrive."""
    import signal
    import subprocess

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        for r, (phase, pid) in enumerate([("forward", None), ("input check", sleeper.pid)]):
            s = where.Stamps(tmp_path, r)
            s.pid = pid or s.pid
            s.begin_step(2)
            s.enter("input check")
            if phase != "input check":
                s.enter(phase)
            s.close()
        line = where.blame(0, tmp_path)
        # the sleeper reads as running, waiting or, just started on a busy box, in a disk wait (alive each way)
        assert "wait in an exchange themselves (rank 1 (" in line and ") in step 2 input check;" in line, line
        assert line.endswith("a transfer between ranks stopped, not a rank"), line
        sleeper.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while where.process_state(sleeper.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert where.blame(0, tmp_path).startswith("did not arrive: rank 1 (stopped) in step 2 input check")
        sleeper.send_signal(signal.SIGCONT)
        s = where.Stamps(tmp_path, 1)
        s.pid = sleeper.pid
        s.begin_step(2)
        s.enter("data")  # alive, behind, in a phase that computes
        s.close()
        line = where.blame(0, tmp_path)  # just continued: running or waiting
        assert line.startswith("did not arrive: rank 1 (") and ") in step 2 data; rank 0 waited" in line, line
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_link_that_stops_ends_the_job_within_the_timeout(tmp_path):
    """Rank 1's emulated link drops everything from step 2 on (``EmulatedLinks.cut``; the process lives on):
    the ranks, started as torchrun would (one ``flashpar train`` process each, RANK in the environment), time
    out in the same phase (or a rank behind waits in the step's input check, which the cut can split) and say
    that a transfer stopped, not a rank; the job ends within the timeout."""
    import subprocess
    import sys
    import threading

    import pytest

    from flashpar.bench.netlink import EmulatedLinks, launch_ranks, links_available

    ok, why = links_available()
    if not ok:
        pytest.skip(why)
    argv = [sys.executable, "-m", "flashpar.cli", "train", "--steps", "6", "--seq-len", "128", "--max-docs", "40",
            "--workers", "0", "--timeout", str(LINK_TIMEOUT_S), "--watchdog", "0", "--out", str(tmp_path)]
    stamp, cut_at = tmp_path / ".where" / "rank1", []

    def cut_at_step_2(links):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            stamps = where.read(tmp_path / ".where") if stamp.exists() else {}
            if 1 in stamps and stamps[1][1] >= 2:
                links.cut(1)
                cut_at.append(time.time())
                return
            time.sleep(0.05)

    with EmulatedLinks(4, "1gbit") as links:
        cutter = threading.Thread(target=cut_at_step_2, args=(links,), daemon=True)
        cutter.start()
        with pytest.raises(RuntimeError) as err:
            launch_ranks(4, argv, links=links, timeout=180)
        ended = time.time()
        cutter.join(1)
    assert cut_at, f"the run never reached step 2: {err.value}"
    msg = str(err.value)
    assert "timed out" in msg.lower() and "a transfer between ranks stopped, not a rank" in msg, msg[-1500:]
    # the timeout, plus the rest of the step in flight and the error path (seconds each on a loaded 2-core box);
    # without timeouts on the waits the ranks would hang until launch_ranks' 180 s limit
    assert ended - cut_at[0] < LINK_TIMEOUT_S + 30, ended - cut_at[0]
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not leftover, f"rank processes left behind: {leftover}"
