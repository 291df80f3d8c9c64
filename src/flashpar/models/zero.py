"""ZeRO-3 over the shard group for the tensor-parallel weights of ``ParallelLlama``.

The shard group of a rank is every rank with its tp index: the dp x cp x ulysses ranks, which hold the same tp
shard ``W_t`` (``R`` rows) of every weight.  Rank ``s`` of the ``N`` of them stores rows
``O_s = shard_rows(R, N, s)`` (``flashpar.rows``) of it and the optimizer state of those rows only, as
torchtitan's FSDP over dp_shard x cp.  A block's linears run one of two schedules (``ParallelLlama``'s
``zero_schedule``, per block):

* ``prefetch`` (``flashpar.overlap.prefetch``): the block's four weights are one unit, all-gathered over the
  shard group ``depth`` blocks ahead while earlier blocks compute; the linear then runs the plain
  tensor-parallel op on the whole ``W_t`` (its GEMMs undivided) and its gradient is reduce-scattered with the
  unit's as the block's backward ends.  ``source`` hands the linear its whole weight.
* ``fused`` (``flashpar.overlap.sharded``): the shard all-gather of the rows is fused with the GEMMs that use
  them, one piece per peer, composed with the tp all-gather / reduce-scatter of the activations; the gradient
  rows are reduce-scattered behind the backward GEMMs.  Nothing waits ahead of the block: what prefetching
  cannot hide (the first block's gather, the last reduce-scatter) is hidden behind the block's own GEMMs.

Tp rank ``r`` holds the sequence block ``S_r`` of the ``S`` tokens between the layers (sequence parallelism)::

    ZeroColumnParallelLinear (qkv, gate_up)        W_t [R_t, in], rows = output features of the tp rank
      prefetch   y[S, :]            = AG_tp(x_shard) @ W_t^T                 W_t gathered ahead
      fused      y[S, O_s]          = AG_tp(x_shard) @ w_s^T                 per arriving shard piece s
      backward   grad_x_shard       = RS_tp( grad_y @ W_t )
                 grad_w_s           = RS_shard( grad_y[:, O_s]^T @ AG_tp(x_shard) )    (summed over the group)
    ZeroRowParallelLinear (o_proj, down)           W_t [out, in_t], rows = output features
      prefetch   y_shard            = RS_tp( x @ W_t^T )
      fused      y_shard[s_r, O_s]  = RS_tp( x @ w_s^T )                     per arriving shard piece s
      backward   grad_x             = AG_tp(grad_y_shard) @ W_t
                 grad_w_s           = RS_shard( AG_tp(grad_y_shard)[:, O_s]^T @ x )

The fused schedule's three transfers in flight at once (flash; the column layer's forward: shard rank s, tp
rank r)::

    shard lane:  | w_s -> s+1, w_{s-1} <- s-1 ..................................... | w_{s-2} <- s-2 | ...
    tp lane:     | x_r -> r+1, x_{r-1} <- r-1 | x_r -> r+2, x_{r-2} <- r-2 | ... |
    main:        | y[S_r, O_s] | y[S_{r-1}, O_s]          | y[S_{r-2}, O_s] ...   | y[:, O_{s-1}] | ...

Drawings of every direction are in ``flashpar.overlap.sharded`` and ``flashpar.overlap.prefetch``.
``mode="none"`` runs both schedules blocking (the baseline: each unit gathered when it is needed, each
reduce-scatter waited for).  A group of one runs the plain tensor-parallel op.

Gradients are summed over the shard group (the trainer's convention: the loss is normalised by the global target
count), which is every rank holding a copy of ``W_t``: nothing is left for ``ParallelLlama.reduce_grads`` to sum
(``layout`` grad_sum ``zero``).

``gather_rows`` (no autograd) assembles a tp shard from the rows for checkpoints (``ParallelLlama.to_full``);
``reduce_scatter_rows`` (the adjoint of an all-gather) and ``all_gather_rows`` (the adjoint of a reduce-scatter)
serve the vocabulary-parallel embedding and head (``flashpar.models.vocab``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashpar.dist import all_gather_blocks, reduce_scatter_single
from flashpar.overlap.modules import ColumnParallelLinear, RowParallelLinear
from flashpar.overlap.ops import all_gather_matmul, matmul_reduce_scatter
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
    """The full ``[total, ...]`` tensor from every rank's rows (no autograd: checkpoints, ``--check``)."""
    if group is None or dist.get_world_size(group) == 1:
        return rows
    with torch.no_grad():
        return _all_gather_rows(rows.detach(), group, total)


