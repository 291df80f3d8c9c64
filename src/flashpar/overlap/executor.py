"""Runs a :class:`~flashpar.overlap.schedule.Schedule` with torch.distributed.

One executor for every op and mode: the schedule says what to do, the op supplies

* *buffers*: named tensors that pieces resolve to (see :class:`Buffers`), and
* *kernels*: one function per gemm name that computes the rows of a piece,
  writing straight into its slice of the output (``torch.mm(..., out=view)``).

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashpar.dist import GroupInfo, all_gather_single, p2p_group, reduce_scatter_single
from flashpar.overlap.lane import Lane
from flashpar.overlap.schedule import ALL, Add, Collective, Compute, Exchange, Piece, Schedule, Wait


@dataclass(frozen=True)
class RowSpace:
    """Rows of a sequence-sharded 2-D view: rank ``j`` owns ``split_sizes[j]`` sequence positions,
    each ``row_width`` rows of the flattened ``[s * prod(mid_dims), features]`` matrix."""

    split_sizes: tuple[int, ...]
    row_width: int

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for s in self.split_sizes:
            out.append(acc)
            acc += s
        return tuple(out)

    @property
    def total(self) -> int:
        return sum(self.split_sizes) * self.row_width

    def block_len(self, j: int) -> int:
        return self.split_sizes[j] * self.row_width

    def rel(self, piece: Piece) -> tuple[int, int]:
        """Rows of ``piece`` relative to the start of its block."""
        s = self.split_sizes[piece.block]
        lo = s * piece.chunk // piece.chunks
        hi = s * (piece.chunk + 1) // piece.chunks
        return lo * self.row_width, hi * self.row_width

    def rows(self, piece: Piece) -> tuple[int, int]:
        """Global rows of ``piece``."""
        if piece.block == ALL:
            return 0, self.total
        lo, hi = self.rel(piece)
        base = self.offsets[piece.block] * self.row_width
        return base + lo, base + hi

    def max_chunk(self, chunk: int, chunks: int) -> int:
        return max(self.rel(Piece(j, chunk, chunks))[1] - self.rel(Piece(j, chunk, chunks))[0]
                   for j in range(len(self.split_sizes)))


class Buffers:
    """Named tensors of one call; ``view(name, piece, peer)`` resolves a piece to rows.

    Kinds (registered by the op):
    * ``full``: ``[total, F]`` in global row order; the local block may live in another
      tensor (``local=``, e.g. the input shard, so it is never copied).
    * ``local``: ``[s_r rows, F]``, pieces of this rank's block (the reduce-scatter output).
    * ``per_peer``: one ``local``-shaped tensor per peer (received partials, all-to-all pieces).
    * ``per_block``: one tensor per block, allocated on first use (partials to send).
    * ``scratch``: ``[max block rows, F]``, pieces at block-relative rows (ring accumulators).
    Collectives may land a piece elsewhere (a padded slab): ``land`` overrides the lookup.
    """

    def __init__(self, rows: RowSpace, rank: int, *, dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self.rank, self.dtype, self.device = rows, rank, dtype, device
        self._kind: dict[str, str] = {}
        self._t: dict[str, object] = {}
        self._local: dict[str, torch.Tensor] = {}
        self._width: dict[str, int] = {}
        self._landed: dict[tuple[str, int, int, int, int], torch.Tensor] = {}
        self._slabs: dict[tuple[str, int], torch.Tensor] = {}

    def empty(self, n_rows: int, width: int) -> torch.Tensor:
        return torch.empty(n_rows, width, dtype=self.dtype, device=self.device)

    def add_full(self, name: str, tensor: torch.Tensor | None, width: int, local: torch.Tensor | None = None):
        self._kind[name], self._width[name] = "full", width
        self._t[name] = tensor if tensor is not None else self.empty(self.rows.total, width)
        if local is not None:
            self._local[name] = local
        return self._t[name]

    def add_local(self, name: str, tensor: torch.Tensor) -> None:
        self._kind[name], self._t[name], self._width[name] = "local", tensor, tensor.shape[1]

    def add_lazy(self, name: str, kind: str, width: int) -> None:
        """``per_peer`` / ``per_block`` / ``scratch`` buffers, allocated when first viewed."""
        self._kind[name], self._t[name], self._width[name] = kind, {}, width

    def add_slabs(self, name: str, chunks: int, width: int) -> None:
        """Per-slice send slabs ``{name}{c}`` of ``[N * pad_c, F]`` (padded blocks, rank-major) for
        slice-mode reduce-scatter; pieces of ``name`` land in their block's rows of slab ``c``."""
        n = len(self.rows.split_sizes)
        self._width[name] = width
        for c in range(chunks):
            pad = self.rows.max_chunk(c, chunks)
            slab = self.empty(n * pad, width)
            self._t[f"{name}{c}"] = slab
            for j in range(n):
                lo, hi = self.rows.rel(Piece(j, c, chunks))
                self.land(name, Piece(j, c, chunks), slab[j * pad : j * pad + hi - lo])

    def add_peer_slabs(self, name: str, chunks: int) -> None:
        """All-to-all: the ``per_peer`` pieces ``(rank, c)`` of every peer land in one slab ``[N * rows_c, F]``
        (peer-major), so a collective sends or receives slice ``c`` without a copy."""
        n = len(self.rows.split_sizes)
        for c in range(chunks):
            piece = Piece(self.rank, c, chunks)
            lo, hi = self.rows.rel(piece)
            slab = self._slabs[(name, c)] = self.empty(n * (hi - lo), self._width[name])
            for j in range(n):
                self.land(name, piece, slab[j * (hi - lo) : (j + 1) * (hi - lo)], peer=j)

    def slab(self, name: str, chunk: int) -> torch.Tensor | None:
        return self._slabs.get((name, chunk))

    def kind(self, name: str) -> str:
        return self._kind[name]

    def materialize(self, name: str, chunks: int) -> torch.Tensor:
        """The ``full`` buffer ``name`` in global row order: copies in every piece (of ``chunks`` per
        block) whose view lives elsewhere (the local shard, a collective's slab); the rest is in place."""
        full = self.tensor(name)
        for j in range(len(self.rows.split_sizes)):
            for c in range(chunks):
                piece = Piece(j, c, chunks)
                lo, hi = self.rows.rows(piece)
                src = self.view(name, piece)
                if hi > lo and src.data_ptr() != full[lo:hi].data_ptr():
                    full[lo:hi].copy_(src)
        return full

    def tensor(self, name: str) -> torch.Tensor:
        return self._t[name]  # type: ignore[return-value]

    def width(self, name: str) -> int:
        return self._width[name]

    def land(self, name: str, piece: Piece, view: torch.Tensor, peer: int = -1) -> None:
        self._landed[(name, piece.block, piece.chunk, piece.chunks, peer)] = view

    def view(self, name: str, piece: Piece, peer: int = -1) -> torch.Tensor:
        kind, t = self._kind.get(name), self._t.get(name)
        landed = self._landed.get((name, piece.block, piece.chunk, piece.chunks, peer if kind == "per_peer" else -1))
        if landed is not None:
            return landed
        if kind == "full":
            if piece.block == self.rank and name in self._local:
                lo, hi = self.rows.rel(piece)
                return self._local[name][lo:hi]
            lo, hi = self.rows.rows(piece)
            return t[lo:hi]  # type: ignore[index]
        if piece.block == ALL:
            return t  # type: ignore[return-value]
        lo, hi = self.rows.rel(piece)
        if kind == "local":
            return t[lo:hi]  # type: ignore[index]
        key = {"per_peer": peer, "per_block": piece.block, "scratch": 0}[kind]
        store: dict = t  # type: ignore[assignment]
        if key not in store:
            n = self.rows.block_len(self.rank if kind == "per_peer" else piece.block)
            if kind == "scratch":
                n = max(self.rows.block_len(j) for j in range(len(self.rows.split_sizes)))
            store[key] = self.empty(n, self._width[name])
        return store[key][lo:hi]


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
    buffers: Buffers,
    kernels: dict[str, Kernel],
    info: GroupInfo,
    *,
    op_name: str,
    timeout_s: float,
) -> None:
    """Run ``schedule``'s steps: compute on this thread, transfers on the lane."""
    # 'none' has nothing to overlap: its collective is posted and waited for on this thread.
    threaded = buffers.device.type != "cuda" and schedule.mode != "none"
    lane = Lane(op_name, info.rank, timeout_s=timeout_s, threaded=threaded)
    skip = {"compute": (Exchange, Collective, Wait), "comm": (Compute, Add)}.get(_ONLY.get(), ())
    try:
        for step in schedule.steps:
            if isinstance(step, skip):
                continue
            if isinstance(step, Compute):
                if _nonempty(buffers.rows, step.piece):
                    kernels[step.gemm](step)
            elif isinstance(step, Wait):
                lane.wait(step.id)
            elif isinstance(step, Add):
                if _nonempty(buffers.rows, step.piece):
                    buffers.view(step.dst, step.piece).add_(buffers.view(step.src, step.piece, step.peer))
            elif isinstance(step, Exchange):
                _submit_exchange(lane, step, buffers, info)
            elif isinstance(step, Collective):
                _submit_collective(lane, step, buffers, info)
            else:  # pragma: no cover - the schedule vocabulary is closed
                raise TypeError(f"unknown step {step!r}")
        lane.close()
    except BaseException:
        lane.abort()
        raise


