"""The trainer plans for the device it trains on, weighted for a training step (``planner_cost``), with
rank 0's figures on every rank (``flashpar.links.planning_device``; a GPU by its name, ``device_hardware``); the
simulator plans the same way, and reads what a bench report's trainer planned with (``setup.plan_hardware``,
``setup.plan_burst``).  Ranks sharing cores: tests/test_shared_cores.py."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from dist_harness import run_ranks
from flashpar import cost, cp
from flashpar.cost import store as cost_store
from flashpar.cp.cost import BWD_ATTN_TIME, CostModel
from flashpar.cp.cp_plan import rank_figures
from flashpar.links import device_hardware, planning_device
from flashpar.links import spans_nodes as _spans_nodes
from flashpar.models import LlamaConfig
from flashpar.sim import check_train
from flashpar.train.planning import planner_cost

BENCH_MODEL = LlamaConfig(hidden=512, layers=4, heads=8, kv_heads=4, ffn=1408, tie_embeddings=False)
BENCH_PACK = [172, 264, 40, 328, 180, 376, 212, 256, 248, 212, 296, 172, 3236, 340, 236, 384, 184, 384, 52, 8, 80,
              116, 128, 288]
"""``flashpar bench train``'s default pack (wlbllm / 16, seed 0, 8192 tokens): one 3236-token document."""


