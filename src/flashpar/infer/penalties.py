"""Penalties on the next token's logits from the tokens a sequence already holds.

Applied to the full-vocabulary logits ``l [R, V]`` of a step (every rank of a tp group holds the whole rows after
the head's gather, and the rows of a prompt split over cp are the same on each rank of its group), before the
temperature, in this order::

    repetition  r > 0:      l_v <- l_v / r  if l_v > 0  else  l_v * r      for every v in the prompt or the
                                                                          output so far (transformers'
                                                                          RepetitionPenaltyLogitsProcessor)
    frequency   f in [-2, 2]: l_v <- l_v - f * c_v                        c_v: times v occurs in the output so
    presence    a in [-2, 2]: l_v <- l_v - a * [c_v > 0]                  far, the prompt not counted (vLLM's
                                                                          frequency and presence penalties)

``r = 1``, ``f = 0`` and ``a = 0`` leave the logits as they are.  ``History`` keeps, per row, which tokens the
prompt and the output hold (``seen``) and the output's counts (``counts``), updated on the device after each
chosen token: a step reads nothing back to the host.
"""

from __future__ import annotations

import torch


def repetition(logits: torch.Tensor, seen: torch.Tensor, r: float) -> torch.Tensor:
    """``logits [R, V]`` with the repetition penalty ``r`` on the tokens ``seen [R, V]`` (bool) marks."""
    penalized = torch.where(logits > 0, logits / r, logits * r)
    return torch.where(seen, penalized, logits)


def frequency_presence(logits: torch.Tensor, counts: torch.Tensor, f: float, a: float) -> torch.Tensor:
    """``logits [R, V]`` less ``f`` per occurrence and ``a`` once for each token of ``counts [R, V]`` (the output's
    occurrences)."""
    counts = counts.to(logits.dtype)
    return logits - f * counts - a * (counts > 0).to(logits.dtype)


class History:
    """The tokens of each row a penalty reads: ``seen [R, V]`` (prompt and output) for the repetition penalty,
    ``counts [R, V]`` (output only) for the frequency and presence penalties; each kept only when its penalty is
    set."""

    def __init__(self, prompts: list[list[int]], vocab: int, device: torch.device, *, repetition: bool,
                 counted: bool) -> None:
        rows = len(prompts)
        self.seen = None
        if repetition:
            self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
            for i, p in enumerate(prompts):
                self.seen[i, torch.tensor(p, dtype=torch.long, device=device)] = True
        self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device) if counted else None

    def add(self, tokens: torch.Tensor) -> None:
        """Count the chosen ``tokens [R]`` (one per row)."""
        index = tokens[:, None]
        if self.seen is not None:
            self.seen.scatter_(1, index, True)
        if self.counts is not None:
            self.counts.scatter_add_(1, index, torch.ones_like(index, dtype=self.counts.dtype))

    def apply(self, logits: torch.Tensor, how) -> torch.Tensor:
        """``logits`` with ``how``'s penalties (a ``Sampling``)."""
        if self.seen is not None:
            logits = repetition(logits, self.seen, how.repetition_penalty)
        if self.counts is not None:
            logits = frequency_presence(logits, self.counts, how.frequency_penalty, how.presence_penalty)
        return logits
