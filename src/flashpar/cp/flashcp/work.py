"""What a document costs: its compute whole (linear work plus attention over its causal pairs), the compute and tokens
of each member of a head-tail group over it, and of each member of an unequal split; the documents in the order a
greedy pass takes them (longest first), and the mean compute per rank ``W``.

A document of ``L`` tokens whole: ``L`` tokens of linear work and ``L (L + 1) / 2`` causal pairs; a piece ``[x, y)``
of it: ``y - x`` tokens and ``(y - x)(x + y + 1) / 2`` pairs, run as the default backend runs them: its causal square
and a full task per member holding keys ahead of it, each at its own shape (``CostModel.piece_cost``: the
piece's length, the ``x`` keys ahead and how many members hold them)."""

from __future__ import annotations

import functools
import math

import numpy as np

from flashpar.cp.cost import CostModel
from flashpar.cp.cp_plan import whole_doc_times
from flashpar.cp.flashcp.arrays import falls_to_nonnegative, ints

SHARE_BLOCK = 512
"""Members of head-tail groups over one document whose compute is made at once: consecutive sizes of
:func:`group_sizes` up to this many members in all (one pass over arrays costs about what one size alone does)."""


def group_sizes(n: int) -> list[int]:
    """Head-tail group sizes the group search tries at ``n`` ranks: every size up to 8, then about 1.25x apart, and
    ``n`` itself (Per-Doc)."""
    sizes, g = [], 2
    while g < n:
        sizes.append(g)
        g = g + 1 if g < 8 else math.ceil(g * 1.25)
    return [*sizes, n] if n >= 2 else []


