"""Trades between ranks under and over the mean compute of parts of split documents, tokens for tokens
(:func:`exchange`): a rank full of a document light per token gives some of it to a busy rank for as many tokens of a
heavier one, which moves compute without moving the token counts::

    u (under W, at the cap):  [ B B B B B B | X X ]   ->  [ B B B B | X X X X ]
    v (over W):               [ X X X X | B ]         ->  [ X X | B B B ]
"""

from __future__ import annotations

import bisect

import numpy as np

from flashpar.cp.flashcp.arrays import floats
from flashpar.cp.flashcp.splits import Split
from flashpar.cp.flashcp.work import DocWork

EXCHANGE_GAP = 0.01
"""Ranks trade split parts only when this far under (and, the taker, within this of the token cap) or over
the mean compute."""
EXCHANGE_MIN = 64
"""Fewest tokens a trade moves (smaller ones add members for little balance)."""


def exchange(work: DocWork, splits: list[Split], load, toks) -> None:
    """Trade parts of split documents between ranks under and over the mean compute ``W``, tokens for tokens.

    A rank ``u`` under ``W`` and near the token cap (typically full of a document light per token, which
    the pass had nowhere else to put) gives ``x`` tokens of a split document ``B`` to a rank ``v`` over
    ``W`` and takes ``x`` tokens of a heavier split document ``X`` from it: token counts stay, and
    ``(w_X - w_B) x`` compute moves from ``v`` to ``u`` (``w = W_d / L_d``, compute per token), with
    ``x`` the most that takes neither past ``W``.  Lightest ``B`` first, busiest ``v`` first, heaviest
    ``X`` first.  Both documents' parts become unequal (laid out by ``Placement.headtail_sized``)."""
    mean = work.mean
    over = sorted((r for r in range(work.n) if load[r] > mean * (1 + EXCHANGE_GAP)), key=lambda r: -load[r])
    under = sorted((r for r in range(work.n) if load[r] < mean * (1 - EXCHANGE_GAP)
                    and toks[r] > work.cap * (1 - EXCHANGE_GAP)), key=load.__getitem__)
    if not over or not under or not splits:
        return
    rate = [work.whole(sp.length) / sp.length for sp in splits]
    # The scan, per (u, B): over v (busiest first) and its X (heaviest first), trade where the move is at least
    # EXCHANGE_MIN; X stops at the first no heavier than B.  Between two trades nothing changes, so each step
    # finds the next trade of the scan at once: every (v, X) pair of the scan as arrays, in scan order, with
    # the part of X on v (0 once v holds none) and v's load kept in step with the trades.
    pairs = scan_pairs(work, splits, over, rate, load)
    if pairs is None:
        return
    held, pv, px, prate, ppart, excess, pair_at, rows_of = pairs
    rates_sorted = sorted(set(prate.tolist()))
    with np.errstate(divide="ignore", invalid="ignore"):  # (see next_trade)
        _trades(work, under, held, rate, rates_sorted, splits, load, pv, px, prate, ppart, excess, pair_at, rows_of)


def scan_pairs(work: DocWork, splits: list[Split], over: list[int], rate: list[float], load):
    """:func:`exchange`'s pairs (see there): (the splits each rank has a part of, as sets; each pair's
    v and X, lists; X's rate, X's part on v and v's load over the mean, arrays; each pair's row by (v, X); each
    v's rows), or None where there are none."""
    held: list[set[int]] = [set() for _ in range(work.n)]  # the splits each rank has a part of
    for i, sp in enumerate(splits):
        for r in sp.parts:
            held[r].add(i)
    # the splits of each rank over the mean, heaviest first (what a trade gives it is not offered again)
    heaviest = {v: sorted(held[v], key=lambda i: -rate[i]) for v in over}
    pv = [v for v in over for _ in heaviest[v]]
    px = [x for v in over for x in heaviest[v]]
    if not px:
        return None
    prate = floats(rate)[px]
    ppart = np.asarray([splits[x].parts.get(v, 0) for v, x in zip(pv, px, strict=True)], dtype=np.float64)
    excess = floats([load[v] for v in pv]) - work.mean  # (v's load over the mean, per pair)
    pair_at = {vx: i for i, vx in enumerate(zip(pv, px, strict=True))}
    rows_of: dict[int, list[int]] = {}
    for i, v in enumerate(pv):
        rows_of.setdefault(v, []).append(i)
    rows_of = {v: np.asarray(rows, dtype=np.int64) for v, rows in rows_of.items()}
    return held, pv, px, prate, ppart, excess, pair_at, rows_of


def _trades(work: DocWork, under, held, rate, rates_sorted, splits, load, pv, px, prate, ppart, excess, pair_at,
            rows_of) -> None:
    """The trades of :func:`exchange`'s scan (see there), in order."""
    mean = work.mean
    # (for long scans, see next_trade: the pairs by rate, with their rates, parts and excesses in that order,
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
                i = next_trade(pos, prate, rate[b], ppart, excess, mean - load[u], by_rate)
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


def next_trade(pos: int, prate, rate_b: float, ppart, excess, room: float, by_rate=None) -> int:
    """The first pair ``i >= pos`` of :func:`exchange`'s scan that trades (its X heavier than B, of rate
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

