"""Runs a :class:`~flashpar.overlap.schedule.Schedule` with torch.distributed.

One executor for every op, mode and exchange (the overlap ops and the K/V exchange of
``flashpar.cp.attention``): the schedule says what to do, the caller supplies

* *buffers*: a resolver of the schedule's declared buffers (:class:`BufferResolver`; the
  overlap ops' :class:`~flashpar.overlap.buffers.Buffers`, the CP exchange's
  ``flashpar.cp.exchange.KVBuffers``), and
* *kernels*: one function per gemm name that computes the rows of a piece,
  writing straight into its slice of the output (``torch.mm(..., out=view)``).

Bytes are counted here, where tensors are handed to the transport (:class:`Traffic`).

Communication goes through a :class:`~flashpar.overlap.lane.Lane`: exchanges are
``isend``/``irecv`` (batched with ``batch_isend_irecv`` where they share a group),
collectives are ``all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce``
with ``async_op=True``.  Nothing in this file blocks between posting a transfer and
the compute meant to hide it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from flashpar.dist import GroupInfo, all_gather_single, p2p_group, reduce_scatter_single
from flashpar.overlap.buffers import Buffers
from flashpar.overlap.lane import Lane
from flashpar.overlap.schedule import Add, Collective, Compute, Exchange, Piece, Schedule, Wait


@dataclass(frozen=True)
class Deferred:
    """A send payload made when the lane posts it (rows gathered, a cast), not at submission;
    ``rows`` is known up front, so both ends agree on whether the message exists."""

    rows: int
    make: Callable[[], torch.Tensor]


Payload = torch.Tensor | Deferred


class BufferResolver(Protocol):
    """What the executor asks of a schedule's buffers."""

    device: torch.device

    def view(self, name: str, piece: Piece, peer: int = -1) -> Payload: ...

    def add(self, step: Add) -> None: ...

    def nonempty(self, piece: Piece) -> bool: ...


class Traffic:
    """Bytes one run handed to the transport: ``sent`` (send payloads, as posted) and ``received``
    (receive buffers posted), summed over point-to-point messages and collectives' in/outputs."""

    def __init__(self) -> None:
        self.sent = self.received = 0
        self._lock = threading.Lock()  # posts happen on the lane's thread and the caller's

    def count(self, sent: int, received: int) -> None:
        with self._lock:
            self.sent += sent
            self.received += received


Kernel = Callable[[Compute], None]

_ONLY: contextvars.ContextVar[str | None] = contextvars.ContextVar("flashpar_overlap_only", default=None)


@contextlib.contextmanager
def only(part: str) -> Iterator[None]:
    """Benchmarks: run only the ``"compute"`` steps (no transfers) or only the ``"comm"`` steps
    (transfers of the same sizes, in the same order, no GEMMs) of every schedule in this block.
    Results are meaningless inside it; times are the compute-only / communication-only baselines."""
    if part not in ("compute", "comm"):
        raise ValueError(f"only() takes 'compute' or 'comm', got {part!r}")
    token = _ONLY.set(part)
    try:
        yield
    finally:
        _ONLY.reset(token)


def run_schedule(
    schedule: Schedule,
    buffers: BufferResolver,
    kernels: dict[str, Kernel],
    info: GroupInfo,
    *,
    op_name: str,
    timeout_s: float,
) -> Traffic:
    """Run ``schedule``'s steps: compute on this thread, transfers on the lane; returns the bytes
    handed to the transport.  Any failure aborts the lane (its unposted items are skipped)."""
    # 'none' has nothing to overlap: its collective is posted and waited for on this thread.
    threaded = buffers.device.type != "cuda" and schedule.mode != "none"
    lane = Lane(op_name, info.rank, timeout_s=timeout_s, threaded=threaded, group=info.group)
    traffic = Traffic()
    skip = {"compute": (Exchange, Collective, Wait), "comm": (Compute, Add)}.get(_ONLY.get(), ())
    try:
        for step in schedule.steps:
            if isinstance(step, skip):
                continue
            if isinstance(step, Compute):
                if buffers.nonempty(step.piece):
                    kernels[step.gemm](step)
            elif isinstance(step, Wait):
                lane.wait(step.id)
            elif isinstance(step, Add):
                if buffers.nonempty(step.piece):
                    buffers.add(step)
            elif isinstance(step, Exchange):
                _submit_exchange(lane, step, schedule, buffers, info, traffic)
            elif isinstance(step, Collective):
                _submit_collective(lane, step, buffers, info, traffic)  # type: ignore[arg-type]
            else:  # pragma: no cover - the schedule vocabulary is closed
                raise TypeError(f"unknown step {step!r}")
        lane.close()
    except BaseException:
        lane.abort()
        raise
    return traffic


