"""The Whole-Doc documents of one rank, per length, for the refinement that moves and swaps whole documents
(:func:`flashpar.cp.flashcp.refine.refine`)."""

from __future__ import annotations

import bisect
import collections

import numpy as np

from flashpar.cp.flashcp.arrays import floats, ints


class RankDocs:
    """The Whole-Doc documents of one rank for ``refine.refine``: per length it holds, its documents of that length
    in the order it received them (``doc_seq``), and as lists (lengths ascending; compute; place in the rank's order
    of the first document of each length), which :func:`refine.best_move` reads.  ``docs``: the rank's documents
    by (length, place); ``heads``: where each length's begin there.  The queue of a length is made when a move first
    touches it (moves are few, lengths many).  ``rising``: the compute rises with the length over all lengths (then
    over any rank's too); ``work``: the compute of each of ``lens``, where the caller has it."""

    def __init__(self, docs, lens: list[int], first: list[int], heads: list[int], whole: dict[int, float],
                 rising: bool = False, work: list[float] | None = None) -> None:
        self.docs, self.lens, self.first, self.whole, self.rising = docs, lens, first, whole, rising
        self.work = [whole[x] for x in lens] if work is None else work
        # (the lengths first held, ascending, and where each begins in docs: a length's documents until its queue is
        # made, which happens at most once per such length, as a length that leaves and comes back gets a new queue)
        self._heads = (list(lens), heads)
        self.queues: dict[int, collections.deque] = {}
        self._arrays = self._other = None

    @staticmethod
    def all_ranks(whole, n: int, doc_rank, lens_np, doc_seq, seq_end: int, work: dict[int, float],
                  in_order: bool = False, rising: bool = False, doc_work=None):
        """``r -> RankDocs`` of every rank ``r`` (made when first called) of the documents ``whole``, in one sort
        of all of them by (rank, length, place): the places are distinct and below ``seq_end``, so documents by
        place come from one scatter, then two stable sorts (of small integers: radix sorts) by length, then rank (one,
        by ``rank (longest + 1) + length``, where that fits in 16 bits).  ``in_order``: among documents of one length
        the places rise with the index (a pass places them so: longest first, then by index), so ``whole`` (by
        index) needs no scatter.  ``doc_work``: each document's compute (``work`` of its length), where the caller has
        it."""
        if in_order:
            docs = whole
        else:
            by_seq = np.full(seq_end, -1, dtype=np.int64)
            by_seq[doc_seq[whole]] = whole
            docs = by_seq[by_seq >= 0]
        if len(docs) != len(whole):  # (places not distinct: no pass gives such)
            docs = whole[np.lexsort((doc_seq[whole], lens_np[whole], doc_rank[whole]))]
        else:
            ln = lens_np[docs]
            span = int(ln.max()) + 1
            if span * n <= 1 << 15:  # (both in 16 bits: one radix sort by rank span + length)
                key = (doc_rank[docs] * span + ln).astype(np.int16)
                docs = docs[np.argsort(key, kind="stable")]
            else:
                for key in (lens_np, doc_rank):
                    k = key[docs]
                    docs = docs[np.argsort(k.astype(np.int16) if int(k.max()) < 1 << 15 else k, kind="stable")]
        rk, ln = doc_rank[docs], lens_np[docs]
        heads = np.flatnonzero(np.concatenate(([True], (rk[1:] != rk[:-1]) | (ln[1:] != ln[:-1]))))
        offsets = np.searchsorted(rk, np.arange(n + 1))
        doc_off = offsets.tolist()
        head_off = np.searchsorted(heads, offsets).tolist()
        # per length each rank holds (all ranks at once): the length, its first place, where it begins in the rank's
        head_len, head_first = ln[heads].tolist(), doc_seq[docs[heads]].tolist()
        head_at = (heads - offsets[rk[heads]]).tolist()  # documents
        # (each length's compute: the documents' own, where given, else looked up per length)
        head_work = doc_work[docs[heads]].tolist() if doc_work is not None else [work[x] for x in head_len]
        made: dict[int, RankDocs] = {}

        def of_rank(r: int) -> RankDocs:
            if r not in made:
                h0, h1 = head_off[r], head_off[r + 1]
                made[r] = RankDocs(docs[doc_off[r]:doc_off[r + 1]], head_len[h0:h1], head_first[h0:h1],
                                    head_at[h0:h1], work, rising, head_work[h0:h1])
            return made[r]

        return of_rank

    def arrays(self):
        """(lengths ascending, compute, place of the first document of each length) as arrays (made once per
        change): views of :meth:`other_arrays` past its first."""
        if self._arrays is None:
            ol, ow, oj, _ = self.other_arrays()
            self._arrays = ol[1:], ow[1:], oj[1:]
        return self._arrays

    def other_arrays(self):
        """:meth:`arrays` as the least busy rank's, with nothing first (length 0, compute 0, place -1), and
        whether the compute rises along them (where it rises over all lengths, so over these: no compute is below 0)."""
        if self._other is None:
            work = floats([0.0, *self.work])
            self._other = (ints([0, *self.lens]), work, ints([-1, *self.first]),
                           self.rising or bool((work[1:] >= work[:-1]).all()))
        return self._other

    def _queue(self, length: int) -> collections.deque:
        if length not in self.queues:  # (a length first held, not touched before)
            lens0, heads = self._heads
            i = bisect.bisect_left(lens0, length)
            lo, hi = heads[i], (heads[i + 1] if i + 1 < len(heads) else len(self.docs))
            q = self.docs[lo:hi]
            self.queues[length] = collections.deque(q if isinstance(q, list) else q.tolist())
        return self.queues[length]

    def pop_first(self, length: int, doc_seq) -> int:
        """The first document of ``length`` (it leaves)."""
        q = self._queue(length)
        doc = q.popleft()
        i = bisect.bisect_left(self.lens, length)
        if q:  # (the lengths stay: only the place of the length's first document changes, in the arrays too)
            self.first[i] = at = int(doc_seq[q[0]])
            if self._arrays is not None:
                self._arrays[2][i] = at
            if self._other is not None:
                self._other[2][i + 1] = at
        else:
            del self.queues[length], self.lens[i], self.work[i], self.first[i]
            self._arrays = self._other = None
        return doc

    def append(self, length: int, doc: int, at: int) -> None:
        """``doc`` of ``length`` arrives, received at ``at`` (after all this rank holds)."""
        i = bisect.bisect_left(self.lens, length)
        if i < len(self.lens) and self.lens[i] == length:  # (last of its length: the options stay)
            self._queue(length).append(doc)
            return
        self._arrays = self._other = None
        self.lens.insert(i, length)
        self.work.insert(i, self.whole[length])
        self.first.insert(i, at)
        self.queues[length] = collections.deque([doc])