@pytest.fixture(autouse=True)
def no_calibration_file(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the presets, whatever this machine has calibrated


def test_per_step_weighs_attention_by_its_backward_and_nothing_else():
    fwd = CostModel(hardware="h100-ib")
    step = fwd.per_step()
    weight = (1 + BWD_ATTN_TIME) / 3  # attention fwd + bwd = 3.5 forwards, a linear layer's 3
    assert step.attn_time(10**6, 700, 3000) == pytest.approx(weight * fwd.attn_time(10**6, 700, 3000), rel=1e-12)
    assert step.linear_time(4096) == fwd.linear_time(4096)
    assert step.comm_time(4096) == fwd.comm_time(4096)
    assert step.hardware.attn_half == fwd.hardware.attn_half


def test_planner_cost_reads_the_training_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the presets, on a GPU machine too
    shape = {"hidden": 512, "ffn": 1408, "heads": 8, "kv_heads": 4, "head_dim": 64, "layers": 4}
    expect = {d: CostModel(**shape, dtype_bytes=4, hardware=cost.preset(p)).per_step()
              for d, p in (("cpu", "cpu-calibrated"), ("cuda", "h100-ib"))}
    assert planner_cost(BENCH_MODEL) == expect["cpu"]  # the default: a CPU trainer
    assert planner_cost(BENCH_MODEL, device_type="cuda") == expect["cuda"]
    mine = dataclasses.replace(cost.preset("cpu"), flops=7e10, link_bytes_per_s=3e8)
    with cost_store.use(mine):  # a calibration in force (as the file would be)
        assert planner_cost(BENCH_MODEL).hardware.link_bytes_per_s == 3e8
    given = planner_cost(BENCH_MODEL, 2, hardware=mine)  # the trainer's: rank 0's figures
    assert given.hardware.flops == 7e10 and given.dtype_bytes == 2


def test_a_visible_gpu_plans_with_its_own_figures(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    assert device_hardware("cuda") == cost.preset("h200")  # the GPU by its name, not the cuda fallback
    assert planner_cost(BENCH_MODEL, device_type="cuda") == planner_cost(BENCH_MODEL, hardware=cost.preset("h200"))
    assert device_hardware("cpu") == cost.preset("cpu")
    mine = dataclasses.replace(cost.preset("h200"), link_bytes_per_s=1e10)
    with cost_store.use(mine):  # a calibration in force wins over the name
        assert device_hardware("cuda") == mine
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Some Future GPU")
    assert device_hardware("cuda") == cost.preset("h100-ib")  # a GPU not listed: the cuda preset


def test_a_group_across_nodes_takes_the_ports_link_and_keeps_the_devices_figures():
    ib = cost.preset("h100-ib")
    for preset in ("h200", "b200", "a100"):
        device = cost.preset(preset)
        within = cost.group_hardware(device, ib, [0, 1, 2, 3], 8)
        across = cost.group_hardware(device, ib, [0, 8, 16, 24], 8)
        assert within == device and within.nodes == 1
        assert (across.link_bytes_per_s, across.link_latency_s) == (ib.link_bytes_per_s, ib.link_latency_s) == (
            48e9, 22.4e-6)  # NCCL's 400 Gb/s port and one Simple network step
        assert across.nodes == 4 and across.node_link_bytes_per_s == device.link_bytes_per_s
        assert dataclasses.replace(across, link_bytes_per_s=within.link_bytes_per_s, nodes=1, node_link_bytes_per_s=0.0,
                                   link_latency_s=within.link_latency_s) == within  # compute figures kept
    assert cost.group_hardware(cost.preset("h200"), ib, [6, 7, 8, 9], 8).nodes == 2  # straddling a node boundary


def _spans(rank: int, world_size: int, local: str | None) -> bool | str:
    if local is None:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    else:
        os.environ["LOCAL_WORLD_SIZE"] = local
    try:
        return _spans_nodes()
    except ValueError as err:
        return str(err)


@pytest.mark.parametrize("local,spans", [(None, False), ("2", False), ("1", True), ("x", "is not an integer")])
def test_spans_nodes_reads_torchruns_local_world_size(local, spans):
    got = run_ranks(2, _spans, local)
    if isinstance(spans, str):
        assert all(spans in g for g in got)
    else:
        assert got == [spans, spans]
    assert _spans_nodes() is False  # no process group here: one node


def _slowest_rank_s(plan, device: CostModel) -> float:
    """The plan's slowest rank on ``device`` for a whole step: forward, backward, K/V in flight."""
    return max(rank_figures(plan.segments, plan.doc_lens, plan.doc_starts, device, plan.comm).time)


def test_the_device_decides_the_plan_of_the_bench_pack():
    """On an H100 preset the bench model's step is microseconds: splitting the long document costs more K/V
    time than it balances, and the planner keeps every document whole (1.08x compute imbalance by its own
    estimate, kernel launches included: 5 and 8 calls).  On the CPU it splits the long document; there the
    whole-document plan's slowest rank takes 1.14x as long by the cpu preset (1.18x by the curves ``bench train``
    measured, docs/benchmarks/train-default.json)."""
    gpu = cp.plan(BENCH_PACK, 2, strategy="flashcp", cost=planner_cost(BENCH_MODEL, device_type="cuda"))
    cpu = cp.plan(BENCH_PACK, 2, strategy="flashcp", cost=planner_cost(BENCH_MODEL))
    assert gpu.stats()["total_kv_bytes"] == 0 and gpu.stats()["compute_imbalance"] > 1.05
    assert cpu.stats()["total_kv_bytes"] > 0 and cpu.stats()["compute_imbalance"] < 1.01
    device = planner_cost(BENCH_MODEL)
    assert _slowest_rank_s(gpu, device) > 1.1 * _slowest_rank_s(cpu, device)


def _plan_with_own_figures(rank: int, world_size: int) -> tuple[float, float, float]:
    mine = dataclasses.replace(cost.preset("cpu"), flops=1e10 * (rank + 1))  # as if each node calibrated alone
    os.sched_getaffinity = lambda pid: set(range(1 if rank == 0 else 64))  # rank 0's host: 1 core
    with cost_store.use(mine):
        hw, burst = planning_device("cpu")
    return hw.flops, cost_store.load("cpu").flops, burst


@pytest.mark.parametrize("world_size", [1, 3])
def test_every_rank_plans_with_rank_0s_figures(world_size):
    got = run_ranks(world_size, _plan_with_own_figures)
    assert [flops for flops, _, _ in got] == [1e10] * world_size
    assert [own for _, own, _ in got] == [cost.preset("cpu").flops] * world_size  # `use` ended with the block
    assert [burst for _, _, burst in got] == [float(world_size)] * world_size  # rank 0's: N ranks on 1 core


def _plan_with_broken_file_on_rank0(rank: int, world_size: int, folder: str) -> str:
    if rank == 0:  # only rank 0 reads the figures: the other ranks' files are not looked at
        os.environ["XDG_CACHE_HOME"] = folder
    try:
        planning_device("cpu")
    except ValueError as err:
        return str(err)
    return "no error"


def test_rank0s_unreadable_figures_fail_every_rank(tmp_path):
    broken = tmp_path / "flashpar" / "hardware.json"
    broken.parent.mkdir()
    broken.write_text("{not json")
    got = run_ranks(3, _plan_with_broken_file_on_rank0, str(tmp_path))
    assert all(g.startswith("planning figures of rank 0: calibration file") and str(broken) in g for g in got), got


def test_a_report_says_what_its_trainer_planned_with():
    cpu = dataclasses.asdict(cost.preset("cpu"))
    assert check_train.plan_hardware({}) == (cost.preset("h100-ib"), False)  # no such field: forward, h100-ib
    assert check_train.plan_hardware({"plan_hardware": cpu}) == (cost.preset("cpu"), True)
    for bad, needle in (([1, 2], "must be an object"), ({**cpu, "flops": -1}, "flops must be > 0"),
                        ({"speed": 1}, "speed")):
        with pytest.raises(ValueError, match=needle):
            check_train.plan_hardware({"plan_hardware": bad})
    assert check_train.plan_burst({}) == 1.0  # a report without the field: each rank its own device
    assert check_train.plan_burst({"plan_burst": 2.0}) == 2.0
    for bad in (0.5, "2", None):
        with pytest.raises(ValueError, match=r"^the report's setup.plan_burst: CostModel.burst must be"):
            check_train.plan_burst({"plan_burst": bad})


def test_the_trainers_zero3_schedule_is_the_fastest_simulated_candidate():
    """``--zero-schedule auto``: the per-block schedule the trainer builds is the candidate whose simulated step
    is the shortest on the trainer's own workload (``zero_workload``), every block prefetched unless another
    wins by more than the margin; explicit schedules pass through; the baseline (``--mode none``) prefetches
    every block (blocking)."""
    from flashpar.links import planning_device
    from flashpar.models import LlamaConfig
    from flashpar.sim import zero
    from flashpar.sim.predict import simulate
    from flashpar.train.config import TrainConfig
    from flashpar.train.planning import resolve_options, zero_workload

    model = LlamaConfig(hidden=512, heads=8, kv_heads=4, ffn=1408, layers=4)
    figures = planning_device("cpu")  # read once: what resolve_options and the planner share
    for kw in ({"dp": 2, "cp": 1, "tp": 2}, {"dp": 1, "cp": 2, "tp": 2}, {"dp": 2, "cp": 2, "tp": 1}):
        config = TrainConfig(**kw, model=model, seq_len=4096)
        w, peer = zero_workload(config, "cpu", figures)
        times = {c: simulate(w, peer, c)["step_s"] for c in zero.candidates(w, peer)}
        assert len(times) == 3  # every candidate exists here (no Ulysses, a shard group of 2)
        every, best = next(iter(times)), min(times, key=times.get)
        want = best if times[best] < zero.ZERO_AUTO_MARGIN * times[every] else every
        options = resolve_options(config, "cpu", figures)
        assert options.zero_schedule == want and options.resolved, (kw, times)
    fused = TrainConfig(dp=2, cp=1, tp=2, model=model, zero_schedule="fused")
    assert resolve_options(fused, "cpu", figures).zero_schedule == "fused"
    blocking = resolve_options(TrainConfig(dp=2, cp=1, tp=2, model=model, mode="none"), "cpu", figures)
    assert (blocking.zero_schedule, blocking.zero_collective) == (("prefetch",) * 4, "ring")
    whole = resolve_options(TrainConfig(dp=2, cp=1, tp=2, model=model, dp_mode="replicate"), "cpu", figures)
    assert whole.resolved and whole.dp_mode == "replicate"
