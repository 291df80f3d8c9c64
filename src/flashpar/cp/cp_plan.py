"""``CPPlan``: which tokens of a packed sequence each context-parallel rank holds, and what it receives.

A plan is data: for every rank, the global token ranges it holds (``segments``, in the rank's
local order; a range never crosses a document boundary) and how K/V travels (``comm``):

* ``"aware"``: sharding-aware.  A rank receives exactly the keys its queries attend to under
  the causal document mask, from the rank that holds them: for each document it holds part of,
  the keys ``[doc start, end of its last piece)`` that it does not hold itself.
* ``"all"``: every rank receives every other rank's K/V (ring passing or all-gather), as
  context parallelism without document awareness does.

Everything else (local indices, position and document ids, receive lists, statistics) is
derived, so a plan serialises to a few numbers per piece and runs in a data-loader worker.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
from dataclasses import dataclass, field

import numpy as np
import torch

from flashpar.cp import window as band
from flashpar.cp.calls import ahead, full_calls, square_calls
from flashpar.cp.cost import CostModel

Segment = tuple[int, int]


def doc_starts_of(doc_lens) -> list[int]:
    out = list(itertools.accumulate(doc_lens, initial=0))
    out.pop()
    return out


def causal_pairs(a: int, b: int, s: int) -> int:
    """Pairs (q, k) with ``q`` in ``[a, b)`` and key ``k`` in ``[s, q]`` (document starting at ``s``)."""
    return (b - a) * (a + b - 2 * s + 1) // 2


@dataclass(frozen=True)
class RankFigures:
    """Per-rank work and traffic, from the cost model (times in seconds)."""

    tokens: list[int]
    attn_pairs: list[int]
    recv_tokens: list[int]
    compute: list[float]  # linear + all attention, its kernel launches included
    remote: list[float]  # attention whose keys come from other ranks, its launches included
    comm: list[float]
    time: list[float]  # max(compute, comm + remote)
    step: float  # the plan's estimated step: CostModel.step_time (the slowest rank's time, unless ranks share cores)
    calls: list[int]  # attention kernel calls of the rank, one direction (flashpar.cp.calls)
    launch: list[float]  # their launch time (calls x gemm_overhead_s), within compute


def rank_figures(segments, doc_lens, doc_starts, cost: CostModel, comm: str) -> RankFigures:
    """Work and traffic of every rank of a placement (the planner scores candidates with this).

    Per rank, over its pieces ``[a, b)`` in token order (document ``d`` from ``s``; ``L = b - a``), the kernel calls
    the default backend makes (:mod:`flashpar.cp.calls`): the causal square ``(L, L)`` on local keys, and per rank
    ``o`` holding ``h_o`` tokens of ``d`` before ``a`` a full task ``(L, h_o)``, local where ``o`` is the rank, else
    remote; each at the efficiency of its own shape (``CostModel.attn_times``), and one launch
    (``gemm_overhead_s``) per batch of them, local or remote as the batch's keys are.  ``p = causal_pairs(a, b, s)``
    pairs in all.  It receives, per document, ``[s, end of its last piece)`` less what it holds.  Computed on arrays
    (numpy), the per-rank sums taken in token order."""
    n = len(segments)
    counts = np.fromiter((len(s) for s in segments), dtype=np.int64, count=n)
    m = int(counts.sum())
    flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(segments)), dtype=np.int64,
                       count=2 * m).reshape(m, 2)
    rank = np.repeat(np.arange(n, dtype=np.int64), counts)
    return figures_of_arrays(rank, flat[:, 0], flat[:, 1], n, sum(doc_lens), doc_starts, cost, comm)


def by_rank_start(rank, a):
    """The order that sorts pieces by (rank, start), the one ``np.lexsort((a, rank))`` gives (stable); None where
    they already are so (checked for 1,000 pieces or more).  Pieces of a placement never share a start, so their
    (rank, start) keys are distinct and one sort of ``rank * span + a`` (any sort: distinct keys have one order)
    gives that order; with ties, lexsort."""
    m = len(a)
    if m < 2:
        return None
    if m < 1000:  # (few pieces: one lexsort costs less than the checks)
        return np.lexsort((a, rank))
    span = int(a.max()) + 1
    if a.min() < 0 or rank.min() < 0 or (int(rank.max()) + 1) * span >= 1 << 62:  # (no such placements)
        return np.lexsort((a, rank))
    key = rank * span + a
    if (key[1:] > key[:-1]).all():
        return None
    order = np.argsort(key)
    k = key[order]
    return order if (k[1:] > k[:-1]).all() else np.lexsort((a, rank))


def figures_of_arrays(rank, a, b, n: int, total: int, doc_starts, cost: CostModel, comm: str,
                      whole=None) -> RankFigures:
    """:func:`rank_figures` of the pieces ``[a_i, b_i)`` held by ``rank_i`` (arrays, in any order).  ``whole``:
    (lengths, :func:`whole_doc_times`) of the documents, where known: a piece that is a whole document then takes its
    time from there (the same float) and the formulas below run on the other pieces alone (a whole document is a
    group of its own, receives nothing, has no full task and no remote work, and adding 0.0 changes no sum; the
    kernel calls of its causal square are counted with every piece's)."""
    order = by_rank_start(rank, a)  # per rank, by start: sorted(segs)
    if order is not None:
        a, b, rank = a[order], b[order], rank[order]
    starts = doc_starts if isinstance(doc_starts, np.ndarray) else np.asarray(doc_starts, dtype=np.int64)
    doc = np.searchsorted(starts, a, side="right") - 1
    s = starts[doc]
    length = b - a
    pairs = band.pairs(a - s, b - s, cost.window)
    counts = np.bincount(rank, minlength=n)
    tokens_r, pairs_r = _int_sums(rank, length, n, total), _int_sums(rank, pairs, n, total)
    part = None  # the pieces that are not whole documents (None: all)
    if whole is not None:
        lens, times = whole
        part = np.flatnonzero((a != s) | (length != lens[doc]))
        if len(part) * 2 > len(a):  # (mostly cut: the formulas on all of them)
            part = None
    if part is None:
        local_t, remote_t, recv_r, part_counts, calls = _cut_figures(rank, a, b, doc, s, length, n, total, cost)
    else:
        local_t = times[doc]
        if len(part):
            lt_p, remote_t, recv_r, part_counts, calls = _cut_figures(rank[part], a[part], b[part], doc[part], s[part],
                                                                      length[part], n, total, cost)
            local_t[part] = lt_p
        else:
            remote_t, recv_r, part_counts = np.zeros(0), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
            calls = (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
    lt, rt = _sums_in_order(local_t, counts), _sums_in_order(remote_t, part_counts)
    recv = (total - tokens_r) if comm == "all" and cost.window is None else recv_r
    return _figures(tokens_r, pairs_r, recv, lt, rt, square_calls(rank, length, n) + calls[0], calls[1], cost)


def _figures(tokens_r, pairs_r, recv, lt, rt, local_calls, remote_calls, cost: CostModel) -> RankFigures:
    """Per-rank sums (arrays: tokens, pairs, tokens received, local and remote attention time, kernel calls on local
    and on remote keys) -> RankFigures: each call adds a launch to its side, ``compute = linear_time(tokens) + lt +
    rt``, the K/V time, ``max(compute, comm + rt)`` and the step."""
    hw = cost.hardware
    lt = lt + local_calls * hw.gemm_overhead_s
    rt = rt + remote_calls * hw.gemm_overhead_s
    compute = tokens_r * cost.flops_per_token / hw.gemm_flops + lt + rt  # linear_time(tokens) + lt + rt
    comm_t = (recv * cost.kv_bytes_per_token) / hw.link_bytes_per_s
    time = np.maximum(compute, comm_t + rt)
    calls = local_calls + remote_calls
    return RankFigures(tokens_r.tolist(), pairs_r.tolist(), recv.tolist(), compute.tolist(), rt.tolist(),
                       comm_t.tolist(), time.tolist(), cost.step_time(compute, rt, comm_t), calls.tolist(),
                       (calls * hw.gemm_overhead_s).tolist())


def _cut_figures(rank, a, b, doc, s, length, n: int, total: int, cost: CostModel):
    """Per piece (sorted by rank and start; ``doc`` and its start ``s``), its local and remote attention time: its
    causal square and full task on its own rank's keys ahead, its full tasks on the other ranks' (closed form,
    ``CostModel.full_attn_times``); per rank, the tokens it receives (sharding-aware), its count of pieces and the
    kernel calls of its full tasks on local and on remote keys (:mod:`flashpar.cp.calls`)."""
    m = len(a)
    # groups: consecutive pieces of one document on one rank
    new = np.ones(m, dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1])
    csum = np.cumsum(length)
    group_first = np.flatnonzero(new)
    before_group = (csum - length)[group_first]  # tokens of the rank's earlier groups (running over all)
    keys = ahead(rank, a, doc, length, n)
    mine = (keys.own > 0).astype(np.int64)
    q = length.astype(np.float64)
    share = cost.ahead_share(length, a - s)  # (1.0 without a window)
    local_t = cost.attn_times(cost.square_pairs(length), q, q) + cost.full_attn_times(length, keys.own, mine) * share
    remote_t = cost.full_attn_times(length, (a - s) - keys.own, keys.holders - mine) * share
    if cost.window is None:  # receive: per group, (last end - doc start) - held tokens
        group_last = np.append(group_first[1:], m) - 1
        held = csum[group_last] - before_group
        recv = _int_sums(rank[group_first], (b[group_last] - s[group_first]) - held, n, total)
    else:  # per piece, the gap its window reaches past the previous piece of its group (flashpar.cp.window)
        prev_end = np.where(new, s, np.roll(b, 1))
        recv = _int_sums(rank, band.reach_gaps(a, s, prev_end, cost.window), n, total)
    return (local_t, remote_t, recv, np.bincount(rank, minlength=n), full_calls(rank, a, doc, length, keys, n))


def whole_doc_times(lens, cost: CostModel, attn=None):
    """Attention time of each document (lengths ``lens``, an int64 array) held whole on one rank: its causal square,
    ``cost.attn_times(L (L + 1) / 2, L, L)``, the float :func:`figures_of_arrays` gives such a piece.  ``attn``: those
    times, where the caller has them."""
    if attn is not None:
        return attn
    q = lens.astype(np.float64)
    return cost.attn_times(cost.square_pairs(lens), q, q)


def figures_of_whole(rank, docs, n: int, lens, times, cost: CostModel) -> RankFigures:
    """:func:`figures_of_arrays` (sharding-aware) of a placement of whole documents: document ``docs[i]`` on rank
    ``rank[i]``, sorted by (rank, start); ``lens`` and ``times`` (:func:`whole_doc_times`) per document.  The same
    floats: nothing is received and no attention is remote, so a rank's compute is its linear time plus its
    documents' attention times, added in token order, and a launch per distinct ladder length of its documents."""
    length = lens[docs]
    total = int(lens.sum())
    tokens_r = _int_sums(rank, length, n, total)
    pairs_r = _int_sums(rank, cost.square_pairs(length), n, total)
    counts = np.bincount(rank, minlength=n)
    lt, rt = _sums_in_order(times[docs], counts), np.zeros(n)
    none = np.zeros(n, dtype=np.int64)
    return _figures(tokens_r, pairs_r, none, lt, rt, square_calls(rank, length, n), none, cost)


def aware_send_tokens(segments, doc_starts, total: int) -> list[int]:
    """Tokens of K/V each rank sends under sharding-aware K/V (the sum over ranks ``r`` of what ``kv_recv(r)`` takes
    from it), on arrays.  Rank ``r`` receives, of every document ``d`` it holds part of, the other ranks' pieces of
    ``d`` before ``E_rd``, the end of its own last piece of ``d`` (pieces never straddle another's end).  So a piece
    ``[a, b)`` of ``d`` on rank ``o`` goes whole to every rank holding ``d`` with ``E_rd >= b``, less ``o`` itself:
    one sorted search per piece over the (document, E) pairs."""
    n = len(segments)
    counts = np.fromiter((len(x) for x in segments), dtype=np.int64, count=n)
    m = int(counts.sum())
    if m == 0:
        return [0] * n
    flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(segments)), dtype=np.int64,
                       count=2 * m).reshape(m, 2)
    rank = np.repeat(np.arange(n, dtype=np.int64), counts)
    a, b = flat[:, 0], flat[:, 1]
    order = by_rank_start(rank, a)
    if order is not None:
        a, b, rank = a[order], b[order], rank[order]
    starts = np.asarray(doc_starts, dtype=np.int64)
    doc = np.searchsorted(starts, a, side="right") - 1
    last = np.ones(m, dtype=bool)  # the last piece of each (rank, document) group
    last[:-1] = (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1])
    span = total + 1
    keys = np.sort(doc[last] * span + b[last])  # (document, E) of every rank holding part of it
    n_ge = np.searchsorted(keys, (doc + 1) * span, side="left") - np.searchsorted(keys, doc * span + b, side="left")
    sent = (n_ge - 1) * (b - a)
    return np.bincount(rank, weights=sent, minlength=n).astype(np.int64).tolist()


