"""Ulysses all-to-all ops against float64 references on gloo at N = 1..4."""

from __future__ import annotations

import pytest

from a2a_workers import a2a_cases, op_errors, run_a2a_cases
from dist_harness import SpawnCache

CASES = a2a_cases()


def _calls(n: int) -> list[tuple]:
    calls = [("ops", run_a2a_cases, CASES)]
    return calls + [("errors", op_errors)] if n != 2 else calls


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(_calls)  # one spawn per world size for every test below


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a2a_op_matches_float64_reference(spawned, n, case):
    failures = {r: out[case.id] for r, out in enumerate(spawned(n)["ops"]) if out[case.id] is not None}
    assert not failures, f"N={n} {case.id}: {failures}"


@pytest.mark.parametrize("n", [1, 3, 4])
def test_a2a_bad_inputs_raise_clear_errors(spawned, n):
    for out in spawned(n)["errors"]:
        if n > 1:
            assert "must be [N * w" in out["weight_rows"], out
            assert out["features_differ"].startswith("RuntimeError") and "ranks disagree on features" in \
                out["features_differ"], out
        assert "not meaningful for all-to-all" in out["ring_rejected"], out
        assert "input columns" in out["weight_columns"], out
