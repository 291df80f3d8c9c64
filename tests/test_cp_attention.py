"""Context-parallel attention against a float64 whole-sequence reference on gloo at N = 1..4,
for every planner strategy, with the bytes sent checked against the plan."""

from __future__ import annotations

import pytest

from cp_workers import all_cases, bad_inputs, subgroup_case
from dist_harness import SpawnCache
from flashpar.cp import STRATEGIES
from flashpar.cp.layout import PATTERNS


def _calls(n: int) -> list[tuple]:
    calls = [("cases", all_cases)] + ([("subgroups", subgroup_case)] if n == 4 else [])
    return calls + [("bad", bad_inputs)] if n != 2 else calls  # bad input last


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(_calls)  # one spawn per world size for every test below


@pytest.fixture(scope="module")
def results(spawned):
    return lambda n: spawned(n)["cases"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_output_and_gradients_match_float64_reference(results, n):
    per_rank = results(n)
    assert len(per_rank[0]) == 6 * len(STRATEGIES) + 12
    failures = {(r, case): out["bad"] for r, rank_out in enumerate(per_rank) for case, out in rank_out.items()
                if out["bad"] is not None}
    assert not failures, failures


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_bytes_sent_equal_the_plan(results, n):
    """The counter holds the ``nbytes`` the executor handed to the transport (measured at the posts,
    not derived from the plan).  p2p and all-gather: every rank sends exactly the plan's
    ``kv_send_bytes`` and, backward, returns one gradient per K/V row it received and receives one
    per row it sent.  Ring: each rank forwards every block but its successor's, so per rank it sends
    ``total - tokens[r + 1]`` tokens (the total equals the plan's); backward it sends the running
    sums of every block but its own and receives those of every block but its predecessor's."""
    per_rank = results(n)
    for case in per_rank[0]:
        rows = [rank_out[case] for rank_out in per_rank]
        fwd, plan_send = [x["fwd_sent"] for x in rows], [x["plan_send"] for x in rows]
        assert [x["fwd_recv"] for x in rows] == [x["plan_recv"] for x in rows], case
        assert sum(fwd) == sum(plan_send), case
        if PATTERNS.get(case[1]) == "ring":
            tokens = rows[0]["tokens"]
            per_token = sum(fwd) / max(1, (n - 1) * sum(tokens))
            assert fwd == [(sum(tokens) - tokens[(r + 1) % n]) * per_token for r in range(n)], case
            assert [x["bwd_sent"] for x in rows] == [(sum(tokens) - tokens[r]) * per_token for r in range(n)], case
            assert [x["bwd_recv"] for x in rows] == [(sum(tokens) - tokens[r - 1]) * per_token for r in range(n)], \
                case
        else:
            assert fwd == plan_send, case
            assert [x["bwd_sent"] for x in rows] == [x["fwd_recv"] for x in rows], case
            assert [x["bwd_recv"] for x in rows] == fwd, case


def test_sharding_aware_plans_send_less_than_all_gather(results):
    per_rank = results(4)
    total = {s: sum(r[("mixed", s)]["fwd_sent"] for r in per_rank) for s in STRATEGIES}
    assert total["flashcp"] < total["per_doc_aware"] < total["per_doc"], total


@pytest.mark.parametrize("n", [1, 3, 4])
def test_bad_input_raises_on_every_rank(spawned, n):
    per_rank = spawned(n)["bad"]
    words = {"tokens": "plan gives it", "heads": "multiple of kv heads", "cp_size": f"cp_size {n + 1}",
             "plan": "disagree on plan", "layout": "disagree on tokens"}
    for name, word in words.items():
        if name == "plan" and n == 1:
            continue  # one rank cannot disagree with itself
        for r, out in enumerate(per_rank):
            expected = word
            if name == "tokens" and r != n - 1:  # only the last rank's input is bad; its peers name it
                expected = f"rank(s) [{n - 1}] rejected their input"
            assert out[name] is not None and expected in out[name], (name, r, out[name])


def test_cp_groups_inside_a_larger_world(spawned):
    per_rank = spawned(4)["subgroups"]
    failures = {(r, s): e for r, out in enumerate(per_rank) for s, e in out.items() if e is not None}
    assert len(per_rank[0]) == 4 and not failures, failures
