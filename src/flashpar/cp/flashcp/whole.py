"""The Whole-Doc step of a greedy pass, in the forms that place many documents at once: a run of documents of one
length in one sort (:meth:`WholeDocStep._batch_whole`), the rank of least key among those a document fits once many
full ranks sit at the top of the heap (:meth:`WholeDocStep._fitting`), and the state where the first pass of force 0
stopped keying ranks by tokens alone (:class:`Prefix`), from which later passes start.

A rank's key is ``(max(load / limit, tokens / cap), load, rank)``: the Whole-Doc step puts each document on the fitting
rank of least key (the most room left in both work and tokens)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flashpar.cp.flashcp.arrays import floats, ints
from flashpar.cp.flashcp.work import DocWork

BATCH = 16
"""Documents of one length in a row from which the Whole-Doc step places them in one sort (``_batch_whole``)
rather than one by one (the same placement; only faster)."""
SKIP_MAX = 24
"""Full ranks met at the top of the Whole-Doc heap after which the step searches all ranks at once (the same rank)."""


@dataclasses.dataclass(frozen=True)
class Prefix:
    """Where the first greedy pass of force 0 stopped keying every rank by its tokens alone: its state
    before document ``k`` of pass order (loads, tokens, the heap, the runs placed in one sort, the ranks and places of
    the documents placed one by one), and its ``limit``.

    Up to there every rank's key ``max(load / limit, tokens / cap)`` was ``tokens / cap`` (checked at each change:
    ``load / limit <= tokens / cap``, in every slot of a run placed at once) and every document went whole onto the
    first rank by key that fit both bounds (the top of the heap, or every slot of a run fit).  A pass of force 0 with
    a limit no lower divides by a larger limit (``load / limit'`` is no larger: rounded division is monotone), so its
    keys are the same floats, the same ranks fit it (``limit' - w >= limit - w``), and it takes the same steps: it
    starts here (``share`` and sub-groups only matter for documents no rank fits whole, which come after)."""

    limit: float
    k: int
    seq: int
    load: list[float]
    toks: list[int]
    heap: list[tuple]
    runs: list[tuple]
    rank: np.ndarray
    seq_of: np.ndarray



class WholeDocStep(DocWork):
    """The Whole-Doc step's forms over many documents or ranks at once (see the module docstring)."""

    def _fitting(self, lv, tv, limit: float, tok_room: int, work_room: float) -> int:
        """The rank of least key ``(max(load / limit, tokens / cap), load, rank)`` among those with
        ``tokens <= tok_room`` and ``load <= work_room``; -1 if none (``lv``, ``tv``: every rank's load and tokens,
        float64 and int64 arrays)."""
        ok = np.flatnonzero((tv <= tok_room) & (lv <= work_room))
        if not len(ok):
            return -1
        key0 = np.maximum(lv[ok] / limit, tv[ok] / self.cap)
        return int(ok[np.lexsort((ok, lv[ok], key0))[0]])


    def _batch_whole(self, lo: int, hi: int, length: int, w: float, load, toks, limit: float, tracking: bool = False,
                     rooms=None):
        """Documents ``order[lo:hi]`` (all of ``length`` tokens and compute ``w``, in pass order) placed whole as the
        one-by-one step places them, as far as they fit: returns (the ranks of those placed, in order; the ranks
        changed), or None where the first fits nowhere (``load`` and ``toks`` updated; the caller records the
        documents' ranks and places).

        Rank ``r`` after taking ``j`` of them has load ``l_r + w + ... + w`` (added one by one, as the step adds)
        and ``t_r + j L`` tokens; its ``j``-th slot fits while both stay within ``limit - w`` and ``cap - L``,
        and the step takes each document onto the fitting rank of least key ``(max(load / limit, tokens / cap),
        load, rank)``.  A rank's keys rise with ``j`` and its fitting slots are a prefix, so the documents go to
        the ``hi - lo`` least keys of all fitting slots, in key order: one sort.  Slots per rank are tried up
        to ``m`` (doubled while some rank took all of its ``m`` and more might follow).

        A third item: whether every slot fit within both bounds and was keyed by its tokens alone (``load / limit <=
        tokens / cap``), as in a pass with any higher limit (see :class:`Prefix`; looked at only with ``tracking``).
        ``rooms``: ``load`` and ``toks`` as float64 and int64 arrays, where the caller keeps them (the same values)."""
        n, cap, k = self.n, self.cap, hi - lo
        same = True
        l0, t0 = rooms if rooms is not None else (floats(load), ints(toks))
        most_toks = int(np.maximum.reduce(t0))
        m = min(k, 2 * -(-k // n) + 2, self._slots_needed(k, length, w, l0, t0, limit))
        while True:
            # slots 0..m of each rank, slot m too (the rows then ravel as views): it follows slot m - 1 in key and in
            # place, so it is among the least keys only where its rank took all its first m, where m doubles anyway
            width = m + 1
            lt = np.empty((n, width))
            lt[:, 1:] = w
            lt[:, 0] = l0
            np.add.accumulate(lt, axis=1, out=lt)  # sequential (cumsum): lt[r, j] = load after j more documents
            ls, ts = lt.ravel(), (t0[:, None] + length * np.arange(width, dtype=np.int64)).ravel()
            # every slot fits where each rank's last does (loads and tokens rise along a row): then no selection
            every = most_toks + m * length <= cap - length and (
                limit == math.inf or np.maximum.reduce(lt[:, m]) <= limit - w)
            same = same and every
            if every:
                if limit < math.inf:
                    by_load, by_toks = ls / limit, ts / cap
                    key0 = np.maximum(by_load, by_toks)
                    if tracking and same:
                        same = not np.logical_or.reduce(by_load > by_toks)
                else:
                    key0 = ts / cap
                # (by key, then load, then rank: the slots run by rank, and lexsort is stable)
                take = np.lexsort((ls, key0))[:k]
            else:
                if limit < math.inf:
                    ok = ((ts <= cap - length) & (ls <= limit - w)).nonzero()[0]
                    lv = ls[ok]
                    key0 = np.maximum(lv / limit, ts[ok] / cap)
                else:  # (no work bound: every load fits, and every load / limit is 0)
                    ok = (ts <= cap - length).nonzero()[0]
                    lv = ls[ok]
                    key0 = ts[ok] / cap
                take = ok[np.lexsort((lv, key0))[:k]]  # (as above: ``ok`` runs by rank)
            ranks = take // width
            counts = np.bincount(ranks, minlength=n)
            if m >= k or np.maximum.reduce(counts) < m:  # (no rank took all its first m slots)
                break
            m = min(k, 2 * m)
        if not len(take):
            return None
        changed = np.flatnonzero(counts)
        at = changed * width + counts[changed]
        changed = changed.tolist()
        for r, x, t in zip(changed, ls[at].tolist(), ts[at].tolist(), strict=True):
            load[r], toks[r] = x, t
        return ranks, changed, same

    def _slots_needed(self, k: int, length: int, w: float, load, toks, limit: float) -> int:
        """About the most documents of a run of ``k`` that one rank takes in :meth:`_batch_whole` (where fewer than
        this were tried, the search doubles them: this only saves slots).  Where rank ``r`` takes ``c`` of them, its
        slot ``c - 1`` is among the ``k`` least keys, and so is every slot of another rank ``s`` of lower key: every
        ``j`` with ``t_s + j L < t_r + (c - 1) L`` and ``l_s + j w < l_r + (c - 1) w`` (its tokens and its load both
        lower), at least ``c - 1 - S`` of them, ``S`` the spread of tokens over ``L`` or of loads over ``w``.  So
        ``c + (N - 1)(c - 1 - S) <= k``: ``c <= (k + (N - 1)(1 + S)) / N``; one slot more for rounding.  ``load``,
        ``toks``: every rank's, as float64 and int64 arrays."""
        spread = (int(np.maximum.reduce(toks)) - int(np.minimum.reduce(toks))) / length
        if limit < math.inf and w > 0:
            spread = max(spread, (float(np.maximum.reduce(load)) - float(np.minimum.reduce(load))) / w)
        n = self.n
        return math.ceil((k + (n - 1) * (2 + spread)) / n) + 1

