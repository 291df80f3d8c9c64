"""Schedules as data: each rank's ordered list of compute and communication steps.

Pure Python: no tensors, no torch.distributed.  ``build_schedule(op, mode, N, r)``
returns the step list that :mod:`flashpar.overlap.executor` runs and that a
simulator (:func:`flashpar.overlap.cost.simulate`) times.  Tests check the
properties of the lists for every (N, r) in one process.

Vocabulary
----------
Rows are addressed by :class:`Piece`: chunk ``c`` of ``k`` of the sequence block
owned by rank ``block`` (``block == ALL`` means every row).  Two agents run the
list:

* the *main* agent runs :class:`Compute`, :class:`Wait` and :class:`Add` steps
  in order;
* the *lane* runs communication items (:class:`Exchange`, :class:`Collective`)
  strictly one after another, in the order the main agent submits them.  An item
  is submitted when the main agent reaches it in the list, so everything computed
  before it is ready (that is the only dependency, and it is implicit).

A sequential lane is what makes the point-to-point decomposition pay: exchange
``t`` pairs each rank with one sender and one receiver (shift permutation
``r -> r + t``), so every link carries one flow at full rate and peer blocks
arrive one after another, not all together at the end.  Which side of an
exchange the lane sequences is :attr:`Exchange.sequenced`.

Ops
---
``ag_matmul``       forward of ``y = all_gather(x) @ W^T``.  Gemm ``y``.
``matmul_rs``       forward of ``y_r = reduce_scatter(x @ W^T)``.  Gemm ``p`` (partial, from buffer ``a``).
``ag_matmul_bwd``   backward of ``ag_matmul``: ``grad_x`` is a GEMM+reduce-scatter
                    (gemm ``p`` = ``grad_y @ W``), ``grad_W = all_gather(x)^T @ grad_y``
                    (gemm ``gw``), with ``x`` re-gathered (default) or saved.
``matmul_rs_bwd``   backward of ``matmul_rs``: one all-gather of ``grad_y`` feeding two
                    gemms per block, ``gx`` (``grad_x = grad_y @ W``) and ``gw``
                    (``grad_W += grad_y_j^T @ x_j``); the bias gradient is all-reduced
                    first (item ``gb``).

All-to-all ops (Ulysses).  Rank ``j`` owns token block ``j`` and head group ``j``;
``Compute.peer`` names the head group (the other end) a piece belongs to.

``matmul_a2a``      GEMM then all-to-all, local block last: gemm ``p`` computes this rank's
                    tokens for head group ``j`` (buffer ``a`` -> ``send`` of peer ``j``), sent
                    as soon as computed; received blocks land in ``out[block i]``.
``a2a_matmul``      all-to-all then GEMM, local block first: ``in[block j]`` goes to rank ``j``;
                    the piece of head group ``j`` arrives in ``recv`` of peer ``j`` and feeds
                    gemm ``y`` (a sum over head groups).
``matmul_a2a_bwd``  backward of ``matmul_a2a``: the ``a2a_matmul`` pattern with gemms ``gx``
                    and ``gw`` per arriving piece, then (``reduce_weight``) an all-reduce of
                    ``gw`` over the group.
``a2a_matmul_bwd``  backward of ``a2a_matmul``: the ``matmul_a2a`` pattern, with gemm ``gw``
                    (on the pieces the forward received, no communication) just before the
                    local block; ``reduce_weight`` all-reduces ``gw`` behind that local block.

Modes
-----
``flash``  point-to-point per peer, local-first (all-gather) / local-last (reduce-scatter).
``ring``   neighbour ring: all-gather forwards blocks, reduce-scatter accumulates and forwards.
``slice``  ``chunks`` slices, each slice one async collective; first (AG) or last (RS) exposed.
``none``   one blocking collective and one GEMM.
All-to-all ops have no ``ring`` (forwarding an all-to-all around a ring multiplies its bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALL = -1
"""``Piece.block`` value meaning every row of the tensor."""

# Flash lanes: a gather sequences its receives (blocks arrive one at a time, in the order the
# GEMM needs them, whatever the skew between ranks); a reduce-scatter sequences nothing: each
# partial leaves as soon as it is computed and the receiver needs them all only at the end, so
# a late peer must not hold back the other transfers (measured: N=4 at 300mbit, ovl/ideal of
# the forward 1.11 unsequenced vs 1.17-1.20 with sequenced sends).
GATHER_SEQUENCE = "recvs"
SCATTER_SEQUENCE = "none"

OPS = ("ag_matmul", "matmul_rs", "ag_matmul_bwd", "matmul_rs_bwd")
A2A_OPS = ("matmul_a2a", "a2a_matmul", "matmul_a2a_bwd", "a2a_matmul_bwd")
MODES = ("flash", "ring", "slice", "none")
A2A_MODES = ("flash", "slice", "none")


@dataclass(frozen=True)
class Piece:
    """Chunk ``chunk`` of ``chunks`` of the sequence block of rank ``block`` (or ``ALL``)."""

    block: int
    chunk: int = 0
    chunks: int = 1


WHOLE = Piece(ALL)


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message: ``buffer[piece]`` to / from group rank ``peer``."""

    peer: int
    buffer: str
    piece: Piece


