"""NCCL's model of its collectives (``flashpar.cost.nccl``) against its formulas written out by hand here from
``src/graph/tuning.cc`` (NCCL 2.30.7), ``Hardware.collective`` on gloo's ring, and ``flashpar simulate
collective``.  Pure arithmetic: every figure is exact, so the tolerances are rounding's."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from flashpar import cli
from flashpar.cost import group_hardware, nccl, preset

NV, PORT = 370.8e9, 48e9  # NCCL's H100 NVLink (18 x 20.6 GB/s) and 400 Gb/s port (4 x 12 GB/s)


def _by(cands):
    return {(c.algorithm, c.protocol): c for c in cands}


def test_the_ring_latency_at_512_ranks_on_64_nodes_is_nccls():
    """8.4 us + (511 - 63) intra-node hops x 3.4 us + 63 network hops x 14 us = 2,413.6 us (Simple); LL128
    14 + 448 x 1.9 + 63 x 4.0 = 1,117.2 us; LL 6.6 + 448 x max(0.6, 1.0 net overhead) + 63 x 2.7 = 624.7 us."""
    c = _by(nccl.candidates("all_gather", 512, 64, 1 << 30, NV, PORT))
    assert c[("ring", "Simple")].latency_s == pytest.approx(2413.6e-6, rel=1e-12)
    assert c[("ring", "LL128")].latency_s == pytest.approx(1117.2e-6, rel=1e-12)
    assert c[("ring", "LL")].latency_s == pytest.approx(624.7e-6, rel=1e-12)
    assert ("pat", "Simple") not in c  # 8 ranks a node: no PAT


def _reference_ring(op: str, n: int, nodes: int, nbytes: float) -> float:
    """NCCL's ring, written out: the least over LL / LL128 / Simple of latency + nbytes / algorithm bandwidth."""
    steps, inter = (2 * (n - 1), 2 * (nodes - 1)) if op == "all_reduce" else (n - 1, nodes - 1)
    bus = min(NV, n / nodes * PORT) if nodes > 1 else NV
    ll_max = {1: 141e9, 2: 39e9}.get(nodes, 20.4e9)
    best = math.inf
    for base, hop, net, bw in ((6.6, 0.6, 2.7, min(ll_max, bus / 2)), (14.0, 1.9, 4.0, 0.92 * bus),
                               (8.4, 3.4, 14.0, bus)):
        if nodes > 1:
            hop = max(hop, 3.0 if base == 8.4 else 1.0)
        best = min(best, (base + (steps - inter) * hop + inter * net) * 1e-6 + nbytes * steps / n / bw)
    return best


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_the_pick_at_512_ranks_on_64_nodes_is_within_a_quarter_of_nccls_model(op):
    """The target: ``simulate collective`` at 512 ranks / 64 nodes within 25% of NCCL's model, at every size
    (it is the model, so within rounding)."""
    hw = group_hardware(preset("h100-nvlink"), preset("h100-ib"), range(512), 8)
    assert (hw.nodes, hw.link_bytes_per_s, hw.node_link_bytes_per_s) == (64, PORT, pytest.approx(NV))
    for nbytes in (1 << 10, 1 << 20, 1 << 24, 1 << 28, 1 << 30):
        got, want = hw.collective(op, 512, nbytes).total_s, _reference_ring(op, 512, 64, nbytes)
        assert got == pytest.approx(want, rel=1e-9)
        assert abs(got / want - 1) <= 0.25


def test_pat_runs_only_with_one_rank_per_node_from_2_23():
    """64 ranks on 64 nodes: PAT's latency 8 + log2(64) x 14 / 3.5 + 2.8 x 64 = 211.2 us, bandwidth 0.75 of one
    port (no ring conversion); the network latency of a ring with one rank per node is the tree's."""
    c = _by(nccl.candidates("reduce_scatter", 64, 64, 1 << 26, NV, PORT))
    assert c[("pat", "Simple")].latency_s == pytest.approx(211.2e-6, rel=1e-12)
    assert c[("pat", "Simple")].bandwidth_s == pytest.approx((1 << 26) / (0.75 * PORT), rel=1e-12)
    assert c[("ring", "Simple")].latency_s == pytest.approx((8.4 + 63 * 14.0) * 1e-6, rel=1e-12)
    assert c[("ring", "LL128")].latency_s == pytest.approx((14.0 + 63 * 8.5) * 1e-6, rel=1e-12)  # tree's NET
    older = _by(nccl.candidates("reduce_scatter", 64, 64, 1 << 26, NV, PORT, version=(2, 22, 3)))
    assert ("pat", "Simple") not in older
    assert ("pat", "Simple") not in _by(nccl.candidates("all_reduce", 64, 64, 1 << 26, NV, PORT))


