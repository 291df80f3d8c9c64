"""Property tests: the schedule builders and the planner's JSON loading take any input and answer
with a correct result or one clear ``ValueError``, never another exception, a hang or a crash.

A plan is a file users may keep and pass around, so ``CPPlan.from_json`` is checked on random bytes, on random
valid plans (round trip) and on valid plans with one field broken (refused, naming the field)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashpar.cp import STRATEGIES, plan
from flashpar.cp.cp_plan import CPPlan
from flashpar.overlap.schedule import A2A_OPS, OPS, Compute, Exchange, Wait, build_schedule

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 9), st.floats(allow_nan=True), st.text(max_size=4),
                st.lists(st.integers(0, 3), max_size=2))


def _valid_schedule(s) -> None:
    """What every schedule must be: each wait names an item already submitted, each lane item has a unique id,
    each exchange's transfers name a peer in the group other than the rank itself, and a rank of a group of
    one moves nothing."""
    submitted = set()
    for step in s.steps:
        if isinstance(step, Wait):
            assert step.id in submitted, f"{s.op}/{s.mode}: waits for item {step.id} before it is submitted"
        elif isinstance(step, Compute):
            continue
        elif hasattr(step, "id"):
            assert step.id not in submitted
            submitted.add(step.id)
            if isinstance(step, Exchange):
                for t in (*step.sends, *step.recvs):
                    assert 0 <= t.peer < s.world_size and t.peer != s.rank
    if s.world_size == 1:
        assert not s.lane_items()


@SETTINGS
@given(op=st.one_of(st.sampled_from(OPS + A2A_OPS), ANY), mode=st.one_of(st.sampled_from(["flash", "ring",
       "slice", "none"]), ANY), n=st.one_of(st.integers(-1, 6), ANY), rank=st.one_of(st.integers(-1, 6), ANY),
       chunks=st.one_of(st.integers(-1, 5), ANY), flags=st.dictionaries(st.sampled_from(
           ["grad_input", "grad_weight", "grad_bias", "regather", "reduce_weight"]), st.one_of(st.booleans(), ANY)))
def test_schedule_builders_answer_any_arguments(op, mode, n, rank, chunks, flags):
    try:
        s = build_schedule(op, mode, n, rank, chunks=chunks, **flags)
    except ValueError as err:
        assert "\n" not in str(err) and str(err)
        return
    _valid_schedule(s)


LENS = st.lists(st.integers(1, 300), min_size=1, max_size=12)


@SETTINGS
@given(data=st.binary(max_size=200))
def test_plan_from_random_bytes_is_refused_with_one_line(data):
    try:
        CPPlan.from_json(data.decode("utf-8", "replace"))
    except ValueError as err:
        assert "\n" not in str(err) and str(err).startswith("plan JSON")
    else:  # a random text that is a valid plan: vanishingly unlikely, but it would be correct
        pass


@SETTINGS
@given(lens=LENS, n=st.integers(1, 4), strategy=st.sampled_from(STRATEGIES))
def test_random_valid_plans_round_trip(lens, n, strategy):
    if sum(lens) < n:
        return
    p = plan(lens, n, strategy=strategy)
    q = CPPlan.from_json(p.to_json())
    assert q == p and [q.kv_recv(r) for r in range(n)] == [p.kv_recv(r) for r in range(n)]


def _broken(d: dict, how: str) -> dict:
    d = json.loads(json.dumps(d))
    segs = d["segments"]
    if how == "cp_size":
        d["cp_size"] += 1
    elif how == "overlap":  # a token held twice
        segs[0].append(list(segs[-1][-1]) if segs[-1] else [0, 1])
    elif how == "gap":  # the last token of one range held by nobody
        r = next(i for i, s in enumerate(segs) if s)
        a, b = segs[r][-1]
        if b - a > 1:
            segs[r][-1] = [a, b - 1]
        else:
            segs[r].pop()
    elif how == "crosses":  # a range over a document boundary
        d["doc_lens"] = [d["doc_lens"][0] - 1, 1] + d["doc_lens"][1:] if d["doc_lens"][0] > 1 else None
    elif how == "comm":
        d["comm"] = "some"
    elif how == "types":
        d["doc_lens"] = [str(x) for x in d["doc_lens"]]
    elif how == "negative":
        d["segments"][0] = [[-1, 0]] + d["segments"][0]
    elif how == "missing":
        del d["segments"]
    elif how == "cost":
        d["cost"]["heads"] = "many"
    return d


@pytest.mark.parametrize("how, field", [
    ("cp_size", "cp_size"), ("overlap", "segments"), ("gap", "segments"), ("crosses", "doc_lens"),
    ("comm", "comm"), ("types", "doc_lens"), ("negative", "segments"), ("missing", "segments"), ("cost", "cost"),
])
def test_a_broken_plan_is_refused_naming_the_field(how, field):
    p = plan([40, 7, 90, 13, 200], 3, strategy="flashcp")
    d = _broken(json.loads(p.to_json()), how)
    if d["doc_lens"] is None:
        pytest.skip("no document boundary to cross")
    with pytest.raises(ValueError) as err:
        CPPlan.from_json(json.dumps(d))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("plan JSON") and field in msg, msg
