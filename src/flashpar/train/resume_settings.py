"""A resumed run continues with its checkpoint's settings: only the flags given again change them.

Every checkpoint's meta.json holds ``settings``: each ``TrainConfig`` field of the run that saved it, as JSON
values (paths absolute).  ``flashpar train --resume RUN/checkpoints`` then needs no other flag::

    the resumed run's value of a setting  =  the flag given now,  else the checkpoint's,  else the default

``--resume auto`` (``AUTO``) is the same with the run's own ``<--out>/checkpoints`` when it holds a marked checkpoint,
and a fresh start when it holds none (``auto_folder``): one command line for a job's first launch and each restart.

Not taken from the checkpoint: what describes this launch rather than the run (``INVOCATION``: ``--resume``
itself, ``--nproc``, which follows the mesh, ``--check``, ``--master-addr``) and ``--init-from`` (the
checkpoint's weights win; its model sizes and tokenizer are in the settings).  What must not change across a
resume (``TrainConfig.kept``) is refused with one line that names the flags (``KEPT_FLAGS``).  A checkpoint
saved without ``settings`` is resumed with the flags given, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashpar.train.marker import MARKER, newest_checkpoint

INVOCATION = ("resume", "nproc", "check", "master_addr", "init_from")
KEPT_FLAGS = {  # TrainConfig.kept()'s keys -> the flags that set them
    "model": "--hidden ... --ffn / --hf-config / --init-from",
    "seq_len": "--seq-len",
    "max_docs": "--max-docs",
    "seed": "--seed",
    "data": "--data",
    "tokenizer": "--tokenizer / --eod-token",
    "held_out": "--eval-every / --eval-docs",
}
PATHS = ("data", "tokenizer", "out")  # absolute in the settings: a resume may start from another folder


def settings(config) -> dict:
    """``config``'s fields as JSON values, paths absolute (what meta.json's ``settings`` holds)."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "model":
            value = value.to_dict()
        elif f.name in PATHS and value is not None:
            value = [str(Path(v).resolve()) for v in value] if isinstance(value, tuple) else str(Path(value).resolve())
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


AUTO = "auto"
"""``--resume auto``: the run's own newest checkpoint (``<--out>/checkpoints``) if it has one, else a fresh start: the
command line a first launch and every restart can share."""


def auto_folder(out) -> Path | None:
    """What ``--resume auto`` resumes: ``<out>/checkpoints`` when a ``step_*`` folder there is marked complete
    (checked later, as ``--resume``'s: a broken newest one skipped with one line), else None (a fresh start)."""
    folder = Path(out) / "checkpoints"
    return folder if newest(folder) is not None else None


def newest(path: Path) -> Path | None:
    """The checkpoint ``--resume path`` names: ``path`` itself when it holds a marker, else its newest ``step_*``
    that does (None: none; the checksums are checked later, when the run resolves the checkpoint)."""
    path = Path(path)
    return path if (path / MARKER).is_file() else newest_checkpoint(path)


def saved(path: str) -> dict | None:
    """The settings of the checkpoint ``--resume path`` names (None: it has none, or none is found: the run's
    own checks then say what is wrong in one line)."""
    folder = newest(Path(path))
    if folder is None:
        return None
    try:
        value = json.loads((folder / "meta.json").read_text()).get("settings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, dict) else None


def merged(values: dict, given: set[str], saved_settings: dict) -> tuple[dict, list[str]]:
    """``values`` (the parsed flags, by field) with every field not in ``given`` taken from ``saved_settings``;
    and the fields that were taken (for the run's one line)."""
    taken = []
    out = dict(values)
    for name, value in saved_settings.items():
        if name in values and name not in given and name not in INVOCATION and value != values[name]:
            out[name] = tuple(value) if isinstance(value, list) else value
            taken.append(name)
    return out, taken


def difference_line(path, differ: list[str], meta: dict, kept: dict) -> str:
    """The one line refusing a resume whose kept settings differ, by flag."""
    parts = [f"{KEPT_FLAGS.get(k, k)} {_short(meta.get(k))} there, {_short(kept[k])} here" for k in differ]
    return (f"checkpoint {path} was made with other settings: " + "; ".join(parts)
            + " (leave those flags out to continue with the checkpoint's)")


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."
