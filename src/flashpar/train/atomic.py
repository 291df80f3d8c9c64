"""Durable, all-or-nothing folders: what a checkpoint save builds on (``flashpar.train.checkpoint``).

A folder is published in three moves, each durable before the next starts::

    1. write every file into  parent/.NAME.partial/       fsync each file   (a crash: a .partial, ignored)
    2. fsync .NAME.partial/ itself (its entries), then     rename(.NAME.partial, NAME)   (atomic on POSIX)
    3. fsync parent/ (the rename's entry)                  (a crash before: either name, never half of one)

A folder that already has the name is first renamed to ``.NAME.trash`` and deleted after the rename
(a crash in between leaves the new folder under ``.NAME.partial``: not a checkpoint, and the older
ones untouched).  Removing a folder renames it to ``.NAME.trash`` first, so a folder that is half
deleted never carries a checkpoint's name.  ``sweep`` deletes the ``.partial`` and ``.trash`` folders
that a killed process left behind.

``sha256`` is the checksum of the completion marker: read in 1 MiB blocks (memory stays flat whatever
the file's size).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

PARTIAL, TRASH = ".partial", ".trash"
BLOCK = 1 << 20


def partial_of(target: Path) -> Path:
    """Where ``target`` is written before it is published: ``parent/.NAME.partial``."""
    return target.parent / f".{target.name}{PARTIAL}"


def trash_of(target: Path) -> Path:
    return target.parent / f".{target.name}{TRASH}"


def sha256(path: Path) -> str:
    """The file's SHA-256 (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the folder's entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, value) -> None:
    """Write ``value`` as JSON to ``path`` and fsync it (``path`` is in a folder not yet published)."""
    with open(path, "w") as f:
        f.write(json.dumps(value, indent=1))
        f.flush()
        os.fsync(f.fileno())


def describe(folder: Path, names) -> dict[str, dict]:
    """``{name: {"bytes": size, "sha256": hex}}`` of the files ``names`` of ``folder``, each fsynced."""
    out = {}
    for name in names:
        path = folder / name
        fsync_file(path)
        out[name] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    return out


def publish(partial: Path, target: Path) -> None:
    """Steps 2 and 3 of the module docstring: ``partial`` (every file fsynced) becomes ``target``."""
    fsync_dir(partial)
    old = trash_of(target)
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(target, old)
    os.rename(partial, target)
    fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


def remove(folder: Path) -> None:
    """Delete ``folder``: renamed to ``.NAME.trash`` (durably) first, then its files."""
    trash = trash_of(folder)
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(folder, trash)
    fsync_dir(folder.parent)
    shutil.rmtree(trash)


def sweep(parent: Path) -> None:
    """Delete what killed saves left in ``parent``: its ``.*.partial`` and ``.*.trash`` folders."""
    for path in parent.glob(".*"):
        if path.is_dir() and not path.is_symlink() and path.name.endswith((PARTIAL, TRASH)):
            shutil.rmtree(path, ignore_errors=True)
