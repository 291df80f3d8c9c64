"""How little K/V the worst rank can receive: a floor that no plan within given balance caps goes below.

``kv_worst_frac`` (``CPPlan.stats``) is, over the ranks, the most K/V tokens a rank receives over what an
all-gather would bring it (``T - own tokens``).  Under a causal document mask, the rank holding a document's
last query attends every key of that document, so it receives every one of them it does not hold itself::

    document d (L tokens):   0  1  2 ...  k-2 | k-1 ........................ L-2 | L-1
    rank r holds:            the k-1 cheapest queries (the head)                 | the last query
    r receives at least:                      | the L - k keys between               |

How many of the document's tokens ``k`` can r hold?  Its causal pairs are at least those of the last query
(``L``) and of the ``k - 1`` cheapest other queries (positions ``0 .. k-2``: ``k (k - 1) / 2``), and a plan
within attention imbalance ``a`` and token imbalance ``t`` gives no rank more than ``a P / N`` pairs
(``P``: every document's ``L (L + 1) / 2``) nor more than ``t T / N`` tokens::

    k_max(L) = the largest k <= min(L, t T / N) with  L + k (k - 1) / 2 <= a P / N

r's own tokens number at least ``k``, so the all-gather would bring it at most ``T - k``; with
``(L - k) / (T - k)`` falling as ``k`` grows (``L <= T``)::

    kv_worst_frac >= max over documents of (L - k_max(L)) / (T - k_max(L))          (0 where negative)

The floor is what the document lengths and the caps allow, whatever the planner: a target below it cannot be
met by any plan that keeps the caps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flashpar.cp.cp_plan import causal_pairs


def held_at_most(length: int, pairs_cap: float, tokens_cap: float) -> int:
    """``k_max``: the most tokens of a ``length``-token document the rank holding its last query can hold
    within ``pairs_cap`` causal pairs and ``tokens_cap`` tokens (at least 1: the last query itself)."""
    # L + k (k - 1) / 2 <= cap  <=>  k <= (1 + sqrt(1 + 8 (cap - L))) / 2
    room = pairs_cap - length
    k = 1 if room < 0 else int((1 + math.sqrt(1 + 8 * room)) / 2)
    while k > 1 and length + k * (k - 1) / 2 > pairs_cap:  # the float root's rounding, either way
        k -= 1
    while length + (k + 1) * k / 2 <= pairs_cap:
        k += 1
    return max(1, min(k, length, int(tokens_cap)))


def kv_worst_floor(doc_lens: Sequence[int], n: int, attn_imbalance: float, token_imbalance: float) -> float:
    """The least ``kv_worst_frac`` a plan of ``doc_lens`` over ``n`` ranks can have while its attention
    imbalance stays within ``attn_imbalance`` and its token imbalance within ``token_imbalance`` (module
    docstring)."""
    if n < 1 or attn_imbalance < 1 or token_imbalance < 1:
        raise ValueError(f"kv_worst_floor needs n >= 1 and caps >= 1, got n={n}, attn_imbalance={attn_imbalance}, "
                         f"token_imbalance={token_imbalance}")
    total = sum(doc_lens)
    if n == 1 or total == 0:
        return 0.0
    # the pairs as CPPlan.stats counts them for its attention imbalance: L (L + 1) / 2 a document
    pairs_cap = attn_imbalance * sum(causal_pairs(0, L, 0) for L in doc_lens) / n
    tokens_cap = token_imbalance * total / n
    floor = 0.0
    for length in doc_lens:
        if length < 2:
            continue
        k = held_at_most(length, pairs_cap, tokens_cap)
        floor = max(floor, (length - k) / (total - k))
    return floor
