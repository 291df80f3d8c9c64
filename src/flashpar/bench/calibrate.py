"""Measures the :class:`flashpar.cost.Hardware` parameters on the running group.

Called on every rank at once (so CPU sharing between ranks is part of what is
measured); rank 0's values are broadcast, so every rank holds the same numbers
and ``auto`` picks the same mode everywhere.

    GEMM:  t(m) = overhead + 2 k n (m + half_rows) / flops, fitted on a sweep of m
    link:  t(b) = latency + b / bandwidth, from pairwise exchanges (shift r -> r+1)
           of a small and a large message, the same pattern as a flash exchange
    memory: an in-place add over a few MB
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from flashpar.cost import DEFAULTS, Hardware
from flashpar.dist import p2p_group, resolve_group


def _median_time(fn, repeats: int, *, barrier: bool = False) -> float:
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gemm(k: int, n: int, dtype: torch.dtype, *, repeats: int = 5) -> tuple[float, float, float]:
    """(flops, half_rows, overhead_s) for ``[m, k] @ [k, n]`` GEMMs on this process."""
    w = torch.randn(k, n, dtype=dtype)
    tiny_a, tiny_b = torch.randn(1, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype)
    overhead = _median_time(lambda: torch.mm(tiny_a, tiny_b), 50)
    ms = [64, 256, 1024, 2048]
    ts = []
    for m in ms:
        a = torch.randn(m, k, dtype=dtype)
        out = torch.empty(m, n, dtype=dtype)
        torch.mm(a, w, out=out)  # warm-up
        ts.append(_median_time(lambda a=a, out=out: torch.mm(a, w, out=out), repeats))
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
        return DEFAULTS["cpu"].link_bytes_per_s, DEFAULTS["cpu"].link_latency_s
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

    t_small = _median_time(exchange(small), repeats * 2, barrier=True)
    t_large = _median_time(exchange(large), repeats, barrier=True)
    bw = (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - small / bw, 1e-6)
    return bw, latency


def measure_schedule_overheads(group, dtype: torch.dtype) -> tuple[float, float]:
    """(seconds per GEMM piece, seconds per lane item) that the executor adds on top of the kernels
    and the wire: dispatch, views and bookkeeping per piece; the hand-off to the lane and back per
    transfer.  Measured on a tiny all_gather_matmul, compute-only flash(k=4) vs none for the piece,
    communication-only flash(k=1) for the item.  Decomposition pays these per piece, which is what
    makes it lose at small M."""
    from flashpar.overlap import all_gather_matmul
    from flashpar.overlap.executor import only

    n = dist.get_world_size(group)
    x, w = torch.randn(4, 64, dtype=dtype), torch.randn(64, 64, dtype=dtype)
    calls = 20

    def per_call(part: str, mode: str, chunks: int) -> float:
        def run():
            with only(part):
                for _ in range(calls):
                    all_gather_matmul(x, w, group=group, mode=mode, chunks=chunks, check=False)
        run()  # warm-up
        return _median_time(run, 5, barrier=True) / calls

    piece = (per_call("compute", "flash", 4) - per_call("compute", "none", 1)) / ((n - 1) * 4)
    item = per_call("comm", "flash", 1) / (n - 1)
    return max(piece, 0.0), item


def measure_memory(dtype: torch.dtype) -> float:
    a = torch.randn(1 << 20, dtype=dtype)
    b = torch.randn(1 << 20, dtype=dtype)
    t = _median_time(lambda: a.add_(b), 10)
    return 3 * a.numel() * a.element_size() / t


def calibrate(group=None, *, k: int = 1024, n: int = 512, dtype: torch.dtype = torch.float32) -> Hardware:
    """Measure on every rank of ``group`` (a collective call); returns rank 0's values everywhere."""
    flops, half_rows, overhead = measure_gemm(k, n, dtype)
    bw, latency = measure_link(group)
    mem = measure_memory(dtype)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        piece, item = measure_schedule_overheads(group, dtype)
        overhead, latency = max(overhead, piece), max(latency, item)
    hw = [Hardware(flops, half_rows, overhead, bw, latency, mem)]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(hw, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return hw[0]
