"""A process's line to the launcher that started it: when the launcher dies, however it died, the process ends.

A launcher that is killed with SIGKILL (a scheduler's time limit, the OOM killer, ``timeout -s KILL``) runs no
handler, so nothing it does on the way out can stop what it started.  Two things the kernel does anyway can:

* it closes a dead process's files.  The launcher makes a pipe and keeps its write end, never writing to it;
  every process it starts gets the read end.  A thread of the child blocks in ``read()``, which returns
  ``b""`` once no process holds a write end, i.e. once the launcher is gone::

      launcher  (holds write end W, close-on-exec: no child inherits it)
         │ read end R: pickled with a rank's arguments (multiprocessing passes the descriptor along), or
         │ kept open across exec for a subprocess (``pass_fds``, its number in ``FLASHPAR_LIFELINE``)
         ▼
      child: thread  read(R) ... b""  ->  on_loss()  ->  os._exit(LAUNCHER_GONE)

  This works whoever the child's parent is (a rank forked by multiprocessing's fork server is the server's
  child, not the launcher's) and on every POSIX system.

* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks for SIGKILL when the process's parent thread ends; it
  holds across ``exec`` (``ip netns exec NS python ...``).  ``die_with_parent`` sets it in a child whose
  parent is the launcher or one of its ranks (data-loader workers, benchmark workers), then checks that the
  parent has not already gone in between.

What a watched child does on loss (``exit_now``): one line on its standard error, its NCCL communicators
aborted when it has any (so no kernel waits on a peer that is gone; gloo's sockets close with the process),
then ``os._exit`` at once: ``destroy_process_group`` could wait for peers that are gone too.  A timer ends
the process even if the abort hangs.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading

ENV = "FLASHPAR_LIFELINE"  # "<read fd>:<launcher pid>" in a subprocess started with the read end kept open
LAUNCHER_GONE = 75  # the exit status of a process that ended because its launcher died
ABORT_GRACE_S = 2.0  # the most the NCCL abort may take before the process ends anyway
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel for ``sig`` when this process's parent ends (Linux; elsewhere returns False).  With
    ``parent_pid`` (the parent's pid as the parent knew it): if the parent is already gone (the process has
    been re-parented), exit now, since the signal would never come."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(LAUNCHER_GONE)
    return True


class Lifeline:
    """The launcher's end: a pipe whose write end only this process holds.  ``child()`` is what a process
    started with multiprocessing gets (pickle it with the process's arguments); ``env()`` and ``fd`` are what
    a subprocess gets (``pass_fds=(line.fd,)``).  ``close()`` when every child has ended (the children see
    the same as the launcher's death)."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()  # both close-on-exec: a subprocess gets the read end only by pass_fds
        self.pid = os.getpid()

    def child(self) -> ChildEnd:
        return ChildEnd(self.fd, self.pid)

    def env(self) -> dict[str, str]:
        return {ENV: f"{self.fd}:{self.pid}"}

    def close(self) -> None:
        for fd in (self.fd, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd = self._write = -1

    def __enter__(self) -> Lifeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ChildEnd:
    """The read end as a multiprocessing child receives it: when pickled for a new process, the descriptor is
    passed along with it (``DupFd``); ``watch()`` in the child starts the thread."""

    def __init__(self, fd: int, launcher_pid: int) -> None:
        self.fd, self.launcher_pid, self._passed = fd, launcher_pid, None

    def __reduce__(self):
        from multiprocessing.context import get_spawning_popen
        from multiprocessing.reduction import DupFd

        passed = DupFd(self.fd) if get_spawning_popen() is not None else None
        return (_rebuild, (self.launcher_pid, passed))

    def watch(self, on_loss=None) -> None:
        """Start the watching thread (``on_loss``: what to do when the launcher is gone; default ``exit_now``).
        A no-op where the descriptor did not come along (not started by multiprocessing)."""
        if self._passed is None:
            return
        watch(self._passed.detach(), self.launcher_pid, on_loss)


def _rebuild(launcher_pid: int, passed) -> ChildEnd:
    end = ChildEnd(-1, launcher_pid)
    end._passed = passed
    return end


def watch(fd: int, launcher_pid: int, on_loss=None) -> threading.Thread:
    """A daemon thread that waits for end-of-file on ``fd`` (the lifeline's read end), then runs ``on_loss()``
    (default: ``exit_now``, naming ``launcher_pid``)."""
    def wait() -> None:
        while True:
            try:
                if os.read(fd, 1) == b"":
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        (on_loss or (lambda: exit_now(f"the launcher (pid {launcher_pid}) is gone")))()

    thread = threading.Thread(target=wait, name="flashpar-lifeline", daemon=True)
    thread.start()
    return thread


def watch_from_env(on_loss=None) -> bool:
    """In a subprocess started with a lifeline (``ENV`` set, the read end kept open): die with the parent where
    Linux allows and watch the pipe.  The variable is removed, so this process's own children do not take the
    descriptor number for theirs.  False when there is no lifeline."""
    value = os.environ.pop(ENV, "")
    try:
        fd, pid = (int(v) for v in value.split(":"))
        os.fstat(fd)
    except (ValueError, OSError):
        return False
    if os.getppid() == pid:  # a direct child (ip netns exec keeps the pid): the kernel's signal as well
        die_with_parent(pid)
    watch(fd, pid, on_loss)
    return True


def exit_now(why: str, status: int = LAUNCHER_GONE, file=None, *, line: str | None = None) -> None:
    """End this process at once: one line on ``file`` (default stderr; ``line``, else one made of ``why``), NCCL
    communicators aborted (bounded by ``ABORT_GRACE_S``), ``os._exit(status)``."""
    timer = threading.Timer(ABORT_GRACE_S, os._exit, (status,))
    timer.daemon = True
    timer.start()
    with contextlib.suppress(Exception):
        print(line or f"flashpar: {why}: this process stops (pid {os.getpid()})", file=file or sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        _abort_nccl()
    os._exit(status)


def _abort_nccl() -> None:
    """Abort the default group's communicators when it is NCCL (nothing to do for gloo)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
