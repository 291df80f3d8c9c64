"""Placements of the baselines: which global token ranges each rank holds.

    contiguous     the packed sequence cut into N equal pieces; ring / all-gather K/V
    headtail       2N chunks of the whole sequence, rank r takes chunks r and 2N-1-r
                   (Megatron / TransformerEngine); ring K/V passing
    per_doc        every document cut into 2N chunks, head-tail (Llama 3); all-gather K/V
    per_doc_aware  the same placement with sharding-aware K/V
    torch_per_doc  torch 2.13's _PerDocumentHeadTailLoadBalancer layout cut into N contiguous
                   shards: a peer row, not a model
    whole_doc      documents that fit under the token cap whole (largest first, on the least
                   loaded rank with room), Per-Doc for the rest; sharding-aware K/V

Chunk ``i`` of ``2g`` of a range ``[s, s + L)`` is ``[s + L i // 2g, s + L (i + 1) // 2g)``: a document
shorter than ``2g`` tokens has empty chunks, and no token is ever dropped.
"""

from __future__ import annotations

import bisect

import numpy as np

from flashpar.cp.cp_plan import doc_starts_of


def chunk_bounds(start: int, length: int, parts: int) -> list[int]:
    return [start + length * i // parts for i in range(parts + 1)]


class Placement:
    """Per-rank segment lists under construction (empty ranges are skipped)."""

    def __init__(self, n: int) -> None:
        self.segments: list[list[tuple[int, int]]] = [[] for _ in range(n)]

    def add(self, rank: int, a: int, b: int) -> None:
        if b > a:
            self.segments[rank].append((a, b))

    def add_split(self, rank: int, a: int, b: int, doc_starts: list[int]) -> None:
        """``[a, b)`` cut at document boundaries."""
        i = bisect.bisect_right(doc_starts, a)
        for cut in doc_starts[i:]:
            if cut >= b:
                break
            self.add(rank, a, cut)
            a = cut
        self.add(rank, a, b)

    def headtail(self, ranks: list[int], start: int, length: int) -> None:
        """``[start, start + length)`` (one document) head-tail over ``ranks``: rank ``i`` of the group
        takes chunks ``i`` and ``2g - 1 - i`` of ``2g``."""
        g = len(ranks)
        if g == 1:
            self.add(ranks[0], start, start + length)
            return
        bounds = chunk_bounds(start, length, 2 * g)
        for i, r in enumerate(ranks):
            self.add(r, bounds[i], bounds[i + 1])
            self.add(r, bounds[2 * g - 1 - i], bounds[2 * g - i])

    def headtail_sized(self, ranks: list[int], sizes: list[int], start: int, length: int) -> None:
        """``[start, start + length)`` head-tail over ``ranks`` in unequal parts: member ``i`` (``sizes[i]``
        tokens, ``sum(sizes) == length``) takes the next ``sizes[i] // 2`` tokens from the front and the next
        ``sizes[i] - sizes[i] // 2`` from the back; the last member takes the middle that is left.  A
        mirrored pair of pieces ``[a, b)``, ``[L - b, L - a)`` holds ``(b - a) L`` causal pairs, so a
        member's attention work is about proportional to its tokens (see :func:`sized_pieces`)."""
        for r, pieces in zip(ranks, sized_pieces(sizes, start, length), strict=True):
            for a, b in pieces:
                self.add(r, a, b)

    def frozen(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        return tuple(tuple(segs) for segs in self.segments)

    @property
    def n(self) -> int:
        return len(self.segments)

    def arrays(self):
        """(rank, start, end) of every piece, as int64 arrays, each rank's in its local order."""
        import itertools

        import numpy as np

        counts = np.fromiter((len(s) for s in self.segments), dtype=np.int64, count=self.n)
        m = int(counts.sum())
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(self.segments)),
                           dtype=np.int64, count=2 * m).reshape(m, 2)
        return np.repeat(np.arange(self.n, dtype=np.int64), counts), flat[:, 0].copy(), flat[:, 1].copy()


