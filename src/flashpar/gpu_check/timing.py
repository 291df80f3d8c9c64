"""Timing GPU (or CPU) work: the median of a few repetitions after warm-up, the device synchronised.

On CUDA each repetition is bracketed by CUDA events on the current stream (the kernels' time, not
their launches); elsewhere by ``time.perf_counter``.  ``budget_s`` caps the repetitions: a slow
kernel is timed fewer times rather than eating the part's limit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, *, warmup: int = 1, reps: int = 5,
                   budget_s: float = 10.0) -> float:
    """Median seconds of ``fn()`` over up to ``reps`` timed calls after ``warmup`` calls (at least one timed
    call; no more once ``budget_s`` has passed since the first warm-up)."""
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    while len(times) < max(1, reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)
