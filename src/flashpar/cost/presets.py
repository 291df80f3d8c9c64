"""Named machines: datasheet figures of the GPUs, and the development box's calibrated CPU.

A GPU preset's ``flops`` is the datasheet's dense bf16 Tensor Core rate (half the "with
sparsity" figure); ``memory_bytes_per_s`` its HBM bandwidth; ``link_bytes_per_s`` one
direction of one GPU's link: NVLink's total bandwidth is quoted for both directions, so half of
it; on InfiniBand, one 400 Gb/s ConnectX-7 port per GPU (as in a DGX H100) is 50 GB/s.  The
rest are estimates shared by every GPU preset, not datasheet figures:

* ``gemm_eff = 0.7``: the fraction of peak a large bf16 GEMM sustains.
* ``half_rows = flops gemm_eff / memory_bytes_per_s``: a GEMM of ``m`` rows does ``m`` FLOPs
  per byte of its bf16 weight (``2 m k n`` FLOPs, ``2 k n`` bytes), so below this many rows
  reading the weight takes longer than the arithmetic.
* ``gemm_overhead_s = 8 us`` per GEMM launch, link latency 10 us per message on NVLink and
  15 us on InfiniBand (NCCL small-message point-to-point times, order of magnitude).
* ``attn_peak = 0.6``, ``attn_half = 256``: an approximation of FlashAttention-2's published
  forward throughput (causal, head dim 128): half the long-sequence rate at 512 tokens, near
  the plateau beyond 8K, the plateau at about 60% of the device peak.

``h100-96gb`` is the H100 of torchtitan's published runs (Meta's Grand Teton hosts: 96 GB HBM2e at
2.4 TB/s, the 500 W power limit, NVLink inside a host, 400 Gb/s RDMA per GPU between hosts, which is
``h100-ib``'s link).  Its peak stays the SXM datasheet's 989 TFLOP/s (the benchmark's own MFU divides by it;
it says the capped part's real peak lies between the SXM's and the NVL's, value unknown), so the power cap
shows in its efficiencies: ``gemm_eff = 0.7 c`` and ``attn_peak = 0.6 c`` with one clock factor ``c``
(``H100_96GB_CLOCK``) fitted to one published run by ``flashpar.sim.anchors.fit`` (``flashpar simulate anchors
--fit``); launch overhead and link latency keep the shared estimates.

``cpu`` and ``cuda`` are the names ``mode="auto"`` asks for (the tensor's device type).
"""

from __future__ import annotations

from dataclasses import replace

from flashpar.cost.hardware import Hardware

_GEMM_EFF, _ATTN_PEAK = 0.7, 0.6
NVLINK_LATENCY_S, IB_LATENCY_S = 10e-6, 15e-6

H100_96GB_CLOCK = 0.643
"""The clock factor of ``h100-96gb`` (module docstring): ``flashpar.sim.anchors.fit``'s result, rounded to 3
digits (a test checks that it still reproduces the fit's run)."""


def _gpu(*, tflops: float, hbm_tb_s: float, link_gb_s: float, latency_s: float, clock: float = 1.0) -> Hardware:
    flops, memory = tflops * 1e12, hbm_tb_s * 1e12
    gemm_eff = _GEMM_EFF * clock
    return Hardware(flops=flops, half_rows=round(flops * gemm_eff / memory), gemm_overhead_s=8e-6,
                    link_bytes_per_s=link_gb_s * 1e9, link_latency_s=latency_s, memory_bytes_per_s=memory,
                    gemm_eff=gemm_eff, attn_peak=_ATTN_PEAK * clock, attn_half=256.0)


def h100_96gb(clock: float) -> Hardware:
    """The ``h100-96gb`` preset at clock factor ``clock`` (what ``flashpar.sim.anchors.fit`` varies)."""
    return _gpu(tflops=989, hbm_tb_s=2.4, link_gb_s=450, latency_s=NVLINK_LATENCY_S, clock=clock)