def _nonempty(rows: RowSpace, piece: Piece) -> bool:
    lo, hi = rows.rows(piece)
    return hi > lo


# Message channels: a send of one buffer lands in the peer's buffer of the same channel.  gloo matches
# a receive to a send by (peer, tag) in posting order; when gathers and reduce-scatters share a lane
# with different sequencing, their receives from one peer may be posted out of order, so each
# channel has its own tag.  (NCCL ignores tags; there every transfer is posted in schedule order.)
_TAGS = {"x": 1, "g": 2, "send": 3, "recv": 3, "in": 3, "out": 3, "acc0": 4, "acc1": 4, "accin0": 4, "accin1": 4}


def _submit_exchange(lane: Lane, step: Exchange, buffers: Buffers, info: GroupInfo) -> None:
    sends, recvs = [], []
    for kind, transfers, ops in ((dist.isend, step.sends, sends), (dist.irecv, step.recvs, recvs)):
        for t in transfers:
            view = buffers.view(t.buffer, t.piece, t.peer)
            if view.numel():
                src, dst = (info.rank, t.peer) if kind is dist.isend else (t.peer, info.rank)
                group = p2p_group(info, src, dst, op_name=lane.op_name, timeout_s=lane.timeout_s)
                ops.append(dist.P2POp(kind, view, info.global_rank(t.peer), group, tag=_TAGS[t.buffer]))
    what = "exchange " + ", ".join([f"send {t.buffer} to rank {t.peer}" for t in step.sends]
                                   + [f"recv {t.buffer} from rank {t.peer}" for t in step.recvs])
    if step.sequenced == "both" or not lane.threaded:
        lane.submit(step.id, functools.partial(_post_p2p, sends + recvs), what)
    else:
        in_lane, now = {"sends": (sends, recvs), "recvs": (recvs, sends), "none": ([], sends + recvs)}[step.sequenced]
        lane.submit(step.id, functools.partial(_post_p2p, in_lane), what, post_now=functools.partial(_post_p2p, now))


