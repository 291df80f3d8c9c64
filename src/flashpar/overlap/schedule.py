"""Schedules as data: each rank's ordered list of compute and communication steps.

Pure Python: no tensors, no torch.distributed.  ``build_schedule(op, mode, N, r)``
returns the step list that :mod:`flashpar.overlap.executor` runs and that a
simulator (:func:`flashpar.overlap.simulate.simulate`) times.  Tests check the
properties of the lists for every (N, r) in one process.

The steps (the agents that run them, the rows they address, the buffers they name) are
:mod:`flashpar.overlap.steps`.

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
``sharded``         forward of the sharded-DP linear: all-gather of the weight shards ``w``
                    (row space = output features), gemm ``y`` per arriving shard.
``sharded_bwd``     its backward: gather ``w`` again; gemm ``gw`` (this rank's ``grad_W`` of
                    shard ``j``) is reduce-scattered to the shard's owner (local block last),
                    gemm ``gx`` adds each gathered shard's ``grad_x`` term (local first).

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

Merged pieces
-------------
``peers_per_piece = g`` (flash only, ``chunks = 1``): the ``N - 1`` peers are cut, in exchange
order ``t = 1 .. N-1``, into ``p = ceil((N-1) / g)`` pieces of ``floor`` or ``ceil((N-1) / p)``
peers (:func:`peer_pieces`).  A piece is one lane item (one :class:`Exchange` with a send and a
receive per peer of it) and one GEMM on its blocks together, so it pays one message latency, one
launch and a GEMM of ``g`` blocks' rows instead of ``g`` of each.  The smaller pieces sit next to the
local block (first on the all-gather side, last on the reduce-scatter side): the local GEMM alone
hides the transfer of the piece beside it.  Rank ``r``'s piece of shifts ``{t}`` holds blocks
``r - t`` (gather) or ``r + t`` (scatter), consecutive modulo ``N``; where they wrap past rank 0
the piece computes as two GEMMs, one per run of consecutive rows: at most one piece of an op
wraps, so that costs one launch, where a merged buffer would copy every row of the piece in (and,
for an output in global row order, out again).  In flight, all-gather at N = 8, g = 3 (pieces of
2, 2 and 3 peers), rank r::

    lane:  | x_r -> r+1, r+2         | x_r -> r+3, r+4         | x_r -> r+5 .. r+7         |
           | x_{r-1}, x_{r-2} <-     | x_{r-3}, x_{r-4} <-     | x_{r-5} .. x_{r-7} <-     |
    main:  | y[r] (local)            | y[r-2 .. r-1]           | y[r-4 .. r-3]             | y[r-7 .. r-5]

All-to-all pieces merge head groups, not rows: the scatter side (``matmul_a2a``, the ``p`` gemm of
``a2a_matmul_bwd``) computes a run of consecutive head groups in one batched GEMM
(``Compute.peers``); the gather side sums over head groups (a contraction along features of
separately received buffers), so it keeps one GEMM per head group after the piece's one wait.

Modes
-----
``flash``  point-to-point per peer (or per merged piece), local-first (all-gather) / local-last
           (reduce-scatter).
``ring``   neighbour ring: all-gather forwards blocks, reduce-scatter accumulates and forwards.
``slice``  ``chunks`` slices, each slice one async collective; first (AG) or last (RS) exposed.
``none``   one blocking collective and one GEMM.
All-to-all ops have no ``ring`` (forwarding an all-to-all around a ring multiplies its bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpar.overlap.steps import (  # noqa: F401 - the step types, read from here by the executors
    ALL,
    BUFFER_KINDS,
    TAG_DIRECT,
    TAG_GATHER,
    TAG_GATHER_GRAD,
    TAG_RING,
    WHOLE,
    Add,
    BufferDecl,
    Collective,
    Compute,
    Exchange,
    Piece,
    Schedule,
    ScheduleBuilder,
    Step,
    Transfer,
    Wait,
)

# Flash lanes: a gather sequences its receives (blocks arrive one at a time, in the order the
# GEMM needs them, whatever the skew between ranks); a reduce-scatter sequences nothing: each
# partial leaves as soon as it is computed and the receiver needs them all only at the end, so
# a late peer must not hold back the other transfers (measured: N=4 at 300mbit, ovl/ideal of
# the forward 1.11 unsequenced vs 1.17-1.20 with sequenced sends).
GATHER_SEQUENCE = "recvs"
SCATTER_SEQUENCE = "none"

OPS = ("ag_matmul", "matmul_rs", "ag_matmul_bwd", "matmul_rs_bwd", "sharded", "sharded_bwd")
A2A_OPS = ("matmul_a2a", "a2a_matmul", "matmul_a2a_bwd", "a2a_matmul_bwd")
MODES = ("flash", "ring", "slice", "none")
A2A_MODES = ("flash", "slice", "none")


def build_schedule(
    op: str,
    mode: str,
    world_size: int,
    rank: int,
    *,
    chunks: int = 1,
    peers_per_piece: int = 1,
    grad_input: bool = True,
    grad_weight: bool = True,
    grad_bias: bool = False,
    regather: bool = True,
    reduce_weight: bool = False,
) -> Schedule:
    """The step list of ``rank`` for ``op`` in ``mode``, with the buffers it names.

    ``chunks``: sub-blocks per peer block (flash, ring) or slices (slice).
    ``peers_per_piece``: flash: at most this many peers per merged piece (see *Merged pieces*; 1: one
    piece per peer; more than ``N - 1``: one piece of every peer).
    ``grad_input`` / ``grad_weight`` / ``grad_bias``: which gradients a backward op computes
    (``sharded_bwd``: ``grad_weight`` is the reduce-scattered gemm ``gw``, ``grad_input`` the gemm
    ``gx`` on the gathered shards).
    ``regather``: ``ag_matmul_bwd`` gathers ``x`` again (True) or reads the gathered copy saved
    by the forward (False).
    ``reduce_weight``: all-to-all backward ops all-reduce ``gw`` over the group.
    """
    _check_flags(grad_input=grad_input, grad_weight=grad_weight, grad_bias=grad_bias, regather=regather,
                 reduce_weight=reduce_weight)
    if op not in OPS + A2A_OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS + A2A_OPS}")
    check_peers_per_piece(peers_per_piece, op=op, mode=mode, chunks=chunks)
    if op in A2A_OPS:
        return _a2a_schedule(op, mode, world_size, rank, chunks, peers_per_piece, grad_input, grad_weight,
                             reduce_weight)
    _check(mode, MODES, world_size, rank, chunks)
    n, r = world_size, rank
    g = min(peers_per_piece, max(n - 1, 1))  # more than N - 1: one piece of every peer
    b = ScheduleBuilder()
    if op in ("ag_matmul", "sharded"):  # the gathered operand: activations x, or the weight shards w
        src = "x" if op == "ag_matmul" else "w"
        b.declare(src, "gathered", "in", TAG_GATHER)
        b.declare("y", "full" if op == "ag_matmul" else "kernel", "out")
        _all_gather(b, mode, n, r, chunks, ("y",), src=src, g=g)
    elif op == "matmul_rs_bwd":
        gb = None
        if grad_bias and n > 1:
            b.declare("gb", "local", "out")
            gb = b.collective("all_reduce", "gb", "gb")
        gemms = tuple(g for g, need in (("gx", grad_input), ("gw", grad_weight)) if need)
        b.declare("g", "gathered", "out", TAG_GATHER_GRAD)
        if grad_input:
            b.declare("gx", "full", "in")
        if grad_weight:
            b.declare("gw", "kernel", "in")
        _all_gather(b, mode, n, r, chunks, gemms, src="g", g=g)
        if gb is not None:
            b.wait(gb)
    elif op == "matmul_rs":
        b.declare("a", "full", "in")
        _reduce_scatter(b, mode, n, r, chunks, Scatter("p", "a", "y", "out"), g=g)
    elif op == "ag_matmul_bwd":
        # grad_x [s_r, in] = ReduceScatter(grad_y @ W) (gemm p on a = grad_y); grad_W on the gathered x
        if grad_input:
            b.declare("a", "full", "out")
        _gather_scatter(b, mode, n, r, chunks, Scatter("p", "a", "gx", "in") if grad_input else None,
                        "gw" if grad_weight else None, "x", regather, g=g)
    else:  # sharded_bwd: grad_W of shard j [o_j, in] reduce-scattered to j; grad_x terms on the gathered shards
        if grad_weight:
            b.declare("g", "kernel", "out")
        _gather_scatter(b, mode, n, r, chunks, Scatter("gw", "g", "gw", "in") if grad_weight else None,
                        "gx" if grad_input else None, "w", True)
    return b.schedule(op, mode, n, r, chunks if mode in ("flash", "ring", "slice") else 1, g)


@dataclass(frozen=True)
class Scatter:
    """The reduce-scattered gemm of a schedule: ``gemm`` reads ``src``; the sum of every rank's rows of
    block ``r`` lands in ``out`` (``[s_r, width]``, the op's output)."""

    gemm: str
    src: str
    out: str
    width: str


def _gather_scatter(b: ScheduleBuilder, mode: str, n: int, r: int, k: int, scatter: Scatter | None,
                    gathered_gemm: str | None, gathered: str, regather: bool, g: int = 1) -> None:
    """A GEMM+reduce-scatter (``scatter``) and/or a gemm on every block of ``gathered`` (all-gathered
    again when ``regather``, else the op's saved copy), sharing one lane: the gather goes first."""
    if gathered_gemm is not None:
        b.declare(gathered_gemm, "kernel", "in")
        b.declare(gathered, "gathered" if regather else "full", "in", TAG_GATHER if regather else 0)
    if scatter is not None:
        extra = (gathered_gemm,) if gathered_gemm is not None else ()
        _reduce_scatter(b, mode, n, r, k, scatter, extra=extra, gathered=gathered,
                        gather_x=gathered_gemm is not None and regather, g=g)
    elif gathered_gemm is not None and regather:
        _all_gather(b, mode, n, r, k, (gathered_gemm,), src=gathered, g=g)
    elif gathered_gemm is not None:
        b.compute((gathered_gemm,), WHOLE, gathered)


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


MERGED_OPS = ("ag_matmul", "matmul_rs", "ag_matmul_bwd", "matmul_rs_bwd", *A2A_OPS)
"""Ops whose flash schedules take ``peers_per_piece``; the sharded-DP ones keep one piece per peer."""


def check_peers_per_piece(peers_per_piece, *, op: str | None = None, mode: str = "flash", chunks=1) -> None:
    """``peers_per_piece``: an int >= 1; above 1 only with flash, ``chunks = 1`` and an op of
    :data:`MERGED_OPS` (``op=None``: any of them).  ``ValueError`` with one line naming the problem."""
    g = peers_per_piece
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"peers_per_piece must be an integer >= 1, got {g!r}")
    if g == 1:
        return
    if mode != "flash":
        raise ValueError(f"peers_per_piece={g} merges the pieces of mode 'flash' only, not of mode {mode!r}")
    if chunks not in (None, 1):
        raise ValueError(f"peers_per_piece={g} takes whole blocks: chunks must be 1, got {chunks!r} "
                         "(merging peers and cutting blocks pull opposite ways)")
    if op is not None and op not in MERGED_OPS:
        raise ValueError(f"peers_per_piece={g} does not apply to op {op!r} (its schedules keep one piece per peer)")


