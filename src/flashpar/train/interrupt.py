"""A stopped job, as ``flashpar train``'s own launcher sees it: Ctrl-C (SIGINT) or SIGTERM ends it with one line.

    launcher: SIGINT / SIGTERM  ->  Interrupted (raised where the launcher waits for the ranks)
              -> every rank SIGKILLed (their data-loader workers follow: flashpar.lifeline)
              -> "interrupted at step 9; newest checkpoint step_5; resume with --resume OUT/checkpoints"
    ranks:    ignore SIGINT (a terminal sends it to the whole process group): the launcher decides, so no
              rank prints a traceback and none is left half-way through a collective the others left

A rank killed in the middle of a save leaves a ``.partial`` folder, never a ``step_N`` (``flashpar.train.atomic``);
the line names the newest ``step_N`` with its completion marker.  The step is rank 0's stamp
(``flashpar.train.where``): the step it was in when the job stopped.  Under ``torchrun`` none of this applies:
torchrun's agent handles the signals.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

from flashpar.train.marker import newest_checkpoint

EXIT_STATUS = 130  # a shell's status for a job ended by SIGINT


class Interrupted(KeyboardInterrupt):
    """The launcher was asked to stop (SIGINT: ``KeyboardInterrupt`` itself; SIGTERM: this, naming it)."""

    def __init__(self, signame: str = "SIGINT") -> None:
        super().__init__(signame)
        self.signame = signame


@contextlib.contextmanager
def sigterm_interrupts():
    """While the launcher waits: SIGTERM raises ``Interrupted("SIGTERM")`` (main thread only; elsewhere nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Interrupted("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def ignore_in_rank() -> None:
    """A spawned rank ignores SIGINT (its launcher stops it; see the module docstring)."""
    with contextlib.suppress(ValueError):  # not the main thread: nothing to change
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop_ranks(procs) -> None:
    """SIGKILL every rank still running and reap it (``procs``: torch's ``ProcessContext``, or None)."""
    if procs is None:
        return
    for p in procs.processes:
        if p.is_alive():
            with contextlib.suppress(OSError):
                p.kill()
    for p in procs.processes:
        p.join(5.0)


def line(out: Path, save_every: int, err: KeyboardInterrupt, started: float) -> str:
    """The one line: where the job stopped, its newest checkpoint and how to resume."""
    from flashpar.train import where

    signame = getattr(err, "signame", "SIGINT")
    what = "interrupted" if signame == "SIGINT" else f"stopped by {signame}"
    stamp = where.read(out / ".where").get(0)
    fresh = (out / ".where" / "rank0").is_file() and (out / ".where" / "rank0").stat().st_mtime >= started - 1
    at = f" at step {stamp[1]}" if stamp is not None and fresh and stamp[1] > 0 else " before the first step"
    newest = newest_checkpoint(out / "checkpoints")
    if newest is None:
        after = "no checkpoint saved" + ("" if save_every else " (--save-every 0)")
        return f"{what}{at}; {after}"
    return f"{what}{at}; newest checkpoint {newest.name}; resume with --resume {out / 'checkpoints'}"

