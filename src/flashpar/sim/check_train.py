"""``flashpar simulate check`` on a ``flashpar bench train`` report: not built yet (issue 14)."""

from __future__ import annotations


def check(report: dict) -> list[dict]:
    raise ValueError("simulate check of a bench train report is not built yet")
