"""The search's choice among candidate placements: distinct placements in the order they are compared
(:func:`unique_placements`), the best-balanced with attention work alone (:func:`balanced`), and otherwise the fewest
K/V among the fastest (:func:`pick`)."""

from __future__ import annotations

import numpy as np

from flashpar.cp import window as band
from flashpar.cp.cost import CostModel
from flashpar.cp.strategies import ArrayPlacement

BALANCE = 0.03
"""Attention-work imbalance (max / mean) a candidate may have and still compete, attention alone."""
TIME_TIE = 0.002
"""Step times within this fraction of the fastest candidate's count as equal (then fewer K/V bytes win)."""
PERFECT = 1e-4
"""The search ends after its first pass and the baselines where their pick receives no K/V and is estimated within
this fraction of the lower bound (the mean compute with every document whole): no other candidate could be more
than 0.01% faster, nor receive less (packs of many short documents, where the knobs change nothing that matters)."""


def unique_placements(placements: list[ArrayPlacement]) -> list[ArrayPlacement]:
    """Distinct placements (the knobs often agree), each the first of its equals, ordered by where the last of
    its equals stands (the order the search compares them in: ties go to the earlier)."""
    first: dict[bytes, ArrayPlacement] = {}
    last: dict[bytes, int] = {}
    for i, p in enumerate(placements):
        k = p.key()
        first.setdefault(k, p)
        last[k] = i
    return [first[k] for k in sorted(last, key=last.__getitem__)]


def balanced(placements: list[ArrayPlacement], doc_starts, cap: int, window: int | None = None) -> list[int]:
    """Attention work alone (``CostModel(linear=False)``): the candidates within the token cap (all, if none
    is) whose attention work (causal pairs, max / mean over ranks, :func:`pair_balance`) is within ``BALANCE`` of
    perfect balance, or within 0.5% of the best reached.  Without linear work to hide it, K/V traffic would otherwise
    outweigh balance, which is what the attention-only comparison is about; counting pairs is cheaper than figures.
    ``doc_starts``: the documents' starts, an int64 array; ``window``: count a sliding window's pairs
    (``CostModel.window``)."""
    imbalance, tokens = zip(*(pair_balance(p, doc_starts, window) for p in placements), strict=True)
    idx = [i for i, t in enumerate(tokens) if t <= cap] or list(range(len(tokens)))
    budget = max(1 + BALANCE, 1.005 * min(imbalance[i] for i in idx))
    return [i for i in idx if imbalance[i] <= budget]


def pair_balance(p: ArrayPlacement, doc_starts, window: int | None = None) -> tuple[float, int]:
    """(max / mean over ranks of the causal pairs a rank's queries hold, 1.0 where there are none; the most tokens
    of a rank).  A piece ``[a, b)`` of the document starting at ``s`` (the last start at or before ``a``) holds
    ``(b - a)(a + b - 2s + 1) / 2`` pairs (:func:`~flashpar.cp.cp_plan.causal_pairs`), added per rank in int64
    (exact); the ratio is taken on Python integers, as sums of Python integers give it.  Under ``window``, the
    windowed pairs (:func:`flashpar.cp.window.pairs`)."""
    s = doc_starts[np.searchsorted(doc_starts, p.a, side="right") - 1]
    span = p.b - p.a
    per_rank, toks = np.zeros(p.n, dtype=np.int64), np.zeros(p.n, dtype=np.int64)
    np.add.at(per_rank, p.rank, band.pairs(p.a - s, p.b - s, window))
    np.add.at(toks, p.rank, span)
    pairs = per_rank.tolist()
    mean = sum(pairs) / len(pairs)
    return (max(pairs) / mean if mean > 0 else 1.0), int(toks.max())


def pick(figs, cap: int, baseline: list[bool], cost: CostModel) -> int:
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
