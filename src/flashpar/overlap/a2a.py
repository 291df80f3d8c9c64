"""All-to-all fused with the projections around Ulysses attention.

Notation: ``N`` ranks; rank ``i`` holds token block ``T_i`` (``s_i`` tokens, ``S = sum s_i``)
before and after attention and head group ``i`` during it.  Weights are replicated.

matmul_all_to_all (QKV projection, then sequence -> head sharding)
------------------------------------------------------------------
    forward   out_r[T_i]  = x_i @ W_r^T + b_r      computed on rank i, sent to rank r
    backward  grad_x_i    = sum_g grad_out_g[T_i] @ W_g                all-to-all + GEMM
              grad_W_g    = sum_i grad_out_g[T_i]^T @ x_i               (rank i's term on rank i)
``W_g`` are rows ``[g w, (g + 1) w)`` of ``weight [N w, in]``: the caller lays the weight out by
head group.  Forward (flash): each peer's piece is computed and sent at once, the own head
group last, so its GEMM covers the last send.  Backward (flash): local term first, then one
term per arriving head group.

all_to_all_matmul (head -> sequence sharding, then the output projection)
-------------------------------------------------------------------------
    forward   y_i         = sum_g o_g[T_i] @ Wo_g^T + b        o_g[T_i] sent by rank g to rank i
    backward  grad_o_g[T_i] = grad_y_i @ Wo_g                   computed on rank i, sent to rank g
              grad_Wo_g   = sum_i grad_y_i^T @ o_g[T_i]         from the pieces the forward received
``Wo_g`` are columns ``[g u, (g + 1) u)`` of ``weight [out, N u]``.  Forward (flash): the own
head group's term first while the others arrive.  Backward (flash): peers' pieces first,
each sent when computed, then the weight-gradient GEMMs (no communication), the local piece
last.

In flight (flash, rank r of N; ``p_j`` = this rank's tokens projected for head group j, ``o_j``
= head group j's attention output for this rank's tokens, ``T_j`` = rank j's token block)::

    matmul_all_to_all   lane:         | p_{r+1} -> r+1, T_{r-1} <- r-1 | p_{r+2} -> r+2, T_{r-2} <- r-2 |
      forward           main:  p_{r+1} | p_{r+2}                        | ... | p_r (own group, last)  |
    all_to_all_matmul   lane:  | o_r of T_{r+1} -> r+1, o_{r-1} <- r-1 | ... -> r+2, o_{r-2} <- r-2 |
      forward           main:  | y += o_r Wo_r^T (local)               | y += o_{r-1} Wo_{r-1}^T    | ...

The backward of each is the other's pattern: ``matmul_all_to_all``'s gathers ``grad_out`` pieces
like ``all_to_all_matmul`` (own term first), ``all_to_all_matmul``'s computes and sends each
peer's ``grad_o`` like ``matmul_all_to_all`` (own piece last, after the weight-gradient GEMMs).

Weight gradients are this rank's terms (its tokens), as for any replicated parameter under
data parallelism; ``reduce_weight_grad=True`` all-reduces them (sum) over the group inside the
backward, so every rank holds the gradient of the whole sequence.

Merged pieces (``peers_per_piece=g``, flash): ``g`` head groups' messages in one lane item.  The
GEMM-then-all-to-all side computes a run of consecutive head groups ``j .. j+g-1`` in one batched
GEMM, ``p_{j..j+g-1} = x_r @ [W_j; ...; W_{j+g-1}]^T`` written as ``[g, s_r, w]`` (one contiguous send
per peer); the all-to-all-then-GEMM side sums over head groups, one GEMM per arriving group (see
``flashpar.overlap.schedule``, *Merged pieces*).

Modes: flash | slice | none | auto (``ring`` does not apply to an all-to-all).
"""

from __future__ import annotations

import math

import torch

from flashpar.dist import DEFAULT_TIMEOUT_S, dtype_code
from flashpar.overlap.buffers import Buffers
from flashpar.overlap.call import Call, Local, check_split, prepare
from flashpar.overlap.ops import flat, run
from flashpar.overlap.schedule import A2A_MODES, Compute, Piece

