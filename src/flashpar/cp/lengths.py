"""Document-length lists, length distributions and packing into fixed-size sequences.

The real lists live in ``shared/data`` (next to the repository; ``FLASHPAR_DATA`` overrides):
one length per line, or a JSON list.  Two distributions are given as buckets: MagiAttention's
histogram (``magi_doclen_histogram.csv``, counts per length range) and the long-context
fine-tuning mix (bucket weights); lengths are sampled uniformly inside a bucket, as
MagiAttention does.

``pack(lengths, tokens)`` cuts the document stream, in order, into sequences of exactly
``tokens`` tokens: a document crossing a boundary is split there and its remainder starts
the next sequence; a final partial sequence is dropped.
"""

from __future__ import annotations

import csv
import json
import os
import random
from pathlib import Path

# Long-context fine-tuning mix (MagiAttention's benchmarks, after ChatQA2): (low, high, weight)
LONG_CONTEXT_MIX = ((1, 2048, 0.16), (2049, 4096, 0.05), (4097, 8192, 0.04), (8193, 16384, 0.06),
                    (16385, 32768, 0.08), (32769, 65536, 0.21), (65537, 131072, 0.40), (131073, 262144, 0.20),
                    (262145, 524288, 0.05), (524289, 1048576, 0.04), (1048577, 2097152, 0.01),
                    (2097153, 4194304, 0.01))


def data_dir() -> Path:
    """``$FLASHPAR_DATA``, else ``shared/data`` beside the repository (or the working directory)."""
    env = os.environ.get("FLASHPAR_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in [Path.cwd(), *here.parents]:
        candidate = parent.parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("shared/data not found beside the repository; set FLASHPAR_DATA to its path")


def read_lengths(path) -> list[int]:
    """One positive length per line, or a JSON list of them."""
    text = Path(path).read_text()
    stripped = text.strip()
    values = json.loads(stripped) if stripped.startswith("[") else [line for line in text.split() if line]
    out = []
    for i, v in enumerate(values):
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: entry {i} ({v!r}) is not an integer length") from None
        if n <= 0:
            raise ValueError(f"{path}: entry {i} is {n}; document lengths must be positive")
        out.append(n)
    if not out:
        raise ValueError(f"{path}: no lengths")
    return out


def read_histogram(path) -> list[tuple[int, int, float]]:
    """``(low, high, count)`` buckets of a CSV whose first two columns are ``"[low, high]"`` and a count."""
    buckets = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row or not row[0].startswith("["):
                continue
            low, high = (int(v) for v in row[0].strip("[]").split(","))
            buckets.append((max(low, 1), high, float(row[1])))
    return buckets


def sample(buckets, count: int, rng: random.Random) -> list[int]:
    """``count`` lengths: a bucket by weight, then uniform inside it."""
    weights = [w for _, _, w in buckets]
    picks = rng.choices(range(len(buckets)), weights=weights, k=count)
    return [rng.randint(buckets[i][0], buckets[i][1]) for i in picks]


def sample_packs(buckets, tokens: int, packs: int, rng: random.Random, cap: int | None = None) -> list[list[int]]:
    """``packs`` sequences of ``tokens`` tokens from sampled lengths (each capped at ``cap`` if given)."""
    lengths: list[int] = []
    while sum(lengths) < tokens * packs:
        lengths += [min(n, cap) if cap is not None else n for n in sample(buckets, 256, rng)]
    return pack(lengths, tokens)[:packs]


def pack(lengths, tokens: int) -> list[list[int]]:
    """Consecutive sequences of exactly ``tokens`` tokens (see the module docstring)."""
    if tokens <= 0:
        raise ValueError(f"tokens per sequence must be positive, got {tokens}")
    packs, current, room = [], [], tokens
    for n in lengths:
        while n > 0:
            take = min(n, room)
            current.append(take)
            n -= take
            room -= take
            if room == 0:
                packs.append(current)
                current, room = [], tokens
    return packs
