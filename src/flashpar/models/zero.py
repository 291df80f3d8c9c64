"""ZeRO-3 over the data-parallel group for the tensor-parallel weights of ``ParallelLlama``.

Each dp rank ``d`` of ``D`` stores rows ``O_d = shard_rows(R, D, d)`` (``flashpar.rows``) of its tp shard
``W_t`` (``R`` rows) and the optimizer state of those rows only.  The layers run the one ZeRO-3 of
flashpar (``flashpar.overlap.sharded``): the dp all-gather of the rows is fused with the GEMMs that use
them, and with the tensor-parallel all-gather / reduce-scatter of the activations; the gradient rows
are reduce-scattered (summed) over dp behind the backward GEMMs.  Tp rank ``r`` holds the sequence
block ``S_r`` of the ``S`` tokens between the layers (sequence parallelism)::

    ZeroColumnParallelLinear (qkv, gate_up)        W_t [R_t, in], dp rows = output features of the tp rank
      forward    y[S, O_d]          = AG_tp(x_shard) @ w_d^T                 per arriving dp piece d
      backward   grad_x_shard       = RS_tp( sum_d grad_y[:, O_d] @ w_d )
                 grad_w_d           = RS_dp( grad_y[:, O_d]^T @ AG_tp(x_shard) )        (summed over dp)
    ZeroRowParallelLinear (o_proj, down)           W_t [out, in_t], dp rows = output features
      forward    y_shard[s_r, O_d]  = RS_tp( x @ w_d^T )                     per arriving dp piece d
      backward   grad_x             = sum_d AG_tp(grad_y_shard)[:, O_d] @ w_d
                 grad_w_d           = RS_dp( AG_tp(grad_y_shard)[:, O_d]^T @ x )

Three transfers in flight at once (flash; the column layer's forward: dp rank d, tp rank r)::

    dp lane:  | w_d -> d+1, w_{d-1} <- d-1 ..................................... | w_{d-2} <- d-2 | ...
    tp lane:  | x_r -> r+1, x_{r-1} <- r-1 | x_r -> r+2, x_{r-2} <- r-2 | ... |
    main:     | y[S_r, O_d] | y[S_{r-1}, O_d]          | y[S_{r-2}, O_d] ...   | y[:, O_{d-1}] | y[:, O_{d-2}] ...

The first GEMM that needs the tp-gathered activation gathers it (the inner tp schedule, its GEMMs on
the blocks as they arrive) while the dp lane brings the next weight rows; the later dp pieces reuse
it.  The backward gathers the rows again (nothing gathered is kept from the forward: ZeRO-3 memory).
Drawings of every direction are in ``flashpar.overlap.sharded``.  ``mode="none"`` runs the same
decomposition with blocking collectives (the baseline).  A dp group of one runs the plain tensor-parallel
op; a tp group of one is ``sharded_linear``'s path.

Gradients are summed over dp (the trainer's convention: the loss is normalised by the global target
count), so ``ParallelLlama.reduce_grads`` sums the ZeRO-3 rows over cp only (``layout`` grad_sum ``zero``).

``gather_rows`` (no autograd) assembles a tp shard from the dp rows for checkpoints
(``ParallelLlama.to_full``); ``reduce_scatter_rows`` (the adjoint of an all-gather) and ``all_gather_rows``
(the adjoint of a reduce-scatter) serve the vocabulary-parallel embedding and head (``flashpar.models.vocab``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashpar.dist import all_gather_blocks, reduce_scatter_single
from flashpar.overlap.modules import ColumnParallelLinear, RowParallelLinear
from flashpar.overlap.sharded import zero_all_gather_matmul, zero_matmul_reduce_scatter
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


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, group, total):
        ctx.group = group
        return _all_gather_rows(rows.contiguous(), group, total)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad.contiguous(), ctx.group), None, None


def all_gather_rows(rows: torch.Tensor, group, total: int) -> torch.Tensor:
    """The full ``[total, ...]`` tensor from every rank's block ``shard_rows(total, n, p)`` (gradient: this
    rank's block of the gradient, summed over the group)."""
    if group is None or dist.get_world_size(group) == 1:
        return rows
    return _GatherRows.apply(rows, group, total)


def gather_rows(rows: torch.Tensor, group, total: int) -> torch.Tensor:
    """The full ``[total, ...]`` tensor from every dp rank's rows (no autograd: checkpoints, ``--check``)."""
    if group is None or dist.get_world_size(group) == 1:
        return rows
    with torch.no_grad():
        return _all_gather_rows(rows.detach(), group, total)


class _ZeroRows:
    """Mixin: ``weight`` (and ``bias``) keep this dp rank's rows of the tp shard (``total_rows`` rows in all)."""

    def _keep_rows(self, dp_group) -> None:
        self.dp_group = dp_group
        n, r = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.dp_size, self.dp_rank = n, r
        self.total_rows = self.weight.shape[0]
        lo, hi = shard_rows(self.total_rows, n, r)
        self.weight = torch.nn.Parameter(self.weight.data[lo:hi].clone())
        if self.bias is not None:
            self.bias = torch.nn.Parameter(self.bias.data[lo:hi].clone())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows of {self.total_rows}, dp={self.dp_size}"


class ZeroColumnParallelLinear(_ZeroRows, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose ``weight [o_d, in]`` (and bias ``[o_d]``) are this dp rank's rows of the
    tp shard; ``forward(x_shard, *, split_sizes=None, check=True)`` as the parent's."""

    def __init__(self, *args, dp_group, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._keep_rows(dp_group)

    def forward(self, x_shard: torch.Tensor, *, split_sizes: list[int] | None = None,
                check: bool = True) -> torch.Tensor:
        return zero_all_gather_matmul(x_shard, self.weight, self.bias, group=self.group, dp_group=self.dp_group,
                                      total_rows=self.total_rows, mode=self.mode, chunks=self.chunks,
                                      split_sizes=split_sizes, check=check, timeout_s=self.timeout_s)


class ZeroRowParallelLinear(_ZeroRows, RowParallelLinear):
    """``RowParallelLinear`` whose ``weight [o_d, in_t]`` (and bias ``[o_d]``) are this dp rank's output rows;
    ``forward(x, *, split_sizes=None, check=True)`` as the parent's."""

    def __init__(self, *args, dp_group, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._keep_rows(dp_group)

    def forward(self, x: torch.Tensor, *, split_sizes: list[int] | None = None, check: bool = True) -> torch.Tensor:
        return zero_matmul_reduce_scatter(x, self.weight, self.bias, group=self.group, dp_group=self.dp_group,
                                          total_rows=self.total_rows, mode=self.mode, chunks=self.chunks,
                                          split_sizes=split_sizes, check=check, timeout_s=self.timeout_s)
