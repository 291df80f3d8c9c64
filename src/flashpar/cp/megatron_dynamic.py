"""Megatron-Core's dynamic (hybrid) context parallelism as a placement: a peer for the FlashCP planner.

Idea (Megatron-LM pull requests 2054 and 2282, described here in our own words; no code taken): instead
of one CP group for the whole packed sequence, every document gets a CP group of its own, a power of
two just large enough that its share per rank is no more than the mean per rank.  With ``N`` ranks and
``T`` tokens, ``t = T / N`` tokens per rank, document ``i`` of ``L_i`` tokens gets

    cp_i = 2^ceil(log2(L_i / t)),  clipped to [1, N]        (integers: the least power of two p with
                                                              p T >= L_i N; p > N becomes N)
    w_i  = L_i^2 / cp_i                                      its workload per member (causal pairs of a
                                                              head-tail member: L_i (L_i + 1) / (2 cp_i))

Placement (greedy, largest workload first, as LPT scheduling balances; ties: longer first, then index):

* ``cp_i = 1``: the document goes whole onto one rank, the one with the least causal work so far
  among the ranks with token room (``tokens_r + L_i <= cap``, ``cap = max(ceil(T / N), (1 + slack) T / N)``
  as the other planners use), else the least loaded of all.  Least-loaded-first by causal pairs is
  the rule Megatron's packing balances workload with; the token room keeps the linear layers
  (proportional to tokens) from piling onto the rank that holds many short documents.
* ``cp_i > 1``: the document is head-tail sharded (``2 cp_i`` chunks, member ``j`` takes chunks ``j``
  and ``2 cp_i - 1 - j``: ``L_i / cp_i`` tokens and about ``w_i / 2`` causal pairs each) over an aligned
  group ``[k cp_i, (k + 1) cp_i)``, ``0 <= k < N // cp_i`` (a power-of-two group never straddles two
  larger ones, as Megatron's sub-groups of the CP world do; where ``cp_i = N`` is no power of two, the
  group is every rank).  Among the groups whose members all have token room (else all groups), the one
  whose busiest member would be least loaded after taking its part; ties: least total load, lowest ``k``.

Only group sizes of powers of two, one size per document decided by its length alone, and whole
documents placed by causal work: what FlashCP searches beyond (arbitrary group sizes, unequal parts,
sizes chosen by the balance of the whole pack) is what this peer lacks.

K/V is sharding-aware (``comm = "aware"``, the same plan machinery and executor as FlashCP): a rank
receives only the keys its queries need, from the members of its documents' groups; a whole document
needs none.  In flight, for a document over the group [4, 8) of N = 8 (chunks c0..c7):

    rank 4: c0 c7   <- c1..c6 from ranks 5, 6, 7 (the keys before c7)
    rank 5: c1 c6   <- c0 (rank 4), c2..c5 (ranks 6, 7)
    rank 6: c2 c5   <- c0, c1, c3, c4
    rank 7: c3 c4   <- c0, c1, c2
    ranks 0..3: nothing of this document
"""

from __future__ import annotations

import heapq

import torch

from flashpar.cp.cp_plan import causal_pairs, doc_starts_of
from flashpar.cp.flashcp import token_cap
from flashpar.cp.strategies import Placement, chunk_bounds


def group_size(length: int, total: int, n: int) -> int:
    """``cp_i = 2^ceil(log2(L_i N / T))`` clipped to ``[1, N]``, in integers."""
    p = 1
    while p < n and p * total < length * n:
        p *= 2
    return min(p, n)


