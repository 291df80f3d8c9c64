"""all_gather_matmul / matmul_reduce_scatter against a float64 reference, every mode, N = 1..4 on gloo; and
``mode="auto"`` choosing merged pieces through every public op."""

from __future__ import annotations

import pytest

from dist_harness import SpawnCache
from overlap_cases import all_cases, auto_cases, auto_merges, run_all

CASES = all_cases()
WORLD_SIZES = [1, 2, 3, 4]
RAN = {"ag": ("ag_matmul", "ag_matmul_bwd"), "rs": ("matmul_rs", "matmul_rs_bwd"),
       "qkv": ("matmul_a2a", "matmul_a2a_bwd"), "out": ("a2a_matmul", "a2a_matmul_bwd")}


@pytest.fixture(scope="module")
def results():
    """One spawn per world size runs every case; per-case assertions below read the outcome."""
    return SpawnCache(lambda n: [("cases", run_all, CASES), ("auto", auto_merges)])


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_float64_reference(results, n, case):
    per_rank = results(n)["cases"]
    failures = {r: out[case.id] for r, out in enumerate(per_rank) if out[case.id] is not None}
    assert not failures, f"N={n} {case.id}: {failures}"


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("case", auto_cases(), ids=[c.id for c in auto_cases()])
def test_auto_runs_the_merged_pieces_it_picks_exactly(results, n, case):
    """Where launches and latencies are all that cost, auto merges every peer into one piece (N >= 3): each
    rank ran exactly the merged forward and backward schedules, and the results match the reference."""
    for r, out in enumerate(results(n)["auto"]):
        problem, ran = out[case.id]
        assert problem is None, f"N={n} rank {r} {case.id}: {problem}"
        if n <= 2:  # one peer: nothing to merge (N = 1 runs none; at N = 2 auto picks none or flash)
            assert [(op, g) for op, _, g in ran] == [(op, 1) for op in RAN[case.op]], f"N={n} {case.id}: ran {ran}"
            continue
        expect = [(op, "flash", n - 1) for op in RAN[case.op]]
        assert ran == expect, f"N={n} rank {r} {case.id}: ran {ran}, expected {expect}"
