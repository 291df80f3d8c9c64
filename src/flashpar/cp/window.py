"""Sliding-window band math: which keys a windowed query sees, what a rank receives, which tasks it runs.

A query at global position ``q`` of a document starting at ``s`` attends the keys ``[max(s, q - W + 1), q]``:
``W`` keys counting itself (``W = 1``: itself alone).  This is the definition of Mistral, Qwen2 and transformers'
``sliding_window`` (``masking_utils.sliding_window_overlay``: key ``k`` is kept where ``k > q - W``, on top of the
causal mask).  ``W`` at least a document's length is that document's full causal attention.

Band of a query chunk ``[Q0, Q1)`` (``W = 4``, chunk of 4 queries; ``x`` attended, ``.`` masked)::

    keys        Q0-3 Q0-2 Q0-1 | Q0 Q0+1 Q0+2 Q0+3
    query Q0      x    x    x  |  x
    query Q0+1    .    x    x  |  x   x
    query Q0+2    .    .    x  |  x   x    x
    query Q0+3    .    .    .  |  x   x    x    x
                  band task      causal square (chunk <= W: nothing masked but above the diagonal)

A piece ``[a, b)`` of a document is cut into chunks of at most ``W`` queries.  Each chunk runs its causal square
(exact: no two queries of a chunk are ``W`` apart) and, per contiguous run of keys before ``Q0`` that its band
reaches (on the rank's own K/V or in what a peer sent), one task on that run alone: a ``full`` task where every
query of the chunk sees every key of the run, else a ``band`` task masked by ``0 <= qpos - kpos < W`` over the
run's slice.  Queries that reach none of a run's keys are left out of its task, so every row of a band task sees
at least one key.  Keys outside the band are never touched: the work is document-sparse and band-sparse.

Receive sets: rank ``r`` needs, of each document it holds a piece ``[a, b)`` of, the keys
``[max(s, a - W + 1), a)`` it does not hold itself (the union over the piece's queries of their windows, less its
own tokens), from the ranks holding them (:func:`window_recv`).  A plan is valid for every window: exactness
does not depend on how the planner placed the pieces.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable

import numpy as np

Run = tuple[int, int, int]  # (global start, global end, first buffer row): keys contiguous in both


def check_window(window) -> str | None:
    """Why ``window`` is not a sliding window (``None``: it is one, or ``None`` itself: full causal attention)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        return f"window must be a positive int or None, got {type(window).__name__} {window!r}"
    if window < 1:
        return f"window must be a positive int or None, got {window}"
    return None


def reach(a: int, s: int, window: int) -> int:
    """The first key any query of a piece starting at ``a`` of a document starting at ``s`` attends."""
    return max(s, a - window + 1)


def chunks(a: int, b: int, window: int) -> Iterable[tuple[int, int]]:
    """Query chunks ``[Q0, Q1)`` of at most ``window`` queries covering ``[a, b)``, in order."""
    for q0 in range(a, b, window):
        yield q0, min(b, q0 + window)


def band_task(q0: int, q1: int, k0: int, k1: int, window: int) -> tuple[int, int, int, int, bool] | None:
    """The part of queries ``[q0, q1)`` x keys ``[k0, k1)`` (global positions, keys before the queries:
    ``k1 <= q0``) inside the window: ``(q0', q1', k0', k1', full)`` with only the queries that see a key and only
    the keys some query sees; ``full``: every query sees every key (no mask needed).  None: no pair is inside."""
    k0 = max(k0, q0 - window + 1)
    q1 = min(q1, k1 + window - 1)
    if k0 >= k1 or q0 >= q1:
        return None
    return q0, q1, k0, k1, q1 - window <= k0


def band_visible(q_pos: int, k_pos: int, window: int) -> bool:
    """Whether the query at ``q_pos`` sees the key at ``k_pos`` (same document): ``0 <= q_pos - k_pos < window``."""
    return 0 <= q_pos - k_pos < window


