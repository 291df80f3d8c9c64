"""The overlap ops' buffers: a schedule's declared buffers (:class:`~flashpar.overlap.steps.BufferDecl`)
as tensors over a :class:`~flashpar.overlap.row_space.RowSpace`.

``Buffers(schedule, rows, dims=..., bind=...)`` allocates every declared buffer the op did not
bind (lazily where the kind says so) and resolves ``view(name, piece, peer)`` to rows; the kinds
are :data:`~flashpar.overlap.steps.BUFFER_KINDS`.  A merged piece's rows are one tensor: a ``span``
of consecutive blocks of a global-order buffer is a row range already; a lazily allocated buffer
(``per_block``, ``per_peer``) allocates a merged piece's blocks, or its run of ``peers``, as one tensor
the first time the piece is asked for, and the single blocks are views into it.  A buffer's feature count is its bound
tensor's, else ``dims[decl.width]``; its dtype ``dtypes[name]``, else ``dtype`` (mixed precision: the
ZeRO-3 backward re-gathers bf16 weight rows and reduce-scatters fp32 gradient rows).  Collectives may
land a piece elsewhere (a padded slab): ``land`` overrides the lookup.
"""

from __future__ import annotations

import torch

from flashpar.overlap.row_space import RowSpace
from flashpar.overlap.schedule import ALL, Add, Piece, Schedule

_LAZY = {"per_peer", "per_block", "scratch", "peer_slabs"}


