"""Ranks that share cores (``CostModel.burst``): the step the cost model estimates, the plans it leads to, and
how the trainer finds its burst (``flashpar.links.core_burst``); the finish times of ranks sharing cores
(``flashpar.cost.shared_finish``)."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_harness import run_ranks
from flashpar import links
from flashpar.cost import shared_burst, shared_finish
from flashpar.cp import CostModel, CPPlan, plan
from flashpar.links import core_burst, host_cores

BASELINES = ("whole_doc", "per_doc", "headtail", "contiguous", "torch_per_doc")
"""The placements flashcp scores beside its own candidates (``flashcp.search.plan``, ``scored``): never estimated
faster."""


def test_burst_1_is_the_slowest_ranks_time():
    compute, remote, comm = [1.3, 0.7, 1.0], [0.2, 0.0, 0.5], [0.9, 0.0, 0.2]
    time = np.maximum(np.asarray(compute), np.asarray(comm) + np.asarray(remote))
    assert CostModel().step_time(compute, remote, comm) == float(time.max()) == 1.3


def test_a_waiting_rank_lends_its_cores():
    """The class docstring's drawing: compute 1.3 and 0.7 on two ranks, nothing received."""
    two = CostModel(burst=2.0)
    assert two.step_time([1.3, 0.7], [0.0, 0.0], [0.0, 0.0]) == pytest.approx(1.0, rel=1e-15)  # 0.7 + 0.6 / 2
    # 4 ranks on 2 cores: all busy to 0.2, then rank 0 alone on one core (2x: not every core) for 2.8 / 2
    assert two.step_time([3.0, 0.2, 0.2, 0.2], [0.0] * 4, [0.0] * 4) == pytest.approx(1.6, rel=1e-15)
    # 4, 3 and 2 busy: rates 1, 4/3 and 2 (N / k, then capped by burst), phases of 1.0, 1.0 and 2.0 of work
    assert two.step_time([1.0, 4.0, 2.0, 4.0], [0.0] * 4, [0.0] * 4) == pytest.approx(1.0 + 1.0 / (4 / 3) + 2.0 / 2)
    # a rank that waits for K/V (comm 0.9) before its remote work (0.5, at 2x: 0.25) ends at 1.15, after the span
    assert two.step_time([1.0, 1.0], [0.5, 0.0], [0.9, 0.0]) == pytest.approx(1.15, rel=1e-15)
    # burst 1.5 (3 ranks on 2 cores, 1 thread each): rate 1.5 once one rank is left
    assert CostModel(burst=1.5).step_time([1.3, 0.7], [0.0, 0.0], [0.0, 0.0]) == pytest.approx(0.7 + 0.6 / 1.5)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=1, max_size=12), st.floats(1.0, 8.0))
def test_the_span_is_a_fair_share_of_the_cores(compute, burst):
    """Against an event-by-event run of the ranks: ``k`` busy ranks each at ``min(burst, N / k)``.  Bounds:
    the mean (no more work than the cores hold) and the slowest rank over burst."""
    n, left, t = len(compute), list(compute), 0.0
    while any(x > 0 for x in left):
        busy = [i for i, x in enumerate(left) if x > 0]
        rate = min(burst, n / len(busy))
        dt = min(left[i] for i in busy) / rate
        t += dt
        for i in busy:
            left[i] = max(left[i] - dt * rate, 0.0) if left[i] - dt * rate > 1e-12 * max(compute) else 0.0
    span = CostModel(burst=burst).compute_span(compute)
    assert span == pytest.approx(t, rel=1e-9, abs=1e-12)
    assert span >= sum(compute) / n * (1 - 1e-12) and span >= max(compute) / burst * (1 - 1e-12)


@pytest.mark.parametrize("bad", [0.5, 0, -1.0, math.nan, math.inf, True, "2"])
def test_a_burst_below_1_or_not_a_number_is_refused(bad):
    with pytest.raises(ValueError, match=r"CostModel.burst must be a finite number >= 1, got"):
        CostModel(burst=bad)


def test_a_plan_keeps_its_burst_and_a_bad_one_is_refused():
    p = plan([300, 40, 900, 20], 2, cost=CostModel(hidden=512, ffn=1408, heads=8, kv_heads=4, head_dim=64,
                                                  burst=2.0))
    back = CPPlan.from_json(p.to_json())
    assert back == p and back.cost.burst == 2.0
    text = p.to_json().replace('"burst": 2.0', '"burst": 0.5')
    with pytest.raises(ValueError, match=r"^plan JSON: cost is not a CostModel \(CostModel.burst must be"):
        CPPlan.from_json(text)
    old = p.to_json().replace(', "burst": 2.0', "")  # a plan written before burst: each rank its own device
    assert CPPlan.from_json(old).cost.burst == 1.0


