"""Choosing the next token from logits: greedy, or sampled with a temperature, top-k and top-p.

Sampling is by the inverse of the cumulative distribution at one uniform number per (step, prompt), drawn up
front from ``torch.Generator().manual_seed(seed)`` on the host (``uniforms``): the number a prompt's step
uses does not depend on which rank decodes it nor on the batch's order, so the same seed gives the same tokens
on any mesh (to the logits' own rounding)::

    z = logits / temperature;  keep the k largest (top-k);  p = softmax(z), sorted descending
    keep the fewest tokens whose p sum to >= top_p (the first always)
    token = the first kept token whose cumulative p exceeds u * (sum of kept p)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0: greedy (argmax; the first of equal maxima).  ``top_k`` 0: no limit; ``top_p`` 1: no
    limit."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise ValueError(f"sampling: temperature must be a number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise ValueError(f"sampling: top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ValueError(f"sampling: top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool)):
            raise ValueError(f"sampling: seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def uniforms(seed: int, steps: int, prompts: int) -> torch.Tensor:
    """``[steps, prompts]`` uniform numbers in [0, 1), the same for a seed on every rank."""
    return torch.rand(steps, prompts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def choose(logits: torch.Tensor, u: torch.Tensor, how: Sampling) -> torch.Tensor:
    """The next token of each row of ``logits [R, V]`` (``u [R]``: the rows' uniform numbers)."""
    if how.greedy:
        return logits.argmax(dim=-1)
    z = logits.double() / how.temperature
    if how.top_k and how.top_k < z.shape[-1]:
        kth = z.topk(how.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    p, order = torch.softmax(z, dim=-1).sort(dim=-1, descending=True, stable=True)
    cum = p.cumsum(dim=-1)
    keep = (cum - p) < how.top_p  # the tokens before which less than top_p is covered (the first always)
    p = p * keep
    cum = p.cumsum(dim=-1)
    target = u.to(cum)[:, None] * cum[:, -1:]
    pick = (cum <= target).sum(dim=-1).clamp(max=p.shape[-1] - 1)  # the first index whose cumulative p > u total
    return order.gather(-1, pick[:, None]).squeeze(-1)
