"""A checkpoint's completion marker, and the newest checkpoint of a folder that carries one.

    RUN/checkpoints/step_4/flashpar.json    written last by a save (flashpar.train.checkpoint): the save finished
    RUN/checkpoints/step_6/                 no marker: a save that did not finish, never the newest

No torch here: the launcher reads it (the interrupt line, a resume's settings) before any rank starts.
"""

from __future__ import annotations

from pathlib import Path

MARKER = "flashpar.json"  # the completion marker: written last, its presence means the save finished


def step_of(folder: Path) -> int | None:
    """N of a ``step_N`` folder, else None."""
    number = folder.name.removeprefix("step_")
    return int(number) if folder.name.startswith("step_") and number.isdigit() and folder.is_dir() else None


def newest_checkpoint(folder: Path) -> Path | None:
    """The highest ``step_N`` in ``folder`` that carries its completion marker (its checksums are checked when
    it is resumed), or None."""
    steps = [d for d in Path(folder).glob("step_*") if step_of(d) is not None and (d / MARKER).is_file()]
    return max(steps, key=step_of, default=None)
