"""ZeRO-3 by prefetch: units of row-sharded parameters gathered ahead of their use on a gather lane, their
GEMMs undivided, their gradients reduce-scattered on a second lane as each unit's backward ends.

A model is a sequence of units ``u_0 .. u_{U-1}`` used in that order in forward and in reverse in backward (the
trainer's: embedding, blocks, head).  Each unit (``flashpar.overlap.unit.ShardedUnit``) keeps on every rank of
the shard group only its rows; ``depth = K`` units are in flight ahead of the one computing::

    forward    gather lane:  | u_1 | u_2 ...........| u_3 ...........| u_4 ...
               main:   | u_0 (waits) | u_1 computes | u_2 computes   | u_3 ...         (enter k: wait u_k,
                                                                                          post u_{k+1..k+K})
    backward   gather lane:  | u_{k-1} again | u_{k-2} again | ...
               main:         | u_k's backward | u_{k-1}'s backward | ...                (u_k's backward starts:
               scatter lane:                  | RS(grads of u_k) | RS(grads of u_{k-1}) | ...   wait u_k, post
                                                                                          u_{k-1..k-K})

* The gathered whole tensors live from ``enter`` to ``exit`` of their unit: the GEMMs of the unit save them
  for backward, and a saved-tensor hook (``saving``) keeps only a token (unit, offset, size, stride) in their
  place, so the buffer is freed when the forward leaves the unit.  In backward the token unpacks into the
  unit's gathered-again buffer, which ``u_k``'s backward start (``exit``'s autograd node, the first node of the
  unit's backward) waits for.  With activation checkpointing the hook is off (the checkpoint keeps nothing)
  and the recomputed forward reads the gathered-again buffer through ``weight``.
* ``keep`` units (the last block and the head: the first in backward) keep their forward buffer to the end of
  their backward, so backward starts without a gather; a unit whose backward needs no weight (the embedding
  lookup saves only indices: ``regather=False``) is not gathered again.
* The whole tensors are outputs of one autograd node per unit and forward (:class:`_Unsharded`); when every
  gradient of them is in, its backward posts the unit's reduce-scatter (fp32) and returns nothing for the
  shards: :meth:`finish` waits for the reduce-scatters and adds each rank's rows into ``.grad`` (``land``).
  Reduce-scatters are posted in ONE order on every rank, the reverse of the units' (a unit that completes
  early waits for the later ones; a unit without gradients sends zeros), so the scatter lane's collectives
  match across ranks.
* ``depth = 0`` is the blocking schedule (the baseline): each gather is posted and waited for when its unit
  starts, each reduce-scatter waited for as soon as it is posted.

Gradients are summed over the group (the trainer's convention); ``average=True`` divides by its size.  The
gather and scatter groups are the caller's own (no other op's collectives interleave with them).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

from flashpar.dist import DEFAULT_TIMEOUT_S, stream_waits, wait_work
from flashpar.overlap.unit import ShardedUnit


class _Unsharded(torch.autograd.Function):
    """``(W_0, ..., W_{M-1})``, the unit's whole tensors, from its shards; backward: the unit's gradients go to
    the prefetcher (reduce-scattered there), nothing to the shards."""

    @staticmethod
    def forward(ctx, owner, k, *params):
        ctx.owner, ctx.k = owner, k
        return tuple(owner.units[k].views_of(owner._staged))  # the buffer is staged by the caller

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner._unit_grads(ctx.k, list(grads))
        return (None, None) + (None,) * len(grads)


class _BackwardStart(torch.autograd.Function):
    """Identity on the unit's output; its backward is the first node of the unit's backward: the unit's weight
    is made ready (gathered again where needed) and the next units' gathers are posted."""

    @staticmethod
    def forward(ctx, x, owner, k):
        ctx.owner, ctx.k = owner, k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.owner._backward_start(ctx.k)
        return grad, None, None


