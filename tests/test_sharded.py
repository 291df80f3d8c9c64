"""ShardedLinear (ZeRO-3 / FSDP style, fused gather and reduce-scatter) on gloo at N = 1..4."""

from __future__ import annotations

import pytest

from dist_harness import SpawnCache
from sharded_workers import error_cases, linear_cases, model_step_all_modes


def _calls(n: int) -> list[tuple]:
    return [("linear", linear_cases)] + [("model", model_step_all_modes)] * (n in (2, 3)) + \
        [("errors", error_cases)] * (n in (1, 3))


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(_calls)  # one spawn per world size for every test below


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sharded_linear_matches_float64_reference(spawned, n):
    per_rank = spawned(n)["linear"]
    failures = {(r, case): p for r, out in enumerate(per_rank) for case, p in out.items() if p is not None}
    assert len(per_rank[0]) == 31 and not failures, failures


@pytest.mark.parametrize("n", [2, 3])
def test_shard_linears_model_step_matches_data_parallel_average(spawned, n):
    per_rank = spawned(n)["model"]
    failures = {(r, mode): p for r, out in enumerate(per_rank) for mode, p in out.items() if p is not None}
    assert not failures, failures


@pytest.mark.parametrize("n", [1, 3])
def test_bad_input_raises_on_every_rank(spawned, n):
    for r, out in enumerate(spawned(n)["errors"]):
        assert out["unknown_mode"].startswith("ValueError") and "unknown mode 'fast'" in out["unknown_mode"]
        assert out["feature_mismatch"].startswith("ValueError") and "same in" in out["feature_mismatch"]
        assert out["bias_mismatch"].startswith("ValueError") and "bias shard" in out["bias_mismatch"]
        assert out["split_wrong"].startswith("ValueError") and "split_sizes" in out["split_wrong"]
        if n > 1:
            msg = out["features_differ"]
            assert msg.startswith("RuntimeError") and "in features" in msg, (r, msg)
        assert out["healthy_after"] == "ok", out["healthy_after"]