@dataclass(frozen=True)
class _Message:
    send: bool
    payload: Payload
    peer: int  # global rank
    group: object
    tag: int


def _submit_exchange(lane: Lane, step: Exchange, schedule: Schedule, buffers: BufferResolver, info: GroupInfo,
                     traffic: Traffic) -> None:
    sends, recvs = [], []
    for is_send, transfers, msgs in ((True, step.sends, sends), (False, step.recvs, recvs)):
        for t in transfers:
            payload = buffers.view(t.buffer, t.piece, t.peer)
            if (payload.rows if isinstance(payload, Deferred) else payload.numel()) > 0:
                src, dst = (info.rank, t.peer) if is_send else (t.peer, info.rank)
                group = p2p_group(info, src, dst, op_name=lane.op_name, timeout_s=lane.timeout_s)
                msgs.append(_Message(is_send, payload, info.global_rank(t.peer), group, schedule.buffer(t.buffer).tag))
    what = "exchange " + ", ".join([f"send {t.buffer} to rank {t.peer}" for t in step.sends]
                                   + [f"recv {t.buffer} from rank {t.peer}" for t in step.recvs])
    post = functools.partial(_post_p2p, traffic=traffic)
    if step.sequenced == "both" or not lane.threaded:
        lane.submit(step.id, functools.partial(post, sends + recvs), what)
    else:
        in_lane, now = {"sends": (sends, recvs), "recvs": (recvs, sends), "none": ([], sends + recvs)}[step.sequenced]
        lane.submit(step.id, functools.partial(post, in_lane), what, post_now=functools.partial(post, now))


def _post_p2p(msgs: list[_Message], *, traffic: Traffic) -> list:
    """Post point-to-point messages (one batch where they share a group); counts their bytes.

    The transport takes dense memory only: a send of a strided view (K/V split out of a fused
    QKV projection, a column slice) is sent from a contiguous copy made here, at post time, so
    every caller may hand it the views it holds; a :class:`Deferred` payload is made here too.
    Receive buffers are allocated dense by their resolvers and are written in place."""
    if not msgs:
        return []
    ops = [dist.P2POp(dist.isend if m.send else dist.irecv, _tensor(m), m.peer, m.group, tag=m.tag) for m in msgs]
    traffic.count(sum(op.tensor.nbytes for op in ops if op.op is dist.isend),
                  sum(op.tensor.nbytes for op in ops if op.op is dist.irecv))
    if len({id(op.group) for op in ops}) == 1:
        return dist.batch_isend_irecv(ops)
    return [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]  # batches take one group only


def _tensor(m: _Message) -> torch.Tensor:
    t = m.payload.make() if isinstance(m.payload, Deferred) else m.payload
    if m.send and not t.is_contiguous():
        return t.contiguous()
    if not t.is_contiguous():
        raise ValueError(f"receive buffer for rank {m.peer} is not contiguous (shape {tuple(t.shape)})")
    return t


