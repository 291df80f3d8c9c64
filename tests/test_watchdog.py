"""The step-progress watchdog (``flashpar.train.watchdog``): what it names from two reads of the heartbeats, its
thread on a store in this process, and a stopped rank found by its peers' watchdogs long before ``--timeout``; a
torchrun worker's report of its failure (one line when a peer is gone)."""

from __future__ import annotations

import functools
import os
import time

import pytest

from flashpar.train import where
from flashpar.train.config import TrainConfig
from flashpar.train.loop import Hooks
from flashpar.train.run import GRACE_S, launch
from flashpar.train.watchdog import Beat, diagnose, interval_of
from train_workers import stop_at


def _beat(tick, step, seq, phase="forward", pid=100):
    return Beat(tick, step, seq, pid, "node1", phase)


def test_a_rank_whose_heartbeat_stands_still_or_never_came_is_named_silent():
    first = {0: _beat(5, 7, 3), 1: _beat(9, 7, 1, "data", pid=41), 2: _beat(4, 7, 3)}
    second = {0: _beat(8, 7, 3), 1: _beat(9, 7, 1, "data", pid=41), 2: _beat(7, 7, 3)}
    clause, silent = diagnose(0, first, second, world=4)
    assert silent == [1, 3]
    assert clause == ("silent (stopped, frozen or gone): rank 1 (pid 41 on node1) last heard in step 7 data; rank 3 "
                      "(no heartbeat)")
    # its own stamp, where this host sees it (the same pid), says where it stopped; another process's does not
    clause, _ = diagnose(0, first, second, world=3, stamps={1: (41, 8, 1, "data")})
    assert clause == "silent (stopped, frozen or gone): rank 1 (pid 41 on node1) in step 8 data"
    clause, _ = diagnose(0, first, second, world=3, stamps={1: (42, 8, 1, "data")})
    assert clause.endswith("last heard in step 7 data")


def test_with_every_rank_ticking_the_ranks_behind_are_named_or_a_transfer_stopped():
    first = {r: _beat(1, 7, 3) for r in range(3)}
    second = {0: _beat(2, 7, 3), 1: _beat(2, 7, 2, "input check"), 2: _beat(2, 7, 3)}
    clause, silent = diagnose(0, first, second, world=3)
    assert silent == [] and clause == ("behind the others (alive, not progressing): rank 1 (pid 100 on node1) in "
                                       "step 7 input check")
    second[1] = _beat(2, 7, 3)
    clause, _ = diagnose(0, first, second, world=3)
    assert clause == ("every rank waits at the same point in step 7 forward: a transfer between ranks stopped, not a "
                      "rank")


def test_the_interval_is_a_tenth_of_the_limit_within_bounds():
    assert interval_of(1.0) == 0.2 and interval_of(10.0) == 1.0 and interval_of(600.0) == 5.0


@pytest.mark.parametrize("value", [-1.0, True, "soon"])
def test_a_bad_watchdog_is_one_line(value):
    with pytest.raises(ValueError, match="^watchdog must be a number of seconds >= 0"):
        TrainConfig(watchdog=value)


def test_the_watchdog_defaults_to_the_timeout_and_zero_is_off():
    assert TrainConfig(timeout=42.0).watchdog_s == 42.0
    assert TrainConfig(timeout=42.0, watchdog=0).watchdog_s == 0.0


WATCHDOG_S = 3.0


def test_a_stopped_rank_is_named_by_the_watchdog_long_before_the_timeout(tmp_path, capsys):
    """2 ranks (cp 2), rank 1 stops itself (SIGSTOP) before step 2, ``--timeout 120 --watchdog 3``: rank 0's
    watchdog finds rank 1's heartbeat standing still, names it, and ends; the launcher kills the stopped rank after
    its grace.  From the stall to the end: the limit, four intervals, the grace and slack for a loaded machine,
    far below the timeout."""
    config = TrainConfig(steps=3, cp=2, tp=1, seq_len=128, max_docs=20, workers=0, timeout=120.0,
                         watchdog=WATCHDOG_S, out=str(tmp_path))
    rc = launch(config, hooks=Hooks(before_step=functools.partial(stop_at, rank=1, at=2)))
    ended = time.time()
    stalled = os.path.getmtime(tmp_path / ".where" / "rank1")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1].startswith("flashpar train: a rank failed: rank 0: no progress for "), err[-3:]
    assert "silent (stopped, frozen or gone): rank 1 (pid " in err[-1] and ") in step 2 data" in err[-1], err[-1]
    stamps = where.read(tmp_path / ".where")
    assert not [r for r, s in stamps.items() if os.path.exists(f"/proc/{s[0]}")], "no rank process left"
    bound = WATCHDOG_S + 4 * interval_of(WATCHDOG_S) + GRACE_S
    assert ended - stalled < bound + 10, (ended - stalled, bound)
    print(f"stall to end: {ended - stalled:.1f} s (bound {bound:.1f} s + slack)")


class _Store:
    """A dict with the three TCPStore calls the watchdog makes."""

    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]


def test_the_thread_publishes_fires_once_stalled_and_names_the_silent_peer(tmp_path, monkeypatch):
    """In process, on a dict store: rank 0's thread publishes its beats; while its stamp moves it stays quiet; once
    its stamp stands still for the limit it reads the beats twice, finds rank 1's tick standing still (its beat
    written once, by hand) and ends with one line naming rank 1 in the phase of its stamp."""
    from flashpar.train import watchdog

    monkeypatch.setattr(where, "_MINE", None)  # this process's stamps: none again after the test
    stamps = where.install(tmp_path / ".where", 0)
    peer = where.Stamps(tmp_path / ".where", 1)
    peer.begin_step(4)
    store, ended = _Store(), []
    dog = watchdog.Watchdog(1.0, rank=0, world=2, store=store, attempt="0")
    store.set(dog.key(1), Beat(3, 4, 1, peer.pid, dog.host, "data").text())
    monkeypatch.setattr(dog, "_end", ended.append)
    monkeypatch.setattr(dog, "_kill_if_stopped", lambda rank, beat: False)
    stamps.begin_step(4)
    dog.start()
    try:
        for _ in range(8):  # 1.6 s of progress: a phase every 0.2 s, never 1 s without one
            time.sleep(0.2)
            stamps.enter("forward")
        assert not ended and Beat.parse(store.get(dog.key(0)).decode()).step == 4
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.stop()
        peer.close()
        stamps.close()
    assert len(ended) == 1, ended
    named = f"silent (stopped, frozen or gone): rank 1 (pid {peer.pid} on {dog.host}) in step 4 data"
    assert ended[0].startswith(f"rank 0: no progress for 1 s (--watchdog 1; this rank in step 4 forward): {named}")


def test_a_torchrun_worker_reports_a_gone_peer_in_one_line_and_a_bug_with_its_traceback(monkeypatch):
    from flashpar.train.run import _worker_failed

    monkeypatch.setenv("RANK", "2")
    gone = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:4: Connection reset by peer. "
                        "This is typically caused by a remote worker\nmore")
    try:
        raise ValueError("in the lane") from gone
    except ValueError as err:
        line = _worker_failed(err)
    assert "\n" not in line and line.startswith("flashpar train: rank 2"), line
    assert line.endswith("a peer is gone (ValueError: in the lane); this rank ends"), line
    try:
        raise KeyError("a bug")
    except KeyError as err:
        report = _worker_failed(err)
    assert report.startswith("Traceback") and report.splitlines()[-1].endswith("KeyError: 'a bug'"), report
