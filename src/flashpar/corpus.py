"""Real documents that ship with every machine: the Python standard library's own source files.

One document per ``.py`` file of the running interpreter's standard library (``site-packages``
and test suites excluded), in sorted path order, tokenized byte-level (UTF-8 bytes, vocabulary
256).  Tests, the trainer and benchmarks use these instead of a hub download.  The lengths are
real and long-tailed (a few files are over 100K bytes).
"""

from __future__ import annotations

import functools
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

VOCAB_SIZE = 256


@functools.lru_cache(maxsize=1)
def document_paths() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    paths = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    if not paths:
        raise FileNotFoundError(f"no Python source files under {root}: the standard library is missing")
    return tuple(sorted(paths))


def tokenize(text: bytes) -> torch.Tensor:
    """Byte-level tokens (int64)."""
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.long)


def documents(limit: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tokens)`` of each document; empty files are skipped."""
    paths = document_paths()
    root = Path(sysconfig.get_paths()["stdlib"])
    count = 0
    for path in paths:
        if limit is not None and count >= limit:
            return
        data = path.read_bytes()
        if data:
            count += 1
            yield str(path.relative_to(root)), tokenize(data)


@functools.lru_cache(maxsize=8)
def document_lengths(limit: int | None = None) -> list[int]:
    """Token counts of :func:`documents` (file sizes in bytes; no file is read)."""
    sizes = [p.stat().st_size for p in document_paths()]
    sizes = [s for s in sizes if s > 0]
    return sizes[:limit] if limit is not None else sizes