def test_tree_all_reduce_latency_and_its_pick_for_small_messages():
    """16 ranks on 2 nodes: tree LL128 14 + 2 ((8 - 1) x 1.25 + log2(2) x 8.5) = 48.5 us; at 1 MB the tree wins,
    at 1 GB the ring's bandwidth (n / (2 (n - 1)) of the bus, against the tree's half) does."""
    c = _by(nccl.candidates("all_reduce", 16, 2, 1 << 20, NV, PORT))
    assert c[("tree", "LL128")].latency_s == pytest.approx(48.5e-6, rel=1e-12)
    assert nccl.time("all_reduce", 16, 2, 1 << 20, NV, PORT).algorithm == "tree"
    assert nccl.time("all_reduce", 16, 2, 1 << 30, NV, PORT).algorithm == "ring"


def test_one_node_rides_nvlink_and_the_bus_grows_with_ports_per_node():
    assert nccl.bus_bandwidth(8, 1, NV, PORT) == NV
    assert nccl.bus_bandwidth(8, 2, NV, PORT) == 4 * PORT  # 4 ports a node together, under NVLink's rate
    assert nccl.bus_bandwidth(16, 2, NV, PORT) == NV  # 8 ports (384 GB/s) above it: NVLink bounds the ring
    assert nccl.bus_bandwidth(64, 64, NV, PORT) == PORT  # one rank a node: its port
    a2a = nccl.time("all_to_all", 8, 2, 8e6, NV, PORT)  # 1 MB to each peer: 3 over NVLink, 4 over the port
    assert a2a.algorithm == "p2p" and a2a.bandwidth_s == pytest.approx(max(3e6 / NV, 4e6 / PORT))
    assert a2a.latency_s == pytest.approx(22.4e-6)


def test_gloos_ring_keeps_n_minus_one_link_transfers():
    hw = preset("cpu")
    assert hw.collectives == "ring"
    b = 1e6
    assert hw.collective("all_gather", 4, 4 * b).total_s == pytest.approx(3 * hw.transfer_time(b))
    assert hw.collective("all_reduce", 4, b).total_s == pytest.approx(6 * (hw.link_latency_s + b / 4 /
                                                                          hw.link_bytes_per_s))
    assert hw.collective("all_gather", 1, b).total_s == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        hw.collective("broadcast", 4, b)
    with pytest.raises(ValueError, match="collectives"):
        dataclasses.replace(hw, collectives="mpi")


def test_simulate_collective_prints_the_split_and_doubling(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert cli.main(["simulate", "collective", "--op", "all_gather", "--ranks", "512", "--nodes", "64",
                     "--bytes", "1M,1G", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("NCCL 2.30.7's model") and "doubling" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [1 << 20, 1 << 30]
    for r in rows:
        assert r["latency_s"] + r["bandwidth_s"] == pytest.approx(r["total_us"] * 1e-6)
        assert r["picked"] == "yes" and r["algorithm"] == "ring"
    assert rows[0]["doubling_us"] < rows[0]["total_us"]  # 1 MB: 9 point-to-point steps beat 511 ring steps
    assert rows[1]["doubling_us"] > rows[1]["total_us"]  # 1 GB: each doubling step waits on one port
    assert cli.main(["simulate", "collective", "--op", "all_reduce", "--ranks", "16", "--nodes", "2", "--bytes",
                     "1M", "--all"]) == 0
    assert len([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("all_reduce")]) == 6


@pytest.mark.parametrize(("argv", "needle"), [
    (["--op", "all_gather", "--ranks", "12", "--nodes", "5"], "--nodes"),
    (["--op", "all_gather", "--ranks", "0"], "--ranks"),
    (["--op", "all_gather", "--ranks", "8", "--bytes", "12Q"], "--bytes"),
    (["--op", "all_gather", "--ranks", "8", "--hardware", "h900"], "h900"),
])
def test_simulate_collective_bad_arguments_stop_with_one_line(argv, needle, capsys):
    assert cli.main(["simulate", "collective", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("flashpar simulate collective: ") and needle in err, err
