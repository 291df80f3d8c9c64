"""Sharded data parallelism (ZeRO-3 / FSDP style) with the weight all-gather and the gradient
reduce-scatter fused into the layer's own GEMMs, alone or composed with tensor + sequence parallelism.

This file is the one ZeRO-3 of flashpar: :func:`sharded_linear` / ``ShardedLinear`` (data parallelism only;
its modules: ``flashpar.overlap.sharded_modules``) and the tensor-parallel layers of ``flashpar.models.zero`` run
the same autograd
function (:class:`_ZeroLinear`); without a tensor-parallel group the two kinds below are the same op.

Notation: dp group of ``D`` ranks (different batches; the weight rows are split over it), tp group of
``T`` ranks (one batch, sequence-sharded between the layers).  ``W_t [R, in]`` is the tp rank's weight
(the whole weight without tp); dp rank ``d`` holds its rows ``O_d = shard_rows(R, D, d)``, ``w_d``.
Tp rank ``j`` holds sequence block ``S_j`` of the ``S`` positions.

Column kind (``zero_all_gather_matmul``: qkv, gate_up; and ``sharded_linear``, where ``T = 1``)::

    forward   y[S, O_d]      = AG_tp(x_shard)[S, in] @ w_d^T (+ b_d)           for every dp piece d
    backward  grad_x_shard   = RS_tp( sum_d grad_y[:, O_d] @ w_d )             GEMMs + tp reduce-scatter
              grad_w_d       = RS_dp( grad_y[:, O_d]^T @ AG_tp(x_shard) )      GEMMs + dp reduce-scatter

Row kind (``zero_matmul_reduce_scatter``: o_proj, down; ``O_d`` are output features)::

    forward   y_shard[s_r, O_d] = RS_tp( x[S, in_t] @ w_d^T ) (+ b_d)          for every dp piece d
    backward  grad_x[S, in_t]   = sum_d G[:, O_d] @ w_d,      G = AG_tp(grad_y_shard)
              grad_w_d          = RS_dp( G[:, O_d]^T @ x )

Schedules, nested.  The outer schedule is the dp ``sharded`` (forward) / ``sharded_bwd`` (backward) of
``flashpar.overlap.schedule`` over the row space of ``W_t``: the forward gathers the ``w`` pieces and
runs gemm ``y`` on each as it arrives (the own piece first); the backward gathers ``w`` again for gemm
``gx`` while gemm ``gw`` computes the peers' gradient rows first, each sent to its owner as soon as it
is ready, its own rows last.  A gemm of the outer schedule runs an inner tp schedule:

* the tp all-gather of an activation (``x`` of the column kind, ``grad_y`` of the row kind) is run by
  the FIRST outer gemm that needs it, fused with that gemm (each arriving block's GEMM as it lands:
  the gather half of ``matmul_rs_bwd``), and kept for the later ones (:class:`_TpGather`; the first
  one is whichever the mode's order runs first, so every mode works);
* the tp reduce-scatter (``matmul_rs``) of the row kind's forward runs inside every piece's gemm ``y``
  (the tp traffic of one reduce-scatter, split into dp rounds); that of the column kind's ``grad_x``
  inside the LAST gemm ``gx``, whose partials are ``gx_partial[S_j] + grad_y[S_j, O_d] @ w_d``.

Lane workers are per (group, thread), so the dp lane keeps moving weight rows (forward, re-gather) and
gradient rows (backward) while the inner tp schedule's lane moves activations.  In flight (flash, dp rank
d, tp rank r; ``X = AG_tp(x_shard)``, ``G = AG_tp(grad_y_shard)``, ``gY``: the column kind's ``grad_y``)::

    column forward
      dp lane:  | w_d -> d+1, w_{d-1} <- d-1 ...................... | w_d -> d+2, w_{d-2} <- d-2 | ...
      tp lane:  | x_r -> r+1, x_{r-1} <- r-1 | x_r -> r+2, ... |
      main:     | y[S_r, O_d] | y[S_{r-1}, O_d] | y[S_{r-2}, O_d]  | y[:, O_{d-1}] = X w^T | y[:, O_{d-2}] ...
    column backward
      dp lane:  | w re-gather ................................ | gW_{d+1} -> d+1 | gW_{d+2} -> d+2 | ...
      tp lane:  | x re-gather (inside the first gw) |                   | grad_x partials -> tp peers (last gx)
      main:     | gW_{d+1} per arriving x block | gW_{d+2} = gY^T X | gx terms as w arrives | last gx | gW_d
    row forward
      dp lane:  | w_d -> d+1, w_{d-1} <- d-1 .................... | w_d -> d+2, w_{d-2} <- d-2 | ...
      tp lane:  | partials of piece d -> tp peers | partials of piece d-1 -> tp peers | ...
      main:     | x @ w_d^T, peers' rows first, own last | x @ w_{d-1}^T ...           | ...
    row backward
      dp lane:  | w re-gather ................................ | gW_{d+1} -> d+1 | gW_{d+2} -> d+2 | ...
      tp lane:  | grad_y gathered into G (inside the first gw) |
      main:     | gW_{d+1} per arriving G block | gW_{d+2} = G^T x | gx terms as w arrives | gW_d | + received

The gathered weight lives only inside the forward and the backward (the backward gathers it again);
between them each rank keeps its rows, its input (``x_shard`` for the column kind, as Megatron's
sequence parallelism does) and nothing gathered.  The bias travels as one extra column of the weight
rows, so one transfer per peer carries both and one reduce-scatter returns both gradients.

Gradient convention (``average``): :func:`sharded_linear` averages over the dp group, like torch's FSDP
and DDP (each rank's loss is a mean over its own batch); the tensor-parallel ops sum, as the trainer
does (its loss is normalised by the global number of targets).  Parameters that are not in a
``ShardedLinear`` (norms, embeddings) stay replicated; average their gradients with a plain all-reduce
(``average_replicated_grads``).

Mixed precision (FSDP2's ``param_dtype`` / ``reduce_dtype``): ``x`` may have a lower dtype than the rows
(bf16 activations, fp32 master rows).  The rows are cast to ``x``'s dtype before the dp all-gather (forward
and re-gather move bf16) and every GEMM runs in it; the gradient rows, and every buffer of their dp
reduce-scatter, are in the rows' dtype (each bf16 GEMM's product added into fp32), so the sum over dp
is fp32 and the gradient returned has the parameter's dtype.  With one dtype nothing is cast.

Bytes (flash, per rank, in elements): the dp rows travel once per direction (``(D-1) o_d in`` sent,
``(R - o_d) in`` received; the backward adds the same again for the gradient rows); the tp activation
once per direction (the forward gather of ``x`` or the reduce-scatter of ``y`` in dp rounds of the same
total; the backward's gather plus, for the column kind, the reduce-scatter of ``grad_x``).

Cross-rank check: the tp group first, then the dp group, the first's error carried into the second, so
a bad local input or a disagreement within a tp group raises on every rank of the mesh; a disagreement
that only the dp check sees raises on that dp group (its tp peers then time out with the op's name).
``check=False`` with ``split_sizes`` given exchanges nothing.  Benchmarks: ``executor.only("comm")``
skips the gemms, and with them the inner tp schedules that run inside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashpar.dist import DEFAULT_TIMEOUT_S, GroupInfo, dtype_code, resolve_group
from flashpar.overlap.buffers import Buffers
from flashpar.overlap.call import Call, Local, check_split, check_tensors, prepare
from flashpar.overlap.executor import Traffic, run_schedule
from flashpar.overlap.ops import all_gather_matmul, flat, matmul_reduce_scatter
from flashpar.overlap.schedule import Compute, build_schedule
from flashpar.rows import row_sizes

OP_NAME = "sharded_linear"


@dataclass
class ZeroCounter:
    """What the ZeRO-3 ops handed to the transport, accumulated over calls: ``bytes[(direction, group)]`` =
    ``[sent, received]`` with direction ``fwd`` / ``bwd`` and group ``dp`` / ``tp``.  ``events``: ``(what,
    time.monotonic())`` of each op's start and end and of each inner tp schedule's first GEMM (overlap tests)."""

    bytes: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    events: list[tuple[str, float]] = field(default_factory=list)

    def add(self, direction: str, group: str, traffic: Traffic) -> None:
        entry = self.bytes.setdefault((direction, group), [0, 0])
        entry[0] += traffic.sent
        entry[1] += traffic.received

    def mark(self, what: str) -> None:
        self.events.append((what, time.monotonic()))


# ----------------------------------------------------------------------------------------------
# public ops


def sharded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group=None,
                   mode: str = "flash", chunks: int | None = None, split_sizes: list[int] | None = None,
                   check: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                   counter: ZeroCounter | None = None) -> torch.Tensor:
    """``F.linear(x, all_gather(weight), all_gather(bias))`` with the gather hidden behind the GEMM and
    the gradients of ``weight`` / ``bias`` reduce-scattered (averaged) behind the backward GEMMs.

    x ``[..., in]`` (this rank's batch; other ranks may hold other row counts), weight ``[o_r, in]``
    (this rank's output rows), bias ``[o_r]``; returns ``[..., sum_j o_j]``.  ``split_sizes``: the
    output rows of every rank (exchanged by the cross-rank check when omitted).
    """
    z = _prepare(OP_NAME, "column", x, weight, bias, tp_group=None, has_tp=False, dp_group=group, mode=mode,
                 chunks=chunks, seq_split=None, dp_split=split_sizes, check=check, timeout_s=timeout_s,
                 average=True, counter=counter)
    return _ZeroLinear.apply(x, weight, bias, z)


def zero_all_gather_matmul(x_shard: torch.Tensor, w_rows: torch.Tensor, bias: torch.Tensor | None = None, *,
                           group=None, dp_group=None, total_rows: int | None = None, mode: str = "flash",
                           chunks: int | None = None, split_sizes: list[int] | None = None, check: bool = True,
                           timeout_s: float = DEFAULT_TIMEOUT_S, average: bool = False,
                           counter: ZeroCounter | None = None, pick_rows: int | None = None) -> torch.Tensor:
    """``all_gather_matmul(x_shard, W_t, b_t)`` over the tp ``group`` with ``W_t`` / ``b_t`` ZeRO-3 sharded over
    ``dp_group``: ``w_rows [o_d, in]`` are this dp rank's rows ``shard_rows(total_rows, D, d)`` of ``W_t``.

    x_shard ``[s_r, ..., in]``; returns ``[S, ..., total_rows]``.  ``split_sizes``: the sequence blocks of the
    tp ranks (as ``all_gather_matmul``).  Gradient of ``w_rows``: summed over dp (``average=True``: averaged).
    A dp group of one runs ``all_gather_matmul`` itself.  ``pick_rows``: the rows ``mode="auto"`` picks the dp
    side's schedule on (default: this rank's tokens).  With ``check=False`` each rank keeps its own pick, so a
    caller whose ranks hold different numbers of tokens gives every rank of ``dp_group`` the same number here
    (``flashpar.models.parallel``: the sequence's tokens over cp, what the simulator picks on).
    """
    if resolve_group(dp_group).world_size == 1:
        w_rows, bias = _in_dtype(w_rows, bias, x_shard.dtype)
        return all_gather_matmul(x_shard, w_rows, bias, group=group, mode=mode, chunks=chunks, split_sizes=split_sizes,
                                 check=check, timeout_s=timeout_s)
    z = _prepare("zero_all_gather_matmul", "column", x_shard, w_rows, bias, tp_group=group, has_tp=True,
                 dp_group=dp_group, mode=mode, chunks=chunks, seq_split=split_sizes,
                 dp_split=_rows(total_rows, dp_group), check=check, timeout_s=timeout_s, average=average,
                 counter=counter, pick_rows=pick_rows)
    return _ZeroLinear.apply(x_shard, w_rows, bias, z)


def zero_matmul_reduce_scatter(x: torch.Tensor, w_rows: torch.Tensor, bias: torch.Tensor | None = None, *,
                               group=None, dp_group=None, total_rows: int | None = None, mode: str = "flash",
                               chunks: int | None = None, split_sizes: list[int] | None = None, check: bool = True,
                               timeout_s: float = DEFAULT_TIMEOUT_S, average: bool = False,
                               counter: ZeroCounter | None = None, pick_rows: int | None = None) -> torch.Tensor:
    """``matmul_reduce_scatter(x, W_t) + b`` over the tp ``group`` with ``W_t [R, in_t]`` and ``b [R]`` ZeRO-3
    sharded over ``dp_group`` by output rows: ``w_rows [o_d, in_t]``, bias ``[o_d]`` (the same on every tp rank).

    x ``[S, ..., in_t]``; returns this tp rank's block ``[s_r, ..., total_rows]``.  ``split_sizes``: how ``S``
    is split over tp (omitted: equal blocks).  A dp group of one runs ``matmul_reduce_scatter`` itself.
    ``pick_rows``: as ``zero_all_gather_matmul``'s.
    """
    if resolve_group(dp_group).world_size == 1:
        w_rows, bias = _in_dtype(w_rows, bias, x.dtype)
        return matmul_reduce_scatter(x, w_rows, bias, group=group, mode=mode, chunks=chunks, split_sizes=split_sizes,
                                     check=check, timeout_s=timeout_s)
    z = _prepare("zero_matmul_reduce_scatter", "row", x, w_rows, bias, tp_group=group, has_tp=True,
                 dp_group=dp_group, mode=mode, chunks=chunks, seq_split=split_sizes,
                 dp_split=_rows(total_rows, dp_group), check=check, timeout_s=timeout_s, average=average,
                 counter=counter, pick_rows=pick_rows)
    return _ZeroLinear.apply(x, w_rows, bias, z)


def _in_dtype(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """``weight`` and ``bias`` cast to the compute ``dtype`` in autograd (themselves when they have it)."""
    return weight.to(dtype), (bias.to(dtype) if bias is not None else None)


def _rows(total_rows: int | None, dp_group) -> list[int] | None:
    return None if total_rows is None else row_sizes(total_rows, resolve_group(dp_group).world_size)


# ----------------------------------------------------------------------------------------------
# validation and the cross-rank checks


@dataclass(frozen=True)
class _Zero:
    """One call, resolved: ``kind`` (``column``: tp gather side, ``row``: tp scatter side), the dp call (row
    space: the rows of ``W_t``), the tp call (row space: sequence blocks; None without tensor parallelism)."""

    kind: str
    dp: Call
    tp: Call | None
    average: bool
    counter: ZeroCounter | None

    def count(self, direction: str, group: str, traffic: Traffic) -> None:
        if self.counter is not None:
            self.counter.add(direction, group, traffic)

    def mark(self, what: str) -> None:
        if self.counter is not None:
            self.counter.mark(what)


def _prepare(op_name, kind, x, weight, bias, *, tp_group, has_tp, dp_group, mode, chunks, seq_split, dp_split,
             check, timeout_s, average, counter, pick_rows: int | None = None) -> _Zero:
    # weight and bias are the master rows (one dtype), x the compute dtype: the rows are cast to x's dtype
    # before they travel (mixed precision); x's dtype is what the ranks compare
    tensors = {"x": x}
    gather_side = kind == "column"

    def validate() -> None:
        check_tensors(op_name, {"weight": weight, "bias": bias})
        if not isinstance(x, torch.Tensor):
            return  # prepare's check_tensors names it
        if weight.device != x.device:
            raise ValueError(f"{op_name}: x is on {x.device}, the weight rows on {weight.device}")
        if not (x.is_floating_point() and weight.is_floating_point()):
            raise TypeError(f"{op_name}: x and the weight rows must be floating point, got {x.dtype}, {weight.dtype}")
        if x.dim() < (2 if has_tp else 1) or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
            what = "[s, ..., in]" if has_tp else "[..., in]"
            raise ValueError(f"{op_name}: x must be {what} and the weight rows [out_r, in] with the same in; "
                             f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{op_name}: bias shard {tuple(bias.shape)} does not match the weight shard's "
                             f"{weight.shape[0]} rows")

    def describe_tp(info: GroupInfo) -> Local:
        validate()
        n, r = info.world_size, info.rank
        mid = tuple(x.shape[1:-1])
        if gather_side:
            check_split(op_name, seq_split, n, r, local=x.shape[0], what="sequence rows")
            local_len, total = x.shape[0], (x.shape[0] * n if seq_split is None else sum(seq_split))
        else:
            check_split(op_name, seq_split, n, r, total=x.shape[0], what="sequence length")
            total, local_len = x.shape[0], (seq_split[r] if seq_split is not None else x.shape[0] // n)
        out_total = sum(dp_split) if dp_split is not None else weight.shape[0]
        named = [("ndim", x.dim()), ("features", weight.shape[1]), ("dtype", dtype_code(x.dtype)),
                 ("bias present", int(bias is not None)), ("weight rows", weight.shape[0])]
        named += [] if gather_side else [("sequence length", x.shape[0])]
        sim = ("ag_matmul" if gather_side else "matmul_rs", total * _prod(mid), weight.shape[1], out_total)
        return Local(local_len, sim, named, mid)

    error: BaseException | None = None
    tp_call = None
    if has_tp and resolve_group(tp_group).world_size > 1:
        try:
            tp_call = prepare(op_name, tp_group, tensors, describe_tp, mode=mode, chunks=chunks, split_sizes=seq_split,
                              check=check, timeout_s=timeout_s, local_sizes=gather_side)
        except (ValueError, TypeError, RuntimeError) as err:
            error = err  # carried into the dp check, so the dp peers raise too
    elif has_tp:
        try:
            describe_tp(resolve_group(tp_group))  # local checks only (no peer)
        except (ValueError, TypeError) as err:
            error = err

    def describe_dp(info: GroupInfo) -> Local:
        if error is not None:
            raise ValueError(str(error))
        validate()
        check_split(op_name, dp_split, info.world_size, info.rank, local=weight.shape[0], what="weight rows")
        out_total = sum(dp_split) if dp_split is not None else weight.shape[0] * info.world_size
        tokens = pick_rows if pick_rows is not None else max(x.numel() // max(x.shape[-1], 1), 1)
        named = [("in features", weight.shape[1]), ("dtype", dtype_code(x.dtype)),
                 ("bias present", int(bias is not None))]
        return Local(weight.shape[0], ("sharded", tokens, weight.shape[1], out_total), named)

    try:
        dp_call = prepare(op_name, dp_group, tensors, describe_dp, mode=mode, chunks=chunks, split_sizes=dp_split,
                          check=check, timeout_s=timeout_s, local_sizes=True)
    except (ValueError, TypeError, RuntimeError):
        if error is not None:
            raise error from None
        raise
    if error is not None:
        raise error
    return _Zero(kind, dp_call, tp_call, average, counter)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


# ----------------------------------------------------------------------------------------------
# running schedules


def _run(z: _Zero, call: Call, op: str, kernels, *, direction: str, group: str, dims: dict[str, int],
         bind: dict[str, torch.Tensor | None], like: torch.Tensor, dtypes: dict[str, torch.dtype] | None = None,
         **flags) -> Buffers:
    """Build ``op``'s schedule for ``call``, its buffers (``like``'s dtype, but ``dtypes``), and run it;
    ``kernels(schedule, buffers)`` returns the gemm functions.  Counts the bytes under (``direction``, ``group``)."""
    info = call.info
    schedule = build_schedule(op, call.mode, info.world_size, info.rank, chunks=call.chunks, **flags)
    buffers = Buffers(schedule, call.rows, dims=dims, bind=bind, dtype=like.dtype, device=like.device,
                      dtypes=dtypes)
    traffic = run_schedule(schedule, buffers, kernels(schedule, buffers), info, op_name=call.op_name,
                           timeout_s=call.timeout_s)
    z.count(direction, group, traffic)
    return buffers


BlockGemm = Callable[[slice, torch.Tensor], None]  # (rows of the gathered tensor, those rows)


class _TpGather:
    """``AG_tp(local)`` (``local [s_r, F]``), gathered by the first GEMM that needs it and fused with it.

    ``use(gemm)`` runs ``gemm(rows, block)`` on the blocks of the gathered tensor: the first time as the
    inner tp all-gather schedule delivers them (local block first), afterwards once on the whole kept
    tensor.  Without tensor parallelism ``local`` is the whole tensor."""

    def __init__(self, z: _Zero, local: torch.Tensor, direction: str) -> None:
        self.z, self.local, self.direction = z, local, direction
        self.full = local if z.tp is None else None

    def use(self, gemm: BlockGemm) -> None:
        if self.full is not None:
            gemm(slice(0, self.full.shape[0]), self.full)
            return
        tp = self.z.tp
        first = [True]

        def kernels(schedule, buffers):
            def gemm_block(step: Compute) -> None:
                if first[0]:
                    self.z.mark(f"tp:{self.direction}:gemm")
                    first[0] = False
                lo, hi = tp.rows.rows(step.piece)
                gemm(slice(lo, hi), buffers.view(step.src, step.piece))

            return {"gw": gemm_block}

        # the gather half of matmul_rs_bwd: one all-gather of 'g' feeding gemm 'gw' per arriving block
        buffers = _run(self.z, tp, "matmul_rs_bwd", kernels, direction=self.direction, group="tp", dims={},
                       bind={"g": self.local}, like=self.local, grad_input=False, grad_weight=True)
        self.full = buffers.materialize("g")


def _tp_reduce_scatter(z: _Zero, partial: BlockGemm, out: torch.Tensor, *, a: torch.Tensor, direction: str) -> None:
    """``out [s_r, F] = RS_tp(P)`` where ``partial(rows, dst)`` writes rows ``rows`` of this rank's ``P`` into
    ``dst`` (the inner ``matmul_rs`` schedule: peers' blocks first, each sent when computed, the own last).
    Without tensor parallelism ``out = P``.  ``a``: the GEMM's operand (bound to the schedule's ``a``)."""
    tp = z.tp
    if tp is None:
        partial(slice(0, out.shape[0]), out)
        return
    # collectives (slice, none) reduce into dense memory; flash and ring write `out` by GEMMs and adds only
    dense = out if out.is_contiguous() or tp.mode in ("flash", "ring") else torch.empty_like(out)
    first = [True]

    def kernels(schedule, buffers):
        def gemm_p(step: Compute) -> None:
            if first[0]:
                z.mark(f"tp:{direction}:gemm")
                first[0] = False
            lo, hi = tp.rows.rows(step.piece)
            partial(slice(lo, hi), buffers.view(step.dst, step.piece))

        return {"p": gemm_p}

    _run(z, tp, "matmul_rs", kernels, direction=direction, group="tp", dims={"out": out.shape[1]},
         bind={"a": a, "y": dense}, like=out)
    if dense is not out:
        out.copy_(dense)


def _with_bias_column(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The rows that travel: ``[o_d, in]``, or ``[o_d, in + 1]`` with the bias as the last column, in the
    compute ``dtype`` (mixed precision: cast before the all-gather, so it moves bf16)."""
    if bias is None:
        return weight.to(dtype).contiguous()
    return torch.cat([weight, bias[:, None]], dim=1).to(dtype)


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b``; mixed precision: the GEMM in ``a``'s dtype (bf16), the sum in ``out``'s (fp32)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out.add_(torch.mm(a, b))


# ----------------------------------------------------------------------------------------------
# the autograd function


class _ZeroLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, z: _Zero):
        z.mark("fwd:start")
        dp_rows, n_in, out_total = z.dp.rows, weight.shape[1], z.dp.rows.total
        x2 = flat(x) if z.tp is not None else x.reshape(-1, n_in).contiguous()
        if z.kind == "column":
            out_len = z.tp.rows.total if z.tp is not None else x2.shape[0]
        else:
            out_len = z.tp.rows.block_len(z.tp.info.rank) if z.tp is not None else x2.shape[0]
        y = torch.empty(out_len, out_total, dtype=x.dtype, device=x.device)
        gathered = _TpGather(z, x2, "fwd") if z.kind == "column" else None

        def kernels(schedule, buffers):
            def gemm_y(step: Compute) -> None:  # the columns O_j of y for the arrived rows w_j
                lo, hi = dp_rows.rows(step.piece)
                w = buffers.view("w", step.piece)
                w_t, b = (w.t(), None) if bias is None else (w[:, :n_in].t(), w[:, n_in])
                y_cols = y[:, lo:hi]

                def block(rows: slice, x_block: torch.Tensor, dst: torch.Tensor | None = None) -> None:
                    dst = y_cols[rows] if dst is None else dst
                    if b is None or z.kind == "row":
                        torch.mm(x_block, w_t, out=dst)
                    else:
                        torch.addmm(b, x_block, w_t, out=dst)

                if z.kind == "column":
                    gathered.use(block)
                else:  # row: the partials of this piece, reduce-scattered over tp into y_shard[:, O_j]
                    _tp_reduce_scatter(z, lambda rows, dst: block(rows, x2[rows], dst), y_cols, a=x2,
                                       direction="fwd")
                    if b is not None:
                        y_cols.add_(b)

            return {"y": gemm_y}

        _run(z, z.dp, "sharded", kernels, direction="fwd", group="dp", dims={},
             bind={"w": _with_bias_column(weight, bias, x2.dtype)}, like=x2)
        ctx.save_for_backward(x2, weight, bias)  # this rank's (master) rows and input: nothing gathered
        ctx.z, ctx.x_shape = z, x.shape
        z.mark("fwd:end")
        if z.tp is None:
            return y.view(*x.shape[:-1], out_total)
        return y.view(out_len // z.tp.rows.row_width, *z.tp.mid_shape, out_total)

    @staticmethod
    def backward(ctx, grad_y):
        z: _Zero = ctx.z
        z.mark("bwd:start")
        dp_rows = z.dp.rows
        x2, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        n_in = weight.shape[1]
        g2 = flat(grad_y) if z.tp is not None else grad_y.reshape(-1, dp_rows.total).contiguous()
        # the rows re-gathered in the compute dtype; the gradient rows (and every buffer of their
        # reduce-scatter) in the master's dtype: the sum over dp is fp32 under mixed precision
        shard = _with_bias_column(weight, bias, g2.dtype)
        grad_shard = torch.empty(weight.shape[0], shard.shape[1], dtype=weight.dtype, device=g2.device)
        column = z.kind == "column"
        # column: gW reads AG_tp(x); row: every GEMM reads G = AG_tp(grad_y)
        gathered = _TpGather(z, x2 if column else g2, "bwd")
        # grad_x: row kind and no tp: the sum of the pieces' terms, in place; column with tp: partial sums
        # over the dp pieces, the last piece's GEMM fused with the tp reduce-scatter into grad_x_shard
        tp_scatter = column and z.tp is not None
        if tp_scatter:
            grad_x = torch.empty(z.tp.rows.block_len(z.tp.info.rank), n_in, dtype=g2.dtype, device=g2.device)
        else:
            grad_x = torch.zeros(x2.shape[0], n_in, dtype=g2.dtype, device=g2.device)
        state = {"partial": None, "left": 0}

        def kernels(schedule, buffers):
            state["left"] = sum(1 for s in schedule.computes() if s.gemm == "gx" and buffers.nonempty(s.piece))

            def gemm_gw(step: Compute) -> None:  # this rank's term of the gradient rows of a piece
                lo, hi = dp_rows.rows(step.piece)
                out = buffers.view(step.dst, step.piece)
                out.zero_()
                gw = out[:, :n_in]
                if column:
                    gathered.use(lambda rows, x_block: _add_product(gw, g2[rows, lo:hi].t(), x_block))
                    if bias is not None:
                        torch.sum(g2[:, lo:hi], dim=0, dtype=out.dtype, out=out[:, n_in])
                else:
                    def block(rows: slice, g_block: torch.Tensor) -> None:
                        _add_product(gw, g_block[:, lo:hi].t(), x2[rows])
                        if bias is not None:
                            out[:, n_in].add_(g_block[:, lo:hi].sum(0))

                    gathered.use(block)

            def gemm_gx(step: Compute) -> None:  # the arrived rows' term of grad_x
                lo, hi = dp_rows.rows(step.piece)
                w = buffers.view("w", step.piece)[:, :n_in]
                if not column:
                    gathered.use(lambda rows, g_block: grad_x[rows].addmm_(g_block[:, lo:hi], w))
                    return
                if not tp_scatter:
                    grad_x.addmm_(g2[:, lo:hi], w)
                    return
                state["left"] -= 1
                if state["left"] > 0:
                    if state["partial"] is None:
                        state["partial"] = torch.mm(g2[:, lo:hi], w)
                    else:
                        state["partial"].addmm_(g2[:, lo:hi], w)
                    return
                _scatter_grad_x(g2[:, lo:hi], w)

            return {"gw": gemm_gw, "gx": gemm_gx}

        def _scatter_grad_x(gy_cols: torch.Tensor | None, w: torch.Tensor | None) -> None:
            partial = state["partial"]

            def block(rows: slice, dst: torch.Tensor) -> None:
                if gy_cols is None:
                    dst.copy_(partial[rows]) if partial is not None else dst.zero_()
                elif partial is None:
                    torch.mm(gy_cols[rows], w, out=dst)
                else:
                    torch.addmm(partial[rows], gy_cols[rows], w, out=dst)

            _tp_reduce_scatter(z, block, grad_x, a=g2, direction="bwd")
            state["left"] = -1  # done

        _run(z, z.dp, "sharded_bwd", kernels, direction="bwd", group="dp", dims={"in": shard.shape[1]},
             bind={"w": shard, "gw": grad_shard}, like=grad_shard, dtypes={"w": shard.dtype}, grad_input=need_x,
             grad_weight=need_w or need_b)
        if need_x and tp_scatter and state["left"] >= 0:  # no rows of W_t anywhere: the tp scatter still runs
            _scatter_grad_x(None, None)
        if (need_w or need_b) and z.average:
            grad_shard.div_(z.dp.info.world_size)  # the data-parallel average (torch FSDP / DDP convention)
        z.mark("bwd:end")
        return (
            grad_x.view(ctx.x_shape) if need_x else None,
            grad_shard[:, :n_in] if need_w else None,
            grad_shard[:, n_in] if need_b else None,
            None,
        )
