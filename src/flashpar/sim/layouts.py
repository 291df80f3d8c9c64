"""Which (dp, cp, ulysses, tp) layouts a model can run on N GPUs, and the search over them.

A layout is valid (``problem`` is ``None``) when dp x cp x ulysses x tp = N; tp fits in a node; the mesh's rules
hold (``flashpar.dims.ParallelDims.problem``: tp divides the heads, the kv heads, the FFN and the vocabulary; ulysses
> 1 only with tp = 1, the heads splitting over it); and the sequence
has at least one token per rank of a cp rank's group (``seq >= cp x ulysses x tp``; ``seq`` divisible by it).
The search tries every valid layout with tp and ulysses powers of two, each configuration with and without
activation checkpointing (without when it fits), and ranks the layouts that fit the GPU's memory by
tokens/s.
"""

from __future__ import annotations

from flashpar.models.config import LlamaConfig
from flashpar.sim.topology import Layout


def problem(cfg: LlamaConfig, layout: Layout, gpus: int, seq: int, gpus_per_node: int) -> str | None:
    """The first reason ``layout`` cannot run ``cfg`` on ``gpus`` GPUs with ``seq`` tokens per sample, or None."""
    L = layout
    if L.gpus != gpus:
        return (f"the layout dp {L.dp} x cp {L.cp} x ulysses {L.ulysses} x tp {L.tp} = {L.gpus} GPUs does not "
                f"match --gpus {gpus}")
    if L.tp > gpus_per_node:
        return f"tp = {L.tp} does not fit in a node of --gpus-per-node {gpus_per_node} (tp runs on NVLink)"
    bad = L.problem(cfg)  # the mesh's rules (flashpar.dims): Ulysses with tp, tp and Ulysses against the model
    if bad:
        return bad
    group = L.seq_ranks
    if seq % group:
        return f"--seq {seq} is not divisible by cp x ulysses x tp = {group}"
    return None


def _powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def candidates(cfg: LlamaConfig, gpus: int, seq: int, gpus_per_node: int) -> list[Layout]:
    """Every valid layout with tp and ulysses powers of two (cp and dp any divisors)."""
    out = []
    for tp in _powers_of_two(min(gpus, gpus_per_node)):
        for u in _powers_of_two(gpus // tp) if tp == 1 else [1]:
            rest = gpus // (tp * u)
            if rest * tp * u != gpus:
                continue
            for cp in (c for c in range(1, rest + 1) if rest % c == 0):
                layout = Layout(dp=rest // cp, cp=cp, ulysses=u, tp=tp)
                if problem(cfg, layout, gpus, seq, gpus_per_node) is None:
                    out.append(layout)
    return out
