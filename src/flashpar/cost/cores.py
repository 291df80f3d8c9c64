"""Ranks that share a host's cores: how much faster one computes while the others wait, and when each finishes.

The device figures of a CPU host are measured with every rank busy (``flashpar.cost.calibrate``).  Where the
host runs more threads than it has cores, a rank that waits hands its cores to the others:

    shared_burst(L, t, C, g)    ``flashpar.cp.CostModel.burst``: a rank alone against a rank among all, for ``L``
                                processes of ``t`` threads on ``C`` cores in ranks of ``g`` processes
    shared_finish(work, C)      each rank's finish time under processor sharing (``flashpar bench cp``'s
                                prediction of what a rank measures from the barrier)

Plain Python: no torch.
"""

from __future__ import annotations


def shared_burst(processes: int, threads: int, cores: int, group: int = 1) -> float:
    """``CostModel.burst`` of ``processes`` processes of ``threads`` threads on one host of ``cores`` cores, in
    ranks of ``group`` processes each (a cp rank: its tp x ulysses processes compute together): a rank gets
    ``cores / ranks`` cores with every rank busy and ``min(group threads, cores)`` alone; 1 where every
    thread has a core."""
    for name, v in (("processes", processes), ("threads", threads), ("cores", cores), ("group", group)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"shared_burst: {name} must be an integer >= 1, got {v!r}")
    ranks = max(processes / group, 1.0)
    return max(1.0, ranks * min(group * threads, cores) / cores)


def shared_finish(work: list[float], cores: float) -> list[float]:
    """Finish times of ranks with compute ``work`` (seconds at the calibrated rate, which is measured
    with every rank busy) when the N ranks share ``cores`` cores: processor sharing, each busy rank
    running at ``min(1, cores / busy)`` of a core.  With a core per rank it returns ``work``."""
    n = len(work)
    if cores >= n:
        return list(work)
    left = {r: w * cores / n for r, w in enumerate(work)}  # seconds on a whole core
    finish, now = [0.0] * n, 0.0
    while left:
        share = min(1.0, cores / len(left))
        first = min(left, key=left.get)
        dt = left[first] / share
        now += dt
        for r in list(left):
            left[r] -= dt * share
            if left[r] <= 1e-15:
                finish[r] = now
                del left[r]
    return finish
