"""A document split over several ranks (:class:`Split`: tokens per member) and the pieces its members hold, on arrays.

Equal head-tail over ``g`` members (member ``i`` takes chunks ``i`` and ``2g - 1 - i`` of ``2g``)::

    chunk:   0    1    2    3    4    5        (g = 3)
    member:  0    1    2    2    1    0

Unequal parts, largest outermost: member ``i`` takes the next ``s_i // 2`` tokens from the front and the next
``s_i - s_i // 2`` from the back; the last member takes the middle."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass
class Split:
    """A document over several ranks: tokens per member (``equal``: the head-tail of equal chunks, in order)."""

    start: int
    length: int
    parts: dict[int, int]
    equal: bool

    def trade(self, src: int, dst: int, tokens: int) -> None:
        """``tokens`` of the part of ``src`` go to ``dst`` (the parts become unequal)."""
        self.parts[src] -= tokens
        self.parts[dst] = self.parts.get(dst, 0) + tokens
        if self.parts[src] == 0:
            del self.parts[src]
        self.equal = False



def headtail_arrays(splits: list[Split]):
    """(rank, start, end) of the pieces of equal head-tail splits (``Placement.headtail``: member ``i`` of ``g``
    takes chunks ``i`` and ``2g - 1 - i`` of ``2g``), on arrays; empty pieces are left to the caller to drop."""
    g = np.fromiter((len(sp.parts) for sp in splits), dtype=np.int64, count=len(splits))
    rank = np.fromiter(itertools.chain.from_iterable(sp.parts for sp in splits), dtype=np.int64, count=int(g.sum()))
    i = np.arange(len(rank), dtype=np.int64) - np.repeat(np.cumsum(g) - g, g)  # place in its group
    two = np.repeat(2 * g, g)
    start = np.repeat(np.fromiter((sp.start for sp in splits), dtype=np.int64, count=len(splits)), g)
    length = np.repeat(np.fromiter((sp.length for sp in splits), dtype=np.int64, count=len(splits)), g)
    a = np.concatenate((start + length * i // two, start + length * (two - 1 - i) // two))
    b = np.concatenate((start + length * (i + 1) // two, start + length * (two - i) // two))
    return np.concatenate((rank, rank)), a, b



def sized_arrays(splits: list[Split]):
    """(rank, start, end) of the pieces of unequal head-tail splits (``Placement.headtail_sized``, the largest parts
    outermost: member ``i`` takes the next ``s_i // 2`` tokens from the front and the next ``s_i - s_i // 2`` from
    the back, the last member the middle), on arrays; empty pieces are left to the caller to drop."""
    ranks, sizes, g = [], [], []
    for sp in splits:
        part = sp.parts.__getitem__
        members = sorted(sp.parts, key=part, reverse=True)  # (stable: equal parts keep their order, as by -part)
        ranks += members
        sizes += map(part, members)
        g.append(len(members))
    g_np = np.asarray(g, dtype=np.int64)
    s = np.asarray(sizes, dtype=np.int64)
    last = np.cumsum(g_np) - 1
    h = s // 2
    h[last] = s[last]  # the last member: one piece, the middle
    first = np.repeat(last - g_np + 1, g_np)
    head = np.cumsum(h) - h  # tokens taken from the front before each member (within its split)
    back = np.cumsum(s - h) - (s - h)
    head, back = head - head[first], back - back[first]
    start = np.repeat(np.asarray([sp.start for sp in splits], dtype=np.int64), g_np)
    end = start + np.repeat(np.asarray([sp.length for sp in splits], dtype=np.int64), g_np)
    rank = np.asarray(ranks, dtype=np.int64)
    a = np.concatenate((start + head, end - back - (s - h)))
    b = np.concatenate((start + head + h, end - back))
    return np.concatenate((rank, rank)), a, b

