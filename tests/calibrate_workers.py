"""Rank functions for tests/test_cost_and_bench.py (module level: the ranks unpickle them by name)."""

from __future__ import annotations


def comm_cpu(rank: int, n: int) -> dict:
    """``measure_comm_cpu`` on this loopback group, small (30 ms GEMMs, 3 pairs): its figures."""
    import torch

    from flashpar.cost import preset
    from flashpar.cost.calibrate import measure_comm_cpu

    return measure_comm_cpu(preset("cpu"), torch.float32, gemm_s=0.03, pairs=3)


def late_peak(rank: int, n: int) -> float:
    """``peak_flops`` on CPU with the last rank entering 1 s late: the seconds this rank's call took."""
    import time

    import torch

    from flashpar.cost.calibrate import peak_flops

    if rank == n - 1:
        time.sleep(1.0)
    t0 = time.perf_counter()
    assert peak_flops(torch.device("cpu")) > 0
    return time.perf_counter() - t0
