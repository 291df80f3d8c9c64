"""Emulated rate-limited network links for multi-rank benchmarks on a single CPU box.

On loopback, communication between torch.distributed ranks is nearly free, so overlap of
communication and computation cannot be measured.  :class:`EmulatedLinks` gives every rank
its own Linux network namespace with one "NIC" that is shaped by ``tc``, all NICs joined by
a bridge that lives in a separate hub namespace -- one NIC per rank behind a switch::

      ns <prefix>-r0           ns <prefix>-r1                  ns <prefix>-r{N-1}
     +---------------+        +---------------+               +---------------+
     | lo            |        | lo            |               | lo            |
     | fpnic         |        | fpnic         |      ...      | fpnic         |
     | 10.213.7.1/24 |        | 10.213.7.2/24 |               | 10.213.7.N/24 |
     +-------+-------+        +-------+-------+               +-------+-------+
             | tbf (rank egress)      |                               |
             | veth                   | veth                          | veth
             | tbf [+netem] (ingress) |                               |
     +-------+------------------------+-------------------------------+-------+
     |      p0                       p1                             p{N-1}    |
     |                          br0 (Linux bridge)                           |
     |                          ns <prefix>-hub                              |
     +-----------------------------------------------------------------------+

* Rank egress is shaped by a ``tbf`` on the rank-side veth (``fpnic``); rank ingress by a
  ``tbf`` on the bridge-side veth ``p<r>`` (its egress towards the rank).  Both directions
  therefore run at ``rate`` independently (full duplex), and N-to-1 traffic is limited by
  the receiver's ingress, like a switch port.
* ``delay`` (optional) is a ``netem`` in front of the ingress ``tbf``, so a packet between
  two ranks is delayed once: one-way latency ``delay``, RTT ``2*delay``.  It is put on the
  hub side on purpose: a netem on the sender's own interface would hold skbs and throttle
  TCP through TCP small queues.  Needs a kernel with netem (CONFIG_NET_SCH_NETEM).
* ``tbf`` counts Ethernet frames, so TCP goodput is about 1448/1514 ~ 96% of ``rate``.
* Veth endpoints are created directly inside the new namespaces; nothing is added to the
  root namespace.  Deleting the namespaces removes the veths and the bridge; teardown
  happens on ``__exit__``/``close``, at interpreter exit and on SIGINT/SIGTERM/SIGHUP.  A benchmark killed
  with SIGKILL cannot remove them: its ranks die with it (``flashpar.lifeline``), and the next benchmark
  removes every namespace whose owner (the pid in its name) is gone, saying so in one line.
* gloo must be told the interface (``GLOO_SOCKET_IFNAME``): by default it resolves the host
  name, which is not reachable from inside a rank namespace.  :meth:`EmulatedLinks.env` sets it.
* gloo caveat (measured, not a link artefact): a simultaneous exchange between two ranks in one
  process group shares one TCP connection and often gets only ~half the rate per direction;
  sending each direction through its own process group restores full duplex.

Needs root, ``ip`` and ``tc`` (iproute2).  Use :func:`links_available` to check first.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import IO

__all__ = ["EmulatedLinks", "launch_ranks", "links_available", "parse_rate"]

_PREFIX = "fpnet"  # namespaces: f"{_PREFIX}{pid}-{serial}-r{rank}" and f"...-hub"
_BRIDGE = "br0"
_IFNAME = "fpnic"
_TBF_BURST_S = 0.002  # token bucket depth in seconds of line rate (see _tbf)
_TBF_LATENCY = "20ms"  # max queueing delay inside a tbf before it drops

_RATE_UNITS = {  # tc(8) units -> multiplier to bits/s (SI = 1000-based, IEC = 1024-based)
    "": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40,
}  # fmt: skip
_RATE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_rate(rate: str) -> float:
    """'1gbit', '500mbit', '100kbit', '2.5gbit' (tc's units, bits/s) -> bytes per second;
    ValueError naming the bad string.

    As in tc(8): a bare number or ``bit`` is bits/s, ``kbit/mbit/gbit/tbit`` are SI multiples,
    ``kibit``... are IEC multiples, and ``bps/kbps/mbps/...`` are *bytes* per second.
    """
    m = _RATE_RE.fullmatch(rate) if isinstance(rate, str) else None
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _RATE_UNITS:
        raise ValueError(f"bad rate {rate!r}: expected a number with a tc unit such as '500mbit' or '1gbit'")
    bits = float(m.group(1)) * _RATE_UNITS[unit]
    if bits <= 0:
        raise ValueError(f"bad rate {rate!r}: must be positive")
    return bits / 8.0


def _run(cmd: str) -> None:
    """Run one ip/tc command line (whitespace-separated, no quoting needed);
    RuntimeError with the command line and its stderr on failure."""
    res = subprocess.run(cmd.split(), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"command failed (exit {res.returncode}): {cmd}: {res.stderr.strip()}")


def _netns_list() -> list[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _del_netns(name: str) -> None:
    """Kill what still runs inside (it would keep the namespace and its links alive), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _owner(name: str) -> int | None:
    """The pid in one of our namespace names (``fpnet<pid>-<serial>-r<rank>`` or ``...-hub``), None for others."""
    m = re.fullmatch(rf"{_PREFIX}(\d+)-\d+-(?:hub|r\d+)", name)
    return int(m.group(1)) if m else None


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, from /proc), None when it is gone or has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _stale(name: str, made_at: float | None) -> bool:
    """Whether namespace ``name`` is ours and its owner is gone: no process has its pid, or the one that has it
    started after the namespace was made (the pid was reused).  ``made_at``: the namespace's file time."""
    pid = _owner(name)
    if pid is None or pid == os.getpid():
        return False
    started = _started_at(pid)
    if started is None:
        return True
    return made_at is not None and started > made_at + 1.0  # 1 s: /proc's start time is in clock ticks


