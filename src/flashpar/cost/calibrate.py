"""Measures :class:`flashpar.cost.Hardware` on the running group, and the trainer's MFU peak.

Called on every rank at once (so CPU sharing between ranks is part of what is measured);
rank 0's values are broadcast, so every rank holds the same numbers and ``auto`` picks the
same mode everywhere.

    GEMM:      t(m) = overhead + 2 k n (m + half_rows) / flops, fitted on a sweep of m (gemm_eff 1:
               on a CPU the measured large-M rate is the peak)
    link:      t(b) = latency + b / bandwidth, from pairwise exchanges (shift r -> r+1)
               of a small and a large message, the same pattern as a flash exchange
    memory:    an in-place add over a few MB
    comm CPU:  (GEMM time beside an exchange - GEMM time alone) / bytes the exchange moved during the
               GEMM (sent + received), every rank at once: what a transfer in flight takes from compute
               (``comm_cpu_s_per_byte``; :func:`measure_comm_cpu`, which ``flashpar bench overlap`` calls)
    attention: the flash kernel's rate r(L) on a long and a short causal block, forward and
               backward, solved for the curve r(L) = plateau (L / (L + attn_half))^2
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from flashpar.cost.hardware import Hardware
from flashpar.cost.presets import PRESETS, gpu_preset, preset
from flashpar.dist import from_rank0, p2p_group, resolve_group

PEAK_PROBES = 5  # one probe: 0.04 s of small GEMMs on a free core here, twice that or more when shared


def peak_flops(device: torch.device, group=None, *, probes: int = PEAK_PROBES) -> float:
    """The MFU denominator of one rank: the datasheet's dense bf16 rate of the GPU's preset
    (:func:`flashpar.cost.gpu_preset`), or on CPU a GEMM probe of this rank that every rank of
    ``group`` runs at once, so that it is each rank's share of the cores: a barrier first (a
    collective on CPU where a group is initialised), then the median of ``probes`` probes.  One probe
    alone swings: 35-79 GFLOP/s on one rank of 4 sharing 2 cores in one run, 58-86 as the
    median of 5 after the barrier."""
    if device.type == "cuda":
        return PRESETS[gpu_preset(torch.cuda.get_device_name(device))].flops
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)
    return statistics.median(measure_gemm(256, 256, torch.float32, repeats=3)[0] for _ in range(probes))


def median_time(fn, repeats: int, *, barrier: bool = False, group=None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls (each after a barrier of ``group`` if ``barrier``)."""
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gemm(k: int, n: int, dtype: torch.dtype, *, repeats: int = 5) -> tuple[float, float, float]:
    """(flops, half_rows, overhead_s) for ``[m, k] @ [k, n]`` GEMMs on this process."""
    w = torch.randn(k, n, dtype=dtype)
    tiny_a, tiny_b = torch.randn(1, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype)
    overhead = median_time(lambda: torch.mm(tiny_a, tiny_b), 50)
    ms = [64, 256, 1024, 2048]
    ts = []
    for m in ms:
        a = torch.randn(m, k, dtype=dtype)
        out = torch.empty(m, n, dtype=dtype)
        torch.mm(a, w, out=out)  # warm-up
        ts.append(median_time(lambda a=a, out=out: torch.mm(a, w, out=out), repeats))
    # least squares t = a0 + b0 * m
    mean_m, mean_t = statistics.fmean(ms), statistics.fmean(ts)
    b0 = sum((m - mean_m) * (t - mean_t) for m, t in zip(ms, ts, strict=True)) / sum((m - mean_m) ** 2 for m in ms)
    b0 = max(b0, ts[-1] / ms[-1] * 0.5)
    a0 = mean_t - b0 * mean_m
    flops = 2.0 * k * n / b0
    half_rows = max(0.0, (a0 - overhead) / b0)
    return flops, half_rows, overhead


def measure_link(group=None, *, small: int = 16 << 10, large: int = 4 << 20, repeats: int = 5) -> tuple[float, float]:
    """(bytes_per_s, latency_s) of one rank's link, from pairwise exchanges with neighbours."""
    info = resolve_group(group)
    n, r = info.world_size, info.rank
    if n == 1:
        return preset("cpu").link_bytes_per_s, preset("cpu").link_latency_s
    to, frm = info.global_rank((r + 1) % n), info.global_rank((r - 1) % n)
    send_group, recv_group = p2p_group(info, r, (r + 1) % n), p2p_group(info, (r - 1) % n, r)

    def exchange(nbytes: int):
        send = torch.empty(nbytes, dtype=torch.uint8)
        recv = torch.empty(nbytes, dtype=torch.uint8)

        def run():
            works = [dist.isend(send, to, group=send_group), dist.irecv(recv, frm, group=recv_group)]
            for w in works:
                w.wait()
        return run

    t_small = median_time(exchange(small), repeats * 2, barrier=True, group=info.group)
    t_large = median_time(exchange(large), repeats, barrier=True, group=info.group)
    bw = (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - small / bw, 1e-6)
    return bw, latency


