"""The ranks of a greedy pass by ``(load, tokens, rank)``, kept as loads change (:class:`Ranked`, the order the group
search takes ranks in)."""

from __future__ import annotations

import bisect
import operator

import numpy as np

from flashpar.cp.flashcp.arrays import floats, ints


class Ranked:
    """The ranks in ``(load, tokens, rank)`` order (the order the sub-group step takes its least-loaded ranks in),
    kept sorted as loads change: per change O(log N) comparisons and one O(N) memory move, where sorting all ranks
    at every use costs O(N log N); after many changes at once, sorted anew (on arrays).  ``keys``:
    those tuples in order; ``loads`` and ``toks``: the ranks' loads and tokens in that order, the two rows of one
    float array (tokens are integers far below 2^53: exact as floats)."""

    def __init__(self, n: int) -> None:
        self.keys = [(0.0, 0, q) for q in range(n)]
        self.cur = list(self.keys)
        self._rows(np.zeros((2, n)))
        self.toks_of, self.load_of = np.zeros(n, dtype=np.int64), np.zeros(n)  # (by rank)
        self._top_toks, self._load_sums = np.zeros(n), np.zeros(n)  # (see top_prefix, sum_prefix)

    def _rows(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.loads, self.toks = rows[0], rows[1]
        self._valid_top = self._valid_sums = 0

    def top_prefix(self, most: int) -> np.ndarray:
        """The prefix maximum of ``toks``, valid over the first ``most`` places.  Kept between calls: a change moves
        ranks only between its old and its new place, so the prefixes before both stay, and only the rest is taken
        anew (the maximum of the last valid one and the rest's own prefix maxima)."""
        v, top = self._valid_top, self._top_toks
        if v < most:
            np.maximum.accumulate(self.toks[v:most], out=top[v:most])
            if v:
                np.maximum(top[v:most], top[v - 1], out=top[v:most])
            self._valid_top = most
        return top

    def sum_prefix(self, most: int) -> np.ndarray:
        """The prefix sum of ``loads`` (``np.cumsum``'s sums: ``np.add.accumulate``, in order), valid over the first
        ``most`` places; kept as :meth:`top_prefix` (a running sum continued from its last valid value is the same
        sum)."""
        v, sums = self._valid_sums, self._load_sums
        if v < most:
            if v == 0:
                np.add.accumulate(self.loads[:most], out=sums[:most])
            else:
                sums[v:most] = self.loads[v:most]
                np.add.accumulate(sums[v - 1:most], out=sums[v - 1:most])  # (from the last valid sum on)
            self._valid_sums = most
        return sums

    def update(self, q: int, load: float, toks: int) -> None:
        old, new = self.cur[q], (load, toks, q)
        if old == new:
            return
        keys = self.keys
        i = bisect.bisect_left(keys, old)
        del keys[i]
        # (the keys before i are below old, those from i on above it: the search for new starts on its side of i)
        j = bisect.bisect_left(keys, new, i) if new > old else bisect.bisect_left(keys, new, 0, i)
        keys.insert(j, new)
        self.cur[q] = new
        lo = i if i < j else j
        if lo < self._valid_top:
            self._valid_top = lo
        if lo < self._valid_sums:
            self._valid_sums = lo
        loads, toks_row = self.loads, self.toks  # (the rows, one at a time: cheaper than both as one 2-d slice)
        if j > i:  # (overlapping slices: numpy copies as if through a buffer)
            loads[i:j] = loads[i + 1:j + 1]
            toks_row[i:j] = toks_row[i + 1:j + 1]
        elif j < i:
            loads[j + 1:i + 1] = loads[j:i]
            toks_row[j + 1:i + 1] = toks_row[j:i]
        loads[j], toks_row[j] = load, toks
        self.toks_of[q], self.load_of[q] = toks, load

    def update_many(self, ranks, load, toks) -> None:
        if len(ranks) <= 64:
            for q in ranks:
                self.update(q, load[q], toks[q])
            return
        cur, lv, tv = self.cur, self.load_of, self.toks_of
        get = operator.itemgetter(*ranks)
        new_load, new_toks = get(load), get(toks)
        for q, x, t in zip(ranks, new_load, new_toks, strict=True):
            cur[q] = (x, t, q)
        at = ints(ranks)  # (the same values, written at once)
        lv[at], tv[at] = floats(new_load), ints(new_toks)
        at = np.argsort(lv, kind="stable")  # (equal loads: by rank; by tokens first where any are equal)
        if (lv[at[1:]] == lv[at[:-1]]).any():
            at = np.lexsort((tv, lv))
        self.keys = list(operator.itemgetter(*at.tolist())(cur))  # (cur's tuples in that order)
        lv_at, tv_at = lv[at], tv[at]
        self._rows(np.stack((lv_at, tv_at.astype(np.float64))))

    def ranks(self) -> list[int]:
        return [key[2] for key in self.keys]

    def first_with_room(self, most: int) -> int:
        """The first rank in order with at most ``most`` tokens, or -1."""
        room = self.toks <= most
        at = int(room.argmax())
        return self.keys[at][2] if room[at] else -1

