"""A unit of row-sharded parameters, gathered whole with one all-gather and its gradients returned with one
reduce-scatter (the transfers of ZeRO-3 by prefetch, ``flashpar.overlap.prefetch``).

A unit holds ``M`` members.  Member ``m`` is a tensor ``W_m [R_m, *trail_m]`` (``w_m`` elements per row) split
by rows over the ``n`` ranks of a group with the one rule of ``flashpar.rows``: rank ``p`` keeps rows
``shard_rows(R_m, n, p)``, its parameter.  Each rank packs its rows of every member into one chunk of
``C`` elements (``C`` = the largest rank's packed length, the same on every rank), so one all-gather of equal
chunks brings every member whole::

    chunk of rank p:   | W_0[rows_p] | W_1[rows_p] | ... | pad |          (compute dtype)
    all-gather:        | chunk 0 | chunk 1 | ... | chunk n-1 |            n C elements
    copy-out:          whole W_m = cat_p chunk_p[member m]  ->  one flat buffer, every member a view of it

The flat buffer holds the members one after another (``offsets``); a member may present its rows in another
order, ``W_m[regroup_m]`` (a row index, rows may repeat: the Ulysses q/k/v weight regrouped by head group).
Its gradient comes back as ``index_add`` over ``regroup_m`` (the sum over the repeats) before it travels.

The gradients travel the other way in the master rows' dtype (fp32 under mixed precision): every member's
gradient is cut by the same rows, rank ``p``'s section packed like its chunk, and one reduce-scatter of
``n C`` elements leaves each rank the sum of its own rows over the group::

    send:   | rows_0 of every member | rows_1 of every member | ... |      n C elements (fp32)
    recv:   | this rank's rows of every member, summed over the group |  C elements -> each parameter's .grad

Bytes per rank and direction: ``(n - 1) C`` elements, the ring all-gather / reduce-scatter's.  ``collective``
says how they travel: ``ring`` (the backend's all-gather and reduce-scatter, ``n - 1`` steps) or ``doubling``
(``flashpar.overlap.doubling``: the same bytes in ``ceil(log2 n)`` point-to-point steps, the chunks in rotated
order: rank ``r``'s buffers hold rank ``p``'s chunk at position ``(p - r) mod n``, which the packing and the
copy-out read directly, no extra copy).  Pure tensor code plus two posted transfers; which group and when is
the caller's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from flashpar.dist import DEFAULT_TIMEOUT_S, all_gather_single, reduce_scatter_single
from flashpar.overlap import doubling
from flashpar.rows import row_sizes, shard_rows

COLLECTIVES = ("ring", "doubling")


@dataclass
class Member:
    """One parameter of a unit: ``param`` holds this rank's rows ``shard_rows(total, n, rank)`` of a tensor of
    ``total`` rows; ``regroup`` (optional, a 1-D long tensor) presents the whole tensor as ``whole[regroup]``."""

    param: nn.Parameter
    total: int
    regroup: torch.Tensor | None = None

    @property
    def presented_rows(self) -> int:
        return self.total if self.regroup is None else int(self.regroup.numel())


class ShardedUnit:
    """``members`` split over a group of ``n`` ranks (this one ``rank``), gathered in ``dtype``, moved by
    ``collective`` (``COLLECTIVES``: the module docstring)."""

    def __init__(self, name: str, members: list[Member], n: int, rank: int, dtype: torch.dtype,
                 collective: str = "ring") -> None:
        if not members:
            raise ValueError(f"sharded unit {name!r}: no members")
        if collective not in COLLECTIVES:
            raise ValueError(f"sharded unit {name!r}: collective must be one of {COLLECTIVES}, got {collective!r}")
        self.name, self.members, self.n, self.rank, self.dtype = name, members, n, rank, dtype
        self.collective = collective
        self.first = rank if collective == "doubling" else 0  # the rank whose chunk sits at position 0
        for m in members:
            lo, hi = shard_rows(m.total, n, rank)
            if m.param.shape[0] != hi - lo:
                raise ValueError(f"sharded unit {name!r}: a member holds {m.param.shape[0]} rows, rank {rank} of {n} "
                                 f"should hold {hi - lo} of {m.total}")
        self.sizes = [row_sizes(m.total, n) for m in members]  # rows of every rank, per member
        self.trails = [tuple(m.param.shape[1:]) for m in members]
        self.widths = [math.prod(t) for t in self.trails]
        packed = [sum(s[p] * w for s, w in zip(self.sizes, self.widths, strict=True)) for p in range(n)]
        self.chunk = max(packed)  # elements per rank's chunk, padded to the largest
        self.offsets = []  # where each member's rows of rank p start in p's chunk: offsets[m][p]
        for m in range(len(members)):
            self.offsets.append([sum(self.sizes[j][p] * self.widths[j] for j in range(m)) for p in range(n)])
        self.shapes = [(m.presented_rows, *t) for m, t in zip(members, self.trails, strict=True)]
        self.reduce_dtype = members[0].param.dtype  # the master rows' dtype: gradients are summed in it
        if any(m.param.dtype != self.reduce_dtype for m in members):
            raise ValueError(f"sharded unit {name!r}: members of different dtypes")
        self.flat_sizes = [math.prod(s) for s in self.shapes]
        self._regroups: dict[tuple[int, str], torch.Tensor] = {}

    def _regroup(self, m: int, device: torch.device) -> torch.Tensor:
        """Member ``m``'s row index on ``device``, copied there once (not in every step)."""
        key = (m, str(device))
        if key not in self._regroups:
            self._regroups[key] = self.members[m].regroup.to(device)
        return self._regroups[key]

    @property
    def params(self) -> list[nn.Parameter]:
        return [m.param for m in self.members]

    def whole_elements(self) -> int:
        """Elements of the gathered buffer (every member whole, as presented)."""
        return sum(self.flat_sizes)

    # ---- gather ----------------------------------------------------------------------------------------

    def position(self, p: int) -> int:
        """Where rank ``p``'s chunk sits in the gathered buffer and rank ``p``'s section in the gradients'."""
        return (p - self.first) % self.n

    def post_gather(self, group, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[object, torch.Tensor, torch.Tensor]:
        """Post the all-gather of this rank's rows (cast to ``dtype``): ``(work, send, recv)``; ``assemble(recv)``
        once the work is complete.  No autograd."""
        device = self.members[0].param.device
        with torch.no_grad():
            recv = torch.empty(self.n * self.chunk, dtype=self.dtype, device=device)
            # doubling: this rank's chunk is position 0 of the gathered buffer, packed there in place
            send = recv[: self.chunk] if self.collective == "doubling" else torch.empty(self.chunk, dtype=self.dtype,
                                                                                          device=device)
            at = 0
            for m in self.members:
                k = m.param.numel()
                send[at : at + k].copy_(m.param.detach().reshape(-1))
                at += k
            if at < self.chunk:
                send[at:].zero_()
        if self.collective == "doubling":
            return doubling.post_all_gather(recv, self.chunk, group, timeout_s=timeout_s), send, recv
        return all_gather_single(recv, send, group=group, async_op=True), send, recv

    def assemble(self, recv: torch.Tensor) -> torch.Tensor:
        """The whole members from the gathered chunks: one flat buffer (``views_of`` it: a view per member)."""
        with torch.no_grad():
            flat = torch.empty(self.whole_elements(), dtype=recv.dtype, device=recv.device)
            chunks = recv.view(self.n, self.chunk)
            for m, (member, view) in enumerate(zip(self.members, self.views_of(flat), strict=True)):
                w = self.widths[m]
                parts = [chunks[self.position(p), self.offsets[m][p] : self.offsets[m][p] + self.sizes[m][p] * w]
                         for p in range(self.n)]
                if member.regroup is None:
                    torch.cat(parts, out=view.view(-1))
                else:
                    whole = torch.cat(parts).view(member.total, w)
                    torch.index_select(whole, 0, self._regroup(m, whole.device), out=view.view(-1, w))
        return flat

    def gather_local(self) -> torch.Tensor:
        """The whole members without a group (``n == 1``): this rank's rows are all of them."""
        recv = torch.cat([m.param.detach().reshape(-1).to(self.dtype) for m in self.members])
        if recv.numel() < self.chunk:
            recv = torch.cat([recv, recv.new_zeros(self.chunk - recv.numel())])
        return self.assemble(recv)

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The members' views of a gathered ``flat`` buffer."""
        out, at = [], 0
        for m in range(len(self.members)):
            out.append(flat[at : at + self.flat_sizes[m]].view(self.shapes[m]))
            at += self.flat_sizes[m]
        return out

    # ---- reduce-scatter --------------------------------------------------------------------------------

    def pack_grads(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """The reduce-scatter's input ``[n C]`` (the master dtype) from the members' whole gradients (presented shapes;
        ``None``: zeros): rank ``p``'s section holds rows ``shard_rows`` of every member."""
        device = self.members[0].param.device
        send = torch.zeros(self.n * self.chunk, dtype=self.reduce_dtype, device=device)
        chunks = send.view(self.n, self.chunk)
        for m, (member, g) in enumerate(zip(self.members, grads, strict=True)):
            if g is None:
                continue
            w = self.widths[m]
            g = g.reshape(-1, w)
            if member.regroup is None:
                whole = g.to(self.reduce_dtype)
            else:
                whole = torch.zeros(member.total, w, dtype=self.reduce_dtype, device=device)
                whole.index_add_(0, self._regroup(m, device), g.to(self.reduce_dtype))
            lo = 0
            for p in range(self.n):
                k = self.sizes[m][p]
                if k:
                    o = self.offsets[m][p]
                    chunks[self.position(p), o : o + k * w].copy_(whole[lo : lo + k].reshape(-1))
                lo += k
        return send

    def post_scatter(self, grads: list[torch.Tensor | None], group,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[object, torch.Tensor, torch.Tensor]:
        """Post the reduce-scatter of the members' gradients: ``(work, send, recv)``; ``land(recv)`` once complete."""
        send = self.pack_grads(grads)
        recv = torch.empty(self.chunk, dtype=self.reduce_dtype, device=send.device)
        if self.collective == "doubling":
            return doubling.post_reduce_scatter(send, recv, group, timeout_s=timeout_s), send, recv
        work = reduce_scatter_single(recv, send, group=group, async_op=True)
        return work, send, recv

    def land(self, recv: torch.Tensor, scale: float = 1.0) -> None:
        """Add this rank's summed rows (``recv``, times ``scale``) to each member parameter's ``.grad``."""
        with torch.no_grad():
            for m, member in enumerate(self.members):
                p = member.param
                o = self.offsets[m][self.rank]
                g = recv[o : o + p.numel()].view(p.shape)
                if scale != 1.0:
                    g = g * scale
                if p.grad is None:
                    p.grad = g  # a view of recv, which nothing else reuses
                else:
                    p.grad.add_(g)
