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

The exchange is a schedule (``exchange.kv_schedule``) run by the overlap executor; the attention
tasks of each phase are its compute items.  What is in flight while each piece computes
(N = 3, p2p / allgather; ``KV_o`` the K/V of block o, ``dKV_o`` its gradient)::

    forward   lane:  | KV_r -> r+1, KV_{r-1} <- r-1 | KV_r -> r+2, KV_{r-2} <- r-2 |
              main:  | tasks on KV_r (local)        | tasks on KV_{r-1}           | tasks on KV_{r-2} | merge
    backward  lane:              | dKV_{r-1} -> r-1, <- r+1 | dKV_{r-2} -> r-2, <- r+2 |
              main:  | dKV_{r-1} | dKV_{r-2}                | dKV_r (local)            | + received rows

(ring: the same order, every transfer to r+1 / from r-1; see ``exchange``.)

With ``window=W`` (sliding-window attention: a query at position ``p`` of its document attends the keys
``[max(doc start, p - W + 1), p]``, transformers' ``sliding_window``; :mod:`flashpar.cp.window`) the exchange is
point-to-point whatever the plan's strategy, and each rank receives only the keys its queries' windows reach; the
kernels run the band's slice of keys per query chunk.  A model's windowed and full layers share one plan: their
layouts and exchanges are built once each, per (plan, W).
"""

from __future__ import annotations

import functools
import math
import zlib

import torch

from flashpar.cp import kernels
from flashpar.cp.cp_plan import CPPlan
from flashpar.cp.exchange import CommCounter, KVBuffers, add_rows, kv_schedule
from flashpar.cp.layout import DeviceLayout, device_layout
from flashpar.cp.window import check_window
from flashpar.dist import DEFAULT_TIMEOUT_S, GroupInfo, dtype_code, exchange_metadata, p2p_group, resolve_group
from flashpar.overlap.executor import run_schedule
from flashpar.overlap.schedule import Compute

OP = "cp.attention"


@functools.lru_cache(maxsize=64)
def plan_digest(plan: CPPlan) -> int:
    """A 31-bit checksum of what the ranks must agree on (sizes, strategy, placement)."""
    text = repr((plan.cp_size, plan.doc_lens, plan.strategy, plan.comm, plan.segments))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class _Run:
    """Everything one call needs besides the tensors (``placed``: the rank's layout with its index tensors
    on the activations' device, shared by every call on the same plan)."""

    def __init__(self, placed: DeviceLayout, info: GroupInfo, scale: float, backend: str, timeout_s: float,
                 counter: CommCounter | None) -> None:
        self.layout, self.info, self.scale, self.backend = placed.layout, info, scale, backend
        self.timeout_s, self.counter = timeout_s, counter
        self.phases, self.send_rows = placed.phases, placed.send_rows

    def phase(self, step: Compute) -> list:
        """The batches of the compute item on block ``step.piece.block``: phase ``(r - o) mod N``."""
        return self.phases[(self.layout.rank - step.piece.block) % self.layout.n]

    def run(self, direction: str, buffers: KVBuffers, kernel: dict) -> None:
        """Run the exchange of ``direction`` with the attention ``kernel`` as its compute items."""
        traffic = run_schedule(kv_schedule(self.layout, direction), buffers, kernel, self.info,
                               op_name=f"{OP} {direction}", timeout_s=self.timeout_s)
        if self.counter is not None:
            self.counter.add("fwd" if direction == "forward" else "bwd", traffic)


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run: _Run):
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:2], -math.inf, dtype=acc, device=q.device)
        buffers = KVBuffers(run.layout, k, v, send_rows=run.send_rows)

        def attn(step: Compute) -> None:
            for batch in run.phase(step):
                rows, o, m = kernels.batch_forward(batch, q, *buffers.blocks[batch.buf], run.scale, run.backend)
                kernels.merge(out, lse, rows, o, m)

        run.run("forward", buffers, {"attn": attn})
        out = out.to(q.dtype)
        ctx.run, ctx.recv = run, {b: kv for b, kv in buffers.blocks.items() if b != -1}
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
        grads = {-1: (dk, dv)}
        for o, (kb, vb) in ctx.recv.items():
            grads[o] = (torch.zeros(kb.shape, dtype=acc, device=kb.device),
                        torch.zeros(vb.shape, dtype=acc, device=vb.device))
        buffers = KVBuffers(lo, k, v, received=ctx.recv, grads=grads, send_rows=run.send_rows)

        def attn_bwd(step: Compute) -> None:
            gk, gv = grads[buffers.key(step.piece.block)]
            for batch in run.phase(step):
                kb, vb = buffers.blocks[batch.buf]
                a, b, c = kernels.batch_backward(batch, q, kb, vb, dout, out, lse, run.scale, run.backend)
                add_rows(dq, batch.rows, a)
                add_rows(gk, batch.keys, b)  # padded batches may repeat keys: index_add_ sums them
                add_rows(gv, batch.keys, c)

        run.run("backward", buffers, {"attn_bwd": attn_bwd})
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, *, group=None,
              softmax_scale: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None,
              counter: CommCounter | None = None, check: bool = True, rows: tuple[int, ...] | None = None,
              window: int | None = None) -> torch.Tensor:
    """Causal document-masked attention of this rank's tokens (see the module docstring).

    ``group``: the context-parallel group (None: the default group; a ProcessGroup or a 1-D
    DeviceMesh); its size must be ``plan.cp_size``.  ``backend``: ``"flash"`` (an SDPA-class kernel per
    padded batch: torch's CPU flash attention on CPU, its fused FlashAttention-2 / memory-efficient kernels
    on CUDA; the default on both), ``"math"`` (explicit per-batch matrices; the default on other devices
    and for float64 on CUDA) or ``"varlen"`` (FlashAttention-2's variable-length kernel on CUDA, fp16 /
    bf16; on CPU it runs per task, for tests).  ``counter``: a
    ``CommCounter`` that accumulates the bytes sent and received.  ``check``: validate shapes and
    cross-rank agreement (one small all-gather); every rank raises the same error on bad input.  With
    ``check=False`` (a caller that checked its step once, as ``ParallelLlama`` does) a call communicates
    only its K/V exchange and reads nothing back to the host; the plan's layout, schedules and index
    tensors on the device are built by the first call on a plan and reused by the later ones.  ``rows``: only
    these local query rows (a tuple of distinct row indices, each rank its own) are computed, the other rows of
    the output are zero (a caller that reads a few rows: prefill's last layer, its prompts' last tokens); the K/V
    exchange is the plan's either way.  ``window``: sliding-window attention of ``W`` keys (a positive int; the
    query at position ``p`` of its document attends ``[max(0, p - W + 1), p]`` of it, as transformers' and
    Mistral's ``sliding_window``), exact forward and backward for any plan, receiving only the windows' keys
    (module docstring); None: full causal.  On CUDA the band runs through the fused kernels with the band as an
    additive mask over each chunk's slice of keys (``varlen``: its band tasks run so too); only CPU is tested here.
    """
    info = resolve_group(group)
    error = _local_error(q, k, v, plan, info, backend) or _rows_error(rows, q) or _window_error(window)
    if check:
        _agree(q, k, plan, info, error, timeout_s, window)
    elif error is not None:
        raise error
    backend = backend or kernels.default_backend(q.device, q.dtype, q.shape[-1])
    placed = device_layout(plan, info.rank, backend == "varlen", q.device, rows, window)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    run = _Run(placed, info, scale, backend, timeout_s, counter)
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


