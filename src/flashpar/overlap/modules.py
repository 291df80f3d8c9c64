"""Sequence-parallel linear layers (Megatron conventions) built on the overlapped ops.

    ColumnParallelLinear:  x_shard [s/N, ..., in]  -> y [s, ..., out/N]     (w_col [out/N, in])
    RowParallelLinear:     x [s, ..., in/N]        -> y_shard [s/N, ..., out] (w_row [out, in/N])

A column-parallel layer followed by a row-parallel one is the tensor-parallel MLP
(or attention) block: the activations between them are feature-sharded and
sequence-complete, those outside are sequence-sharded.  ``from_linear(linear,
group)`` shards a full ``nn.Linear`` so a converted model can be checked against
its unsharded self.  The row-parallel bias is replicated; its gradient is the
full (all-reduced) gradient on every rank, so replicas never drift.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flashpar.dist import DEFAULT_TIMEOUT_S, resolve_group
from flashpar.overlap.ops import all_gather_matmul, matmul_reduce_scatter


def _shard_len(total: int, n: int, what: str) -> int:
    if total % n:
        raise ValueError(f"{what} = {total} is not divisible by the tensor-parallel size {n}")
    return total // n


def init_linear_params(module: nn.Module, weight_shape: tuple[int, int], bias_len: int | None, fan_in: int, *,
                       device=None, dtype=None) -> None:
    """``module.weight [weight_shape]`` and ``module.bias [bias_len]`` (None: no bias) as parameters with
    nn.Linear's initialisation, using the fan-in of the full (unsharded) layer."""
    kw = {"device": device, "dtype": dtype}
    module.weight = nn.Parameter(torch.empty(*weight_shape, **kw))
    module.bias = nn.Parameter(torch.empty(bias_len, **kw)) if bias_len is not None else None
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        nn.init.uniform_(module.weight, -bound, bound)  # = kaiming_uniform_(a=sqrt(5)) of nn.Linear
        if module.bias is not None:
            nn.init.uniform_(module.bias, -bound, bound)


def _in_dtype(module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``module.weight`` and ``module.bias`` cast to ``dtype`` (the same tensors when they have it): a cast in
    autograd, so the gradient comes back to the parameter in its own dtype."""
    bias = module.bias.to(dtype) if module.bias is not None else None
    return module.weight.to(dtype), bias


class _ParallelLinear(nn.Module):
    def __init__(self, group, mode: str, chunks: int | None, timeout_s: float) -> None:
        super().__init__()
        self.group = group
        self.mode = mode
        self.chunks = chunks
        self.timeout_s = timeout_s
        info = resolve_group(group)
        self.tp_size, self.tp_rank = info.world_size, info.rank

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs):
        """The same layer sharded over ``group``: this rank's part of ``linear``'s weight and bias."""
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                  device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        weight, bias = mod._shard_of(linear)
        with torch.no_grad():
            mod.weight.copy_(weight)
            if bias is not None:
                mod.bias.copy_(bias)
        return mod

    def _shard_of(self, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def extra_repr(self) -> str:
        w = self.weight
        return f"weight={tuple(w.shape)}, bias={self.bias is not None}, tp={self.tp_size}, mode={self.mode}"


class ColumnParallelLinear(_ParallelLinear):
    """``y = all_gather(x_shard) @ w_col^T + b_col``; output features sharded over the group."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 mode: str = "flash", chunks: int | None = None, save_gathered: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S, device=None, dtype=None) -> None:
        super().__init__(group, mode, chunks, timeout_s)
        out_local = _shard_len(out_features, self.tp_size, "out_features")
        self.in_features, self.out_features = in_features, out_features
        self.save_gathered = save_gathered
        init_linear_params(self, (out_local, in_features), out_local if bias else None, in_features, device=device,
                           dtype=dtype)

    def forward(self, x_shard: torch.Tensor, *, split_sizes: list[int] | None = None,
                check: bool = True) -> torch.Tensor:
        """``check=False``: no cross-rank shape check (with ``split_sizes`` given, nothing is exchanged
        before the op's own transfers); for callers that validate once per step.  The weight computes in
        ``x_shard``'s dtype (mixed precision: fp32 parameters, bf16 activations; ``_in_dtype``)."""
        weight, bias = _in_dtype(self, x_shard.dtype)
        return all_gather_matmul(x_shard, weight, bias, group=self.group, mode=self.mode,
                                 chunks=self.chunks, split_sizes=split_sizes, save_gathered=self.save_gathered,
                                 check=check, timeout_s=self.timeout_s)

    def _shard_of(self, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's rows of ``linear.weight`` (and ``linear.bias``)."""
        n = self.weight.shape[0]
        rows = slice(self.tp_rank * n, (self.tp_rank + 1) * n)
        return linear.weight[rows], (linear.bias[rows] if linear.bias is not None else None)


class RowParallelLinear(_ParallelLinear):
    """``y_shard = reduce_scatter(x @ w_row^T) + b``; input features sharded, bias replicated."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 mode: str = "flash", chunks: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device=None, dtype=None) -> None:
        super().__init__(group, mode, chunks, timeout_s)
        in_local = _shard_len(in_features, self.tp_size, "in_features")
        self.in_features, self.out_features = in_features, out_features
        init_linear_params(self, (out_features, in_local), out_features if bias else None, in_features,
                           device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, *, split_sizes: list[int] | None = None, check: bool = True) -> torch.Tensor:
        """``check`` and the dtype: as :meth:`ColumnParallelLinear.forward`."""
        weight, bias = _in_dtype(self, x.dtype)
        return matmul_reduce_scatter(x, weight, bias, group=self.group, mode=self.mode,
                                     chunks=self.chunks, split_sizes=split_sizes, check=check,
                                     timeout_s=self.timeout_s)

    def _shard_of(self, linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's columns of ``linear.weight``; the bias whole (it is replicated)."""
        n = self.weight.shape[1]
        return linear.weight[:, self.tp_rank * n : (self.tp_rank + 1) * n], linear.bias
