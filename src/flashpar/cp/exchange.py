"""The K/V exchange of context-parallel attention as schedules for the overlap executor.

:func:`kv_schedule` is pure (a :class:`~flashpar.cp.layout.RankLayout` in, a
:class:`~flashpar.overlap.schedule.Schedule` out, testable in one process); the steps run on
:func:`flashpar.overlap.executor.run_schedule`, the same lane machinery as the overlap ops, with
:class:`KVBuffers` resolving the buffers and the attention kernels as compute items
(``attn`` / ``attn_bwd`` on the K/V of block ``o``: the tasks of phase ``(r - o) mod N``).

Forward, exchange ``j`` (1 .. N-1) brings rank ``r`` the K/V originating at ``o = r - j``:
``p2p`` / ``allgather`` from ``o`` itself (``p2p``: only the rows ``r`` needs, gathered when the
lane posts the send), ``ring`` from ``r - 1``, which forwards what it received at ``j - 1``.
Local first, N = 3, rank r (``KV_o``: K and V of block o)::

    p2p / allgather   lane:  | KV_r -> r+1, KV_{r-1} <- r-1 | KV_r -> r+2, KV_{r-2} <- r-2 |
                      main:  | attn on KV_r (local)         | attn on KV_{r-1}            | attn on KV_{r-2}
    ring              lane:  | KV_r -> r+1, KV_{r-1} <- r-1 | KV_{r-1} -> r+1, KV_{r-2} <- r-1 |
                      main:  | attn on KV_r (local)         | attn on KV_{r-1}                 | attn on KV_{r-2}

Backward, remote first: the gradient ``dKV_o`` of each received block is computed first and
returned while the rest computes; the local block's tasks cover the tail:

* ``p2p`` / ``allgather``: exchange ``j`` returns ``dKV_{r-j}`` to ``r - j`` and receives from
  ``r + j`` the gradient of the rows ``r`` sent there (a reduce-scatter as transfers), added
  into ``dK`` / ``dV`` at those rows;
* ``ring``: a ring reduce-scatter.  Exchange ``j`` sends to ``r + 1`` the running sum for block
  ``r - j`` (this rank's share plus the sum received at ``j - 1``); after ``N - 1`` exchanges
  every block's sum arrives at its owner.

::

    p2p       lane:                | dKV_{r-1} -> r-1, <- r+1 |           | dKV_{r-2} -> r-2, <- r+2 |
              main:  | dKV_{r-1}   | dKV_{r-2}                | dKV_r (local)                        | + received rows
    ring      lane:                | dKV_{r-1} -> r+1, <- r-1 |           | sum_{r-2} -> r+1, sum_r <- r-1 |
              main:  | dKV_{r-1}   | dKV_{r-2} + sum received  | dKV_r (local)                       | + sum_r

Bytes are counted by the executor where it hands tensors to the transport (``CommCounter``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flashpar.cp.layout import RankLayout
from flashpar.overlap.executor import Deferred, Traffic
from flashpar.overlap.schedule import Add, Piece, Schedule, ScheduleBuilder, Transfer

TAG_K, TAG_V = 21, 22
KV_KINDS = {
    "kv": "K or V of block o: the rank's own (send rows per peer) or the buffer received from o",
    "kv_grad": "gradient of K or V of block o, accumulated here (the own block: dK / dV)",
    "kv_recv_grad": "a received gradient of block o from one peer (the own block: rows sent to that peer)",
}
"""Buffer kinds of the exchange schedules (resolved by :class:`KVBuffers`)."""


@dataclass
class CommCounter:
    """Bytes this rank handed to the transport, per direction (accumulates over calls)."""

    fwd_sent: int = 0
    bwd_sent: int = 0
    fwd_recv: int = 0
    bwd_recv: int = 0

    def add(self, direction: str, traffic: Traffic) -> None:
        setattr(self, f"{direction}_sent", getattr(self, f"{direction}_sent") + traffic.sent)
        setattr(self, f"{direction}_recv", getattr(self, f"{direction}_recv") + traffic.received)


def kv_schedule(layout: RankLayout, direction: str) -> Schedule:
    """The exchange of ``layout.rank`` in ``direction`` (``"forward"``: K/V out, ``"backward"``: dK/dV
    back), for its pattern (``p2p``, ``allgather``, ``ring``).  The steps depend only on (pattern, N, rank):
    built once per such triple (every layer and step reuses them; a schedule is immutable)."""
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    return _kv_schedule(layout.pattern, layout.n, layout.rank, direction)


@functools.lru_cache(maxsize=256)
def _kv_schedule(pattern: str, n: int, r: int, direction: str) -> Schedule:
    ring = pattern == "ring"
    b = ScheduleBuilder()
    b.declare("k", "kv", "kv", TAG_K)  # the compute items' source: the K/V of their block
    if direction == "forward":
        b.declare("v", "kv", "kv", TAG_V)
        b.declare("out", "kernel", "q")
        items = []
        for j in range(1, n):
            o = (r - j) % n
            to, frm, held = ((r + 1) % n, (r - 1) % n, (o + 1) % n) if ring else ((r + j) % n, o, r)
            items.append((b.exchange(_kv(to, "k", "v", held), _kv(frm, "k", "v", o)), o))
        b.compute(("attn",), Piece(r), "k", "out")  # local first: needs no communication
        for item, o in items:
            b.wait(item)
            b.compute(("attn",), Piece(o), "k", "out")
        return b.schedule("kv_forward", pattern, n, r, 1)
    for name, kind, tag in (("gk", "kv_grad", TAG_K), ("gv", "kv_grad", TAG_V), ("rk", "kv_recv_grad", TAG_K),
                            ("rv", "kv_recv_grad", TAG_V)):
        b.declare(name, kind, "kv", tag)
    returns = []
    for j in range(1, n):  # remote K/V first: its gradient travels while the rest computes
        o = (r - j) % n
        b.compute(("attn_bwd",), Piece(o), "k", "gk")
        if ring and j > 1:  # add the running sum for block o that rank r - 1 sent at step j - 1
            b.wait(returns[-1][0])
            _add_grads(b, Piece(o), (r - 1) % n)
        to, frm, arriving = ((r + 1) % n, (r - 1) % n, (r - j - 1) % n) if ring else (o, (r + j) % n, r)
        returns.append((b.exchange(_kv(to, "gk", "gv", o), _kv(frm, "rk", "rv", arriving)), frm))
    b.compute(("attn_bwd",), Piece(r), "k", "gk")  # the local tasks cover the tail
    for item, frm in returns[-1:] if ring else returns:  # ring: only the last exchange brings own rows
        b.wait(item)
        _add_grads(b, Piece(r), frm)
    return b.schedule("kv_backward", pattern, n, r, 1)


def _kv(peer: int, k: str, v: str, block: int) -> list[Transfer]:
    return [Transfer(peer, k, Piece(block)), Transfer(peer, v, Piece(block))]


def _add_grads(b: ScheduleBuilder, piece: Piece, peer: int) -> None:
    b.steps.append(Add("gk", "rk", piece, peer))
    b.steps.append(Add("gv", "rv", piece, peer))


class KVBuffers:
    """The exchange's buffers for :func:`flashpar.overlap.executor.run_schedule`.

    ``blocks``: K/V by block (``-1``: the own, else the origin rank), the forward's receive buffers
    allocated (zeroed) here unless ``received`` passes them on to the backward.  ``grads``:
    backward only, the gradient accumulators by block (the own block's are dK / dV); they travel
    cast to ``k.dtype``.  ``send_rows``: ``layout.send_rows`` already on ``k``'s device (a
    :class:`~flashpar.cp.layout.DeviceLayout`'s); omitted, they are copied there.
    """

    def __init__(self, layout: RankLayout, k: torch.Tensor, v: torch.Tensor, *,
                 received: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 grads: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 send_rows: tuple[torch.Tensor | None, ...] | None = None) -> None:
        self.layout, self.device, self.wire = layout, k.device, k.dtype
        if received is None:
            received = {o: tuple(x.new_zeros((layout.recv_tokens(o), *x.shape[1:])) for x in (k, v))
                        for o in range(layout.n) if o != layout.rank}
        self.blocks = {-1: (k, v), **received}
        self.grads = grads or {}
        self._recv_grads: dict[tuple[str, int, int], torch.Tensor] = {}
        if send_rows is None:
            send_rows = tuple(None if rows is None else rows.to(k.device) for rows in layout.send_rows)
        self._rows = send_rows

    def key(self, block: int) -> int:
        """The key of block ``block`` in ``blocks`` / ``grads`` (``-1``: this rank's own)."""
        return -1 if block == self.layout.rank else block

    def view(self, name: str, piece: Piece, peer: int = -1):
        lo, o = self.layout, piece.block
        if name in ("k", "v"):
            t = self.blocks[self.key(o)][name == "v"]
            rows = self._rows[peer] if o == lo.rank else None
            return t if rows is None else Deferred(rows.numel(), functools.partial(t.index_select, 0, rows))
        if name in ("gk", "gv"):
            g = self.grads[self.key(o)][name == "gv"]
            return Deferred(g.shape[0], functools.partial(g.to, self.wire))
        key = (name, o, peer)
        if key not in self._recv_grads:
            like = self.blocks[-1][0]
            self._recv_grads[key] = like.new_empty((lo.held_rows(o, peer), *like.shape[1:]))
        return self._recv_grads[key]

    def add(self, step: Add) -> None:
        """``grad[block][rows for peer] += received`` (the own block: the rows sent to ``peer``)."""
        dst = self.grads[self.key(step.piece.block)][step.dst == "gv"]
        src = self.view(step.src, step.piece, step.peer)  # allocated by its receive (compute-only runs: here)
        rows = self._rows[step.peer] if step.piece.block == self.layout.rank else None
        add_rows(dst, rows, src)

    def nonempty(self, piece: Piece) -> bool:
        return True  # a phase without tasks is an empty loop


def add_rows(dst: torch.Tensor, rows: torch.Tensor | slice | None, src: torch.Tensor) -> None:
    """``dst[rows] += src`` in ``dst``'s dtype (``rows``: indices, a slice, or None for every row);
    repeated indices sum (padded kernel batches may repeat keys)."""
    if rows is None or isinstance(rows, slice):
        dst[rows if rows is not None else slice(None)] += src.to(dst.dtype)
    else:
        dst.index_add_(0, rows, src.to(dst.dtype))
