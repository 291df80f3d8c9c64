"""Lists of numbers as numpy arrays, and one test on an array, for the planner's array forms (the same values)."""

from __future__ import annotations

import numpy as np


def falls_to_nonnegative(values) -> bool:
    """Whether ``values`` never rise along the array and its last is not below 0 (NaN: False)."""
    return bool((values[:-1] >= values[1:]).all()) and bool(values[-1] >= 0)


def floats(values) -> np.ndarray:
    """A list of floats as a float64 array (the same values; beyond 64 by ``np.fromiter``: ``np.asarray``'s type
    discovery costs about 1.5x there, up to 4x on a loaded machine, and fromiter's start-up more below)."""
    n = len(values)
    return np.fromiter(values, dtype=np.float64, count=n) if n > 64 else np.array(values, dtype=np.float64)


def ints(values) -> np.ndarray:
    """A list of integers as an int64 array (see :func:`floats`)."""
    n = len(values)
    return np.fromiter(values, dtype=np.int64, count=n) if n > 64 else np.array(values, dtype=np.int64)

