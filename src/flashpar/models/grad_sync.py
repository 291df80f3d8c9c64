"""The gradient sums of ``ParallelLlama`` posted during backward, hidden behind the rest of it.

A parameter held by several ranks (a tp shard on the dp x cp x ulysses ranks of its tp index, a
norm on every rank, ZeRO-3 rows on the cp x ulysses ranks) has on each rank the gradient of that
rank's tokens only; the true gradient is their sum (``flashpar.models.parallel``).  Summing after
backward (one blocking all-reduce per parameter) leaves all of it exposed.  Here each parameter's
all-reduce is posted asynchronously as soon as its gradient is complete
(``register_post_accumulate_grad_hook``), so it travels while backward computes the earlier layers,
and ``finish`` waits for them all::

    backward:  | head, norm | block L-1 ........ | block L-2 ........ | ... | block 0 | embedding |
    lane:                   | sum(head, norm)   | sum(block L-1)     | ... | sum(block 1) | ...    | finish
                                                                                  (waits: only the tail)

Order.  Collectives on a group must be posted in the same order on every member.  Gradients may
complete in different orders on different ranks (autograd's order is the graph's, but nothing
promises it), so the sums are posted in ONE fixed order, the reverse of ``named_parameters`` (about
the order backward completes them): a completed gradient is posted only once every parameter before
it in that order has been posted, and ``finish`` posts the rest (a gradient that never came is
zeros).  Each group therefore sees the same sequence of all-reduces on every rank.

Gradient accumulation (``flashpar.train.step.accumulate``) arms only the last micro-batch's backward:
the hooks of the earlier ones return at once (their gradients only add up in ``.grad``), and a
post-accumulate hook fires after autograd has added the last backward's term, so each sum carries
all the micro-batches, posted once per optimizer step.

The groups are the model's own (``_sum_groups``, made for this purpose only), never a group that
also carries the step's transfers, so an all-reduce in flight never interleaves with another op's
collectives on the same group.  Waits have the model's timeout on gloo; on NCCL the stream waits
(``flashpar.dist.wait_work``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashpar.dist import stream_waits, wait_work


class GradSync:
    """Sums of ``params`` (``[(parameter, group or None)]``, in the order they are posted) over their
    groups, posted during backward.  ``arm()`` before backward, ``finish()`` after it."""

    def __init__(self, params: list[tuple[torch.nn.Parameter, object]], *, timeout_s: float) -> None:
        self.params = params
        self.timeout_s = timeout_s
        self._ready = [False] * len(params)
        self._posted = 0  # params[:_posted] have their all-reduce posted (or need none)
        self._works: list[tuple[object, object]] = []  # (work, group)
        self._armed = False
        for i, (p, _) in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))

    def arm(self) -> None:
        """Post the sums during the next backward (the previous step must be finished)."""
        if self._works or self._posted:
            raise RuntimeError("GradSync.arm: the previous step's gradient sums were not finished")
        self._ready = [False] * len(self.params)
        self._armed = True

    def _on_grad(self, i: int) -> None:
        if not self._armed:
            return
        self._ready[i] = True
        while self._posted < len(self.params) and self._ready[self._posted]:
            self._post(self._posted)

    def _post(self, i: int) -> None:
        p, group = self.params[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if group is not None:
            self._works.append((dist.all_reduce(p.grad, group=group, async_op=True), group))
        self._posted = i + 1

    def finish(self) -> None:
        """Post what backward did not, then wait for every sum: afterwards each gradient is the sum over
        the ranks holding its parameter."""
        while self._posted < len(self.params):
            self._post(self._posted)
        works, self._works = self._works, []
        self._armed, self._posted = False, 0
        for work, group in works:
            wait_work(work, self.timeout_s, host=not stream_waits(group))
