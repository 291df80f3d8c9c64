"""The search grid at a given number of ranks ``N`` (which candidate passes and baselines are tried): chosen once per
plan (:meth:`Policy.for_ranks`).  It changes which plans compete, so it changes plans; how each step is carried out
does not depend on ``N``.

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
    """The search grid at ``ranks`` ranks (see the module docstring for each field's value and reason)."""

    ranks: int
    tolerances: tuple[float, ...]
    forced: tuple[int, ...]
    shares: tuple[float, ...]
    torch_per_doc: bool

    @classmethod
    def for_ranks(cls, n: int) -> Policy:
        small = n <= 16
        return cls(
            ranks=n,
            tolerances=TOLERANCES if small else TOLERANCES[:2],
            forced=FORCED if small else FORCED[:1],
            shares=SHARES if n < 256 else SHARES[:-1],
            torch_per_doc=small,
        )
