"""The last improving pass of a greedy placement: lower the busiest rank by moving one of its whole documents to the
least busy rank, or by swapping it for a lighter one there, while the peak drops (:func:`refine`; whole documents
receive no K/V, so these moves cost no communication)."""

from __future__ import annotations

import numpy as np

from flashpar.cp.flashcp.rankdocs import RankDocs
from flashpar.cp.flashcp.work import DocWork

_UNSURE = object()
""":func:`_best_move_rows` could not be sure of its answer."""


def refine(work: DocWork, doc_rank, doc_seq, load, toks, seq: int) -> None:
    """Lower the busiest rank by moving one of its Whole-Doc documents to the least busy rank, or by
    swapping one for a lighter one there (no K/V cost: whole documents need none), while the peak drops.

    Each step takes, over every document ``a`` of the busiest rank and every option ``b`` of the least
    busy (nothing, or one of its documents) within the token cap, the lowest peak
    ``max(H - w_a + w_b, L + w_a - w_b)``, the first in (``a``, then nothing, then ``b``) order on ties
    (see :func:`best_move`).  A rank's documents are kept in the order it received them (``doc_seq``);
    per length only the first can be chosen (``w`` is a function of the length), so each rank holds, per
    length, its documents of that length in that order (:class:`RankDocs`, built when the rank is first
    met)."""
    whole = np.flatnonzero(doc_rank >= 0)
    if not len(whole):
        return
    docs_of = RankDocs.all_ranks(whole, work.n, doc_rank, work.lens_np, doc_seq, seq, work._whole, True,
                                  work.works_rise, work.doc_work)  # (one sort of them all)

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
        best = best_move(work, docs_of(hi), docs_of(lo), load[hi], load[lo], toks[hi], toks[lo])
        if best is None:
            return
        la, lb = best
        seq = move(hi, lo, la, seq)
        wa, wb = work.whole(la), 0.0
        if lb is not None:
            seq = move(lo, hi, lb, seq)
            wb = work.whole(lb)
        load[hi] += wb - wa
        load[lo] += wa - wb
        toks[hi] += (lb or 0) - la
        toks[lo] += la - (lb or 0)


def best_move(work: DocWork, hi_docs: RankDocs, lo_docs: RankDocs, h: float, low: float, tok_hi: int, tok_lo: int):
    """``(la, lb)``: move the first document of length ``la`` of the busiest rank (load ``h``) to the least
    busy (load ``low``) and its first of length ``lb`` back (``None``: nothing back), the pair of lowest
    peak ``p = max(h - w_a + w_b, low + w_a - w_b)`` below ``h (1 - 1e-12)`` with both ranks within the
    token cap, the first on equal peaks in (the busiest rank's order of its documents, then nothing, then
    the least busy rank's order); ``None`` if no pair lowers the peak.  ``*_docs``: per length a rank
    holds, (lengths, compute, place in its order of the first document of that length) (``RankDocs.arrays``).
    All pairs at once (lengths x lengths, in numpy; on large tables at most two options per row first, see
    :func:`_best_move_rows`), each peak rounded as the step writes it."""
    if not len(hi_docs.lens):
        return None
    la, wa, sa = hi_docs.arrays()
    ol, ow, oj, rising = lo_docs.other_arrays()  # nothing first on ties
    if len(la) * len(ol) > 2048:
        found = _best_move_rows(work, la, wa, sa, ol, ow, oj, rising, h, low, tok_hi, tok_lo) if rising else _UNSURE
        if found is not _UNSURE:
            return found
    cap = work.cap
    feasible = (ol[None, :] >= (la + tok_lo - cap)[:, None]) & (ol[None, :] <= (cap - tok_hi + la)[:, None])
    peak = np.maximum((h - wa)[:, None] + ow[None, :], (low + wa)[:, None] - ow[None, :])
    peak = np.where(feasible & (peak < h - 1e-12 * abs(h)), peak, np.inf)
    best = peak.min()
    if best == np.inf:
        return None
    ii, jj = np.nonzero(peak == best)
    k = np.lexsort((oj[jj], sa[ii]))[0]
    return int(la[ii[k]]), (None if jj[k] == 0 else int(ol[jj[k]]))


def _best_move_rows(work: DocWork, la, wa, sa, ol, ow, oj, rising: bool, h: float, low: float, tok_hi: int,
                    tok_lo: int):
    """:func:`best_move` (on its arrays: the options ``ol``, ``ow``, ``oj`` of the least busy rank, nothing
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
    cap = work.cap
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
