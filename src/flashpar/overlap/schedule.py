"""Schedules as data: each rank's ordered list of compute and communication steps.

Pure Python: no tensors, no torch.distributed.  ``build_schedule(op, mode, N, r)``
returns the step list that :mod:`flashpar.overlap.executor` runs and that a
simulator (:func:`flashpar.overlap.simulate.simulate`) times.  Tests check the
properties of the lists for every (N, r) in one process.

Vocabulary
----------
Rows are addressed by :class:`Piece`: chunk ``c`` of ``k`` of the sequence block
owned by rank ``block`` (``block == ALL`` means every row), or the ``span`` consecutive
blocks ``block .. block + span - 1`` of a merged piece.  Two agents run the list:

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

Buffers
-------
Every name a step mentions is declared once, in :attr:`Schedule.buffers` (a
:class:`BufferDecl`: name, kind, width rule, message tag).  The executor allocates and
resolves buffers from it, the simulator sizes transfers from it, the ops bind their
tensors to it by name; adding a buffer is one ``declare`` in the builder below.

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

OPS = ("ag_matmul", "matmul_rs", "ag_matmul_bwd", "matmul_rs_bwd", "sharded", "sharded_bwd")
A2A_OPS = ("matmul_a2a", "a2a_matmul", "matmul_a2a_bwd", "a2a_matmul_bwd")
MODES = ("flash", "ring", "slice", "none")
A2A_MODES = ("flash", "slice", "none")


@dataclass(frozen=True)
class Piece:
    """Chunk ``chunk`` of ``chunks`` of the sequence block of rank ``block`` (or ``ALL``); with ``span > 1``
    (merged pieces, whole blocks only) the consecutive blocks ``block .. block + span - 1``."""

    block: int
    chunk: int = 0
    chunks: int = 1
    span: int = 1


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

    ``peer``: the head group of an all-to-all piece (-1 elsewhere); ``peers > 1``: the head groups
    ``peer .. peer + peers - 1`` in one (batched) GEMM, ``peers`` times as wide."""

    gemm: str
    piece: Piece
    src: str
    dst: str
    peer: int = -1
    peers: int = 1


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


# Message channels: a send of one buffer lands in the peer's buffer of the same tag.  gloo matches a
# receive to a send by (peer, tag) in posting order; when gathers and reduce-scatters share a lane
# with different sequencing, their receives from one peer may be posted out of order, so each
# channel has its own tag.  (NCCL ignores tags; there every transfer is posted in schedule order.)
TAG_GATHER, TAG_GATHER_GRAD, TAG_DIRECT, TAG_RING = 1, 2, 3, 4

BUFFER_KINDS = {
    "gathered": "[S, F] in global row order; the local block is the op's own tensor (never copied)",
    "full": "[S, F] in global row order (bound by the op, else allocated)",
    "local": "[s_r, F]: this rank's block (bound by the op)",
    "per_peer": "one [s_r, F] tensor per peer, allocated on first use (a run of peers in one compute: one tensor)",
    "per_block": "one [s_j, F] tensor per block j, allocated on first use (a merged piece's blocks: one tensor)",
    "scratch": "[max s_j, F]; pieces at block-relative rows (ring accumulators)",
    "slabs": "slice-mode reduce-scatter sends: one [N pad_c, F] slab per slice c, blocks padded",
    "peer_slabs": "per_peer, slice c of every peer in one [N rows_c, F] slab (all-to-all collectives)",
    "kernel": "memory the op's kernel owns (an accumulator, a saved tensor); the executor never views it",
}
"""Buffer kinds of the overlap ops (``S`` rows of the row space, ``s_j`` those of block ``j``).  Other
executors' buffer resolvers add their own (the CP exchange: ``flashpar.cp.exchange``)."""


@dataclass(frozen=True)
class BufferDecl:
    """One buffer a schedule names: ``kind`` (how rows are laid out, :data:`BUFFER_KINDS`), ``width``
    (the shape rule: which of the op's dimensions is its feature count, e.g. ``"in"`` / ``"out"``
    of the forward weight) and ``tag`` (the message channel of its transfers, 0: never sent)."""

    name: str
    kind: str
    width: str
    tag: int = 0