def groups_of(cp: int, n: int) -> list[list[int]]:
    """The aligned groups of ``cp`` ranks: ``[k cp, (k + 1) cp)``; every rank where ``cp == N``."""
    if cp >= n:
        return [list(range(n))]
    return [list(range(k * cp, (k + 1) * cp)) for k in range(n // cp)]


def member_shares(start: int, length: int, g: int) -> list[tuple[int, int]]:
    """(causal pairs, tokens) of each member of a head-tail group of ``g`` over one document."""
    if g == 1:
        return [(causal_pairs(start, start + length, start), length)]
    b = chunk_bounds(start, length, 2 * g)
    out = []
    for j in range(g):
        pieces = ((b[j], b[j + 1]), (b[2 * g - 1 - j], b[2 * g - j]))
        out.append((sum(causal_pairs(x, y, start) for x, y in pieces), sum(y - x for x, y in pieces)))
    return out


def megatron_dynamic(doc_lens: list[int], n: int, token_slack: float) -> Placement:
    """The placement of the module docstring: per-document power-of-two groups, largest ``L^2 / cp`` first."""
    total = sum(doc_lens)
    cap = token_cap(doc_lens, n, token_slack)
    starts = doc_starts_of(doc_lens)
    cps = [group_size(length, total, n) for length in doc_lens]
    order = sorted(range(len(doc_lens)), key=lambda d: (-(doc_lens[d] ** 2 / cps[d]), -doc_lens[d], d))
    load, toks = [0] * n, [0] * n
    heap = [(0, 0, r) for r in range(n)]  # (load, tokens, rank), lazily updated: stale entries are skipped
    waiting: list[tuple[int, int, int]] = []  # (tokens, load, rank): ranks without room (_least_loaded_with_room)
    p = Placement(n)
    for d in order:
        length, start, cp = doc_lens[d], starts[d], cps[d]
        shares = member_shares(start, length, cp)
        if cp == 1:
            members = [_least_loaded_with_room(heap, waiting, load, toks, length, cap)]
        else:
            members = _least_loaded_group(cp, n, shares, load, toks, cap)
        p.headtail(members, start, length)  # (a group of one: the whole document)
        for r, (w, t) in zip(members, shares, strict=True):
            if w or t or cp == 1:  # (a member of a document shorter than 2 cp_i may take nothing)
                load[r] += w
                toks[r] += t
                heapq.heappush(heap, (load[r], toks[r], r))
    for segs in p.segments:
        segs.sort()
    return p


def _least_loaded_group(cp: int, n: int, shares, load, toks, cap: int) -> list[int]:
    """Among the aligned groups of ``cp`` ranks (:func:`groups_of`; member ``j`` taking ``shares[j]`` = (pairs,
    tokens)), those whose members all keep within ``cap`` tokens (all groups if none does), the one whose busiest
    member would be least loaded after taking its part; ties: least total load, then the first.  Vectorised over
    the groups (integer tensors: exact)."""
    width = min(cp, n)
    count = n // width
    loads = torch.tensor(load[: count * width]).view(count, width)
    tks = torch.tensor(toks[: count * width]).view(count, width)
    w, t = torch.tensor([x for x, _ in shares]), torch.tensor([y for _, y in shares])
    fits = ((tks + t) <= cap).all(1)
    pool = fits if bool(fits.any()) else torch.ones_like(fits)
    peak = torch.where(pool, (loads + w).amax(1), torch.iinfo(torch.int64).max)
    pool &= peak == peak.min()
    total = torch.where(pool, loads.sum(1), torch.iinfo(torch.int64).max)
    k = int(torch.argmin(total))  # argmin: the first of the least
    return list(range(k * width, (k + 1) * width))


def _least_loaded_with_room(heap, waiting, load, toks, length: int, cap: int) -> int:
    """The rank of least causal work (then fewest tokens, lowest rank) with room for ``length`` more tokens,
    else the least loaded of all.

    ``heap`` holds ``(load, tokens, rank)``, ``waiting`` ``(tokens, load, rank)`` of the ranks found without room
    for an earlier document; entries are current where they match ``load`` and ``toks`` (stale ones are
    dropped when met).  Whole documents come longest first, so a rank without room for this one stays without
    it until the documents get short enough: it waits in ``waiting`` (fewest tokens first) and returns to
    ``heap`` then.  A rank thus moves between the two at most once per document it takes, plus once:
    O((documents + N) log N) in all.  The chosen rank's entry is removed (the caller pushes its new one)."""
    while waiting and waiting[0][0] + length <= cap:
        t, w, r = heapq.heappop(waiting)
        if (w, t) == (load[r], toks[r]):
            heapq.heappush(heap, (w, t, r))
    while heap:
        w, t, r = heapq.heappop(heap)
        if (w, t) != (load[r], toks[r]):
            continue  # stale: the rank's load changed since
        if t + length <= cap:
            return r
        heapq.heappush(waiting, (t, w, r))
    return min(range(len(load)), key=lambda q: (load[q], toks[q], q))  # no rank has room (rare: O(N))
