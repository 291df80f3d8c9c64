"""Where a document that fits whole on no rank goes: the smallest head-tail group of the least-loaded ranks that keeps
every member under the work and token bounds (:meth:`GroupSearch._group`), or, where no group does, unequal parts over
the fewest ranks whose room holds it, all filled to one level of compute (:meth:`GroupSearch._fill`).

Group sizes tried: every size up to 8, then about 1.25x apart, and ``N`` itself (Per-Doc)::

    2 3 4 5 6 7 8 10 13 17 22 28 ... N
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from flashpar.cp.flashcp.arrays import floats, ints
from flashpar.cp.flashcp.ranks import Ranked
from flashpar.cp.flashcp.work import DocWork

FILL_MARGIN = 0.02
"""Room the members of an unequal split must have beyond the document (cut pieces run less efficiently)."""


class GroupSearch(DocWork):
    """The group-size search and the unequal fill over the documents of :class:`DocWork`; ``peak_share``: the largest
    share of the mean compute any member of a split took since it was last set to 0 (a pass sets it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peak_share = 0.0
        self._top: dict[tuple[int, int], float] = {}  # per (length, g): the largest of the shares
        self.sizes_np = np.asarray(self.sizes, dtype=np.int64)
        self._last_np = self.sizes_np - 1  # (the last member of a group of each size)
        self._fewest: dict[int, tuple] = {}  # per length: the room _group's members need, per size
        self._sizes_at = (math.nan, None)  # (a limit, g times it for every size g)

    def _group(self, length: int, ranked: Ranked, limit: float, share: float) -> list[int] | None:
        """The smallest head-tail group (of ``self.sizes`` least-loaded ranks, ``ranked`` order) whose members all stay
        under ``limit`` and the token cap, each taking at most ``share`` of a rank's mean compute.

        Only sizes up to the number of ranks under ``limit`` can fit (the ranks are by load).  A size is passed over
        at once, before its shares are looked up, where the fullest member (by tokens, a prefix maximum) has no room
        for the fewest tokens any member takes (``2 floor(L / 2g)``: each chunk holds at least ``floor(L / 2g)``),
        where the least loaded rank has no room for the first member's (chunks ``0`` and ``2g - 1``), or where the
        members' room under ``limit`` (``g limit - sum of their loads``, a prefix sum) is less than the document's
        compute whole: the members' shares add up to at least that (the same causal pairs, in pieces no longer than
        the document, which run no more efficiently; a millionth of it, and a billionth of ``g limit``, spare for
        rounding)."""
        # a member's share is about whole / g (a little more: cut pieces run less efficiently)
        whole = self.whole(length)
        first = max(2, min(self.n, math.ceil(whole / (share * self.mean)))) if share < math.inf else 2
        keys, sizes, cap = ranked.keys, self.sizes, self.cap
        lo = bisect.bisect_left(sizes, first)
        hi = bisect.bisect_right(sizes, bisect.bisect_left(keys, (limit,)))  # (limit,): below every key at limit
        if lo >= hi:
            return None
        most = sizes[hi - 1]  # (the members' room grows with g: every rank up to here is under the limit)
        at = self._last_np[lo:hi]  # (the last member of each size)
        per_size = self._fewest.get(length)  # the most tokens a rank may hold to take the fewest tokens a member
        if per_size is None:  # takes, and to take the first member's, per size
            two = 2 * self.sizes_np
            per_size = self._fewest[length] = (cap - 2 * (length // two),
                                               cap - (length // two + length - length * (two - 1) // two))
        fewest_room, first_room = per_size
        top_toks = ranked.top_prefix(most)
        ok = (top_toks[at] <= fewest_room[lo:hi]) & (first_room[lo:hi] >= keys[0][1])
        if not np.logical_or.reduce(ok):  # (ok.any(), without its Python layer)
            return None
        gs = self.sizes_np[lo:hi]
        if limit < math.inf:  # the members' room under the limit, all together, must hold the document's work
            if self._sizes_at[0] != limit:  # (g limit for every size, per limit: the same products)
                self._sizes_at = (limit, self.sizes_np * (limit * (1 + 1e-9)))
            room = self._sizes_at[1][lo:hi] - ranked.sum_prefix(most)[at]
            ok &= room >= whole * (1 - 1e-6)
        candidates = gs[ok].tolist()
        bound = share * self.mean
        for g in candidates:
            # every member within the cap where the fullest of them (the prefix maximum) has room for two of the
            # longest chunks, ceil(L / 2g) tokens each, else where no member's sum is over (the largest, a
            # maximum.reduce); within the limit where the most loaded, the last, has room for the largest share (no
            # member's sum can then be over: float sums are monotone), else where no member's sum is over
            if top_toks[g - 1] + 2 * -(-length // (2 * g)) > cap and np.maximum.reduce(
                    ranked.toks[:g] + self._share_tokens(length, g)) > cap:
                continue
            top = self._top.get((length, g))
            if top is None:
                top = self._top[(length, g)] = float(np.maximum.reduce(self._share_arrays(length, g)[0]))
            if (top > bound and g < self.n) or (ranked.loads[g - 1] + top > limit and np.maximum.reduce(
                    ranked.loads[:g] + self._share_arrays(length, g)[0]) > limit):
                continue
            if share < math.inf:
                self.peak_share = max(self.peak_share, top / self.mean)
            return [key[2] for key in keys[:g]]
        return None

    def _fill(self, length: int, start: int, load, toks, limit: float, share: float, rooms=None):
        """Unequal head-tail (``Placement.headtail_sized``) over the fewest ranks whose room holds the document,
        each filled to the same level of compute.  Returns (members, tokens of each), or None.

        Work is about proportional to tokens (``w = W_d / L_d`` per token), so rank ``r`` has room for
        ``c_r = min((limit - load_r) / w, cap - toks_r, share W / w)`` tokens.  Ranks by ``c_r``, largest
        first, join until ``sum c >= (1 + FILL_MARGIN) L_d``; if all of them together have too little
        room, every rank with token room joins and the bound is lifted (``share`` dropped).  Member ``i``
        then takes ``s_i = min((lam - load_i) / w_i, cap - toks_i, top)`` tokens, with the level ``lam``
        such that ``sum s_i = L_d`` (see ``_level``), once with ``w_i = w`` and once more with each member's
        own rate from the cost model (short pieces, and pieces near the document's start, run slower).
        ``rooms``: ``load`` and ``toks`` as float64 and int64 arrays, where the caller keeps them (the same values)."""
        per_tok = self.whole(length) / length
        top = min(self.cap, share * self.mean / per_tok)
        need = (1 + FILL_MARGIN) * length
        load_np, toks_np = rooms if rooms is not None else (floats(load), ints(toks))
        acc, k, members, first = self._fill_rooms(load_np, toks_np, limit, per_tok, top, need)
        if acc >= need:
            self.peak_share = max(self.peak_share, first * per_tok / self.mean)
        else:  # too little work room: lift the bound for all alike (the token cap stays)
            members, top = np.flatnonzero(toks_np < self.cap), self.cap
            if int((self.cap - toks_np[members]).sum()) < length:
                return None
        return self._fill_parts(length, start, members, load_np[members], toks_np[members], per_tok, top)

    def _fill_parts(self, length: int, start: int, members, load, toks, per_tok: float, top: float):
        """The end of :meth:`_fill` (``members`` and their ``load`` and ``toks``, arrays): the parts at one level
        (:meth:`_level`), members by part (largest first, a stable order), then the parts again at each member's own
        rate (its compute over its tokens, a float over an integer below 2^53, divided as Python divides)."""
        sizes = self._level(length, load, toks, np.full(len(members), per_tok), top)
        order = np.argsort(-sizes, kind="stable")  # largest part first: least K/V received
        members, sizes, load, toks = members[order], sizes[order], load[order], toks[order]
        nonzero = np.flatnonzero(sizes > 0)
        rates = np.full(len(members), per_tok)
        rates[nonzero] = self.sized_work(start, length, sizes[nonzero].tolist(), as_array=True) / sizes[nonzero]
        sizes = self._level(length, load, toks, rates, top)
        keep = sizes > 0
        return members[keep].tolist(), sizes[keep].tolist()

    def _fill_rooms(self, load, toks, limit: float, per_tok: float, top: float, need: float):
        """:meth:`_fill`'s ranks by room, on arrays: (the room of the first ``k`` added up, ``k``, those ranks, the
        largest room), the ranks joining by room (largest first, the higher rank on ties) while the sum is under
        ``need`` and the room at least one token."""
        n = self.n
        room = np.minimum(np.minimum((limit - np.asarray(load)) / per_tok,
                                     (self.cap - np.asarray(toks, dtype=np.int64)).astype(np.float64)), top)
        order = (n - 1) - np.argsort(-room[::-1], kind="stable")  # (by room, then rank, both descending: one sort)
        room = room[order]
        usable = int(np.count_nonzero(room >= 1))  # (a prefix: the rooms are in descending order)
        sums = np.cumsum(room[:usable])  # (in order, as the running sum adds)
        full = np.flatnonzero(sums >= need)
        k = int(full[0]) + 1 if len(full) else usable
        return (float(sums[k - 1]) if k else 0.0), k, order[:k], float(room[0])

    def _level(self, length: int, load, toks, rates, top: float) -> np.ndarray:
        """Integer parts ``s_i = clip((lam - load_i) / rate_i, 0, c_i)``, ``c_i = min(cap - toks_i, top)``,
        adding up to ``length`` (an int64 array).  Their sum is piecewise linear in ``lam``, its slope rising by
        ``1 / rate_i`` at ``load_i`` and falling back at ``load_i + rate_i c_i``: those points in order, the sum at
        each a running sum (``np.cumsum``, adding in order), ``lam`` where it reaches ``length``."""
        ld, w = np.asarray(load, dtype=np.float64), np.asarray(rates, dtype=np.float64)
        t = np.asarray(toks, dtype=np.int64)
        caps = np.maximum(0.0, np.minimum((self.cap - t).astype(np.float64), top))
        xs = np.concatenate((ld, ld + w * caps))
        steps = np.concatenate((1 / w, -1 / w))
        o = np.lexsort((steps, xs))
        xs, steps = xs[o], steps[o]
        slope = np.concatenate(([0.0], np.cumsum(steps)[:-1]))  # before each point
        prev = np.concatenate((xs[:1], xs[:-1]))  # lam before each point
        total = np.cumsum(slope * (xs - prev))  # total after each point
        hit = np.flatnonzero(total >= length - 1e-6)
        if len(hit):
            k = int(hit[0])
            before, sl = (float(total[k - 1]) if k else 0.0), float(slope[k])
            lam = float(prev[k]) + (max(0.0, length - before) / sl if sl > 0 else 0.0)
        else:
            lam = float(xs[-1])
        sizes = np.maximum(0.0, np.minimum((lam - ld) / w, caps)).astype(np.int64)
        rest = length - int(np.add.reduce(sizes))
        if rest > 0:  # rounding: fewer than one token per member, where the cap allows (in member order)
            took = np.minimum(np.cumsum(np.maximum(0, self.cap - t - sizes)), rest)
            sizes += np.diff(took, prepend=0)
        return sizes