def _check(mode: str, modes: tuple[str, ...], world_size: int, rank: int, chunks: int) -> None:
    for name, value in (("world_size", world_size), ("rank", rank), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if mode not in modes:
        raise ValueError(f"unknown mode {mode!r}; expected one of {modes}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of size {world_size}")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")


def _a2a_schedule(op, mode, n, r, k, g, grad_input, grad_weight, reduce_weight) -> Schedule:
    _check(mode, A2A_MODES, n, r, k)
    g = min(g, max(n - 1, 1))
    k = k if mode in ("flash", "slice") else 1
    b = ScheduleBuilder()
    reduce = reduce_weight and grad_weight and n > 1
    peer_kind = "peer_slabs" if mode in ("slice", "none") and n > 1 else "per_peer"
    if op in ("matmul_a2a_bwd", "a2a_matmul_bwd") and grad_weight:
        b.declare("gw", "local" if reduce else "kernel", "-")
    if op == "matmul_a2a":
        b.declare("a", "local", "in")
        _a2a_scatter(b, mode, n, r, k, g, extra=False, reduce=False, width="out", peer_kind=peer_kind)
    elif op == "a2a_matmul":
        b.declare("y", "kernel", "out")
        _a2a_gather(b, mode, n, r, k, g, ("y",), width="in", peer_kind=peer_kind)
    elif op == "matmul_a2a_bwd":
        gemms = tuple(g for g, need in (("gx", grad_input), ("gw", grad_weight)) if need)
        if grad_input:
            b.declare("gx", "kernel", "in")
        if gemms:
            _a2a_gather(b, mode, n, r, k, g, gemms, width="out", peer_kind=peer_kind)
        if reduce:
            b.wait(b.collective("all_reduce", "gw", "gw"))
    elif grad_input:  # a2a_matmul_bwd
        b.declare("a", "local", "out")
        _a2a_scatter(b, mode, n, r, k, g, extra=grad_weight, reduce=reduce, width="in", peer_kind=peer_kind)
    elif grad_weight:
        b.declare("saved", "kernel", "in")
        for j in range(n):
            b.compute(("gw",), Piece(r), "saved", peer=j)
        if reduce:
            b.wait(b.collective("all_reduce", "gw", "gw"))
    return b.schedule(op, mode, n, r, k, g)


def _a2a_scatter(b: ScheduleBuilder, mode: str, n: int, r: int, k: int, g: int, *, extra: bool, reduce: bool,
                 width: str, peer_kind: str) -> None:
    """GEMM then all-to-all (local block last).  Piece ``(r, c)`` of head group ``j`` goes to rank ``j``
    (buffer ``send`` of peer ``j``) and lands there in ``out[block r]``.  ``extra``: gemm ``gw`` on the
    forward's received pieces (``saved``, one per group) before the local block; ``reduce``: then an
    all-reduce of ``gw``, hidden behind the local block.  Merged pieces (``g > 1``): one batched gemm
    ``p`` per run of consecutive head groups, one exchange per piece."""
    others = [to for to, _ in peer_order(n, r)]
    items = []
    b.declare("out", "full", width, TAG_DIRECT)
    if extra:
        b.declare("saved", "kernel", width)

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
    b.declare("send", peer_kind, width, TAG_DIRECT)
    if mode == "flash":
        for shifts in peer_pieces(n, g, local_first=False):
            tos, frms = [(r + t) % n for t in shifts], [(r - t) % n for t in shifts]
            for c in range(k):
                for first, count in runs(tos):
                    b.compute(("p",), Piece(r, c, k), "a", "send", peer=first, peers=count)
                sends = [Transfer(to, "send", Piece(r, c, k)) for to in tos]
                recvs = [Transfer(frm, "out", Piece(frm, c, k)) for frm in frms]
                items.append(b.exchange(sends, recvs, sequenced=SCATTER_SEQUENCE))
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


def _a2a_gather(b: ScheduleBuilder, mode: str, n: int, r: int, k: int, g: int, gemms: tuple[str, ...], *,
                width: str, peer_kind: str) -> None:
    """All-to-all then GEMM (local block first): ``in[block j]`` goes to rank ``j``; head group ``j``'s
    piece of this rank's tokens arrives in ``recv`` of peer ``j`` and feeds ``gemms``.  Merged pieces
    (``g > 1``): one exchange per piece, then ``gemms`` per head group of it (they sum over head groups)."""
    b.declare("in", "full", width, TAG_DIRECT)
    if n == 1:
        b.compute(gemms, WHOLE, "in", peer=r)
        return
    b.declare("recv", peer_kind, width, TAG_DIRECT)
    if mode == "flash":
        items = []
        for shifts in peer_pieces(n, g, local_first=True):
            tos, frms = [(r + t) % n for t in shifts], [(r - t) % n for t in shifts]
            for c in range(k):
                sends = [Transfer(to, "in", Piece(to, c, k)) for to in tos]
                recvs = [Transfer(frm, "recv", Piece(r, c, k)) for frm in frms]
                items.append((b.exchange(sends, recvs, sequenced=GATHER_SEQUENCE), frms, c))
        b.compute(gemms, Piece(r), "in", peer=r)  # local first: needs no communication
        for item, frms, c in items:
            b.wait(item)
            for frm in frms:
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


def peer_pieces(world_size: int, peers_per_piece: int = 1, *, local_first: bool) -> list[tuple[int, ...]]:
    """The shifts ``t = 1 .. N-1`` (exchange ``t`` of :func:`peer_order`) cut, in order, into merged pieces.

    ``p = ceil((N-1) / g)`` pieces (``g = min(peers_per_piece, N - 1)``) of ``floor`` or ``ceil((N-1) / p)``
    shifts; the smaller ones next to the local block (first when ``local_first``, last otherwise).
    ``g = 1``: one piece per shift, ``[(1,), (2,), ..., (N-1,)]``."""
    peers = world_size - 1
    if peers < 1:
        return []
    pieces = -(-peers // min(peers_per_piece, peers))
    small, bigger = divmod(peers, pieces)
    sizes = [small] * (pieces - bigger) + [small + 1] * bigger
    if not local_first:
        sizes.reverse()
    out, t = [], 1
    for size in sizes:
        out.append(tuple(range(t, t + size)))
        t += size
    return out


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``(first, count)`` of each run of consecutive indices in ``blocks`` (distinct), in ascending order:
    the blocks (or head groups) of a merged piece split where they wrap past 0."""
    out: list[tuple[int, int]] = []
    for j in sorted(blocks):
        if out and out[-1][0] + out[-1][1] == j:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((j, 1))
    return out


def _run_pieces(blocks: list[int], c: int, k: int) -> list[Piece]:
    """The pieces that compute chunk ``c`` of ``k`` of ``blocks``: one per block when ``k > 1`` (merged pieces
    take whole blocks), else one per run of consecutive blocks."""
    if k > 1 or len(blocks) == 1:
        return [Piece(j, c, k) for j in blocks]
    return [Piece(first, 0, 1, count) for first, count in runs(blocks)]


def _gather_exchanges(b: ScheduleBuilder, mode: str, n: int, r: int, k: int, buf: str,
                      g: int = 1) -> list[tuple[int, list[Piece]]]:
    """The exchanges of a point-to-point all-gather of ``buf``; returns (lane item, arriving pieces).

    Flash exchange ``(t, c)`` brings chunk ``c`` of block ``r - t`` (sending its own block straight to
    ``r + t``); a merged exchange does that for every shift of its piece and returns the piece's runs of
    blocks.  Ring forwards to ``r + 1`` the block it received in the previous exchange.
    """
    items = []
    if mode == "flash":
        for shifts in peer_pieces(n, g, local_first=True):
            frms = [(r - t) % n for t in shifts]
            for c in range(k):
                sends = [Transfer((r + t) % n, buf, Piece(r, c, k)) for t in shifts]
                recvs = [Transfer(frm, buf, Piece(frm, c, k)) for frm in frms]
                items.append((b.exchange(sends, recvs, sequenced=GATHER_SEQUENCE), _run_pieces(frms, c, k)))
        return items
    for t in range(1, n):
        for c in range(k):
            sends = [Transfer((r + 1) % n, buf, Piece((r - t + 1) % n, c, k))]
            piece = Piece((r - t) % n, c, k)
            items.append((b.exchange(sends, [Transfer((r - 1) % n, buf, piece)], sequenced="both"), [piece]))
    return items


def _all_gather(b: ScheduleBuilder, mode: str, n: int, r: int, k: int, gemms, *, src: str, g: int = 1) -> None:
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
    items = _gather_exchanges(b, mode, n, r, k, src, g)
    b.compute(gemms, Piece(r), src)  # local first: needs no communication
    for item, pieces in items:
        b.wait(item)
        for piece in pieces:
            b.compute(gemms, piece, src)


def _reduce_scatter(b: ScheduleBuilder, mode: str, n: int, r: int, k: int, sc: Scatter, *, extra=(),
                    gathered: str = "x", gather_x: bool = False, g: int = 1) -> None:
    """GEMM+reduce-scatter of gemm ``sc.gemm`` into ``sc.out`` (local block last).

    ``extra``: gemms computed per piece besides it, reading ``gathered`` (``gw`` of
    ``ag_matmul_bwd``); ``gather_x``: ``gathered`` is all-gathered first on the lane.
    ``g``: flash peers per merged piece (the gather of ``gathered`` merges the same way).
    """
    gemm, w = sc.gemm, sc.width
    b.declare(sc.out, "local", w)
    if n == 1:
        b.compute((gemm,), WHOLE, sc.src, sc.out)
        b.compute(extra, WHOLE, gathered)
        return
    x_items: list[tuple[int, list[Piece]]] = []
    if gather_x and mode in ("flash", "ring"):
        x_items = _gather_exchanges(b, mode, n, r, k, gathered, g)
    elif gather_x:  # slice / none: collectives of x first
        slices = k if mode == "slice" else 1
        x_items = [(b.collective("all_gather", gathered, gathered, c, slices), [Piece(ALL, c, slices)])
                   for c in range(slices)]

    def extra_terms() -> None:
        """``extra`` terms on every gathered piece (local-first), or one GEMM on the saved gather."""
        if not extra:
            return
        if not gather_x:
            b.compute(extra, WHOLE, gathered)
            return
        if mode in ("flash", "ring"):
            b.compute(extra, Piece(r), gathered)
        for item, pieces in x_items:
            b.wait(item)
            for piece in pieces:
                if piece.block == ALL:  # a gathered slice: one term per block
                    for j in range(n):
                        b.compute(extra, Piece(j, piece.chunk, piece.chunks), gathered)
                else:
                    b.compute(extra, piece, gathered)

    if mode == "none":
        b.declare("full", "full", w)
        b.compute((gemm,), WHOLE, sc.src, "full")
        item = b.collective("reduce_scatter", "full", sc.out)
        extra_terms()
        b.wait(item)
        return
    if mode == "slice":
        b.declare("slab", "slabs", w)
        items = []
        for c in range(k):
            for j in [to for to, _ in peer_order(n, r)] + [r]:
                b.compute((gemm,), Piece(j, c, k), sc.src, "slab")
            items.append(b.collective("reduce_scatter", "slab", sc.out, c, k))
        extra_terms()
        for item in items:
            b.wait(item)
        return
    if mode == "flash":
        b.declare("send", "per_block", w, TAG_DIRECT)
        b.declare("recv", "per_peer", w, TAG_DIRECT)
        recvs: list[tuple[int, Piece, list[int]]] = []
        for shifts in peer_pieces(n, g, local_first=False):
            tos, frms = [(r + t) % n for t in shifts], [(r - t) % n for t in shifts]
            for c in range(k):
                for piece in _run_pieces(tos, c, k):
                    b.compute((gemm,), piece, sc.src, "send")
                sends = [Transfer(to, "send", Piece(to, c, k)) for to in tos]
                recv = [Transfer(frm, "recv", Piece(r, c, k)) for frm in frms]
                recvs.append((b.exchange(sends, recv, sequenced=SCATTER_SEQUENCE), Piece(r, c, k), frms))
        extra_terms()
        b.compute((gemm,), Piece(r), sc.src, sc.out)  # local last: covers the last sends
        for item, piece, frms in recvs:
            b.wait(item)
            for frm in frms:
                b.steps.append(Add(sc.out, "recv", piece, frm))
        return
    # ring: the block for rank d starts at d + 1, gathers one partial per hop, ends at d.
    last: dict[int, int] = {}
    for t in range(1, n):
        acc, acc_in, nxt_in = f"acc{t % 2}", f"accin{(t - 1) % 2}", f"accin{t % 2}"
        for name in (acc, nxt_in):
            b.declare(name, "scratch", w, TAG_RING)
        for c in range(k):
            piece = Piece((r - t) % n, c, k)
            b.compute((gemm,), piece, sc.src, acc)
            if t >= 2:
                b.wait(last[c])
                b.steps.append(Add(acc, acc_in, piece, (r - 1) % n))
            nxt = Piece((r - t - 1) % n, c, k)
            last[c] = b.exchange([Transfer((r + 1) % n, acc, piece)], [Transfer((r - 1) % n, nxt_in, nxt)])
    extra_terms()
    b.compute((gemm,), Piece(r), sc.src, sc.out)
    for c in range(k):
        b.wait(last[c])
        b.steps.append(Add(sc.out, f"accin{(n - 1) % 2}", Piece(r, c, k), (r - 1) % n))