@dataclass(frozen=True)
class Exchange:
    """Lane item: post ``sends`` and ``recvs`` together, complete all before the next item.

    ``sequenced``: which transfers the lane runs in order: ``"both"`` (each item completes
    before the next), ``"sends"`` (receives are posted at submission), ``"recvs"`` (sends are
    posted at submission; gloo moves a message only once its receive is posted, so the
    receiver then admits one sender at a time) or ``"none"`` (everything posted at submission,
    the item's ``Wait`` waits for it).  The ring must use ``"both"``: it forwards what it
    received.  On CUDA every item is posted in schedule order on NCCL's stream.
    """

    id: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    sequenced: str = "both"


@dataclass(frozen=True)
class Collective:
    """Lane item: one collective on chunk ``chunk`` of ``chunks`` of every block.

    ``kind``: ``all_gather`` (``src`` -> ``dst``), ``reduce_scatter`` (``src`` -> ``dst``),
    ``all_to_all`` (``src`` piece of peer ``j`` -> ``dst`` of rank ``j``), ``all_reduce`` (in
    place on ``src``).
    """

    id: int
    kind: str
    src: str
    dst: str
    chunk: int = 0
    chunks: int = 1


@dataclass(frozen=True)
class Compute:
    """Main: gemm ``gemm`` on the rows of ``piece``, reading ``src``, writing ``dst``.

    ``peer``: the head group of an all-to-all piece (-1 elsewhere)."""

    gemm: str
    piece: Piece
    src: str
    dst: str
    peer: int = -1


@dataclass(frozen=True)
class Wait:
    """Main: block until lane item ``id`` is complete."""

    id: int


@dataclass(frozen=True)
class Add:
    """Main: ``dst[piece] += src[piece]`` (``src`` of peer ``peer`` where buffers are per peer)."""

    dst: str
    src: str
    piece: Piece
    peer: int = -1


Step = Exchange | Collective | Compute | Wait | Add


@dataclass(frozen=True)
class Schedule:
    op: str
    mode: str
    world_size: int
    rank: int
    chunks: int
    steps: tuple[Step, ...] = field(repr=False)

    def lane_items(self) -> list[Exchange | Collective]:
        return [s for s in self.steps if isinstance(s, (Exchange, Collective))]

    def computes(self) -> list[Compute]:
        return [s for s in self.steps if isinstance(s, Compute)]

    def describe(self) -> str:
        """One line per step, for printing and debugging."""
        return "\n".join(_describe(s) for s in self.steps)


def _describe(step: Step) -> str:
    def pc(p: Piece) -> str:
        return "all" if p.block == ALL else f"b{p.block}.{p.chunk}/{p.chunks}"

    if isinstance(step, Exchange):
        s = ", ".join(f"{t.buffer}[{pc(t.piece)}]->r{t.peer}" for t in step.sends)
        r = ", ".join(f"{t.buffer}[{pc(t.piece)}]<-r{t.peer}" for t in step.recvs)
        return f"lane#{step.id} exchange  send {s or '-'}  recv {r or '-'}"
    if isinstance(step, Collective):
        return f"lane#{step.id} {step.kind} {step.src}->{step.dst} slice {step.chunk}/{step.chunks}"
    if isinstance(step, Compute):
        group = f" g{step.peer}" if step.peer >= 0 else ""
        return f"compute {step.gemm}[{pc(step.piece)}{group}] {step.src}->{step.dst}"
    if isinstance(step, Wait):
        return f"wait lane#{step.id}"
    return f"add {step.dst}[{pc(step.piece)}] += {step.src}(r{step.peer})"