def _rows_error(rows, q) -> ValueError | None:
    if rows is None:
        return None
    t = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else 0
    if (not isinstance(rows, tuple) or any(not isinstance(j, int) or isinstance(j, bool) for j in rows)
            or len(set(rows)) != len(rows) or any(not 0 <= j < t for j in rows)):
        got = repr(rows)
        return ValueError(f"{OP}: rows must be a tuple of distinct local row indices in [0, {t}), got "
                          + (got if len(got) <= 80 else got[:77] + "..."))
    return None


def _window_error(window) -> ValueError | None:
    why = check_window(window)
    return None if why is None else ValueError(f"{OP}: {why}")


def _agree(q, k, plan, info: GroupInfo, error, timeout_s: float, window=None) -> None:
    """Every rank raises if any rank's input is bad or the ranks disagree on shapes, dtype, plan or window."""
    shape = [q.shape[1], k.shape[1], q.shape[2]] if q.dim() == 3 and k.dim() == 3 else [-1, -1, -1]
    digest = plan_digest(plan) if isinstance(plan, CPPlan) else -1
    gloo = info.world_size == 1 or torch.distributed.get_backend(info.group) == "gloo"
    device = torch.device("cpu") if gloo else q.device
    width = 0 if window is None or check_window(window) else min(window, 1 << 62)  # (int64; 0: full causal)
    table = exchange_metadata(info, [*shape, dtype_code(q.dtype), digest, width], device=device, op_name=OP,
                              local_error=error, timeout_s=timeout_s)
    names = ["query heads", "kv heads", "head_dim", "dtype", "plan", "window (0: none)"]
    for i, name in enumerate(names):
        col = table[:, i].tolist()
        if len(set(col)) > 1:
            raise ValueError(f"{OP}: ranks disagree on {name}: {col}"
                             + (" (every rank must pass the same CPPlan)" if name == "plan" else ""))
