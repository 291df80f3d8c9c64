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
A forward without grad (no input needs it) keeps nothing gathered.

matmul_reduce_scatter (row-parallel linear)
-------------------------------------------
    forward   y_r[s_r, out]     = ReduceScatter(x[S, in_r] @ W_r^T) + b      GEMM+reduce-scatter
    backward  grad_x[S, in_r]   = AllGather(grad_y) @ W_r                    all-gather+GEMM
              grad_W_r          = AllGather(grad_y)^T @ x                    same gathered blocks
              grad_b            = AllReduce(sum over rows of grad_y_r)       the full bias gradient
The bias is replicated, so its gradient is all-reduced (async, first on the
lane, hidden by the local GEMMs) and every rank ends with the same, full value.
Both backward GEMMs read each arriving block of ``grad_y`` once.

Merged pieces: ``peers_per_piece=g`` (flash, ``chunks=1``) moves ``g`` peers' blocks in one lane
item and runs one GEMM on their rows together (``flashpar.overlap.schedule``, *Merged pieces*)::

    N = 4, g = 2, all-gather side, rank 1:   lane:  | x_1 -> 2; x_0 <- 0 | x_1 -> 3, 0; x_3, x_2 <- |
                                             main:  | y[1]  (local)     | y[0]              | y[2 .. 3]

``mode="auto"`` weighs them against one piece per peer and ``none`` with the cost model, the forward and
the backward each on its own (the backward runs ``Call.backward()``: every mode gives the same gradients).

Exactness: every mode does the same products as the collective version; only
the order of the summands of a reduce-scatter and of ``grad_W`` differs.