def _post_p2p(ops: list) -> list:
    """Post point-to-point ops (one batch where they share a group).

    The transport takes dense memory only: a send of a strided view (K/V split out of a fused
    QKV projection, a column slice) is sent from a contiguous copy made here, at post time, so
    every caller may hand it the views it holds.  Receive buffers are allocated dense by their
    callers and are written in place."""
    if not ops:
        return []
    ops = [_dense_send(op) for op in ops]
    if len({id(op.group) for op in ops}) == 1:
        return dist.batch_isend_irecv(ops)
    return [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]  # batches take one group only


def _dense_send(op: dist.P2POp) -> dist.P2POp:
    if op.op is dist.isend and not op.tensor.is_contiguous():
        return dist.P2POp(op.op, op.tensor.contiguous(), op.peer, op.group, tag=op.tag)
    if not op.tensor.is_contiguous():
        raise ValueError(f"receive buffer for rank {op.peer} is not contiguous (shape {tuple(op.tensor.shape)})")
    return op


def _submit_collective(lane: Lane, step: Collective, buffers: Buffers, info: GroupInfo) -> None:
    """Collectives over chunk ``c`` of every block; uneven blocks are padded to the largest."""
    rows, n, r = buffers.rows, info.world_size, info.rank
    c, k = step.chunk, step.chunks
    what = f"{step.kind} of {step.src} (slice {c}/{k}) over {n} ranks"
    if step.kind == "all_reduce":
        fn = functools.partial(_async, dist.all_reduce, buffers.tensor(step.src), group=info.group)
        lane.submit(step.id, fn, what)
        return
    if step.kind == "all_to_all":
        _submit_all_to_all(lane, step, buffers, info)
        return
    width = buffers.width(step.src)
    pad = rows.max_chunk(c, k)
    even = all(rows.rel(Piece(j, c, k))[1] - rows.rel(Piece(j, c, k))[0] == pad for j in range(n))
    if step.kind == "all_gather":
        if even and k == 1:
            slab = buffers.tensor(step.dst)  # rank-major gather is the global row order
            local = buffers.view(step.src, Piece(r))
        else:
            slab = buffers.empty(n * pad, width)
            local = buffers.view(step.src, Piece(r, c, k))
            if not even:
                padded = buffers.empty(pad, width)
                padded[: local.shape[0]].copy_(local)
                local = padded
            for j in range(n):
                lo, hi = rows.rel(Piece(j, c, k))
                buffers.land(step.dst, Piece(j, c, k), slab[j * pad : j * pad + hi - lo])
            if k == 1:  # 'none' on uneven blocks: compact into global row order once it has arrived
                after = functools.partial(buffers.materialize, step.dst, 1)
                fn = functools.partial(_async, all_gather_single, slab, local, group=info.group)
                lane.submit(step.id, fn, what, after_done=after)
                return
        fn = functools.partial(_async, all_gather_single, slab, local, group=info.group)
        lane.submit(step.id, fn, what)
        return
    # reduce_scatter: src is the full partial ('none') or a per-slice slab ('slice')
    out = buffers.view(step.dst, Piece(r, c, k))
    if step.src == "full" and even:
        slab = buffers.tensor("full")
    elif step.src == "full":
        slab = buffers.empty(n * pad, width)
        for j in range(n):
            lo, hi = rows.rows(Piece(j))
            slab[j * pad : j * pad + hi - lo].copy_(buffers.tensor("full")[lo:hi])
    else:
        slab = buffers.tensor(f"{step.src}{c}")
    target = out if out.shape[0] == pad else buffers.empty(pad, width)
    after = None if target is out else functools.partial(_copy_rows, out, target)
    fn = functools.partial(_async, reduce_scatter_single, target, slab, group=info.group)
    lane.submit(step.id, fn, what, after_done=after)


def _submit_all_to_all(lane: Lane, step: Collective, buffers: Buffers, info: GroupInfo) -> None:
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
        dst_slab = buffers.empty(sum(v.shape[0] for v in dst_views), buffers.width(step.dst))
        after = functools.partial(_scatter_rows, dst_views, dst_slab)
    fn = functools.partial(_async, dist.all_to_all_single, dst_slab, src_slab,
                           [v.shape[0] for v in dst_views], [v.shape[0] for v in src_views], group=info.group)
    lane.submit(step.id, fn, f"all_to_all of {step.src} (slice {c}/{k}) over {n} ranks", after_done=after)


def _scatter_rows(views: list[torch.Tensor], slab: torch.Tensor) -> None:
    lo = 0
    for v in views:
        v.copy_(slab[lo : lo + v.shape[0]])
        lo += v.shape[0]


def _async(collective, *args, group) -> list:
    return [collective(*args, group=group, async_op=True)]


def _copy_rows(out: torch.Tensor, padded: torch.Tensor) -> None:
    out.copy_(padded[: out.shape[0]])
