"""The padding ladder of segment-attention batches: which task lengths share one kernel call.

Tasks of a phase whose query and key lengths round up to the same ladder values run as one padded batch
(``flashpar.cp.kernels.make_batches``); the cost model counts those batches to charge one kernel launch each
(``flashpar.cp.calls``).  A length ``n`` rounds up to ``m 2^e`` with ``m`` in 4..8 (at most 1.25x above ``n``:
four steps per octave), lengths up to ``MIN_PAD`` to ``MIN_PAD``, and above ``PAD_LIMIT`` it stays exact (a long
task pads to no one).
"""

from __future__ import annotations

import numpy as np

PAD_LIMIT = 2048  # above this length a task is batched only with tasks of exactly its shape
MIN_PAD = 8


def padded_len(n: int) -> int:
    """``n`` rounded up to ``m 2^e`` with ``m`` in 4..8 (at most 1.25x above ``n``); exact above PAD_LIMIT."""
    if n > PAD_LIMIT:
        return n
    if n <= MIN_PAD:
        return MIN_PAD
    e = max(0, n.bit_length() - 3)
    return -(-n >> e) << e


def padded_lens(n) -> np.ndarray:
    """:func:`padded_len` of every element of an integer array (``np.frexp``'s exponent of ``n >= 1`` is its bit
    length)."""
    n = np.asarray(n, dtype=np.int64)
    e = np.maximum(np.frexp(np.maximum(n, 1).astype(np.float64))[1].astype(np.int64) - 3, 0)
    up = -((-n) >> e) << e
    return np.where(n > PAD_LIMIT, n, np.where(n <= MIN_PAD, MIN_PAD, up))
