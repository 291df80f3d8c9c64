"""Time of a piece of a step: the compute it runs and the communication it leaves exposed, per parallelism.

    total = compute + exposed["tp"] + exposed["ulysses"] + exposed["cp"] + exposed["dp"]

``compute`` is what the piece takes with every transfer skipped (``flashpar bench train``'s no-communication
step runs the same schedules with the transfers made local no-ops, so a decomposed schedule keeps its
smaller GEMM pieces there too); ``exposed[p]`` is what parallelism ``p``'s transfers add on top; ``sent[p]`` the
seconds ``p``'s transfers keep the rank's link busy, hidden or not (what the data-parallel lanes share a port
with: ``flashpar.sim.zero``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KEYS = ("tp", "ulysses", "cp", "dp")


@dataclass
class Part:
    compute: float = 0.0
    exposed: dict = field(default_factory=lambda: dict.fromkeys(KEYS, 0.0))
    sent: dict = field(default_factory=lambda: dict.fromkeys(KEYS, 0.0))

    @classmethod
    def of(cls, compute: float, sent: dict | None = None, **exposed: float) -> Part:
        part = cls(compute)
        for key, v in exposed.items():
            part.exposed[key] += max(v, 0.0)
        for key, v in (sent or {}).items():
            part.sent[key] += max(v, 0.0)
        return part

    @property
    def total(self) -> float:
        return self.compute + sum(self.exposed.values())

    def add(self, other: Part, times: float = 1.0) -> Part:
        """This part plus ``times`` x ``other`` (in place; returns self)."""
        self.compute += times * other.compute
        for key in KEYS:
            self.exposed[key] += times * other.exposed[key]
            self.sent[key] += times * other.sent[key]
        return self

    def scaled(self, factor: float) -> Part:
        return Part().add(self, factor)

    def copy(self) -> Part:
        return Part().add(self)


def total(parts) -> Part:
    out = Part()
    for p in parts:
        out.add(p)
    return out
