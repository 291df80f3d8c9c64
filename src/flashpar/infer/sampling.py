"""Choosing the next token from logits: penalties, then greedy, or sampled with a temperature, top-k, top-p and
min-p.

Sampling is by the inverse of the cumulative distribution at one uniform number per (step, output), drawn up
front from ``torch.Generator().manual_seed(seed)`` on the host (``uniforms``): the number an output's step uses
does not depend on which rank decodes it, so the same seed gives the same tokens on any mesh (to the logits'
own rounding)::

    l = the logits with the penalties of the tokens so far (flashpar.infer.penalties), float64
    z = l / temperature                                    (greedy: token = argmax l)
    sorted descending: keep the k largest and their ties   (top-k)
                       keep the fewest whose p = softmax(z) sum to >= top_p (the first always)   (top-p)
                       keep those with p >= min_p * max p, p over the tokens still kept          (min-p)
    token = the first kept token whose cumulative p exceeds u * (sum of kept p)

The order of the limits is transformers' (TopK, TopP, MinP warpers after the temperature).  The log-probability
of a chosen token (``logprobs``) is ``log_softmax(z)`` at it: after the penalties and the temperature (1 when
greedy), before top-k, top-p and min-p remove tokens.

Without a temperature, a setting only sampling reads (``top_k``, ``top_p``, ``min_p``, ``seed``, ``n > 1``)
samples at temperature 1 (as vLLM, whose temperature is 1 unless given); with none of them the choice is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SAMPLING_ONLY = ("top_k", "top_p", "min_p", "seed", "n")  # the settings greedy choice does not read


class SamplingError(ValueError):
    """A bad ``Sampling`` setting: ``name`` (the field) and ``rule`` (what it must be, and the value given)."""

    def __init__(self, name: str, rule: str) -> None:
        super().__init__(f"sampling: {name} {rule}")
        self.name, self.rule = name, rule


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.  ``temperature`` 0: greedy (argmax; the first of equal maxima); None: 1 where
    a setting of ``SAMPLING_ONLY`` is given, else 0.  ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0: no limit.
    ``seed``: of the uniform numbers (None: 0).  ``n``: outputs per prompt.  The penalties:
    ``flashpar.infer.penalties`` (1, 0 and 0: none)."""

    temperature: float | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    implied: bool = field(default=False, init=False, repr=False, compare=False)  # the temperature was not given

    def __post_init__(self) -> None:
        checks = (
            ("temperature", self.temperature is None or _number(self.temperature) and self.temperature >= 0,
             "must be a number >= 0"),
            ("top_k", _integer(self.top_k) and self.top_k >= 0, "must be an integer >= 0"),
            ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", _number(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed is None or _integer(self.seed), "must be an integer"),
            ("n", _integer(self.n) and self.n >= 1, "must be an integer >= 1"),
            ("repetition_penalty", _number(self.repetition_penalty) and self.repetition_penalty > 0,
             "must be a number > 0 (1: none)"),
            ("presence_penalty", _number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "must be in [-2, 2] (0: none)"),
            ("frequency_penalty", _number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "must be in [-2, 2] (0: none)"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise SamplingError(name, f"{rule}, got {getattr(self, name)!r}")
        if self.temperature is None:
            object.__setattr__(self, "temperature", 1.0 if self.given() else 0.0)
            object.__setattr__(self, "implied", bool(self.given()))
        if self.n > 1 and self.temperature == 0:
            raise SamplingError("n", f"{self.n} at temperature 0 (greedy) gives {self.n} copies of the same tokens: "
                                "give a temperature > 0")

    def given(self) -> list[str]:
        """The settings of ``SAMPLING_ONLY`` that differ from their defaults."""
        defaults = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None, "n": 1}
        return [name for name in SAMPLING_ONLY if getattr(self, name) != defaults[name]]

    def note(self, name=str) -> str | None:
        """One line where the settings choose for the user: sampling at an implied temperature 1, or sampling
        settings that greedy choice ignores (``name``: how a field is called, e.g. its flag)."""
        given = ", ".join(name(f) for f in self.given())
        if self.implied:
            return (f"sampling at {name('temperature')} 1 ({given} given without {name('temperature')}; "
                    f"{name('temperature')} 0 is greedy)")
        if self.greedy and given:
            return f"greedy ({name('temperature')} 0): {given} has no effect"
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def generator_seed(self) -> int:
        return 0 if self.seed is None else self.seed


def uniforms(seed: int, steps: int, outputs: int) -> torch.Tensor:
    """``[steps, outputs]`` uniform numbers in [0, 1), the same for a seed on every rank."""
    return torch.rand(steps, outputs, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def sorted_kept(z: torch.Tensor, how: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """``z [R, V]`` sorted descending (stable) with ``-inf`` at the tokens top-k, top-p and min-p remove, and the
    sort's order (``z``: the logits after penalties and temperature)."""
    zs, order = z.sort(dim=-1, descending=True, stable=True)
    if how.top_k and how.top_k < zs.shape[-1]:
        zs = zs.masked_fill(zs < zs[:, how.top_k - 1:how.top_k], -torch.inf)
    if how.top_p < 1:
        p = torch.softmax(zs, dim=-1)
        zs = zs.masked_fill(p.cumsum(dim=-1) - p >= how.top_p, -torch.inf)  # covered before it: top_p or more
    if how.min_p > 0:
        p = torch.softmax(zs, dim=-1)
        zs = zs.masked_fill(p < how.min_p * p[:, :1], -torch.inf)
    return zs, order


def truncate(z: torch.Tensor, how: Sampling) -> torch.Tensor:
    """``z [R, V]`` with ``-inf`` at the tokens top-k, top-p and min-p remove, in the vocabulary's order."""
    zs, order = sorted_kept(z, how)
    return torch.empty_like(zs).scatter_(-1, order, zs)


def choose(logits: torch.Tensor, u: torch.Tensor, how: Sampling, history=None,
           logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """The next token of each row of ``logits [R, V]`` (``u [R]``: the rows' uniform numbers; ``history``: the
    rows' ``flashpar.infer.penalties.History`` where ``how`` has penalties).  ``logprobs [R]``: where given,
    filled with the chosen tokens' log-probabilities (the module docstring)."""
    if how.greedy and history is None and logprobs is None:
        return logits.argmax(dim=-1)
    z = logits.double()
    if history is not None:
        z = history.apply(z, how)
    if how.greedy:
        tokens = z.argmax(dim=-1)
    else:
        z = z / how.temperature
        zs, order = sorted_kept(z, how)
        cum = torch.softmax(zs, dim=-1).cumsum(dim=-1)
        target = u.to(cum)[:, None] * cum[:, -1:]
        pick = (cum <= target).sum(dim=-1).clamp(max=cum.shape[-1] - 1)  # the first whose cumulative p > u total
        tokens = order.gather(-1, pick[:, None]).squeeze(-1)
    if logprobs is not None:
        logprobs.copy_(torch.log_softmax(z, dim=-1).gather(-1, tokens[:, None]).squeeze(-1))
    return tokens