def needed(segments, doc_starts: list[int], window: int) -> list[tuple[int, int]]:
    """Global key ranges that the queries of ``segments`` (one rank's pieces) reach under ``window`` and that the
    rank does not hold, sorted and disjoint."""
    want = []
    for a, _ in segments:
        s = doc_starts[bisect.bisect_right(doc_starts, a) - 1]
        lo = reach(a, s, window)
        if lo < a:
            want.append((lo, a))
    held = sorted(segments)
    out: list[tuple[int, int]] = []
    for x, y in _union(want):
        i = max(bisect.bisect_right(held, (x, x)) - 1, 0)
        cursor = x
        while i < len(held) and held[i][0] < y:
            a, b = held[i]
            if b > cursor:
                if a > cursor:
                    out.append((cursor, min(a, y)))
                cursor = max(cursor, b)
            i += 1
        if cursor < y:
            out.append((cursor, y))
    return out


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for x, y in sorted(ranges):
        if out and x <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], y))
        else:
            out.append((x, y))
    return out


@functools.lru_cache(maxsize=256)
def window_recv(plan, rank: int, window: int) -> tuple[tuple[int, int, int], ...]:
    """``(src_rank, start, end)`` global ranges whose K/V ``rank`` receives under ``window``, in token order (the
    windowed counterpart of ``CPPlan.kv_recv``, for every plan whatever its ``comm``); cached per (plan, rank, W)."""
    plan._check_rank(rank)
    starts, ranges = plan._owners
    out: list[tuple[int, int, int]] = []
    for x, y in needed(plan.segments[rank], plan.doc_starts, window):
        i = max(bisect.bisect_right(starts, x) - 1, 0)
        while i < len(ranges) and ranges[i][0] < y:
            a, b, r = ranges[i]
            lo, hi = max(a, x), min(b, y)
            if hi > lo and r != rank:
                if out and out[-1][0] == r and out[-1][2] == lo:
                    out[-1] = (r, out[-1][1], hi)
                else:
                    out.append((r, lo, hi))
            i += 1
    return tuple(out)


def recv_tokens(plan, window: int) -> list[int]:
    """Tokens of K/V each rank receives under ``window``."""
    return [sum(b - a for _, a, b in window_recv(plan, r, window)) for r in range(plan.cp_size)]


def send_tokens(plan, window: int) -> list[int]:
    """Tokens of K/V each rank sends under ``window`` (each rank's share of every rank's :func:`window_recv`)."""
    out = [0] * plan.cp_size
    for r in range(plan.cp_size):
        for src, a, b in window_recv(plan, r, window):
            out[src] += b - a
    return out


def pairs(x, y, window: int | None):
    """(query, key) pairs of the queries at document positions ``[x, y)`` (ints or numpy int64 arrays): each
    query at position ``p`` sees ``min(p + 1, W)`` keys (``window`` None: ``p + 1``, the causal pairs)."""
    return _prefix(y, window) - _prefix(x, window)


def _prefix(m, window: int | None):
    """Pairs of the first ``m`` queries of a document: ``m (m + 1) / 2`` up to ``W``, then ``W`` per query."""
    tri = m * (m + 1) // 2
    if window is None:
        return tri
    over = window * (window + 1) // 2 + (m - window) * window
    if isinstance(m, int):
        return tri if m <= window else over
    return np.where(m <= window, tri, over)


def reach_gaps(a, s, prev_end, window: int | None):
    """Keys a piece ``[a, b)`` of a rank receives under ``window`` beyond those its previous piece of the same
    document (ending at ``prev_end``, or ``s`` for the first) already brought: the gap
    ``[max(s, a - W + 1, prev_end), a)`` (numpy arrays; pieces of a document on a rank in token order).  Summed
    over a rank's pieces, its receive count: the union of the pieces' reaches ``[max(s, a - W + 1), b)`` less its
    own tokens."""
    lo = s if window is None else np.maximum(s, a - window + 1)
    return a - np.maximum(lo, prev_end)
