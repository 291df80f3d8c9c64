"""The FlashCP cost model: work, bytes and estimated time per rank of a context-parallel plan.

Shared by the planner (to score candidates), the execution benchmarks and the simulator.
Everything is per transformer layer and per forward pass; :meth:`CostModel.per_step` weighs
attention for a whole training step (its backward costs relatively more than a linear layer's),
which is what the trainer plans with.  The model's shape is here; the
device's figures are one :class:`flashpar.cost.Hardware` (``hardware``, default the
``h100-ib`` preset, which is also what ``cuda`` means to ``mode="auto"``).

    attention flops of a (query, key) pair   4 heads head_dim            (Q K^T and P V, 2 flops per MAC)
    linear flops per token                    2 [hidden (heads + 2 kv_heads) head_dim      QKV
                                                 + heads head_dim hidden                   output projection
                                                 + 3 hidden ffn]                           SwiGLU MLP
    K/V bytes of one token                    2 kv_heads head_dim dtype_bytes
    attention task time   hardware.attn_time(pairs * 4 h d, q_len, k_len)
                          = pairs 4 h d / (flops attn_peak q/(q + attn_half) k/(k + attn_half))
                          per task of the default backend (a piece's causal square, and a full task per
                          rank holding keys before it: flashpar.cp.calls), at its own shape
    attention launches    hardware.gemm_overhead_s per kernel call (a batch of tasks, flashpar.cp.calls)
    linear time           tokens * linear flops / hardware.gemm_flops     (the large-M rate: a
                                                                           rank holds thousands of rows)
    K/V time              bytes / hardware.link_bytes_per_s               (bandwidth only: the messages
                                                                           are megabytes)
    rank time             max(compute, comm + compute that needs remote K/V)      local-first overlap
    step time             max over ranks                                  (burst 1: a device per rank)
                          max(compute_span, max over ranks of             (burst b > 1: ranks sharing
                              comm + remote / b)                           cores; see CostModel.burst)

Default: a Llama-3-8B layer (hidden 4096, FFN 14336, 32 heads, 8 kv heads, head dim 128, bf16)
on an H100 with a 400 Gb/s InfiniBand link per GPU (``h100-ib``: 989 TFLOP/s dense bf16,
linear layers at 0.7 of it, attention on FlashAttention-2's curve, 50 GB/s).
``flashpar bench cp`` replaces the device by values measured on this machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from flashpar.cost import Hardware, preset
from flashpar.cp import window as band

DEFAULT_HARDWARE = "h100-ib"

BWD_ATTN_TIME = 2.5
"""Backward attention takes this many times the forward's time (FlashAttention-2's backward: five matrix
products against the forward's two, at a somewhat lower rate; the usual rule of thumb on a GPU.  torch's CPU
flash kernel measures 2.4 at its plateau: ``flashpar bench train``'s ``attn_fwd`` / ``attn_bwd``)."""

_LEGACY = {"flops": "flops", "bandwidth": "link_bytes_per_s", "attn_peak": "attn_peak", "attn_half": "attn_half",
           "linear_eff": "gemm_eff"}
"""Device keys of the flat ``to_dict`` before the device moved into ``hardware`` -> Hardware field."""


