"""One machine's figures (:class:`Hardware`) and the times they give: GEMM, attention, link, memory.

    gemm_rate(m)        = flops gemm_eff m / (m + half_rows)              small-M curve: half the
                                                                          sustained rate at half_rows
    gemm_time(m, k, n)  = gemm_overhead_s + 2 m k n / gemm_rate(m) + gemm_io_bytes m (k + n) / memory
                        = gemm_overhead_s + 2 k n (m + half_rows) / (flops gemm_eff) + ...
                          (the weight's read at memory bandwidth is the half_rows term, 2 bytes an element on
                          a GPU preset: half_rows = flops gemm_eff / memory; the last term reads the input
                          and writes the output the same way, so a narrow GEMM -- few columns, or a short
                          inner dimension -- is bounded by its activations' traffic)
    attn_efficiency(q, k) = attn_peak q / (q + attn_half) k / (k + attn_half)
    attn_time(w, q, k)  = w / (flops attn_efficiency(q, k))              w: the kernel's FLOPs
    transfer_time(b)    = link_latency_s + b / link_bytes_per_s          one message, one direction
    collective(op, n, b)                                                  a collective of the group, b bytes
                                                                          in all: NCCL's model (``nccl``) or
                                                                          n - 1 link transfers (``ring``)
    memory_time(b)      = b / memory_bytes_per_s                         element-wise passes
    comm_cpu_s_per_byte                                                   compute seconds lost per byte a
                                                                          transfer moves (sent + received)
                                                                          while it runs beside compute

``flops`` is the device's peak (the datasheet's dense rate on a GPU, the measured large-M GEMM
rate on a calibrated CPU, where ``gemm_eff`` is 1): the trainer's MFU divides by it, and every
kernel's sustained rate is a fraction of it.  The overlap simulator times GEMM pieces with
``gemm_time``; the CP planner (:class:`flashpar.cp.CostModel`) charges linear layers at the
large-M rate ``flops gemm_eff`` and attention through ``attn_efficiency``.  ``comm_cpu_s_per_byte``
is what a transfer in flight takes from the computation beside it (on a CPU the transport's threads
and the kernel's network path copy the bytes on the cores the GEMMs use): measured by ``flashpar
bench overlap``'s calibration, 0 in every preset (a GPU's DMA engines and links move the bytes).  Named machines are in
:mod:`flashpar.cost.presets`.

A ``Hardware`` also stands for one group of ranks on such devices (``flashpar.cost.groups.group_hardware``): its
link figures are those of the group's slowest link (a network port where it spans ``nodes`` > 1 nodes, with
``node_link_bytes_per_s`` the NVLink rate inside each), and ``collectives`` says how its collectives are timed:
``"nccl"`` (:mod:`flashpar.cost.nccl`, the GPU presets) or ``"ring"`` (gloo's ring: ``n - 1`` link transfers)::

    ring   all_gather / reduce_scatter of b bytes in all = (n - 1) (latency + b / (n link))
           all_reduce                                    = 2 (n - 1) (latency + b / (n link))
           all_to_all                                    = (n - 1) (latency + b / (n link))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from flashpar.cost import nccl

_AT_LEAST_ZERO = ("half_rows", "gemm_overhead_s", "link_latency_s", "attn_half", "comm_cpu_s_per_byte",
                  "node_link_bytes_per_s", "gemm_io_bytes")
COLLECTIVES = ("ring", "nccl")


@dataclass(frozen=True)
class Hardware:
    flops: float  # peak FLOP/s of one device (dense; datasheet on GPU, measured GEMM rate on CPU)
    half_rows: float  # rows at which a GEMM reaches half of its sustained rate
    gemm_overhead_s: float  # fixed cost per GEMM call
    link_bytes_per_s: float  # one direction of one rank's link
    link_latency_s: float  # per message
    memory_bytes_per_s: float
    gemm_eff: float = 1.0  # fraction of ``flops`` a large-M GEMM sustains
    attn_peak: float = 0.6  # fraction of ``flops`` a long attention kernel reaches
    attn_half: float = 256.0  # query / key length at which an attention kernel runs at half its plateau
    comm_cpu_s_per_byte: float = 0.0  # compute seconds a transfer takes per byte moved beside compute (CPU)
    gemm_io_bytes: float = 0.0  # bytes per element a GEMM reads / writes of its input and output at memory
    #                             bandwidth (2 on a GPU preset, bf16; 0: a calibrated CPU's fit holds it)
    collectives: str = "ring"  # how a group's collectives are timed: "nccl" (flashpar.cost.nccl) or "ring"
    nodes: int = 1  # nodes a group of these devices spans (its link figures: the network port's where > 1)
    node_link_bytes_per_s: float = 0.0  # inside a node, for a group spanning nodes (0: link_bytes_per_s)

    def __post_init__(self) -> None:
        if self.collectives not in COLLECTIVES:
            raise ValueError(f"Hardware.collectives must be one of {COLLECTIVES}, got {self.collectives!r}")
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"Hardware.nodes must be an integer >= 1, got {self.nodes!r}")
        for f in fields(self):
            if f.name in ("collectives", "nodes"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"Hardware.{f.name} must be a finite number, got {v!r}")
            if v < 0 or (v == 0 and f.name not in _AT_LEAST_ZERO):
                bound = ">= 0" if f.name in _AT_LEAST_ZERO else "> 0"
                raise ValueError(f"Hardware.{f.name} must be {bound}, got {v!r}")

    @property
    def gemm_flops(self) -> float:
        """Sustained FLOP/s of a large-M GEMM: ``flops gemm_eff``."""
        return self.flops * self.gemm_eff

    def gemm_rate(self, m: int) -> float:
        """Sustained FLOP/s of an ``m``-row GEMM (the small-M curve, without the call overhead)."""
        return self.gemm_flops * m / (m + self.half_rows) if m > 0 else 0.0

    def gemm_time(self, m: int, k: int, n: int) -> float:
        if m <= 0:
            return 0.0
        io = self.gemm_io_bytes * m * (k + n) / self.memory_bytes_per_s if self.gemm_io_bytes else 0.0
        return self.gemm_overhead_s + 2.0 * k * n * (m + self.half_rows) / self.gemm_flops + io

    def attn_efficiency(self, q_len: int, k_len: int) -> float:
        """Fraction of ``flops`` an attention kernel of ``q_len`` queries over ``k_len`` keys reaches."""
        h = self.attn_half
        return self.attn_peak * (q_len / (q_len + h)) * (k_len / (k_len + h))

    def attn_time(self, work: float, q_len: int, k_len: int) -> float:
        """Seconds of ``work`` attention FLOPs in kernels of ``q_len`` queries over ``k_len`` keys."""
        if work <= 0:
            return 0.0
        return work / (self.flops * self.attn_efficiency(q_len, k_len))

    def transfer_time(self, nbytes: float) -> float:
        return self.link_latency_s + nbytes / self.link_bytes_per_s

    def memory_time(self, nbytes: float) -> float:
        return nbytes / self.memory_bytes_per_s

    def collective(self, op: str, ranks: int, nbytes: float) -> nccl.CollectiveTime:
        """``op`` (``nccl.OPS``) over ``ranks`` ranks of this group, ``nbytes`` in all (an all-gather's output, a
        reduce-scatter's input, an all-reduce's buffer, an all-to-all's send buffer): NCCL's pick
        (``collectives == "nccl"``) or the ring (the module docstring)."""
        if ranks <= 1:
            return nccl.CollectiveTime(0.0, 0.0, "none", "-")
        if self.collectives == "nccl":
            inside = self.node_link_bytes_per_s or self.link_bytes_per_s
            return nccl.time(op, ranks, min(self.nodes, ranks), nbytes, inside, self.link_bytes_per_s)
        if op not in nccl.OPS:
            raise ValueError(f"unknown collective {op!r}; expected one of {nccl.OPS}")
        steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
        return nccl.CollectiveTime(steps * self.link_latency_s, steps * nbytes / (ranks * self.link_bytes_per_s),
                                   "ring", "-")