def _int_sums(rank, values, n: int, total: int):
    """Per-rank sums of non-negative integers of at most ``total^2 / 2`` in all: ``bincount`` (float64 sums, exact
    below 2^53), else ``np.add.at``."""
    if total * total < 1 << 53:
        return np.bincount(rank, weights=values, minlength=n).astype(np.int64)
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, rank, values)
    return out


def _sums_in_order(values, counts):
    """Per rank, the sum of its consecutive run of ``values`` (``counts[r]`` of them), added left to right as a
    running ``+=`` adds them (``cumsum`` is sequential; ``sum()`` is pairwise): in one ``cumsum`` along the rows
    of a zero-padded table (adding 0.0 changes no sum) where that is small, else one ``cumsum`` per rank."""
    n, m = len(counts), len(values)
    width = int(counts.max()) if n else 0
    out = np.zeros(n)
    if width == 0:
        return out
    if n * width <= 4 * m + 4096:
        # value i of rank r (its runs start at bounds[r]) at table[r, i - bounds[r]], flat: i + r width - bounds[r]
        shift = width * np.arange(n) - (np.cumsum(counts) - counts)
        table = np.zeros(n * width)
        table[np.arange(m) + np.repeat(shift, counts)] = values
        return np.cumsum(table.reshape(n, width), axis=1)[:, -1]
    lo = 0
    for r, c in enumerate(counts.tolist()):
        if c:
            out[r] = np.cumsum(values[lo:lo + c])[-1]
        lo += c
    return out


