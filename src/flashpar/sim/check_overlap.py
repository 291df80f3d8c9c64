"""``flashpar simulate check`` on a ``flashpar bench overlap`` report: not built yet (issue 14)."""

from __future__ import annotations


def check(report: dict) -> list[dict]:
    raise ValueError("simulate check of a bench overlap report is not built yet")
