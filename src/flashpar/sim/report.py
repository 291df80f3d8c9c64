"""What every ``simulate`` command prints and writes: a table of rows, and ``{"setup": ..., "rows": [...]}``.

Each row is a flat dict of plain numbers and strings; ``columns`` names the ones printed, in order, with
their format.  The JSON file holds every key of every row, so a table can show fewer figures than the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence


def format_value(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, str):
        return v
    return format(v, fmt)


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str]], *, title: str = "") -> str:
    """``rows`` as aligned text: ``columns`` is ``[(key, format spec), ...]`` (``""`` for strings)."""
    cells = [[key for key, _ in columns]]
    cells += [[format_value(r.get(key), fmt) for key, fmt in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = [title] if title else []
    for c in cells:
        padded = (x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(c, widths, strict=True)))
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def write_json(path: str | None, setup: dict, rows: Sequence[dict]) -> None:
    """``--json PATH``: ``{"setup": setup, "rows": rows}`` (nothing without a path)."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"setup": setup, "rows": list(rows)}, f, indent=1)
    print(f"wrote {path}")
