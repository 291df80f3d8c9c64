"""A training step that stops before the optimizer when its loss or gradient norm is not finite.

``checked_step`` is ``flashpar.train.step.optimizer_step`` with the decision in the middle::

    gradients(model, micro-batches)  -> loss share (this rank), global gradient norm (one all-reduce inside)
    all-reduce [loss share, K/V bytes sent]   the step's figures, summed over the ranks (the collective the
                                              trainer's bookkeeping made after every step, now made here)
    one host read of (loss, norm)             the read the bookkeeping made after every step, made earlier
    finite?  yes: AdamW step                  no: gradients dropped, weights and AdamW state untouched;
                                                  NonFiniteGuard skips and counts it, or stops the job

No collective and no host read is added to a step: the loss's sum over the ranks and its read were
already made once per step, after it; they move before ``opt.step()``.  Every rank decides on the same
two numbers (an all-reduce's result, and the norm, itself an all-reduce of every shard's squares): a
NaN or an infinity in any rank's loss share or in any gradient element reaches both, so every rank
skips, or raises, together.  The step's clipping multiplies the gradients by a non-finite coefficient
when the norm is not finite; they are dropped, not applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from flashpar.train import where
from flashpar.train.optimizer import set_lr
from flashpar.train.step import gradients
from flashpar.train.stop import JobStop


class StepTotals(NamedTuple):
    """A step's figures over every rank, host values: the global batch's mean loss, the gradient norm before
    clipping, the forward K/V bytes the ranks sent, and whether the optimizer step was skipped."""

    loss: float
    grad_norm: float
    kv_bytes: int
    skipped: bool


class NonFinite(JobStop):
    """A step's loss or gradient norm is not finite (the same line on every rank)."""


@dataclass
class NonFiniteGuard:
    """What to do with a non-finite step: skip up to ``allowed`` of them (``--skip-nonfinite``), then stop."""

    allowed: int = 0
    skipped: list[int] = field(default_factory=list)

    def apply(self, step: int, loss: float, norm: float) -> bool:
        """Whether step ``step`` may update the weights; ``NonFinite`` when it may not and no skip is left."""
        if math.isfinite(loss) and math.isfinite(norm):
            return True
        if len(self.skipped) < self.allowed:
            self.skipped.append(step)
            return False
        before = (f"; {len(self.skipped)} skipped before (steps {', '.join(map(str, self.skipped))}, "
                  f"--skip-nonfinite {self.allowed})" if self.allowed else
                  "; --skip-nonfinite N skips up to N such steps")
        raise NonFinite(f"step {step}: loss {loss}, gradient norm {norm}: stopped before the optimizer step (the "
                        f"weights are those of step {step - 1}; no checkpoint of step {step} is written){before}")


def checked_step(model, opt, micro_batches, count: float, *, clip: float, lr: float, kv_sent, step: int,
                 guard: NonFiniteGuard) -> StepTotals:
    """One optimizer step of the global batch (the module docstring); ``kv_sent``: this rank's forward K/V bytes
    so far this step, a callable read after the forward passes."""
    loss, norm = gradients(model, micro_batches, count, clip=clip)
    where.enter("step figures")
    stats = torch.stack([loss.detach().to(torch.float64).reshape(()),
                         torch.tensor(float(kv_sent()), dtype=torch.float64, device=loss.device)])
    dist.all_reduce(stats)
    total, grad_norm, kv = torch.stack([stats[0], norm.to(torch.float64).reshape(()), stats[1]]).tolist()
    apply = guard.apply(step, total, grad_norm)
    if apply:
        set_lr(opt, lr)
        where.enter("optimizer")
        opt.step()
    opt.zero_grad(set_to_none=True)
    return StepTotals(total, grad_norm, int(kv), not apply)
