"""Activation checkpointing of ``ParallelLlama``'s blocks (``flashpar train --checkpoint-activations``).

Each ``ParallelBlock`` runs under ``torch.utils.checkpoint`` (``use_reentrant=False``): its forward keeps
only the block's input; backward runs the block's forward again, then its backward::

    forward:   | block 0 (saves x_0) | block 1 (saves x_1) | ... | head, loss
    backward:  | loss, head | recompute block L-1, its backward | ... | recompute block 0, its backward

The recomputation is the whole forward again, transfers included (tp all-gathers / reduce-scatters,
the ZeRO-3 dp all-gather of the weight rows, Ulysses all-to-alls, the K/V exchange): early stop is
off, so every rank re-runs every op of the block, in the forward's order, at the same point of its
backward (autograd reaches block ``i``'s recomputation once block ``i + 1``'s backward is done, on
every rank).  The K/V bytes of the recomputation are counted apart, in ``kv_recompute``, so
``kv_counter`` still holds the forward's and backward's own traffic.  Parameters are leaves outside
the checkpoint: their gradients accumulate once per step, and ``GradSync``'s hooks fire as without it.

Memory: a block keeps its input ``[T_u / tp, h]`` instead of every activation the ops save
(normed inputs, q/k/v, attention output and log-sum-exp, the MLP's ``[T, 2 ffn / tp]``), at the cost of
one more forward per block.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


@contextlib.contextmanager
def _counting(block, counter):
    """The block's K/V bytes go to ``counter`` while the context is open."""
    kept, block.kv_counter = block.kv_counter, counter
    try:
        yield
    finally:
        block.kv_counter = kept


def run_checkpointed(block: torch.nn.Module, recompute_counter, *args) -> torch.Tensor:
    """``block(*args)`` whose activations are recomputed in backward; the recomputation's K/V bytes go to
    ``recompute_counter``."""

    def contexts():
        return contextlib.nullcontext(), _counting(block, recompute_counter)

    with set_checkpoint_early_stop(False):
        return checkpoint(block, *args, use_reentrant=False, context_fn=contexts)
