"""Sharded data parallelism on two lanes: flashpar's ZeRO-3 and torch's FSDP2, and the schedule flashpar's
``auto`` picks per block (``zero_schedule``, which the trainer calls too).

Shard group ``S``: the dp x cp x U ranks with the same tp index (``Workload.groups(peer)["shard"]``).  Each
unit's parameters (its tp shard; under Ulysses the attention projections whole) are split by rows over
``S``; norms stay whole (flashpar: summed over the whole mesh once, at the end of backward).

    units    [embedding, block 0, ..., block L-1, head]      (tied embeddings: one table unit, kept gathered
             from the start of forward to the end of backward; torch's ``fsdp_root``: embedding, final norm
             and head as one such unit)
    gather   (|S| - 1) transfers of P_unit / |S| x e bytes     one all-gather per unit (ring), compute dtype
    scatter  (|S| - 1) transfers of P_unit / |S| x 4 bytes     the gradient reduce-scatter, fp32 sums

flashpar's units may travel by ``doubling`` instead (``flashpar.overlap.doubling``): the same bytes in
``ceil(log2 |S|)`` steps, the step at distance ``d`` carrying ``min(d, |S| - d)`` chunks, so each step pays one
message latency where the ring pays ``|S| - 1``; ``zero_collective`` chooses (``COLLECTIVE_MARGIN``).  The
baseline and the torch peers ride the ring (NCCL's all-gather and reduce-scatter between multi-GPU nodes).

A block is ``prefetch`` or ``fused``:

* ``prefetch`` (``K = Workload.prefetch``; 0: each gather and reduce-scatter blocking, as the executor's
  depth 0): the gathers of units i+1 .. i+K are posted on the gather lane
  when unit i starts computing (units 0 .. K at the start of forward, with nothing to hide behind); unit i
  waits for its own; its linears run the plain tp op.  Backward: the head and the last block keep their
  forward gather, the untied embedding (its lookup saves only indices) is not gathered again; when unit i's
  backward starts, the gathers of the next K units that need one are posted again; unit i's
  gradient reduce-scatter is posted on the scatter lane when its backward ends.
* ``fused``: the block's linears run ZeRO-3's per-peer decomposition over ``S`` (``flashpar.sim.step.linears``
  with ``fused``), their transfers inside the ops; nothing of the block rides the lanes.  Only with U = 1.

Four units, K = 1 (the test's example: forward / backward seconds 1 / 1, 4 / 8, 4 / 8, 2 / 3; gathers 2, 3, 3,
2; reduce-scatters 1, 2, 2, 1; units 2 and 3 kept), unit numbers on the lanes, forward then backward::

    gather   | 0 |  1  |  2  | | 3 |             |  1  |         | 0 |
    main         |0|   |   1   |   2   | 3 |  3  |       2       |       1       |0|
    scatter                                      |3|             | 2 |           | 1 |0|
    time     0                   10        15        20                  30        35

    forward ends at 15 (waits 2 + 2), backward at 35, the scatter lane at 37: exposed 4 + tail 2

A wait on either lane, and what of the scatter lane (with flashpar's norm all-reduce, one message of every
norm's gradient: ``step.small_all_reduce_s``) outlasts backward, is exposed (dp).  flashpar's tail overlaps
the clipping's squared-norm pass over the gradients that have landed (``NORM_PASS_BYTES_PER_PARAM`` per local
parameter outside the embedding's table, at memory bandwidth):

    exposed tail = max(0, scatter lane end - backward end - that pass)

Configurations:

    flashpar (flash, auto)  auto: per block the fastest of {every block prefetch, block 0 fused + the rest
                            prefetch, every block fused} (``zero_schedule``: the whole step simulated for each)
                            where it beats every block prefetched by more than ``ZERO_AUTO_MARGIN``
    baseline (mode none)    every block prefetch with K = 0: each gather blocking when the unit needs it,
                            each reduce-scatter blocking right after the unit's backward, the tail blocking
    torch (FSDP2)           torchtitan's ``apply_fsdp``: units [embedding, blocks, (norm, head)], one unit
                            ahead (``Workload.fsdp_prefetch``), the last block and (norm, head) not resharded
                            after forward (``Workload.fsdp_keep_last``: the bench's torch peer reshards the last
                            block), the reduce-scatters on the scatter lane; the optimizer waits for them all

The lanes run at the link's full rate each: an all-gather and a reduce-scatter in flight together do not
share it here (both peers alike).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpar.cost import Hardware
from flashpar.overlap.doubling import distances
from flashpar.sim import step
from flashpar.sim.parts import Part, total
from flashpar.sim.peers import Peer
from flashpar.sim.workload import Workload

PREFETCH, FUSED = "prefetch", "fused"
RING, DOUBLING = "ring", "doubling"


@dataclass(frozen=True)
class Unit:
    """One unit on the lanes: its forward and backward seconds without the lanes, its all-gather and
    reduce-scatter seconds (0: nothing on that lane), whether backward reuses its forward gather (``kept``),
    whether its backward reads the weight at all (``regather``: flashpar's embedding lookup does not), and the
    seconds its own transfers hold the port the lanes ride (``port_fwd``, ``port_bwd``)."""

    fwd: float
    bwd: float
    gather: float = 0.0
    scatter: float = 0.0
    kept: bool = False
    regather: bool = True
    port_fwd: float = 0.0  # seconds the unit's own transfers hold the lanes' port in its forward (``lanes``)
    port_bwd: float = 0.0


@dataclass(frozen=True)
class Lanes:
    fwd_end: float  # when forward ends
    bwd_end: float  # when backward ends (blocking reduce-scatters included)
    scatter_end: float  # when the scatter lane's last item ends (the tail's end)
    exposed: float  # lane waits of forward and backward


# ----------------------------------------------------------------------------------------------
# sizes


def shard_size(w: Workload, peer: Peer) -> int:
    return w.groups(peer)["shard"][0]


def table_params(w: Workload, peer: Peer) -> float:
    """Elements of one vocabulary table's tp shard."""
    return w.cfg.vocab_size * w.cfg.hidden / w.sizes(peer)["tp"]


def block_params(w: Workload, peer: Peer) -> float:
    """Elements of one block's unit: its projections' tp shard (Ulysses, tp = 1: every projection whole);
    torch's FSDP2 units hold the block's two norms too."""
    cfg, tp = w.cfg, w.sizes(peer)["tp"]
    norms = 2 * cfg.hidden if step.is_torch(peer) else 0
    return cfg.block_matmul_params / tp + norms


def norm_params(w: Workload) -> float:
    return (2 * w.cfg.layers + 1) * w.cfg.hidden


def local_params(w: Workload, peer: Peer) -> float:
    """Parameters a rank holds: flashpar and baseline ``(L P_block + tables) / |S| + norms``; torch everything
    / tp / |S| (FSDP2 shards the norms too)."""
    n = shard_size(w, peer)
    tables = table_params(w, peer) * (1 if w.cfg.tie_embeddings else 2)
    if step.is_torch(peer):
        return w.cfg.params / w.sizes(peer)["tp"] / n
    return (w.cfg.layers * block_params(w, peer) + tables) / n + norm_params(w)


def collective_s(kind: str, n: int, hw: Hardware, chunk_bytes: float) -> float:
    """Seconds of an all-gather (or reduce-scatter) of ``n`` chunks of ``chunk_bytes`` over ``n`` ranks of ``hw``'s
    group: the backend's collective (``ring``: ``Hardware.collective``, NCCL's own model on a GPU preset, whose
    all-gather and reduce-scatter cost the same), or the doubling steps, point-to-point messages on the group's
    link (``min(d, n - d)`` chunks each)."""
    if n <= 1:
        return 0.0
    if kind == RING:
        return hw.collective("all_gather", n, n * chunk_bytes).total_s
    return sum(hw.transfer_time(min(d, n - d) * chunk_bytes) for d in distances(n))


COLLECTIVE_MARGIN = 0.98
"""``auto`` moves the units by doubling only where a block's gather and reduce-scatter are predicted more than 2%
faster than the ring's (small groups, large chunks: the backend's collective)."""


def zero_collective(w: Workload, peer: Peer) -> str:
    """How ``peer``'s ZeRO-3 units travel on ``w``: the torch peers and the baseline by ring; flashpar by
    ``w.zero_collective``, or for ``auto`` by doubling where a block unit's all-gather and reduce-scatter are
    predicted faster by more than ``COLLECTIVE_MARGIN``."""
    if step.is_torch(peer) or peer.mode == "none":
        return RING
    if w.zero_collective != "auto":
        return w.zero_collective
    n, hw = w.groups(peer)["shard"][:2]
    blk = block_params(w, peer) / max(n, 1)
    ring, doubling = ((collective_s(k, n, hw, blk * w.elem_bytes) + collective_s(k, n, hw, blk * w.zero_rs_elem_bytes))
                      for k in (RING, DOUBLING))
    return DOUBLING if doubling < COLLECTIVE_MARGIN * ring else RING


def gather_s(w: Workload, peer: Peer, params: float, kind: str | None = None) -> float:
    """Seconds of the all-gather of a unit of ``params`` elements over the shard group, compute dtype, by
    ``kind`` (None: ``zero_collective``'s)."""
    n, hw = w.groups(peer)["shard"][:2]
    return collective_s(kind or zero_collective(w, peer), n, hw, params / n * w.elem_bytes)


def scatter_s(w: Workload, peer: Peer, params: float, kind: str | None = None) -> float:
    """Seconds of the reduce-scatter of a unit's gradient over the shard group (``zero_rs_elem_bytes``), by
    ``kind`` (None: ``zero_collective``'s)."""
    n, hw = w.groups(peer)["shard"][:2]
    return collective_s(kind or zero_collective(w, peer), n, hw, params / n * w.zero_rs_elem_bytes)


# ----------------------------------------------------------------------------------------------
# the lanes


def lanes(units: list[Unit], ahead: int, blocking: bool = False) -> Lanes:
    """The rank's port and the main agent over ``units`` (forward in order, backward reversed), gathers posted
    ``ahead`` units ahead (0: when the unit needs it); ``blocking``: each reduce-scatter waited for as soon as
    it is posted (the module docstring).  Gathers and reduce-scatters queue on one lane, the rank's one port,
    in the order they are posted; while a unit computes, its own transfers on that port (``Unit.port_fwd`` /
    ``port_bwd``: K/V, all-to-all, tp) take it first."""
    n = len(units)
    lane = 0.0
    ready: dict[int, float] = {}

    def post(i: int, at: float) -> None:
        nonlocal lane
        if units[i].gather > 0 and i not in ready:
            lane = max(lane, at) + units[i].gather
            ready[i] = lane

    def busy(at: float, seconds: float) -> None:
        nonlocal lane
        if seconds > 0:
            lane = max(lane, at) + seconds

    t = waits = 0.0
    for i in range(min(ahead, n - 1) + 1):
        post(i, 0.0)
    for i in range(n):
        post(i, t)
        start = max(t, ready.get(i, 0.0))
        waits += start - t
        busy(start, units[i].port_fwd)
        for j in range(i + 1, min(i + ahead, n - 1) + 1):
            post(j, start)
        t = start + units[i].fwd
    fwd_end = t
    order = list(reversed(range(n)))
    ready = {i: 0.0 for i in range(n) if units[i].kept or not units[i].regather}
    scatter = t
    for k, i in enumerate(order):
        post(i, t)
        start = max(t, ready.get(i, 0.0))
        waits += start - t
        busy(start, units[i].port_bwd)
        for j in [j for j in order[k + 1:] if j not in ready][:ahead]:  # the next units that gather again
            post(j, start)
        t = start + units[i].bwd
        if units[i].scatter > 0:
            lane = max(lane, t) + units[i].scatter
            scatter = lane
            if blocking:
                waits += scatter - t
                t = scatter
    return Lanes(fwd_end, t, max(scatter, t), waits)


# ----------------------------------------------------------------------------------------------
# the schedules


def candidates(w: Workload, peer: Peer) -> list[tuple[str, ...]]:
    """flashpar's auto candidates: every block prefetch, block 0 fused + the rest prefetch, every block fused
    (the fused ones only with U = 1 and a shard group of more than one rank)."""
    layers = w.cfg.layers
    every = (PREFETCH,) * layers
    if w.sizes(peer)["u"] > 1 or shard_size(w, peer) == 1:
        return [every]
    return [every, (FUSED,) + (PREFETCH,) * (layers - 1), (FUSED,) * layers]


@dataclass
class DataParallel:
    """One configuration's step without the optimizer, on the lanes."""

    fwd: Part  # the units' forward (compute and tp / ulysses / cp exposures)
    bwd: Part  # the units' backward
    no_comm: float  # the same with every transfer skipped
    exposed: float  # dp: lane waits and the exposed tail
    tail: float  # of which the tail's
    schedule: tuple[str, ...]

    @property
    def total(self) -> float:
        return self.fwd.total + self.bwd.total + self.exposed


class _Pieces:
    """The block (per schedule kind) and the ends of one configuration, computed once."""

    def __init__(self, w: Workload, peer: Peer) -> None:
        self.blocks = {PREFETCH: step.block(w, peer)}
        if peer.data_parallel == "zero3" and w.sizes(peer)["u"] == 1 and shard_size(w, peer) > 1:
            self.blocks[FUSED] = step.block(w, peer, fused=True)
        self.embed, self.head = step.ends(w, peer)


def _units(w: Workload, peer: Peer, schedule: tuple[str, ...], pieces: _Pieces) -> list[Unit]:
    torch_peer = step.is_torch(peer)
    table, blk = table_params(w, peer), block_params(w, peer)
    keep_last = w.fsdp_keep_last or not torch_peer
    one_table = w.cfg.tie_embeddings or (torch_peer and w.fsdp_root)
    first = 2 * table + w.cfg.hidden if torch_peer and w.fsdp_root else table
    (ef, eb), (hf, hb) = pieces.embed, pieces.head
    moved_by = zero_collective(w, peer)  # every unit travels the same way
    # flashpar's embedding lookup saves only indices: its backward gathers nothing (FSDP2 unshards every unit)
    units = [Unit(ef.total, eb.total, gather_s(w, peer, first, moved_by), scatter_s(w, peer, first, moved_by),
                  kept=one_table, regather=torch_peer or one_table)]
    shared = port_keys(w, peer)
    for i, kind in enumerate(schedule):
        bf, bb = pieces.blocks[kind][:2]
        port = {"port_fwd": sum(bf.sent[k] for k in shared), "port_bwd": sum(bb.sent[k] for k in shared)}
        if kind == FUSED:
            units.append(Unit(bf.total, bb.total, **port))
        else:
            units.append(Unit(bf.total, bb.total, gather_s(w, peer, blk, moved_by), scatter_s(w, peer, blk, moved_by),
                              kept=keep_last and i == len(schedule) - 1, **port))
    head = table + (w.cfg.hidden if torch_peer else 0)
    if one_table:
        units.append(Unit(hf.total, hb.total))
    else:
        units.append(Unit(hf.total, hb.total, gather_s(w, peer, head, moved_by), scatter_s(w, peer, head, moved_by),
                          kept=True))
    return units


def port_keys(w: Workload, peer: Peer) -> tuple[str, ...]:
    """The parallelisms whose transfers ride the port the shard group's lanes ride: those of a group of more than
    one rank on the same kind of link (NVLink inside a node, the network port across nodes)."""
    g = w.groups(peer)
    kind = g["shard"][2]
    return tuple(k for k in ("tp", "ulysses", "cp") if g[k][0] > 1 and g[k][2] == kind)


def _run(w: Workload, peer: Peer, schedule: tuple[str, ...], pieces: _Pieces) -> DataParallel:
    torch_peer = step.is_torch(peer)
    units = _units(w, peer, schedule, pieces)
    if torch_peer:
        ahead, blocking = (1 if w.fsdp_prefetch else 0), False
    else:
        ahead = w.prefetch if peer.mode != "none" else 0
        blocking = ahead == 0  # (flashpar.overlap.prefetch: depth 0 is the blocking schedule)
    ln = lanes(units, ahead, blocking)
    tail_end, overlap = ln.scatter_end, 0.0
    if not torch_peer:  # the norms' gradients, one fp32 message summed over the whole mesh after the last unit's
        all_n, all_hw = w.groups(peer)["all"][:2]
        tail_end = max(tail_end, ln.bwd_end) + step.small_all_reduce_s(norm_params(w) * 4, all_n, all_hw)
    if not torch_peer and not blocking:
        # the squared norms of the gradients that have landed: all but the embedding table's and the norms'
        landed = local_params(w, peer) - norm_params(w) - table_params(w, peer) / shard_size(w, peer)
        overlap = w.cluster.device.memory_time(step.NORM_PASS_BYTES_PER_PARAM * max(landed, 0.0))
    tail = max(0.0, tail_end - ln.bwd_end - overlap)
    blocks = [pieces.blocks[k] for k in schedule]
    (ef, eb), (hf, hb) = pieces.embed, pieces.head
    fwd = total([ef, *[b[0] for b in blocks], hf])
    bwd = total([eb, *[b[1] for b in blocks], hb])
    no_comm = ef.compute + eb.compute + hf.compute + hb.compute + sum(b[2].compute + b[3].compute for b in blocks)
    return DataParallel(fwd, bwd, no_comm, ln.exposed + tail, tail, schedule)


def data_parallel(w: Workload, peer: Peer, schedule: tuple[str, ...] | None = None) -> DataParallel:
    """The step of ``peer`` on ``w`` without the optimizer, with ``schedule`` (flashpar and baseline; None:
    the configuration's own, ``zero_schedule``)."""
    pieces = _Pieces(w, peer)
    if step.is_torch(peer):
        return _run(w, peer, (PREFETCH,) * w.cfg.layers, pieces)
    if schedule is None:
        return _best(w, peer, pieces)
    if len(schedule) != w.cfg.layers or any(k not in pieces.blocks for k in schedule):
        raise ValueError(f"a ZeRO-3 schedule names one of {tuple(pieces.blocks)} per block ({w.cfg.layers}), got "
                         f"{schedule!r}")
    return _run(w, peer, tuple(schedule), pieces)


ZERO_AUTO_MARGIN = 0.98
"""``auto`` leaves every block prefetched only for a predicted gain of more than 2% of the step: the model is
rough about the fused decomposition's many small transfers (on the CPU box, measured: block 0 fused exposed
more than prefetching every block, where the model predicted less)."""


def _best(w: Workload, peer: Peer, pieces: _Pieces) -> DataParallel:
    every = _run(w, peer, (PREFETCH,) * w.cfg.layers, pieces)
    if peer.mode == "none":
        return every
    best = min((_run(w, peer, c, pieces) for c in candidates(w, peer)), key=lambda r: r.total)
    return best if best.total < ZERO_AUTO_MARGIN * every.total else every


def zero_schedule(w: Workload, peer: Peer) -> tuple[str, ...]:
    """flashpar's ZeRO-3 schedule per block on ``w``: ``"prefetch"`` or ``"fused"`` for each of the model's
    blocks (mode flash: the fastest candidate of ``candidates`` where it beats every block prefetched by more
    than ``ZERO_AUTO_MARGIN``, else every block prefetched; baseline: every block prefetch)."""
    if step.is_torch(peer):
        raise ValueError(f"{peer.name} runs FSDP2, not flashpar's ZeRO-3")
    return data_parallel(w, peer).schedule
