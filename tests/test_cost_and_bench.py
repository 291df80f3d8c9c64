"""Cost model, simulator, 'auto' choice, stored calibration, and a smoke run of `flashpar bench overlap`."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from flashpar import cost
from flashpar.cost import Hardware
from flashpar.overlap.schedule import build_schedule
from flashpar.overlap.simulate import (
    AUTO_MARGIN,
    CANDIDATES,
    SPLIT_OPS,
    candidates,
    choose_modes,
    op_shapes,
    predict,
    simulate,
)

# A clean machine for the simulator: 1 TFLOP/s, no small-M penalty, 1 GB/s link, no latency.
HW = Hardware(flops=1e12, half_rows=0, gemm_overhead_s=0, link_bytes_per_s=1e9, link_latency_s=0,
              memory_bytes_per_s=1e15)


def _times(mode, n, rows, n_in, n_out, chunks=1, hw=HW, op="ag_matmul"):
    return predict(op, mode, chunks, n, rows, n_in, n_out, 4, hw)[op]


@pytest.mark.parametrize("n", [2, 4])
def test_flash_hides_communication_inside_the_window(n):
    # comm/compute = (N-1)/N * 4 bytes * flops / (2 n_out link) = 0.5, inside (N-1)/N: flash is
    # compute-bound, none pays compute + comm
    rows, n_in = 4096, 1024
    n_out = int((n - 1) / n * 4000)
    flash, none = _times("flash", n, rows, n_in, n_out), _times("none", n, rows, n_in, n_out)
    assert flash.total == pytest.approx(flash.compute, rel=1e-6)
    assert none.total == pytest.approx(none.compute + none.comm, rel=1e-6)
    assert flash.comm == pytest.approx(none.comm, rel=1e-6)


def test_slice_exposes_its_first_slice_and_flash_meets_the_decomposed_bound():
    n, rows, n_in, n_out = 4, 4096, 1024, 64  # communication-bound
    s = _times("slice", n, rows, n_in, n_out, chunks=4)
    assert s.total > max(s.compute, s.comm) * 1.01
    for k in (1, 2, 4):
        f = _times("flash", n, rows, n_in, n_out, chunks=k)
        assert f.total == pytest.approx(max(f.compute, f.comm + f.compute / (n * k)), rel=1e-6)


def test_reduce_scatter_local_last_covers_the_last_send():
    n, rows, n_in, n_out = 4, 4096, 3000, 256  # comm/compute = 0.5 (see above, with n_in)
    f = _times("flash", n, rows, n_in, n_out, op="matmul_rs")
    assert f.comm < f.compute
    assert f.total == pytest.approx(f.compute, rel=1e-3)  # + the adds of the received partials


def _fwd_bwd(op, mode, chunks, n, rows, n_in, n_out, hw, g=1):
    return sum(t.total for t in predict(op, mode, chunks, n, rows, n_in, n_out, 4, hw, peers_per_piece=g).values())


def joint_pick(*args, **kwargs):
    """One pick for both directions (``split=False``), as a fused op runs it."""
    fwd, bwd = choose_modes(*args, split=False, **kwargs)
    assert fwd == bwd
    return fwd


def test_auto_at_small_m_keeps_none_or_merges_every_peer_and_at_large_m_picks_flash():
    cpu = cost.preset("cpu")
    # 16 rows over 4 ranks: one piece per peer pays 3 latencies behind 4 small GEMMs, none's ring all-gather
    # 3 latencies before one GEMM; one piece of all 3 peers pays one latency (its 3 messages go together)
    # beside the local GEMM, then one GEMM of 12 rows: predicted 27% below none, the only win over it
    assert joint_pick("ag_matmul", 4, 16, 512, 512, 4, "cpu", cpu) == ("flash", 1, 3)
    none = _fwd_bwd("ag_matmul", "none", 1, 4, 16, 512, 512, cpu)
    merged = _fwd_bwd("ag_matmul", "flash", 1, 4, 16, 512, 512, cpu, g=3)
    assert merged < AUTO_MARGIN * none < _fwd_bwd("ag_matmul", "flash", 1, 4, 16, 512, 512, cpu)
    # a caller that runs one piece per peer only (merged=False) and a pair of ranks (nothing to merge) keep none
    assert joint_pick("ag_matmul", 4, 16, 512, 512, 4, "cpu", cpu, merged=False) == ("none", 1, 1)
    assert joint_pick("ag_matmul", 2, 16, 512, 512, 4, "cpu", cpu) == ("none", 1, 1)
    mode, _, _ = joint_pick("ag_matmul", 4, 8192, 1024, 1024, 4, "cpu", cpu)
    assert mode == "flash"


def _dir(op, pick, n, rows, n_in, n_out, hw, d, regather=True, elem=4):
    t = predict(op, pick[0], pick[1], n, rows, n_in, n_out, elem, hw, peers_per_piece=pick[2], regather=regather)
    return t[op if d == 0 else f"{op}_bwd"].total


def test_auto_picks_the_directions_apart_where_the_backward_hides_its_transfer_undivided():
    """Llama-70B's gate/up projection on 8 H100s, 8K rows, the backward reading the forward's gathered x: the
    forward hides its all-gather behind the GEMM cut into pieces; the backward's reduce-scatter of grad_x
    already hides behind the weight-gradient GEMM, so splitting it only thins the GEMMs: it keeps none.
    The joint pick (one schedule both ways) sees the sum and keeps none for both, leaving the forward's
    transfer exposed."""
    hw = cost.preset("h100-96gb")
    shape = ("ag_matmul", 8, 8192, 8192, 7168, 2, "cuda", hw)
    fwd, bwd = choose_modes(*shape, regather=False)
    assert fwd[0] == "flash" and bwd == ("none", 1, 1), (fwd, bwd)
    assert choose_modes(*shape, regather=False, split=False) == (("none", 1, 1),) * 2
    none = ("none", 1, 1)

    def t(pick, d):
        return _dir("ag_matmul", pick, 8, 8192, 8192, 7168, hw, d, regather=False, elem=2)  # bf16, as picked

    assert t(fwd, 0) < AUTO_MARGIN * t(none, 0)
    assert all(t(none, 1) <= t(c, 1) for c in candidates("ag_matmul", 8))
    # the two picks together beat the joint pick's none by the forward's whole gain
    assert t(fwd, 0) + t(bwd, 1) < t(none, 0) + t(none, 1) - 0.1 * t(none, 0)
def test_candidates_add_one_merge_per_piece_count_and_none_for_the_sharded_op():
    assert candidates("ag_matmul", 8) == [*CANDIDATES, ("flash", 1, 2), ("flash", 1, 3), ("flash", 1, 4),
                                          ("flash", 1, 7)]  # 4, 3, 2 and 1 pieces of the 7 peers
    assert candidates("a2a_matmul", 4) == [*CANDIDATES, ("flash", 1, 2), ("flash", 1, 3)]
    assert candidates("ag_matmul", 2) == candidates("sharded", 8) == candidates("matmul_rs", 8, merged=False) == \
        list(CANDIDATES)


@pytest.mark.parametrize("preset", ["h100-nvlink", "h100-ib", "cpu"])
def test_auto_is_never_predicted_slower_than_none(preset):
    """Over ops, group sizes and rows from decode-sized to long: the joint pick (forward + backward) is none, or
    predicted below AUTO_MARGIN of none and the fastest candidate; for the tensor-parallel pair the directions
    picked apart are no slower than the joint pick, and where they differ each is none or, in its direction,
    below AUTO_MARGIN of none and the fastest."""
    hw = cost.preset(preset)
    for op, n_in, n_out in (("ag_matmul", 4096, 768), ("matmul_rs", 512, 4096), ("matmul_a2a", 4096, 384),
                            ("a2a_matmul", 512, 4096)):
        for n in (2, 3, 4, 8):
            for rows in (8 * n, 1024, 32768):
                fwd, bwd = choose_modes(op, n, rows, n_in, n_out, 4, "cpu", hw)
                shape = (op, n, rows, n_in, n_out, hw)
                joint = joint_pick(op, n, rows, n_in, n_out, 4, "cpu", hw)
                judged = [(joint, shape, None)]
                if op in SPLIT_OPS:  # the pair no slower than the joint pick; apart, each direction's own best
                    pair = _time_of(fwd, shape, 0) + _time_of(bwd, shape, 1)
                    assert pair <= _time_of(joint, shape, None), (op, n, rows, fwd, bwd, joint)
                    if fwd != bwd:
                        judged += [(fwd, shape, 0), (bwd, shape, 1)]
                else:
                    assert fwd == bwd == joint
                for pick, shape, d in judged:
                    none, t = _time_of(("none", 1, 1), shape, d), _time_of(pick, shape, d)
                    best = min(_time_of(c, shape, d) for c in candidates(op, n))
                    assert pick == ("none", 1, 1) or t < AUTO_MARGIN * none, (op, n, rows, pick)
                    assert t <= none and (pick[0] == "none" or t == best), (op, n, rows, pick)


def _time_of(pick, shape, d):
    """A pick's predicted time in direction ``d`` (0 forward, 1 backward, None both)."""
    op, n, rows, n_in, n_out, hw = shape
    if d is None:
        return _fwd_bwd(op, pick[0], pick[1], n, rows, n_in, n_out, hw, pick[2])
    return _dir(op, pick, n, rows, n_in, n_out, hw, d)


