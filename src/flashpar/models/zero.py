"""ZeRO-3 over the data-parallel group for the tensor-parallel weights of ``ParallelLlama``.

Each dp rank stores rows ``shard_rows(R, dp, d)`` (``flashpar.rows``) of its tp shard ``W_t`` (``R`` rows) and the
optimizer state of those rows only.  Before use the rows are all-gathered over dp; in backward the
gradient of ``W_t`` is reduce-scattered (summed) back to the row owners:

    forward:   W_t = all_gather_dp(w_rows)                    [R, in]
    backward:  g_rows = reduce_scatter_dp(g_W_t)[own rows]     sum over the dp ranks

Uneven row shards are padded to the largest for the collectives.  The layers that use it are
``ColumnParallelLinear`` / ``RowParallelLinear`` whose ``weight`` holds the dp rows (``Zero*``).
``reduce_scatter_rows`` (the adjoint of ``gather_rows``) also serves the vocabulary-parallel
embedding (``flashpar.models.vocab``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashpar.dist import all_gather_blocks, reduce_scatter_single
from flashpar.overlap.modules import ColumnParallelLinear, RowParallelLinear
from flashpar.rows import row_sizes, shard_rows


def _all_gather_rows(rows: torch.Tensor, group, total: int) -> torch.Tensor:
    """``[total, ...]`` from every rank's block ``shard_rows(total, n, p)``."""
    return torch.cat(all_gather_blocks(rows, row_sizes(total, dist.get_world_size(group)), group))


def _reduce_scatter_rows(full: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of ``full`` summed over the group."""
    n, total = dist.get_world_size(group), full.shape[0]
    longest = -(-total // n)
    padded = full.new_zeros((n, longest, *full.shape[1:]))
    for p in range(n):
        lo, hi = shard_rows(total, n, p)
        padded[p, : hi - lo] = full[lo:hi]
    out = full.new_empty((longest, *full.shape[1:]))
    reduce_scatter_single(out, padded.reshape(n * longest, *full.shape[1:]).contiguous(), group=group)
    lo, hi = shard_rows(total, n, dist.get_rank(group))
    return out[: hi - lo]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, group, total: int):
        ctx.group = group
        return _all_gather_rows(rows, group, total)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group), None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full, group):
        ctx.group, ctx.total = group, full.shape[0]
        return _reduce_scatter_rows(full, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad.contiguous(), ctx.group, ctx.total), None


def reduce_scatter_rows(full: torch.Tensor, group) -> torch.Tensor:
    """This rank's rows ``shard_rows(T, n, rank)`` of ``full [T, ...]`` summed over the group
    (gradient: all-gathered)."""
    if group is None or dist.get_world_size(group) == 1:
        return full
    return _ScatterRows.apply(full, group)


def gather_rows(rows: torch.Tensor, group, total: int) -> torch.Tensor:
    """The full ``[total, ...]`` tensor from every dp rank's rows (gradient: summed back to the owners)."""
    if group is None or dist.get_world_size(group) == 1:
        return rows
    return _GatherRows.apply(rows, group, total)


class _ZeroRows:
    """Mixin: ``weight`` keeps this dp rank's rows of the tp shard; ``_weight()`` gathers them for the op."""

    def _keep_rows(self, dp_group) -> None:
        self.dp_group = dp_group
        n, r = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.total_rows = self.weight.shape[0]
        lo, hi = shard_rows(self.total_rows, n, r)
        self.weight = torch.nn.Parameter(self.weight.data[lo:hi].clone())

    def _weight(self) -> torch.Tensor:
        return gather_rows(self.weight, self.dp_group, self.total_rows)


class ZeroColumnParallelLinear(_ZeroRows, ColumnParallelLinear):
    def __init__(self, *args, dp_group, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._keep_rows(dp_group)


class ZeroRowParallelLinear(_ZeroRows, RowParallelLinear):
    def __init__(self, *args, dp_group, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._keep_rows(dp_group)
