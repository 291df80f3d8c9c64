"""Overlapped tensor+sequence-parallel linears: ``all_gather_matmul`` and ``matmul_reduce_scatter``.

Notation: ``N`` ranks, rank ``r`` holds sequence block ``r`` of ``s_r`` positions
(``S = sum s_j``); a block is split into ``k`` chunks (``chunks=k``).  All GEMMs
run on the flattened ``[s * prod(mid dims), features]`` view.

all_gather_matmul (column-parallel linear, Megatron sequence parallelism)
------------------------------------------------------------------------
    forward   y[S, out_r]    = AllGather(x_shard)[S, in] @ W_r^T + b_r
    backward  grad_x[s_r, in] = ReduceScatter(grad_y @ W_r)              GEMM+reduce-scatter
              grad_W_r       = AllGather(x_shard)^T @ grad_y             x gathered again, or saved
              grad_b_r       = sum over rows of grad_y                   local
The forward (flash)::

    lane:  | x_r -> r+1, x_{r-1} <- r-1 | x_r -> r+2, x_{r-2} <- r-2 | ...
    main:  | y[r] = x_r W^T  (local)    | y[r-1]                    | y[r-2] ...

The backward (flash) sends each peer's partial as soon as it is ready and
computes the local block last, so that its GEMM covers the last send::

    lane:  | x exchanges (re-gather) | p[r+1] -> r+1 | p[r+2] -> r+2 | ...
    main:  | p[r+1] | p[r+2] | ...   | grad_W terms as x arrives | p[r] (local) | + received partials

With ``save_gathered=True`` the forward keeps the gathered ``x`` (``S x in``
extra activation memory per layer) and the backward has no x exchange; the
default keeps only ``x_shard``, as Megatron does with sequence parallelism.

matmul_reduce_scatter (row-parallel linear)
-------------------------------------------
    forward   y_r[s_r, out]     = ReduceScatter(x[S, in_r] @ W_r^T) + b      GEMM+reduce-scatter
    backward  grad_x[S, in_r]   = AllGather(grad_y) @ W_r                    all-gather+GEMM
              grad_W_r          = AllGather(grad_y)^T @ x                    same gathered blocks
              grad_b            = AllReduce(sum over rows of grad_y_r)       the full bias gradient
The bias is replicated, so its gradient is all-reduced (async, first on the
lane, hidden by the local GEMMs) and every rank ends with the same, full value.
Both backward GEMMs read each arriving block of ``grad_y`` once.

Exactness: every mode does the same products as the collective version; only
the order of the summands of a reduce-scatter and of ``grad_W`` differs.

Extra memory beyond inputs and outputs (rows x features, per call)
------------------------------------------------------------------
all-gather side: every mode receives straight into the gathered buffer
(``S - s_r`` rows; ``none`` and ``slice`` also gather the local rows, padded
to the largest block where shards are uneven).  Reduce-scatter side:
``flash``: partials for all peers (``S - s_r`` rows) + one received partial per
peer (``(N-1) s_r`` rows), direct sends, no forwarding.  ``ring``:
accumulate-and-forward with two accumulators and two receive buffers of one
block each (``4 max s_j`` rows).  ``slice``: one slab per slice (``S`` rows in
all).  ``none``: the full partial product (``S`` rows).

Uneven shards: ``split_sizes=[s_0, ..., s_{N-1}]`` (sequence positions per rank).
For ``all_gather_matmul`` it may be omitted; the cross-rank check then exchanges
the local lengths once.  For ``matmul_reduce_scatter`` it says how the output is
split; omitted means equal blocks.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from flashpar.dist import DEFAULT_TIMEOUT_S, GroupInfo, dtype_code, resolve_group
from flashpar.overlap.call import (
    MODE_CHOICES,
    Call,
    check_mode,
    check_split,
    check_tensors,
    mid_named,
    pick_mode,
    row_space,
    settle,
)
from flashpar.overlap.executor import Buffers, run_schedule
from flashpar.overlap.schedule import Compute, build_schedule


def all_gather_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group=None,
    mode: str = "flash",
    chunks: int | None = None,
    split_sizes: list[int] | None = None,
    save_gathered: bool = False,
    check: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """``F.linear(all_gather(x, dim=0), weight, bias)`` with the all-gather hidden behind the GEMM.

    x ``[s_r, ..., in]`` (this rank's sequence block), weight ``[out_r, in]``, bias ``[out_r]``;
    returns ``[S, ..., out_r]``.  ``mode``: flash | ring | slice | none | auto.  ``chunks``: sub-blocks
    per peer (flash, ring) or slices (slice).  ``check``: cross-rank shape check (one tiny
    all-gather); switch it off only where shapes are known to agree.
    """
    info = resolve_group(group)
    call = _prepare("all_gather_matmul", info, x, weight, bias, mode, chunks, split_sizes, check, timeout_s)
    call = dataclasses.replace(call, save_gathered=save_gathered)
    return _AllGatherMatmul.apply(x, weight, bias, call)


def matmul_reduce_scatter(
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
    """``reduce_scatter(F.linear(x, weight), dim=0) + bias`` with the reduce-scatter hidden behind the GEMM.

    x ``[S, ..., in_r]`` (full sequence, this rank's input features), weight ``[out, in_r]``, bias
    ``[out]`` (replicated); returns this rank's block ``[s_r, ..., out]``.
    """
    info = resolve_group(group)
    call = _prepare("matmul_reduce_scatter", info, x, weight, bias, mode, chunks, split_sizes, check, timeout_s)
    return _MatmulReduceScatter.apply(x, weight, bias, call)


# ----------------------------------------------------------------------------------------------
# validation and the cross-rank check


def _prepare(op_name, info, x, weight, bias, mode, chunks, split_sizes, check, timeout_s) -> Call:
    n, r = info.world_size, info.rank
    gather_side = op_name == "all_gather_matmul"
    error: BaseException | None = None
    try:
        _validate_local(op_name, n, r, x, weight, bias, mode, chunks, split_sizes, gather_side)
    except (ValueError, TypeError) as err:
        error = err
    mid_shape, local_len, named, chosen = (), 0, [], ("none", 1)
    if error is None:
        mid_shape = tuple(x.shape[1:-1])
        if gather_side:
            local_len = x.shape[0]
            total = local_len * n if split_sizes is None else sum(split_sizes)
        else:
            total = x.shape[0]
            local_len = split_sizes[r] if split_sizes is not None else total // n
        sim_op = "ag_matmul" if gather_side else "matmul_rs"
        rows = total * math.prod(mid_shape)
        chosen = pick_mode(mode, chunks, n, sim_op, rows, weight.shape[1], weight.shape[0], x)
        feat = weight.shape[1] if gather_side else weight.shape[0]
        named = [("ndim", x.dim()), ("features", feat), ("dtype", dtype_code(x.dtype)),
                 ("bias present", int(bias is not None)), ("mode", MODE_CHOICES.index(mode))]
        named += [] if gather_side else [("sequence length", x.shape[0])]
        named += mid_named(mid_shape)
    device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    sizes, chosen_mode, k = settle(op_name, info, error=error, local_len=local_len, named=named,
                                   chosen=chosen, split_sizes=split_sizes, local_sizes=gather_side, check=check,
                                   device=device, timeout_s=timeout_s)
    return Call(op_name, info, chosen_mode, k, row_space(sizes, mid_shape), mid_shape, timeout_s)


def _validate_local(op_name, n, r, x, weight, bias, mode, chunks, split_sizes, gather_side) -> None:
    check_mode(op_name, mode, chunks)
    check_tensors(op_name, {"x": x, "weight": weight, "bias": bias})
    if x.dim() < 2 or weight.dim() != 2:
        raise ValueError(f"{op_name}: x must be [s, ..., in] and weight [out, in]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op_name}: input features {x.shape[-1]} of x {tuple(x.shape)} do not match weight "
                         f"{tuple(weight.shape)} (expects {weight.shape[1]})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op_name}: bias shape {tuple(bias.shape)} does not match weight rows {weight.shape[0]}")
    if gather_side:
        check_split(op_name, split_sizes, n, r, local=x.shape[0], what="sequence rows")
    else:
        check_split(op_name, split_sizes, n, r, total=x.shape[0], what="sequence length")


# ----------------------------------------------------------------------------------------------
# kernels


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.mm(a, b, out=out)


class _GradWeight:
    """``grad_W = sum_pieces g[piece]^T @ x[piece]`` accumulated into one tensor."""

    def __init__(self, rows_out: int, cols: int, like: torch.Tensor) -> None:
        self.value = torch.zeros(rows_out, cols, dtype=like.dtype, device=like.device)

    def add(self, g_piece: torch.Tensor, x_piece: torch.Tensor) -> None:
        self.value.addmm_(g_piece.t(), x_piece)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def _gathered(buffers: Buffers, name: str, tensor: torch.Tensor, info: GroupInfo, width: int) -> None:
    """Register the all-gathered input ``name``: its local block is ``tensor`` itself (never copied)."""
    if info.world_size == 1:
        buffers.add_full(name, tensor, width)
    else:
        buffers.add_full(name, None, width, local=tensor)


def _reduce_buffers(buffers: Buffers, call: Call, width: int, out: torch.Tensor) -> None:
    """Buffers of a GEMM+reduce-scatter whose local block lands in ``out``."""
    buffers.add_local("y", out)
    for name, kind in (("send", "per_block"), ("recv", "per_peer"), ("acc0", "scratch"), ("acc1", "scratch"),
                       ("accin0", "scratch"), ("accin1", "scratch")):
        buffers.add_lazy(name, kind, width)
    if call.mode == "none" and call.info.world_size > 1:
        buffers.add_full("full", None, width)
    if call.mode == "slice":
        buffers.add_slabs("slab", call.chunks, width)


def _run(call: Call, schedule, buffers: Buffers, kernels) -> None:
    run_schedule(schedule, buffers, kernels, call.info, op_name=call.op_name, timeout_s=call.timeout_s)


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: Call):
        info, rows = call.info, call.rows
        x2 = _flat(x)
        w_t = weight.t()
        buffers = Buffers(rows, info.rank, dtype=x.dtype, device=x.device)
        _gathered(buffers, "x", x2, info, x2.shape[1])
        y = buffers.add_full("y", None, weight.shape[0])

        def gemm_y(step: Compute) -> None:
            out = buffers.view("y", step.piece)
            src = buffers.view(step.src, step.piece)
            if bias is None:
                torch.mm(src, w_t, out=out)
            else:
                torch.addmm(bias, src, w_t, out=out)

        schedule = build_schedule("ag_matmul", call.mode, info.world_size, info.rank, chunks=call.chunks)
        _run(call, schedule, buffers, {"y": gemm_y})
        keep = buffers.materialize("x", schedule.chunks) if call.save_gathered and info.world_size > 1 else x2
        ctx.save_for_backward(keep, weight)
        ctx.call, ctx.has_bias, ctx.x_shape = call, bias is not None, x.shape
        return y.view(rows.total // rows.row_width, *call.mid_shape, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        call: Call = ctx.call
        info, rows = call.info, call.rows
        x_saved, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = _flat(grad_y)
        grad_b = g2.sum(0) if need_b and ctx.has_bias else None
        if not (need_x or need_w):
            return None, None, grad_b, None
        n_in = weight.shape[1]
        buffers = Buffers(rows, info.rank, dtype=g2.dtype, device=g2.device)
        buffers.add_full("a", g2, g2.shape[1])
        buffers.add_full("g", g2, g2.shape[1])
        saved_gather = call.save_gathered and info.world_size > 1
        if saved_gather:
            buffers.add_full("x", x_saved, n_in)
        else:
            _gathered(buffers, "x", x_saved, info, n_in)
        grad_x = torch.empty(rows.block_len(info.rank), n_in, dtype=g2.dtype, device=g2.device) if need_x else None
        if need_x:
            _reduce_buffers(buffers, call, n_in, grad_x)
        grad_w = _GradWeight(weight.shape[0], n_in, g2)

        def gemm_p(step: Compute) -> None:
            _mm_into(buffers.view(step.dst, step.piece), buffers.view("a", step.piece), weight)

        def gemm_gw(step: Compute) -> None:
            grad_w.add(buffers.view("g", step.piece), buffers.view("x", step.piece))

        schedule = build_schedule(
            "ag_matmul_bwd", call.mode, info.world_size, info.rank, chunks=call.chunks,
            grad_input=need_x, grad_weight=need_w, regather=not saved_gather,
        )
        _run(call, schedule, buffers, {"p": gemm_p, "gw": gemm_gw})
        gx = grad_x.view(ctx.x_shape) if need_x else None
        return gx, grad_w.value if need_w else None, grad_b, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: Call):
        info, rows = call.info, call.rows
        x2 = _flat(x)
        w_t = weight.t()
        buffers = Buffers(rows, info.rank, dtype=x.dtype, device=x.device)
        buffers.add_full("a", x2, x2.shape[1])
        y = torch.empty(rows.block_len(info.rank), weight.shape[0], dtype=x.dtype, device=x.device)
        _reduce_buffers(buffers, call, weight.shape[0], y)

        def gemm_p(step: Compute) -> None:
            _mm_into(buffers.view(step.dst, step.piece), buffers.view("a", step.piece), w_t)

        schedule = build_schedule("matmul_rs", call.mode, info.world_size, info.rank, chunks=call.chunks)
        _run(call, schedule, buffers, {"p": gemm_p})
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(x2, weight)
        ctx.call, ctx.has_bias, ctx.x_shape = call, bias is not None, x.shape
        return y.view(rows.split_sizes[info.rank], *call.mid_shape, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        call: Call = ctx.call
        info, rows = call.info, call.rows
        x2, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        g_local = _flat(grad_y)
        buffers = Buffers(rows, info.rank, dtype=g_local.dtype, device=g_local.device)
        _gathered(buffers, "g", g_local, info, g_local.shape[1])
        buffers.add_full("x", x2, x2.shape[1])
        grad_x = buffers.add_full("gx", None, x2.shape[1]) if need_x else None
        grad_b = g_local.sum(0, keepdim=True) if need_b else None
        if grad_b is not None:
            buffers.add_local("gb", grad_b)
        grad_w = _GradWeight(weight.shape[0], weight.shape[1], g_local)

        def gemm_gx(step: Compute) -> None:
            _mm_into(buffers.view("gx", step.piece), buffers.view(step.src, step.piece), weight)

        def gemm_gw(step: Compute) -> None:
            grad_w.add(buffers.view(step.src, step.piece), buffers.view("x", step.piece))

        if need_x or need_w or need_b:
            schedule = build_schedule(
                "matmul_rs_bwd", call.mode, info.world_size, info.rank, chunks=call.chunks,
                grad_input=need_x, grad_weight=need_w, grad_bias=need_b,
            )
            _run(call, schedule, buffers, {"gx": gemm_gx, "gw": gemm_gw})
        return (
            grad_x.view(ctx.x_shape) if need_x else None,
            grad_w.value if need_w else None,
            grad_b.view(-1) if need_b else None,
            None,
        )