def test_a_merged_piece_pays_one_latency_and_one_launch_per_run():
    # only the latency and the launch cost: times count messages and GEMM calls
    hw = replace(HW, flops=1e30, link_bytes_per_s=1e30, link_latency_s=1.0, gemm_overhead_s=1e-3)
    n = 5
    for g, items, gemms in ((1, 4, 5), (2, 2, 3), (3, 2, 3), (4, 1, 2)):
        t = predict("ag_matmul", "flash", 1, n, 64, 8, 8, 4, hw, peers_per_piece=g)["ag_matmul"]
        assert t.comm == pytest.approx(items) and t.compute == pytest.approx(gemms * 1e-3), g
    # rank 2's piece of all 4 peers holds blocks 0, 1 and 3, 4: it wraps past rank 0, two GEMMs
    shape = op_shapes("ag_matmul", n, 64, 8, 8, 4)["ag_matmul"]
    wrapped = simulate(build_schedule("ag_matmul", "flash", n, 2, peers_per_piece=4), shape, hw)
    assert wrapped.compute == pytest.approx(3e-3) and wrapped.comm == pytest.approx(1.0)
    # all-to-all: a run of head groups is one GEMM as wide as the run, the gather side one GEMM per group
    flops = replace(hw, flops=1e12, gemm_overhead_s=0.0, half_rows=0)
    one, merged = (predict("matmul_a2a", "flash", 1, n, 64, 8, 8, 4, flops, peers_per_piece=g) for g in (1, 4))
    assert merged["matmul_a2a"].compute == pytest.approx(one["matmul_a2a"].compute)  # the same FLOPs
    a2a = {g: predict("a2a_matmul", "flash", 1, n, 64, 8, 8, 4, hw, peers_per_piece=g) for g in (1, 4)}
    assert a2a[4]["a2a_matmul"].compute == a2a[1]["a2a_matmul"].compute == pytest.approx(5e-3)
    assert a2a[4]["a2a_matmul_bwd"].compute == pytest.approx(2e-3 + 5e-3)  # run + own piece; 5 weight terms