class Buffers:
    def __init__(self, schedule: Schedule, rows: RowSpace, *, dims: dict[str, int],
                 bind: dict[str, torch.Tensor | None], dtype: torch.dtype, device: torch.device,
                 dtypes: dict[str, torch.dtype] | None = None) -> None:
        self.rows, self.rank, self.dtype, self.device = rows, schedule.rank, dtype, device
        self.dtypes = dtypes or {}
        self.chunks = schedule.chunks
        self._kind: dict[str, str] = {}
        self._t: dict[str, object] = {}
        self._local: dict[str, torch.Tensor] = {}
        self._width: dict[str, int] = {}
        self._landed: dict[tuple[str, Piece, int], torch.Tensor] = {}
        self._slabs: dict[tuple[str, int], torch.Tensor] = {}
        self._runs: dict[tuple[str, int, int], torch.Tensor] = {}  # (name, first block / peer, count): merged rows
        for decl in schedule.buffers:
            if decl.kind == "kernel":
                continue
            t = bind.get(decl.name)
            if decl.kind in ("gathered", "local") and t is None:
                raise ValueError(f"{schedule.op}: buffer {decl.name!r} ({decl.kind}) must be bound by the op")
            name, width = decl.name, (t.shape[1] if t is not None else dims[decl.width])
            self._kind[name], self._width[name] = decl.kind, width
            if decl.kind == "gathered" and schedule.world_size > 1:
                self._t[name], self._local[name] = self.empty(rows.total, width, name), t
            elif decl.kind in ("gathered", "local") or t is not None:
                self._t[name] = t
            elif decl.kind == "full":
                self._t[name] = self.empty(rows.total, width, name)
            elif decl.kind == "slabs":
                self._add_slabs(name, schedule.chunks, width)
            elif decl.kind in _LAZY:
                self._t[name] = {}
                if decl.kind == "peer_slabs":
                    self._kind[name] = "per_peer"
                    self._add_peer_slabs(name, schedule.chunks)
            else:
                raise ValueError(f"{schedule.op}: unknown buffer kind {decl.kind!r} of {name!r}")

    def empty(self, n_rows: int, width: int, name: str | None = None) -> torch.Tensor:
        """Rows for buffer ``name`` (its dtype: ``dtypes[name]``, else the op's)."""
        return torch.empty(n_rows, width, dtype=self.dtypes.get(name, self.dtype), device=self.device)

    def _add_slabs(self, name: str, chunks: int, width: int) -> None:
        """Per-slice send slabs ``{name}{c}`` of ``[N * pad_c, F]`` (padded blocks, rank-major) for
        slice-mode reduce-scatter; pieces of ``name`` land in their block's rows of slab ``c``."""
        n = len(self.rows.split_sizes)
        for c in range(chunks):
            pad = self.rows.max_chunk(c, chunks)
            slab = self._slabs[(name, c)] = self.empty(n * pad, width, name)
            for j in range(n):
                lo, hi = self.rows.rel(Piece(j, c, chunks))
                self.land(name, Piece(j, c, chunks), slab[j * pad : j * pad + hi - lo])

    def _add_peer_slabs(self, name: str, chunks: int) -> None:
        """All-to-all: the ``per_peer`` pieces ``(rank, c)`` of every peer land in one slab ``[N * rows_c, F]``
        (peer-major), so a collective sends or receives slice ``c`` without a copy."""
        n = len(self.rows.split_sizes)
        for c in range(chunks):
            piece = Piece(self.rank, c, chunks)
            lo, hi = self.rows.rel(piece)
            slab = self._slabs[(name, c)] = self.empty(n * (hi - lo), self._width[name], name)
            for j in range(n):
                self.land(name, piece, slab[j * (hi - lo) : (j + 1) * (hi - lo)], peer=j)

    def slab(self, name: str, chunk: int) -> torch.Tensor | None:
        return self._slabs.get((name, chunk))

    def kind(self, name: str) -> str:
        return self._kind[name]

    def materialize(self, name: str, chunks: int | None = None) -> torch.Tensor:
        """The ``full`` buffer ``name`` in global row order: copies in every piece (of ``chunks`` per
        block, default the schedule's) whose view lives elsewhere (the local shard, a collective's
        slab); the rest is in place."""
        full, chunks = self.tensor(name), chunks or self.chunks
        for j in range(len(self.rows.split_sizes)):
            for c in range(chunks):
                piece = Piece(j, c, chunks)
                lo, hi = self.rows.rows(piece)
                src = self.view(name, piece)
                if hi > lo and src.data_ptr() != full[lo:hi].data_ptr():
                    full[lo:hi].copy_(src)
        return full

    def _run(self, name: str, store: dict, keys: range, lengths: list[int]) -> torch.Tensor:
        """One tensor for the blocks (or peers) ``keys`` of a merged piece, allocated on its first use; each
        key's rows are a view into it."""
        run = self._runs.get((name, keys.start, len(keys)))
        if run is not None:
            return run
        apart = [key for key in keys if key in store]
        if apart:
            raise AssertionError(f"buffer {name!r}: {list(keys)} form one merged piece, but {apart} were allocated "
                                 "apart before it")
        run = self._runs[(name, keys.start, len(keys))] = self.empty(sum(lengths), self._width[name], name)
        lo = 0
        for key, length in zip(keys, lengths, strict=True):
            store[key] = run[lo : lo + length]
            lo += length
        return run

    def tensor(self, name: str) -> torch.Tensor:
        return self._t[name]  # type: ignore[return-value]

    def width(self, name: str) -> int:
        return self._width[name]

    def land(self, name: str, piece: Piece, view: torch.Tensor, peer: int = -1) -> None:
        self._landed[(name, piece, peer)] = view

    def nonempty(self, piece: Piece) -> bool:
        lo, hi = self.rows.rows(piece)
        return hi > lo

    def add(self, step: Add) -> None:
        """``dst[piece] += src[piece]`` (``src`` of the step's peer where it is per peer)."""
        self.view(step.dst, step.piece).add_(self.view(step.src, step.piece, step.peer))

    def view(self, name: str, piece: Piece, peer: int = -1, peers: int = 1) -> torch.Tensor:
        """The rows of ``piece`` in buffer ``name`` (of ``peer`` where it is per peer); ``peers > 1``: those of
        the consecutive peers ``peer .. peer + peers - 1``, ``[peers, rows, F]`` in one tensor."""
        kind, t = self._kind.get(name), self._t.get(name)
        landed = self._landed.get((name, piece, peer if kind == "per_peer" else -1))
        if landed is not None:
            return landed
        if kind in ("full", "gathered"):
            if name in self._local and piece.span > 1 and piece.block <= self.rank < piece.block + piece.span:
                raise AssertionError(f"buffer {name!r}: merged piece {piece} covers the local block, which lives apart")
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
        if kind == "per_block" and piece.span > 1:
            blocks = range(piece.block, piece.block + piece.span)
            return self._run(name, store, blocks, [self.rows.block_len(j) for j in blocks])
        if kind == "per_peer" and peers > 1:
            n = self.rows.block_len(self.rank)
            run = self._run(name, store, range(peer, peer + peers), [n] * peers)
            return run.view(peers, n, run.shape[1])[:, lo:hi]
        if key not in store:
            n = self.rows.block_len(self.rank if kind == "per_peer" else piece.block)
            if kind == "scratch":
                n = max(self.rows.block_len(j) for j in range(len(self.rows.split_sizes)))
            store[key] = self.empty(n, self._width[name], name)
        return store[key][lo:hi]