class _Builder:
    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.next_id = 0

    def exchange(self, sends: list[Transfer], recvs: list[Transfer], sequenced: str = "both") -> int:
        self.steps.append(Exchange(self.next_id, tuple(sends), tuple(recvs), sequenced))
        self.next_id += 1
        return self.next_id - 1

    def collective(self, kind: str, src: str, dst: str, chunk: int = 0, chunks: int = 1) -> int:
        self.steps.append(Collective(self.next_id, kind, src, dst, chunk, chunks))
        self.next_id += 1
        return self.next_id - 1

    def compute(self, gemms: tuple[str, ...], piece: Piece, src: str, dst: str | None = None,
                peer: int = -1) -> None:
        """``dst=None``: each gemm writes its own output buffer, named like the gemm."""
        for g in gemms:
            self.steps.append(Compute(g, piece, src, dst or g, peer))

    def wait(self, item: int) -> None:
        self.steps.append(Wait(item))


def build_schedule(
    op: str,
    mode: str,
    world_size: int,
    rank: int,
    *,
    chunks: int = 1,
    grad_input: bool = True,
    grad_weight: bool = True,
    grad_bias: bool = False,
    regather: bool = True,
    reduce_weight: bool = False,
) -> Schedule:
    """The step list of ``rank`` for ``op`` in ``mode``.

    ``chunks``: sub-blocks per peer block (flash, ring) or slices (slice).
    ``grad_input`` / ``grad_weight`` / ``grad_bias``: which gradients a backward op computes.
    ``regather``: ``ag_matmul_bwd`` gathers ``x`` again (True) or reads the gathered copy saved
    by the forward (False).
    ``reduce_weight``: all-to-all backward ops all-reduce ``gw`` over the group.
    """
    if op in A2A_OPS:
        return _a2a_schedule(op, mode, world_size, rank, chunks, grad_input, grad_weight, reduce_weight)
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS + A2A_OPS}")
    _check(mode, MODES, world_size, rank, chunks)
    n, r = world_size, rank
    b = _Builder()
    if op == "ag_matmul":
        _all_gather(b, mode, n, r, chunks, ("y",), src="x")
    elif op == "matmul_rs_bwd":
        gb = b.collective("all_reduce", "gb", "gb") if grad_bias and n > 1 else None
        gemms = tuple(g for g, need in (("gx", grad_input), ("gw", grad_weight)) if need)
        _all_gather(b, mode, n, r, chunks, gemms, src="g")
        if gb is not None:
            b.wait(gb)
    elif op == "matmul_rs":
        _reduce_scatter(b, mode, n, r, chunks, extra=(), gather_x=False)
    else:  # ag_matmul_bwd
        if grad_input:
            extra = ("gw",) if grad_weight else ()
            _reduce_scatter(b, mode, n, r, chunks, extra=extra, gather_x=grad_weight and regather)
        elif grad_weight and regather:
            _all_gather(b, mode, n, r, chunks, ("gw",), src="x")
        elif grad_weight:
            b.compute(("gw",), WHOLE, "x")
    steps = tuple(b.steps)
    return Schedule(op, mode, n, r, chunks if mode in ("flash", "ring", "slice") else 1, steps)


def _check(mode: str, modes: tuple[str, ...], world_size: int, rank: int, chunks: int) -> None:
    if mode not in modes:
        raise ValueError(f"unknown mode {mode!r}; expected one of {modes}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of size {world_size}")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")


def _a2a_schedule(op, mode, n, r, k, grad_input, grad_weight, reduce_weight) -> Schedule:
    _check(mode, A2A_MODES, n, r, k)
    k = k if mode in ("flash", "slice") else 1
    b = _Builder()
    reduce = reduce_weight and grad_weight and n > 1
    if op == "matmul_a2a":
        _a2a_scatter(b, mode, n, r, k, extra=False, reduce=False)
    elif op == "a2a_matmul":
        _a2a_gather(b, mode, n, r, k, ("y",))
    elif op == "matmul_a2a_bwd":
        gemms = tuple(g for g, need in (("gx", grad_input), ("gw", grad_weight)) if need)
        if gemms:
            _a2a_gather(b, mode, n, r, k, gemms)
        if reduce:
            b.wait(b.collective("all_reduce", "gw", "gw"))
    elif grad_input:  # a2a_matmul_bwd
        _a2a_scatter(b, mode, n, r, k, extra=grad_weight, reduce=reduce)
    elif grad_weight:
        for j in range(n):
            b.compute(("gw",), Piece(r), "saved", peer=j)
        if reduce:
            b.wait(b.collective("all_reduce", "gw", "gw"))
    return Schedule(op, mode, n, r, k, tuple(b.steps))


