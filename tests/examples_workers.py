"""Rank bodies for tests/test_docs_examples.py: each multi-rank example's ``main(rank, world)``, in one spawn."""

from __future__ import annotations

import importlib.util
import traceback
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def load(name: str):
    """The example ``docs/examples/<name>.py`` as a module (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_examples(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """``{name: None}`` where ``main(rank, world)`` of the example ran through, else its traceback."""
    out = {}
    for name in names:
        try:
            load(name).main(rank, world)
            out[name] = None
        except Exception:  # noqa: BLE001 - reported to the test
            out[name] = traceback.format_exc()
    return out
