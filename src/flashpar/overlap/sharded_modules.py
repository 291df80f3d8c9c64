"""The modules of sharded data parallelism (ZeRO-3 / FSDP style) over ``flashpar.overlap.sharded``'s op:
:class:`ShardedLinear`, a drop-in for ``nn.Linear`` whose weight holds this rank's rows; :func:`shard_linears`
to convert a model's linears; :func:`average_replicated_grads` for the parameters that stay whole.

    rank r of N:   weight [o_r, in] (rows shard_rows(out, N, r))  --sharded_linear-->  y [..., out]
                   grad:  this rank's rows of the group average
"""

from __future__ import annotations

import torch
from torch import nn

from flashpar.dist import DEFAULT_TIMEOUT_S, resolve_group
from flashpar.overlap.modules import init_linear_params
from flashpar.overlap.sharded import sharded_linear
from flashpar.rows import row_sizes, shard_rows


class ShardedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` under sharded data parallelism: ``weight`` / ``bias`` are this rank's rows.

    ``forward(x)``: ``x [..., in]`` (this rank's batch) -> ``[..., out]``.  Gradients of the shard are the
    group average (FSDP / DDP convention).  ``mode``: flash | ring | slice | none | auto.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None, mode: str = "flash",
                 chunks: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, device=None, dtype=None) -> None:
        super().__init__()
        info = resolve_group(group)
        self.group, self.mode, self.chunks, self.timeout_s = group, mode, chunks, timeout_s
        self.dp_size, self.dp_rank = info.world_size, info.rank
        self.in_features, self.out_features = in_features, out_features
        self.split_sizes = row_sizes(out_features, info.world_size)
        rows = self.split_sizes[info.rank]
        init_linear_params(self, (rows, in_features), rows if bias else None, in_features, device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs) -> ShardedLinear:
        """This rank's rows of ``linear`` (every rank passes the same full layer)."""
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                  device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        lo, hi = shard_rows(linear.out_features, mod.dp_size, mod.dp_rank)
        with torch.no_grad():
            mod.weight.copy_(linear.weight[lo:hi])
            if mod.bias is not None:
                mod.bias.copy_(linear.bias[lo:hi])
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sharded_linear(x, self.weight, self.bias, group=self.group, mode=self.mode, chunks=self.chunks,
                              split_sizes=self.split_sizes, timeout_s=self.timeout_s)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"shard={tuple(self.weight.shape)}, dp={self.dp_size}, mode={self.mode}")


def shard_linears(model: nn.Module, group=None, **kwargs) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (in place) by its :class:`ShardedLinear`; returns ``model``,
    or, for a bare ``nn.Linear`` (which cannot be replaced in place), its :class:`ShardedLinear`.

    Every rank must call it on the same model (same weights).  Other parameters stay replicated:
    average their gradients with :func:`average_replicated_grads` (or a DDP wrapper over them).
    """
    if isinstance(model, nn.Linear):
        return ShardedLinear.from_linear(model, group, **kwargs)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, ShardedLinear.from_linear(child, group, **kwargs))
        else:
            shard_linears(child, group, **kwargs)
    return model


def average_replicated_grads(model: nn.Module, group=None) -> None:
    """All-reduce (average) the gradients of every parameter not owned by a :class:`ShardedLinear`."""
    import torch.distributed as dist

    info = resolve_group(group)
    if info.world_size == 1:
        return
    sharded = {id(p) for m in model.modules() if isinstance(m, ShardedLinear) for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in sharded and p.grad is not None:
            dist.all_reduce(p.grad, group=info.group)
            p.grad.div_(info.world_size)
