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

Schedules: the forward is the ``ag_matmul`` schedule over the row space of ``W``'s output
features (a piece of shard ``j`` is a block of output columns, written straight into its
columns of ``y``); the backward is ``ag_matmul_bwd`` with its roles named for this layer:
gemm ``p`` computes the peers' ``grad_W`` blocks first, each sent as soon as it is ready,
the local block last, and gemm ``gw`` adds each arriving shard's ``grad_x`` term (local
first).  The bias travels as one extra column of the weight shard, so one transfer per
peer carries both and one reduce-scatter returns both gradients.

Gradient convention: like torch's FSDP and DDP, the gradient of a shard is the *average*
over the group of the ranks' gradients (each rank's loss is a mean over its own batch).
Parameters that are not in a ``ShardedLinear`` (norms, embeddings) stay replicated; average
their gradients with a plain all-reduce (:func:`average_replicated_grads`).
"""

from __future__ import annotations

import torch
from torch import nn

from flashpar.dist import DEFAULT_TIMEOUT_S, dtype_code, resolve_group
from flashpar.overlap.call import MODE_CHOICES, Call, check_mode, check_split, check_tensors, pick_mode, settle
from flashpar.overlap.executor import Buffers, RowSpace, run_schedule
from flashpar.overlap.modules import _init_like_linear
from flashpar.overlap.ops import _gathered, _reduce_buffers
from flashpar.overlap.schedule import Compute, build_schedule
from flashpar.rows import shard_rows

OP_NAME = "sharded_linear"


def sharded_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    mode: str = "flash",
    chunks: int | None = None,
    split_sizes: list[int] | None = None,
    check: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """``F.linear(x, all_gather(weight), all_gather(bias))`` with the gather hidden behind the GEMM and
    the gradients of ``weight`` / ``bias`` reduce-scattered (averaged) behind the backward GEMMs.

    x ``[..., in]`` (this rank's batch; other ranks may hold other row counts), weight ``[o_r, in]``
    (this rank's output rows), bias ``[o_r]``; returns ``[..., sum_j o_j]``.  ``split_sizes``: the
    output rows of every rank (exchanged by the cross-rank check when omitted).
    """
    info = resolve_group(group)
    n, r = info.world_size, info.rank
    error = None
    named, chosen = [], ("none", 1)
    try:
        check_mode(OP_NAME, mode, chunks)
        check_tensors(OP_NAME, {"x": x, "weight": weight, "bias": bias})
        if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
            raise ValueError(f"{OP_NAME}: x must be [..., in] and the weight shard [out_r, in] with the same in; "
                             f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{OP_NAME}: bias shard {tuple(bias.shape)} does not match the weight shard's "
                             f"{weight.shape[0]} rows")
        check_split(OP_NAME, split_sizes, n, r, local=weight.shape[0], what="output rows")
        out_total = sum(split_sizes) if split_sizes is not None else weight.shape[0] * n
        tokens = max(x.numel() // max(x.shape[-1], 1), 1)
        chosen = pick_mode(mode, chunks, n, "sharded", tokens, weight.shape[1], out_total, x)
        named = [("in features", weight.shape[1]), ("dtype", dtype_code(x.dtype)),
                 ("bias present", int(bias is not None)), ("mode", MODE_CHOICES.index(mode))]
    except (ValueError, TypeError) as err:
        error = err
    device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    sizes, chosen_mode, k = settle(OP_NAME, info, error=error, local_len=weight.shape[0] if error is None else 0,
                                   named=named, chosen=chosen, split_sizes=split_sizes, local_sizes=True,
                                   check=check, device=device, timeout_s=timeout_s)
    call = Call(OP_NAME, info, chosen_mode, k, RowSpace(sizes, 1), (), timeout_s)
    return _ShardedLinear.apply(x, weight, bias, call)


def _with_bias_column(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The shard that travels: ``[o_r, in]``, or ``[o_r, in + 1]`` with the bias as its last column."""
    if bias is None:
        return weight.contiguous()
    return torch.cat([weight, bias[:, None]], dim=1)


class _ShardedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: Call):
        info, rows = call.info, call.rows
        n_in = weight.shape[1]
        x2 = x.reshape(-1, n_in).contiguous()
        shard = _with_bias_column(weight, bias)
        buffers = Buffers(rows, info.rank, dtype=x.dtype, device=x.device)
        _gathered(buffers, "x", shard, info, shard.shape[1])
        y = torch.empty(x2.shape[0], rows.total, dtype=x.dtype, device=x.device)

        def gemm_y(step: Compute) -> None:
            lo, hi = rows.rows(step.piece)
            w = buffers.view("x", step.piece)
            if bias is None:
                torch.mm(x2, w.t(), out=y[:, lo:hi])
            else:
                torch.addmm(w[:, n_in], x2, w[:, :n_in].t(), out=y[:, lo:hi])

        schedule = build_schedule("ag_matmul", call.mode, info.world_size, info.rank, chunks=call.chunks)
        run_schedule(schedule, buffers, {"y": gemm_y}, info, op_name=call.op_name, timeout_s=call.timeout_s)
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
        width = shard.shape[1]
        buffers = Buffers(rows, info.rank, dtype=g2.dtype, device=g2.device)
        _gathered(buffers, "x", shard, info, width)
        grad_shard = torch.empty(weight.shape[0], width, dtype=g2.dtype, device=g2.device)
        if need_w or need_b:
            _reduce_buffers(buffers, call, width, grad_shard)
        grad_x = torch.zeros(x2.shape[0], n_in, dtype=g2.dtype, device=g2.device) if need_x else None

        def gemm_grad_w(step: Compute) -> None:  # this rank's contribution to grad_W of a piece of a shard
            lo, hi = rows.rows(step.piece)
            out = buffers.view(step.dst, step.piece)
            torch.mm(g2[:, lo:hi].t(), x2, out=out[:, :n_in])
            if bias is not None:
                torch.sum(g2[:, lo:hi], dim=0, out=out[:, n_in])

        def gemm_grad_x(step: Compute) -> None:  # one shard's term of grad_x
            lo, hi = rows.rows(step.piece)
            grad_x.addmm_(g2[:, lo:hi], buffers.view("x", step.piece)[:, :n_in])

        schedule = build_schedule("ag_matmul_bwd", call.mode, info.world_size, info.rank, chunks=call.chunks,
                                  grad_input=need_w or need_b, grad_weight=need_x, regather=True)
        run_schedule(schedule, buffers, {"p": gemm_grad_w, "gw": gemm_grad_x}, info, op_name=call.op_name,
                     timeout_s=call.timeout_s)
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
        self.split_sizes = [hi - lo for lo, hi in (shard_rows(out_features, info.world_size, j)
                                                   for j in range(info.world_size))]
        rows = self.split_sizes[info.rank]
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(rows, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(rows, **kw)) if bias else None
        _init_like_linear(self.weight.data, self.bias.data if bias else None, in_features)

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
    """Replace every ``nn.Linear`` in ``model`` (in place) by its :class:`ShardedLinear`; returns ``model``.

    Every rank must call it on the same model (same weights).  Other parameters stay replicated:
    average their gradients with :func:`average_replicated_grads` (or a DDP wrapper over them).
    """
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
