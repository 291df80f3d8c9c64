"""K/V transfers of context-parallel attention on a communication lane, forward and backward.

Forward, step ``j`` (1 .. N-1): rank ``r`` receives the K/V originating at rank ``r - j`` (see
``layout``).  Backward returns the K/V gradients to their origins and accumulates them there:

* ``p2p`` / ``allgather``: step ``j`` sends the gradient of the K/V from ``r - j`` back to it and
  receives from ``r + j`` the gradient of what ``r`` sent there (a reduce-scatter as transfers).
* ``ring``: a ring reduce-scatter.  At step ``s`` rank ``r`` sends to ``r + 1`` the running sum for
  the block of rank ``r - s`` (its own share plus the sum received at step ``s - 1``); after
  ``N - 1`` steps every block's sum arrives at its owner.

Steps run one after another on a ``Lane`` (a worker thread on gloo, posting the next step when the
previous one has completed, as a CUDA stream orders NCCL calls), so the main thread computes
while K/V is in flight and each peer's data is usable as soon as its step completes.  Payloads are
counted in ``CommCounter`` (bytes handed to sends: K and V together, or their gradients).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashpar.cp.layout import RankLayout
from flashpar.dist import GroupInfo, p2p_group
from flashpar.overlap.executor import _post_p2p
from flashpar.overlap.lane import Lane

TAG_K, TAG_V = 21, 22


@dataclass
class CommCounter:
    """Bytes this rank handed to sends, per direction (accumulates over calls)."""

    fwd_sent: int = 0
    bwd_sent: int = 0
    fwd_recv: int = 0
    bwd_recv: int = 0


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows.to(x.device))


class Transfers:
    """One call's transfers (forward or backward) on a lane of its own."""

    def __init__(self, layout: RankLayout, info: GroupInfo, lane: Lane, counter: CommCounter | None) -> None:
        self.layout, self.info, self.lane, self.counter = layout, info, lane, counter

    def _ops(self, send_to: int, sends: tuple, recv_from: int, recvs: tuple) -> list:
        info, ops = self.info, []
        for kind, peer, tensors in ((dist.isend, send_to, sends), (dist.irecv, recv_from, recvs)):
            if tensors and tensors[0].numel():
                src, dst = (info.rank, peer) if kind is dist.isend else (peer, info.rank)
                group = p2p_group(info, src, dst, op_name=self.lane.op_name, timeout_s=self.lane.timeout_s)
                for tag, t in zip((TAG_K, TAG_V), tensors, strict=True):
                    ops.append(dist.P2POp(kind, t, info.global_rank(peer), group, tag=tag))
        return ops

    def _submit(self, step: int, send_to: int, make_sends, recv_from: int, recvs: tuple, what: str) -> None:
        """``make_sends()`` runs when the step is posted (on the lane's thread)."""
        def post():
            return _post_p2p(self._ops(send_to, make_sends(), recv_from, recvs))
        self.lane.submit(step, post, f"{what} step {step}: send to rank {send_to}, recv from rank {recv_from}")

    # ------------------------------------------------------------------------------------------
    # forward

    def buffers(self, k: torch.Tensor, v: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed receive buffers by origin rank."""
        lo = self.layout
        return {lo.origin(j): tuple(x.new_zeros((lo.recv_tokens(lo.origin(j)), *x.shape[1:])) for x in (k, v))
                for j in range(1, lo.n)}

    def start_forward(self, k: torch.Tensor, v: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Post every step; returns the receive buffers by origin rank (filled when their step completes)."""
        lo, n = self.layout, self.layout.n
        bufs = self.buffers(k, v)
        sent = 0
        for j in range(1, n):
            send_to, recv_from = lo.step_peers(j)
            origin = lo.origin(j)
            if lo.pattern == "ring":
                held = (k, v) if j == 1 else bufs[lo.origin(j - 1)]  # forwarded as it arrived
                make = functools.partial(tuple, held)
                sent += _nbytes(*held)
            else:
                make = functools.partial(lambda rows: (_take(k, rows), _take(v, rows)), lo.send_rows[send_to])
                sent += lo.send_tokens(send_to) * 2 * math.prod(k.shape[1:]) * k.element_size()
            self._submit(j, send_to, make, recv_from, bufs[origin], "K/V")
        if self.counter is not None:
            self.counter.fwd_sent += sent
            self.counter.fwd_recv += sum(_nbytes(*b) for b in bufs.values())
        return bufs

    # ------------------------------------------------------------------------------------------
    # backward

    def send_grad(self, step: int, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Post backward step ``step`` with the gradient (``dk``, ``dv``) of the K/V from ``r - step``
        (ring: the running sum for that block); returns the buffers this step receives into."""
        lo, n, r = self.layout, self.layout.n, self.layout.rank
        if lo.pattern == "ring":
            send_to, recv_from = (r + 1) % n, (r - 1) % n
            rows = lo.recv_tokens((r - step - 1) % n) if step < n - 1 else lo.tokens
        else:
            send_to, recv_from = lo.origin(step), (r + step) % n
            rows = lo.send_tokens(recv_from)
        recv = (dk.new_empty((rows, *dk.shape[1:])), dv.new_empty((rows, *dv.shape[1:])))
        self._submit(step, send_to, lambda: (dk, dv), recv_from, recv, "dK/dV")
        if self.counter is not None:
            self.counter.bwd_sent += _nbytes(dk, dv)
            self.counter.bwd_recv += _nbytes(*recv)
        return recv

    def grad_rows(self, step: int) -> torch.Tensor | None:
        """Local rows the gradient received at backward ``step`` belongs to (p2p / allgather)."""
        return self.layout.send_rows[(self.layout.rank + step) % self.layout.n]
