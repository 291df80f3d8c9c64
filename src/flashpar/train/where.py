"""Where each rank is in its step, so that a rank whose wait timed out can name the peer that did not arrive.

Every rank stamps the phase it enters (``enter("forward")``) into its own small file, ``<out>/.where/rank<r>``,
one fixed-size record overwritten in place by ``os.pwrite``: a system call of a few microseconds, no flush,
no collective, nothing waits on a device.  The processes of one machine share the page cache, so a stamp is
visible to the others at once::

    rank 0:  step 3 forward    ──┐
    rank 1:  step 3 check      ──┤  ranks 0, 2, 3 time out in step 3's forward: each reads the four stamps,
    rank 2:  step 3 forward    ──┤  finds rank 1 behind (step 3, check) and its process state in /proc
    rank 3:  step 3 forward    ──┘  (stopped), and ends its log with one line naming rank 1 and the phase

A rank is behind when its (step, phase number within the step) is lower than this rank's.  When no rank is
behind (they all wait in the same phase), the line says so: a transfer between ranks stopped, not a rank.
So it does when every rank behind is alive inside a phase that is one exchange and nothing else
(:data:`EXCHANGE_PHASES`): such a rank is itself waiting for a transfer, as when a link stops in the middle
of the step's input check and the ranks whose data had already arrived went on to the forward.
Ranks on other machines (under torchrun) have no stamp here; the line names only what this machine sees.
"""

from __future__ import annotations

import os
from pathlib import Path

RECORD = 96  # bytes of one stamp: "pid step seq phase", space-padded
EXCHANGE_PHASES = ("input check", "gradient sums")
"""Phases that are one wait on other ranks' transfers: the step's cross-rank input check (one collective,
``flashpar.models.step_check``) and the wait for the gradient sums posted during backward."""
_ALIVE = ("running", "waiting", "in a disk wait", "idle")  # a disk wait (D: paging, I/O) is alive too
_STATE = {"R": "running", "S": "waiting", "D": "in a disk wait", "T": "stopped", "t": "stopped by a tracer",
          "Z": "exited", "X": "exited", "I": "idle"}


class Stamps:
    """This rank's stamp file; ``enter`` overwrites the record."""

    def __init__(self, folder: str | os.PathLike, rank: int) -> None:
        self.folder, self.rank = Path(folder), rank
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.folder / f"rank{rank}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pid, self.step, self.seq, self.phase = os.getpid(), 0, 0, ""

    def begin_step(self, step: int) -> None:
        self.step, self.seq = step, 0
        self.enter("data")

    def enter(self, phase: str) -> None:
        self.seq += 1
        self.phase = phase
        os.pwrite(self.fd, f"{self.pid} {self.step} {self.seq} {phase}".ljust(RECORD)[:RECORD].encode(), 0)

    def close(self) -> None:
        os.close(self.fd)


_MINE: Stamps | None = None


def install(folder: str | os.PathLike, rank: int) -> Stamps:
    """Stamp this process's phases into ``folder`` from now on (one per rank process)."""
    global _MINE
    if _MINE is not None:
        _MINE.close()
    _MINE = Stamps(folder, rank)
    return _MINE


def mine() -> Stamps | None:
    """This process's stamps (``None`` before ``install``): what ``flashpar.train.watchdog`` reads."""
    return _MINE


def begin_step(step: int) -> None:
    if _MINE is not None:
        _MINE.begin_step(step)


def enter(phase: str) -> None:
    """Stamp ``phase`` (no-op in a process that did not ``install``: tests, ``--check``)."""
    if _MINE is not None:
        _MINE.enter(phase)


def read(folder: str | os.PathLike) -> dict[int, tuple[int, int, int, str]]:
    """Every rank's last stamp: rank -> (pid, step, seq, phase)."""
    out = {}
    for path in Path(folder).glob("rank*"):
        try:
            pid, step, seq, phase = path.read_bytes().decode().split(maxsplit=3)
            out[int(path.name[4:])] = (int(pid), int(step), int(seq), phase.strip())
        except (OSError, ValueError):  # a file being created, or not ours
            continue
    return out


def process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return _STATE.get(code, code)


def blame(rank: int | None = None, folder: str | os.PathLike | None = None) -> str:
    """The ranks behind ``rank`` (default: this process's), their phase and process state, in one line;
    ``""`` without stamps."""
    if folder is None:
        if _MINE is None:
            return ""
        folder, rank = _MINE.folder, _MINE.rank if rank is None else rank
    stamps = read(folder)
    if rank not in stamps:
        return ""
    _, step, seq, phase = stamps[rank]
    behind = sorted((r for r, s in stamps.items() if (s[1], s[2]) < (step, seq)), key=lambda r: stamps[r][1:3])
    if not behind:
        return (f"no rank is behind rank {rank} (all {len(stamps)} stamps at step {step} or later, this rank in "
                f"{phase}): a transfer between ranks stopped, not a rank")
    states = {r: process_state(stamps[r][0]) for r in behind}
    named = "; ".join(f"rank {r} ({states[r]}) in step {stamps[r][1]} {stamps[r][3]}" for r in behind)
    if all(states[r] in _ALIVE and stamps[r][3] in EXCHANGE_PHASES for r in behind):
        return (f"the ranks behind rank {rank} wait in an exchange themselves ({named}; rank {rank} waited in step "
                f"{step} {phase}): a transfer between ranks stopped, not a rank")
    return f"did not arrive: {named}; rank {rank} waited in step {step} {phase}"
