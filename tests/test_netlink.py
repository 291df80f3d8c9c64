"""Tests for flashpar.bench.netlink: rate parsing, real tc shaping between namespaces, rank launching."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashpar.bench import netlink
from flashpar.bench.netlink import EmulatedLinks, launch_ranks, links_available, parse_rate


@pytest.mark.parametrize(
    ("rate", "bytes_per_s"),
    [
        ("1gbit", 125e6),
        ("500mbit", 62.5e6),
        ("100kbit", 12.5e3),
        ("2.5gbit", 312.5e6),
        ("10GBit", 1.25e9),
        ("8000", 1e3),  # bare number: bits/s, as in tc
        ("1mbps", 1e6),  # tc's "bps" means bytes/s
        ("1mibit", 2**20 / 8),
    ],
)
def test_parse_rate(rate: str, bytes_per_s: float) -> None:
    assert parse_rate(rate) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("bad", ["fast", "1 gigabit", "", "-1gbit", "0mbit", "1.2.3gbit"])
def test_parse_rate_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="bad rate"):
        parse_rate(bad)


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# rank 0 sends NBYTES to rank 1; rank 1 prints the seconds the receive took.  A tiny warm-up
# message first, so the timed transfer does not include gloo's connection setup.
_SEND_RECV = textwrap.dedent("""
    import time, torch, torch.distributed as dist
    NBYTES = 5_000_000
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    warm, x = torch.zeros(16), torch.zeros(NBYTES // 4)
    if rank == 0:
        dist.send(warm, 1)
        dist.barrier()
        dist.send(x, 1)
    else:
        dist.recv(warm, 0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.recv(x, 0)
        print("SECONDS", time.perf_counter() - t0, flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_shaped_links_throughput_and_teardown() -> None:
    ok, reason = links_available()
    if not ok:
        pytest.skip(reason)
    rate = "200mbit"
    with EmulatedLinks(2, rate) as links:
        names = [links.netns(0), links.netns(1), links.hub]
        assert set(names) <= set(_netns_list())
        procs = launch_ranks(2, [sys.executable, "-c", _SEND_RECV], links=links, timeout=60)
    seconds = float(procs[1].stdout.split("SECONDS")[1].split()[0])
    measured = 5_000_000 / seconds
    print(f"{rate}: measured {measured / 1e6:.1f} MB/s of {parse_rate(rate) / 1e6:.1f} MB/s")
    # Band 0.4x..1.3x of the configured rate.  The ideal is ~0.96x (tbf counts Ethernet frames, TCP
    # goodput is 1448/1514 of that); the token bucket (a few ms of line rate) may let the start of the
    # transfer run ahead, and a busy 2-core box (gloo threads, other tests) can only slow it down.
    # Unshaped veths run at several GB/s, i.e. >100x the rate, so this still proves the shaping is real.
    assert 0.4 * parse_rate(rate) < measured < 1.3 * parse_rate(rate), f"{measured / 1e6:.1f} MB/s"
    assert not set(names) & set(_netns_list())


def test_launch_ranks_names_failing_rank() -> None:
    prog = textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("rank one is failing on purpose", file=sys.stderr)
            sys.exit(3)
        time.sleep(30)  # the healthy rank would hang; launch_ranks must kill it
    """)
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed \(exit code 3\)") as info:
        launch_ranks(2, [sys.executable, "-c", prog], timeout=20)
    assert "failing on purpose" in str(info.value)


def test_launch_ranks_loopback_env() -> None:
    keys = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK", "X"]
    prog = f"import os; print(*(os.environ[k] for k in {keys!r}))"
    procs = launch_ranks(3, [sys.executable, "-c", prog], env={"X": "x"}, timeout=30)
    assert [p.stdout.split() for p in procs] == [[str(r), "3", "127.0.0.1", str(r), "x"] for r in range(3)]


def test_launch_ranks_loopback_gloo() -> None:
    procs = launch_ranks(2, [sys.executable, "-c", _SEND_RECV], timeout=60)
    assert "SECONDS" in procs[1].stdout


# A process that builds links, reports their namespaces, then waits to be signalled.
_HOLDER = textwrap.dedent("""
    import sys, time
    from flashpar.bench.netlink import EmulatedLinks
    links = EmulatedLinks(2, "1gbit").__enter__()  # no `with`: teardown must come from the signal handler
    print(links.hub, links.netns(0), links.netns(1), flush=True)
    time.sleep(30)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_down(sig: signal.Signals) -> None:
    ok, reason = links_available()
    if not ok:
        pytest.skip(reason)
    src = str(Path(netlink.__file__).resolve().parents[2])  # so the child imports this very flashpar
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", _HOLDER]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) as proc:
        assert proc.stdout is not None
        names = proc.stdout.readline().split()
        assert len(names) == 3
        proc.send_signal(sig)
        assert proc.wait(timeout=10) != 0
    assert not set(names) & set(_netns_list())


def test_launch_ranks_timeout() -> None:
    with pytest.raises(RuntimeError, match=r"timeout after 0.5s: rank\(s\) \[0, 1\]"):
        launch_ranks(2, [sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