def token_cap(doc_lens: list[int], n: int, token_slack: float, total: int | None = None) -> int:
    """``max(ceil(T / N), (1 + token_slack) T / N)``; ``total``: ``T``, where the caller has it."""
    total = sum(doc_lens) if total is None else total
    return max(-(-total // n), int((1 + token_slack) * total / n))



class DocWork:
    """The documents of one pack over ``n`` ranks under one cost model and token cap, with their costs per length
    (and per (length, group size)) cached."""

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
        self._big: dict[tuple[int, int], tuple] = {}  # per (length, g): _share_arrays
        self._tok_arrays: dict[tuple[int, int], np.ndarray] = {}  # per (length, g): _share_tokens
        self.sizes = group_sizes(n)
        self._block_of: dict[int, np.ndarray] = {}  # per size: the sizes whose shares are made with it (SHARE_BLOCK)
        block: list[int] = []
        for g in [*self.sizes, None]:
            if block and (g is None or sum(block) + g > SHARE_BLOCK):
                arr = np.asarray(block, dtype=np.int64)
                self._block_of.update(dict.fromkeys(block, arr))
                block = []
            if g is not None:
                block.append(g)
        self._whole_times = None
        whole_runs = self._whole_arrays(distinct, keep=True)
        self.doc_work = whole_all = whole_runs[self.doc_run]  # (each document's whole compute: whole(length))
        self.works_rise = falls_to_nonnegative(whole_runs)  # (longest first: rising with the length)
        self._whole = dict(zip(distinct.tolist(), whole_runs.tolist(), strict=True))
        # (added in document order: cumsum adds in order, as sum() of floats does)
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
        attn = cost.attn_times(cost.square_pairs(lens), q, q)
        if keep:
            self._run_attn = attn
        return q * cost.flops_per_token / cost.hardware.gemm_flops + attn

    def whole(self, length: int) -> float:
        if length not in self._whole:
            self._whole[length] = self.cost.linear_time(length) + self.cost.attn_time(
                self.cost.square_pairs(length), length, length)
        return self._whole[length]

    def shares(self, length: int, g: int) -> tuple[list[float], list[int]]:
        """Compute and tokens of each member of a head-tail group of ``g`` over one document (lists of
        :meth:`_share_arrays`)."""
        if g == 1:
            return [self.whole(length)], [length]
        key = (length, g)
        if key not in self._shares:
            work, tok = self._share_arrays(length, g)
            self._shares[key] = (work.tolist(), tok.tolist())
        return self._shares[key]

    def _share_arrays(self, length: int, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Compute and tokens of each member of a head-tail group of ``g`` over one document, as arrays (see
        :meth:`_share_rows`); made with those of the neighbouring sizes of :func:`group_sizes` (``SHARE_BLOCK``)."""
        key = (length, g)
        if key not in self._big:
            block = self._block_of.get(g)
            gs = block if block is not None else np.asarray([g], dtype=np.int64)
            work, n_tok = self._share_rows(length, gs)
            at = 0
            for size in gs.tolist():
                self._big[(length, size)] = (work[at:at + size], n_tok[at:at + size])
                at += size
        return self._big[key]

    def _share_rows(self, length: int, gs) -> tuple[np.ndarray, np.ndarray]:
        """Compute and tokens of each member of head-tail groups of each size of ``gs`` over one document, the groups'
        members one after another: member ``i`` of ``g`` holds chunks ``i`` and ``2g - 1 - i`` of ``2g``; each
        piece's time (``CostModel.piece_cost``: its causal square, a full task per member holding keys ahead of it,
        their launches; ``headtail_holders`` within its group), the head's and the tail's added, then the linear
        time.  Elementwise: a group's floats do not depend on the others'."""
        m = int(gs.sum())
        first = np.cumsum(gs) - gs
        two = np.repeat(2 * gs, gs)
        i = np.arange(m, dtype=np.int64) - np.repeat(first, gs)
        x = length * np.concatenate((i, two - 1 - i)) // np.concatenate((two, two))  # heads, then tails
        y = length * np.concatenate((i + 1, two - i)) // np.concatenate((two, two))
        n_tok = (y[:m] - x[:m]) + (y[m:] - x[m:])
        head, tail = (y[:m] > x[:m]).astype(np.int64), (y[m:] > x[m:]).astype(np.int64)
        # headtail_holders within each group: the nonempty heads before a head; every nonempty head of its group and
        # the later members holding a tail and no head, for a tail
        upto = np.cumsum(head)
        before = upto - head - np.repeat(upto[first] - head[first], gs)
        heads = np.repeat(np.add.reduceat(head, first), gs)
        tail_only = tail * (1 - head)
        upto_t = np.cumsum(tail_only)
        later = np.repeat(upto_t[first + gs - 1], gs) - upto_t  # (the group's tail-only members after each)
        t = self._piece_time(x, y, np.concatenate((before, heads + later)))
        return (t[:m] + t[m:]) + n_tok.astype(np.float64) * (
            self.cost.flops_per_token) / self.cost.hardware.gemm_flops, n_tok

    def _share_tokens(self, length: int, g: int) -> np.ndarray:
        """The tokens of :meth:`_share_arrays` alone (chunks ``i`` and ``2g - 1 - i`` of ``2g``)."""
        key = (length, g)
        if key not in self._tok_arrays:
            i = np.arange(g, dtype=np.int64)
            two = 2 * g
            self._tok_arrays[key] = (length * (i + 1) // two - length * i // two) + (
                length * (two - i) // two - length * (two - 1 - i) // two)
        return self._tok_arrays[key]

    def _piece_time(self, x, y, holders):
        """``CostModel.piece_cost`` of the pieces ``[x, y)`` of a document from 0, the keys ahead of each held by
        ``holders`` members, on arrays (the same floats; an empty piece: 0)."""
        return self.cost.piece_costs(y - x, x, holders)


    def sized_work(self, start: int, length: int, sizes: list[int], as_array: bool = False):
        """Compute of each member of an unequal head-tail split (pieces as placed: member ``i`` takes the next
        ``s_i // 2`` tokens from the front and the next ``s_i - s_i // 2`` from the back, the last member the
        middle as one piece; each piece's time as :meth:`_piece_time`, then the linear time), a list
        (``as_array``: a float64 array).  ``start``: the document's start (the pieces' times depend only on where
        they sit in the document)."""
        if sum(sizes) != length:
            raise ValueError(f"sizes {sizes} do not add up to the document's {length} tokens")
        s = ints(sizes)
        h = s // 2
        h[-1] = s[-1]  # the last member: one piece, the middle
        head0 = np.concatenate(([0], np.cumsum(h)[:-1]))  # (from the document's start)
        tail1 = length - np.concatenate(([0], np.cumsum(s - h)[:-1]))
        tail0 = tail1 - (s - h)
        tail0[-1] = tail1[-1]
        m = headtail_holders(h > 0, tail1 > tail0)  # (the last member's middle as its head)
        g = len(s)
        t = self._piece_time(np.concatenate((head0, tail0)), np.concatenate((head0 + h, tail1)), m)  # (heads, tails)
        work = (t[:g] + t[g:]) + s.astype(np.float64) * (self.cost.flops_per_token) / self.cost.hardware.gemm_flops
        return work if as_array else work.tolist()


def headtail_holders(head, tail):
    """:func:`chunk_holders` of a head-tail split on arrays (``head``, ``tail``: whether member ``i``'s head and tail
    are nonempty; heads in member order, then tails in reverse): ``(per member, its head's; its tail's)``.  A head
    has the nonempty heads before it ahead; a tail every nonempty head and the nonempty tails of later members."""
    head, tail = np.asarray(head, dtype=np.int64), np.asarray(tail, dtype=np.int64)
    before = np.cumsum(head) - head
    tail_only = tail * (1 - head)
    later = tail_only[::-1].cumsum()[::-1] - tail_only  # members after i holding a tail and no head
    return np.concatenate((before, head.sum() + later))

