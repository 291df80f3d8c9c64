"""``flashpar.cp.kv_floor``: the floor under ``kv_worst_frac`` is never above what a plan within the caps reaches.

Checked against every assignment of tokens to ranks on small packs (the true least), and against the plans the
planner and the baselines make on real length lists."""

from __future__ import annotations

import itertools

import pytest

from flashpar.cp import plan
from flashpar.cp.kv_floor import held_at_most, kv_worst_floor


def _figures(doc_lens, owner, n):
    """(tokens, causal pairs, K/V tokens received) per rank of an assignment ``owner[token] = rank``."""
    tokens, pairs, recv = [0] * n, [0] * n, [0] * n
    start = 0
    for length in doc_lens:
        ranks = owner[start : start + length]
        for p, r in enumerate(ranks):
            tokens[r] += 1
            pairs[r] += p + 1
        for r in range(n):  # r receives key j of the document where it holds a later query and not j
            mine = [p for p, o in enumerate(ranks) if o == r]
            if mine:
                recv[r] += sum(1 for j in range(max(mine) + 1) if ranks[j] != r)
        start += length
    return tokens, pairs, recv


def _least_worst(doc_lens, n, a, t):
    """The least kv_worst_frac over every assignment within the caps (None: no assignment meets them)."""
    total = sum(doc_lens)
    mean_pairs = sum(L * (L + 1) // 2 for L in doc_lens) / n
    best = None
    for owner in itertools.product(range(n), repeat=total):
        tokens, pairs, recv = _figures(doc_lens, owner, n)
        if max(pairs) > a * mean_pairs + 1e-9 or max(tokens) > t * total / n + 1e-9:
            continue
        worst = max(r / (total - k) if total > k else 0.0 for r, k in zip(recv, tokens, strict=True))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize(("doc_lens", "n", "a", "t"), [
    ([8, 2, 1], 2, 1.1, 1.1), ([8, 2, 1], 2, 1.2, 1.2), ([6, 3, 2], 3, 1.1, 1.35), ([9, 1], 2, 1.5, 1.5),
    ([5, 5, 1], 2, 1.1, 1.2), ([7, 3], 3, 1.3, 1.5),
])
def test_the_floor_is_at_most_the_least_any_assignment_reaches(doc_lens, n, a, t):
    least = _least_worst(doc_lens, n, a, t)
    floor = kv_worst_floor(doc_lens, n, a, t)
    assert least is not None, "the case must have a plan within its caps"
    assert floor <= least + 1e-12, (floor, least)


def test_the_floor_is_reached_where_a_long_document_forces_it():
    """One document of 9 tokens and one of 1 over 2 ranks with loose caps: the rank with the last query can hold
    at most k tokens of it; the floor (9 - k) / (10 - k) is what the best assignment reaches."""
    floor = kv_worst_floor([9, 1], 2, 1.5, 1.5)
    k = held_at_most(9, 1.5 * (45 + 1) / 2, 7.5)
    assert floor == pytest.approx((9 - k) / (10 - k)) and floor > 0
    assert _least_worst([9, 1], 2, 1.5, 1.5) == pytest.approx(floor)


def test_held_at_most_is_the_largest_k_within_both_caps():
    for length in (1, 2, 7, 100, 4097):
        for pairs_cap in (length - 1, length, length + 0.5, length + 1, 3 * length, length ** 2):
            for tokens_cap in (1, 3, 50, 10 ** 6):
                k = held_at_most(length, pairs_cap, tokens_cap)
                fits = [j for j in range(1, length + 1) if length + j * (j - 1) / 2 <= pairs_cap and j <= tokens_cap]
                assert k == (max(fits) if fits else 1), (length, pairs_cap, tokens_cap)


@pytest.mark.parametrize("strategy", ["flashcp", "per_doc_aware", "per_doc", "headtail"])
def test_no_plan_within_the_caps_goes_below_the_floor(strategy):
    """The planner's and the baselines' plans on real packs: wherever a plan keeps the caps, its worst rank
    receives at least the floor (and some plans do keep them, so the check runs)."""
    from flashpar.cp.lengths import resolve_lengths

    checked = 0
    for name in ("magi", "wlbllm"):
        for doc_lens in resolve_lengths(name).packs(16384, 4, seed=1):
            for n in (2, 4, 8):
                s = plan(doc_lens, n, strategy=strategy).stats()
                a, t = max(s["attn_imbalance"], 1.0), max(s["token_imbalance"], 1.0)
                assert s["kv_worst_frac"] >= kv_worst_floor(doc_lens, n, a, t) - 1e-12, (name, n, strategy)
                checked += 1
    assert checked == 24


def test_bad_caps_are_one_clear_error():
    with pytest.raises(ValueError, match="caps >= 1"):
        kv_worst_floor([4, 4], 2, 0.9, 1.0)
