"""The few plain collectives of inference (no autograd): sums and gathers over a group of ``n`` ranks, each
a no-op copy-free return for a group of one."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor, group, n: int, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``x`` reduced over ``group`` in place (returned)."""
    if n > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def gather_columns(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """Every rank's ``x [R, C]`` side by side, ``[R, n C]`` in rank order (a vocabulary split over tp)."""
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def gather_rows(x: torch.Tensor, split: list[int], group, n: int) -> torch.Tensor:
    """Every rank's rows ``x [split[rank], ...]`` stacked in rank order (each padded to the largest for the
    all-gather)."""
    if n == 1:
        return x
    width = max(split)
    padded = x.new_zeros(width, *x.shape[1:])
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:s] for p, s in zip(parts, split, strict=True)])
