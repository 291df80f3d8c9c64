"""The attention kernel calls of a placement, on arrays: what the cost model charges for a rank's attention.

A rank runs, for every piece ``[a, b)`` it holds of a document starting at ``s`` (``L = b - a``;
``flashpar.cp.layout.rank_layout``'s tasks):

* the causal square ``(L, L)`` on its own K/V, and
* for every rank ``o`` holding ``h_o > 0`` tokens of the document before ``a``: a full task ``(L, h_o)`` on
  ``o``'s K/V (the rank's own where ``o`` is the rank; those keys lie in one run of that buffer where its
  pieces are in token order, as every strategy but ``torch_per_doc`` places them).

Their time needs no list of tasks: a full task takes ``fpp (L + c)(h + c) / (flops attn_peak)``
(``CostModel.full_attn_time``), so a piece's full tasks on other ranks add up to a function of their keys and
their count alone.  Per piece this module gives the keys ahead on its own rank (``own``) and the number of
ranks holding keys ahead (``holders``, its own included where ``own > 0``).

The default backend runs each phase's tasks (one key buffer) in batches, one kernel call per batch and per
direction (``flashpar.cp.kernels.make_batches``): per (buffer, kind), one per distinct pair of ladder lengths
``(padded_len(Lq), padded_len(Lk))`` (``flashpar.cp.ladder``).  So a rank makes

    calls = #{padded_len(L)} over its pieces                              causal squares, own K/V
          + #{(padded_len(L), padded_len(own))} over its pieces, own > 0   full tasks on own K/V
          + sum over other ranks o of #{(padded_len(L), padded_len(h_o))}  full tasks on o's K/V

which is ``make_batches``'s count exactly where no query piece has two runs of keys in one buffer.  The last
sum needs every (piece, holder) pair: listed where there are at most ``EXACT_TASKS`` of them (a document cut
into ``m`` pieces over ``u`` ranks makes up to ``m u``; the baselines that cut every document over every rank
make ``O(D N^2)``); beyond, the lower bound ``sum over ladder lengths of L of the most holders a piece of that
length has`` (tasks on different buffers never share a call, each buffer at least one).
``tests/test_cp_calls.py`` compares the count with ``make_batches`` on every strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashpar.cp.ladder import padded_lens

EXACT_TASKS = 1 << 16  # (piece, other holder) pairs listed one by one at most; beyond, the lower bound


@dataclass(frozen=True)
class Ahead:
    """Per piece (the input's order): the keys of its document ahead of it on its own rank, and how many ranks
    hold keys ahead of it (its own included where ``own > 0``)."""

    own: np.ndarray
    holders: np.ndarray


def ahead(rank, a, doc, length, n: int) -> Ahead:
    """:class:`Ahead` of the pieces ``[a_i, a_i + length_i)`` of documents ``doc_i`` held by ``rank_i`` (every piece
    of a document that has one among them)."""
    m = len(a)
    if m == 0:
        return Ahead(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    by_start = np.argsort(a, kind="stable")
    d, group = doc[by_start], doc[by_start] * n + rank[by_start]  # (document, rank), in start order
    # a rank joins the holders of a document's later pieces at its first piece of it
    order = np.lexsort((np.arange(m), group))  # by group, then start
    sg = group[order]
    first_sorted = np.concatenate(([True], sg[1:] != sg[:-1]))
    first = np.zeros(m, dtype=np.int64)
    first[order[first_sorted]] = 1
    joined = np.cumsum(first) - first  # groups started before each piece, over every document
    doc_first = np.searchsorted(d, d, side="left")  # the document's first piece, in start order
    holders = np.empty(m, dtype=np.int64)
    holders[by_start] = joined - joined[doc_first]
    ln = length[by_start][order]
    before = np.cumsum(ln) - ln  # tokens of the earlier sorted pieces
    own = np.empty(m, dtype=np.int64)
    own[by_start[order]] = before - before[np.maximum.accumulate(np.where(first_sorted, np.arange(m), 0))]
    return Ahead(own, holders)


def square_calls(rank, length, n: int) -> np.ndarray:
    """Per rank, the kernel calls of its causal squares (one per ladder length of its pieces)."""
    return distinct_per_rank(n, rank, padded_lens(length))


def full_calls(rank, a, doc, length, keys: Ahead, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the kernel calls of its full tasks on its own K/V and on the other ranks' (the pieces: every piece of
    a document that has one among them; ``keys``: their :func:`ahead`)."""
    pq = padded_lens(length)
    mine = keys.own > 0
    local = distinct_per_rank(n, rank[mine], pq[mine], padded_lens(keys.own[mine]))
    others = keys.holders - mine
    if int(others.sum()) <= EXACT_TASKS:
        tasks = _full_tasks(rank, a, doc, length, n)
        other = tasks.holder != rank[tasks.piece]
        piece = tasks.piece[other]
        return local, distinct_per_rank(n, rank[piece], tasks.holder[other], pq[piece], padded_lens(tasks.keys[other]))
    has = others > 0
    r, q, count = rank[has], pq[has], others[has]
    if len(r) == 0:
        return local, np.zeros(n, dtype=np.int64)
    order = np.lexsort((q, r))
    new = np.concatenate(([True], (r[order][1:] != r[order][:-1]) | (q[order][1:] != q[order][:-1])))
    most = np.maximum.reduceat(count[order], np.flatnonzero(new))
    return local, np.bincount(r[order][new], weights=most, minlength=n).astype(np.int64)


@dataclass(frozen=True)
class FullTasks:
    """Full tasks (arrays indexed by task): the query piece (its index in the input), the rank holding the keys and
    how many keys (``> 0``)."""

    piece: np.ndarray
    holder: np.ndarray
    keys: np.ndarray


def _full_tasks(rank, a, doc, length, n: int) -> FullTasks:
    """Every full task of the pieces, one per (piece, rank holding keys of its document ahead of it): each (document,
    rank) group, from its first piece on, is ahead of every later piece of the document; its tokens ahead of one by
    a search among the group's pieces."""
    m = len(a)
    empty = np.zeros(0, dtype=np.int64)
    if m < 2:
        return FullTasks(empty, empty, empty)
    by_start = np.argsort(a, kind="stable")
    d, ln = doc[by_start], length[by_start]
    group = d * n + rank[by_start]
    doc_end = np.searchsorted(d, d, side="right")  # one past the document's last piece, in start order
    key = group * m + np.arange(m)
    order = np.argsort(key, kind="stable")
    skey, sg = key[order], group[order]
    before = np.concatenate(([0], np.cumsum(ln[order])))  # tokens of the sorted pieces before sorted index j
    first = np.flatnonzero(np.concatenate(([True], sg[1:] != sg[:-1])))  # each group's first sorted index
    g_pos = order[first]  # the group's first piece, in start order
    g_count = doc_end[g_pos] - g_pos - 1  # the document's later pieces
    total = int(g_count.sum())
    if total == 0:
        return FullTasks(empty, empty, empty)
    owner = np.repeat(np.arange(len(first)), g_count)
    pos = g_pos[owner] + 1 + (np.arange(total) - np.repeat(np.cumsum(g_count) - g_count, g_count))
    g = sg[first][owner]
    j = np.searchsorted(skey, g * m + pos, side="left")  # the group's pieces before position pos end at j
    return FullTasks(by_start[pos], g % n, before[j] - before[first[owner]])


def distinct_per_rank(n: int, rank, *cols) -> np.ndarray:
    """Per rank, how many distinct rows ``cols`` has among its entries: one sort of a mixed-radix key where it fits
    in 62 bits, else of the columns; a row is new where it differs from the previous."""
    if len(rank) == 0:
        return np.zeros(n, dtype=np.int64)
    rank = np.asarray(rank, dtype=np.int64)
    cols = [np.asarray(c, dtype=np.int64) for c in cols]
    sizes = [n] + [int(c.max()) + 1 for c in cols]
    if float(np.prod(np.asarray(sizes, dtype=np.float64))) < 2.0 ** 62:
        key = rank
        for c, size in zip(cols, sizes[1:], strict=True):
            key = key * size + c
        key = np.sort(key)
        new = np.concatenate(([True], key[1:] != key[:-1]))
        return np.bincount(key[new] // int(np.prod(sizes[1:], dtype=np.int64)), minlength=n).astype(np.int64)
    order = np.lexsort((*reversed(cols), rank))
    same = np.ones(len(rank) - 1, dtype=bool)
    for c in (rank, *cols):
        sc = c[order]
        same &= sc[1:] == sc[:-1]
    new = np.concatenate(([True], ~same))
    return np.bincount(rank[order][new], minlength=n).astype(np.int64)
