"""Sharded data parallelism (ZeRO-3 / FSDP style) with the weight all-gather and the gradient
reduce-scatter fused into the layer's own GEMMs.

Every rank of the data-parallel group holds rows ``O_r`` (``o_r`` of the ``out`` output
features) of the weight ``W [out, in]`` and of the bias, and its own batch ``x_r [..., in]``:

    forward   y_r[:, O_j]      = x_r @ W_j^T + b_j        for every shard j (local j = r first)
    backward  grad_x_r         = sum_j grad_y_r[:, O_j] @ W_j               one term per shard, local first
              grad_W_j (avg)   = 1/N sum_r grad_y_r[:, O_j]^T @ x_r         GEMM + reduce-scatter
              grad_b_j (avg)   = 1/N sum_r sum over rows of grad_y_r[:, O_j]

The gathered weight lives only inside the forward and the backward (the backward gathers
it again, as ZeRO-3 / FSDP do); between them each rank keeps its shard and its input.

Schedules (``flashpar.overlap.schedule``, row space = ``W``'s output features, so a piece of
shard ``j`` is a block of output columns): the forward ``sharded`` gathers the shards ``w``,
gemm ``y`` writing each arrived shard's columns of ``y``; the backward ``sharded_bwd`` gathers
``w`` again for gemm ``gx`` (each shard's ``grad_x`` term, local first) while gemm ``gw``
computes the peers' ``grad_W`` blocks first, each sent to its owner as soon as it is ready,
the local block last.  The bias travels as one extra column of the weight shard, so one
transfer per peer carries both and one reduce-scatter returns both gradients.

In flight (flash, rank r of N; ``w_j`` = shard j, ``gW_j`` = this rank's term of its gradient)::

    forward   lane:  | w_r -> r+1, w_{r-1} <- r-1 | w_r -> r+2, w_{r-2} <- r-2 | ...
              main:  | y[:, O_r] (local)           | y[:, O_{r-1}]              | y[:, O_{r-2}] ...
    backward  lane:  | w exchanges (re-gather)     | gW_{r+1} -> r+1 | gW_{r+2} -> r+2 | ...
              main:  | gW_{r+1} | gW_{r+2} | ...   | grad_x terms as w arrives | gW_r (local) | + received

Gradient convention: like torch's FSDP and DDP, the gradient of a shard is the *average*
over the group of the ranks' gradients (each rank's loss is a mean over its own batch).
Parameters that are not in a ``ShardedLinear`` (norms, embeddings) stay replicated; average
their gradients with a plain all-reduce (:func:`average_replicated_grads`).
"""

from __future__ import annotations

import torch
from torch import nn

from flashpar.dist import DEFAULT_TIMEOUT_S, dtype_code, resolve_group
from flashpar.overlap.buffers import Buffers
from flashpar.overlap.call import Call, Local, check_split, prepare
from flashpar.overlap.modules import init_linear_params
from flashpar.overlap.ops import run
from flashpar.overlap.schedule import Compute
from flashpar.rows import row_sizes, shard_rows

OP_NAME = "sharded_linear"


