"""flashpar.cost: presets, the GEMM and attention curves, the calibration file, and that every
consumer (planner, simulator, ``auto``, MFU) reads the same machine."""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys

import pytest
import torch

from flashpar import cost
from flashpar.cost import Hardware
from flashpar.cost.calibrate import fit_attention_curve, peak_flops
from flashpar.cp import CostModel, CPPlan, plan
from flashpar.overlap.simulate import predict


def test_presets_hold_the_datasheet_figures():
    h100, ib = cost.preset("h100-nvlink"), cost.preset("h100-ib")
    assert h100.flops == ib.flops == cost.preset("h200").flops == 989e12  # dense bf16, H100 / H200 SXM
    assert cost.preset("a100").flops == 312e12 and cost.preset("b200").flops == 2250e12
    assert h100.link_bytes_per_s == pytest.approx(370.8e9)  # NCCL's NVLink 4 rate: 18 links x 20.6 GB/s
    assert ib.link_bytes_per_s == 48e9  # NCCL's rate of one 400 Gb/s port per GPU
    assert cost.preset("a100").link_bytes_per_s == 240e9
    assert cost.preset("b200").link_bytes_per_s == pytest.approx(721.8e9)
    assert (h100.memory_bytes_per_s, cost.preset("h200").memory_bytes_per_s) == (3.35e12, 4.8e12)
    for name, hw in cost.PRESETS.items():  # the small-M knee is where the bf16 weight read stops bounding
        if name != "cpu-calibrated":
            assert hw.half_rows == round(hw.gemm_flops / hw.memory_bytes_per_s), name


def test_aliases_and_unknown_names():
    assert cost.preset("cpu") is cost.preset("cpu-calibrated")
    assert cost.preset("cuda") is cost.preset("h100-ib")
    assert cost.preset_name("cuda") == "h100-ib"
    assert cost.device_preset("mps") == "cpu-calibrated"  # any other device type: as cpu
    with pytest.raises(ValueError, match=r"unknown hardware preset 'h800'; known: h100-nvlink, .*cpu, cuda"):
        cost.preset("h800")
    assert cost.gpu_preset("NVIDIA H100 80GB HBM3") == "h100-nvlink"
    assert cost.gpu_preset("NVIDIA H200") == "h200" and cost.gpu_preset("NVIDIA A100-SXM4-80GB") == "a100"
    assert cost.gpu_preset("NVIDIA GeForce RTX 4090") == "h100-ib"  # not listed: what 'cuda' means


def test_gemm_small_m_curve():
    hw = cost.preset("h100-nvlink")
    k, n = 4096, 4096
    assert hw.gemm_rate(int(hw.half_rows)) == pytest.approx(hw.gemm_flops / 2)
    rates = [hw.gemm_rate(m) for m in (1, 16, 128, 1024, 8192, 1 << 20)]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(hw.gemm_flops, rel=1e-3)
    assert hw.gemm_flops == hw.flops * 0.7
    for m in (1, 64, 4096):  # and the bf16 input and output at memory bandwidth
        io = 2 * m * (k + n) / hw.memory_bytes_per_s
        assert hw.gemm_time(m, k, n) == pytest.approx(hw.gemm_overhead_s + 2 * m * k * n / hw.gemm_rate(m) + io)
    narrow = hw.gemm_time(1 << 16, k, 128) / hw.gemm_time(1 << 16, k, 4096)  # a 128-column shard: its input's read
    assert narrow > 2 * 128 / 4096
    assert hw.gemm_time(0, k, n) == 0.0 and hw.gemm_rate(0) == 0.0


def test_attention_efficiency_curve():
    hw = cost.preset("h100-ib")
    h = hw.attn_half
    assert hw.attn_efficiency(h, h) == pytest.approx(hw.attn_peak / 4)  # half on each side
    assert hw.attn_efficiency(1 << 30, 1 << 30) == pytest.approx(hw.attn_peak, rel=1e-6)
    assert hw.attn_efficiency(128, 8192) < hw.attn_efficiency(8192, 8192)  # short queries run slower
    assert hw.attn_time(1e12, 4096, 4096) == pytest.approx(1e12 / (hw.flops * hw.attn_efficiency(4096, 4096)))
    assert hw.attn_time(0.0, 4096, 4096) == 0.0


def test_fit_attention_curve_recovers_plateau_and_half():
    plateau, half = 3e10, 60.0
    rate = lambda n: plateau * (n / (n + half)) ** 2  # noqa: E731
    got = fit_attention_curve(2048, rate(2048), 128, rate(128))
    assert got == pytest.approx((plateau, half), rel=1e-9)
    assert fit_attention_curve(2048, 1e10, 128, 1e10) == (pytest.approx(1e10 * (2049 / 2048) ** 2), 1.0)


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("flops", 0.0, "must be > 0"), ("link_latency_s", -1e-6, "must be >= 0"),
    ("memory_bytes_per_s", math.nan, "must be a finite number, got nan"),
    ("half_rows", True, "must be a finite number, got True"),
])
def test_hardware_refuses_figures_out_of_range(field, value, problem):
    fields = {"flops": 1e12, "half_rows": 0, "gemm_overhead_s": 0, "link_bytes_per_s": 1e9, "link_latency_s": 0,
              "memory_bytes_per_s": 1e12, field: value}
    with pytest.raises(ValueError, match=rf"Hardware\.{field} {problem}"):
        Hardware(**fields)