@pytest.mark.parametrize("op", ["sharded", "matmul_a2a", "a2a_matmul"])
def test_fsdp_and_ulysses_flash_meet_the_decomposed_bound(op):
    n = 4
    for n_free in (4096, 64):  # communication inside the window, then communication-bound
        rows, n_in, n_out = (n_free, 1024, 1024) if op == "sharded" else (4096, 1024, n_free)
        if op == "a2a_matmul":
            n_in, n_out = n_free, 1024
        t = predict(op, "flash", 2, n, rows, n_in, n_out, 4, HW)
        fwd = next(iter(t.values()))
        assert fwd.total == pytest.approx(max(fwd.compute, fwd.comm + fwd.compute / (n * 2)), rel=0.02), (op, n_free)
        none = predict(op, "none", 1, n, rows, n_in, n_out, 4, HW)
        assert next(iter(none.values())).total == pytest.approx(fwd.compute + fwd.comm, rel=0.02)


def test_simulate_counts_every_lane_item():
    shapes = op_shapes("matmul_rs", 3, 300, 16, 16, 4)
    sched = build_schedule("matmul_rs_bwd", "ring", 3, 0, grad_bias=True)
    t = simulate(sched, shapes["matmul_rs_bwd"], HW)
    assert t.comm > 0 and t.compute > 0 and t.total >= max(t.comm, t.compute)