def _reap_stale() -> list[str]:
    """Delete namespaces left behind by earlier runs that died without removing them (SIGKILL: their owner is
    gone); the names deleted."""
    removed = []
    for name in _netns_list():
        try:
            made_at = os.stat(f"/run/netns/{name}").st_mtime
        except OSError:
            made_at = None
        if _stale(name, made_at):
            _del_netns(name)
            removed.append(name)
    return removed


def _tbf(rate_bytes: float) -> str:
    """tbf parameters that make TCP throughput match the rate (checked from 1mbit to 10gbit).

    The bucket holds _TBF_BURST_S of line rate, at least two full frames.  A bucket of only a
    few frames at high rates makes throughput fall short on a busy box (every late qdisc-watchdog
    wakeup can release only one bucket); a much larger one lets short transfers run ahead of the
    rate (at 10gbit a 5 ms bucket made a 32 MB send 15% too fast).  Measured with gloo, 32 MB:
    96% of the rate at 100mbit, 1gbit, 2.5gbit and 10gbit -- exactly TCP's 1448/1514 goodput.
    GSO super-packets larger than the bucket are segmented by tbf itself.
    """
    burst = max(2 * 1514, int(rate_bytes * _TBF_BURST_S))
    return f"tbf rate {int(rate_bytes * 8)}bit burst {burst} latency {_TBF_LATENCY}"