def _a2a_scatter(b: _Builder, mode: str, n: int, r: int, k: int, *, extra: bool, reduce: bool) -> None:
    """GEMM then all-to-all (local block last).  Piece ``(r, c)`` of head group ``j`` goes to rank ``j``
    (buffer ``send`` of peer ``j``) and lands there in ``out[block r]``.  ``extra``: gemm ``gw`` on the
    forward's received pieces (``saved``, one per group) before the local block; ``reduce``: then an
    all-reduce of ``gw``, hidden behind the local block."""
    others = [to for to, _ in peer_order(n, r)]
    items = []

    def weight_terms() -> None:
        if extra:
            for j in [r, *others]:
                b.compute(("gw",), Piece(r), "saved", peer=j)
        if reduce:
            items.append(b.collective("all_reduce", "gw", "gw"))

    if n == 1:
        b.compute(("p",), WHOLE, "a", "out", peer=r)
        weight_terms()
        return
    if mode == "flash":
        for to, frm in peer_order(n, r):
            for c in range(k):
                b.compute(("p",), Piece(r, c, k), "a", "send", peer=to)
                sends = [Transfer(to, "send", Piece(r, c, k))]
                items.append(b.exchange(sends, [Transfer(frm, "out", Piece(frm, c, k))], sequenced=SCATTER_SEQUENCE))
        weight_terms()
        b.compute(("p",), Piece(r), "a", "out", peer=r)  # local last: covers the last sends
    else:  # slice / none: every group's slice c (this rank's own included) in one collective
        for c in range(k):
            for j in [*others, r]:
                b.compute(("p",), Piece(r, c, k), "a", "send", peer=j)
            items.append(b.collective("all_to_all", "send", "out", c, k))
        weight_terms()
    for item in items:
        b.wait(item)


def _a2a_gather(b: _Builder, mode: str, n: int, r: int, k: int, gemms: tuple[str, ...]) -> None:
    """All-to-all then GEMM (local block first): ``in[block j]`` goes to rank ``j``; head group ``j``'s
    piece of this rank's tokens arrives in ``recv`` of peer ``j`` and feeds ``gemms``."""
    if n == 1:
        b.compute(gemms, WHOLE, "in", peer=r)
        return
    if mode == "flash":
        items = []
        for to, frm in peer_order(n, r):
            for c in range(k):
                sends = [Transfer(to, "in", Piece(to, c, k))]
                item = b.exchange(sends, [Transfer(frm, "recv", Piece(r, c, k))], sequenced=GATHER_SEQUENCE)
                items.append((item, frm, c))
        b.compute(gemms, Piece(r), "in", peer=r)  # local first: needs no communication
        for item, frm, c in items:
            b.wait(item)
            b.compute(gemms, Piece(r, c, k), "recv", peer=frm)
        return
    items = [b.collective("all_to_all", "in", "recv", c, k) for c in range(k)]
    for c, item in enumerate(items):
        b.wait(item)
        for j in [r] + [frm for _, frm in peer_order(n, r)]:
            b.compute(gemms, Piece(r, c, k), "recv", peer=j)


def peer_order(world_size: int, rank: int) -> list[tuple[int, int]]:
    """``(send_to, recv_from)`` of exchange ``t = 1 .. N-1``: the shift permutation ``r -> r + t``."""
    n = world_size
    return [((rank + t) % n, (rank - t) % n) for t in range(1, n)]


def _gather_exchanges(b: _Builder, mode: str, n: int, r: int, k: int, buf: str) -> list[tuple[int, Piece]]:
    """The exchanges of a point-to-point all-gather of ``buf``; returns (lane item, arriving piece).

    Exchange ``(t, c)`` brings chunk ``c`` of block ``r - t``: flash sends its own block straight to
    ``r + t``; ring forwards to ``r + 1`` the block it received in the previous exchange.
    """
    items = []
    for t, (to, frm) in enumerate(peer_order(n, r), start=1):
        for c in range(k):
            if mode == "flash":
                sends, seq = [Transfer(to, buf, Piece(r, c, k))], GATHER_SEQUENCE
            else:
                sends, seq = [Transfer((r + 1) % n, buf, Piece((r - t + 1) % n, c, k))], "both"
                frm = (r - 1) % n
            piece = Piece((r - t) % n, c, k)
            items.append((b.exchange(sends, [Transfer(frm, buf, piece)], sequenced=seq), piece))
    return items