class Prefetcher:
    """Runs ``units`` (in forward order) on the ranks of a shard group: gathers on ``gather_group``,
    reduce-scatters on ``scatter_group`` (two groups of the same ranks), ``depth`` units ahead.

    ``keep``: indices of the units whose forward buffer serves their backward; ``regather``: per unit, whether
    its backward reads its weight (``False``: not gathered again)."""

    def __init__(self, units: list[ShardedUnit], *, gather_group, scatter_group, depth: int = 1,
                 keep: frozenset[int] | set[int] = frozenset(), regather: list[bool] | None = None,
                 average: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S, trace: bool = False) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"prefetch depth must be an integer >= 0, got {depth!r}")
        if not units:
            raise ValueError("Prefetcher: no units")
        n = {u.n for u in units}
        if len(n) != 1:
            raise ValueError(f"Prefetcher: the units are split over groups of different sizes {sorted(n)}")
        self.units, self.depth, self.keep = units, depth, frozenset(keep)
        self.regather = list(regather) if regather is not None else [True] * len(units)
        if len(self.regather) != len(units):
            raise ValueError(f"Prefetcher: {len(self.regather)} regather flags for {len(units)} units")
        self.gather_group, self.scatter_group = gather_group, scatter_group
        self.n = units[0].n
        self.scale = 1.0 / self.n if average else 1.0
        self.timeout_s = timeout_s
        self._host = {g: not stream_waits(g) for g in (gather_group, scatter_group)} if self.n > 1 else {}
        self._scatters: list[tuple[ShardedUnit, object, torch.Tensor, torch.Tensor]] = []
        # trace=True: every gather and reduce-scatter posted, as (what, unit), and a weak reference to every
        # gathered buffer (tests: the order of the lanes, and what is alive when)
        self.trace: list[tuple[str, int]] | None = [] if trace else None
        self.buffers: list[tuple[int, weakref.ref]] = []
        self._reset()

    # ---- per forward ------------------------------------------------------------------------------------

    def _reset(self) -> None:
        u = len(self.units)
        self._pending: dict[int, tuple] = {}  # unit -> (work, send, recv) of a gather in flight
        # the gathered buffers (flat, every member a view: ShardedUnit.views_of) of forward and of backward
        self._fwd: dict[int, torch.Tensor] = {}
        self._outs: dict[int, tuple[torch.Tensor, ...]] = {}  # the _Unsharded outputs of this forward
        self._recomputed: dict[int, tuple[torch.Tensor, ...]] = {}  # the same of a forward recomputed in backward
        self._staged: torch.Tensor | None = None
        self._bwd: dict[int, torch.Tensor] = {}
        self._next_fwd = 0  # the next unit whose forward gather is posted
        self._grads: dict[int, list] = {}  # unit -> gradients arrived, not yet posted
        self._next_post = u - 1  # reduce-scatters are posted in this order
        self._posting = False  # some unit's gradients arrived in this backward
        self._backward = False
        self._training = False

    def begin(self) -> None:
        """The start of a forward: whatever the previous one left (gathers in flight, gradients never posted) is
        completed first, so every rank's lanes stay in step."""
        for k in sorted(self._pending):
            self._complete(k)
        self._post_remaining()
        self._reset()
        self._training = torch.is_grad_enabled()

    def _post_gather(self, k: int) -> None:
        if k in self._pending:
            return
        if self.trace is not None:
            self.trace.append(("gather", k))
        self._pending[k] = self.units[k].post_gather(self.gather_group, self.timeout_s) if self.n > 1 else None

    def _complete(self, k: int) -> torch.Tensor:
        """Unit ``k``'s gathered buffer (waits for its gather; without a group: assembled locally)."""
        if k not in self._pending:
            self._post_gather(k)
        posted = self._pending.pop(k)
        if posted is None:  # a group of one: this rank's rows are the whole tensors
            gathered = self.units[k].gather_local()
        else:
            work, _, recv = posted
            wait_work(work, self.timeout_s, host=self._host[self.gather_group])
            gathered = self.units[k].assemble(recv)
        if self.trace is not None:
            self.buffers.append((k, weakref.ref(gathered)))
        return gathered

    def enter(self, k: int) -> tuple[torch.Tensor, ...]:
        """Forward of unit ``k`` begins: its whole tensors (autograd outputs of the shards), the next ``depth``
        units' gathers posted."""
        while self._next_fwd <= min(k + self.depth, len(self.units) - 1):
            self._post_gather(self._next_fwd)  # in unit order, so every rank's gather lane runs the same sequence
            self._next_fwd += 1
        gathered = self._complete(k)
        self._fwd[k] = gathered
        self._outs[k] = self._apply(k, gathered)
        return self._outs[k]

    def _apply(self, k: int, gathered: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._staged = gathered
        try:
            return _Unsharded.apply(self, k, *self.units[k].params)
        finally:
            self._staged = None

    def weight(self, k: int, m: int) -> torch.Tensor:
        """Member ``m`` of unit ``k`` as the unit's ops should use it: this forward's output, or, in backward (a
        recomputed forward under activation checkpointing), the gathered-again tensor."""
        if not self._backward:
            return self._outs[k][m]
        gathered = self._bwd.get(k)
        if gathered is None:
            raise RuntimeError(f"prefetch: unit {self.units[k].name!r} is used in backward before its start")
        if k not in self._recomputed:
            self._recomputed[k] = self._apply(k, gathered)  # a node of the recomputation, never run backward
        return self._recomputed[k][m]

    def exit(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Forward of unit ``k`` ends: its buffer is released (kept units keep it for their backward);
        returns ``x`` through the node that starts the unit's backward."""
        if self._training and k in self.keep:
            self._bwd[k] = self._fwd[k]
        self._fwd.pop(k, None)
        self._outs.pop(k, None)
        if not self._training or not x.requires_grad:
            return x
        return _BackwardStart.apply(x, self, k)

    @contextlib.contextmanager
    def saving(self, k: int):
        """Tensors saved for backward inside this context that are views of unit ``k``'s forward buffer are kept
        as tokens and unpacked from its gathered-again buffer (nothing gathered outlives the unit's forward)."""
        if not self._training or k in self.keep:
            yield
            return
        # the closures hold the buffer's address, never the buffer (autograd may keep them as long as it saves)
        device, storage = self._fwd[k].device, self._fwd[k].untyped_storage().data_ptr()

        def pack(t: torch.Tensor):
            if t.device == device and t.untyped_storage().data_ptr() == storage:
                return ("unit", k, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            return t

        def unpack(obj):
            if isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "unit":
                _, unit, offset, shape, stride = obj
                gathered = self._bwd.get(unit)
                if gathered is None:
                    raise RuntimeError(f"prefetch: unit {self.units[unit].name!r}'s weight is read in backward "
                                       "before its backward started")
                return gathered.as_strided(shape, stride, offset)
            return obj

        with saved_tensors_hooks(pack, unpack):
            yield

    # ---- backward ---------------------------------------------------------------------------------------

    def _backward_start(self, k: int) -> None:
        self._backward = True
        if k not in self._bwd and self.regather[k]:
            self._post_gather(k)
            self._bwd[k] = self._complete(k)
        ahead, j = 0, k - 1
        while j >= 0 and ahead < self.depth:  # the next `depth` units that need a gather-again, in flight
            if j not in self._bwd and j not in self.keep and self.regather[j]:
                self._post_gather(j)  # (a no-op where it is in flight already)
                ahead += 1
            j -= 1

    def _unit_grads(self, k: int, grads: list) -> None:
        self._bwd.pop(k, None)
        self._recomputed.pop(k, None)
        self._grads[k] = grads
        self._posting = True
        while self._next_post >= 0 and self._next_post in self._grads:
            self._post_scatter(self._next_post)

    def _post_scatter(self, k: int) -> None:
        grads = self._grads.pop(k, None) or [None] * len(self.units[k].members)
        self._next_post = k - 1
        unit = self.units[k]
        if self.trace is not None:
            self.trace.append(("scatter", k))
        if self.n == 1:
            unit.land(unit.pack_grads(grads), self.scale)
            return
        work, send, recv = unit.post_scatter(grads, self.scatter_group, self.timeout_s)
        self._scatters.append((unit, work, send, recv))
        if self.depth == 0:
            self._land_all()

    def _post_remaining(self) -> None:
        while self._posting and self._next_post >= 0:
            self._post_scatter(self._next_post)

    def _land_all(self, leave: int = 0) -> None:
        """Land the reduce-scatters in posting order, all but the last ``leave`` of them."""
        keep = len(self._scatters) - leave
        scatters, self._scatters = self._scatters[:keep], self._scatters[keep:]
        for unit, work, _, recv in scatters:
            wait_work(work, self.timeout_s, host=self._host[self.scatter_group])
            unit.land(recv, self.scale)

    def finish(self, *, leave_last: bool = False) -> list[torch.nn.Parameter]:
        """After backward: post what is left (units without gradients send zeros), wait for every
        reduce-scatter and add each rank's rows into its parameters' ``.grad``.  ``leave_last``: the last one
        posted (the tail of backward: the first unit's) stays in flight; returns its parameters, whose
        gradients ``finish_tail`` lands (the caller works on the others meanwhile)."""
        self._post_remaining()
        self._land_all(leave=1 if leave_last else 0)
        self._bwd.clear()
        self._outs.clear()
        self._recomputed.clear()
        self._backward = False
        return [p for unit, *_ in self._scatters for p in unit.params]

    def finish_tail(self) -> None:
        """Land what ``finish(leave_last=True)`` left in flight."""
        self._land_all()

    def in_flight(self) -> int:
        """Reduce-scatters posted and not yet landed."""
        return len(self._scatters)
