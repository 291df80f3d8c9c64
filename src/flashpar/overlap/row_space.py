"""Row spaces: how the pieces of a schedule map to rows (pure: no torch, no torch.distributed).

Read by the executor's buffers and by the simulator, which times the same pieces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flashpar.overlap.schedule import ALL, Piece


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
        """Rows of ``piece`` relative to the start of its (first) block."""
        if piece.span > 1:  # merged blocks: whole blocks only (schedule.check_peers_per_piece)
            return 0, sum(self.split_sizes[piece.block : piece.block + piece.span]) * self.row_width
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