SHAPE = {"hidden": 512, "ffn": 1408, "heads": 8, "kv_heads": 4, "head_dim": 64, "layers": 4, "dtype_bytes": 4}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=24), st.integers(1, 6),
       st.sampled_from([1.5, 2.0, 4.0]), st.sampled_from(["cpu", "h100-ib"]))
def test_flashcp_is_never_estimated_slower_than_a_baseline(doc_lens, n, burst, hardware):
    """The search's bounds (the ring's and the others') stay lower bounds of the step with cores shared, so no
    baseline it skips or scores is estimated faster than its pick, among those within the token cap (the pick's
    first rule: whole_doc cuts a document that fits on no rank Per-Doc, and its chunks can pass the cap)."""
    from flashpar.cp.flashcp import token_cap

    cost = CostModel(**SHAPE, hardware=hardware, burst=burst).per_step()
    best = plan(doc_lens, n, strategy="flashcp", cost=cost).stats()
    cap = token_cap(doc_lens, n, 0.05)
    assert max(best["tokens"]) <= cap
    for strategy in BASELINES:
        other = plan(doc_lens, n, strategy=strategy, cost=cost).stats()
        if max(other["tokens"]) <= cap:
            assert best["est_step_time"] <= other["est_step_time"] * (1 + 1e-12), (strategy, best, other)


@pytest.mark.parametrize("processes, threads, cores, group, burst", [
    (4, 1, 2, 1, 2.0),  # bench train: 4 ranks of 1 thread on 2 cores, a core alone against half of one
    (4, 1, 2, 2, 2.0),  # ... as 2 cp ranks of 2 tp processes: 2 cores alone against 1
    (8, 1, 2, 4, 2.0),  # 2 cp ranks of 4: alone they have the 2 cores, not 4 (per process it would read 4)
    (4, 2, 2, 1, 4.0),  # 2 threads each: a rank alone takes both cores, against half of one
    (3, 1, 2, 1, 1.5),
    (4, 1, 8, 1, 1.0),  # a core per thread: nothing shared
    (4, 1, 2, 4, 1.0),  # one cp rank: no other to lend it cores
])
def test_shared_burst(processes, threads, cores, group, burst):
    assert shared_burst(processes, threads, cores, group) == burst


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_shared_burst_refuses_a_count_that_is_not_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"shared_burst: cores must be an integer >= 1, got"):
        shared_burst(4, 1, bad)


def test_shared_finish_plays_the_ranks_work_on_the_shared_cores():
    assert shared_finish([3.0, 1.0], 4) == [3.0, 1.0]  # a core per rank: nothing shared
    # equal work on 4 ranks / 2 cores is what calibration measured: unchanged
    assert shared_finish([2.0] * 4, 2) == [2.0] * 4
    # one busy rank alone gets a whole core, twice the calibrated (half-core) rate
    fin = shared_finish([2.0, 0.0, 0.0, 0.0], 2)
    assert abs(fin[0] - 1.0) < 1e-12
    # two ranks finish first; then the other two run at a full core each
    fin = shared_finish([1.0, 1.0, 3.0, 3.0], 2)
    assert [round(x, 12) for x in fin] == [1.0, 1.0, 2.0, 2.0]


def _burst(rank: int, world_size: int, threads: int, cores: int, local: str | None, device: str,
           group: int) -> float:
    torch.set_num_threads(threads)
    os.sched_getaffinity = lambda pid: set(range(cores))  # (this rank's process only)
    links.CPU_MAX = Path("/nonexistent/cpu.max")  # no container quota, whatever the machine running this has
    if local is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = local
    return core_burst(device, group)


@pytest.mark.parametrize("threads, cores, local, device, group, burst", [
    (1, 2, None, "cpu", 1, 1.5),   # 3 ranks on 2 cores: a rank alone has a core, 1.5x the share it has among 3
    (1, 1, None, "cpu", 1, 3.0),   # 3 ranks on 1 core
    (4, 2, None, "cpu", 1, 3.0),   # a rank alone uses both cores, not 4 threads' worth
    (1, 4, None, "cpu", 1, 1.0),   # a core per rank
    (1, 1, None, "cpu", 3, 1.0),   # one cp rank of 3 processes (tp 3): no other rank to lend it cores
    (1, 2, "3", "cpu", 1, 1.5),    # torchrun's count of this node's ranks
    (1, 2, "1", "cpu", 1, 1.0),    # the job spans nodes: the cp group may not share one host's cores
    (1, 1, None, "cuda", 1, 1.0),  # a GPU per rank
])
def test_core_burst_counts_the_ranks_threads_and_cores_of_the_host(threads, cores, local, device, group, burst):
    assert run_ranks(3, _burst, threads, cores, local, device, group) == [burst] * 3


