"""``flashpar.cp.attention``: exact causal document-masked attention over a context-parallel group.

Each rank holds the tokens ``plan.local_indices(rank)`` (THD layout: q ``[T, H, D]``, k and v
``[T, H_kv, D]``) and gets the rows of

    out = softmax(scale q k^T + document causal mask) v

that full attention over the whole packed sequence gives its tokens.

Forward (local first): the K/V transfers of the plan's pattern are posted on a lane; the tasks on
the rank's own K/V (Whole-Doc documents, its own chunks) run while they are in flight; then, step by
step, the tasks on each peer's K/V as it arrives.  Partial results are merged by the log-sum-exp
rule (``kernels.merge``).  Backward, reversed: the tasks on each peer's K/V first, each peer's
dK/dV sent back as soon as it is complete, the local tasks last, covering the tail; gradients
received for the local K/V are added where they belong.
"""

from __future__ import annotations

import functools
import math
import zlib

import torch

from flashpar.cp import kernels
from flashpar.cp.cp_plan import CPPlan
from flashpar.cp.exchange import CommCounter, Transfers
from flashpar.cp.layout import RankLayout, rank_layout
from flashpar.dist import DEFAULT_TIMEOUT_S, GroupInfo, dtype_code, exchange_metadata, p2p_group, resolve_group
from flashpar.overlap.executor import _ONLY
from flashpar.overlap.lane import Lane

OP = "cp.attention"


@functools.lru_cache(maxsize=64)
def plan_digest(plan: CPPlan) -> int:
    """A 31-bit checksum of what the ranks must agree on (sizes, strategy, placement)."""
    text = repr((plan.cp_size, plan.doc_lens, plan.strategy, plan.comm, plan.segments))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class _Run:
    """Everything one call needs besides the tensors."""

    def __init__(self, layout: RankLayout, info: GroupInfo, scale: float, backend: str, timeout_s: float,
                 counter: CommCounter | None, device: torch.device) -> None:
        self.layout, self.info, self.scale, self.backend = layout, info, scale, backend
        self.timeout_s, self.counter, self.device = timeout_s, counter, device
        self.phases = [[b.to(device) for b in phase] for phase in layout.phases]

    def parts(self) -> tuple[bool, bool]:
        """(run the transfers, run the kernels): both, except inside ``flashpar.overlap.executor.only``
        (benchmarks: compute-only or communication-only baselines; results are meaningless there)."""
        part = _ONLY.get()
        return self.layout.n > 1 and part != "compute", part != "comm"

    def lane(self, what: str) -> Lane:
        return Lane(f"{OP} {what}", self.info.rank, timeout_s=self.timeout_s, threaded=self.device.type == "cpu")