def _all_gather(b: _Builder, mode: str, n: int, r: int, k: int, gemms, *, src: str) -> None:
    """All-gather of ``src`` feeding ``gemms`` per arriving piece (local piece first)."""
    if n == 1 or mode == "none":
        if n > 1:
            b.wait(b.collective("all_gather", src, src))
        b.compute(gemms, WHOLE, src)
        return
    if mode == "slice":
        items = [b.collective("all_gather", src, src, c, k) for c in range(k)]
        for c, item in enumerate(items):
            b.wait(item)
            for j in [r] + [frm for _, frm in peer_order(n, r)]:
                b.compute(gemms, Piece(j, c, k), src)
        return
    items = _gather_exchanges(b, mode, n, r, k, src)
    b.compute(gemms, Piece(r), src)  # local first: needs no communication
    for item, piece in items:
        b.wait(item)
        b.compute(gemms, piece, src)


def _reduce_scatter(b: _Builder, mode: str, n: int, r: int, k: int, *, extra, gather_x: bool) -> None:
    """GEMM+reduce-scatter of gemm ``p`` into ``y`` (local block last).

    ``extra``: gemms computed per piece besides ``p`` (``gw`` in ``ag_matmul_bwd``);
    ``gather_x``: those read an all-gathered ``x`` whose exchanges go first on the lane.
    """
    if n == 1:
        b.compute(("p",), WHOLE, "a", "y")
        b.compute(extra, WHOLE, "x")
        return
    x_items: list[tuple[int, Piece]] = []
    if gather_x and mode in ("flash", "ring"):
        x_items = _gather_exchanges(b, mode, n, r, k, "x")
    elif gather_x:  # slice / none: collectives of x first
        slices = k if mode == "slice" else 1
        x_items = [(b.collective("all_gather", "x", "x", c, slices), Piece(ALL, c, slices)) for c in range(slices)]

    def extra_terms() -> None:
        """``gw`` terms on every gathered piece (local-first), or one GEMM on the saved gather."""
        if not extra:
            return
        if not gather_x:
            b.compute(extra, WHOLE, "x")
            return
        if mode in ("flash", "ring"):
            b.compute(extra, Piece(r), "x")
        for item, piece in x_items:
            b.wait(item)
            if piece.block == ALL:  # a gathered slice: one term per block
                for j in range(n):
                    b.compute(extra, Piece(j, piece.chunk, piece.chunks), "x")
            else:
                b.compute(extra, piece, "x")

    if mode == "none":
        b.compute(("p",), WHOLE, "a", "full")
        item = b.collective("reduce_scatter", "full", "y")
        extra_terms()
        b.wait(item)
        return
    if mode == "slice":
        items = []
        for c in range(k):
            for j in [to for to, _ in peer_order(n, r)] + [r]:
                b.compute(("p",), Piece(j, c, k), "a", "slab")
            items.append(b.collective("reduce_scatter", "slab", "y", c, k))
        extra_terms()
        for item in items:
            b.wait(item)
        return
    if mode == "flash":
        recvs: list[tuple[int, Piece, int]] = []
        for to, frm in peer_order(n, r):
            for c in range(k):
                b.compute(("p",), Piece(to, c, k), "a", "send")
                sends = [Transfer(to, "send", Piece(to, c, k))]
                item = b.exchange(sends, [Transfer(frm, "recv", Piece(r, c, k))], sequenced=SCATTER_SEQUENCE)
                recvs.append((item, Piece(r, c, k), frm))
        extra_terms()
        b.compute(("p",), Piece(r), "a", "y")  # local last: covers the last sends
        for item, piece, frm in recvs:
            b.wait(item)
            b.steps.append(Add("y", "recv", piece, frm))
        return
    # ring: the block for rank d starts at d + 1, gathers one partial per hop, ends at d.
    last: dict[int, int] = {}
    for t in range(1, n):
        acc, acc_in = f"acc{t % 2}", f"accin{(t - 1) % 2}"
        for c in range(k):
            piece = Piece((r - t) % n, c, k)
            b.compute(("p",), piece, "a", acc)
            if t >= 2:
                b.wait(last[c])
                b.steps.append(Add(acc, acc_in, piece, (r - 1) % n))
            nxt = Piece((r - t - 1) % n, c, k)
            last[c] = b.exchange([Transfer((r + 1) % n, acc, piece)], [Transfer((r - 1) % n, f"accin{t % 2}", nxt)])
    extra_terms()
    b.compute(("p",), Piece(r), "a", "y")
    for c in range(k):
        b.wait(last[c])
        b.steps.append(Add("y", f"accin{(n - 1) % 2}", Piece(r, c, k), (r - 1) % n))
