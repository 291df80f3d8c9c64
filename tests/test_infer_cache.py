"""The sharded KV cache's bookkeeping (``flashpar.infer.cache``) in one process, against its definition written
token by token: how many tokens of each prompt a cp rank holds, and where each prefill token's K/V goes (its
prompt's region, in global token order)."""

from __future__ import annotations

import random

import pytest
import torch

from flashpar import cp
from flashpar.infer.cache import RankCache, cache_schedule


def _slots_by_definition(plan: cp.CPPlan, rank: int, rows: list[int], offsets: list[int]) -> list[int]:
    """Local token ``j`` -> ``offset of its prompt's row + how many tokens of its prompt here come before it in
    the sequence``."""
    docs, where = plan.doc_ids(rank).tolist(), plan.local_indices(rank).tolist()
    slot = []
    for j, p in enumerate(docs):
        before = sum(1 for i, q in enumerate(docs) if q == p and where[i] < where[j])
        slot.append(offsets[rows.index(p)] + before)
    return slot


@pytest.mark.parametrize("strategy", ["flashcp", "per_doc", "contiguous", "headtail"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_held_counts_and_prefill_slots_follow_their_definition(strategy, n):
    rng = random.Random(7 * n + len(strategy))
    lens = [rng.choice([1, 3, 8, 17, 40]) for _ in range(7)]
    plan = cp.plan(lens, n, strategy=strategy)
    schedule = cache_schedule(plan, 3)
    for r in range(n):
        docs = plan.doc_ids(r).tolist()
        assert list(schedule.held[r]) == [docs.count(p) for p in range(len(lens))]
        cache = RankCache(plan, schedule, r, 1, 1, 2, torch.float32, torch.device("cpu"))
        offsets = cache.offsets.tolist()
        slots = cache.prefill_slots.tolist()
        assert slots == _slots_by_definition(plan, r, cache.rows, offsets)
        assert len(set(slots)) == len(slots)  # no two tokens share a slot