def links_available() -> tuple[bool, str]:
    """(True, "") if we are root and can create+delete a namespace and a veth with tc;
    else (False, reason) -- a clear one-line reason to print as a skip message."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "emulated links need root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"emulated links need '{tool}' (iproute2) on PATH"
    a, b = f"{_PREFIX}{os.getpid()}-0-r0", f"{_PREFIX}{os.getpid()}-0-hub"  # serial 0: the probe
    try:
        _run(f"ip netns add {a}")
        _run(f"ip netns add {b}")
        _run(f"ip link add v0 netns {a} type veth peer name v1 netns {b}")
        _run(f"tc -n {a} qdisc add dev v0 root {_tbf(parse_rate('1gbit'))}")
    except (RuntimeError, OSError) as e:
        return False, f"cannot build emulated links: {e}".splitlines()[0]
    finally:
        _del_netns(a)
        _del_netns(b)
    return True, ""


class EmulatedLinks:
    """Context manager: N rank namespaces + hub bridge, rate-limited.

    ::

        with EmulatedLinks(4, "1gbit") as links:
            procs = launch_ranks(4, [sys.executable, "-m", "flashpar.bench.worker"], links=links)

    See the module docstring for the topology.  ``addresses[r]`` is rank r's IPv4 address
    (``f"{subnet}.{r + 1}"``, a /24); ``ifname`` is the NIC name inside every rank namespace.
    ``delay`` is a tc time such as ``"2ms"``, added once per direction (RTT = 2 * delay).
    """

    _serial = itertools.count(1)  # tells several instances of one process apart

    def __init__(
        self,
        world_size: int,
        rate: str = "1gbit",
        *,
        delay: str | None = None,
        subnet: str = "10.213.7",
    ):
        if not 1 <= world_size <= 254:
            raise ValueError(f"world_size must be in 1..254, got {world_size}")
        octets = subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and int(o) <= 255 for o in octets):
            raise ValueError(f"bad subnet {subnet!r}: expected the first three octets, e.g. '10.213.7'")
        if delay is not None and not re.fullmatch(r"\d+(\.\d+)?(s|sec|ms|msec|us|usec)", delay):
            raise ValueError(f"bad delay {delay!r}: expected a tc time such as '500us' or '2ms'")
        self.world_size = world_size
        self.rate = rate
        self.rate_bytes = parse_rate(rate)
        self.delay = delay
        self.subnet = subnet
        self.ifname: str = _IFNAME
        self.addresses: list[str] = [f"{subnet}.{r + 1}" for r in range(world_size)]
        self._base = f"{_PREFIX}{os.getpid()}-{next(EmulatedLinks._serial)}"
        self.hub: str = f"{self._base}-hub"
        self._created: list[str] = []  # namespaces that exist and must be deleted
        self._entered = False

    def netns(self, rank: int) -> str:
        """Name of rank ``rank``'s network namespace."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for world_size {self.world_size}")
        return f"{self._base}-r{rank}"

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.netns(rank), *argv]

    def env(self, rank: int, port: int) -> dict[str, str]:
        """torch.distributed env:// variables for ``rank`` (merge them into the environment)."""
        return {
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": self.ifname,
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank),
        }

    def __enter__(self) -> EmulatedLinks:
        if self._entered:
            raise RuntimeError("EmulatedLinks can be entered only once")
        self._entered = True
        _register(self)
        try:
            stale = _reap_stale()
            if stale:
                owners = sorted({_owner(n) for n in stale})
                print(f"removed {len(stale)} network namespaces left by a benchmark that is gone (pid "
                      f"{', '.join(map(str, owners))}): {' '.join(sorted(stale))}", file=sys.stderr, flush=True)
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _run(f"ip netns add {name}")
        self._created.append(name)
        _run(f"ip -n {name} link set dev lo up")

    def _build(self) -> None:
        hub, nic, tbf = self.hub, self.ifname, _tbf(self.rate_bytes)
        self._add_netns(hub)
        _run(f"ip -n {hub} link add {_BRIDGE} type bridge")
        # addrgenmode none: no IPv6 link-local addresses, so no stray traffic and gloo's
        # interface lookup finds only the IPv4 address
        _run(f"ip -n {hub} link set dev {_BRIDGE} addrgenmode none up")
        for r in range(self.world_size):
            ns, port = self.netns(r), f"p{r}"
            self._add_netns(ns)
            # both ends are born inside their namespaces: nothing ever appears in the root one
            _run(f"ip link add {nic} netns {ns} type veth peer name {port} netns {hub}")
            _run(f"ip -n {hub} link set dev {port} master {_BRIDGE}")
            _run(f"ip -n {hub} link set dev {port} addrgenmode none up")
            _run(f"ip -n {ns} addr add {self.addresses[r]}/24 dev {nic}")
            _run(f"ip -n {ns} link set dev {nic} addrgenmode none up")
            # a link between accelerators has no TCP slow start after idle: do not restart each
            # transfer from a small congestion window (a per-namespace setting)
            _run(f"ip netns exec {ns} sysctl -q -w net.ipv4.tcp_slow_start_after_idle=0")
            _run(f"tc -n {ns} qdisc add dev {nic} root {tbf}")  # rank egress
            if self.delay is None:  # rank ingress
                _run(f"tc -n {hub} qdisc add dev {port} root {tbf}")
            else:
                netem = f"netem delay {self.delay} limit 100000"  # limit (packets) >= rate * delay
                try:
                    _run(f"tc -n {hub} qdisc add dev {port} root handle 1: {netem}")
                except RuntimeError as e:
                    raise RuntimeError(f"{e} (delay= needs the netem qdisc, CONFIG_NET_SCH_NETEM)") from None
                _run(f"tc -n {hub} qdisc add dev {port} parent 1:1 handle 10: {tbf}")

    def cut(self, rank: int) -> None:
        """Make ``rank``'s link stop carrying traffic, both ways, while its processes live on (a fault drill):
        both of its tbf qdiscs drop to 8 bit/s, so every packet waits past the queue's latency and is dropped."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not one of the {self.world_size} ranks")
        dead = f"tbf rate 8bit burst {2 * 1514} latency 1ms"
        _run(f"tc -n {self.netns(rank)} qdisc replace dev {self.ifname} root {dead}")
        if self.delay is None:
            _run(f"tc -n {self.hub} qdisc replace dev p{rank} root {dead}")
        else:
            _run(f"tc -n {self.hub} qdisc replace dev p{rank} parent 1:1 handle 10: {dead}")

    def close(self) -> None:
        """Delete all namespaces (which removes the veths and the bridge), killing any process still
        running inside one of them. Idempotent."""
        while self._created:
            _del_netns(self._created.pop())
        _unregister(self)

    def __repr__(self) -> str:
        return f"<EmulatedLinks {self._base}: {self.world_size} ranks, {self.rate}, delay {self.delay}>"


# ---- teardown on interpreter exit and on SIGINT/SIGTERM/SIGHUP----------------------------------------------

_live: set[EmulatedLinks] = set()
_lock = threading.Lock()
_prev_handlers: dict[int, object] = {}  # signal -> the handler we replaced
_installed = False


def _close_all() -> None:
    for links in list(_live):
        links.close()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _close_all()
    prev = _prev_handlers.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)  # e.g. signal.default_int_handler -> KeyboardInterrupt
    else:  # SIG_DFL (or None: installed outside Python)
        # exit via an exception so that `finally` blocks (e.g. killing rank processes) still run
        raise SystemExit(128 + signum)


def _register(links: EmulatedLinks) -> None:
    """Track live links; on first use install the atexit hook and SIGINT/SIGTERM/SIGHUP handlers."""
    global _installed
    with _lock:
        if not _installed:
            _installed = True
            atexit.register(_close_all)
            if threading.current_thread() is threading.main_thread():  # signal() works only there
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    prev = signal.getsignal(sig)
                    if prev is not signal.SIG_IGN:  # an ignored signal stays ignored
                        _prev_handlers[sig] = prev
                        signal.signal(sig, _on_signal)
        _live.add(links)


def _unregister(links: EmulatedLinks) -> None:
    with _lock:
        _live.discard(links)


# ---- launching ranks ------------------------------------------------------------------------------------


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the rank's whole session (it is its group leader), including stray children."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _status(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def launch_ranks(
    world_size: int,
    argv: list[str],
    *,
    links: EmulatedLinks | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
) -> list[subprocess.CompletedProcess]:
    """Start world_size copies of argv (e.g. [sys.executable, "-m", "flashpar.bench.worker", ...]) as
    ranks 0..N-1, each with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT(/GLOO_SOCKET_IFNAME) set; inside the
    namespaces when links is given, on 127.0.0.1 with a free port otherwise. Capture stdout/stderr of each
    rank, wait for all with the timeout; if any rank fails or the timeout passes, kill the others (whole
    process group) and raise RuntimeError that names the rank and includes the tail of its stderr.
    Returns the completed processes (rank order).

    Each rank's environment is ``os.environ``, updated by ``env``, updated by the rank's variables.
    Without links, GLOO_SOCKET_IFNAME defaults to ``lo`` unless already set.  Every rank runs in its own
    session (process group); all of them are killed if this function exits early for any reason.  Each also
    gets this process's lifeline (``flashpar.lifeline``: a pipe's read end and ``FLASHPAR_LIFELINE``); a rank that
    calls ``flashpar.lifeline.watch_from_env()``, as every benchmark worker does, ends when this process ends,
    however it ends (SIGKILL included).
    """
    if links is not None and links.world_size != world_size:
        raise ValueError(f"links are built for {links.world_size} ranks, not {world_size}")
    rendezvous = None
    if port is None and links is None:  # the store in this process, on loopback only (flashpar.ranks.Rendezvous)
        from flashpar.ranks import Rendezvous

        rendezvous = Rendezvous("127.0.0.1", timeout)
        port = rendezvous.port
    if port is None:
        port = 29500  # a fresh namespace has every port free
    procs: list[subprocess.Popen] = []
    from flashpar.lifeline import Lifeline

    with contextlib.ExitStack() as files:
        line = files.enter_context(Lifeline())  # a rank that runs flashpar.lifeline.watch_from_env dies with us
        # temp files, not pipes: a chatty rank cannot block while we wait on another one
        outs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(world_size)]
        errs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(world_size)]

        def read(f: IO[str]) -> str:
            f.seek(0)
            return f.read()

        try:
            for r in range(world_size):
                rank_env = {**os.environ, **(env or {}), **line.env()}
                if links is not None:
                    rank_env.update(links.env(r, port))
                    cmd = links.wrap(r, argv)
                else:
                    rank_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
                    rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                    rank_env.update(rendezvous.env() if rendezvous is not None else {})
                    rank_env.update(
                        RANK=str(r),
                        WORLD_SIZE=str(world_size),
                        LOCAL_RANK=str(r),
                    )
                    cmd = list(argv)
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=rank_env,
                        stdin=subprocess.DEVNULL,
                        stdout=outs[r],
                        stderr=errs[r],
                        start_new_session=True,
                        pass_fds=(line.fd,),
                    )
                )
            # one waiter thread per rank, so that failures are seen in the order they happen
            exited: queue.Queue[int] = queue.Queue()

            def waiter(rank: int) -> None:
                procs[rank].wait()
                exited.put(rank)

            for r in range(world_size):
                threading.Thread(target=waiter, args=(r,), daemon=True).start()
            deadline, running = time.monotonic() + timeout, set(range(world_size))
            while running:
                try:
                    r = exited.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    hung = sorted(running)
                    raise RuntimeError(
                        f"timeout after {timeout:g}s: rank(s) {hung} of {world_size} still "
                        f"running; rank {hung[0]} stderr tail:\n{_tail(read(errs[hung[0]]))}"
                    ) from None
                if procs[r].returncode != 0:
                    raise RuntimeError(
                        f"rank {r} of {world_size} failed ({_status(procs[r].returncode)}); "
                        f"stderr tail:\n{_tail(read(errs[r]))}"
                    )
                running.discard(r)
        finally:  # failure, timeout, KeyboardInterrupt, SystemExit from SIGTERM: leave no orphans behind
            for p in procs:
                _kill_group(p)
            if rendezvous is not None:
                rendezvous.close()
        return [
            subprocess.CompletedProcess(p.args, p.returncode, read(o), read(e))
            for p, o, e in zip(procs, outs, errs, strict=True)
        ]


def rate_problem(requested) -> str | None:
    """One line naming what is wrong with a ``--link-rate`` value (``none`` / ``loopback`` / empty: no link), or
    None."""
    if str(requested).lower() in ("none", "loopback", ""):
        return None
    try:
        parse_rate(requested)
    except ValueError as err:
        return f"--link-rate: {err}"
    return None


def chosen_rate(requested) -> str | None:
    """The ``--link-rate`` a benchmark runs with: ``None`` (loopback) when asked for, or when links cannot
    be emulated here (it says why: communication is then nearly free and overlap cannot show)."""
    rate = None if str(requested).lower() in ("none", "loopback", "") else requested
    if rate is not None:
        ok, why = links_available()
        if not ok:
            print(f"emulated links unavailable ({why}); skipping the link emulation, running on loopback, "
                  "where communication is nearly free and overlap cannot show", flush=True)
            rate = None
    return rate


def launch_on_links(world_size: int, argv: list[str], rate: str | None, *, timeout: float) -> None:
    """``launch_ranks`` behind emulated links of ``rate`` (built and torn down here), or on loopback."""
    print(f"running N={world_size} on {rate or 'loopback'} ...", flush=True)
    if rate is None:
        launch_ranks(world_size, argv, timeout=timeout)
        return
    with EmulatedLinks(world_size, rate) as links:
        launch_ranks(world_size, argv, links=links, timeout=timeout)