def measure_memory(dtype: torch.dtype) -> float:
    a = torch.randn(1 << 20, dtype=dtype)
    b = torch.randn(1 << 20, dtype=dtype)
    t = median_time(lambda: a.add_(b), 10)
    return 3 * a.numel() * a.element_size() / t


def calibrate(group=None, *, k: int = 1024, n: int = 512, dtype: torch.dtype = torch.float32,
              overheads: Callable[[object, torch.dtype], tuple[float, float]] | None = None) -> Hardware:
    """Measure on every rank of ``group`` (a collective call); returns rank 0's values everywhere.

    ``overheads(group, dtype)``, a collective the caller supplies, measures (seconds per GEMM
    piece, seconds per lane item) that its executor adds on top of the kernel and the wire
    (``flashpar bench overlap`` passes its own); they raise the GEMM overhead and the latency.
    ``comm_cpu_s_per_byte`` stays 0 here: :func:`measure_comm_cpu` measures it where asked."""
    flops, half_rows, overhead = measure_gemm(k, n, dtype)
    bw, latency = measure_link(group)
    mem = measure_memory(dtype)
    many = dist.is_initialized() and dist.get_world_size(group) > 1
    if overheads is not None and many:
        piece, item = overheads(group, dtype)
        overhead, latency = max(overhead, piece), max(latency, item)
    return from_rank0(Hardware(flops, half_rows, overhead, bw, latency, mem), group)


def measure_comm_cpu(hw: Hardware, dtype: torch.dtype, group=None, *, gemm_s: float = 0.1, pairs: int = 25,
                     share: float = 0.8) -> dict:
    """Seconds the slowest rank's GEMM loses per byte each rank moves beside it (a collective call; the
    same figures on every rank): ``{"s_per_byte", "q25", "q75", "pairs", "bytes_moved", "gemm_s"}``.

    Every rank at once, ``pairs`` times in alternating order: a GEMM of about ``gemm_s`` (at ``hw``'s rate)
    alone, and the same GEMM while a thread (as the overlap lane does) posts an exchange with the
    neighbours (``b`` bytes to r+1, ``b`` from r-1, sized to take ``share`` of the GEMM on ``hw``'s link)
    and waits for it::

        alone    |====== GEMM ======|
        beside   |====== GEMM, slowed ======|
                 |--- exchange, 2b ---|            (the thread stamps its start and end)

    Per pair, ``(beside - alone) / (2b x the exchange's fraction that ran during the GEMM)``, each time the
    slowest rank's (as the benchmark's rows: with more ranks than cores the scheduler's shares make one
    rank's time noisy, the last rank's much less) and the smallest fraction.  ``s_per_byte``: the median
    over pairs (the box's load makes single pairs noisy), at least 0; ``q25`` / ``q75``: the quartiles
    (the figure's own spread, unclipped); ``bytes_moved``: 2b; ``gemm_s``: the median GEMM alone."""
    info = resolve_group(group)
    nr, r = info.world_size, info.rank
    if nr == 1:
        return {"s_per_byte": 0.0, "q25": 0.0, "q75": 0.0, "pairs": 0, "bytes_moved": 0, "gemm_s": 0.0}
    k = n = 1024
    m = max(64, int(gemm_s * hw.gemm_flops / (2.0 * k * n)))
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    b = int(min(16 << 20, max(64 << 10, share * gemm_s * hw.link_bytes_per_s)))
    send, recv = torch.empty(b, dtype=torch.uint8), torch.empty(b, dtype=torch.uint8)
    to, frm = info.global_rank((r + 1) % nr), info.global_rank((r - 1) % nr)
    send_group, recv_group = p2p_group(info, r, (r + 1) % nr), p2p_group(info, (r - 1) % nr, r)

    def alone() -> float:
        dist.barrier(info.group)
        t0 = time.perf_counter()
        torch.mm(a, w, out=out)
        return time.perf_counter() - t0

    def beside() -> tuple[float, float]:
        """(GEMM seconds, fraction of the exchange that ran during the GEMM)."""
        stamps, go = {}, threading.Event()

        def exchange():
            go.wait()
            stamps["start"] = time.perf_counter()
            works = [dist.isend(send, to, group=send_group), dist.irecv(recv, frm, group=recv_group)]
            for work in works:
                work.wait()
            stamps["end"] = time.perf_counter()

        lane = threading.Thread(target=exchange, name="flashpar-calibrate-lane")
        lane.start()  # started before the clock, like the overlap lane's worker
        dist.barrier(info.group)
        t0 = time.perf_counter()
        go.set()
        torch.mm(a, w, out=out)
        t1 = time.perf_counter()
        lane.join()
        span = max(stamps["end"] - stamps["start"], 1e-9)
        return t1 - t0, min(1.0, max(0.0, min(t1, stamps["end"]) - max(t0, stamps["start"])) / span)

    alone()
    beside()  # warm-up: the GEMM and the exchange's connections
    times = torch.zeros(pairs, 2, dtype=torch.float64)  # (alone, beside) per pair
    during = torch.zeros(pairs, dtype=torch.float64)
    for i in range(pairs):
        if i % 2:
            (times[i, 1], during[i]), times[i, 0] = beside(), alone()
        else:
            times[i, 0] = alone()
            times[i, 1], during[i] = beside()
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=info.group)  # the slowest rank's
    dist.all_reduce(during, op=dist.ReduceOp.MIN, group=info.group)
    per_byte = sorted(float(t[1] - t[0]) / (2.0 * b * float(f)) for t, f in zip(times, during, strict=True) if f > 0)
    if not per_byte:  # no exchange overlapped any GEMM: nothing measured
        per_byte = [0.0]
    q = statistics.quantiles(per_byte, n=4) if len(per_byte) > 1 else per_byte * 3
    return {"s_per_byte": max(0.0, statistics.median(per_byte)), "q25": q[0], "q75": q[2], "pairs": len(per_byte),
            "bytes_moved": 2 * b, "gemm_s": statistics.median(float(t) for t in times[:, 0])}


