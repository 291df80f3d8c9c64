"""Rank processes that start in well under a second: forked from a server that has already imported torch.

``flashpar train`` (and the test harness) runs each rank in its own process.  With the ``spawn`` start
method every rank imports torch and flashpar again: about 1.5 s of CPU each, and four ranks on two
cores wait some 5 s before their first line (under load, tens of seconds).  The ``forkserver`` start
method forks each rank from one server process instead; ``context()`` makes that server import
``PRELOAD`` once, so a rank starts with torch loaded::

    launcher ──(first start)──> forkserver: import torch, torch.distributed, flashpar's trainer
        │                            │ fork        │ fork      ...
        └──(pickled fn, args)──>  rank 0        rank 1        (no import: copy-on-write pages)

The server imports only; it never runs a torch op, so it has no OpenMP or CUDA state a fork could
copy half-made (the reason fork is unsafe after torch has run).  A forked rank would otherwise see the
server's view of the world, taken when the server started; ``Inherit`` carries the launcher's view
at start time instead: its environment (``os.environ``) and its standard output and error (the file
descriptors are passed along with the process, so a rank writes where the launcher writes now, e.g.
to the capture of the pytest test that started it).  Where ``forkserver`` does not exist (Windows) the
context is ``spawn`` and ``Inherit`` is a no-op.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo", "flashpar.train.loop",
           "flashpar.train.check"]  # imported once by the server (an import that fails is skipped)


def local_world_size(default: int) -> int:
    """This node's ranks as torchrun says (``LOCAL_WORLD_SIZE``), else ``default``; a malformed value is one line
    (``ValueError``)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={n} must be >= 1")
    return n


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def context():
    """The multiprocessing context for rank processes (``start_method()``), its server preloading ``PRELOAD``
    started now (``start_server``)."""
    method = start_method()
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts
        start_server()
    return ctx


def start_server() -> None:
    """Start the fork server (when it is not running) with SIGINT ignored.

    A terminal's Ctrl-C goes to the whole foreground process group, the server included, and the server spends
    its first second or more importing ``PRELOAD``: a KeyboardInterrupt there would print a traceback of
    torch's import.  A disposition of "ignore" is kept across exec, and Python installs its KeyboardInterrupt
    handler only where SIGINT is not ignored at start, so the server started while the launcher ignores SIGINT
    never raises it (multiprocessing's server ignores SIGINT once its preload is done anyway).  The server still
    ends with the launcher (its ``alive`` pipe), and the ranks it forks ignore SIGINT as before
    (``flashpar.train.interrupt``).  A SIGINT in the milliseconds the start takes is not seen by the launcher."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():  # (only the main thread may set handlers)
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def quiet_tracker() -> None:
    """Start multiprocessing's resource tracker now (when it is not running) without its warning at shutdown
    about leaked semaphores.  Call it before anything else in the launcher can start the tracker (a spawn pool:
    ``flashpar.train.tokens``); a tracker already running keeps its own flags.

    Whose semaphores: a rank's data loader (spawn context: its queues and event, 11 with one worker) and rank 0's
    progress bar (tqdm's lock); the launcher makes none (torch's start_processes, the lifeline: pipes).  A rank
    that ends by itself removes them on its way out, so a completed run leaves none.  Ranks stopped with SIGKILL
    (Ctrl-C, SIGTERM, a failed rank: one may be blocked inside a collective and cannot clean up) cannot; the
    tracker removes what they registered when the job ends, which is what it is for.  Its warning then reports
    that cleanup, not a leak: the semaphores are gone either way, and the warning would be the only line after
    the job's."""
    from multiprocessing import resource_tracker

    flag = "ignore:resource_tracker:UserWarning"  # passed to the tracker's interpreter as -W
    sys.warnoptions.append(flag)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(flag)


class Inherit:
    """The launcher's environment and standard output / error, taken when a rank process is started (it is
    pickled with the process's arguments); ``apply()`` in the rank makes them the rank's."""

    def __init__(self) -> None:
        self.env, self.fds = dict(os.environ), ()

    def __reduce__(self):
        from multiprocessing.context import get_spawning_popen
        from multiprocessing.reduction import DupFd

        fds = ()
        if get_spawning_popen() is not None:  # being pickled by Popen: send fds 1 and 2 along with the process
            sys.stdout.flush()
            sys.stderr.flush()
            fds = tuple(DupFd(fd) for fd in (1, 2))
        return (_rebuild, (dict(os.environ), fds))

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        for target, passed in zip((1, 2), self.fds, strict=False):
            fd = passed.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _rebuild(env: dict, fds: tuple) -> Inherit:
    inherit = Inherit.__new__(Inherit)
    inherit.env, inherit.fds = env, fds
    return inherit


# ---- the spawn launcher's rendezvous ---------------------------------------------------------------------------
#
#    launcher: TCPStore server on (--master-addr, a port the kernel picks), that address only
#        ▲ MASTER_ADDR / MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True: every rank is a client
#    rank 0 ... rank N-1   (gloo's own sockets: GLOO_SOCKET_IFNAME = the loopback interface when the
#                           address is loopback and the variable is not set)
#
# torch's env:// rendezvous makes rank 0 host the store on every interface (it binds the port on ``::``,
# whatever MASTER_ADDR says); a server bound here, handed to TCPStore as a listening socket, is reachable
# at that address only, and needs no port guessed in advance.


def _address(addr: str):
    import socket

    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as err:
        raise ValueError(f"--master-addr {addr}: not an address of this machine ({err})") from None
    return family, sockaddr


def _listen(addr: str):
    import socket

    family, sockaddr = _address(addr)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise ValueError(f"--master-addr {addr}: cannot listen there: {err.strerror or err}") from None
    return sock


def can_listen(addr: str) -> None:
    """``ValueError`` (one line) unless a socket can listen on ``addr``."""
    _listen(addr).close()


def loopback_interface() -> str | None:
    """The name of the loopback network interface (Linux: the one with IFF_LOOPBACK in its flags), or None."""
    from pathlib import Path

    for flags in sorted(Path("/sys/class/net").glob("*/flags")):
        try:
            if int(flags.read_text(), 16) & 0x8:
                return flags.parent.name
        except (OSError, ValueError):
            continue
    return None


class Rendezvous:
    """The launcher's ``TCPStore`` server on ``addr`` only (the comment above); ``env()`` is what each spawned rank
    adds to its environment before ``init_process_group`` (env://); ``close()`` when the ranks are done."""

    def __init__(self, addr: str, timeout_s: float) -> None:
        import datetime
        import ipaddress

        import torch.distributed as dist

        self.addr = addr
        sock = _listen(addr)
        self.port = sock.getsockname()[1]
        self.loopback = ipaddress.ip_address(_address(addr)[1][0].split("%")[0]).is_loopback
        try:
            self.store = dist.TCPStore(addr, self.port, None, True, datetime.timedelta(seconds=timeout_s),
                                       wait_for_workers=False, master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns the listening socket now (and closes it)

    def env(self) -> dict[str, str]:
        env = {"MASTER_ADDR": self.addr, "MASTER_PORT": str(self.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        if self.loopback and "GLOO_SOCKET_IFNAME" not in os.environ and (lo := loopback_interface()):
            env["GLOO_SOCKET_IFNAME"] = lo
        return env

    def close(self) -> None:
        self.store = None  # the server stops with its last reference