@dataclass(frozen=True)
class CostModel:
    """A model's layer shape on a device: ``hardware`` is a :class:`flashpar.cost.Hardware` or a preset's
    name (``CostModel(hardware="h100-nvlink")``).

    ``burst``: how many times faster one rank computes while the ranks it shares cores with wait (1: each
    rank has its own device).  A host running ``L`` ranks of ``t`` threads on ``C`` cores, ``L t > C``, gives a
    busy rank ``C / L`` cores and a rank alone ``min(t, C)``: ``burst = L min(t, C) / C``
    (``flashpar.cost.shared_burst``; a cp rank of ``g`` processes, tp x ulysses, counts as one rank of ``g t``
    threads).  The device's figures
    are then one rank's with every rank busy; with ``k`` of the ``N`` ranks still busy each computes
    ``min(burst, N / k)`` times as fast (the cores shared fairly, none idle while a rank has work), so the ranks'
    computes end as ranks leave the cores to the others (``compute_span``), not at the slowest rank's time at
    the shared rate::

        burst 2, no K/V, compute 1.3 and 0.7 (mean 1.0), in time:
            rank 0  |======== shared: 0.7 ========|== alone: 0.6 / 2 ==|    ends at 1.0
            rank 1  |======== shared: 0.7 ========|                         its cores lent to rank 0
            step = 0.7 + 0.6 / 2 = 1.0, not the slowest rank's 1.3

    A plan that balances the ranks by cutting a document then buys nothing and costs a K/V exchange.
    A rank that waits for remote K/V ends no sooner than ``comm + remote / burst``."""

    hidden: int = 4096
    ffn: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 1
    dtype_bytes: int = 2
    linear: bool = True  # False: attention work alone (to compare with solvers that balance only attention)
    hardware: Hardware = field(default_factory=lambda: preset(DEFAULT_HARDWARE))
    burst: float = 1.0  # a rank's speed-up while the ranks sharing its cores wait (see the class docstring)
    window: int | None = None  # sliding-window attention of W keys (flashpar.cp.window): pairs min(p + 1, W) per query

    def __post_init__(self) -> None:
        if isinstance(self.hardware, str):  # a preset's name
            object.__setattr__(self, "hardware", preset(self.hardware))
        b = self.burst
        if isinstance(b, bool) or not isinstance(b, int | float) or not math.isfinite(b) or b < 1:
            raise ValueError(f"CostModel.burst must be a finite number >= 1, got {b!r}")
        why = band.check_window(self.window)
        if why is not None:
            raise ValueError(f"CostModel.{why}")

    def square_pairs(self, length):
        """Pairs of a causal square of ``length`` queries from a document's start (int or int64 array): under a
        window, ``sum over p < L of min(p + 1, W)``, else ``L (L + 1) / 2``."""
        return band.pairs(0, length, self.window)

    def ahead_share(self, length, before):
        """The part of a full task's pairs (``length`` queries, ``before`` keys ahead of them in the document) that
        the window keeps: 1 without one; else the band's pairs over ``length * before`` (numpy arrays or ints; 0
        where there are no keys ahead).  A full task's time is scaled by it: its keys outside the band are never
        touched."""
        if self.window is None:
            return 1.0
        length = np.asarray(length, dtype=np.int64)
        before = np.asarray(before, dtype=np.int64)
        kept = band.pairs(before, before + length, self.window) - self.square_pairs(length)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(length * before > 0, kept / np.maximum(length * before, 1), 0.0)

    def step_time(self, compute, remote, comm) -> float:
        """The estimated step of ranks with these per-rank times (seconds; sequences of one length): with
        ``burst`` 1 the slowest rank's ``max(compute, comm + remote)``; ranks sharing cores: the later of the
        computes' end (``compute_span``) and every rank's K/V and remote work, ``comm + remote / burst``."""
        compute, remote, comm = (np.asarray(x, dtype=np.float64) for x in (compute, remote, comm))
        return max(self.compute_span(compute), float((comm + remote / self.burst).max()))  # (x / 1.0 is x)

    def compute_span(self, compute) -> float:
        """When the last of the ranks' computes ends (seconds, one per rank, each at the rate of every rank busy):
        the slowest one's with ``burst`` 1; ranks sharing cores fairly (the class docstring), by phases between
        two computes' ends, in ascending order ``c_(0) <= ... <= c_(N-1)``::

            span = sum_i (c_(i) - c_(i-1)) / min(burst, N / (N - i)),   c_(-1) = 0

        at least the mean compute (all ``N`` ranks' work on the cores) and the slowest's over ``burst``."""
        compute = np.asarray(compute, dtype=np.float64)
        if self.burst == 1:
            return float(compute.max())
        return float(self.compute_ends(compute).max())

    def compute_ends(self, compute) -> np.ndarray:
        """When each rank's compute ends (seconds, in the ranks' order), by the phases of ``compute_span``: the
        ``i``-th to end, ``sum_{j <= i} (c_(j) - c_(j-1)) / min(burst, N / (N - j))``; ``compute`` itself with
        ``burst`` 1.  The last of them is the span: no rank's compute ends after the step."""
        compute = np.asarray(compute, dtype=np.float64)
        if self.burst == 1:
            return compute.copy()
        n = len(compute)
        order = np.argsort(compute, kind="stable")
        rate = np.minimum(self.burst, n / (n - np.arange(n, dtype=np.float64)))
        ends = np.empty(n)
        ends[order] = np.cumsum(np.diff(compute[order], prepend=0.0) / rate)
        return ends

    def per_step(self) -> CostModel:
        """This model weighted for one training step, forward and backward, as a trainer plans it.

        A linear layer's backward is two GEMMs of its forward's size, 3x the forward in all; attention's
        backward takes ``BWD_ATTN_TIME`` x its forward, ``1 + BWD_ATTN_TIME`` in all.  Against the linears,
        attention therefore weighs ``(1 + BWD_ATTN_TIME) / 3`` (1.17x) what the forward alone says: the
        attention rate is divided by that, every time stays per forward.  An attention kernel call launches once
        forward and once backward: its launch weighs ``2 / 3`` of a forward launch (``gemm_overhead_s``, which the
        model charges for attention calls alone).  K/V time is unchanged (dK / dV travel back in backward as K / V
        came in forward, overlapped the same way)."""
        step_weight = (1.0 + BWD_ATTN_TIME) / 3.0
        return self.with_hardware(attn_peak=self.hardware.attn_peak / step_weight,
                                  gemm_overhead_s=self.hardware.gemm_overhead_s * 2.0 / 3.0)

    def with_hardware(self, **figures) -> CostModel:
        """This model on a device whose figures differ by ``figures`` (``Hardware`` field names)."""
        return dataclasses.replace(self, hardware=dataclasses.replace(self.hardware, **figures))

    @functools.cached_property
    def flops_per_pair(self) -> float:
        return 4.0 * self.heads * self.head_dim * self.layers

    @functools.cached_property
    def flops_per_token(self) -> float:
        if not self.linear:
            return 0.0
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        out = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.ffn
        return 2.0 * (qkv + out + mlp) * self.layers

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes * self.layers

    def attn_time(self, pairs: float, q_len: int, k_len: int) -> float:
        if pairs <= 0:
            return 0.0
        return self.hardware.attn_time(pairs * self.flops_per_pair, q_len, k_len)

    def attn_times(self, pairs, q_len, k_len):
        """:meth:`attn_time` on arrays (numpy, elementwise; the same floats): 0 where there are no pairs."""
        work = np.asarray(pairs, dtype=np.float64) * self.flops_per_pair
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(work > 0, work / (self.hardware.flops * self.hardware.attn_efficiency(q_len, k_len)), 0.0)

    def full_attn_time(self, length: int, keys: int, tasks: int) -> float:
        """Attention time of ``tasks`` full tasks of ``length`` queries over ``keys`` keys in all, each at its own shape
        (:mod:`flashpar.cp.calls`), in closed form: a task of ``h`` keys takes ``L h fpp / (flops attn_peak L / (L + c)
        h / (h + c)) = fpp (L + c)(h + c) / (flops attn_peak)`` (``c = attn_half``, ``fpp`` the FLOPs per pair), so
        they add up to ``fpp (L + c)(keys + tasks c) / (flops attn_peak)``: how the keys are shared out matters only
        through the count."""
        if length <= 0 or tasks <= 0:
            return 0.0
        hw = self.hardware
        return self.flops_per_pair * (length + hw.attn_half) * (keys + tasks * hw.attn_half) / (hw.flops * hw.attn_peak)

    def full_attn_times(self, length, keys, tasks):
        """:meth:`full_attn_time` on arrays (numpy, elementwise; the same floats)."""
        length, keys, tasks = (np.asarray(x, dtype=np.int64) for x in (length, keys, tasks))
        hw = self.hardware
        t = self.flops_per_pair * (length.astype(np.float64) + hw.attn_half) * (keys + tasks * hw.attn_half) / (
            hw.flops * hw.attn_peak)
        return np.where((length > 0) & (tasks > 0), t, 0.0)

    def piece_attn_time(self, length: int, before: int, holders: int) -> float:
        """Attention time of a piece of ``length`` queries whose document has ``before`` tokens ahead of it, held by
        ``holders`` ranks: its causal square and a full task per holder (:meth:`full_attn_time`)."""
        if length <= 0:
            return 0.0
        return (self.attn_time(self.square_pairs(length), length, length)
                + self.full_attn_time(length, before, holders) * float(self.ahead_share(length, before)))

    def piece_attn_times(self, length, before, holders):
        """:meth:`piece_attn_time` on arrays (numpy, elementwise; the same floats)."""
        length = np.asarray(length, dtype=np.int64)
        q = length.astype(np.float64)
        return (self.attn_times(self.square_pairs(length), q, q)
                + self.full_attn_times(length, before, holders) * self.ahead_share(length, before))

    def piece_cost(self, length: int, before: int, holders: int) -> float:
        """:meth:`piece_attn_time` and a launch (``gemm_overhead_s``) for each of the piece's ``1 + holders`` tasks:
        what the planner's greedy charges a piece of a cut document (its tasks rarely share a batch: each reads
        another rank's buffer; the launches of whole documents, one per ladder length a rank holds, are left to
        the figures, which count batches).  (Inlined: the greedy asks for thousands.)"""
        if length <= 0:
            return 0.0
        hw = self.hardware
        t = self.attn_time(self.square_pairs(length), length, length)
        if holders > 0:
            t += self.flops_per_pair * (length + hw.attn_half) * (before + holders * hw.attn_half) / (
                hw.flops * hw.attn_peak) * (1.0 if self.window is None else float(self.ahead_share(length, before)))
        return t + (1 + holders) * hw.gemm_overhead_s

    def piece_costs(self, length, before, holders):
        """:meth:`piece_cost` on arrays (numpy, elementwise; the same floats)."""
        hw = self.hardware
        q = length.astype(np.float64)
        full = self.flops_per_pair * (q + hw.attn_half) * (before + holders * hw.attn_half) / (hw.flops * hw.attn_peak)
        full = full * self.ahead_share(length, before) if self.window is not None else full
        t = self.attn_times(self.square_pairs(length), q, q) + np.where(holders > 0, full, 0.0)
        return np.where(length > 0, t + (1 + holders) * hw.gemm_overhead_s, 0.0)

    def linear_time(self, tokens: int) -> float:
        return tokens * self.flops_per_token / self.hardware.gemm_flops

    def comm_time(self, kv_tokens: int) -> float:
        return kv_tokens * self.kv_bytes_per_token / self.hardware.link_bytes_per_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        """Inverse of :meth:`to_dict`; also reads the flat form that held the device figures beside the
        shape (``flops``, ``bandwidth``, ``attn_peak``, ``attn_half``, ``linear_eff``) over ``h100-ib``."""
        d = dict(d)
        hw = d.pop("hardware", None)
        legacy = {_LEGACY[k]: d.pop(k) for k in list(d) if k in _LEGACY}
        hardware = Hardware(**hw) if hw is not None else dataclasses.replace(preset(DEFAULT_HARDWARE), **legacy)
        return cls(**d, hardware=hardware)


def cost_model_of(cfg, dtype_bytes: int, hardware: Hardware | str = DEFAULT_HARDWARE, burst: float = 1.0) -> CostModel:
    """The cost model of a model config ``cfg`` (``flashpar.models.LlamaConfig``, or any object with ``hidden``,
    ``ffn``, ``heads``, ``kv_heads``, ``head_dim`` and ``layers``): its layer shape, all its layers, activations
    of ``dtype_bytes``, on ``hardware`` with ``burst`` (per forward pass; ``per_step`` for a training step).  A
    model whose every layer has one sliding window ``W`` (``cfg.windows``: Mistral's) is planned for it
    (``window=W``: its pairs and K/V); where full layers sit beside windowed ones (Qwen's ``max_window_layers``)
    the plan is the full layers' (their exchange is the larger), and the windowed layers send less than it says."""
    windows = set(getattr(cfg, "windows", ()) or ())
    window = windows.pop() if len(windows) == 1 and 0 not in windows else None
    return CostModel(hidden=cfg.hidden, ffn=cfg.ffn, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                     layers=cfg.layers, dtype_bytes=dtype_bytes, hardware=hardware, burst=burst, window=window)
