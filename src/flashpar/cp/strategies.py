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

from flashpar.cp.cp_plan import by_rank_start, doc_starts_of


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

    def __init__(self, n: int, rank, a, b, docs=None) -> None:
        self.n, self.rank, self.a, self.b = n, rank, a, b
        self.docs = docs  # where every piece is a whole document, sorted by (rank, start): each piece's document
        self._frozen = self._key = None

    @classmethod
    def of_whole(cls, n: int, doc_rank, starts, lens) -> ArrayPlacement:
        """Every document ``d`` whole on rank ``doc_rank[d]`` (``starts``, ``lens``: int64 arrays), each rank's in
        token order (a stable sort by rank: documents are in token order)."""
        small = doc_rank.astype(np.int16) if n <= 1 << 15 else doc_rank  # (small integers: a radix sort)
        docs = np.argsort(small, kind="stable")
        a = starts[docs]
        return cls(n, doc_rank[docs], a, a + lens[docs], docs)

    @classmethod
    def sorted_from(cls, n: int, parts) -> ArrayPlacement:
        """The pieces of ``parts`` ((rank, a, b) arrays), each rank's sorted by start, empty ones dropped."""
        rank, a, b = (np.concatenate([np.asarray(x[i], dtype=np.int64) for x in parts]) for i in range(3))
        keep = b > a
        if not keep.all():
            rank, a, b = rank[keep], a[keep], b[keep]
        order = by_rank_start(rank, a)
        return cls(n, rank, a, b) if order is None else cls(n, rank[order], a[order], b[order])

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
        """Equal for equal placements (the same pieces, each rank's in the same order)."""
        if self._key is None:  # (the arrays are never changed once made)
            self._key = self.rank.tobytes() + self.a.tobytes() + self.b.tobytes()
        return self._key

    def figures(self, doc_lens, doc_starts, cost, comm: str = "aware", whole=None):
        """:func:`~flashpar.cp.cp_plan.figures_of_arrays`; ``whole``: (lengths, :func:`whole_doc_times`) of the
        documents, which a placement of whole documents (``docs``) is scored from, and its whole documents where
        some are cut."""
        from flashpar.cp.cp_plan import figures_of_arrays, figures_of_whole

        if whole is not None and self.docs is not None and comm == "aware":
            return figures_of_whole(self.rank, self.docs, self.n, whole[0], whole[1], cost)
        return figures_of_arrays(self.rank, self.a, self.b, self.n, sum(doc_lens), doc_starts, cost, comm, whole)


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


def contiguous(doc_lens: list[int], n: int, starts=None) -> ArrayPlacement:
    return _chunks_at_docs(doc_lens, n, n, starts)


def headtail(doc_lens: list[int], n: int, starts=None) -> ArrayPlacement:
    return _chunks_at_docs(doc_lens, n, 2 * n, starts)


def _chunks_at_docs(doc_lens: list[int], n: int, parts: int, starts=None) -> ArrayPlacement:
    """The whole sequence cut into ``parts`` chunks (``chunk_bounds``), every chunk cut at the document starts
    inside it; chunk ``c`` goes to rank ``c`` (``parts == n``: contiguous) or, head-tail (``parts == 2n``), to
    ``c`` and ``2n - 1 - c``.  On arrays: the pieces are the gaps between consecutive cut points (the chunk
    bounds and the document starts), in order; each rank's pieces in token order (a stable sort by rank).
    ``starts``: the documents' starts as an int64 array, where the caller has them."""
    if starts is None:
        starts = np.asarray(doc_starts_of(doc_lens), dtype=np.int64)
    total = int(starts[-1]) + doc_lens[-1]
    bounds = total * np.arange(parts + 1, dtype=np.int64) // parts
    cuts = _sorted_union(starts, bounds)
    a, b = cuts[:-1], cuts[1:]
    chunk = np.searchsorted(bounds, a, side="right") - 1
    if parts == n:  # (in rank order already)
        return ArrayPlacement(n, chunk, a, b)
    rank = np.where(chunk < n, chunk, 2 * n - 1 - chunk)
    order = np.argsort(rank.astype(np.int16) if n <= 1 << 15 else rank, kind="stable")  # (small keys: radix)
    return ArrayPlacement(n, rank[order], a[order], b[order])


def per_doc(doc_lens: list[int], n: int) -> Placement:
    """Every document head-tail over all ranks (``Placement.headtail`` per document, then each rank's pieces in
    token order), on arrays: for N > 1, rank ``r``'s pieces are, document by document, chunks ``r`` and
    ``2n - 1 - r``."""
    p = Placement(n)
    if n == 1:  # a group of one holds each document whole, in one piece
        p.segments[0] = [(s, s + length) for s, length in zip(doc_starts_of(doc_lens), doc_lens, strict=True)]
        return p
    a, b = _per_doc_pieces(doc_lens, n)
    for r in range(n):
        keep = b[r] > a[r]
        p.segments[r] = list(zip(a[r][keep].tolist(), b[r][keep].tolist(), strict=True))
    return p


def per_doc_arrays(doc_lens: list[int], n: int) -> ArrayPlacement:
    """:func:`per_doc` as an :class:`ArrayPlacement` (the same pieces, each rank's in the same order), without its
    lists."""
    if n == 1:
        return ArrayPlacement.of(per_doc(doc_lens, n))
    a, b = _per_doc_pieces(doc_lens, n)
    keep = b > a
    counts = np.count_nonzero(keep, axis=1)
    return ArrayPlacement(n, np.repeat(np.arange(n, dtype=np.int64), counts), a[keep], b[keep])


def _per_doc_pieces(doc_lens: list[int], n: int):
    """(start, end) of :func:`per_doc`'s pieces, ``(n, 2 D)`` arrays: per rank, the head and tail of each document
    in order (empty ones included)."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    starts = np.asarray(doc_starts_of(doc_lens), dtype=np.int64)
    bounds = starts[:, None] + lens[:, None] * np.arange(2 * n + 1, dtype=np.int64)[None, :] // (2 * n)
    head_a, head_b = bounds[:, :n].T, bounds[:, 1:n + 1].T  # (rank, document)
    tail_a, tail_b = bounds[:, 2 * n - 1:n - 1:-1].T, bounds[:, 2 * n:n:-1].T
    a = np.stack((head_a, tail_a), axis=2).reshape(n, -1)  # per rank: head, tail of each document, in order
    b = np.stack((head_b, tail_b), axis=2).reshape(n, -1)
    return a, b


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