@dataclass(frozen=True)
class CPPlan:
    cp_size: int
    doc_lens: tuple[int, ...]
    strategy: str
    segments: tuple[tuple[Segment, ...], ...]  # per rank, in local order
    comm: str  # "aware" | "all"
    cost: CostModel = field(default_factory=CostModel)
    token_slack: float = 0.05
    planning_s: float = field(default=0.0, compare=False)

    # ------------------------------------------------------------------------------------------
    # what a rank holds

    @functools.cached_property
    def doc_starts(self) -> list[int]:
        return doc_starts_of(self.doc_lens)

    @property
    def total_tokens(self) -> int:
        return sum(self.doc_lens)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} is not in a plan for cp_size {self.cp_size}")

    def local_indices(self, rank: int) -> torch.Tensor:
        """Global token positions held by ``rank``, in its local order (LongTensor)."""
        self._check_rank(rank)
        parts = [torch.arange(a, b, dtype=torch.long) for a, b in self.segments[rank]]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def doc_ids(self, rank: int) -> torch.Tensor:
        """Document index of every local token."""
        self._check_rank(rank)
        starts = self.doc_starts
        parts = [torch.full((b - a,), bisect.bisect_right(starts, a) - 1, dtype=torch.long)
                 for a, b in self.segments[rank]]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def position_ids(self, rank: int) -> torch.Tensor:
        """Position of every local token inside its document (for rotary embeddings)."""
        return self.local_indices(rank) - torch.tensor(self.doc_starts, dtype=torch.long)[self.doc_ids(rank)]

    # ------------------------------------------------------------------------------------------
    # what a rank receives

    @functools.cached_property
    def _owners(self) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Every held range of every rank as (start, end, rank), sorted: a partition of the sequence."""
        ranges = sorted((a, b, r) for r, segs in enumerate(self.segments) for a, b in segs)
        return [a for a, _, _ in ranges], ranges

    def kv_recv(self, rank: int) -> list[tuple[int, int, int]]:
        """``(src_rank, start, end)`` global token ranges whose K/V ``rank`` receives, in token order."""
        self._check_rank(rank)
        starts, ranges = self._owners  # computed once per plan, shared by every rank's query
        if self.comm == "all":
            out = [(r, a, b) for a, b, r in ranges if r != rank]
        else:
            out = []
            for x, y in self._needed(rank):
                i = max(bisect.bisect_right(starts, x) - 1, 0)
                while i < len(ranges) and ranges[i][0] < y:
                    a, b, r = ranges[i]
                    lo, hi = max(a, x), min(b, y)
                    if hi > lo and r != rank:
                        out.append((r, lo, hi))
                    i += 1
        merged: list[tuple[int, int, int]] = []
        for r, a, b in out:
            if merged and merged[-1][0] == r and merged[-1][2] == a:
                merged[-1] = (r, merged[-1][1], b)
            else:
                merged.append((r, a, b))
        return merged

    def _needed(self, rank: int) -> list[tuple[int, int]]:
        """Key ranges ``rank`` needs and does not hold: per document, ``[start, last end)`` minus its pieces."""
        starts = self.doc_starts
        by_doc: dict[int, list[Segment]] = {}
        for a, b in self.segments[rank]:
            by_doc.setdefault(bisect.bisect_right(starts, a) - 1, []).append((a, b))
        gaps = []
        for d, segs in sorted(by_doc.items()):
            cursor = starts[d]
            for a, b in sorted(segs):
                if a > cursor:
                    gaps.append((cursor, a))
                cursor = max(cursor, b)
        return gaps

    # ------------------------------------------------------------------------------------------
    # statistics and serialisation

    def figures(self) -> RankFigures:
        return rank_figures(self.segments, self.doc_lens, self.doc_starts, self.cost, self.comm)

    def stats(self) -> dict:
        """Per-rank lists and plan-wide scalars (see the README for each name)."""
        n = self.cp_size
        fig = self.figures()
        kv = self.cost.kv_bytes_per_token
        recv_bytes = [t * kv for t in fig.recv_tokens]
        if self.cost.window is not None:  # a windowed model: every rank receives what its windows reach
            send_tokens = band.send_tokens(self, self.cost.window)
        elif self.comm == "all":  # every other rank receives all of a rank's tokens
            send_tokens = [t * (n - 1) for t in fig.tokens]
        else:
            send_tokens = aware_send_tokens(self.segments, self.doc_starts, self.total_tokens)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        ratio = lambda xs: max(xs) / mean(xs) if mean(xs) > 0 else 1.0  # noqa: E731
        others = [self.total_tokens - t for t in fig.tokens]  # what an all-gather would bring each rank
        return {
            "attn_pairs": fig.attn_pairs,
            "tokens": fig.tokens,
            "kv_recv_bytes": recv_bytes,
            "kv_send_bytes": [t * kv for t in send_tokens],
            "est_time": fig.time,
            "compute": fig.compute,
            "compute_imbalance": ratio(fig.compute),
            "attn_imbalance": ratio(fig.attn_pairs),
            "token_imbalance": ratio(fig.tokens),
            "total_kv_bytes": sum(recv_bytes),
            "max_kv_bytes": max(recv_bytes),
            "kv_worst_frac": max((t / o if o else 0.0) for t, o in zip(fig.recv_tokens, others, strict=True)),
            "est_step_time": fig.step,
            "planning_s": self.planning_s,
        }

    def to_json(self) -> str:
        return json.dumps({
            "cp_size": self.cp_size, "doc_lens": list(self.doc_lens), "strategy": self.strategy, "comm": self.comm,
            "token_slack": self.token_slack, "cost": self.cost.to_dict(),
            "segments": [[list(s) for s in segs] for segs in self.segments],
        })

    @classmethod
    def from_json(cls, text: str) -> CPPlan:
        """The plan ``to_json`` wrote; any other text is refused with one line (:mod:`flashpar.cp.plan_check`)."""
        from flashpar.cp.plan_check import parse_plan

        d = parse_plan(text)
        try:
            cost = CostModel.from_dict(d["cost"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"plan JSON: cost is not a CostModel ({err})".replace("\n", " ")) from None
        return cls(d["cp_size"], d["doc_lens"], d["strategy"], d["segments"], d["comm"], cost, d["token_slack"])