def sharded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group=None,
                   mode: str = "flash", chunks: int | None = None, split_sizes: list[int] | None = None,
                   check: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """``F.linear(x, all_gather(weight), all_gather(bias))`` with the gather hidden behind the GEMM and
    the gradients of ``weight`` / ``bias`` reduce-scattered (averaged) behind the backward GEMMs.

    x ``[..., in]`` (this rank's batch; other ranks may hold other row counts), weight ``[o_r, in]``
    (this rank's output rows), bias ``[o_r]``; returns ``[..., sum_j o_j]``.  ``split_sizes``: the
    output rows of every rank (exchanged by the cross-rank check when omitted).
    """

    def describe(info) -> Local:
        if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
            raise ValueError(f"{OP_NAME}: x must be [..., in] and the weight shard [out_r, in] with the same in; "
                             f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{OP_NAME}: bias shard {tuple(bias.shape)} does not match the weight shard's "
                             f"{weight.shape[0]} rows")
        check_split(OP_NAME, split_sizes, info.world_size, info.rank, local=weight.shape[0], what="output rows")
        out_total = sum(split_sizes) if split_sizes is not None else weight.shape[0] * info.world_size
        tokens = max(x.numel() // max(x.shape[-1], 1), 1)
        named = [("in features", weight.shape[1]), ("dtype", dtype_code(x.dtype)),
                 ("bias present", int(bias is not None))]
        return Local(weight.shape[0], ("sharded", tokens, weight.shape[1], out_total), named)

    call = prepare(OP_NAME, group, {"x": x, "weight": weight, "bias": bias}, describe, mode=mode, chunks=chunks,
                   split_sizes=split_sizes, check=check, timeout_s=timeout_s, local_sizes=True)
    return _ShardedLinear.apply(x, weight, bias, call)


def _with_bias_column(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The shard that travels: ``[o_r, in]``, or ``[o_r, in + 1]`` with the bias as its last column."""
    if bias is None:
        return weight.contiguous()
    return torch.cat([weight, bias[:, None]], dim=1)


class _ShardedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: Call):
        rows = call.rows
        n_in = weight.shape[1]
        x2 = x.reshape(-1, n_in).contiguous()
        y = torch.empty(x2.shape[0], rows.total, dtype=x.dtype, device=x.device)

        def kernels(buffers: Buffers):
            def gemm_y(step: Compute) -> None:  # y[:, O_j] = x @ W_j^T + b_j for the arrived shard j
                lo, hi = rows.rows(step.piece)
                w = buffers.view("w", step.piece)
                if bias is None:
                    torch.mm(x2, w.t(), out=y[:, lo:hi])
                else:
                    torch.addmm(w[:, n_in], x2, w[:, :n_in].t(), out=y[:, lo:hi])

            return {"y": gemm_y}

        run(call, "sharded", kernels, dims={}, bind={"w": _with_bias_column(weight, bias)}, like=x2)
        ctx.save_for_backward(x2, weight, bias)
        ctx.call, ctx.x_shape = call, x.shape
        return y.view(*x.shape[:-1], rows.total)

    @staticmethod
    def backward(ctx, grad_y):
        call: Call = ctx.call
        info, rows = call.info, call.rows
        x2, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        n_in = weight.shape[1]
        g2 = grad_y.reshape(-1, rows.total).contiguous()
        shard = _with_bias_column(weight, bias)
        grad_shard = torch.empty(weight.shape[0], shard.shape[1], dtype=g2.dtype, device=g2.device)
        grad_x = torch.zeros(x2.shape[0], n_in, dtype=g2.dtype, device=g2.device) if need_x else None

        def kernels(buffers: Buffers):
            def gemm_gw(step: Compute) -> None:  # this rank's term of grad_W (and grad_b) of a piece of a shard
                lo, hi = rows.rows(step.piece)
                out = buffers.view(step.dst, step.piece)
                torch.mm(g2[:, lo:hi].t(), x2, out=out[:, :n_in])
                if bias is not None:
                    torch.sum(g2[:, lo:hi], dim=0, out=out[:, n_in])

            def gemm_gx(step: Compute) -> None:  # the arrived shard's term of grad_x
                lo, hi = rows.rows(step.piece)
                grad_x.addmm_(g2[:, lo:hi], buffers.view("w", step.piece)[:, :n_in])

            return {"gw": gemm_gw, "gx": gemm_gx}

        run(call, "sharded_bwd", kernels, dims={"in": shard.shape[1]}, bind={"w": shard, "gw": grad_shard}, like=g2,
            grad_input=need_x, grad_weight=need_w or need_b)
        if need_w or need_b:
            grad_shard.div_(info.world_size)  # the data-parallel average (torch FSDP / DDP convention)
        return (
            grad_x.view(ctx.x_shape) if need_x else None,
            grad_shard[:, :n_in] if need_w else None,
            grad_shard[:, n_in] if need_b else None,
            None,
        )


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