@pytest.mark.parametrize("text, cores", [
    ("200000 100000\n", 2),   # docker --cpus 2
    ("150000 100000\n", 2),   # 1.5 cores' worth: rounded up
    ("50000 100000\n", 1),
    ("max 100000\n", 64),     # no quota: the affinity
    ("garbage\n", 64),        # unreadable: the affinity
    (None, 64),                # no cgroup v2 file
])
def test_host_cores_takes_a_containers_quota(tmp_path, monkeypatch, text, cores):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    cpu_max = tmp_path / "cpu.max"
    if text is not None:
        cpu_max.write_text(text)
    assert host_cores(cpu_max) == cores


def test_one_process_alone_shares_nothing():
    assert core_burst("cpu") == 1.0  # no process group: one rank, whatever its threads


def test_the_plans_of_ranks_sharing_cores_keep_a_document_whole_where_it_buys_no_balance():
    """``bench train``'s pack on the cpu preset: with a core per rank the planner cuts the long document (the
    whole-document plan's slowest rank 1.16x the mean); with 2 ranks per core (its 4 ranks of 1 thread on 2
    cores) that plan takes the ranks' total work, the same as the cut one's, with no K/V to wait for."""
    from flashpar.train.planning import planner_cost
    from test_planner_device import BENCH_MODEL, BENCH_PACK

    own = plan(BENCH_PACK, 2, strategy="flashcp", cost=planner_cost(BENCH_MODEL, burst=1.0)).stats()
    shared_cost = planner_cost(BENCH_MODEL, burst=2.0)
    shared = plan(BENCH_PACK, 2, strategy="flashcp", cost=shared_cost).stats()
    assert own["total_kv_bytes"] > 0 and own["compute_imbalance"] < 1.01
    assert shared["total_kv_bytes"] == 0 and shared["compute_imbalance"] > 1.1
    cut = plan(BENCH_PACK, 2, strategy="flashcp", cost=dataclasses.replace(shared_cost, burst=1.0))
    cut_on_shared = CPPlan(cut.cp_size, cut.doc_lens, cut.strategy, cut.segments, cut.comm, shared_cost)
    assert shared["est_step_time"] < cut_on_shared.stats()["est_step_time"]


def test_the_simulator_shares_the_cores_as_the_run_did():
    """``simulate check`` of a bench train report: its ranks shared 2 cores (4 ranks of 1 thread; the report's
    ``world_size``, ``threads``, ``cores``).  flashpar's plan keeps the long document whole (burst 2), so one cp
    rank computes more than the other; with the cores shared the block ends when the ranks' work is done
    (``compute_span``), earlier than the slowest rank's time at the shared rate and no earlier than the mean."""
    import json
    from pathlib import Path

    from flashpar.sim import check_train
    from flashpar.sim.peers import PEERS
    from flashpar.sim.predict import simulate
    from flashpar.sim.step import block

    report = json.loads((Path(__file__).parents[1] / "tests/data/bench_train_report.json").read_text())
    report["setup"]["plan_burst"] = 2.0
    assert check_train.run_burst(report["setup"], 2) == 2.0 and check_train.run_burst({}, 2) == 1.0
    with pytest.raises(ValueError, match=r"^the report's setup \(world_size, threads, cores\): .*threads"):
        check_train.run_burst({**report["setup"], "threads": 0}, 2)
    shared = check_train.workload(report, "flashpar")
    own = dataclasses.replace(shared, shared_cores=1.0)
    assert shared.shared_cores == 2.0 and shared.plan_burst == 2.0
    for i in (2, 3):  # forward and backward, compute alone
        span, slowest = block(shared, PEERS["flashpar"])[i].compute, block(own, PEERS["flashpar"])[i].compute
        assert slowest / 2 <= span < slowest / 1.05  # at least the slowest over burst; the ranks are unequal
    assert simulate(shared, PEERS["flashpar"])["no_comm_s"] < simulate(own, PEERS["flashpar"])["no_comm_s"]
