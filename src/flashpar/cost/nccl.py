"""NCCL's own model of its collectives: latency and bandwidth per algorithm and protocol, and its pick.

The constants and formulas are those of NCCL's tuner (``src/graph/tuning.cc`` of NVIDIA/nccl 2.30.7, commit
5067397: ``ncclTunerConstantsDefaults`` and ``ncclTopoTuneModel``; the time of one call is
``ncclTopoGetAlgoTime``), written here for the cases flashpar's peers meet: H100-class GPUs (Hopper), NVLink
inside a node, one network port per GPU between nodes, an x86 Intel host, one operation per call.  NCCL times
every enabled (algorithm, protocol) of a call and runs the fastest; so does :func:`time`::

    time = latency + nbytes / algorithm bandwidth          nbytes: the whole buffer (an all-gather's output,
                                                           a reduce-scatter's input, an all-reduce's buffer)

Ring, ``n`` ranks on ``N`` nodes (``ppn = n / N`` ranks of the group per node)::

    steps          all-gather / reduce-scatter: n - 1 (N - 1 of them cross nodes)
                   all-reduce: 2 (n - 1)            (2 (N - 1) cross nodes)
    latency        base[p] + (steps - inter steps) intra[p] + inter steps x net[p]
                   intra[p] = max(hwLat NVLink ring[p], 1 us x (3 for Simple))   (the net post overhead, N > 1)
                   net[p]   = hwLat NET ring[p], or NET tree[p] where ppn = 1
    bus bandwidth  one node: the NVLink rate; across nodes min(NVLink, ppn x port rate): a ring visits a node's
                   ranks in turn and NCCL runs one ring per port, so the node's ``ppn`` ports carry it together
    protocol       Simple x 1, LL128 x 0.92, LL x 0.5 capped at llMaxBw
    algorithm bw   bus bandwidth x n / steps

Tree (all-reduce only): latency ``base[p] + 2 ((ppn - 1) intra tree[p] + log2(N) net tree[p])``, algorithm
bandwidth ``0.5 x`` the bus bandwidth (Simple x 0.92, LL / 3.8, LL128 x 120/128 or 7/9 on one node) times the
tree correction factor of the message size.  PAT (all-gather / reduce-scatter, NCCL >= 2.23, Simple, only where
the group has one rank per node): latency ``8 + log2(N) x 14 / 3.5 + 2.8 n`` us, algorithm bandwidth 0.75 x the
bus bandwidth.

    constants (us)        LL    LL128  Simple                 (tuning.cc, ncclTunerConstantsDefaults)
    base   tree          6.8   14.0    8.4
           ring          6.6   14.0    8.4
           PAT             -      -    8.0
    NVLink tree          0.6   1.25    4.0
           ring          0.6    1.9    3.4
    NET    tree          5.0    8.5   14.0
           ring          2.7    4.0   14.0

Left out, as they change neither peer's standing: NVLS / NVLS-tree (NVLink SHARP all-reduce inside a node),
CollNet (network SHARP), the per-channel bandwidth caps (16+ channels put them above the links here), the
network plugin's own latency (0 for InfiniBand verbs).  All-to-all is not a tuned collective in NCCL (grouped
point-to-point): :func:`time` charges it one point-to-point latency and each port's bytes at its rate.

A point-to-point message (flashpar's decomposed schedules, the doubling steps) costs the Simple protocol's one
ring step: ``base + hwLat`` = 11.8 us on NVLink, 22.4 us across nodes (:data:`P2P_LATENCY_S`).
"""

from __future__ import annotations

from dataclasses import dataclass

VERSION = (2, 30, 7)
"""The NCCL release whose tuner these constants are (``makefiles/version.mk``)."""
PAT_SINCE = (2, 23)
"""NCCL releases from which an all-gather / reduce-scatter with one rank per node runs PAT."""

PROTOCOLS = ("LL", "LL128", "Simple")
_BASE_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "pat": (8.0, 8.0, 8.0)}
_HW_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "pat": (0.0, 0.0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "pat": (0.0, 0.0, 14.0)},
}
NET_OVERHEAD_US = 1.0
"""``getNetOverhead``: the post overhead of a network step on an x86 Intel host (2 on AMD), x 3 for Simple."""
LL_MAX_BW_GB_S = {1: 141.0, 2: 39.0, 3: 20.4}
"""``llMaxBws``: LL's bandwidth cap by node count (1: Hopper; 2, more: an Intel host's)."""
_TREE_CORRECTION = {  # treeCorrectionFactor[protocol][log2(nbytes / 64)], message sizes 64 B to 256 MB
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}
RING_PLATEAU = 1.4
"""A multi-node ring all-reduce's Simple latency factor once each rank's share per channel is >= 64 bytes
(``ncclTopoGetAlgoTime``; 16 channels assumed, an H100 node's usual count)."""
CHANNELS = 16

P2P_LATENCY_S = {"nvlink": (8.4 + 3.4) * 1e-6, "net": (8.4 + 14.0) * 1e-6}
"""One point-to-point message: the Simple protocol's ring base latency and one hop (inside a node, across)."""

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class CollectiveTime:
    """One call's time split: ``latency_s + bandwidth_s``, by ``algorithm`` and ``protocol``."""

    latency_s: float
    bandwidth_s: float
    algorithm: str
    protocol: str

    @property
    def total_s(self) -> float:
        return self.latency_s + self.bandwidth_s


