"""all_gather_matmul / matmul_reduce_scatter against a float64 reference, every mode, N = 1..4 on gloo;
``mode="auto"`` choosing merged pieces through every public op, and running the two directions of the tp pair
in different schedules."""

from __future__ import annotations

import pytest

from dist_harness import SpawnCache
from overlap_cases import (
    SPLITS,
    all_cases,
    auto_cases,
    auto_merges,
    auto_splits,
    gathered_kept,
    run_all,
    split_cases,
    split_id,
)

CASES = all_cases()
WORLD_SIZES = [1, 2, 3, 4]
RAN = {"ag": ("ag_matmul", "ag_matmul_bwd"), "rs": ("matmul_rs", "matmul_rs_bwd"),
       "qkv": ("matmul_a2a", "matmul_a2a_bwd"), "out": ("a2a_matmul", "a2a_matmul_bwd")}


@pytest.fixture(scope="module")
def results():
    """One spawn per world size runs every case; per-case assertions below read the outcome."""
    return SpawnCache(lambda n: [("cases", run_all, CASES), ("auto", auto_merges), ("split", auto_splits),
                                 ("kept", gathered_kept)])


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


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("i_case", split_cases(), ids=[split_id(*c) for c in split_cases()])
def test_auto_runs_forward_and_backward_in_the_schedules_picked_for_each_exactly(results, n, i_case):
    """``auto`` with the forward and the backward picked apart (fixed picks in place of the cost model): every
    rank ran the forward's schedule then the backward's, in the modes picked (a group of one runs none), and
    the output and the gradients match the float64 reference (saved gathered x too)."""
    i, case = i_case
    (fm, fk, fg), (bm, bk, bg) = SPLITS[i]
    for r, out in enumerate(results(n)["split"]):
        problem, ran = out[split_id(i, case)]
        assert problem is None, f"N={n} rank {r} {split_id(i, case)}: {problem}"
        fwd_op, bwd_op = RAN[case.op]
        # (a piece merges at most the N - 1 peers there are)
        expect = [(fwd_op, "none", 1, 1), (bwd_op, "none", 1, 1)] if n == 1 else \
            [(fwd_op, fm, fk, min(fg, n - 1)), (bwd_op, bm, bk, min(bg, n - 1))]
        assert ran == expect, f"N={n} rank {r} {split_id(i, case)}: ran {ran}, expected {expect}"


@pytest.mark.parametrize("n", [2, 3])
def test_a_forward_without_grad_keeps_no_gathered_input(results, n):
    """``save_gathered=True`` assembles the gathered ``x`` for backward once with grad, never without it
    (inference), and the output is the same either way."""
    for r, out in enumerate(results(n)["kept"]):
        assert out == {"grad": (1, True), "no_grad": (0, True)}, f"N={n} rank {r}: {out}"
