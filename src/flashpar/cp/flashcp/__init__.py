"""FlashCP's hybrid placement: Whole-Doc where a document fits, head-tail over the smallest group of ranks that keeps
the balance where it does not, chosen by a heuristic search scored by the cost model (:func:`plan`).

``W`` is the mean compute per rank and ``cap = (1 + token_slack) T / N``.  A sub-group keeps the document's K/V inside
the group: member ``i`` of ``g`` receives ``(2g - 2 - i) L / 2g`` tokens, so smaller groups send less; in unequal parts
(member ``i`` takes ``s_i`` tokens, the largest parts the outermost pieces) it receives ``e_i - s_i`` tokens, ``e_i``
the end of its last piece (``L`` less the tail tokens of the members before it).  The search scores candidates within
the token cap by the estimated step time (max over ranks of ``max(compute, comm + remote compute)``): among those
within ``TIME_TIE`` (0.2%) of the fastest in step time and in peak compute, the fewest K/V bytes wins.  The placements
of the baselines are candidates too, with sharding-aware communication, and the winner is never estimated slower than
any of them.  Where the pick among the first pass and the baselines receives no K/V and is estimated within
``PERFECT`` (0.01%) of the lower bound (the mean compute with every document whole), the search stops there: no other
candidate could be more than that faster, nor receive less (packs of thousands of short documents).  With attention
work alone (``CostModel(linear=False)``) the greedy balances causal pairs (no efficiency curve) and balance comes first
(see ``pick.balanced``); there a better-balanced plan may be estimated slower.

The modules, each importing only those below it::

    search     the search over knobs and baselines; plan() and whole_doc()
    pick       the choice among candidates          bounds   lower bounds that skip baselines
    greedy     one greedy pass (run)
    trade      trades of split parts                refine   moves and swaps of whole documents
    groups     group-size search, unequal fill      whole    the Whole-Doc step in runs and at once
    rankdocs   a rank's whole documents by length   splits   split documents and their pieces
    ranks      the ranks' orders as loads change
    work       what a document costs; token_cap
    policy     the search grid at N ranks
    arrays     lists as numpy arrays
"""

from __future__ import annotations

from flashpar.cp.flashcp.search import plan, whole_doc
from flashpar.cp.flashcp.work import token_cap

__all__ = ["plan", "token_cap", "whole_doc"]
