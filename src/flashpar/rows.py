"""How ``total`` rows are split between ``n`` ranks: the one rule every sharded dimension of flashpar uses.

    rank p holds rows [lo_p, hi_p),  hi_p - lo_p = total // n + (1 if p < total % n else 0)

so the blocks are contiguous, in rank order, as even as possible, the larger ones first.  It serves
the sequence-parallel row blocks of the mesh model, the tensor-parallel shards of its weights (there
``total`` is divisible by ``n``), the ZeRO-3 row blocks over dp (``flashpar.models.zero``) and
``ShardedLinear``'s rows (``flashpar.overlap.sharded``).  Pure integers: no process group.
"""

from __future__ import annotations


def shard_rows(total: int, n: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``rank``: ``total // n`` each, the first ``total % n`` ranks one more."""
    base, extra = divmod(total, n)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def row_sizes(total: int, n: int) -> list[int]:
    """The number of rows of every rank, ``[hi_p - lo_p for p in range(n)]``."""
    base, extra = divmod(total, n)
    return [base + (p < extra) for p in range(n)]
