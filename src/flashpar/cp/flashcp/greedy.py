"""One greedy pass (:meth:`Greedy.run`) over the documents, longest first (largest-first bin packing), with three knobs:
``tol`` (how far above the mean a rank's compute may go), ``share`` (the largest part of a rank's mean compute one
member of a split document may take: smaller shares spread long documents wider, which leaves room for short ones
everywhere) and ``force`` (how many of the longest documents are split even where they would fit whole)::

    for each document d (longest first):
        Whole-Doc: among the ranks r with tokens_r + L_d <= cap and load_r + w(d) <= (1 + tol) W,
            the one with the most room left in both (min of max(load / bound, tokens / cap))   (whole.py)
        otherwise sub-group: the smallest g such that head-tail over the g least-loaded ranks keeps every
            member under both bounds and ``share`` (g = N is Per-Doc)                          (groups.py)
        otherwise, if no rank has token room for it whole: unequal head-tail over the fewest ranks whose
            room holds it, all filled to one level of compute                                    (groups.py)
        otherwise whole on the least-loaded rank with token room, or a group by tokens alone
        otherwise consecutive pieces sized by each rank's token room (the cap always holds)
    then trade parts of split documents, tokens for tokens                                       (trade.py)
    then move or swap whole documents between the busiest and the least busy rank               (refine.py)
"""

from __future__ import annotations

import heapq

import numpy as np

from flashpar.cp.flashcp.groups import GroupSearch
from flashpar.cp.flashcp.ranks import Ranked
from flashpar.cp.flashcp.refine import refine
from flashpar.cp.flashcp.splits import Split, headtail_arrays, sized_arrays
from flashpar.cp.flashcp.trade import exchange
from flashpar.cp.flashcp.whole import BATCH, SKIP_MAX, Prefix, WholeDocStep
from flashpar.cp.strategies import ArrayPlacement, Placement