def test_a_transfer_in_flight_slows_the_compute_beside_it():
    # N=2 flash all-gather: the exchange (b bytes each way) runs beside the local piece's GEMM, which is as
    # long as the transfer (comm/compute 0.5): the compute runs at 1 - c 2b / t_b while it is in flight, so
    # the whole schedule ends c 2b later; the compute-only and comm-only times do not change
    rows, n_in, n_out, c = 4096, 1024, 2000, 1e-10
    b = rows // 2 * n_in * 4
    free = _times("flash", 2, rows, n_in, n_out)
    slowed = _times("flash", 2, rows, n_in, n_out, hw=replace(HW, comm_cpu_s_per_byte=c))
    assert (slowed.compute, slowed.comm) == (free.compute, free.comm)
    assert slowed.total == pytest.approx(free.total + c * 2 * b, rel=1e-9)
    # none's forward waits for its all-gather before any GEMM: nothing runs beside it, nothing is charged
    none = _times("none", 2, rows, n_in, n_out, hw=replace(HW, comm_cpu_s_per_byte=c))
    assert none.total == pytest.approx(none.compute + none.comm, rel=1e-9)
    # a transport that would take more than all of the CPU stops the compute while it runs: serialised, no worse
    stalled = _times("flash", 2, rows, n_in, n_out, hw=replace(HW, comm_cpu_s_per_byte=1.0))
    assert stalled.total == pytest.approx(stalled.compute + stalled.comm, rel=1e-9)
    assert all(hw.comm_cpu_s_per_byte == 0 for hw in cost.PRESETS.values())  # GPUs: DMA engines move the bytes


def test_comm_cpu_figure_on_loopback():
    from calibrate_workers import comm_cpu
    from dist_harness import run_ranks

    figures = run_ranks(2, comm_cpu, timeout=120)
    assert figures[0] == figures[1], figures  # the slowest rank's times: the same figures everywhere
    f = figures[0]
    assert math.isfinite(f["s_per_byte"]) and f["s_per_byte"] >= 0 and f["q25"] <= f["q75"], f
    # pairs: those whose exchange ran at least partly during the GEMM (all of them but on a stalled box)
    assert 1 <= f["pairs"] <= 3 and f["bytes_moved"] > 0 and f["gemm_s"] > 0, f


def test_the_mfu_peak_is_probed_by_every_rank_at_once():
    """On CPU ``peak_flops`` waits for every rank before probing: a rank that arrives first does not probe
    the cores alone.  The last rank enters 1 s late; the first one's call lasts at least that long."""
    from calibrate_workers import late_peak
    from dist_harness import run_ranks

    took = run_ranks(2, late_peak, timeout=120)
    assert took[0] >= 0.9, took  # the barrier: rank 0 waited for rank 1 (0.1 s of slack for the sleep's start)


def test_calibration_round_trip(tmp_path):
    path = tmp_path / "hw.json"
    assert cost.load("cpu", path) == cost.preset("cpu")
    mine = Hardware(1e11, 8, 1e-5, 2e8, 5e-5, 2e10)
    cost.save(mine, "cpu", path)
    cost.save(cost.preset("cuda"), "cuda", path)
    assert cost.load("cpu", path) == mine and cost.load("cuda", path) == cost.preset("cuda")
    assert json.loads(path.read_text())["cpu"]["flops"] == 1e11  # both entries on disk, as written
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"calibration file .*broken\.json: not JSON"):
        cost.load("cpu", broken)
    with cost.use(mine):
        assert cost.load("cpu") == mine


