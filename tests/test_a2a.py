"""Ulysses all-to-all ops and UlyssesAttention against float64 references on gloo at N = 1..4."""

from __future__ import annotations

import pytest

from a2a_workers import a2a_cases, attention_cases, attention_errors, run_a2a_cases
from dist_harness import SpawnCache

CASES = a2a_cases()


def _calls(n: int) -> list[tuple]:
    calls = [("ops", run_a2a_cases, CASES), ("attention", attention_cases)]
    return calls + [("errors", attention_errors)] if n != 2 else calls


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(_calls)  # one spawn per world size for every test below


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a2a_op_matches_float64_reference(spawned, n, case):
    failures = {r: out[case.id] for r, out in enumerate(spawned(n)["ops"]) if out[case.id] is not None}
    assert not failures, f"N={n} {case.id}: {failures}"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ulysses_attention_matches_plain_attention(spawned, n):
    per_rank = spawned(n)["attention"]
    failures = {(r, case): p for r, out in enumerate(per_rank) for case, p in out.items() if p is not None}
    assert len(per_rank[0]) >= 10 and not failures, failures


@pytest.mark.parametrize("n", [1, 3, 4])
def test_ulysses_bad_layouts_raise_clear_errors(spawned, n):
    for out in spawned(n)["errors"]:
        if n > 1:
            assert out["heads_not_divisible"].startswith("ValueError") and \
                f"not divisible by the sequence-parallel size {n}" in out["heads_not_divisible"], out
            assert out["kv_heads_not_divisible"].startswith("ValueError") and \
                f"kv_heads = {n + 1} is not divisible" in out["kv_heads_not_divisible"], out
            assert "must divide" in out["kv_heads_not_dividing"] or n == 3, out
            assert "must be [N * w" in out["weight_rows"], out
            assert out["features_differ"].startswith("RuntimeError") and "ranks disagree on features" in \
                out["features_differ"], out
        assert "not meaningful for all-to-all" in out["ring_rejected"], out
        assert "input columns" in out["weight_columns"], out