Extra memory beyond inputs and outputs (rows x features, per call)
------------------------------------------------------------------
all-gather side: every mode receives straight into the gathered buffer
(``S - s_r`` rows; ``none`` and ``slice`` also gather the local rows, padded
to the largest block where shards are uneven).  Reduce-scatter side:
``flash``: partials for all peers (``S - s_r`` rows; a merged piece's in one tensor) + one received
partial per peer (``(N-1) s_r`` rows), direct sends, no forwarding.  ``ring``:
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
import functools
import math

import torch

from flashpar.dist import DEFAULT_TIMEOUT_S, dtype_code
from flashpar.overlap.buffers import Buffers
from flashpar.overlap.call import Call, Local, check_split, prepare
from flashpar.overlap.executor import run_schedule
from flashpar.overlap.schedule import Compute, Schedule, build_schedule


def all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group=None,
                      mode: str = "flash", chunks: int | None = None, split_sizes: list[int] | None = None,
                      save_gathered: bool = False, check: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                      peers_per_piece: int | None = None) -> torch.Tensor:
    """``F.linear(all_gather(x, dim=0), weight, bias)`` with the all-gather hidden behind the GEMM.

    x ``[s_r, ..., in]`` (this rank's sequence block), weight ``[out_r, in]``, bias ``[out_r]``;
    returns ``[S, ..., out_r]``.  ``mode``: flash | ring | slice | none | auto.  ``chunks``: sub-blocks
    per peer (flash, ring) or slices (slice).  ``peers_per_piece``: flash merges up to this many peers
    into one piece (default 1; ``auto`` chooses).  ``check``: cross-rank shape check (one tiny
    all-gather); switch it off only where shapes are known to agree.
    """
    call = _linear_call("all_gather_matmul", x, weight, bias, group, mode, chunks, split_sizes, check, timeout_s,
                        peers_per_piece, regather=not save_gathered)
    return _AllGatherMatmul.apply(x, weight, bias, dataclasses.replace(call, save_gathered=save_gathered))


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group=None,
                          mode: str = "flash", chunks: int | None = None, split_sizes: list[int] | None = None,
                          check: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                          peers_per_piece: int | None = None) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight), dim=0) + bias`` with the reduce-scatter hidden behind the GEMM.

    x ``[S, ..., in_r]`` (full sequence, this rank's input features), weight ``[out, in_r]``, bias
    ``[out]`` (replicated); returns this rank's block ``[s_r, ..., out]``.  The options are
    :func:`all_gather_matmul`'s.
    """
    call = _linear_call("matmul_reduce_scatter", x, weight, bias, group, mode, chunks, split_sizes, check, timeout_s,
                        peers_per_piece)
    return _MatmulReduceScatter.apply(x, weight, bias, call)


# ----------------------------------------------------------------------------------------------
# validation and the cross-rank check


def _linear_call(op_name, x, weight, bias, group, mode, chunks, split_sizes, check, timeout_s, peers_per_piece, *,
                 regather: bool = True) -> Call:
    gather_side = op_name == "all_gather_matmul"

    def describe(info) -> Local:
        n, r = info.world_size, info.rank
        if x.dim() < 2 or weight.dim() != 2:
            raise ValueError(f"{op_name}: x must be [s, ..., in] and weight [out, in]; got x {tuple(x.shape)}, "
                             f"weight {tuple(weight.shape)}")
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"{op_name}: input features {x.shape[-1]} of x {tuple(x.shape)} do not match weight "
                             f"{tuple(weight.shape)} (expects {weight.shape[1]})")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{op_name}: bias shape {tuple(bias.shape)} does not match weight rows "
                             f"{weight.shape[0]}")
        mid_shape = tuple(x.shape[1:-1])
        if gather_side:
            check_split(op_name, split_sizes, n, r, local=x.shape[0], what="sequence rows")
            local_len = x.shape[0]
            total = local_len * n if split_sizes is None else sum(split_sizes)
        else:
            check_split(op_name, split_sizes, n, r, total=x.shape[0], what="sequence length")
            total = x.shape[0]
            local_len = split_sizes[r] if split_sizes is not None else total // n
        feat = weight.shape[1] if gather_side else weight.shape[0]
        named = [("ndim", x.dim()), ("features", feat), ("dtype", dtype_code(x.dtype)),
                 ("bias present", int(bias is not None))]
        named += [] if gather_side else [("sequence length", x.shape[0])]
        sim = ("ag_matmul" if gather_side else "matmul_rs", total * math.prod(mid_shape), weight.shape[1],
               weight.shape[0])
        return Local(local_len, sim, named, mid_shape)

    return prepare(op_name, group, {"x": x, "weight": weight, "bias": bias}, describe, mode=mode, chunks=chunks,
                   split_sizes=split_sizes, check=check, timeout_s=timeout_s, local_sizes=gather_side,
                   peers_per_piece=peers_per_piece, merged=True, regather=regather, split_directions=True)


# ----------------------------------------------------------------------------------------------
# kernels


class _GradWeight:
    """``grad_W = sum_pieces g[piece]^T @ x[piece]`` accumulated into one tensor."""

    def __init__(self, rows_out: int, cols: int, like: torch.Tensor) -> None:
        self.value = torch.zeros(rows_out, cols, dtype=like.dtype, device=like.device)

    def add(self, g_piece: torch.Tensor, x_piece: torch.Tensor) -> None:
        self.value.addmm_(g_piece.t(), x_piece)


def flat(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ..., features]`` as the contiguous 2-D ``[rows * prod(...), features]`` the GEMMs run on."""
    return t.reshape(-1, t.shape[-1]).contiguous()


@functools.lru_cache(maxsize=1024)
def _schedule(op: str, mode: str, n: int, r: int, chunks: int, peers_per_piece: int, reduce_weight: bool,
              flags: tuple) -> Schedule:
    """``build_schedule`` once per distinct call: a schedule is immutable, and every layer of a model
    (and every step) runs the same few."""
    return build_schedule(op, mode, n, r, chunks=chunks, peers_per_piece=peers_per_piece,
                          reduce_weight=reduce_weight, **dict(flags))


def run(call: Call, op: str, kernels, *, dims: dict[str, int], bind: dict[str, torch.Tensor | None],
        like: torch.Tensor, **flags) -> Buffers:
    """Build ``op``'s schedule for this call, its buffers (``bind``: the op's tensors by buffer name,
    ``dims``: the widths of the rest) and run it; returns the buffers."""
    info = call.info
    schedule = _schedule(op, call.mode, info.world_size, info.rank, call.chunks, call.peers_per_piece,
                         call.reduce_weight, tuple(sorted(flags.items())))
    buffers = Buffers(schedule, call.rows, dims=dims, bind=bind, dtype=like.dtype, device=like.device)
    run_schedule(schedule, buffers, kernels(buffers), info, op_name=call.op_name, timeout_s=call.timeout_s)
    return buffers


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: Call):
        info, rows = call.info, call.rows
        x2 = flat(x)
        w_t = weight.t()

        def kernels(buffers: Buffers):
            def gemm_y(step: Compute) -> None:
                out = buffers.view("y", step.piece)
                src = buffers.view(step.src, step.piece)
                if bias is None:
                    torch.mm(src, w_t, out=out)
                else:
                    torch.addmm(bias, src, w_t, out=out)

            return {"y": gemm_y}

        buffers = run(call, "ag_matmul", kernels, dims={"out": weight.shape[0]}, bind={"x": x2}, like=x2)
        # the gathered x is kept only for a backward that reads it (none without grad: inference's forward)
        gathered = call.save_gathered and info.world_size > 1 and any(ctx.needs_input_grad[:3])
        keep = buffers.materialize("x") if gathered else x2
        ctx.save_for_backward(keep, weight)
        ctx.call, ctx.has_bias, ctx.x_shape = call, bias is not None, x.shape
        return buffers.tensor("y").view(rows.total // rows.row_width, *call.mid_shape, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        call: Call = ctx.call.backward()  # auto may have picked the backward's schedule apart
        info, rows = call.info, call.rows
        x_saved, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = flat(grad_y)
        grad_b = g2.sum(0) if need_b and ctx.has_bias else None
        if not (need_x or need_w):
            return None, None, grad_b, None
        n_in = weight.shape[1]
        grad_x = torch.empty(rows.block_len(info.rank), n_in, dtype=g2.dtype, device=g2.device) if need_x else None
        grad_w = _GradWeight(weight.shape[0], n_in, g2)

        def kernels(buffers: Buffers):
            def gemm_p(step: Compute) -> None:  # this rank's partial of grad_x rows of a block
                torch.mm(buffers.view("a", step.piece), weight, out=buffers.view(step.dst, step.piece))

            def gemm_gw(step: Compute) -> None:
                grad_w.add(g2[slice(*rows.rows(step.piece))], buffers.view("x", step.piece))

            return {"p": gemm_p, "gw": gemm_gw}

        saved_gather = call.save_gathered and info.world_size > 1
        run(call, "ag_matmul_bwd", kernels, dims={"in": n_in}, bind={"a": g2, "x": x_saved, "gx": grad_x}, like=g2,
            grad_input=need_x, grad_weight=need_w, regather=not saved_gather)
        gx = grad_x.view(ctx.x_shape) if need_x else None
        return gx, grad_w.value if need_w else None, grad_b, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: Call):
        info, rows = call.info, call.rows
        y = torch.empty(rows.block_len(info.rank), weight.shape[0], dtype=x.dtype, device=x.device)
        x2 = flat(x)

        def kernels(buffers: Buffers):
            def gemm_p(step: Compute) -> None:  # this rank's partial of the output rows of a block
                torch.mm(buffers.view("a", step.piece), weight.t(), out=buffers.view(step.dst, step.piece))

            return {"p": gemm_p}

        run(call, "matmul_rs", kernels, dims={"out": weight.shape[0]}, bind={"a": x2, "y": y}, like=x2)
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(x2, weight)
        ctx.call, ctx.has_bias, ctx.x_shape = call, bias is not None, x.shape
        return y.view(rows.split_sizes[info.rank], *call.mid_shape, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        call: Call = ctx.call.backward()  # auto may have picked the backward's schedule apart
        x2, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        g_local = flat(grad_y)
        grad_x = torch.empty(call.rows.total, x2.shape[1], dtype=x2.dtype, device=x2.device) if need_x else None
        grad_b = g_local.sum(0, keepdim=True) if need_b else None
        grad_w = _GradWeight(weight.shape[0], weight.shape[1], g_local)

        def kernels(buffers: Buffers):
            def gemm_gx(step: Compute) -> None:
                torch.mm(buffers.view(step.src, step.piece), weight, out=buffers.view("gx", step.piece))

            def gemm_gw(step: Compute) -> None:
                grad_w.add(buffers.view(step.src, step.piece), x2[slice(*call.rows.rows(step.piece))])

            return {"gx": gemm_gx, "gw": gemm_gw}

        if need_x or need_w or need_b:
            run(call, "matmul_rs_bwd", kernels, dims={}, bind={"g": g_local, "gx": grad_x, "gb": grad_b},
                like=g_local, grad_input=need_x, grad_weight=need_w, grad_bias=need_b)
        return (
            grad_x.view(ctx.x_shape) if need_x else None,
            grad_w.value if need_w else None,
            grad_b.view(-1) if need_b else None,
            None,
        )
