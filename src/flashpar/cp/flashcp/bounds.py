"""Lower bounds on the estimated step time of the baselines, from the documents alone (no placement made): the search
skips a baseline whose bound is slower than its fastest candidate by more than a tie (such a baseline could be neither
the pick nor tied with it, nor lower the bound the baselines set on the pick)."""

from __future__ import annotations

import math

import numpy as np

from flashpar.cp.cost import CostModel


def whole_doc_bound(lens, n: int, cost: CostModel, cap: int, whole_times) -> float:
    """A lower bound on the estimated step time of the ``whole_doc`` baseline: the mean compute per rank, with
    every document longer than the token cap (it fits whole on no rank) Per-Doc over all ``N`` ranks (what
    ``whole_doc`` does with it: ``2N`` chunks, bounded as in :func:`cut_all_bound`, its tasks and launches too) and
    every other one at its attention time whole (``whole_times``, :func:`~flashpar.cp.cp_plan.whole_doc_times`; one
    that ends up cut only costs more), plus the linear work.  Less a millionth for rounding."""
    long = lens > cap
    if not np.logical_or.reduce(long):  # (none: the same sum, of the same array)
        attn = 0.0 + float(whole_times.sum())
        return (attn + cost.linear_time(int(lens.sum()))) / n * (1 - 1e-6)
    cut = lens[long]
    attn = float(cut_attn(cut, n, cost).sum()) + float(split_tasks(cut, n, cost).sum()) + float(
        whole_times[~long].sum())
    return ((attn + cost.linear_time(int(lens.sum()))) / n + split_launches(cut, n, cost)) * (1 - 1e-6)


def ring_bound(lens, starts, n: int, cost: CostModel, whole_times) -> tuple[float, tuple[int, int]]:
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


def cut_attn(lens, n: int, cost: CostModel, runs=None):
    """Per document cut into ``2N`` chunks: a lower bound on its attention time (see :func:`cut_all_bound`).
    ``runs``: (the distinct lengths, each document's place among them): the same floats, once per length."""
    if runs is not None:
        return cut_attn(runs[0], n, cost)[runs[1]]
    L = lens.astype(np.float64)
    return cost.attn_times(cost.square_pairs(lens), np.ceil(L / (2 * n)) if n > 1 else L, L)


def cut_all_bound(lens, n: int, cost: CostModel, runs=None) -> float:
    """A lower bound on the estimated step time of ``per_doc`` and ``torch_per_doc`` (every document cut into 2N
    chunks, torch's further cut at shard boundaries): the mean compute per rank, each document's causal pairs
    at the efficiency of its longest possible piece (``ceil(L / 2N)`` queries over ``L`` keys; efficiency
    rises with both, and a piece cut further only loses), plus the linear work.  Less a millionth for rounding.
    ``runs``: see :func:`cut_attn`."""
    return (float(cut_attn(lens, n, cost, runs).sum()) + cost.linear_time(int(lens.sum()))) / n * (1 - 1e-6)


def per_doc_bound(lens, n: int, cost: CostModel, runs=None) -> float:
    """A lower bound on the estimated step time of ``per_doc`` (rank ``r`` holds chunks ``r`` and ``2N - 1 - r`` of
    every document): :func:`cut_all_bound`'s, with each document's tasks beyond one per piece
    (:func:`split_tasks`) and the launches (:func:`split_launches`) added.  (Not ``torch_per_doc``'s: its shards
    can hold a document's chunks on fewer ranks.)"""
    tasks = split_tasks(lens, n, cost) if runs is None else split_tasks(runs[0], n, cost)[runs[1]]
    attn = float(cut_attn(lens, n, cost, runs).sum()) + float(tasks.sum())
    return ((attn + cost.linear_time(int(lens.sum()))) / n + split_launches(lens, n, cost)) * (1 - 1e-6)


def split_tasks(lens, n: int, cost: CostModel):
    """Per document (``lens``, an int64 array) cut into ``2N`` chunks over ``N`` ranks (rank ``r``: chunks ``r`` and
    ``2N - 1 - r``): a lower bound on the attention time of its full tasks beyond one task per piece, 0 where
    ``L < 2N`` (where a chunk may be empty).

    A piece of ``l`` queries with keys ahead on ``h >= 1`` ranks runs ``h`` full tasks, ``fpp (l + c)(x + h c) /
    (flops attn_peak)`` in all (``CostModel.full_attn_time``, ``x`` the keys ahead, ``c = attn_half``): one task
    over the ``x`` keys (whose time :func:`cut_attn` bounds) and ``fpp (l + c)(h - 1) c / (flops attn_peak)`` more.
    With every chunk holding ``l >= floor(L / 2N)`` tokens, the head chunk ``j`` has ``h = j`` and every tail ``h =
    N``: ``sum (h - 1) = (N - 1)(N - 2) / 2 + N (N - 1)`` over the pieces.  A piece cut further (torch) only adds
    tasks: its parts have no fewer ranks ahead and their ``l + c`` add up to more (in ``whole_doc``, the ranks in
    another order: the same counts)."""
    hw = cost.hardware
    extra = (n - 1) * (n - 2) // 2 + n * (n - 1)
    per_doc = cost.flops_per_pair * ((lens // (2 * n)).astype(np.float64) + hw.attn_half) * hw.attn_half * extra / (
        hw.flops * hw.attn_peak)
    return np.where(lens >= 2 * n, per_doc, 0.0)


def split_launches(lens, n: int, cost: CostModel) -> float:
    """A lower bound on each rank's launches where some document of ``lens`` is cut into ``2N`` chunks over ``N >= 2``
    ranks with no chunk empty (``L >= 2N``): its tail chunk has keys ahead on every other rank, a full task on each
    of their buffers, and tasks on different buffers never share a kernel call (:mod:`flashpar.cp.calls`); with its
    causal square, ``N`` calls, a launch (``gemm_overhead_s``) each."""
    if n < 2 or not np.logical_or.reduce(lens >= 2 * n):
        return 0.0
    return n * cost.hardware.gemm_overhead_s