def keep_rows(module: torch.nn.Module, group) -> None:
    """Make ``module.weight`` (and ``bias``, where it has one) this rank's rows ``shard_rows(R, n, rank)`` of the
    group's; ``module.total_rows = R``, ``module.shard_size = n``."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    module.total_rows, module.shard_size = module.weight.shape[0], n
    lo, hi = shard_rows(module.total_rows, n, r)
    module.weight = torch.nn.Parameter(module.weight.data[lo:hi].clone())
    if getattr(module, "bias", None) is not None:
        module.bias = torch.nn.Parameter(module.bias.data[lo:hi].clone())


class _ZeroRows:
    """Mixin: ``weight`` (and ``bias``) keep this rank's rows of the tp shard (``total_rows`` rows in all) over the
    shard group; ``source`` (set by the model for a prefetched block): a callable returning the whole ``W_t``,
    gathered ahead, in the compute dtype."""

    source = None

    def _keep_rows(self, dp_group) -> None:
        self.dp_group = dp_group
        keep_rows(self, dp_group)

    def extra_repr(self) -> str:
        how = "prefetched" if self.source is not None else "fused"
        return f"{super().extra_repr()}, rows of {self.total_rows}, shard={self.shard_size}, {how}"


class ZeroColumnParallelLinear(_ZeroRows, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose ``weight [o_s, in]`` (and bias ``[o_s]``) are this rank's rows of the tp
    shard; ``forward(x_shard, *, split_sizes=None, check=True, pick_rows=None)`` as the parent's (``pick_rows``: a
    fused block's ``zero_all_gather_matmul``)."""

    def __init__(self, *args, dp_group, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._keep_rows(dp_group)

    def forward(self, x_shard: torch.Tensor, *, split_sizes: list[int] | None = None,
                check: bool = True, pick_rows: int | None = None) -> torch.Tensor:
        if self.source is not None:  # the whole W_t, gathered ahead: the plain tensor-parallel op
            return all_gather_matmul(x_shard, self.source(), None, group=self.group, mode=self.mode,
                                     chunks=self.chunks, split_sizes=split_sizes, save_gathered=self.save_gathered,
                                     check=check, timeout_s=self.timeout_s)
        return zero_all_gather_matmul(x_shard, self.weight, self.bias, group=self.group, dp_group=self.dp_group,
                                      total_rows=self.total_rows, mode=self.mode, chunks=self.chunks,
                                      split_sizes=split_sizes, check=check, timeout_s=self.timeout_s,
                                      pick_rows=pick_rows)


class ZeroRowParallelLinear(_ZeroRows, RowParallelLinear):
    """``RowParallelLinear`` whose ``weight [o_s, in_t]`` (and bias ``[o_s]``) are this rank's output rows;
    ``forward(x, *, split_sizes=None, check=True, pick_rows=None)`` as the parent's."""

    def __init__(self, *args, dp_group, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._keep_rows(dp_group)

    def forward(self, x: torch.Tensor, *, split_sizes: list[int] | None = None, check: bool = True,
                pick_rows: int | None = None) -> torch.Tensor:
        if self.source is not None:
            return matmul_reduce_scatter(x, self.source(), None, group=self.group, mode=self.mode, chunks=self.chunks,
                                         split_sizes=split_sizes, check=check, timeout_s=self.timeout_s)
        return zero_matmul_reduce_scatter(x, self.weight, self.bias, group=self.group, dp_group=self.dp_group,
                                          total_rows=self.total_rows, mode=self.mode, chunks=self.chunks,
                                          split_sizes=split_sizes, check=check, timeout_s=self.timeout_s,
                                          pick_rows=pick_rows)
