"""The sum inference runs over a group of ``n`` ranks (no autograd), a copy-free return for a group of one; its
gathers are ``flashpar.dist.all_gather_cat`` and ``all_gather_blocks``."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor, group, n: int, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``x`` reduced over ``group`` in place (returned)."""
    if n > 1:
        dist.all_reduce(x, op=op, group=group)
    return x