A2A_MODE_CHOICES = (*A2A_MODES, "auto")


def matmul_all_to_all(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group=None,
                      mode: str = "flash", chunks: int | None = None, split_sizes: list[int] | None = None,
                      reduce_weight_grad: bool = False, check: bool = True,
                      timeout_s: float = DEFAULT_TIMEOUT_S, peers_per_piece: int | None = None) -> torch.Tensor:
    """``all_to_all(F.linear(x, weight, bias))`` from sequence to head-group sharding, overlapped.

    x ``[s_r, ..., in]`` (this rank's tokens), weight ``[N w, in]`` (rows grouped by head group),
    bias ``[N w]``; returns ``[S, ..., w]``: every token, this rank's head group.  ``peers_per_piece``:
    flash merges up to this many head groups into one piece (default 1; ``auto`` chooses).
    """
    call = _a2a_call("matmul_all_to_all", x, weight, bias, group, mode, chunks, split_sizes, reduce_weight_grad,
                     check, timeout_s, peers_per_piece)
    return _MatmulAllToAll.apply(x, weight, bias, call)


def all_to_all_matmul(o: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group=None,
                      mode: str = "flash", chunks: int | None = None, split_sizes: list[int] | None = None,
                      reduce_weight_grad: bool = False, check: bool = True,
                      timeout_s: float = DEFAULT_TIMEOUT_S, peers_per_piece: int | None = None) -> torch.Tensor:
    """``F.linear(all_to_all(o), weight, bias)`` from head-group to sequence sharding, overlapped.

    o ``[S, ..., u]`` (every token, this rank's head group), weight ``[out, N u]`` (columns grouped by
    head group), bias ``[out]``; returns ``[s_r, ..., out]``.  ``split_sizes``: tokens per rank
    (equal blocks when omitted).
    """
    call = _a2a_call("all_to_all_matmul", o, weight, bias, group, mode, chunks, split_sizes, reduce_weight_grad,
                     check, timeout_s, peers_per_piece)
    return _AllToAllMatmul.apply(o, weight, bias, call)


