"""FlashCP's hybrid placement: Whole-Doc where a document fits, head-tail over the smallest group of
ranks that keeps the balance where it does not, chosen by a heuristic search scored by the cost model.

One candidate is a greedy pass over the documents, longest first (largest-first bin packing),
with three knobs: ``tol`` (how far above the mean a rank's compute may go), ``share`` (the largest
part of a rank's mean compute one member of a split document may take: smaller shares spread long
documents wider, which leaves room for short ones everywhere) and ``force`` (how many of the
longest documents are split even where they would fit whole):

    for each document d (longest first):
        Whole-Doc: among the ranks r with tokens_r + L_d <= cap and load_r + w(d) <= (1 + tol) W,
            the one with the most room left in both (min of max(load / bound, tokens / cap))
        otherwise sub-group: the smallest g (2..8, then about 1.25x apart, and N) such that head-tail
            over the g least-loaded ranks keeps every member under both bounds and ``share``
            (g = N is Per-Doc; a group of 1 is Whole-Doc)
        otherwise, if no rank has token room for it whole: unequal head-tail over the fewest ranks
            whose room (work, tokens, ``share``) holds it, all members filled to one level of compute
            (if all rooms together are too small, every rank with token room, to a higher level)
        otherwise whole on the least-loaded rank with token room, or a group by tokens alone
        otherwise consecutive pieces sized by each rank's token room (the cap always holds)
    then trade parts of split documents, tokens for tokens: a rank under the mean compute and near
        the token cap (full of a document light per token) gives parts of it to a rank over the mean
        for as many tokens of a heavier split document (see ``_Greedy._exchange``)
    then move or swap whole documents between the busiest and the least busy rank while the peak drops

``W`` is the mean compute per rank and ``cap = (1 + token_slack) T / N``.  A sub-group keeps the
document's K/V inside the group: member ``i`` of ``g`` receives ``(2g - 2 - i) L / 2g`` tokens, so
smaller groups send less; in unequal parts (member ``i`` takes ``s_i`` tokens, the largest parts
the outermost pieces) it receives ``e_i - s_i`` tokens, ``e_i`` the end of its last piece (``L``
less the tail tokens of the members before it).  The search scores candidates within the token cap
by the estimated step time (max over ranks of ``max(compute, comm + remote compute)``): among those
within ``TIME_TIE`` (0.2%) of the fastest in step time and in peak compute, the fewest K/V bytes
wins.  The placements of the baselines are candidates too, with sharding-aware communication, and
the winner is never estimated slower than any of them.  Where the pick among the first pass and the baselines
receives no K/V and is estimated within ``PERFECT`` (0.01%) of the lower bound (the mean compute with every
document whole), the search stops there: no other candidate could be more than that faster, nor receive less
(packs of thousands of short documents).  With attention work alone
(``CostModel(linear=False)``) the greedy balances causal pairs (no efficiency curve) and balance
comes first (see ``_balanced``); there a better-balanced plan may be estimated slower.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import heapq
import itertools
import math
import operator

import numpy as np

from flashpar.cp.cost import CostModel
from flashpar.cp.cp_plan import causal_pairs, whole_doc_times
from flashpar.cp.strategies import (
    ArrayPlacement,
    Placement,
    chunk_bounds,
    contiguous,
    headtail,
    per_doc_arrays,
    sized_pieces,
    torch_per_doc,
)

TOLERANCES = (0.0, 0.02, 0.05)
FORCED = (0, 1)
SHARES = (1.0, 0.7, 0.45, 0.25)
FILL_MARGIN = 0.02
"""Room the members of an unequal split must have beyond the document (cut pieces run less efficiently)."""
EXCHANGE_GAP = 0.01
"""Ranks trade split parts only when this far under (and, the taker, within this of the token cap) or over
the mean compute."""
EXCHANGE_MIN = 64
"""Fewest tokens a trade moves (smaller ones add members for little balance)."""
BATCH = 16
"""Documents of one length in a row from which the Whole-Doc step places them in one sort (``_batch_whole``)
rather than one by one (the same placement; only faster)."""
SKIP_MAX = 24
"""Full ranks met at the top of the Whole-Doc heap after which the step searches all ranks at once (the same rank)."""


class _Mins:
    """``min(toks)`` and ``min(load)`` of the greedy pass, kept in two heaps whose stale entries (no longer a
    rank's value) are dropped when met: O(log N) where ``min()`` is O(N)."""

    def __init__(self, load, toks) -> None:
        self.load_v, self.toks_v = load, toks
        self.loads = list(zip(load, range(len(load)), strict=True))
        self.tokss = list(zip(toks, range(len(toks)), strict=True))
        heapq.heapify(self.loads)
        heapq.heapify(self.tokss)

    def push(self, ranks) -> None:
        for r in ranks:
            heapq.heappush(self.loads, (self.load_v[r], r))
            heapq.heappush(self.tokss, (self.toks_v[r], r))

    def load(self) -> float:
        h, cur = self.loads, self.load_v
        while h[0][0] != cur[h[0][1]]:
            heapq.heappop(h)
        return h[0][0]

    def tok(self) -> int:
        h, cur = self.tokss, self.toks_v
        while h[0][0] != cur[h[0][1]]:
            heapq.heappop(h)
        return h[0][0]


class _Ranked:
    """The ranks in ``(load, tokens, rank)`` order (the order the sub-group step takes its least-loaded ranks in),
    kept sorted as loads change: per change O(log N) comparisons and one O(N) memory move, where sorting all ranks
    at every use costs O(N log N); after many changes at once, sorted anew (on arrays).  ``keys``:
    those tuples in order; ``loads`` and ``toks``: the ranks' loads and tokens in that order, the two rows of one
    float array (tokens are integers far below 2^53: exact as floats)."""

    def __init__(self, n: int, arrays: bool = True) -> None:
        self.keys = [(0.0, 0, q) for q in range(n)]
        self.cur = list(self.keys)
        self.arrays = arrays  # (without: the keys alone, for few ranks, where lists beat arrays)
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
        if not self.arrays:
            return
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
        if len(ranks) <= 64 or not self.arrays:
            for q in ranks:
                self.update(q, load[q], toks[q])
            return
        cur, lv, tv = self.cur, self.load_of, self.toks_of
        get = operator.itemgetter(*ranks)
        new_load, new_toks = get(load), get(toks)
        for q, x, t in zip(ranks, new_load, new_toks, strict=True):
            cur[q] = (x, t, q)
        at = _ints(ranks)  # (the same values, written at once)
        lv[at], tv[at] = _floats(new_load), _ints(new_toks)
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
        if self.arrays:
            room = self.toks <= most
            at = int(room.argmax())
            return self.keys[at][2] if room[at] else -1
        return next((key[2] for key in self.keys if key[1] <= most), -1)


def token_cap(doc_lens: list[int], n: int, token_slack: float, total: int | None = None) -> int:
    """``max(ceil(T / N), (1 + token_slack) T / N)``; ``total``: ``T``, where the caller has it."""
    total = sum(doc_lens) if total is None else total
    return max(-(-total // n), int((1 + token_slack) * total / n))


@dataclasses.dataclass
class _Split:
    """A document over several ranks: tokens per member (``equal``: the head-tail of equal chunks, in order)."""

    start: int
    length: int
    parts: dict[int, int]
    equal: bool

    def trade(self, src: int, dst: int, tokens: int) -> None:
        """``tokens`` of the part of ``src`` go to ``dst`` (the parts become unequal)."""
        self.parts[src] -= tokens
        self.parts[dst] = self.parts.get(dst, 0) + tokens
        if self.parts[src] == 0:
            del self.parts[src]
        self.equal = False


class _RankDocs:
    """The Whole-Doc documents of one rank for ``_Greedy._refine``: per length it holds, its documents of that length
    in the order it received them (``doc_seq``), and as lists (lengths ascending; compute; place in the rank's order
    of the first document of each length), which :meth:`_Greedy._best_move` reads.  ``docs``: the rank's documents
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

    @classmethod
    def of(cls, mine, lens_np, doc_seq, whole: dict[int, float], rising: bool = False) -> _RankDocs:
        """Of the documents ``mine`` (few: in Python)."""
        items = sorted(zip(lens_np[mine].tolist(), doc_seq[mine].tolist(), mine.tolist(), strict=True))
        heads = [i for i in range(len(items)) if i == 0 or items[i][0] != items[i - 1][0]]
        return cls([d for _, _, d in items], [items[i][0] for i in heads], [items[i][1] for i in heads], heads, whole,
                   rising)

    @staticmethod
    def all_ranks(whole, n: int, doc_rank, lens_np, doc_seq, seq_end: int, work: dict[int, float],
                  in_order: bool = False, rising: bool = False, doc_work=None):
        """``r -> _RankDocs`` of every rank ``r`` (made when first called) of the documents ``whole``, in one sort
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
        made: dict[int, _RankDocs] = {}

        def of_rank(r: int) -> _RankDocs:
            if r not in made:
                h0, h1 = head_off[r], head_off[r + 1]
                made[r] = _RankDocs(docs[doc_off[r]:doc_off[r + 1]], head_len[h0:h1], head_first[h0:h1],
                                    head_at[h0:h1], work, rising, head_work[h0:h1])
            return made[r]

        return of_rank

    def options(self):
        return self.lens, self.work, self.first

    def arrays(self):
        """:meth:`options` as arrays (made once per change): views of :meth:`other_arrays` past its first."""
        if self._arrays is None:
            ol, ow, oj, _ = self.other_arrays()
            self._arrays = ol[1:], ow[1:], oj[1:]
        return self._arrays

    def other_arrays(self):
        """:meth:`options` as the least busy rank's, arrays with nothing first (length 0, compute 0, place -1), and
        whether the compute rises along them (where it rises over all lengths, so over these: no compute is below 0)."""
        if self._other is None:
            work = _floats([0.0, *self.work])
            self._other = (_ints([0, *self.lens]), work, _ints([-1, *self.first]),
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


def _falls_to_nonnegative(values) -> bool:
    """Whether ``values`` never rise along the array and its last is not below 0 (NaN: False)."""
    return bool((values[:-1] >= values[1:]).all()) and bool(values[-1] >= 0)


def _floats(values) -> np.ndarray:
    """A list of floats as a float64 array (the same values; beyond 64 by ``np.fromiter``: ``np.asarray``'s type
    discovery costs about 1.5x there, up to 4x on a loaded machine, and fromiter's start-up more below)."""
    n = len(values)
    return np.fromiter(values, dtype=np.float64, count=n) if n > 64 else np.array(values, dtype=np.float64)


def _ints(values) -> np.ndarray:
    """A list of integers as an int64 array (see :func:`_floats`)."""
    n = len(values)
    return np.fromiter(values, dtype=np.int64, count=n) if n > 64 else np.array(values, dtype=np.int64)


def _headtail_arrays(splits: list[_Split]):
    """(rank, start, end) of the pieces of equal head-tail splits (``Placement.headtail``: member ``i`` of ``g``
    takes chunks ``i`` and ``2g - 1 - i`` of ``2g``), on arrays; empty pieces are left to the caller to drop."""
    g = np.fromiter((len(sp.parts) for sp in splits), dtype=np.int64, count=len(splits))
    rank = np.fromiter(itertools.chain.from_iterable(sp.parts for sp in splits), dtype=np.int64, count=int(g.sum()))
    i = np.arange(len(rank), dtype=np.int64) - np.repeat(np.cumsum(g) - g, g)  # place in its group
    two = np.repeat(2 * g, g)
    start = np.repeat(np.fromiter((sp.start for sp in splits), dtype=np.int64, count=len(splits)), g)
    length = np.repeat(np.fromiter((sp.length for sp in splits), dtype=np.int64, count=len(splits)), g)
    a = np.concatenate((start + length * i // two, start + length * (two - 1 - i) // two))
    b = np.concatenate((start + length * (i + 1) // two, start + length * (two - i) // two))
    return np.concatenate((rank, rank)), a, b


def _fits(keys, work, tok, limit: float, cap: int) -> bool:
    """Whether the first ``len(work)`` ranks of ``keys`` ((load, tokens, rank), member ``i`` taking ``work[i]`` and
    ``tok[i]``) all stay within ``limit`` and ``cap``."""
    for (ld, t, _), w, x in zip(keys, work, tok, strict=False):  # noqa: SIM110 (faster than all() of a generator)
        if ld + w > limit or t + x > cap:
            return False
    return True


def _tokens_fit(keys, length: int, g: int, cap: int) -> bool:
    """Whether the first ``g`` ranks of ``keys`` have room for the tokens of a head-tail group of ``g`` over
    ``length`` (member ``i``: chunks ``i`` and ``2g - 1 - i`` of ``2g``, as :meth:`_Greedy.shares` counts them)."""
    two = 2 * g
    for i in range(g):
        x = length * (i + 1) // two - length * i // two + length * (two - i) // two - length * (two - 1 - i) // two
        if keys[i][1] + x > cap:
            return False
    return True


def _sized_arrays(splits: list[_Split]):
    """(rank, start, end) of the pieces of unequal head-tail splits (``Placement.headtail_sized``, the largest parts
    outermost: member ``i`` takes the next ``s_i // 2`` tokens from the front and the next ``s_i - s_i // 2`` from
    the back, the last member the middle), on arrays; empty pieces are left to the caller to drop."""
    ranks, sizes, g = [], [], []
    for sp in splits:
        part = sp.parts.__getitem__
        members = sorted(sp.parts, key=part, reverse=True)  # (stable: equal parts keep their order, as by -part)
        ranks += members
        sizes += map(part, members)
        g.append(len(members))
    g_np = np.asarray(g, dtype=np.int64)
    s = np.asarray(sizes, dtype=np.int64)
    last = np.cumsum(g_np) - 1
    h = s // 2
    h[last] = s[last]  # the last member: one piece, the middle
    first = np.repeat(last - g_np + 1, g_np)
    head = np.cumsum(h) - h  # tokens taken from the front before each member (within its split)
    back = np.cumsum(s - h) - (s - h)
    head, back = head - head[first], back - back[first]
    start = np.repeat(np.asarray([sp.start for sp in splits], dtype=np.int64), g_np)
    end = start + np.repeat(np.asarray([sp.length for sp in splits], dtype=np.int64), g_np)
    rank = np.asarray(ranks, dtype=np.int64)
    a = np.concatenate((start + head, end - back - (s - h)))
    b = np.concatenate((start + head + h, end - back))
    return np.concatenate((rank, rank)), a, b


@dataclasses.dataclass(frozen=True)
class _Prefix:
    """Where the first greedy pass of force 0 (up to 64 ranks) stopped keying every rank by its tokens alone: its state
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


class _Greedy:
    """The greedy pass (see the module docstring), with per-(length, group) shares cached."""

    def __init__(self, doc_lens: list[int], n: int, cost: CostModel, cap: int, lens_np=None) -> None:
        """``lens_np``: ``doc_lens`` as an int64 array, where the caller has it."""
        self.lens, self.n, self.cost, self.cap = doc_lens, n, cost, cap
        if lens_np is None:
            lens_np = np.fromiter(doc_lens, dtype=np.int64, count=len(doc_lens))
        self.lens_np = lens = lens_np
        self.starts_np = np.cumsum(lens) - lens
        # by (-length, index): a stable sort (of 16-bit keys, a radix sort, where the lengths allow)
        neg = -lens if int(lens.max()) >= 1 << 15 else (-lens).astype(np.int16)
        order = np.argsort(neg, kind="stable")
        self.order_np, self.order = order, order.tolist()
        # run_end[k]: where the run of documents of order[k]'s length ends (in pass order)
        sl = lens[order]
        ends = np.append(np.flatnonzero(sl[1:] != sl[:-1]) + 1, len(sl))
        run_end, lo = [], 0
        for e in ends.tolist():  # (a list of few runs, each repeated: cheaper than an array's tolist)
            run_end += [e] * (e - lo)
            lo = e
        self.run_end = run_end
        run_starts = np.concatenate(([0], ends[:-1]))
        # the distinct lengths (longest first) and each document's place among them: formulas that are elementwise in
        # the length run once per length, each document's value gathered from its length's (the same floats)
        self.distinct = distinct = sl[run_starts]
        self.doc_run = np.empty(len(lens), dtype=np.int64)
        self.doc_run[order] = np.repeat(np.arange(len(ends), dtype=np.int64), ends - run_starts)
        self._shares: dict[tuple[int, int], tuple[list[float], list[int]]] = {}
        self._whole: dict[int, float] = {}
        self._top: dict[tuple[int, int], float] = {}  # per (length, g): the largest of the shares
        self._big: dict[tuple[int, int], tuple] = {}  # per (length, g): _share_arrays
        self._tok_arrays: dict[tuple[int, int], np.ndarray] = {}  # per (length, g): _share_tokens
        self._whole_times = None
        # group sizes tried: every size up to 8, then about 1.25x apart (and N itself)
        sizes, g = [], 2
        while g < n:
            sizes.append(g)
            g = g + 1 if g < 8 else math.ceil(g * 1.25)
        self.sizes = [*sizes, n] if n >= 2 else []
        self.sizes_np = np.asarray(self.sizes, dtype=np.int64)
        self._last_np = self.sizes_np - 1  # (the last member of a group of each size)
        self._fewest: dict[int, np.ndarray] = {}  # per length: _group's fewest tokens per member, per size
        self._prefix: _Prefix | None = None  # where the first pass of force 0 stopped keying by tokens alone (run)
        self._row_of = np.arange(n, dtype=np.int64)  # (each rank's row, for _batch_whole)
        whole_runs = self._whole_arrays(distinct, keep=True)
        self.doc_work = whole_all = whole_runs[self.doc_run]  # (each document's whole compute: whole(length))
        self.works_rise = _falls_to_nonnegative(whole_runs)  # (longest first: rising with the length)
        self._whole = dict(zip(distinct.tolist(), whole_runs.tolist(), strict=True))
        # (added in document order, as always: cumsum adds in order, as sum() of floats does)
        self.mean = float(np.cumsum(whole_all)[-1]) / n

    @functools.cached_property
    def starts(self) -> list[int]:
        """The documents' starts (a list: where a pass needs one at a time)."""
        return self.starts_np.tolist()

    def whole_times(self) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, ``whole_doc_times``) of the documents under this pass's cost model (placements of whole
        documents are scored from them): each length's (elementwise), gathered per document."""
        if self._whole_times is None:
            times = whole_doc_times(self.distinct, self.cost, self._run_attn)
            self._whole_times = (self.lens_np, times[self.doc_run])
        return self._whole_times

    def _whole_arrays(self, lens, keep: bool = False):
        """:meth:`whole` of each of ``lens`` (an int64 array), on arrays: the same floats (the linear time, then the
        attention time as ``CostModel.attn_time`` rounds it, added).  ``keep``: the attention times are kept for
        :meth:`whole_times` (``lens``: the distinct lengths)."""
        cost = self.cost
        q = lens.astype(np.float64)
        attn = cost.attn_times(lens * (lens + 1) // 2, q, q)
        if keep:
            self._run_attn = attn
        return q * cost.flops_per_token / cost.hardware.gemm_flops + attn

    def whole(self, length: int) -> float:
        if length not in self._whole:
            self._whole[length] = self.cost.linear_time(length) + self.cost.attn_time(
                causal_pairs(0, length, 0), length, length)
        return self._whole[length]

    def shares(self, length: int, g: int) -> tuple[list[float], list[int]]:
        """Compute and tokens of each member of a head-tail group of ``g`` over one document."""
        key = (length, g)
        if g == 1:
            return [self.whole(length)], [length]
        if key not in self._shares and g >= 16:
            work, tok = self._share_arrays(length, g)
            self._shares[key] = (work.tolist(), tok.tolist())
        if key not in self._shares:
            b = chunk_bounds(0, length, 2 * g)
            work, toks = [], []
            for i in range(g):
                pieces = ((b[i], b[i + 1]), (b[2 * g - 1 - i], b[2 * g - i]))
                t = sum(self.cost.attn_time(causal_pairs(x, y, 0), y - x, y) for x, y in pieces if y > x)
                n_tok = sum(y - x for x, y in pieces)
                work.append(t + self.cost.linear_time(n_tok))
                toks.append(n_tok)
            self._shares[key] = (work, toks)
        return self._shares[key]

    def _share_arrays(self, length: int, g: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`shares` on arrays (the same floats: each piece's time as ``CostModel.attn_time`` rounds it, the
        head's and the tail's added, then the linear time)."""
        key = (length, g)
        if key not in self._big:
            i = np.arange(g, dtype=np.int64)
            two = 2 * g
            x = length * np.concatenate((i, two - 1 - i)) // two  # heads, then tails
            y = length * np.concatenate((i + 1, two - i)) // two
            n_tok = (y[:g] - x[:g]) + (y[g:] - x[g:])
            t = self._piece_time(x, y)
            work = (t[:g] + t[g:]) + n_tok.astype(np.float64) * (
                self.cost.flops_per_token) / self.cost.hardware.gemm_flops
            self._big[key] = (work, n_tok)
        return self._big[key]

    def _share_tokens(self, length: int, g: int) -> np.ndarray:
        """The tokens of :meth:`_share_arrays` alone (chunks ``i`` and ``2g - 1 - i`` of ``2g``)."""
        key = (length, g)
        if key not in self._tok_arrays:
            i = np.arange(g, dtype=np.int64)
            two = 2 * g
            self._tok_arrays[key] = (length * (i + 1) // two - length * i // two) + (
                length * (two - i) // two - length * (two - 1 - i) // two)
        return self._tok_arrays[key]

    def _piece_time(self, x, y):
        """``CostModel.attn_time`` of the pieces ``[x, y)`` of a document from 0, on arrays (the same floats)."""
        # (an empty piece has no pairs: 0)
        return self.cost.attn_times(((y - x) * (x + y + 1)) // 2, (y - x).astype(np.float64), y.astype(np.float64))

    def _group(self, length: int, ranked: _Ranked, limit: float, share: float) -> list[int] | None:
        """The smallest head-tail group (of ``self.sizes`` least-loaded ranks, ``ranked`` order) whose members all stay
        under ``limit`` and the token cap, each taking at most ``share`` of a rank's mean compute.

        Only sizes up to the number of ranks under ``limit`` can fit (the ranks are by load).  A size is passed over
        at once, before its shares are looked up, where the fullest member (by tokens, a prefix maximum) has no room
        for the fewest tokens any member takes (``2 floor(L / 2g)``: each chunk holds at least ``floor(L / 2g)``), or
        where the members' room under ``limit`` (``g limit - sum of their loads``, a prefix sum) is less than the
        document's compute whole: the members' shares add up to at least that (the same causal pairs, in pieces no
        longer than the document, which run no more efficiently; a millionth of it, and a billionth of ``g limit``,
        spare for rounding)."""
        # a member's share is about whole / g (a little more: cut pieces run less efficiently)
        whole = self.whole(length)
        first = max(2, min(self.n, math.ceil(whole / (share * self.mean)))) if share < math.inf else 2
        keys, sizes, cap = ranked.keys, self.sizes, self.cap
        lo = bisect.bisect_left(sizes, first)
        hi = bisect.bisect_right(sizes, bisect.bisect_left(keys, (limit,)))  # (limit,): below every key at limit
        if lo >= hi:
            return None
        if not ranked.arrays:  # few ranks: every size in Python (tokens first: their shares cost more)
            candidates = sizes[lo:hi]
        else:
            most = sizes[hi - 1]  # (the members' room grows with g: every rank up to here is under the limit)
            at = self._last_np[lo:hi]  # (the last member of each size)
            fewest = self._fewest.get(length)  # the fewest tokens a member takes, per size
            if fewest is None:
                fewest = self._fewest[length] = 2 * (length // (2 * self.sizes_np))
            top_toks = ranked.top_prefix(most)
            ok = top_toks[at] + fewest[lo:hi] <= cap
            if not np.logical_or.reduce(ok):  # (ok.any(), without its Python layer)
                return None
            gs = self.sizes_np[lo:hi]
            if limit < math.inf:  # the members' room under the limit, all together, must hold the document's work
                room = gs * (limit * (1 + 1e-9)) - ranked.sum_prefix(most)[at]
                ok &= room >= whole * (1 - 1e-6)
            candidates = gs[ok].tolist()
        bound = share * self.mean
        for g in candidates:
            # (on arrays, at once: every member within the cap where the fullest of them, the prefix maximum, has room
            # for two of the longest chunks, ceil(L / 2g) tokens each; within the limit where the most loaded, the
            # last, has room for the largest share: then no member's sum can be over, as float sums are monotone;
            # any member over: the largest over, a maximum.reduce)
            roomy = ranked.arrays and top_toks[g - 1] + 2 * -(-length // (2 * g)) <= cap
            if ranked.arrays and g > 32:  # (on arrays: the same sums and comparisons; tokens first, cheaper)
                if not roomy and np.maximum.reduce(ranked.toks[:g] + self._share_tokens(length, g)) > cap:
                    continue
                top = self._top.get((length, g))
                if top is None:
                    top = self._top[(length, g)] = float(self._share_arrays(length, g)[0].max())
                if (top > bound and g < self.n) or (ranked.loads[g - 1] + top > limit and np.maximum.reduce(
                        ranked.loads[:g] + self._share_arrays(length, g)[0]) > limit):
                    continue
            else:
                top = self._size_fits(keys, length, g, bound, limit, cap, roomy)
                if top is None:
                    continue
            if share < math.inf:
                self.peak_share = max(self.peak_share, top / self.mean)
            return [key[2] for key in keys[:g]]
        return None

    def _size_fits(self, keys, length: int, g: int, bound: float, limit: float, cap: int,
                   roomy: bool = False) -> float | None:
        """In Python, for ``_group``: the largest share of head-tail over the ``g`` first ranks of ``keys`` where
        every member keeps under ``limit`` and ``cap`` and that share under ``bound`` (any share at ``g = N``),
        else None.  Tokens are checked first: their shares cost more.  ``roomy``: every member is known to have
        token room (then the most loaded member, the last, with room for the largest share is enough)."""
        if not roomy and (length, g) not in self._shares and not _tokens_fit(keys, length, g, cap):
            return None
        work, tok = self.shares(length, g)
        top = self._top.get((length, g))
        if top is None:
            top = self._top[(length, g)] = max(work)
        if (top > bound and g < self.n) or not (roomy and keys[g - 1][0] + top <= limit
                                                  or _fits(keys, work, tok, limit, cap)):
            return None
        return top

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
        if self.n > 32:  # (on arrays: the same rooms, order and running sum)
            load_np, toks_np = rooms if rooms is not None else (_floats(load), _ints(toks))
            acc, k, members, first = self._fill_rooms(load_np, toks_np, limit, per_tok, top, need)
            if acc >= need:
                self.peak_share = max(self.peak_share, first * per_tok / self.mean)
            else:  # too little work room: lift the bound for all alike (the token cap stays)
                members, top = np.flatnonzero(toks_np < self.cap), self.cap
                if int((self.cap - toks_np[members]).sum()) < length:
                    return None
            if len(members) > 32:  # (many members: the same on arrays, _level's too)
                return self._fill_arrays(length, start, members, load_np[members], toks_np[members], per_tok, top)
            members = members.tolist()
        else:
            room = sorted(((min((limit - load[r]) / per_tok, self.cap - toks[r], top), r) for r in range(self.n)),
                          reverse=True)
            acc, k = 0.0, 0
            while k < len(room) and acc < need and room[k][0] >= 1:
                acc += room[k][0]
                k += 1
            members, first = [r for _, r in room[:k]], room[0][0]
            if acc >= need:
                self.peak_share = max(self.peak_share, first * per_tok / self.mean)
            else:  # too little work room: lift the bound for all alike (the token cap stays)
                members, top = [r for r in range(self.n) if toks[r] < self.cap], self.cap
                if sum(self.cap - toks[r] for r in members) < length:
                    return None
        sizes = self._level(length, [load[r] for r in members], [toks[r] for r in members], [per_tok] * len(members),
                            top)
        order = sorted(range(len(members)), key=lambda i: -sizes[i])  # largest part first: least K/V received
        members, sizes = [members[i] for i in order], [sizes[i] for i in order]
        nonzero = [i for i, s in enumerate(sizes) if s > 0]
        rates = [per_tok] * len(members)
        for i, w in zip(nonzero, self.sized_work(start, length, [sizes[i] for i in nonzero]), strict=True):
            rates[i] = w / sizes[i]
        sizes = self._level(length, [load[r] for r in members], [toks[r] for r in members], rates, top)
        return [r for r, s in zip(members, sizes, strict=True) if s > 0], [s for s in sizes if s > 0]

    def _fill_arrays(self, length: int, start: int, members, load, toks, per_tok: float, top: float):
        """The end of :meth:`_fill` over more than 32 members (``members`` and their ``load`` and ``toks``, arrays),
        on arrays: the same levels (``_level_np``, as ``_level`` takes them there), the same stable order by part
        (largest first), the same rates (a float over an integer below 2^53, divided as Python divides)."""
        sizes = self._level_np(length, load, toks, np.full(len(members), per_tok), top)
        order = np.argsort(-sizes, kind="stable")  # largest part first: least K/V received
        members, sizes, load, toks = members[order], sizes[order], load[order], toks[order]
        nonzero = np.flatnonzero(sizes > 0)
        rates = np.full(len(members), per_tok)
        rates[nonzero] = self.sized_work(start, length, sizes[nonzero].tolist(), as_array=True) / sizes[nonzero]
        sizes = self._level_np(length, load, toks, rates, top)
        keep = sizes > 0
        return members[keep].tolist(), sizes[keep].tolist()

    def _fill_rooms(self, load, toks, limit: float, per_tok: float, top: float, need: float):
        """:meth:`_fill`'s ranks by room, on arrays: (the room of the first ``k`` added up, ``k``, those ranks, the
        largest room), the ranks joining by room (largest first, the higher rank on ties) while the sum is under
        ``need`` and the room at least one token."""
        n = self.n
        room = np.minimum(np.minimum((limit - np.asarray(load)) / per_tok,
                                     (self.cap - np.asarray(toks, dtype=np.int64)).astype(np.float64)), top)
        order = np.lexsort((-np.arange(n), -room))
        room = room[order]
        usable = int(np.count_nonzero(room >= 1))  # (a prefix: the rooms are in descending order)
        sums = np.cumsum(room[:usable])  # (in order, as the running sum adds)
        full = np.flatnonzero(sums >= need)
        k = int(full[0]) + 1 if len(full) else usable
        return (float(sums[k - 1]) if k else 0.0), k, order[:k], float(room[0])

    def _level(self, length: int, load, toks, rates, top: float) -> list[int]:
        """Integer parts ``s_i = clip((lam - load_i) / rate_i, 0, c_i)``, ``c_i = min(cap - toks_i, top)``,
        adding up to ``length``.  Their sum is piecewise linear in ``lam``, its slope rising by ``1 / rate_i``
        at ``load_i`` and falling back at ``load_i + rate_i c_i``: walk those points in order (beyond 32 members on
        arrays: the same running sums, ``np.cumsum`` adding in order as the walk does)."""
        if len(load) > 32:
            return self._level_arrays(length, load, toks, rates, top)
        caps = [max(0.0, min(self.cap - t, top)) for t in toks]
        events = sorted([(ld, 1 / w) for ld, w in zip(load, rates, strict=True)]
                        + [(ld + w * c, -1 / w) for ld, w, c in zip(load, rates, caps, strict=True)])
        total, slope, lam = 0.0, 0.0, events[0][0]
        for x, step in events:
            if total + slope * (x - lam) >= length - 1e-6:  # (float sums: a millionth of a token is enough)
                lam += max(0.0, length - total) / slope if slope > 0 else 0.0
                break
            total, lam, slope = total + slope * (x - lam), x, slope + step
        sizes = [int(max(0.0, min((lam - ld) / w, c))) for ld, w, c in zip(load, rates, caps, strict=True)]
        rest = length - sum(sizes)
        for i, t in enumerate(toks):  # rounding: fewer than one token per member, where the cap allows
            add = max(0, min(rest, self.cap - t - sizes[i]))
            sizes[i] += add
            rest -= add
        return sizes

    def _level_arrays(self, length: int, load, toks, rates, top: float) -> list[int]:
        """:meth:`_level` on arrays (the same floats and integers)."""
        return self._level_np(length, load, toks, rates, top).tolist()

    def _level_np(self, length: int, load, toks, rates, top: float) -> np.ndarray:
        """:meth:`_level_arrays`, the parts as an int64 array."""
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

    def sized_work(self, start: int, length: int, sizes: list[int], as_array: bool = False):
        """Compute of each member of an unequal head-tail split (cost model, pieces as placed; beyond 8 members on
        arrays, the same floats: see :meth:`_piece_time`), a list (``as_array``: a float64 array)."""
        if len(sizes) > 8:
            if sum(sizes) != length:
                raise ValueError(f"sizes {sizes} do not add up to the document's {length} tokens")
            s = _ints(sizes)
            h = s // 2
            h[-1] = s[-1]  # the last member: one piece, the middle
            head0 = np.concatenate(([0], np.cumsum(h)[:-1]))  # (from the document's start)
            tail1 = length - np.concatenate(([0], np.cumsum(s - h)[:-1]))
            tail0 = tail1 - (s - h)
            tail0[-1] = tail1[-1]
            work = (self._piece_time(head0, head0 + h) + self._piece_time(tail0, tail1)) + s.astype(np.float64) * (
                self.cost.flops_per_token) / self.cost.hardware.gemm_flops
            return work if as_array else work.tolist()
        out = []
        for pieces in sized_pieces(sizes, start, length):
            t = sum(self.cost.attn_time(causal_pairs(a, b, start), b - a, b - start) for a, b in pieces if b > a)
            out.append(t + self.cost.linear_time(sum(b - a for a, b in pieces)))
        return _floats(out) if as_array else out

    def calibrate(self) -> tuple[Placement, float] | None:
        """Re-base the mean compute on a first placement (cutting documents costs kernel efficiency).  Where
        the mean stays, that placement is the pass ``run(0.0, 0)``'s: returned, with its ``peak_share``."""
        p = self.run(0.0, 0)
        fig = p.figures(self.lens, self.starts_np, self.cost, whole=self.whole_times())
        self.first_figures = fig
        if sum(fig.compute) / self.n <= self.mean * (1 + 1e-9):  # (sums of the same work in another order)
            return p, self.peak_share
        self.mean = sum(fig.compute) / self.n
        return None

    def _cut_by_room(self, p: Placement, by_load: list[int], load, toks, start: int, length: int) -> list[int]:
        """Last resort: consecutive pieces of the document, each as large as a rank's token room (least-loaded
        ranks first), so the token cap holds; the rank of a later piece receives the earlier ones' K/V."""
        a, end, changed = start, start + length, []
        for r in by_load:
            b = end if r == by_load[-1] else min(end, a + max(self.cap - toks[r], 0))
            if b > a:
                p.add(r, a, b)
                load[r] += self.cost.linear_time(b - a) + self.cost.attn_time(causal_pairs(a, b, start), b - a,
                                                                                 b - start)
                toks[r] += b - a
                a = b
                changed.append(r)
        return changed

    def run(self, tol: float, force: int, share: float = 1.0, subgroups: bool = True) -> ArrayPlacement:
        n, cap = self.n, self.cap
        limit = (1 + tol) * self.mean
        self.peak_share = 0.0  # the largest share of the mean any split member took (see flashcp())
        load, toks = [0.0] * n, [0] * n
        doc_rank = np.full(len(self.lens), -1, dtype=np.int64)  # the rank of each document placed whole
        doc_seq = np.zeros(len(self.lens), dtype=np.int64)  # ... and its place in that rank's list of them
        p = Placement(n)
        splits: list[_Split] = []  # documents over several ranks (laid out at the end)
        # the ranks by fullness, key (max(load / limit, tokens / cap), load, rank): a heap with a current entry
        # (key, load, rank, tokens) per rank; an entry whose load and tokens are no longer the rank's is stale
        heap = [(0.0, 0.0, q, 0) for q in range(n)]
        seq = 0
        # the ranks by (load, tokens) too (beyond 128 ranks also load and toks as arrays, by rank: ranked.load_of,
        # ranked.toks_of, always current); from 256 ranks on kept in step with every document, as whether any rank
        # fits a document whole comes from them there, else brought up to date where next needed (``pending``)
        ranked, eager, pending = _Ranked(n, arrays=n > 128), n >= 256, []
        runs = []  # (where in pass order, ranks, first place) of each run _batch_whole placed
        k, prefix = 0, self._prefix
        # up to 64 ranks, a pass of force 0 starts where the first such pass stopped keying by tokens alone, where its
        # own limit is no lower (see _Prefix); the first such pass keeps track of where that is (``tracking``)
        tracking = n <= 64 and force == 0 and prefix is None
        if n <= 64 and force == 0 and prefix is not None and limit >= prefix.limit:
            k, seq, heap, runs = prefix.k, prefix.seq, list(prefix.heap), list(prefix.runs)
            load, toks = list(prefix.load), list(prefix.toks)
            doc_rank, doc_seq = prefix.rank.copy(), prefix.seq_of.copy()
            pending = list(range(n))  # (ranked: every rank brought up to date where next needed)

        def stop_tracking(at_load, at_toks) -> None:  # the state before document k, for the passes after this one
            nonlocal tracking
            self._prefix = _Prefix(limit, k, seq, list(at_load), list(at_toks), list(heap), list(runs), doc_rank.copy(),
                                   doc_seq.copy())
            tracking = False

        mins = _Mins(load, toks) if 64 < n < 256 else None  # min(toks), min(load) in O(log N) in between
        heap_anew = False  # after many changes at once: the heaps are built anew where next needed

        def touched(ranks) -> None:  # new current entries for ranks whose load changed
            nonlocal heap_anew
            if eager:
                ranked.update_many(ranks, load, toks)
            else:
                pending.extend(ranks)
                if ranked.arrays:
                    for q in ranks:
                        ranked.load_of[q], ranked.toks_of[q] = load[q], toks[q]
            if heap_anew or len(ranks) > max(n // 4, 64):
                heap_anew = True
                return
            for q in ranks:
                heapq.heappush(heap, (max(load[q] / limit, toks[q] / cap), load[q], q, toks[q]))
            if mins is not None:
                mins.push(ranks)

        order, run_end = self.order, self.run_end
        count = len(order)
        few, whole_of, lens = not eager and mins is None, self._whole, self.lens  # (few: up to 64 ranks)
        heappop, heapreplace = heapq.heappop, heapq.heapreplace
        while k < count:
            d = order[k]
            if few and k >= force and run_end[k] - k < BATCH:  # the Whole-Doc step below, in short for few ranks:
                # the top of the heap (stale entries dropped) has the least key, and where it fits, it is the rank
                length = lens[d]
                w = whole_of[length]
                e = heap[0]
                while e[1] != load[e[2]] or e[3] != toks[e[2]]:
                    heappop(heap)
                    e = heap[0]
                r = e[2]
                if toks[r] <= cap - length and load[r] <= limit - w:
                    lr, tr = load[r] + w, toks[r] + length
                    x, y = lr / limit, tr / cap
                    if tracking and x > y:  # (its key is no longer its tokens')
                        stop_tracking(load, toks)
                    doc_rank[d], doc_seq[d] = r, seq
                    seq += 1
                    load[r], toks[r] = lr, tr
                    pending.append(r)
                    heapreplace(heap, (y if y > x else x, lr, r, tr))  # (max(x, y), as max() picks)
                    k += 1
                    continue
            length = self.lens[d]
            if k >= force:
                w = self.whole(length)
                tok_room, work_room = cap - length, limit - w
                if run_end[k] - k >= BATCH:  # a run of equal lengths: place as many whole as the greedy would
                    before = (list(load), list(toks)) if tracking else None
                    placed = self._batch_whole(k, run_end[k], length, w, load, toks, limit, tracking)
                    if placed and tracking and not placed[2]:
                        stop_tracking(*before)
                    if placed:
                        runs.append((k, placed[0], seq))  # (their ranks and places: written after the loop)
                        seq += len(placed[0])
                        k += len(placed[0])
                        touched(placed[1])
                        continue
                # the rank with the most room left in both work and tokens, among those it fits: the first in
                # key order that fits (the least key, the lowest rank on ties)
                if tracking:  # (its fit might depend on the limit)
                    stop_tracking(load, toks)
                r, skipped = -1, []
                if tok_room < 0:  # (longer than the cap)
                    fits = False
                elif eager:  # some rank within both (those within the work room: a prefix of the ranked order)
                    c = bisect.bisect_right(ranked.keys, (work_room, math.inf))
                    fits = c > 0 and np.minimum.reduce(ranked.toks[:c]) <= tok_room  # (.min(), without its Python
                    # layer; the tokens are integers, exact as floats)
                elif mins is not None:
                    if heap_anew:
                        mins = _Mins(load, toks)
                    fits = mins.tok() <= tok_room and mins.load() <= work_room
                else:
                    fits = min(toks) <= tok_room and min(load) <= work_room  # (else no rank fits)
                if heap_anew and (fits or mins is not None):  # one current entry per rank (the same entries)
                    if ranked.arrays:  # (the same divisions and maxima on arrays)
                        lv, tv = ranked.load_of, ranked.toks_of
                        key0 = np.maximum(lv / limit, tv / cap).tolist()
                        heap[:] = zip(key0, lv.tolist(), range(n), tv.tolist(), strict=True)
                    else:
                        heap[:] = [(max(load[q] / limit, toks[q] / cap), load[q], q, toks[q]) for q in range(n)]
                    heapq.heapify(heap)
                    heap_anew = False
                at_top = True
                while fits and heap:
                    e = heap[0]
                    q = e[2]
                    if e[1] != load[q] or e[3] != toks[q]:
                        heapq.heappop(heap)  # stale
                        continue
                    if toks[q] <= tok_room and load[q] <= work_room:
                        r = q
                        break
                    skipped.append(heapq.heappop(heap))
                    if len(skipped) >= SKIP_MAX:  # many full ranks first: the least key that fits, on arrays
                        rooms = (ranked.load_of, ranked.toks_of) if ranked.arrays else (load, toks)
                        r, at_top = self._fitting(rooms, limit, tok_room, work_room), False
                        break
                if r >= 0:
                    doc_rank[d], doc_seq[d] = r, seq
                    seq += 1
                    load[r] += w
                    toks[r] += length
                    if eager:
                        ranked.update(r, load[r], toks[r])
                    else:
                        pending.append(r)
                        if ranked.arrays:
                            ranked.load_of[r], ranked.toks_of[r] = load[r], toks[r]
                        if mins is not None:
                            mins.push((r,))
                    entry = (max(load[r] / limit, toks[r] / cap), load[r], r, toks[r])
                    if at_top:
                        heapq.heapreplace(heap, entry)
                    else:
                        heapq.heappush(heap, entry)
                for e in skipped:
                    heapq.heappush(heap, e)
                if r >= 0:
                    k += 1
                    continue
            if pending:
                ranked.update_many(list(dict.fromkeys(pending)), load, toks)
                pending.clear()
            start = int(self.starts_np[d])
            changed = self._place_other(k, d, length, start, force, load, toks, limit, share, subgroups, p, splits,
                                        ranked)
            if changed is None:  # whole on one rank, over the work bound
                r = self._last_whole
                doc_rank[d], doc_seq[d] = r, seq
                seq += 1
                changed = [r]
            touched(changed)
            k += 1
        if tracking:  # every document keyed by tokens alone: the passes after this one start at the end
            stop_tracking(load, toks)
        if runs:  # the documents of runs placed in one sort: ranks and places written at once
            run_ranks = [x for _, x, _ in runs]
            sizes = np.fromiter(map(len, run_ranks), dtype=np.int64, count=len(runs))
            at = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # in its run
            idx = self.order_np[np.repeat(np.asarray([x for x, _, _ in runs], dtype=np.int64), sizes) + at]
            doc_rank[idx] = np.concatenate(run_ranks)
            doc_seq[idx] = np.repeat(np.asarray([x for _, _, x in runs], dtype=np.int64), sizes) + at
        if subgroups:
            self._exchange(splits, load, toks)
        self._refine(doc_rank, doc_seq, load, toks, seq)
        if not splits and not any(p.segments) and doc_rank.min() >= 0:  # every document whole
            return ArrayPlacement.of_whole(n, doc_rank, self.starts_np, self.lens_np)
        parts = []
        if n > 64:  # (many members: on arrays)
            parts = [_headtail_arrays([sp for sp in splits if sp.equal]),
                     _sized_arrays([sp for sp in splits if not sp.equal])]
        else:
            for sp in splits:
                if sp.equal:  # member i takes chunks i and 2g - 1 - i
                    p.headtail(list(sp.parts), sp.start, sp.length)
                else:  # the largest parts outermost
                    members = sorted(sp.parts, key=lambda r: -sp.parts[r])
                    p.headtail_sized(members, [sp.parts[r] for r in members], sp.start, sp.length)
        whole = np.flatnonzero(doc_rank >= 0)
        ws = self.starts_np[whole]
        return ArrayPlacement.sorted_from(n, [(doc_rank[whole], ws, ws + self.lens_np[whole]), p.arrays(), *parts])

    def _fitting(self, rooms, limit: float, tok_room: int, work_room: float) -> int:
        """The rank of least key ``(max(load / limit, tokens / cap), load, rank)`` among those with
        ``tokens <= tok_room`` and ``load <= work_room``; -1 if none.  ``rooms``: (loads, tokens) of every rank."""
        lv, tv = rooms if isinstance(rooms[0], np.ndarray) else (_floats(rooms[0]), _ints(rooms[1]))
        ok = np.flatnonzero((tv <= tok_room) & (lv <= work_room))
        if not len(ok):
            return -1
        key0 = np.maximum(lv[ok] / limit, tv[ok] / self.cap)
        return int(ok[np.lexsort((ok, lv[ok], key0))[0]])

    def _place_other(self, k, d, length, start, force, load, toks, limit, share, subgroups, p, splits, ranked):
        """A document the Whole-Doc step did not place (see the module docstring); returns the ranks it changed, or
        None where it went whole onto one rank (``self._last_whole``).  ``ranked``: the ranks by (load, tokens)."""
        cap = self.cap
        group = self._group(length, ranked, limit, share) if subgroups else None
        # unequal parts only where the document fits whole on no rank (else: whole, over the bound, below); the first
        # rank with token room for it whole (-1: none, where it is longer than the cap less the fewest tokens of any
        # rank), looked up once (nothing changes in between)
        room = ranked.first_with_room(cap - length) if group is None else -1
        cut = group is None and subgroups and room < 0
        rooms = (ranked.load_of, ranked.toks_of) if ranked.arrays else None  # (kept current there, as for _fitting)
        fill = self._fill(length, start, load, toks, limit, share, rooms) if cut else None
        if fill is not None and len(fill[0]) > 1:  # unequal parts by each rank's room
            members, sizes = fill
            splits.append(_Split(start, length, dict(zip(members, sizes, strict=True)), False))
            for r, w, t in zip(members, self.sized_work(start, length, sizes), sizes, strict=True):
                load[r] += w
                toks[r] += t
            return members
        if fill is not None:
            group = fill[0]
        if group is None and k >= force:  # over the work bound: whole on the least-loaded rank with room
            group = [room] if room >= 0 else None
        if group is None and subgroups:  # tokens alone
            group = self._group(length, ranked, float("inf"), float("inf"))
        if group is None and subgroups:  # no group has token room: cut it by the room each rank has left
            return self._cut_by_room(p, ranked.ranks(), load, toks, start, length)
        group = group or ranked.ranks()  # Per-Doc over every rank (the whole_doc baseline)
        work, tok = self.shares(length, len(group))
        for i, r in enumerate(group):
            load[r] += work[i]
            toks[r] += tok[i]
        if len(group) == 1:  # whole (the caller records it with the Whole-Doc documents)
            self._last_whole = group[0]
            return None
        splits.append(_Split(start, length, dict(zip(group, tok, strict=True)), True))
        return group

    def _exchange(self, splits: list[_Split], load, toks) -> None:
        """Trade parts of split documents between ranks under and over the mean compute ``W``, tokens for tokens.

        A rank ``u`` under ``W`` and near the token cap (typically full of a document light per token, which
        the pass had nowhere else to put) gives ``x`` tokens of a split document ``B`` to a rank ``v`` over
        ``W`` and takes ``x`` tokens of a heavier split document ``X`` from it: token counts stay, and
        ``(w_X - w_B) x`` compute moves from ``v`` to ``u`` (``w = W_d / L_d``, compute per token), with
        ``x`` the most that takes neither past ``W``.  Lightest ``B`` first, busiest ``v`` first, heaviest
        ``X`` first.  Both documents' parts become unequal (laid out by ``Placement.headtail_sized``)."""
        mean = self.mean
        over = sorted((r for r in range(self.n) if load[r] > mean * (1 + EXCHANGE_GAP)), key=lambda r: -load[r])
        under = sorted((r for r in range(self.n) if load[r] < mean * (1 - EXCHANGE_GAP)
                        and toks[r] > self.cap * (1 - EXCHANGE_GAP)), key=load.__getitem__)
        if not over or not under or not splits:
            return
        rate = [self.whole(sp.length) / sp.length for sp in splits]
        # The scan, per (u, B): over v (busiest first) and its X (heaviest first), trade where the move is at least
        # EXCHANGE_MIN; X stops at the first no heavier than B.  Between two trades nothing changes, so each step
        # finds the next trade of the scan at once: every (v, X) pair of the scan as arrays, in scan order, with
        # the part of X on v (0 once v holds none) and v's load kept in step with the trades.
        pairs = self._pairs_arrays(splits, over, under, rate, load) if self.n > 64 else None
        if pairs is None:
            pairs = self._pairs(splits, over, rate, load)
        if pairs is None:
            return
        held, pv, px, prate, ppart, excess, pair_at, rows_of = pairs
        rates_sorted = sorted(set(prate.tolist()))
        with np.errstate(divide="ignore", invalid="ignore"):  # (see _next_trade)
            self._trades(under, held, rate, rates_sorted, splits, load, pv, px, prate, ppart, excess, pair_at, rows_of)

    def _pairs(self, splits: list[_Split], over: list[int], rate: list[float], load):
        """:meth:`_exchange`'s pairs (see there), in Python: (the splits each rank has a part of, as sets; each pair's
        v and X, lists; X's rate, X's part on v and v's load over the mean, arrays; each pair's row by (v, X); each
        v's rows), or None where there are none."""
        held: list[set[int]] = [set() for _ in range(self.n)]  # the splits each rank has a part of
        for i, sp in enumerate(splits):
            for r in sp.parts:
                held[r].add(i)
        # the splits of each rank over the mean, heaviest first (what a trade gives it is not offered again)
        heaviest = {v: sorted(held[v], key=lambda i: -rate[i]) for v in over}
        pv = [v for v in over for _ in heaviest[v]]
        px = [x for v in over for x in heaviest[v]]
        if not px:
            return None
        prate = _floats(rate)[px]
        ppart = np.asarray([splits[x].parts.get(v, 0) for v, x in zip(pv, px, strict=True)], dtype=np.float64)
        excess = _floats([load[v] for v in pv]) - self.mean  # (v's load over the mean, per pair)
        pair_at = {vx: i for i, vx in enumerate(zip(pv, px, strict=True))}
        rows_of: dict[int, list[int]] = {}
        for i, v in enumerate(pv):
            rows_of.setdefault(v, []).append(i)
        rows_of = {v: np.asarray(rows, dtype=np.int64) for v, rows in rows_of.items()}
        return held, pv, px, prate, ppart, excess, pair_at, rows_of

    def _pairs_arrays(self, splits: list[_Split], over: list[int], under: list[int], rate: list[float], load):
        """:meth:`_pairs` on arrays (many ranks): the same pairs in the same order, or None where two splits of one
        rank over the mean have equal rates (their order is then the order of that rank's set: :meth:`_pairs`).

        Every part as (split, rank, tokens), in split order; the pairs: the parts on ranks over the mean, by (place
        of the rank in ``over``, rate descending), a stable sort (the same order as ``sorted(set, key=-rate)`` where
        no rates tie).  The sets are made for the ranks under the mean alone (the only ones :meth:`_trades` reads;
        the others' stay empty, and trades only add to and take from them), each from its splits in split order, as
        the loop in :meth:`_pairs` adds them (the same sets, iterated in the same order).  A rank's rows are one
        range (the pairs are grouped by rank)."""
        n = self.n
        g = np.fromiter((len(sp.parts) for sp in splits), dtype=np.int64, count=len(splits))
        m = int(g.sum())
        part_rank = np.fromiter(itertools.chain.from_iterable(sp.parts for sp in splits), dtype=np.int64, count=m)
        part_tok = np.fromiter(itertools.chain.from_iterable(sp.parts.values() for sp in splits), dtype=np.int64,
                               count=m)
        part_split = np.repeat(np.arange(len(splits), dtype=np.int64), g)
        rate_np = _floats(rate)
        place = np.full(n, -1, dtype=np.int64)
        place[np.asarray(over, dtype=np.int64)] = np.arange(len(over), dtype=np.int64)
        sel = np.flatnonzero(place[part_rank] >= 0)
        if not len(sel):
            return None
        sel = sel[np.lexsort((-rate_np[part_split[sel]], place[part_rank[sel]]))]
        pv_np, px_np = part_rank[sel], part_split[sel]
        prate = rate_np[px_np]
        if ((pv_np[1:] == pv_np[:-1]) & (prate[1:] == prate[:-1])).any():
            return None
        held: list[set[int]] = [set() for _ in range(n)]
        mine = np.zeros(n, dtype=bool)
        mine[np.asarray(under, dtype=np.int64)] = True
        sub = np.flatnonzero(mine[part_rank])
        sub = sub[np.argsort(part_rank[sub], kind="stable")]  # (by rank, each rank's in split order)
        ranks_sub, splits_sub = part_rank[sub], part_split[sub].tolist()
        cuts = np.flatnonzero(np.concatenate(([True], ranks_sub[1:] != ranks_sub[:-1], [True]))).tolist()
        for lo, hi in itertools.pairwise(cuts if len(sub) else ()):
            held[int(ranks_sub[lo])] = set(splits_sub[lo:hi])
        pv, px = pv_np.tolist(), px_np.tolist()
        ppart = part_tok[sel].astype(np.float64)
        excess = _floats(load)[pv_np] - self.mean  # (v's load over the mean, per pair)
        pair_at = dict(zip(zip(pv, px, strict=True), range(len(pv)), strict=True))
        heads = np.flatnonzero(np.concatenate(([True], pv_np[1:] != pv_np[:-1], [True]))).tolist()
        rows_of = {pv[lo]: np.arange(lo, hi, dtype=np.int64) for lo, hi in itertools.pairwise(heads)}
        return held, pv, px, prate, ppart, excess, pair_at, rows_of

    def _trades(self, under, held, rate, rates_sorted, splits, load, pv, px, prate, ppart, excess, pair_at,
                rows_of) -> None:
        """The trades of :meth:`_exchange`'s scan (see there), in order."""
        mean = self.mean
        # (for long scans, see _next_trade: the pairs by rate, with their rates, parts and excesses in that order,
        # kept in step with ppart and excess; rate_at: each pair's place in that order)
        by_rate = None  # (only scans of more than 1024 pairs read it)
        if len(prate) > 1024:
            order = np.argsort(prate, kind="stable")
            by_rate = order, prate[order], ppart[order], excess[order]
            part_by_rate, excess_by_rate = by_rate[2], by_rate[3]
            rate_at = np.empty_like(order)
            rate_at[order] = np.arange(len(order))
            rows_by_rate: dict[int, np.ndarray] = {}  # per v: rate_at of its rows
        for u in under:
            for b in sorted(held[u], key=rate.__getitem__):
                pos = 0
                while load[u] < mean and b in held[u] and splits[b].parts[u] >= EXCHANGE_MIN:
                    # (a quick bound first: the lightest X heavier than B must gain little enough for u's room)
                    j = bisect.bisect_right(rates_sorted, rate[b])
                    if j == len(rates_sorted) or (rates_sorted[j] - rate[b]) * EXCHANGE_MIN > (mean - load[u]) * (
                            1 + 1e-9):
                        break
                    i = self._next_trade(pos, prate, rate[b], ppart, excess, mean - load[u], by_rate)
                    if i < 0:
                        break
                    v, x = pv[i], px[i]
                    gain = rate[x] - rate[b]
                    move = int(min((load[v] - mean) / gain, (mean - load[u]) / gain, splits[x].parts[v],
                                   splits[b].parts[u]))
                    for t, src, dst in ((x, v, u), (b, u, v)):
                        splits[t].trade(src, dst, move)
                        held[dst].add(t)
                        if src not in splits[t].parts:
                            held[src].discard(t)
                    load[u] += gain * move
                    load[v] -= gain * move
                    for t in (x, b):
                        if (v, t) in pair_at:
                            at, part = pair_at[(v, t)], splits[t].parts.get(v, 0)
                            ppart[at] = part
                            if by_rate is not None:
                                part_by_rate[rate_at[at]] = part
                    rows, e = rows_of[v], load[v] - mean
                    excess[rows] = e
                    if by_rate is not None:
                        if v not in rows_by_rate:
                            rows_by_rate[v] = rate_at[rows]
                        excess_by_rate[rows_by_rate[v]] = e
                    pos = i + 1

    @staticmethod
    def _next_trade(pos: int, prate, rate_b: float, ppart, excess, room: float, by_rate=None) -> int:
        """The first pair ``i >= pos`` of :meth:`_exchange`'s scan that trades (its X heavier than B, of rate
        ``rate_b``; at least ``EXCHANGE_MIN`` of it on v; a move of at least that within v's ``excess`` over the mean
        and u's ``room``), or -1; long scans look at the next 512 pairs first (the same first pair).  Both moves at
        once: ``min(e, room) / gain`` is the lesser of ``e / gain`` and ``room / gain`` (for ``gain > 0`` a rounded
        division is monotone in its numerator); where ``gain <= 0`` the quotient is not used (no trade; the caller
        silences the division's warnings).

        ``by_rate``: the pairs by rate, and their rates, parts and excesses in that order (the same values as
        ``prate``, ``ppart``, ``excess``); a long scan looks only at the pairs whose rate is in
        ``(rate_b, rate_b + room / EXCHANGE_MIN]`` (with a millionth, and a trillionth of ``rate_b``, to spare for
        rounding) where they are fewer: a pair outside has ``gain <= 0``, or a quotient ``room / gain`` below
        ``EXCHANGE_MIN``, so it cannot trade (the same first pair).  Those pairs are one slice of the arrays by rate
        (the same conditions on the same values, element by element)."""
        end = len(prate)
        if by_rate is not None and end - pos > 1024:
            order, rates, parts, excesses = by_rate
            a = int(rates.searchsorted(rate_b, side="right"))
            z = int(rates.searchsorted(rate_b + room / EXCHANGE_MIN * (1 + 1e-6) + abs(rate_b) * 1e-12, side="right"))
            if z - a < (end - pos) // 2:
                at = order[a:z]
                gain = rates[a:z] - rate_b
                hit = at[(at >= pos) & (gain > 0) & (parts[a:z] >= EXCHANGE_MIN)
                         & (np.minimum(excesses[a:z], room) / gain >= EXCHANGE_MIN)]
                return int(np.minimum.reduce(hit)) if len(hit) else -1
        for lo, hi in (((pos, pos + 512), (pos + 512, end)) if end - pos > 1024 else ((pos, end),)):
            gain = prate[lo:hi] - rate_b
            ok = (gain > 0) & (ppart[lo:hi] >= EXCHANGE_MIN) & (np.minimum(excess[lo:hi], room) / gain >= EXCHANGE_MIN)
            at = int(ok.argmax()) if len(ok) else 0
            if len(ok) and ok[at]:
                return lo + at
        return -1

    def _batch_whole(self, lo: int, hi: int, length: int, w: float, load, toks, limit: float, tracking: bool = False):
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
        tokens / cap``), as in a pass with any higher limit (see :class:`_Prefix`; looked at only with ``tracking``)."""
        n, cap, k = self.n, self.cap, hi - lo
        same = True
        l0, t0 = _floats(load), _ints(toks)
        m = min(k, 2 * -(-k // n) + 2, self._slots_needed(k, length, w, load, toks, limit))
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
            every = max(toks) + m * length <= cap - length and (
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
        if n > 64:
            changed = np.flatnonzero(counts)
            at = changed * width + counts[changed]
            changed = changed.tolist()
            for r, x, t in zip(changed, ls[at].tolist(), ts[at].tolist(), strict=True):
                load[r], toks[r] = x, t
        else:  # (few ranks: every rank's row read at once, the changed ones written)
            got = counts.tolist()
            changed = [r for r in range(n) if got[r]]
            at = self._row_of * width + counts
            new_load, new_toks = ls[at].tolist(), ts[at].tolist()
            for r in changed:
                load[r], toks[r] = new_load[r], new_toks[r]
        return ranks, changed, same

    def _slots_needed(self, k: int, length: int, w: float, load, toks, limit: float) -> int:
        """About the most documents of a run of ``k`` that one rank takes in :meth:`_batch_whole` (where fewer than
        this were tried, the search doubles them: this only saves slots).  Where rank ``r`` takes ``c`` of them, its
        slot ``c - 1`` is among the ``k`` least keys, and so is every slot of another rank ``s`` of lower key: every
        ``j`` with ``t_s + j L < t_r + (c - 1) L`` and ``l_s + j w < l_r + (c - 1) w`` (its tokens and its load both
        lower), at least ``c - 1 - S`` of them, ``S`` the spread of tokens over ``L`` or of loads over ``w``.  So
        ``c + (N - 1)(c - 1 - S) <= k``: ``c <= (k + (N - 1)(1 + S)) / N``; one slot more for rounding."""
        spread = (max(toks) - min(toks)) / length
        if limit < math.inf and w > 0:
            spread = max(spread, (max(load) - min(load)) / w)
        n = self.n
        return math.ceil((k + (n - 1) * (2 + spread)) / n) + 1

    def _refine(self, doc_rank, doc_seq, load, toks, seq: int) -> None:
        """Lower the busiest rank by moving one of its Whole-Doc documents to the least busy rank, or by
        swapping one for a lighter one there (no K/V cost: whole documents need none), while the peak drops.

        Each step takes, over every document ``a`` of the busiest rank and every option ``b`` of the least
        busy (nothing, or one of its documents) within the token cap, the lowest peak
        ``max(H - w_a + w_b, L + w_a - w_b)``, the first in (``a``, then nothing, then ``b``) order on ties
        (see :meth:`_best_move`).  A rank's documents are kept in the order it received them (``doc_seq``);
        per length only the first can be chosen (``w`` is a function of the length), so each rank holds, per
        length, its documents of that length in that order (:class:`_RankDocs`, built when the rank is first
        met)."""
        whole = np.flatnonzero(doc_rank >= 0)
        if not len(whole):
            return
        if len(whole) >= 512:  # many: one sort of them all
            docs_of = _RankDocs.all_ranks(whole, self.n, doc_rank, self.lens_np, doc_seq, seq, self._whole, True,
                                          self.works_rise, self.doc_work)
        else:
            by_rank: dict[int, _RankDocs] = {}

            def docs_of(r: int) -> _RankDocs:
                if r not in by_rank:
                    by_rank[r] = _RankDocs.of(whole[doc_rank[whole] == r], self.lens_np, doc_seq, self._whole,
                                              self.works_rise)
                return by_rank[r]

        def move(src: int, dst: int, length: int, at: int) -> int:
            """The first document of ``length`` on ``src`` goes to ``dst``, received at ``at``; the next seq."""
            doc = docs_of(src).pop_first(length, doc_seq)
            docs_of(dst).append(length, doc, at)
            doc_rank[doc], doc_seq[doc] = dst, at
            return at + 1

        for _ in range(2 * len(whole)):
            hi = load.index(max(load))  # the first busiest / least busy rank
            lo = load.index(min(load))
            if hi == lo:
                return
            best = self._best_move(docs_of(hi), docs_of(lo), load[hi], load[lo], toks[hi], toks[lo])
            if best is None:
                return
            la, lb = best
            seq = move(hi, lo, la, seq)
            wa, wb = self.whole(la), 0.0
            if lb is not None:
                seq = move(lo, hi, lb, seq)
                wb = self.whole(lb)
            load[hi] += wb - wa
            load[lo] += wa - wb
            toks[hi] += (lb or 0) - la
            toks[lo] += la - (lb or 0)

    def _best_move(self, hi_docs: _RankDocs, lo_docs: _RankDocs, h: float, low: float, tok_hi: int, tok_lo: int):
        """``(la, lb)``: move the first document of length ``la`` of the busiest rank (load ``h``) to the least
        busy (load ``low``) and its first of length ``lb`` back (``None``: nothing back), the pair of lowest
        peak ``p = max(h - w_a + w_b, low + w_a - w_b)`` below ``h (1 - 1e-12)`` with both ranks within the
        token cap, the first on equal peaks in (the busiest rank's order of its documents, then nothing, then
        the least busy rank's order); ``None`` if no pair lowers the peak.  ``*_docs``: per length a rank
        holds, (lengths, compute, place in its order of the first document of that length) (``_RankDocs.options``).
        All pairs at once (lengths x lengths, in numpy), each peak rounded as the step writes it."""
        la, wa, sa = hi_docs.options()
        lb, wb, sb = lo_docs.options()
        if not len(la):
            return None
        if len(la) * (len(lb) + 1) <= 256:  # few pairs: in Python (the same peaks, the same order on ties)
            best, best_key = None, (h - 1e-12 * abs(h),)
            opts = [(0, 0.0, -1), *zip(lb, wb, sb, strict=True)]
            cap = self.cap
            for x, w, i in zip(la, wa, sa, strict=True):
                lo_b, hi_b = x + tok_lo - cap, cap - tok_hi + x
                for y, v, j in opts:
                    if lo_b <= y <= hi_b:
                        key = (max(h - w + v, low + w - v), i, j)
                        if key < best_key:
                            best, best_key = (x, y or None), key
            return best
        la, wa, sa = hi_docs.arrays()
        ol, ow, oj, rising = lo_docs.other_arrays()  # nothing first on ties
        if len(la) * len(ol) > 2048:
            found = self._best_move_rows(la, wa, sa, ol, ow, oj, rising, h, low, tok_hi, tok_lo) if rising else _UNSURE
            if found is not _UNSURE:
                return found
        cap = self.cap
        feasible = (ol[None, :] >= (la + tok_lo - cap)[:, None]) & (ol[None, :] <= (cap - tok_hi + la)[:, None])
        peak = np.maximum((h - wa)[:, None] + ow[None, :], (low + wa)[:, None] - ow[None, :])
        peak = np.where(feasible & (peak < h - 1e-12 * abs(h)), peak, np.inf)
        best = peak.min()
        if best == np.inf:
            return None
        ii, jj = np.nonzero(peak == best)
        k = np.lexsort((oj[jj], sa[ii]))[0]
        return int(la[ii[k]]), (None if jj[k] == 0 else int(ol[jj[k]]))

    def _best_move_rows(self, la, wa, sa, ol, ow, oj, rising: bool, h: float, low: float, tok_hi: int, tok_lo: int):
        """:meth:`_best_move` (on its arrays: the options ``ol``, ``ow``, ``oj`` of the least busy rank, nothing
        first, lengths ascending; ``rising``: ``ow`` ascending) with at most two options per document of the
        busiest rank: the same answer, or ``_UNSURE``.  With ``ow`` ascending, a row's ``f1 = (h - w_a) + w_b``
        rises and ``f2 = (low + w_a) - w_b`` falls along its options (float sums are monotone), so its peak
        ``max(f1, f2)`` falls until ``c``, the first option with ``f1 >= f2``, and rises from there: the row's
        least is at ``c - 1`` or ``c`` (within its token window, a range of options; ``c`` found by
        ``w_b >= (f2 - f1) / 2``, then checked in every row: where it is not where the estimate put it (rounding),
        ``_UNSURE``).  Every other option of a row is at least that least, so only the rows whose least is the best
        can hold an equal peak elsewhere, next to it: the option beyond it (``c - 2``, or ``c + 1``) must be higher,
        else ``_UNSURE`` (the caller takes all pairs)."""
        if not rising:
            return _UNSURE
        cap = self.cap
        # (array methods and ufuncs rather than numpy's functions: the same results, without their Python layer)
        jlo = ol.searchsorted(la + (tok_lo - cap), side="left")  # the window [jlo, jhi) within the token cap
        jhi = ol.searchsorted(la + (cap - tok_hi), side="right")
        x1, x2 = h - wa, low + wa
        c = np.minimum(np.maximum(ow.searchsorted((x2 - x1) / 2, side="left"), jlo), jhi)  # (np.clip: slower)
        # options c - 1 and c of each row, one array each (jlo <= c <= jhi: c - 1 is inside where c > jlo, c where
        # c < jhi; an index outside is clipped, its values unused)
        in1, in2 = c > jlo, c < jhi
        w1, w2 = ow[np.maximum(c - 1, 0)], ow[np.minimum(c, len(ol) - 1)]
        f11, f21, f12, f22 = x1 + w1, x2 - w1, x1 + w2, x2 - w2
        if np.logical_or.reduce((in1 & (f11 >= f21)) | (in2 & (f12 < f22))):  # (c - 1 below, c above, where inside)
            return _UNSURE
        peak1, peak2 = np.maximum(f11, f21), np.maximum(f12, f22)
        below = h - 1e-12 * abs(h)
        cand1 = np.where(in1 & (peak1 < below), peak1, np.inf)
        cand2 = np.where(in2 & (peak2 < below), peak2, np.inf)
        best = min(np.minimum.reduce(cand1), np.minimum.reduce(cand2))
        if best == np.inf:
            return None
        rows1, rows2 = (cand1 == best).nonzero()[0], (cand2 == best).nonzero()[0]
        ii = np.concatenate((rows1, rows2))
        jj = np.concatenate((c[rows1] - 1, c[rows2]))
        beyond = np.concatenate((c[rows1] - 2, c[rows2] + 1))  # (the option past each, away from the crossing)
        for i, j in zip(ii.tolist(), beyond.tolist(), strict=True):
            if jlo[i] <= j < jhi[i] and not max(x1[i] + ow[j], x2[i] - ow[j]) > best:  # (an equal peak: maybe more)
                return _UNSURE
        k = np.lexsort((oj[jj], sa[ii]))[0]
        return int(la[ii[k]]), (None if jj[k] == 0 else int(ol[jj[k]]))


_UNSURE = object()
"""``_Greedy._best_move_rows`` could not be sure of its answer."""


def whole_doc(doc_lens: list[int], n: int, cost: CostModel, token_slack: float, lens_np=None) -> ArrayPlacement:
    """Baseline: Whole-Doc wherever a document fits under the token cap, Per-Doc for the rest (``lens_np``: the
    lengths as an int64 array, where the caller has it)."""
    cap = token_cap(doc_lens, n, token_slack, None if lens_np is None else int(lens_np.sum()))
    return _Greedy(doc_lens, n, cost, cap, lens_np).run(float("inf"), 0, subgroups=False)


def flashcp(doc_lens: list[int], n: int, cost: CostModel, token_slack: float, lens_np=None) -> ArrayPlacement:
    """The hybrid search (see the module docstring); ``lens_np``: ``doc_lens`` as an int64 array, where the caller
    has it."""
    cap = token_cap(doc_lens, n, token_slack, None if lens_np is None else int(lens_np.sum()))
    # attention alone: balance the attention work itself (pairs), as the solvers it is compared with do
    greedy = _Greedy(doc_lens, n, cost if cost.linear else cost.with_hardware(attn_half=0.0), cap, lens_np)
    starts = greedy.starts_np
    lower = greedy.mean  # no plan's step time is below the mean compute of every document whole (cuts only add)
    first = greedy.calibrate()  # the pass (tol 0, force 0, share 1), where the mean did not move
    @functools.cache
    def whole() -> ArrayPlacement:  # the whole_doc baseline: planned once, where it can matter (see scored)
        return greedy.run(float("inf"), 0, subgroups=False)

    ring_of = functools.cache(lambda: [f(doc_lens, n, starts) for f in (headtail, contiguous)])
    # per_doc, torch_per_doc (beyond 16 ranks not: cutting every document into 2N pieces twice over is the
    # costliest candidate at large N); in the order the baselines have always been compared in
    cut_all = lambda: ([per_doc_arrays(doc_lens, n)],  # noqa: E731
                       [ArrayPlacement.of(torch_per_doc(doc_lens, n, False))] if n <= 16 else [])
    fig_of: dict[bytes, object] = {}
    times = greedy.whole_times()
    if greedy.cost is not cost:  # (attention alone: the greedy's cost differs; each length's, per document)
        times = (greedy.lens_np, whole_doc_times(greedy.distinct, cost)[greedy.doc_run])
    ring_low = functools.cache(lambda: _ring_bound(greedy.lens_np, starts, n, cost, times[1]))
    runs = (greedy.distinct, greedy.doc_run)

    def scored(candidates: list[ArrayPlacement]):
        """The pick among ``candidates`` and the baselines (see _pick), and its figures."""
        for p in _unique(candidates):
            if p.key() not in fig_of:
                fig_of[p.key()] = p.figures(doc_lens, starts, cost, whole=times)
        # headtail and contiguous: neither planned nor scored where their lower bound (_ring_bound) is slower than
        # the fastest candidate within the cap by more than a tie (as per_doc below: neither could be the fastest,
        # tie, nor lower the baselines' bound, nor change the skips below, which compare with that fastest), unless
        # one might equal another placement (as many pieces as one): then in their places, as always
        inside = [fig_of[p.key()].step for p in candidates if max(fig_of[p.key()].tokens) <= cap]
        ring, pieces = None, ()
        if inside:
            low, pieces = ring_low()
            if low > min(inside) * (1 + TIME_TIE):
                ring = []
        ring = ring_of() if ring is None else ring
        for p in ring:
            if p.key() not in fig_of:
                fig_of[p.key()] = p.figures(doc_lens, starts, cost, whole=times)
        # the whole_doc baseline (a greedy pass of its own): skipped where its lower bound (_whole_doc_bound)
        # is slower than the fastest of the rest within the cap by more than a tie, as per_doc below
        rest = [fig_of[p.key()].step for p in candidates + ring if max(fig_of[p.key()].tokens) <= cap]
        wd = []
        if not rest or _whole_doc_bound(greedy.lens_np, n, cost, cap, times[1]) <= min(rest) * (1 + TIME_TIE):
            wd = [whole()]
            if wd[0].key() not in fig_of:
                fig_of[wd[0].key()] = wd[0].figures(doc_lens, starts, cost, whole=times)
        # per_doc and torch_per_doc cut every document into 2N pieces (O(D N) of them): skipped where even
        # their lower bound (see _cut_all_bound) is slower than the fastest candidate within the cap by more
        # than a tie, which leaves the choice as it was (such a candidate can be neither the fastest nor tied,
        # and its time cannot lower the bound the baselines set)
        pool = [fig_of[p.key()].step for p in candidates + [*wd, *ring] if max(fig_of[p.key()].tokens) <= cap]
        pd, tpd = [], []
        if not pool or _cut_all_bound(greedy.lens_np, n, cost, runs) <= min(pool) * (1 + TIME_TIE):
            pd, tpd = cut_all()
            for p in pd + tpd:
                if p.key() not in fig_of:
                    fig_of[p.key()] = p.figures(doc_lens, starts, cost, whole=times)
        if not ring and any(len(p.a) in pieces for p in candidates + wd + pd + tpd):
            ring = ring_of()
            for p in ring:
                if p.key() not in fig_of:
                    fig_of[p.key()] = p.figures(doc_lens, starts, cost, whole=times)
        baselines = [*wd, *pd, *ring, *tpd]
        unique = _unique(candidates + baselines)
        keys = {p.key() for p in baselines}
        best = unique[_pick([fig_of[p.key()] for p in unique], cap, [p.key() in keys for p in unique], cost)]
        return best, fig_of[best.key()]

    if cost.linear and first is not None:
        fig_of[first[0].key()] = greedy.first_figures
        best, fig = scored([first[0]])
        if sum(fig.recv_tokens) == 0 and fig.step <= lower * (1 + PERFECT):  # nothing left to gain
            return best
    # beyond 16 ranks a pass costs O(N) per document: a smaller grid keeps 1M tokens at N=64 near 200 ms
    forced, tolerances = (FORCED, TOLERANCES) if n <= 16 else (FORCED[:1], TOLERANCES[:2])
    if int(greedy.lens_np.max()) > cap:  # the longest document fits whole nowhere: forcing it to split changes nothing
        forced = FORCED[:1]
    # from 256 ranks on, the smallest share only spreads long documents over more ranks than the fastest plan does:
    # its passes (the slowest of the grid there) won none of the four lists' packs at 2M / 256, 4M / 512 and 8M / 1024
    shares = SHARES if n < 256 else SHARES[:-1]
    candidates, peak = [], {}
    for share in shares:  # a pass whose splits all stayed under a smaller share equals that share's pass
        for force in forced:
            for tol in tolerances:
                if peak.get((force, tol), math.inf) <= share:
                    continue
                if first is not None and (share, force, tol) == (1.0, 0, 0.0):
                    candidates.append(first[0])
                    peak[(force, tol)] = first[1]
                    continue
                candidates.append(greedy.run(tol, force, share))
                peak[(force, tol)] = greedy.peak_share
    if not cost.linear:  # attention alone: balance first (see _balanced), then the least time, then K/V
        pd, tpd = cut_all()
        unique = _unique(candidates + [whole(), *pd, *ring_of(), *tpd])
        figs = {i: unique[i].figures(doc_lens, starts, cost, whole=times)
                for i in _balanced([p.segments for p in unique], greedy.starts, cap)}
        return unique[min(figs, key=lambda i: (figs[i].step, sum(figs[i].recv_tokens), i))]
    return scored(candidates)[0]


def _unique(placements: list[ArrayPlacement]) -> list[ArrayPlacement]:
    """Distinct placements (the knobs often agree), each the first of its equals, ordered by where the last of
    its equals stands (the order the search has always compared them in)."""
    first: dict[bytes, ArrayPlacement] = {}
    last: dict[bytes, int] = {}
    for i, p in enumerate(placements):
        k = p.key()
        first.setdefault(k, p)
        last[k] = i
    return [first[k] for k in sorted(last, key=last.__getitem__)]


def _whole_doc_bound(lens, n: int, cost: CostModel, cap: int, whole_times) -> float:
    """A lower bound on the estimated step time of the ``whole_doc`` baseline: the mean compute per rank, with
    every document longer than the token cap (it fits whole on no rank) Per-Doc over all ``N`` ranks (what
    ``whole_doc`` does with it: ``2N`` chunks, bounded as in :func:`_cut_all_bound`) and every other one at its
    attention time whole (``whole_times``, :func:`~flashpar.cp.cp_plan.whole_doc_times`; one that ends up cut only
    costs more), plus the linear work.  Less a millionth for rounding."""
    long = lens > cap
    if not np.logical_or.reduce(long):  # (none: the same sum, of the same array)
        attn = 0.0 + float(whole_times.sum())
    else:
        attn = float(_cut_attn(lens[long], n, cost).sum()) + float(whole_times[~long].sum())
    return (attn + cost.linear_time(int(lens.sum()))) / n * (1 - 1e-6)


def _ring_bound(lens, starts, n: int, cost: CostModel, whole_times) -> tuple[float, tuple[int, int]]:
    """A lower bound on the estimated step time of both ``headtail`` and ``contiguous`` (the sequence cut into
    ``2N`` chunks, rank ``r`` taking chunks ``r`` and ``2N - 1 - r``, or into ``N``, rank ``r`` taking chunk ``r``;
    chunk ``c`` is ``[B_c, B_c+1)``, ``B_c = c T // parts``), and how many pieces each has.  A step is at least a
    rank's compute (over ``burst`` where ranks share cores, ``CostModel.burst``): its linear time plus the
    attention time of every document inside one of its chunks, at its time whole (``whole_times``: a whole piece
    takes that time, and the pieces of cut documents only add), summed from prefix sums in document order; less a
    millionth for rounding.  Pieces: the documents plus each distinct chunk bound strictly inside a document (the
    pieces are the gaps between the document starts and the bounds)."""
    total = int(starts[-1] + lens[-1])
    ends = starts + lens
    sums = np.concatenate(([0.0], np.cumsum(whole_times)))
    low, pieces = math.inf, []
    for parts in (2 * n, n):
        b = total * np.arange(parts + 1, dtype=np.int64) // parts
        i0, i1 = np.searchsorted(starts, b[:-1], side="left"), np.searchsorted(ends, b[1:], side="right")
        attn, toks = np.where(i1 > i0, sums[i1] - sums[np.minimum(i0, i1)], 0.0), np.diff(b)
        if parts == 2 * n:  # (rank r: chunks r and 2N - 1 - r)
            attn, toks = attn[:n] + attn[::-1][:n], toks[:n] + toks[::-1][:n]
        compute = toks * cost.flops_per_token / cost.hardware.gemm_flops + attn
        low = min(low, float(compute.max()) / cost.burst)  # (the bound of both: the lesser)
        inner = np.unique(b[(b > 0) & (b < total)])
        at = np.minimum(np.searchsorted(starts, inner), len(starts) - 1)
        pieces.append(len(lens) + int(np.count_nonzero(starts[at] != inner)))
    return low * (1 - 1e-6), (pieces[0], pieces[1])


def _cut_attn(lens, n: int, cost: CostModel, runs=None):
    """Per document cut into ``2N`` chunks: a lower bound on its attention time (see :func:`_cut_all_bound`).
    ``runs``: (the distinct lengths, each document's place among them): the same floats, once per length."""
    if runs is not None:
        return _cut_attn(runs[0], n, cost)[runs[1]]
    L = lens.astype(np.float64)
    return cost.attn_times(lens * (lens + 1) // 2, np.ceil(L / (2 * n)) if n > 1 else L, L)


def _cut_all_bound(lens, n: int, cost: CostModel, runs=None) -> float:
    """A lower bound on the estimated step time of ``per_doc`` and ``torch_per_doc`` (every document cut into 2N
    chunks, torch's further cut at shard boundaries): the mean compute per rank, each document's causal pairs
    at the efficiency of its longest possible piece (``ceil(L / 2N)`` queries over ``L`` keys; efficiency
    rises with both, and a piece cut further only loses), plus the linear work.  Less a millionth for rounding.
    ``runs``: see :func:`_cut_attn`."""
    return (float(_cut_attn(lens, n, cost, runs).sum()) + cost.linear_time(int(lens.sum()))) / n * (1 - 1e-6)


BALANCE = 0.03
"""Attention-work imbalance (max / mean) a candidate may have and still compete, attention alone."""


TIME_TIE = 0.002
"""Step times within this fraction of the fastest candidate's count as equal (then fewer K/V bytes win)."""


PERFECT = 1e-4
"""The search ends after its first pass and the baselines where their pick receives no K/V and is estimated within
this fraction of the lower bound (the mean compute with every document whole): no other candidate could be more
than 0.01% faster, nor receive less (packs of many short documents, where the knobs change nothing that matters)."""


def _balanced(placements, doc_starts: list[int], cap: int) -> list[int]:
    """Attention work alone (``CostModel(linear=False)``): the candidates within the token cap (all, if none
    is) whose attention work (causal pairs, max / mean over ranks) is within ``BALANCE`` of perfect balance,
    or within 0.5% of the best reached.  Without linear work to hide it, K/V traffic would otherwise outweigh
    balance, which is what the attention-only comparison is about; counting pairs is cheaper than figures."""
    imbalance, tokens = [], []
    for segments in placements:
        pairs = [sum(causal_pairs(a, b, doc_starts[bisect.bisect_right(doc_starts, a) - 1]) for a, b in segs)
                 for segs in segments]
        mean = sum(pairs) / len(pairs)
        imbalance.append(max(pairs) / mean if mean > 0 else 1.0)
        tokens.append(max(sum(b - a for a, b in segs) for segs in segments))
    idx = [i for i, t in enumerate(tokens) if t <= cap] or list(range(len(tokens)))
    budget = max(1 + BALANCE, 1.005 * min(imbalance[i] for i in idx))
    return [i for i in idx if imbalance[i] <= budget]


def _pick(figs, cap: int, baseline: list[bool], cost: CostModel) -> int:
    """Among the candidates within the token cap (all, if none is): the fewest K/V tokens received among those
    whose estimated step time and peak compute are within ``TIME_TIE`` of the fastest's, and whose step time
    is no more than any baseline's (``baseline[i]``); then the least time.  Peak compute: the slowest rank's,
    or where ranks share cores when the last compute ends (``CostModel.compute_span``)."""
    pool = [i for i, f in enumerate(figs) if max(f.tokens) <= cap] or list(range(len(figs)))
    fastest = min(pool, key=lambda i: (figs[i].step, i))
    bound = min([figs[fastest].step * (1 + TIME_TIE)] + [figs[i].step for i in pool if baseline[i]])
    peak = cost.compute_span(figs[fastest].compute) * (1 + TIME_TIE)
    tied = [i for i in pool if figs[i].step <= bound and cost.compute_span(figs[i].compute) <= peak]
    return min(tied, key=lambda i: (sum(figs[i].recv_tokens), figs[i].step, i))
