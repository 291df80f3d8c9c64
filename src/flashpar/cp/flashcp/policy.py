"""How the planner works at a given number of ranks ``N``: chosen once per plan (:meth:`Policy.for_ranks`), read by
every step that branches on ``N``.

Two kinds of choices.  The search grid (which candidate passes and baselines are tried) changes which plans compete,
so it changes plans; the data structures (Python lists or numpy arrays, heaps, a sorted order kept in step) change
only how fast the same plan is found: every form gives the same floats and the same ranks.

=====================  ==================  ===============================================================
field                  value               why
=====================  ==================  ===============================================================
tolerances             N <= 16: 0, 2, 5%   beyond 16 ranks a pass costs O(N) per document: a smaller grid
                       else: 0, 2%         keeps 1M tokens at N = 64 near 200 ms
forced                 N <= 16: 0, 1       (the same reason)
                       else: 0
shares                 N < 256: 1, .7,     from 256 ranks on, the smallest share only spreads long documents
                       .45, .25            wider than the fastest plan does (its passes won none of the
                       else: 1, .7, .45    shipped lists' packs at 2M / 256, 4M / 512, 8M / 1024)
torch_per_doc          N <= 16             cutting every document into 2N pieces twice over is the
                                           costliest candidate at large N
reuse_prefix           N <= 64             later passes of force 0 start where the first stopped keying ranks
                                           by tokens alone (``whole.Prefix``); the one-by-one Whole-Doc step
                                           in short, on the heap alone
heap_mins              64 < N < 256        ``min(tokens)``, ``min(load)`` from two heaps (``ranks.Mins``)
ranked_arrays          N > 128             the ranked order also as arrays (prefix maxima and sums for the
                                           group search)
ranked_eager           N >= 256            the ranked order kept in step with every document (whether any
                                           rank fits a document whole is read from it)
fill_arrays            N > 32              an unequal split's rooms on arrays
many_arrays            N > 64              split layouts, trade pairs and runs of equal documents written
                                           on arrays
heap_rebuild           max(N / 4, 64)      changes at once after which the heaps are built anew
=====================  ==================  ===============================================================
"""

from __future__ import annotations

import dataclasses

TOLERANCES = (0.0, 0.02, 0.05)
"""How far above the mean compute a rank may go in the Whole-Doc step, per candidate pass."""
FORCED = (0, 1)
"""How many of the longest documents a candidate pass splits even where they would fit whole."""
SHARES = (1.0, 0.7, 0.45, 0.25)
"""The largest part of a rank's mean compute one member of a split document may take, per candidate pass."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """The planner's choices at ``ranks`` ranks (see the module docstring for each field's value and reason)."""

    ranks: int
    tolerances: tuple[float, ...]
    forced: tuple[int, ...]
    shares: tuple[float, ...]
    torch_per_doc: bool
    reuse_prefix: bool
    heap_mins: bool
    ranked_arrays: bool
    ranked_eager: bool
    fill_arrays: bool
    many_arrays: bool
    heap_rebuild: int

    @classmethod
    def for_ranks(cls, n: int) -> Policy:
        small = n <= 16
        return cls(
            ranks=n,
            tolerances=TOLERANCES if small else TOLERANCES[:2],
            forced=FORCED if small else FORCED[:1],
            shares=SHARES if n < 256 else SHARES[:-1],
            torch_per_doc=small,
            reuse_prefix=n <= 64,
            heap_mins=64 < n < 256,
            ranked_arrays=n > 128,
            ranked_eager=n >= 256,
            fill_arrays=n > 32,
            many_arrays=n > 64,
            heap_rebuild=max(n // 4, 64),
        )
