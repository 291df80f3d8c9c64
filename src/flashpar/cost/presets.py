"""Named machines: datasheet figures of the GPUs, and the development box's calibrated CPU.

A GPU preset's ``flops`` is the datasheet's dense bf16 Tensor Core rate (half the "with
sparsity" figure); ``memory_bytes_per_s`` its HBM bandwidth; ``link_bytes_per_s`` one
direction of one GPU's link as NCCL rates it (``src/graph/topo.h`` of NVIDIA/nccl 2.30.7): NVLink at
its per-link figure times the GPU's links (Hopper ``SM90_NVLINK_BW`` 20.6 GB/s x 18 = 370.8 GB/s, Ampere
20.0 x 12 = 240, Blackwell 40.1 x 18 = 721.8; the datasheets' 450 / 300 / 900 GB/s each way are signalling
rates), the network at ``NET_BW`` 12 GB/s per 100 Gb/s: one 400 Gb/s port per GPU (a DGX H100's ConnectX-7)
is 48 GB/s.  The rest are estimates shared by every GPU preset, not datasheet figures:

* ``gemm_eff = 0.7``: the fraction of peak a large bf16 GEMM sustains.
* ``half_rows = flops gemm_eff / memory_bytes_per_s``: a GEMM of ``m`` rows does ``m`` FLOPs
  per byte of its bf16 weight (``2 m k n`` FLOPs, ``2 k n`` bytes), so below this many rows
  reading the weight takes longer than the arithmetic; ``gemm_io_bytes = 2``: its bf16 input and output
  move at memory bandwidth too (below ``half_rows`` columns or inner dimension they take longer than the
  arithmetic: a tensor-parallel shard of a small model's k / v projection).
* ``gemm_overhead_s = 8 us`` per GEMM launch.
* ``link_latency_s``: one point-to-point message, NCCL's Simple protocol base latency and one ring hop
  (``flashpar.cost.nccl.P2P_LATENCY_S``: 8.4 + 3.4 = 11.8 us on NVLink, 8.4 + 14 = 22.4 us over the network).
  Collectives (``collectives = "nccl"``) are timed by NCCL's own tuner model, :mod:`flashpar.cost.nccl`.
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

``cpu`` and ``cuda`` are the names of a device type's fallback (``cuda``: an H100 whose every link is a
network port, where the GPU is not one of ``GPU_NAMES``; a named GPU's groups take ``h100-ib``'s link only where
they span nodes: ``flashpar.cost.group_hardware``).
"""

from __future__ import annotations

from flashpar.cost.hardware import Hardware
from flashpar.cost.nccl import P2P_LATENCY_S

_GEMM_EFF, _ATTN_PEAK = 0.7, 0.6
NVLINK_LATENCY_S, IB_LATENCY_S = P2P_LATENCY_S["nvlink"], P2P_LATENCY_S["net"]

H100_96GB_CLOCK = 0.724
"""The clock factor of ``h100-96gb`` (module docstring): ``flashpar.sim.anchors.fit``'s result, rounded to 3
digits (a test checks that it still reproduces the fit's run)."""
H100_96GB_SPREAD = 0.0287
"""The spread of step time over ``h100-96gb`` devices (``flashpar.sim.sync``: a synchronous step waits for the
slowest of them), fitted with the clock by ``flashpar.sim.anchors.fit`` on the 8- and 128-GPU runs of one
configuration, rounded to 4 digits."""
STEP_SPREAD = {"h100-96gb": H100_96GB_SPREAD}
"""The cluster's spread of step time per device preset (0 where nothing was fitted)."""


def _gpu(*, tflops: float, hbm_tb_s: float, link_gb_s: float, latency_s: float, clock: float = 1.0) -> Hardware:
    flops, memory = tflops * 1e12, hbm_tb_s * 1e12
    gemm_eff = _GEMM_EFF * clock
    return Hardware(flops=flops, half_rows=round(flops * gemm_eff / memory), gemm_overhead_s=8e-6,
                    link_bytes_per_s=link_gb_s * 1e9, link_latency_s=latency_s, memory_bytes_per_s=memory,
                    gemm_eff=gemm_eff, attn_peak=_ATTN_PEAK * clock, attn_half=256.0, collectives="nccl",
                    gemm_io_bytes=2.0)


NVLINK_GB_S = {"hopper": 20.6 * 18, "ampere": 20.0 * 12, "blackwell": 40.1 * 18}
"""NCCL's NVLink rate of one GPU, one way (``SM90_NVLINK_BW`` x links; the module docstring)."""
PORT_400G_GB_S = 12.0 * 4
"""NCCL's rate of one 400 Gb/s network port (``NET_BW`` = 12 GB/s per 100 Gb/s)."""


def h100_96gb(clock: float) -> Hardware:
    """The ``h100-96gb`` preset at clock factor ``clock`` (what ``flashpar.sim.anchors.fit`` varies)."""
    return _gpu(tflops=989, hbm_tb_s=2.4, link_gb_s=NVLINK_GB_S["hopper"], latency_s=NVLINK_LATENCY_S, clock=clock)


PRESETS: dict[str, Hardware] = {
    # H100 SXM5: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s, NVLink 4 (18 links) at NCCL's 370.8 GB/s each way
    "h100-nvlink": _gpu(tflops=989, hbm_tb_s=3.35, link_gb_s=NVLINK_GB_S["hopper"], latency_s=NVLINK_LATENCY_S),
    # the same GPU across nodes: one 400 Gb/s NDR InfiniBand port per GPU, NCCL's 48 GB/s each way
    "h100-ib": _gpu(tflops=989, hbm_tb_s=3.35, link_gb_s=PORT_400G_GB_S, latency_s=IB_LATENCY_S),
    # H200 SXM: H100's 989 TFLOP/s dense bf16, HBM3e 4.8 TB/s, NVLink 4 as the H100's
    "h200": _gpu(tflops=989, hbm_tb_s=4.8, link_gb_s=NVLINK_GB_S["hopper"], latency_s=NVLINK_LATENCY_S),
    # H100 96 GB HBM2e at 500 W (torchtitan's benchmark hosts): 2.4 TB/s, NVLink 4; the fitted clock factor
    # (module docstring)
    "h100-96gb": h100_96gb(H100_96GB_CLOCK),
    # A100 SXM4 80 GB: 312 TFLOP/s dense bf16, HBM2e 2.039 TB/s, NVLink 3 (12 links) at NCCL's 240 GB/s each way
    "a100": _gpu(tflops=312, hbm_tb_s=2.039, link_gb_s=NVLINK_GB_S["ampere"], latency_s=NVLINK_LATENCY_S),
    # B200 (HGX B200): 2.25 PFLOP/s dense bf16, HBM3e 8 TB/s, NVLink 5 (18 links) at NCCL's 721.8 GB/s each way
    "b200": _gpu(tflops=2250, hbm_tb_s=8.0, link_gb_s=NVLINK_GB_S["blackwell"], latency_s=NVLINK_LATENCY_S),
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


def gpu_preset(device_name: str) -> str:
    """The preset of a CUDA device by its name (``NVIDIA H100 80GB HBM3`` -> ``h100-nvlink``);
    ``cuda``'s preset for a GPU not listed."""
    return next((p for key, p in GPU_NAMES if key in device_name), ALIASES["cuda"])
