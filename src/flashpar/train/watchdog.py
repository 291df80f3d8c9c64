"""The step-progress watchdog: a rank that makes no progress for ``--watchdog`` seconds names the rank that holds
the job up and ends, so that the launcher (flashpar's, or torchrun's agent, which then restarts the job) is not
left waiting on a rank that is stopped, frozen or waiting for one that is.

Each rank runs one daemon thread.  Every ``interval`` seconds it reads this rank's phase stamp
(``flashpar.train.where``: step and phase, kept in memory by the training loop; the loop itself does nothing for
the watchdog) and publishes a heartbeat to the job's store (the ``TCPStore`` of ``MASTER_ADDR``: flashpar's
launcher's, or torchrun's agent's, reachable from every node), under this attempt's prefix::

    flashpar/watchdog/<attempt>/<rank> = "<tick> <step> <seq> <pid> <host> <phase>"

The tick counts the thread's beats, so a rank whose process is stopped (SIGSTOP, a debugger) or dead stops
ticking, while a rank waiting in a collective keeps ticking (torch's collectives release the GIL).  When this
rank's own (step, seq) has not changed for ``limit`` seconds (counted from its first step: start-up, compilation
and loading a checkpoint are bounded by ``--timeout``), the thread reads every heartbeat twice, ``3 interval``
apart, and names (``diagnose``)::

    silent   ranks whose tick did not move (stopped, frozen or gone), with their host and the phase they
             stopped in (their stamp where this host sees it, else their last heartbeat)
    behind   else, the ranks at an earlier (step, seq) than the furthest rank
    else     every rank waits in the same phase: a transfer between ranks stopped, not a rank

A silent rank on this host whose process is stopped (``/proc``: state T, not a debugger's stop) and whose
environment names it (its ``RANK`` and restart count) is killed with SIGKILL: a stopped process cannot act on
SIGTERM, so torchrun's agent would wait its whole shutdown grace (30 s) before its own SIGKILL.  Then this rank
ends with one line (``flashpar.lifeline.exit_now``: NCCL communicators aborted, ``os._exit``).

Bound: a hung rank's peers end within ``limit + 4 interval`` (plus a store round trip) of their last progress;
``interval = clamp(limit / 10, 0.2 s, 5 s)``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from flashpar.lifeline import exit_now
from flashpar.train import where

STALLED = 76
"""A rank's exit status when its watchdog ended it (its line is the last of its log)."""
_STORE_TIMEOUT_S = 5.0  # one store operation: a store that does not answer in this long is treated as gone
_report = {"file": None, "status": STALLED}


def report_to(file, status: int = STALLED) -> None:
    """Where the watchdog's line goes (default: stderr) and the exit status it ends the process with."""
    _report.update(file=file, status=status)