@dataclass(frozen=True)
class Schedule:
    op: str
    mode: str
    world_size: int
    rank: int
    chunks: int
    steps: tuple[Step, ...] = field(repr=False)
    buffers: tuple[BufferDecl, ...] = field(default=(), repr=False)
    peers_per_piece: int = 1

    def lane_items(self) -> list[Exchange | Collective]:
        return [s for s in self.steps if isinstance(s, (Exchange, Collective))]

    def computes(self) -> list[Compute]:
        return [s for s in self.steps if isinstance(s, Compute)]

    def buffer(self, name: str) -> BufferDecl:
        """The declaration of ``name`` (KeyError naming the op if the schedule does not declare it)."""
        for decl in self.buffers:
            if decl.name == name:
                return decl
        raise KeyError(f"schedule {self.op}/{self.mode} declares no buffer {name!r}")

    def named(self) -> set[str]:
        """Every buffer name the steps mention (each must be declared)."""
        out: set[str] = set()
        for s in self.steps:
            if isinstance(s, Exchange):
                out |= {t.buffer for t in (*s.sends, *s.recvs)}
            elif isinstance(s, (Collective, Compute, Add)):
                out |= {s.src, s.dst}
        return out

    def describe(self) -> str:
        """One line per step, for printing and debugging."""
        return "\n".join(_describe(s) for s in self.steps)


def _describe(step: Step) -> str:
    def pc(p: Piece) -> str:
        if p.span > 1:
            return f"b{p.block}-{p.block + p.span - 1}"
        return "all" if p.block == ALL else f"b{p.block}.{p.chunk}/{p.chunks}"

    if isinstance(step, Exchange):
        s = ", ".join(f"{t.buffer}[{pc(t.piece)}]->r{t.peer}" for t in step.sends)
        r = ", ".join(f"{t.buffer}[{pc(t.piece)}]<-r{t.peer}" for t in step.recvs)
        return f"lane#{step.id} exchange  send {s or '-'}  recv {r or '-'}"
    if isinstance(step, Collective):
        return f"lane#{step.id} {step.kind} {step.src}->{step.dst} slice {step.chunk}/{step.chunks}"
    if isinstance(step, Compute):
        group = f" g{step.peer}" if step.peer >= 0 else ""
        group += f"-{step.peer + step.peers - 1}" if step.peers > 1 else ""
        return f"compute {step.gemm}[{pc(step.piece)}{group}] {step.src}->{step.dst}"
    if isinstance(step, Wait):
        return f"wait lane#{step.id}"
    return f"add {step.dst}[{pc(step.piece)}] += {step.src}(r{step.peer})"


class ScheduleBuilder:
    """Appends steps with fresh lane item ids and collects buffer declarations (used by every builder)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.next_id = 0
        self.decls: dict[str, BufferDecl] = {}

    def declare(self, name: str, kind: str, width: str, tag: int = 0) -> None:
        decl = BufferDecl(name, kind, width, tag)
        if self.decls.setdefault(name, decl) != decl:
            raise AssertionError(f"buffer {name!r} declared twice: {self.decls[name]} and {decl}")

    def schedule(self, op: str, mode: str, n: int, r: int, chunks: int, peers_per_piece: int = 1) -> Schedule:
        return Schedule(op, mode, n, r, chunks, tuple(self.steps), tuple(self.decls.values()), peers_per_piece)

    def exchange(self, sends: list[Transfer], recvs: list[Transfer], sequenced: str = "both") -> int:
        self.steps.append(Exchange(self.next_id, tuple(sends), tuple(recvs), sequenced))
        self.next_id += 1
        return self.next_id - 1

    def collective(self, kind: str, src: str, dst: str, chunk: int = 0, chunks: int = 1) -> int:
        self.steps.append(Collective(self.next_id, kind, src, dst, chunk, chunks))
        self.next_id += 1
        return self.next_id - 1

    def compute(self, gemms: tuple[str, ...], piece: Piece, src: str, dst: str | None = None,
                peer: int = -1, peers: int = 1) -> None:
        """``dst=None``: each gemm writes its own output buffer, named like the gemm."""
        for g in gemms:
            self.steps.append(Compute(g, piece, src, dst or g, peer, peers))

    def wait(self, item: int) -> None:
        self.steps.append(Wait(item))


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
