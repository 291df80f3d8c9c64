"""A plan read from JSON is input: every field is checked before a :class:`CPPlan` is built from it.

    {"cp_size": N, "doc_lens": [l_0, ...], "strategy": str, "comm": "aware" | "all", "token_slack": x >= 0,
     "cost": CostModel.to_dict(), "segments": [[[a, b], ...] for each of the N ranks]}

A valid plan's segments partition ``[0, sum(doc_lens))``: every token is held by exactly one rank, each range
``[a, b)`` has ``0 <= a < b`` and lies inside one document.  Anything else is refused with one line that
starts with ``plan JSON`` and names the field, so a plan file cannot make a rank compute a wrong attention
or index out of its tensors.
"""

from __future__ import annotations

import bisect
import json
import math

COMMS = ("aware", "all")
FIELDS = ("cp_size", "doc_lens", "strategy", "comm", "token_slack", "cost", "segments")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_plan(text: str) -> dict:
    """The validated fields of a plan's JSON text, segments as tuples (``ValueError``: ``plan JSON: ...``)."""
    try:
        d = json.loads(text)
    except ValueError as err:  # JSONDecodeError, and bad unicode escapes
        raise ValueError(f"plan JSON: not JSON ({err})") from None
    if not isinstance(d, dict):
        raise ValueError(f"plan JSON: expected an object, got a JSON {type(d).__name__}")
    missing = [k for k in FIELDS if k not in d]
    if missing:
        raise ValueError(f"plan JSON: missing field(s) {', '.join(missing)}")
    n, lens = d["cp_size"], d["doc_lens"]
    if not _is_int(n) or n < 1:
        raise ValueError(f"plan JSON: cp_size must be an integer >= 1, got {n!r}")
    if not isinstance(lens, list) or not lens or not all(_is_int(x) and x >= 1 for x in lens):
        raise ValueError("plan JSON: doc_lens must be a non-empty list of integers >= 1")
    if not isinstance(d["strategy"], str):
        raise ValueError(f"plan JSON: strategy must be a string, got {d['strategy']!r}")
    if d["comm"] not in COMMS:
        raise ValueError(f"plan JSON: comm must be one of {COMMS}, got {d['comm']!r}")
    slack = d["token_slack"]
    if isinstance(slack, bool) or not isinstance(slack, int | float) or not math.isfinite(slack) or slack < 0:
        raise ValueError(f"plan JSON: token_slack must be a finite number >= 0, got {slack!r}")
    _cost(d["cost"])
    return {**d, "doc_lens": tuple(lens), "segments": _segments(d["segments"], n, lens)}


SHAPE = ("hidden", "ffn", "heads", "kv_heads", "head_dim", "layers", "dtype_bytes")
"""The model-shape fields of ``CostModel.to_dict()``: integers >= 1 (the device figures are checked by
:class:`flashpar.cost.Hardware` itself)."""


def _cost(cost) -> None:
    if not isinstance(cost, dict):
        raise ValueError("plan JSON: cost must be an object (CostModel.to_dict())")
    bad = [k for k in SHAPE if k in cost and not (_is_int(cost[k]) and cost[k] >= 1)]
    if bad:
        raise ValueError(f"plan JSON: cost.{bad[0]} must be an integer >= 1, got {cost[bad[0]]!r}")
    if "linear" in cost and not isinstance(cost["linear"], bool):
        raise ValueError(f"plan JSON: cost.linear must be true or false, got {cost['linear']!r}")
    if "hardware" in cost and not isinstance(cost["hardware"], dict):
        raise ValueError("plan JSON: cost.hardware must be an object of Hardware figures")


def _segments(segs, n: int, lens: list[int]) -> tuple:
    if not isinstance(segs, list) or len(segs) != n:
        got = len(segs) if isinstance(segs, list) else type(segs).__name__
        raise ValueError(f"plan JSON: segments must hold one list per rank (cp_size {n}), got {got}")
    starts, acc = [], 0
    for x in lens:
        starts.append(acc)
        acc += x
    total, ranges = acc, []
    for r, mine in enumerate(segs):
        if not isinstance(mine, list):
            raise ValueError(f"plan JSON: segments[{r}] must be a list of [start, end] ranges")
        for piece in mine:
            if not (isinstance(piece, list) and len(piece) == 2 and all(map(_is_int, piece))):
                raise ValueError(f"plan JSON: segments[{r}] holds {piece!r}, not a [start, end] pair of integers")
            a, b = piece
            if not 0 <= a < b <= total:
                raise ValueError(f"plan JSON: segments[{r}] range [{a}, {b}) is empty or outside [0, {total})")
            doc = bisect.bisect_right(starts, a) - 1
            if b > starts[doc] + lens[doc]:
                raise ValueError(f"plan JSON: segments[{r}] range [{a}, {b}) crosses the end of document {doc} "
                                 f"(doc_lens)")
            ranges.append((a, b, r))
    ranges.sort()
    at = 0
    for a, b, r in ranges:
        if a != at:
            what = f"tokens [{at}, {a}) are held by no rank" if a > at else f"token {a} is held twice (rank {r})"
            raise ValueError(f"plan JSON: segments do not partition the sequence: {what}")
        at = b
    if at != total:
        raise ValueError(f"plan JSON: segments do not partition the sequence: tokens [{at}, {total}) are held "
                         f"by no rank")
    return tuple(tuple((a, b) for a, b in mine) for mine in segs)
