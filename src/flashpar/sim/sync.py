"""What a synchronous step over ``N`` devices loses to the slowest of them.

Every collective of a training step waits for its last rank, so a step over ``N`` devices runs at the pace of the
slowest.  Devices of one model differ in the clock they sustain under a power limit (torchtitan's published H100s
ran at 500 W), so with a spread ``sigma`` of the per-device step time (its standard deviation over the mean) the
step is, in expectation::

    step(N) = step x (1 + sigma z(N)),     z(N) = E[max of N standard normals]
                                                = integral of x N phi(x) Phi(x)^(N - 1) dx

    N      1     8     64    128   512
    z(N)   0    1.42  2.34  2.59  3.04

``sigma`` is the cluster's (``flashpar.cost.presets.STEP_SPREAD``): fitted with the clock factor on torchtitan's
8- and 128-GPU runs of one configuration (``flashpar.sim.anchors.fit``).  Both peers of a layout lose the same share:
the term moves absolute tokens/s, never a ratio between configurations on the same GPUs.
"""

from __future__ import annotations

import functools
import math


@functools.lru_cache(maxsize=256)
def expected_max(n: int) -> float:
    """``z(n)``: the expected largest of ``n`` independent standard normal draws (0 for one), by Simpson's rule
    over [-9, 9] (the integrand outside is below 1e-15)."""
    if n < 1:
        raise ValueError(f"expected_max needs n >= 1, got {n}")
    if n == 1:
        return 0.0
    steps, lo, hi = 3600, -9.0, 9.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += weight * x * n * pdf * cdf ** (n - 1)
    return total * h / 3


def factor(n: int, spread: float) -> float:
    """``1 + spread z(n)``: the expected step of ``n`` devices over one device's."""
    return 1.0 + spread * expected_max(n)