PRESETS: dict[str, Hardware] = {
    # H100 SXM5: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s, NVLink 4 900 GB/s (450 GB/s each way)
    "h100-nvlink": _gpu(tflops=989, hbm_tb_s=3.35, link_gb_s=450, latency_s=NVLINK_LATENCY_S),
    # the same GPU across nodes: one 400 Gb/s NDR InfiniBand port per GPU, 50 GB/s each way
    "h100-ib": _gpu(tflops=989, hbm_tb_s=3.35, link_gb_s=50, latency_s=IB_LATENCY_S),
    # H200 SXM: H100's 989 TFLOP/s dense bf16, HBM3e 4.8 TB/s, NVLink 4 900 GB/s (450 GB/s each way)
    "h200": _gpu(tflops=989, hbm_tb_s=4.8, link_gb_s=450, latency_s=NVLINK_LATENCY_S),
    # H100 96 GB HBM2e at 500 W (torchtitan's benchmark hosts): 2.4 TB/s, NVLink 4 450 GB/s each way; the
    # fitted clock factor (module docstring)
    "h100-96gb": h100_96gb(H100_96GB_CLOCK),
    # A100 SXM4 80 GB: 312 TFLOP/s dense bf16, HBM2e 2.039 TB/s, NVLink 3 600 GB/s (300 GB/s each way)
    "a100": _gpu(tflops=312, hbm_tb_s=2.039, link_gb_s=300, latency_s=NVLINK_LATENCY_S),
    # B200 (HGX B200): 2.25 PFLOP/s dense bf16, HBM3e 8 TB/s, NVLink 5 1.8 TB/s (900 GB/s each way)
    "b200": _gpu(tflops=2250, hbm_tb_s=8.0, link_gb_s=900, latency_s=NVLINK_LATENCY_S),
    # The 2-core development box, one gloo rank per core share, rounded from its calibrations
    # (docs/bench-overlap.md, docs/bench-cp.md): GEMM 48 GFLOP/s per rank at 4 ranks (97 at 2) ->
    # 4e10 at full rate (gemm_eff 1: measured, not a datasheet); a 1 Gbit/s link (1.25e8 B/s;
    # measured 121-124 MB/s); 100 us per loopback message (the calibrations' 0.6-1.3 ms also hold
    # the lane hand-off per item); the CPU flash kernel's forward plateau 33.8 GFLOP/s (0.85 of
    # the GEMM rate) with half efficiency at 51 tokens.  Small-M terms and memory are estimates.
    "cpu-calibrated": Hardware(flops=4e10, half_rows=16, gemm_overhead_s=2e-5, link_bytes_per_s=1.25e8,
                               link_latency_s=1e-4, memory_bytes_per_s=1e10, gemm_eff=1.0, attn_peak=0.85,
                               attn_half=51.0),
}

ALIASES: dict[str, str] = {"cpu": "cpu-calibrated", "cuda": "h100-ib"}

GPU_NAMES = (("H100", "h100-nvlink"), ("H200", "h200"), ("A100", "a100"), ("B200", "b200"))
"""Substrings of ``torch.cuda.get_device_name`` and the preset each one means."""


def preset(name: str) -> Hardware:
    """The named machine (``PRESETS`` or an alias in ``ALIASES``)."""
    hw = PRESETS.get(ALIASES.get(name, name))
    if hw is None:
        known = ", ".join([*PRESETS, *ALIASES])
        raise ValueError(f"unknown hardware preset {name!r}; known: {known}")
    return hw


def preset_name(name: str) -> str:
    """``name`` with its alias resolved (``cpu`` -> ``cpu-calibrated``)."""
    preset(name)
    return ALIASES.get(name, name)


def gpu_hardware(device_name: str, *, across_nodes: bool) -> Hardware:
    """The figures of the CUDA device named ``device_name`` (its ``gpu_preset``).  ``across_nodes``: the job
    spans nodes, so a group (a cp group of the planner) may too, and the link is one InfiniBand port per GPU
    (``h100-ib``'s link figures) wherever the preset's NVLink is faster."""
    hw = PRESETS[gpu_preset(device_name)]
    if not across_nodes:
        return hw
    ib = PRESETS["h100-ib"]
    return replace(hw, link_bytes_per_s=min(hw.link_bytes_per_s, ib.link_bytes_per_s),
                   link_latency_s=max(hw.link_latency_s, ib.link_latency_s))


def gpu_preset(device_name: str) -> str:
    """The preset of a CUDA device by its name (``NVIDIA H100 80GB HBM3`` -> ``h100-nvlink``);
    ``cuda``'s preset for a GPU not listed."""
    return next((p for key, p in GPU_NAMES if key in device_name), ALIASES["cuda"])