def _add_rows(dst: torch.Tensor, rows, src: torch.Tensor) -> None:
    if isinstance(rows, slice):
        dst[rows] += src.to(dst.dtype)
    else:
        dst.index_add_(0, rows, src.to(dst.dtype))


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run: _Run):
        lo = run.layout
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:2], -math.inf, dtype=acc, device=q.device)
        lane = run.lane("forward")
        transfers = Transfers(lo, run.info, lane, run.counter)
        comm, compute = run.parts()
        try:
            recv = transfers.start_forward(k, v) if comm else transfers.buffers(k, v)
            bufs = {-1: (k, v), **recv}
            for j, phase in enumerate(run.phases):
                if j > 0 and comm:
                    lane.wait(j)
                for batch in phase if compute else ():
                    rows, o, m = kernels.batch_forward(batch, q, *bufs[batch.buf], run.scale, run.backend)
                    kernels.merge(out, lse, rows, o, m)
            lane.close()
        except BaseException:
            lane.abort()
            raise
        out = out.to(q.dtype)
        ctx.run, ctx.recv = run, recv
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        run, lo = ctx.run, ctx.run.layout
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        acc = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        bufs = {-1: (k, v), **ctx.recv}
        lane = run.lane("backward")
        transfers = Transfers(lo, run.info, lane, run.counter)
        comm, compute = run.parts()

        def phase_grads(j: int, gk: torch.Tensor, gv: torch.Tensor) -> None:
            for batch in run.phases[j] if compute else ():
                kb, vb = bufs[batch.buf]
                a, b, c = kernels.batch_backward(batch, q, kb, vb, dout, out, lse, run.scale, run.backend)
                _add_rows(dq, batch.rows, a)
                _add_rows(gk, batch.keys, b)  # padded batches may repeat keys: index_add_ sums them
                _add_rows(gv, batch.keys, c)

        try:
            received = {}
            for j in range(1, lo.n):  # remote K/V first: its gradient travels while the rest computes
                origin = lo.origin(j)
                kb, _ = bufs[origin]
                gk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
                gv = torch.zeros(kb.shape[:1] + v.shape[1:], dtype=acc, device=kb.device)
                phase_grads(j, gk, gv)
                if not comm:
                    continue
                if lo.pattern == "ring" and j > 1:  # add the running sum for this block from rank r - 1
                    lane.wait(j - 1)
                    rk, rv = received.pop(j - 1)
                    gk += rk
                    gv += rv
                received[j] = transfers.send_grad(j, gk.to(k.dtype), gv.to(v.dtype))
            phase_grads(0, dk, dv)  # the local tasks cover the tail
            for j, (rk, rv) in received.items():
                lane.wait(j)
                rows = None if lo.pattern == "ring" else transfers.grad_rows(j)
                _add_rows(dk, slice(None) if rows is None else rows, rk)
                _add_rows(dv, slice(None) if rows is None else rows, rv)
            lane.close()
        except BaseException:
            lane.abort()
            raise
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, *, group=None,
              softmax_scale: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None,
              counter: CommCounter | None = None, check: bool = True) -> torch.Tensor:
    """Causal document-masked attention of this rank's tokens (see the module docstring).

    ``group``: the context-parallel group (None: the default group; a ProcessGroup or a 1-D
    DeviceMesh); its size must be ``plan.cp_size``.  ``backend``: ``"flash"`` (torch's CPU flash
    attention, padded batches; the default on CPU), ``"math"`` (explicit per-batch matrices; the
    default elsewhere) or ``"varlen"`` (FlashAttention-2's variable-length kernel on CUDA, fp16 /
    bf16; not yet run on a GPU, hence not the default there; on CPU it runs per task, for tests).  ``counter``: a
    ``CommCounter`` that accumulates the bytes sent and received.  ``check``: validate shapes and
    cross-rank agreement (one small all-gather); every rank raises the same error on bad input.
    """
    info = resolve_group(group)
    error = _local_error(q, k, v, plan, info, backend)
    if check:
        _agree(q, k, plan, info, error, timeout_s)
    elif error is not None:
        raise error
    backend = backend or kernels.default_backend(q.device)
    layout = rank_layout(plan, info.rank, backend == "varlen")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    run = _Run(layout, info, scale, backend, timeout_s, counter, q.device)
    if info.world_size > 1:
        p2p_group(info, 0, 1, op_name=OP, timeout_s=timeout_s)  # every rank creates the twin group now
    return _CPAttention.apply(q, k, v, run)


def _local_error(q, k, v, plan, info: GroupInfo, backend) -> ValueError | None:
    if not isinstance(plan, CPPlan):
        return ValueError(f"{OP}: plan must be a flashpar.cp.CPPlan, got {type(plan).__name__}")
    if plan.cp_size != info.world_size:
        return ValueError(f"{OP}: the plan is for cp_size {plan.cp_size} but the group has {info.world_size} ranks")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return ValueError(f"{OP}: q, k, v must be [tokens, heads, head_dim] (THD); got shapes "
                          f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        return ValueError(f"{OP}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return ValueError(f"{OP}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head_dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return ValueError(f"{OP}: query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    held = sum(b - a for a, b in plan.segments[info.rank])
    if q.shape[0] != held:
        return ValueError(f"{OP}: rank {info.rank} has {q.shape[0]} tokens but the plan gives it {held} "
                          "(shard the sequence with flashpar.cp.shard(x, plan, rank))")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        return ValueError(f"{OP}: q, k, v must share dtype and device; got {q.dtype}/{k.dtype}/{v.dtype} on "
                          f"{q.device}/{k.device}/{v.device}")
    if backend is not None and backend not in kernels.BACKENDS:
        return ValueError(f"{OP}: unknown backend {backend!r}; expected one of {sorted(kernels.BACKENDS)}")
    return None


def _agree(q, k, plan, info: GroupInfo, error, timeout_s: float) -> None:
    """Every rank raises if any rank's input is bad or the ranks disagree on shapes, dtype or plan."""
    shape = [q.shape[1], k.shape[1], q.shape[2]] if q.dim() == 3 and k.dim() == 3 else [-1, -1, -1]
    digest = plan_digest(plan) if isinstance(plan, CPPlan) else -1
    gloo = info.world_size == 1 or torch.distributed.get_backend(info.group) == "gloo"
    device = torch.device("cpu") if gloo else q.device
    table = exchange_metadata(info, [*shape, dtype_code(q.dtype), digest], device=device, op_name=OP,
                              local_error=error, timeout_s=timeout_s)
    names = ["query heads", "kv heads", "head_dim", "dtype", "plan"]
    for i, name in enumerate(names):
        col = table[:, i].tolist()
        if len(set(col)) > 1:
            raise ValueError(f"{OP}: ranks disagree on {name}: {col}"
                             + (" (every rank must pass the same CPPlan)" if name == "plan" else ""))