def _log2i(x: int) -> int:
    return max(int(x).bit_length() - 1, 0)


def bus_bandwidth(ranks: int, nodes: int, node_bytes_per_s: float, port_bytes_per_s: float) -> float:
    """Bytes/s of a ring's busiest link: the NVLink rate on one node; across nodes the node's ``ranks / nodes``
    ports together, at most the NVLink rate."""
    if nodes <= 1:
        return node_bytes_per_s
    return min(node_bytes_per_s, ranks / nodes * port_bytes_per_s)


def candidates(op: str, ranks: int, nodes: int, nbytes: float, node_bytes_per_s: float, port_bytes_per_s: float,
               version: tuple[int, ...] = VERSION) -> list[CollectiveTime]:
    """Every (algorithm, protocol) NCCL would time for ``op`` (see the module docstring), with its time."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    if ranks <= 1:
        return [CollectiveTime(0.0, 0.0, "none", "-")]
    if op == "all_to_all":
        return [_all_to_all(ranks, nodes, nbytes, node_bytes_per_s, port_bytes_per_s)]
    ppn = ranks / nodes
    bus = bus_bandwidth(ranks, nodes, node_bytes_per_s, port_bytes_per_s)
    ll_max = LL_MAX_BW_GB_S[min(nodes, 3)] * 1e9
    out = []
    steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
    inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if op == "all_reduce" else nodes - 1)
    for i, p in enumerate(PROTOCOLS):
        intra = _HW_US["nvlink"]["ring"][i]
        if nodes > 1:
            intra = max(intra, NET_OVERHEAD_US * (3 if p == "Simple" else 1))
        net = _HW_US["net"]["tree" if ppn == 1 else "ring"][i]
        lat = _BASE_US["ring"][i] + (steps - inter_steps) * intra + inter_steps * net
        if p == "LL":
            bw = min(ll_max, 0.5 * bus)
        elif p == "LL128":
            bw = 0.92 * bus
        else:
            bw = bus
            if op == "all_reduce" and nodes > 1 and nbytes / (CHANNELS * ranks) >= 64:
                lat *= RING_PLATEAU
        algo_bw = bw * ranks / steps
        out.append(CollectiveTime(lat * 1e-6, nbytes / algo_bw, "ring", p))
    if op == "all_reduce":
        log = _log2i(int(nbytes) >> 6) if nbytes >= 64 else -1
        for i, p in enumerate(PROTOCOLS):
            lat = _BASE_US["tree"][i] + 2 * ((ppn - 1) * _HW_US["nvlink"]["tree"][i]
                                             + _log2i(nodes) * _HW_US["net"]["tree"][i])
            bw = {"LL": min(bus / 3.8, ll_max), "LL128": bus * (7 / 9 if nodes == 1 else 120 / 128),
                  "Simple": 0.92 * bus}[p] * 0.5
            if 0 <= log < len(_TREE_CORRECTION[p]):
                bw *= _TREE_CORRECTION[p][log]
            out.append(CollectiveTime(lat * 1e-6, nbytes / bw, "tree", p))
    elif nodes == ranks and tuple(version[:2]) >= PAT_SINCE:
        lat = _BASE_US["pat"][2] + _log2i(nodes) * _HW_US["net"]["tree"][2] / 3.5 + 2.8 * ranks
        out.append(CollectiveTime(lat * 1e-6, nbytes / (0.75 * bus), "pat", "Simple"))
    return out


def time(op: str, ranks: int, nodes: int, nbytes: float, node_bytes_per_s: float, port_bytes_per_s: float,
         version: tuple[int, ...] = VERSION) -> CollectiveTime:
    """NCCL's pick for ``op`` over ``ranks`` ranks on ``nodes`` nodes of ``nbytes`` (the whole buffer): the
    fastest of :func:`candidates`.  ``node_bytes_per_s``: the NVLink rate of one GPU, one way;
    ``port_bytes_per_s``: its network port's (the same where ``nodes`` is 1)."""
    if nodes < 1 or nodes > max(ranks, 1):
        raise ValueError(f"a group of {ranks} ranks cannot span {nodes} nodes")
    return min(candidates(op, ranks, nodes, nbytes, node_bytes_per_s, port_bytes_per_s, version),
               key=lambda c: c.total_s)


def _all_to_all(ranks: int, nodes: int, nbytes: float, node_bytes_per_s: float,
                port_bytes_per_s: float) -> CollectiveTime:
    """Grouped point-to-point: every rank sends ``nbytes / ranks`` to each peer at once; one message latency (the
    network's where the group spans nodes), each link's bytes at its rate (the peers on the node over NVLink,
    the others over the rank's port)."""
    chunk = nbytes / ranks
    ppn = ranks / nodes
    inside = (ppn - 1) * chunk / node_bytes_per_s
    across = (ranks - ppn) * chunk / port_bytes_per_s if nodes > 1 else 0.0
    lat = P2P_LATENCY_S["net" if nodes > 1 else "nvlink"]
    return CollectiveTime(lat, max(inside, across), "p2p", "Simple")