def interval_of(limit_s: float) -> float:
    return min(max(limit_s / 10.0, 0.2), 5.0)


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat as read from the store."""

    tick: int
    step: int
    seq: int
    pid: int
    host: str
    phase: str

    def text(self) -> str:
        return f"{self.tick} {self.step} {self.seq} {self.pid} {self.host} {self.phase}"

    @classmethod
    def parse(cls, text: str) -> Beat:
        tick, step, seq, pid, host, phase = text.split(" ", 5)
        return cls(int(tick), int(step), int(seq), int(pid), host, phase)


def diagnose(rank: int, first: dict[int, Beat], second: dict[int, Beat], world: int,
             stamps: dict[int, tuple[int, int, int, str]] | None = None) -> tuple[str, list[int]]:
    """The clause naming what holds the job up, seen from ``rank`` after two reads of the heartbeats (``first``,
    ``second``: rank -> beat, a rank missing where it has not published), and the silent ranks.  ``stamps``
    (``where.read``: rank -> (pid, step, seq, phase), where this host sees them) say where a silent rank stopped
    to the phase; a heartbeat is up to one interval old."""
    silent = [r for r in range(world) if r != rank and (r not in second or (r in first and
                                                                             first[r].tick == second[r].tick))]
    if silent:
        named = "; ".join(_silent(r, second.get(r) or first.get(r), (stamps or {}).get(r)) for r in silent)
        return f"silent (stopped, frozen or gone): {named}", silent
    furthest = max((b.step, b.seq) for b in second.values())
    behind = sorted((r for r, b in second.items() if (b.step, b.seq) < furthest), key=lambda r: (second[r].step,
                                                                                                  second[r].seq))
    if behind:
        named = "; ".join(f"{_who(r, second[r])} in {_at(second[r].step, second[r].phase)}" for r in behind)
        return f"behind the others (alive, not progressing): {named}", []
    mine = second.get(rank)
    at = f" in {_at(mine.step, mine.phase)}" if mine is not None else ""
    return f"every rank waits at the same point{at}: a transfer between ranks stopped, not a rank", []


def _who(rank: int, beat: Beat) -> str:
    return f"rank {rank} (pid {beat.pid} on {beat.host})"


def _at(step: int, phase: str) -> str:
    return f"step {step} {phase}" if step else "start-up"


def _silent(rank: int, beat: Beat | None, stamp: tuple[int, int, int, str] | None) -> str:
    if beat is None:
        return f"rank {rank} (no heartbeat)"
    if stamp is not None and stamp[0] == beat.pid:  # its own stamp, exact to the phase
        return f"{_who(rank, beat)} in {_at(stamp[1], stamp[3])}"
    return f"{_who(rank, beat)} last heard in {_at(beat.step, beat.phase)}"


class Watchdog:
    """The thread (module docstring).  ``start()`` after ``where.install``; ``stop()`` when the steps are done."""

    def __init__(self, limit_s: float, rank: int, world: int, store=None, attempt: str | None = None) -> None:
        self.limit, self.rank, self.world = float(limit_s), rank, world
        self.interval = interval_of(self.limit)
        self.attempt = attempt if attempt is not None else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = store
        self.host = socket.gethostname().split(".")[0].replace(" ", "_") or "?"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tick = 0

    def key(self, rank: int) -> str:
        return f"flashpar/watchdog/{self.attempt}/{rank}"

    def start(self) -> Watchdog:
        if self.store is None:
            self.store = _job_store()
        self._thread = threading.Thread(target=self._run, name="flashpar-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _publish(self, stamps) -> None:
        self.tick += 1
        beat = Beat(self.tick, stamps.step, stamps.seq, stamps.pid, self.host, stamps.phase or "-")
        with contextlib.suppress(Exception):  # a store that is gone: the peers' diagnosis says so
            self.store.set(self.key(self.rank), beat.text())

    def read(self) -> dict[int, Beat]:
        beats = {}
        for r in range(self.world):
            with contextlib.suppress(Exception):
                if self.store.check([self.key(r)]):
                    beats[r] = Beat.parse(self.store.get(self.key(r)).decode())
        return beats

    def _run(self) -> None:
        stamps = where.mine()
        if stamps is None:
            return
        seen, since = None, time.monotonic()
        while not self._stop.wait(self.interval):
            self._publish(stamps)
            now = (stamps.step, stamps.seq)
            if now != seen:
                seen, since = now, time.monotonic()
            if stamps.step < 1 or time.monotonic() - since < self.limit:
                continue
            waited = time.monotonic() - since
            first = self.read()
            for _ in range(3):  # the silent ranks' ticks stay put while the others' move
                if self._stop.wait(self.interval):
                    return
                self._publish(stamps)
            if (stamps.step, stamps.seq) != seen:  # moved on after all
                seen, since = (stamps.step, stamps.seq), time.monotonic()
                continue
            clause, silent = diagnose(self.rank, first, self.read(), self.world, where.read(stamps.folder))
            killed = [r for r in silent if self._kill_if_stopped(r, first.get(r))]
            done = f"; killed the stopped process of rank {', '.join(map(str, killed))}" if killed else ""
            self._end(f"rank {self.rank}: no progress for {waited:.0f} s (--watchdog {self.limit:g}; this rank in "
                      f"step {stamps.step} {stamps.phase}): {clause}{done}; ending this rank so that the job can be "
                      f"restarted")

    def _kill_if_stopped(self, rank: int, beat: Beat | None) -> bool:
        """SIGKILL ``rank``'s process when it runs on this host, is stopped, and is that rank of this attempt."""
        if beat is None or beat.host != self.host or where.process_state(beat.pid) != "stopped":  # not a debugger's
            return False
        try:
            with open(f"/proc/{beat.pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            return False
        if env.get(b"RANK") != str(rank).encode() or env.get(b"TORCHELASTIC_RESTART_COUNT", b"0") != \
                self.attempt.encode():
            return False
        try:
            os.kill(beat.pid, signal.SIGKILL)
        except OSError:
            return False
        return True

    def _end(self, line: str) -> None:
        """One line (in a spawned rank's log as the launcher prints it; on stderr under torchrun: with the
        command's name), then the process ends."""
        own = _report["file"]
        said = line if own else f"flashpar train: {line}"
        exit_now(line, status=_report["status"], file=own or sys.stderr, line=said)


def _job_store():
    """A client of the job's store (``MASTER_ADDR`` / ``MASTER_PORT``) of its own: its operations never wait
    behind the process group's."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S))


def start(limit_s: float, rank: int, world: int) -> Watchdog | None:
    """This rank's watchdog, started (``None`` when ``limit_s`` is 0 or there is no store to publish to)."""
    if not limit_s or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        return Watchdog(limit_s, rank, world).start()
    except Exception as err:  # noqa: BLE001 - the run goes on without it, saying so
        print(f"flashpar train: rank {rank}: the watchdog cannot reach the job's store ({err}); running without it",
              file=sys.stderr, flush=True)
        return None
