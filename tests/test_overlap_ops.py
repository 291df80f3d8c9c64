"""all_gather_matmul / matmul_reduce_scatter against a float64 reference, every mode, N = 1..4 on gloo."""

from __future__ import annotations

import pytest

from dist_harness import run_ranks
from overlap_cases import all_cases, run_all

CASES = all_cases()
WORLD_SIZES = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def results():
    """One spawn per world size runs every case; per-case assertions below read the outcome."""
    cache: dict[int, list[dict]] = {}

    def get(n: int) -> list[dict]:
        if n not in cache:
            cache[n] = run_ranks(n, run_all, CASES)
        return cache[n]

    return get


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_float64_reference(results, n, case):
    per_rank = results(n)
    failures = {r: out[case.id] for r, out in enumerate(per_rank) if out[case.id] is not None}
    assert not failures, f"N={n} {case.id}: {failures}"
