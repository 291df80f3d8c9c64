"""Schedules' vocabulary: the steps a rank runs (compute, communication, waits, additions), the rows they
address, the buffers they name, a schedule (one rank's steps and buffers) and the builder every schedule is made
with.  Pure Python: no tensors, no torch.distributed; the schedules themselves are
:func:`flashpar.overlap.schedule.build_schedule`'s.

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

Buffers
-------
Every name a step mentions is declared once, in :attr:`Schedule.buffers` (a
:class:`BufferDecl`: name, kind, width rule, message tag).  The executor allocates and
resolves buffers from it, the simulator sizes transfers from it, the ops bind their
tensors to it by name; adding a buffer is one ``declare`` in the builder below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALL = -1
"""``Piece.block`` value meaning every row of the tensor."""


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