class Greedy(GroupSearch, WholeDocStep):
    """The greedy pass (see the module docstring), over the documents and costs of :class:`DocWork`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._prefix: Prefix | None = None  # where the first pass of force 0 stopped keying by tokens alone (run)

    def calibrate(self) -> tuple[Placement, float] | None:
        """Re-base the mean compute on a first placement (cutting documents costs kernel efficiency).  Where
        the mean stays, that placement is the pass ``run(0.0, 0)``'s: returned, with its ``peak_share``."""
        p = self.run(0.0, 0)
        fig = p.figures(self.lens, self.starts_np, self.cost, whole=self.whole_times())
        self.first_figures = fig
        # (the mean is of work without kernel launches, as whole documents' loads are: compared and re-based so)
        work = sum(c - x for c, x in zip(fig.compute, fig.launch, strict=True)) / self.n
        if work <= self.mean * (1 + 1e-9):  # (sums of the same work in another order)
            return p, self.peak_share
        self.mean = work
        return None

    def forcing_changes_nothing(self, tolerances, shares) -> bool:
        """Whether a pass of force 1 places every document as the pass of force 0 with the same ``tol`` and ``share``
        does, for every pair of the grid: where the longest document fits whole on no empty rank (over the token cap,
        or its work over ``(1 + tol) W``) and the group search finds it a group among the empty ranks.  Force only
        decides the first document's step: force 0 tries it whole first (it fits nowhere: the same as force 1, which
        skips that), then both ask :meth:`_group` the same question; only where that finds nothing do they part
        (force 0 then puts it whole over the bound).  From the second document on the two passes run alike."""
        d = self.order[0]
        length, w = self.lens[d], self.whole(self.lens[d])
        for tol in tolerances:
            limit = (1 + tol) * self.mean
            if length <= self.cap and limit - w >= 0.0:  # (the step's own test: it fits whole on an empty rank)
                return False
            for share in shares:
                if self._group(length, Ranked(self.n), limit, share) is None:
                    return False
        return True

    def _cut_by_room(self, p: Placement, by_load: list[int], load, toks, start: int, length: int) -> list[int]:
        """Last resort: consecutive pieces of the document, each as large as a rank's token room (least-loaded
        ranks first), so the token cap holds; the rank of a later piece receives the earlier ones' K/V."""
        a, end, changed = start, start + length, []
        for r in by_load:
            b = end if r == by_load[-1] else min(end, a + max(self.cap - toks[r], 0))
            if b > a:
                p.add(r, a, b)
                # (every earlier piece on a rank of its own: as many holders of the keys ahead)
                load[r] += self.cost.linear_time(b - a) + self.cost.piece_cost(b - a, a - start, len(changed))
                toks[r] += b - a
                a = b
                changed.append(r)
        return changed

    def run(self, tol: float, force: int, share: float = 1.0, subgroups: bool = True) -> ArrayPlacement:
        n, cap = self.n, self.cap
        limit = (1 + tol) * self.mean
        self.peak_share = 0.0  # the largest share of the mean any split member took (see search.plan)
        load, toks = [0.0] * n, [0] * n
        doc_rank = np.full(len(self.lens), -1, dtype=np.int64)  # the rank of each document placed whole
        doc_seq = np.zeros(len(self.lens), dtype=np.int64)  # ... and its place in that rank's list of them
        p = Placement(n)
        splits: list[Split] = []  # documents over several ranks (laid out at the end)
        # the ranks by fullness, key (max(load / limit, tokens / cap), load, rank): a heap with a current entry
        # (key, load, rank, tokens) per rank; an entry whose load and tokens are no longer the rank's is stale
        heap = [(0.0, 0.0, q, 0) for q in range(n)]
        seq = 0
        # the ranks by (load, tokens) too (for the group search), brought up to date where next needed: the ranks
        # changed since are ``pending``; its arrays by rank (``lv``, ``tv``: load and tokens) are kept current
        ranked, pending = Ranked(n), []
        lv, tv = ranked.load_of, ranked.toks_of
        runs = []  # (where in pass order, ranks, first place) of each run _batch_whole placed
        k, prefix = 0, self._prefix
        # a pass of force 0 starts where the first such pass stopped keying ranks by tokens alone, where its own limit
        # is no lower (see Prefix); the first such pass keeps track of where that is (``tracking``)
        tracking = force == 0 and prefix is None
        if force == 0 and prefix is not None and limit >= prefix.limit:
            k, seq, heap, runs = prefix.k, prefix.seq, list(prefix.heap), list(prefix.runs)
            load, toks = list(prefix.load), list(prefix.toks)
            doc_rank, doc_seq = prefix.rank.copy(), prefix.seq_of.copy()
            pending = list(range(n))  # (ranked: every rank brought up to date where next needed)
            lv[:], tv[:] = load, toks

        def stop_tracking(at_load, at_toks) -> None:  # the state before document k, for the passes after this one
            nonlocal tracking
            self._prefix = Prefix(limit, k, seq, list(at_load), list(at_toks), list(heap), list(runs), doc_rank.copy(),
                                   doc_seq.copy())
            tracking = False

        # after many changes at once (more than ``rebuild``): the heap is built anew where next needed (``heap_anew``)
        rebuild, heap_anew = max(n // 4, 64), False

        def touched(ranks) -> None:  # new current entries for ranks whose load changed
            nonlocal heap_anew
            pending.extend(ranks)
            for q in ranks:
                lv[q], tv[q] = load[q], toks[q]
            if heap_anew or len(ranks) > rebuild:
                heap_anew = True
                return
            for q in ranks:
                heapq.heappush(heap, (max(load[q] / limit, toks[q] / cap), load[q], q, toks[q]))

        order, run_end = self.order, self.run_end
        count = len(order)
        whole_of, lens = self._whole, self.lens
        heappop, heapreplace = heapq.heappop, heapq.heapreplace
        while k < count:
            d = order[k]
            if not heap_anew and k >= force and run_end[k] - k < BATCH:  # the Whole-Doc step below, in short: the
                # top of the heap (stale entries dropped) has the least key, and where it fits, it is the rank
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
                    load[r], toks[r] = lv[r], tv[r] = lr, tr
                    pending.append(r)
                    heapreplace(heap, (y if y > x else x, lr, r, tr))  # (max(x, y), as max() picks)
                    k += 1
                    continue
            length = lens[d]
            if k >= force:
                w = whole_of[length]
                tok_room, work_room = cap - length, limit - w
                if run_end[k] - k >= BATCH:  # a run of equal lengths: place as many whole as the greedy would
                    before = (list(load), list(toks)) if tracking else None
                    placed = self._batch_whole(k, run_end[k], length, w, load, toks, limit, tracking, (lv, tv))
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
                # whether any rank fits (on the arrays by rank: only where the top of the heap does not fit)
                fits = tok_room >= 0 and np.logical_or.reduce((tv <= tok_room) & (lv <= work_room))
                r, skipped, at_top = -1, [], True
                if fits and heap_anew:  # one current entry per rank (the same divisions and maxima on arrays)
                    heap[:] = zip(np.maximum(lv / limit, tv / cap).tolist(), load, range(n), toks, strict=True)
                    heapq.heapify(heap)
                    heap_anew = False
                while fits and heap:
                    e = heap[0]
                    q = e[2]
                    if e[1] != load[q] or e[3] != toks[q]:
                        heappop(heap)  # stale
                        continue
                    if toks[q] <= tok_room and load[q] <= work_room:
                        r = q
                        break
                    skipped.append(heappop(heap))
                    if len(skipped) >= SKIP_MAX:  # many full ranks first: the least key that fits, on arrays
                        r, at_top = self._fitting(lv, tv, limit, tok_room, work_room), False
                        break
                if r >= 0:
                    doc_rank[d], doc_seq[d] = r, seq
                    seq += 1
                    load[r] += w
                    toks[r] += length
                    lv[r], tv[r] = load[r], toks[r]
                    pending.append(r)
                    entry = (max(load[r] / limit, toks[r] / cap), load[r], r, toks[r])
                    if at_top:
                        heapreplace(heap, entry)
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
            exchange(self, splits, load, toks)
        refine(self, doc_rank, doc_seq, load, toks, seq)
        if not splits and not any(p.segments) and doc_rank.min() >= 0:  # every document whole
            return ArrayPlacement.of_whole(n, doc_rank, self.starts_np, self.lens_np)
        whole = np.flatnonzero(doc_rank >= 0)
        ws = self.starts_np[whole]
        equal, sized = [sp for sp in splits if sp.equal], [sp for sp in splits if not sp.equal]
        return ArrayPlacement.sorted_from(n, [(doc_rank[whole], ws, ws + self.lens_np[whole]), p.arrays(),
                                              *([headtail_arrays(equal)] if equal else []),
                                              *([sized_arrays(sized)] if sized else [])])


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
        rooms = (ranked.load_of, ranked.toks_of)  # (current: the ranks were brought up to date before this)
        fill = self._fill(length, start, load, toks, limit, share, rooms) if cut else None
        if fill is not None and len(fill[0]) > 1:  # unequal parts by each rank's room
            members, sizes = fill
            splits.append(Split(start, length, dict(zip(members, sizes, strict=True)), False))
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
        splits.append(Split(start, length, dict(zip(group, tok, strict=True)), True))
        return group

