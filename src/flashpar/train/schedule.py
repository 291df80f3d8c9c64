"""The learning rate of each optimizer step: linear warm-up, then cosine decay to a floor at the last step.

With the peak ``lr``, the floor ``lr_min``, ``W`` warm-up steps and ``N`` steps in the run, step ``s``
(1-based, ``1 <= s <= N``) trains with::

    lr(s) = lr * s / W                                                    s <= W   (warm-up: lr / W ... lr)
    lr(s) = lr_min + (lr - lr_min) * (1 + cos(pi * (s - W) / (N - W))) / 2   s > W    (cosine: ... lr_min at N)

    lr ^      ___
       |    /     ``--..
       |  /              `-.
       |/                   `--.__ lr_min
       +---W-------------------N---> s

The cosine starts from ``lr`` at step ``W`` (``W = 0``: step 1 trains at about ``lr``, ``lr_min + (lr -
lr_min) (1 + cos(pi / N)) / 2``); ``W = N`` warms up over the whole run.  A pure function of the step
and the run's settings: a resumed run trains its steps with the same rates as the uninterrupted one
(``--steps`` is part of the curve, so a run resumed with a larger ``--steps`` stretches the decay
from there on).
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, steps: int, warmup: int = 0, lr_min: float = 0.0) -> float:
    """The learning rate of 1-based step ``step`` of a ``steps``-step run (see the module docstring).
    ``ValueError`` (one line) on settings outside ``0 <= warmup <= steps``, ``0 <= lr_min <= lr``,
    ``1 <= step <= steps``."""
    if not 0 <= warmup <= steps:
        raise ValueError(f"warm-up must be within [0, steps = {steps}] steps, got {warmup}")
    if not 0 <= lr_min <= lr:
        raise ValueError(f"lr-min must be within [0, lr = {lr}], got {lr_min}")
    if not 1 <= step <= steps:
        raise ValueError(f"step must be within [1, {steps}], got {step}")
    if step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / (steps - warmup)  # (0, 1]: steps > warmup here
    return lr_min + (lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))