def _a2a_call(op_name, x, weight, bias, group, mode, chunks, split_sizes, reduce_weight_grad, check,
              timeout_s, peers_per_piece) -> Call:
    scatter_side = op_name == "matmul_all_to_all"  # tokens per rank come from x; otherwise from split_sizes

    def describe(info) -> Local:
        n, r = info.world_size, info.rank
        _check_shapes(op_name, n, x, weight, bias, scatter_side)
        if scatter_side:
            check_split(op_name, split_sizes, n, r, local=x.shape[0], what="tokens")
            local_len = x.shape[0]
        else:
            check_split(op_name, split_sizes, n, r, total=x.shape[0], what="tokens")
            local_len = split_sizes[r] if split_sizes is not None else x.shape[0] // n
        mid_shape = tuple(x.shape[1:-1])
        # the whole sequence's rows, the same number on every rank (each rank picks its own mode when the call is
        # not checked across ranks: their picks must agree)
        total = sum(split_sizes) if split_sizes is not None else local_len * n
        rows = total * math.prod(mid_shape)
        if scatter_side:
            sim = ("matmul_a2a", rows, weight.shape[1], weight.shape[0] // n)
        else:
            sim = ("a2a_matmul", rows, x.shape[-1], weight.shape[0])
        named = [("ndim", x.dim()), ("features", x.shape[-1]), ("weight rows", weight.shape[0]),
                 ("weight columns", weight.shape[1]), ("dtype", dtype_code(x.dtype)),
                 ("bias present", int(bias is not None))]
        named += [] if scatter_side else [("sequence length", x.shape[0])]
        return Local(local_len, sim, named, mid_shape)

    return prepare(op_name, group, {"x": x, "weight": weight, "bias": bias}, describe, mode=mode, chunks=chunks,
                   split_sizes=split_sizes, check=check, timeout_s=timeout_s, local_sizes=scatter_side,
                   modes=A2A_MODE_CHOICES, reduce_weight=reduce_weight_grad, peers_per_piece=peers_per_piece,
                   merged=True)


def _check_shapes(op_name, n, x, weight, bias, scatter_side) -> None:
    if x.dim() < 2 or weight.dim() != 2:
        raise ValueError(f"{op_name}: the input must be [tokens, ..., features] and the weight 2-D; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if scatter_side:
        if x.shape[-1] != weight.shape[1] or weight.shape[0] % n:
            raise ValueError(f"{op_name}: weight {tuple(weight.shape)} must be [N * w, {x.shape[-1]}] (N = {n} head "
                             f"groups of w rows) for x {tuple(x.shape)}")
    elif weight.shape[1] != n * x.shape[-1]:
        raise ValueError(f"{op_name}: weight {tuple(weight.shape)} must have N * u = {n} * {x.shape[-1]} input "
                         f"columns for o {tuple(x.shape)} (u features per head group)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op_name}: bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


def _peer_rows(buffers: Buffers, name: str, rank: int, peer: int, chunks: int) -> torch.Tensor:
    """Every row of ``name``'s piece of ``peer`` (one allocation, or slices of slabs joined)."""
    if chunks == 1 or buffers.slab(name, 0) is None:
        return buffers.view(name, Piece(rank), peer=peer)
    return torch.cat([buffers.view(name, Piece(rank, c, chunks), peer=peer) for c in range(chunks)])


def _weight_grad(rows: int, cols: int, with_bias: bool, wanted: bool, like: torch.Tensor) -> torch.Tensor | None:
    """The weight gradient ``[rows, cols]`` with the bias gradient as one more column (one all-reduce for
    both), bound to buffer ``gw``; ``None`` when no weight or bias gradient is wanted."""
    if not wanted:
        return None
    return torch.zeros(rows, cols + int(with_bias), dtype=like.dtype, device=like.device)


def _cols(group: int, width: int, groups: int = 1) -> slice:
    """Columns (or rows) of head groups ``group .. group + groups - 1`` in a layout of ``width`` per group."""
    return slice(group * width, (group + groups) * width)


class _MatmulAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: Call):
        rows = call.rows
        w = weight.shape[0] // call.info.world_size
        x2 = flat(x)

        def kernels(buffers: Buffers):
            def gemm_p(step: Compute) -> None:  # this rank's tokens for head group(s) step.peer (..)
                g, src = _cols(step.peer, w, step.peers), buffers.view("a", step.piece)
                dst = buffers.view(step.dst, step.piece, step.peer, step.peers)
                if step.peers > 1:  # [peers, rows, w] = x @ W_j^T for each group j of the run, one batched GEMM
                    w_t = weight[g].reshape(step.peers, w, -1).transpose(1, 2)
                    x_b = src.expand(step.peers, *src.shape)
                    if bias is None:
                        torch.bmm(x_b, w_t, out=dst)
                    else:
                        torch.baddbmm(bias[g].view(step.peers, 1, w), x_b, w_t, out=dst)
                elif bias is None:
                    torch.mm(src, weight[g].t(), out=dst)
                else:
                    torch.addmm(bias[g], src, weight[g].t(), out=dst)

            return {"p": gemm_p}

        buffers = run(call, "matmul_a2a", kernels, dims={"out": w}, bind={"a": x2}, like=x2)
        ctx.save_for_backward(x2, weight)
        ctx.call, ctx.has_bias, ctx.x_shape = call, bias is not None, x.shape
        return buffers.tensor("out").view(rows.total // rows.row_width, *call.mid_shape, w)

    @staticmethod
    def backward(ctx, grad_out):
        call: Call = ctx.call
        rows = call.rows
        x2, weight = ctx.saved_tensors
        w, n_in = weight.shape[0] // call.info.world_size, weight.shape[1]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = flat(grad_out)
        grad_x = torch.zeros_like(x2) if need_x else None
        want_w = need_w or (need_b and ctx.has_bias)
        grad_w = _weight_grad(weight.shape[0], n_in, ctx.has_bias, want_w, g2)

        def kernels(buffers: Buffers):
            def gemm_gx(step: Compute) -> None:
                lo, hi = rows.rel(step.piece)
                grad_x[lo:hi].addmm_(buffers.view(step.src, step.piece, step.peer), weight[_cols(step.peer, w)])

            def gemm_gw(step: Compute) -> None:
                lo, hi = rows.rel(step.piece)
                g_piece = buffers.view(step.src, step.piece, step.peer)
                block = grad_w[_cols(step.peer, w)]
                block[:, :n_in].addmm_(g_piece.t(), x2[lo:hi])
                if ctx.has_bias:
                    block[:, n_in].add_(g_piece.sum(0))

            return {"gx": gemm_gx, "gw": gemm_gw}

        run(call, "matmul_a2a_bwd", kernels, dims={"out": w}, bind={"in": g2, "gw": grad_w}, like=g2,
            grad_input=need_x, grad_weight=want_w)
        return (grad_x.view(ctx.x_shape) if need_x else None, grad_w[:, :n_in] if need_w else None,
                grad_w[:, n_in] if need_b and ctx.has_bias else None, None)


class _AllToAllMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, weight, bias, call: Call):
        rows, r, n = call.rows, call.info.rank, call.info.world_size
        u = o.shape[-1]
        o2 = flat(o)
        y = torch.zeros(rows.block_len(r), weight.shape[0], dtype=o.dtype, device=o.device)
        if bias is not None:
            y.add_(bias)

        def kernels(buffers: Buffers):
            def gemm_y(step: Compute) -> None:  # head group step.peer's term of this rank's tokens
                lo, hi = rows.rel(step.piece)
                y[lo:hi].addmm_(buffers.view(step.src, step.piece, step.peer), weight[:, _cols(step.peer, u)].t())

            return {"y": gemm_y}

        buffers = run(call, "a2a_matmul", kernels, dims={"in": u}, bind={"in": o2}, like=o2)
        # the weight gradient needs every head group's piece of this rank's tokens
        pieces = [o2[slice(*rows.rows(Piece(r)))] if j == r else _peer_rows(buffers, "recv", r, j, call.chunks)
                  for j in range(n)]
        ctx.save_for_backward(weight, *pieces)
        ctx.call, ctx.has_bias, ctx.o_shape = call, bias is not None, o.shape
        return y.view(rows.split_sizes[r], *call.mid_shape, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        call: Call = ctx.call
        n = call.info.world_size
        weight, *pieces = ctx.saved_tensors
        u = weight.shape[1] // n
        need_o, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = flat(grad_y)
        want_w = need_w or (need_b and ctx.has_bias)
        grad_w = _weight_grad(weight.shape[0], n * u, ctx.has_bias, want_w, g2)
        if want_w and ctx.has_bias:
            torch.sum(g2, dim=0, out=grad_w[:, n * u])

        def kernels(buffers: Buffers):
            def gemm_p(step: Compute) -> None:  # grad_o of head group(s) step.peer (..) for this rank's tokens
                a, dst = buffers.view("a", step.piece), buffers.view(step.dst, step.piece, step.peer, step.peers)
                cols = weight[:, _cols(step.peer, u, step.peers)]
                if step.peers > 1:  # [peers, rows, u] = grad_y @ Wo_j for each group j of the run, one batched GEMM
                    torch.bmm(a.expand(step.peers, *a.shape), cols.reshape(-1, step.peers, u).transpose(0, 1), out=dst)
                else:
                    torch.mm(a, cols, out=dst)

            def gemm_gw(step: Compute) -> None:
                torch.mm(g2.t(), pieces[step.peer], out=grad_w[:, _cols(step.peer, u)])

            return {"p": gemm_p, "gw": gemm_gw}

        buffers = run(call, "a2a_matmul_bwd", kernels, dims={"in": u}, bind={"a": g2, "gw": grad_w}, like=g2,
                      grad_input=need_o, grad_weight=want_w)
        grad_o = buffers.tensor("out").view(ctx.o_shape) if need_o else None
        return (grad_o, grad_w[:, : n * u] if need_w else None,
                grad_w[:, n * u] if need_b and ctx.has_bias else None, None)
