"""ZeRO-3 composed with tensor + sequence parallelism (``flashpar.overlap.sharded``, ``flashpar.models.zero``) on
gloo: meshes (dp, tp) of 1 to 4 ranks, against the float64 single-process layer."""

from __future__ import annotations

import pytest

from dist_harness import SpawnCache
from zero_workers import LATE_S, MESHES, bad_input, in_flight, modules_no_exchange, reference_cases


def _calls(n: int) -> list[tuple]:
    calls = [("reference", reference_cases)]
    if n in (1, 4):
        calls.append(("modules", modules_no_exchange))
    if n == 4:
        calls += [("in_flight", in_flight), ("errors", bad_input)]
    return calls


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(_calls)  # one spawn per world size for every test below


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_both_kinds_match_float64_reference_every_mesh_and_mode(spawned, n):
    """Output, grad_x, grad_W (summed over dp) and grad_b of the column and the row kind on every (dp, tp) mesh of
    ``n`` ranks, modes flash (1 and 2 chunks), ring, slice, none, uneven dp rows (5 rows of W_t) and uneven tp
    blocks; nothing gathered is saved for backward; in flash the bytes at the transport are the decomposition's
    (the dp rows once each way, the tp activation gathered once per direction)."""
    per_rank = spawned(n)["reference"]
    cases = 2 * 7 * len(MESHES[n])  # kinds x (5 modes + bias-with-mid + bias in none) per mesh
    failures = {(r, case): p for r, out in enumerate(per_rank) for case, p in out.items() if p is not None}
    assert all(len(out) == cases for out in per_rank) and not failures, failures


@pytest.mark.parametrize("n", [1, 4])
def test_layers_exchange_no_metadata_with_check_off(spawned, n):
    """The four linear classes with ``check=False`` and ``split_sizes``: no cross-rank metadata exchange, forward
    or backward; with ``check=True`` one per plain layer and two (tp, dp) per ZeRO layer, so the count is live.
    The ZeRO layers hold their dp rows of the plain layer's weight (same seed) and give the same output (fp32:
    the same products, summed in another order, ~1e-7 relative)."""
    for out in spawned(n)["modules"]:
        for kind in ("column", "row"):
            assert out[f"{kind}-checkFalse-exchanges"] == 0, out
            assert out[f"{kind}-checkTrue-exchanges"] == (3 if n == 4 else 0), out  # a group of one exchanges nothing
            assert out[f"{kind}-rows"] and out[f"{kind}-forward"] < 1e-6, out


def test_dp_rows_are_in_flight_during_the_inner_tp_schedule(spawned):
    """(2, 2) mesh, flash, dp replica 1 late by ``LATE_S`` in each direction: replica 0 runs its first inner tp GEMM
    (with its tp peer, which is on time) long before the late replica's rows can have arrived, and the op still
    lasts until they do.  A sequential composition (the dp rows gathered, then the tp op) would start its first
    tp GEMM only after ``LATE_S``."""
    for rank, out in enumerate(spawned(4)["in_flight"]):
        if not out:
            continue  # the late replica
        assert sorted(out) == ["column-bwd", "column-fwd", "row-bwd", "row-fwd"]
        for what, (first_gemm, took) in out.items():
            assert took > 0.8 * LATE_S, (rank, what, took)  # the late replica held it up: the test is live
            assert first_gemm < 0.5 * LATE_S, (rank, what, first_gemm, took)


def test_bad_input_raises_on_every_rank_of_the_mesh(spawned):
    for r, out in enumerate(spawned(4)["errors"]):
        for kind in ("column", "row"):
            if r == 0:
                assert out[kind].startswith("ValueError") and "same in" in out[kind], out
            else:
                assert out[kind].startswith("RuntimeError") and "rank(s) [0] rejected" in out[kind], out
        assert out["healthy_after"] == "ok", out