def test_every_consumer_reads_the_same_preset(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no calibration file: the presets
    hw = cost.preset("h100-nvlink")
    # MFU: the trainer's peak for an H100 is the preset's datasheet figure
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0)) == hw.flops == 989e12
    # the planner: linear layers at the preset's large-M GEMM rate, attention on its curve
    cm = CostModel(hardware="h100-nvlink")
    assert cm.hardware is hw and cm.hardware.flops == 989e12
    assert cm.linear_time(1000) == 1000 * cm.flops_per_token / (hw.flops * hw.gemm_eff)
    assert cm.attn_time(10**6, 512, 4096) == 10**6 * cm.flops_per_pair / (hw.flops * hw.attn_efficiency(512, 4096))
    # the simulator: a blocking all_gather_matmul of many rows computes at the same large-M rate, besides its
    # input's and output's traffic at memory bandwidth
    rows, k, n = 1 << 24, 1024, 1024  # per-call overhead and the small-M term below 1e-3
    fwd = predict("ag_matmul", "none", 1, 2, rows, k, n, 2, hw)["ag_matmul"]
    io = 2 * rows * (k + n) / hw.memory_bytes_per_s
    assert 2 * rows * k * n / (fwd.compute - io) == pytest.approx(hw.gemm_flops, rel=1e-3)
    # 'auto' on cuda and the planner's default are one machine (an H100 behind 400 Gb/s IB)
    assert cost.load("cuda") == CostModel().hardware == cost.preset("h100-ib")
    assert cost.load("cpu") == cost.preset("cpu-calibrated")


def test_planner_default_device_is_unchanged():
    """The planner's default (an H100 at 989 TFLOP/s, linear layers at 0.7 of it, FlashAttention-2's
    curve, a 400 Gb/s link) is what plans were scored with before the device moved to flashpar.cost."""
    hw = CostModel().hardware
    assert (hw.flops, hw.gemm_eff, hw.link_bytes_per_s, hw.attn_peak, hw.attn_half) == (989e12, 0.7, 48e9, 0.6, 256.0)


def test_cost_model_round_trips_and_reads_the_flat_form():
    cm = CostModel(heads=8, linear=False, hardware="a100")
    assert CostModel.from_dict(json.loads(json.dumps(cm.to_dict()))) == cm
    flat = {"hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128, "layers": 1, "dtype_bytes": 2,
            "flops": 989e12, "bandwidth": 48e9, "linear": True, "attn_peak": 0.6, "attn_half": 256.0,
            "linear_eff": 0.7}  # a plan's JSON before the device moved into `hardware`
    assert CostModel.from_dict(flat) == CostModel()
    assert CostModel.from_dict({**flat, "bandwidth": 1e9}).hardware.link_bytes_per_s == 1e9
    p = plan([3000, 500, 700], 2, cost=CostModel(hardware="h200"))
    assert CPPlan.from_json(p.to_json()).cost == p.cost


def test_calibration_file_is_read_once_and_logged(monkeypatch, tmp_path, caplog):
    from flashpar.overlap.simulate import choose_modes

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tmp_path / "flashpar" / "hardware.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"cpu": {"flops": 7e10, "link_bytes_per_s": 3e8}}))
    with caplog.at_level(logging.WARNING, logger="flashpar.cost"):
        first = cost.load("cpu")
        path.write_text(json.dumps({"cpu": {"flops": 1e9}}))  # a later change is not read by this process
        again = [cost.load("cpu"), cost.load("cpu")]
        choose_modes("ag_matmul", 4, 64, 64, 64, 4, "cpu")  # what 'auto' asks: the same figures, no new line
    assert first.flops == 7e10 and first.link_bytes_per_s == 3e8
    assert first.half_rows == cost.preset("cpu").half_rows  # figures the entry lacks come from the preset
    assert again == [first, first]
    lines = [r.getMessage() for r in caplog.records if r.name == "flashpar.cost"]
    assert len(lines) == 1, lines
    assert str(path) in lines[0] and "'cpu-calibrated'" in lines[0] and "once per process" in lines[0]


@pytest.mark.parametrize(("text", "problem"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object of device types, got list"),
    ('{"cpu": 3}', "entry 'cpu' is not an object"),
    ('{"cpu": {"flops": 1e10, "speed": 2}}', r"entry 'cpu': unknown figures \['speed'\]"),
    ('{"cpu": {"flops": "fast"}}', r"entry 'cpu': Hardware\.flops must be a finite number, got 'fast'"),
    ('{"cpu": {"link_bytes_per_s": -5}}', r"entry 'cpu': Hardware\.link_bytes_per_s must be > 0"),
    ('{"cuda": {"flops": NaN}}', r"entry 'cuda': Hardware\.flops must be a finite number"),  # also unused entries
])
def test_malformed_calibration_file_is_refused(tmp_path, text, problem):
    path = tmp_path / "hw.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^calibration file {re.escape(str(path))}: {problem}"):
        cost.load("cpu", path)


def test_save_keeps_other_entries_and_replaces_an_unreadable_file(tmp_path, caplog):
    path = tmp_path / "hw.json"
    path.write_text("{oops")
    with caplog.at_level(logging.WARNING, logger="flashpar.cost"):
        cost.save(cost.preset("a100"), "cuda", path)
    assert any("replacing it" in r.getMessage() and "not JSON" in r.getMessage() for r in caplog.records)
    cost.save(cost.preset("cpu"), "cpu", path)
    assert set(json.loads(path.read_text())) == {"cuda", "cpu"}
    assert cost.parse(path.read_text(), path)["cuda"]["flops"] == 312e12


def test_importable_without_torch():
    code = "import sys, flashpar.cost; assert 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m]"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