class ArrayPlacement:
    """A placement as arrays: piece ``i`` is ``[a[i], b[i])`` on rank ``rank[i]``, each rank's pieces in its local
    order (:meth:`frozen` gives the per-rank tuples a :class:`~flashpar.cp.cp_plan.CPPlan` holds)."""

    def __init__(self, n: int, rank, a, b) -> None:
        self.n, self.rank, self.a, self.b = n, rank, a, b
        self._frozen = None
        self._key = None

    @classmethod
    def sorted_from(cls, n: int, parts) -> ArrayPlacement:
        """The pieces of ``parts`` ((rank, a, b) arrays), each rank's sorted by start, empty ones dropped."""
        rank, a, b = (np.concatenate([np.asarray(x[i], dtype=np.int64) for x in parts]) for i in range(3))
        keep = b > a
        rank, a, b = rank[keep], a[keep], b[keep]
        order = np.lexsort((a, rank))
        return cls(n, rank[order], a[order], b[order])

    @classmethod
    def of(cls, placement) -> ArrayPlacement:
        """``placement`` (a :class:`Placement` or one of these) as arrays."""
        return placement if isinstance(placement, ArrayPlacement) else cls(placement.n, *placement.arrays())

    def frozen(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        if self._frozen is None:
            counts = np.bincount(self.rank, minlength=self.n).tolist()
            pieces = list(zip(self.a.tolist(), self.b.tolist(), strict=True))
            out, lo = [], 0
            for c in counts:
                out.append(tuple(pieces[lo:lo + c]))
                lo += c
            self._frozen = tuple(out)
        return self._frozen

    @property
    def segments(self):
        return self.frozen()

    def key(self) -> bytes:
        """Equal for equal placements (the same pieces, each rank's in the same order); built once (the arrays are
        not changed after construction)."""
        if self._key is None:
            self._key = self.rank.tobytes() + self.a.tobytes() + self.b.tobytes()
        return self._key

    def figures(self, doc_lens, doc_starts, cost, comm: str = "aware"):
        from flashpar.cp.cp_plan import figures_of_arrays

        return figures_of_arrays(self.rank, self.a, self.b, self.n, sum(doc_lens), doc_starts, cost, comm)


def sized_pieces(sizes: list[int], start: int, length: int) -> list[tuple[tuple[int, int], ...]]:
    """The (head, tail) pieces of each member of an unequal head-tail split (see ``Placement.headtail_sized``);
    the last member's is one piece, the middle."""
    if sum(sizes) != length:
        raise ValueError(f"sizes {sizes} do not add up to the document's {length} tokens")
    head, tail, out = start, start + length, []
    for s in sizes[:-1]:
        h = s // 2
        out.append(((head, head + h), (tail - (s - h), tail)))
        head, tail = head + h, tail - (s - h)
    out.append(((head, tail),))
    return out


def contiguous(doc_lens: list[int], n: int) -> ArrayPlacement:
    return _chunks_at_docs(doc_lens, n, n)


def headtail(doc_lens: list[int], n: int) -> ArrayPlacement:
    return _chunks_at_docs(doc_lens, n, 2 * n)


def _chunks_at_docs(doc_lens: list[int], n: int, parts: int) -> ArrayPlacement:
    """The whole sequence cut into ``parts`` chunks (``chunk_bounds``), every chunk cut at the document starts
    inside it; chunk ``c`` goes to rank ``c`` (``parts == n``: contiguous) or, head-tail (``parts == 2n``), to
    ``c`` and ``2n - 1 - c``.  On arrays: the pieces are the gaps between consecutive cut points (the chunk
    bounds and the document starts), in order; each rank's pieces in token order."""
    starts = np.asarray(doc_starts_of(doc_lens), dtype=np.int64)
    total = int(sum(doc_lens))
    bounds = total * np.arange(parts + 1, dtype=np.int64) // parts
    cuts = _sorted_union(starts, bounds)
    a, b = cuts[:-1], cuts[1:]
    chunk = np.searchsorted(bounds, a, side="right") - 1
    rank = chunk if parts == n else np.where(chunk < n, chunk, 2 * n - 1 - chunk)
    return ArrayPlacement.sorted_from(n, [(rank, a, b)])


def per_doc(doc_lens: list[int], n: int) -> Placement:
    """Every document head-tail over all ranks (``Placement.headtail`` per document, then each rank's pieces in
    token order), on arrays: for N > 1, rank ``r``'s pieces are, document by document, chunks ``r`` and
    ``2n - 1 - r``."""
    import numpy as np

    p = Placement(n)
    if n == 1:  # a group of one holds each document whole, in one piece
        p.segments[0] = [(s, s + length) for s, length in zip(doc_starts_of(doc_lens), doc_lens, strict=True)]
        return p
    lens = np.asarray(doc_lens, dtype=np.int64)
    starts = np.asarray(doc_starts_of(doc_lens), dtype=np.int64)
    bounds = starts[:, None] + lens[:, None] * np.arange(2 * n + 1, dtype=np.int64)[None, :] // (2 * n)
    head_a, head_b = bounds[:, :n].T, bounds[:, 1:n + 1].T  # (rank, document)
    tail_a, tail_b = bounds[:, 2 * n - 1:n - 1:-1].T, bounds[:, 2 * n:n:-1].T
    a = np.stack((head_a, tail_a), axis=2).reshape(n, -1)  # per rank: head, tail of each document, in order
    b = np.stack((head_b, tail_b), axis=2).reshape(n, -1)
    for r in range(n):
        keep = b[r] > a[r]
        p.segments[r] = list(zip(a[r][keep].tolist(), b[r][keep].tolist(), strict=True))
    return p


def torch_per_doc(doc_lens: list[int], n: int, use_torch: bool = True) -> Placement:
    """torch's per-document head-tail order (per document, per rank: head chunk, tail chunk), cut into
    N contiguous shards of the rearranged sequence.  Where every length is a multiple of 2N (and
    ``use_torch``) the order comes from torch's own class; elsewhere the same rule with uneven chunks."""
    if not (use_torch and all(length % (2 * n) == 0 for length in doc_lens)):
        return _torch_per_doc_arrays(doc_lens, n)
    starts = doc_starts_of(doc_lens)
    first = set(starts)
    bounds = chunk_bounds(0, sum(doc_lens), n)
    p = Placement(n)
    pos = 0  # position in the rearranged sequence
    for a, b in _torch_order(doc_lens, n, first, use_torch):
        while a < b:
            r = bisect.bisect_right(bounds, pos) - 1
            take = min(b - a, bounds[r + 1] - pos)
            segs = p.segments[r]
            if segs and segs[-1][1] == a and a not in first:
                segs[-1] = (segs[-1][0], a + take)  # continues the previous range of this document
            else:
                p.add(r, a, a + take)
            a, pos = a + take, pos + take
    return p


def _sorted_union(x, y):
    """The sorted distinct values of two integer arrays (``np.union1d`` by sorting: its hashing is slow here)."""
    c = np.sort(np.concatenate((x, y)))
    return c[np.concatenate(([True], c[1:] != c[:-1]))] if len(c) else c


def _torch_per_doc_arrays(doc_lens: list[int], n: int) -> ArrayPlacement:
    """:func:`torch_per_doc` by its rule (no torch), on arrays: the rearranged sequence's runs (per document, per
    rank ``r``: chunks ``r`` and ``2n - 1 - r`` of ``2n``, empty ones dropped), cut at the N shard bounds of the
    rearranged sequence; consecutive pieces of one shard that continue each other inside one document join."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    starts = np.asarray(doc_starts_of(doc_lens), dtype=np.int64)
    total = int(lens.sum())
    cb = starts[:, None] + lens[:, None] * np.arange(2 * n + 1, dtype=np.int64)[None, :] // (2 * n)
    r = np.arange(n)
    a = np.stack((cb[:, r], cb[:, 2 * n - 1 - r]), axis=2).reshape(-1)  # per document, per rank: head, tail
    b = np.stack((cb[:, r + 1], cb[:, 2 * n - r]), axis=2).reshape(-1)
    keep = b > a
    a, b = a[keep], b[keep]
    pos = np.concatenate(([0], np.cumsum(b - a)))  # where each run starts in the rearranged sequence
    shard = total * np.arange(n + 1, dtype=np.int64) // n
    cuts = _sorted_union(pos, shard)  # elementary pieces of the rearranged sequence
    x, y = cuts[:-1], cuts[1:]
    run = np.searchsorted(pos, x, side="right") - 1
    rank = np.searchsorted(shard, x, side="right") - 1
    pa = a[run] + (x - pos[run])
    pb = pa + (y - x)
    # join a piece to the one before it: same rank, continuing it, not at a document start
    at_doc_start = np.isin(pa, starts)
    join = np.zeros(len(pa), dtype=bool)
    join[1:] = (rank[1:] == rank[:-1]) & (pa[1:] == pb[:-1]) & ~at_doc_start[1:]
    head = np.flatnonzero(~join)
    ends = np.append(head[1:], len(pa)) - 1
    return ArrayPlacement(n, rank[head], pa[head], pb[ends])


def _torch_order(doc_lens: list[int], n: int, first: set[int], use_torch: bool) -> list[tuple[int, int]]:
    """The rearranged sequence as runs of global positions (a run never crosses a document start)."""
    if use_torch and all(length % (2 * n) == 0 for length in doc_lens):
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _PerDocumentHeadTailLoadBalancer,
        )

        idx = _PerDocumentHeadTailLoadBalancer([list(doc_lens)], n, "cpu")._generate_indices()[0].tolist()
        runs: list[tuple[int, int]] = []
        for i in idx:
            if runs and runs[-1][1] == i and i not in first:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        return runs
    order = []
    for s, length in zip(doc_starts_of(doc_lens), doc_lens, strict=True):
        b = chunk_bounds(s, length, 2 * n)
        for r in range(n):
            order += [(b[r], b[r + 1]), (b[2 * n - 1 - r], b[2 * n - r])]
    return [(a, e) for a, e in order if e > a]
