"""``--compile`` at start-up: the regions (``flashpar.models.regions``) compiled before the first step, timed, and
the graphs counted, so that compilation is one figure of its own and never part of a step's time.

    build model ─▶ warm_up: every region once, forward and backward, on random rows ─▶ steps (no compilation)
                   └─ CompileReport(seconds, graphs)                                   └─ recompiles() after: 0

Ranks compile apart (each from inductor's cache when it holds the graphs); ``slowest`` waits for the last and
reports its time.  ``graphs`` counts what torch._dynamo compiled in this process (its ``unique_graphs``
counter: one per region and variant; inductor compiles each one's backward when the warm-up's backward first
runs).  ``recompiles`` is how many more it compiled since the report: a step's token count changing is not
one (the rows are marked dynamic), so a steady run reports 0.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass


def graphs_compiled() -> int:
    """The graphs torch._dynamo has compiled in this process (0 before torch._dynamo is imported)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


@dataclass(frozen=True)
class CompileReport:
    """``seconds`` the warm-up took (the compilation: its compute is a few rows), ``graphs`` it compiled."""

    seconds: float
    graphs: int
    start_graphs: int

    def slowest(self, device) -> CompileReport:
        """The report with the slowest rank's seconds (a collective over the world: every rank leaves it when the
        last one has compiled, so no rank's first step waits for another's compilation)."""
        import torch
        import torch.distributed as dist

        seconds = torch.tensor([self.seconds], dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return dataclasses.replace(self, seconds=float(seconds))

    def recompiles(self) -> int:
        """Graphs compiled since the warm-up ended (0 in a steady run)."""
        return graphs_compiled() - self.start_graphs - self.graphs

    def line(self) -> str:
        return (f"compile: {self.seconds:.1f} s, {self.graphs} graphs (each block's elementwise regions, "
                "torch.compile with inductor; the communicating ops eager)")

    def to_dict(self) -> dict:
        return {"compile_s": round(self.seconds, 3), "compile_graphs": self.graphs,
                "recompiles": self.recompiles()}


def warm_up(model, *, grad: bool = True) -> CompileReport | None:
    """Compile ``model``'s regions now (``ParallelLlama.warm_regions``; ``grad``: their backward too, as training
    runs them; False: forward only, as prefill does).  None when the model is not compiled."""
    if not model.options.compile:
        return None
    import torch

    start = graphs_compiled()
    t0 = time.perf_counter()
    with torch.enable_grad() if grad else torch.no_grad():  # prefill runs under no_grad: the same graphs
        model.warm_regions(grad=grad)
    return CompileReport(time.perf_counter() - t0, graphs_compiled() - start, start)