# ----------------------------------------------------------------------------------------------
# attention kernel

ATTN_LONG, ATTN_SHORT = 2048, 128
"""Block lengths (tokens) of the two attention probes."""


def measure_attention(heads: int, kv_heads: int, head_dim: int, length: int, dtype) -> tuple[float, float]:
    """(forward, backward) FLOP/s of the CPU flash kernel on one causal block of ``length`` tokens
    (``4 heads head_dim`` FLOPs per causal (query, key) pair)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    q = torch.randn(1, heads, length, head_dim, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, length, head_dim, dtype=dtype) for _ in range(2))
    out, lse = op(q, k, v, 0.0, True)
    dout = torch.randn_like(out)
    reps = max(1, 2_000_000 // (length * length))
    times = []
    for fn in (lambda: op(q, k, v, 0.0, True), lambda: bwd(dout, q, k, v, out, lse, 0.0, True)):
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            samples.append((time.perf_counter() - t0) / reps)
        times.append(statistics.median(samples))
    flops = 4.0 * heads * head_dim * length * (length + 1) / 2
    return flops / times[0], flops / times[1]


def fit_attention_curve(long_len: int, long_rate: float, short_len: int, short_rate: float) -> tuple[float, float]:
    """(plateau FLOP/s, attn_half) of ``r(L) = plateau (L / (L + half))^2`` through two measured rates.

    ``sqrt(r(s) / r(l)) = s (l + half) / (l (s + half))`` solves to
    ``half = s (1 - ratio) / (ratio - s / l)``; a short block as fast as the long one gives ``half = 1``."""
    ratio = (short_rate / long_rate) ** 0.5
    floor = short_len / long_len
    half = short_len * (1 - ratio) / max(ratio - floor, 1e-3) if ratio < 1 else 1.0
    plateau = long_rate / (long_len / (long_len + half)) ** 2
    return plateau, half


def calibrate_attention(hw: Hardware, heads: int, kv_heads: int, head_dim: int, dtype, group=None,
                        ) -> tuple[Hardware, Hardware]:
    """``hw`` with the attention curve of this machine's flash kernel, (forward, backward): measured on
    every rank of ``group`` at once (a collective call), rank 0's values everywhere."""
    rates = from_rank0([measure_attention(heads, kv_heads, head_dim, n, dtype) for n in (ATTN_LONG, ATTN_SHORT)],
                        group)
    out = []
    for d in (0, 1):  # forward, backward
        plateau, half = fit_attention_curve(ATTN_LONG, rates[0][d], ATTN_SHORT, rates[1][d])
        out.append(replace(hw, attn_peak=plateau / hw.flops, attn_half=half))
    return out[0], out[1]
