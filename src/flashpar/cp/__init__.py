"""FlashCP: context parallelism for packed documents under a causal document mask.

``plan(doc_lens, cp_size, strategy=...)`` decides which tokens each rank holds and which K/V it
receives (:class:`CPPlan`); it is pure and deterministic, needs no process group and runs in a
data-loader worker.  Strategies: ``flashcp`` (the hybrid search) and the baselines
``contiguous``, ``headtail``, ``per_doc``, ``per_doc_aware``, ``torch_per_doc``, ``whole_doc`` and
``megatron_dynamic`` (Megatron-Core's per-document power-of-two CP groups, ``megatron_dynamic.py``).
``attention(q, k, v, plan)`` runs the plan: exact attention with the K/V exchange of its strategy
(``attention.py``; ``window=W``: sliding-window attention, any plan, ``window.py``); ``shard`` / ``gather`` move
whole-sequence tensors to and from its layout.  ``plan(..., window=W)`` plans for a sliding-window model: the work
of a query is ``min(p + 1, W)`` pairs and the K/V its window reaches (``CostModel.window``).

``import flashpar.cp`` loads no torch (a command's flags read ``STRATEGIES`` without it): ``CPPlan``,
``attention``, ``CommCounter``, ``shard`` and ``gather`` are imported on first use, ``plan``'s strategies when it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import time
import types
from typing import TYPE_CHECKING

import numpy as np

from flashpar.cp.cost import CostModel

if TYPE_CHECKING:
    from flashpar.cp.cp_plan import CPPlan

STRATEGIES = ("contiguous", "headtail", "per_doc", "per_doc_aware", "torch_per_doc", "whole_doc", "megatron_dynamic",
              "flashcp")  # flashcp last: STRATEGIES[:-1] are the peers it is measured against
COMM = {"contiguous": "all", "headtail": "all", "per_doc": "all", "torch_per_doc": "all",
        "per_doc_aware": "aware", "whole_doc": "aware", "megatron_dynamic": "aware", "flashcp": "aware"}


def plan(doc_lens, cp_size: int, *, strategy: str = "flashcp", cost: CostModel | None = None,
         token_slack: float = 0.05, window: int | None = None) -> CPPlan:
    """Plan one packed sequence of documents of ``doc_lens`` tokens over ``cp_size`` ranks.  ``window``: plan for
    sliding-window attention of ``W`` keys (sets ``cost.window``; None: ``cost``'s own)."""
    from flashpar.cp import flashcp as _flashcp
    from flashpar.cp import megatron_dynamic as _megatron_dynamic
    from flashpar.cp import strategies as _strategies
    from flashpar.cp.cp_plan import CPPlan

    lens, lens_np = _check(doc_lens, cp_size, strategy, token_slack)
    cost = cost or CostModel()
    if window is not None:
        cost = dataclasses.replace(cost, window=window)  # (CostModel checks it: one line)
    t0 = time.perf_counter()
    if strategy == "flashcp":
        placement = _flashcp.plan(lens, cp_size, cost, token_slack, lens_np)
    elif strategy == "whole_doc":
        placement = _flashcp.whole_doc(lens, cp_size, cost, token_slack, lens_np)
    elif strategy == "megatron_dynamic":
        placement = _megatron_dynamic.megatron_dynamic(lens, cp_size, token_slack)
    else:
        fn = {"contiguous": _strategies.contiguous, "headtail": _strategies.headtail,
              "per_doc": _strategies.per_doc, "per_doc_aware": _strategies.per_doc,
              "torch_per_doc": _strategies.torch_per_doc}[strategy]
        placement = fn(lens, cp_size)
    elapsed = time.perf_counter() - t0
    return CPPlan(cp_size, tuple(lens), strategy, placement.frozen(), COMM[strategy], cost, token_slack, elapsed)


def _check(doc_lens, cp_size, strategy, token_slack) -> tuple[list[int], np.ndarray]:
    """The lengths as a list and as an int64 array (made once: the planner reads both), or ValueError."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    lens = list(doc_lens)
    if not lens:
        raise ValueError("doc_lens is empty: a packed sequence needs at least one document")
    lens_np = None
    if set(map(type, lens)) == {int}:  # (the common case, checked in C; the least on the array)
        with contextlib.suppress(OverflowError):  # (beyond int64: checked one by one below, as any other)
            lens_np = np.fromiter(lens, dtype=np.int64, count=len(lens))
    fine = lens_np is not None and lens_np.min() > 0
    bad = [] if fine else [(i, v) for i, v in enumerate(lens)
                           if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
    if bad:
        raise ValueError(f"doc_lens must be positive ints; bad entries (index, value): {bad[:5]}")
    if not token_slack >= 0:
        raise ValueError(f"token_slack must be >= 0, got {token_slack!r}")
    return lens, lens_np


_TORCH_NAMES = {"CPPlan": "cp_plan", "attention": "attention", "CommCounter": "exchange", "gather": "shard",
                "shard": "shard"}  # name -> its module: imported on first use (they import torch)


def __getattr__(name: str):
    if name not in _TORCH_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_TORCH_NAMES[name]}"), name)


class _Package(types.ModuleType):
    """``flashpar.cp``: ``attention`` and ``shard`` name both a module and the function it defines.  Python sets
    a package's attribute to each of its modules as it is imported; here the function takes the name instead, as
    ``cp.attention(...)`` and ``from flashpar.cp import shard`` expect."""

    def __setattr__(self, name: str, value) -> None:
        if _TORCH_NAMES.get(name) == name and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["COMM", "CPPlan", "CommCounter", "CostModel", "STRATEGIES", "attention", "gather", "plan", "shard"]