def _submit_collective(lane: Lane, step: Collective, buffers: Buffers, info: GroupInfo, traffic: Traffic) -> None:
    """Collectives over chunk ``c`` of every block; uneven blocks are padded to the largest."""
    rows, n, r = buffers.rows, info.world_size, info.rank
    c, k = step.chunk, step.chunks
    what = f"{step.kind} of {step.src} (slice {c}/{k}) over {n} ranks"
    if step.kind == "all_reduce":
        t = buffers.tensor(step.src)
        fn = functools.partial(_async, traffic, dist.all_reduce, t, t, group=info.group)
        lane.submit(step.id, fn, what)
        return
    if step.kind == "all_to_all":
        _submit_all_to_all(lane, step, buffers, info, traffic)
        return
    width = buffers.width(step.src)
    pad = rows.max_chunk(c, k)
    even = all(rows.rel(Piece(j, c, k))[1] - rows.rel(Piece(j, c, k))[0] == pad for j in range(n))
    if step.kind == "all_gather":
        if even and k == 1:
            slab = buffers.tensor(step.dst)  # rank-major gather is the global row order
            local = buffers.view(step.src, Piece(r))
        else:
            slab = buffers.empty(n * pad, width, step.dst)
            local = buffers.view(step.src, Piece(r, c, k))
            if not even:
                padded = buffers.empty(pad, width, step.src)
                padded[: local.shape[0]].copy_(local)
                local = padded
            for j in range(n):
                lo, hi = rows.rel(Piece(j, c, k))
                buffers.land(step.dst, Piece(j, c, k), slab[j * pad : j * pad + hi - lo])
            if k == 1:  # 'none' on uneven blocks: compact into global row order once it has arrived
                after = functools.partial(buffers.materialize, step.dst, 1)
                fn = functools.partial(_async, traffic, all_gather_single, slab, local, group=info.group)
                lane.submit(step.id, fn, what, after_done=after)
                return
        fn = functools.partial(_async, traffic, all_gather_single, slab, local, group=info.group)
        lane.submit(step.id, fn, what)
        return
    # reduce_scatter: src is the full partial ('none') or a per-slice slab ('slice')
    out = buffers.view(step.dst, Piece(r, c, k))
    if buffers.kind(step.src) == "full" and even:
        slab = buffers.tensor(step.src)
    elif buffers.kind(step.src) == "full":
        slab = buffers.empty(n * pad, width, step.src)
        for j in range(n):
            lo, hi = rows.rows(Piece(j))
            slab[j * pad : j * pad + hi - lo].copy_(buffers.tensor(step.src)[lo:hi])
    else:
        slab = buffers.slab(step.src, c)
    target = out if out.shape[0] == pad else buffers.empty(pad, width, step.dst)
    after = None if target is out else functools.partial(_copy_rows, out, target)
    fn = functools.partial(_async, traffic, reduce_scatter_single, target, slab, group=info.group)
    lane.submit(step.id, fn, what, after_done=after)


def _submit_all_to_all(lane: Lane, step: Collective, buffers: Buffers, info: GroupInfo, traffic: Traffic) -> None:
    """Slice ``c`` of an all-to-all: the ``src`` piece for rank ``j`` lands in rank ``j``'s ``dst``.

    A ``per_peer`` buffer's pieces are ``(rank, c)`` of peer ``j`` (see ``Buffers.add_peer_slabs``); a
    ``full`` buffer's are ``(j, c)``, contiguous in rank order only when ``chunks == 1``.  Elsewhere
    the input is copied into a slab and the output copied out of one when the slice has arrived.
    """
    n, r, c, k = info.world_size, info.rank, step.chunk, step.chunks

    def pieces(name: str) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        if buffers.kind(name) == "per_peer":
            return buffers.slab(name, c), [buffers.view(name, Piece(r, c, k), peer=j) for j in range(n)]
        views = [buffers.view(name, Piece(j, c, k)) for j in range(n)]
        return (buffers.tensor(name) if k == 1 else None), views

    src_slab, src_views = pieces(step.src)
    dst_slab, dst_views = pieces(step.dst)
    if src_slab is None:
        src_slab = torch.cat(src_views)
    after = None
    if dst_slab is None:
        dst_slab = buffers.empty(sum(v.shape[0] for v in dst_views), buffers.width(step.dst), step.dst)
        after = functools.partial(_scatter_rows, dst_views, dst_slab)
    fn = functools.partial(_async, traffic, dist.all_to_all_single, dst_slab, src_slab,
                           [v.shape[0] for v in dst_views], [v.shape[0] for v in src_views], group=info.group)
    lane.submit(step.id, fn, f"all_to_all of {step.src} (slice {c}/{k}) over {n} ranks", after_done=after)


def _scatter_rows(views: list[torch.Tensor], slab: torch.Tensor) -> None:
    lo = 0
    for v in views:
        v.copy_(slab[lo : lo + v.shape[0]])
        lo += v.shape[0]


def _async(traffic: Traffic, collective, out: torch.Tensor, inp: torch.Tensor, *args, group) -> list:
    """Post one async collective of ``inp`` into ``out`` (the same tensor for an all-reduce)."""
    traffic.count(inp.nbytes, out.nbytes)
    if collective is dist.all_reduce:
        return [collective(out, group=group, async_op=True)]
    return [collective(out, inp, *args, group=group, async_op=True)]


def _copy_rows(out: torch.Tensor, padded: torch.Tensor) -> None:
    out.copy_(padded[: out.shape[0]])
