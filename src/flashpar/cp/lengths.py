"""Document-length sources (shipped lists, bucket distributions, files) and packing into fixed-size sequences.

Sources.  :func:`resolve_lengths` turns what a user writes after ``--lengths`` into a :class:`Lengths`,
the one meaning of that option in every command (``flashpar plan``, ``bench cp``, ``bench plan``):

* a shipped name (:data:`NAMES`): the lists of :data:`LISTS`, package data in ``flashpar/data/``
  (sources and licences in its ``SOURCES.md``), read with :mod:`importlib.resources`, and two bucket
  distributions, ``magi`` (MagiAttention's histogram, ``magi_doclen_histogram.csv``: counts per length
  range) and ``long-context`` (the long-context fine-tuning mix, :data:`LONG_CONTEXT_MIX`: weights);
* else the path of a file: a ``.csv`` histogram as above, or lengths one per line or as a JSON list.

A distribution is sampled as MagiAttention does: a bucket by weight, then a length uniform inside it.

Packing.  :class:`Packing` lays the documents end to end in one stream, document ``d`` holding the
positions ``[starts[d], starts[d] + lengths[d])``, and cuts it into sequences of exactly ``T`` tokens:
sequence ``i`` is the stream slice ``[i T, (i + 1) T)``, so a document crossing a boundary is split
there and its remainder starts the next sequence, and a final partial sequence is dropped.  It is
random access (a bisection per sequence), which the trainer's :class:`~flashpar.train.data.PackedCorpus`
needs; :func:`pack` is the list of all its sequences.
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import json
import os
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# Long-context fine-tuning mix (MagiAttention's benchmarks, after ChatQA2): (low, high, weight)
LONG_CONTEXT_MIX = ((1, 2048, 0.16), (2049, 4096, 0.05), (4097, 8192, 0.04), (8193, 16384, 0.06),
                    (16385, 32768, 0.08), (32769, 65536, 0.21), (65537, 131072, 0.40), (131073, 262144, 0.20),
                    (262145, 524288, 0.05), (524289, 1048576, 0.04), (1048577, 2097152, 0.01),
                    (2097153, 4194304, 0.01))
LISTS = ("wlbllm", "prolong", "python311_stdlib", "spamassassin", "sotu")  # flashpar/data/<name>.lengths
DISTRIBUTIONS = ("magi", "long-context")  # sampled: MagiAttention's histogram, the long-context mix
NAMES = LISTS + DISTRIBUTIONS
_HISTOGRAM_FILE = "magi_doclen_histogram.csv"
LENGTHS_HELP = (f"document lengths: a shipped name ({', '.join(NAMES)}) or the path of a file (one length per line, "
                "a JSON list, or a .csv histogram)")  # the --lengths help of every command


@dataclass(frozen=True)
class Lengths:
    """A source of document lengths: a list (``values``: one length per document, in order) or a bucket
    distribution (``buckets``: ``(low, high, weight)``, sampled).  ``name`` is the shipped name or the path."""

    name: str
    values: tuple[int, ...] | None = None
    buckets: tuple[tuple[int, int, float], ...] | None = None

    @property
    def sampled(self) -> bool:
        return self.buckets is not None

    def packs(self, tokens: int, count: int | None = None, *, seed: int = 0, cap: int | None = None,
              scale: int = 1) -> list[list[int]]:
        """The first ``count`` sequences of exactly ``tokens`` tokens (all of a list's when ``None``).

        Each length is capped at ``cap`` (if given), then divided by ``scale`` (at least 1 token).  A list
        packs its documents in order; a distribution packs lengths sampled with ``random.Random(seed)``,
        256 at a time, until they fill ``count`` sequences (it needs a ``count``)."""
        if not isinstance(scale, int) or scale < 1:
            raise ValueError(f"scale must be a positive int, got {scale!r}")
        if count is not None and count < 0:
            raise ValueError(f"pack count must be >= 0, got {count}")
        shrink = lambda n: max(1, (min(n, cap) if cap is not None else n) // scale)  # noqa: E731
        if not self.sampled:
            return pack([shrink(n) for n in self.values], tokens, count)
        if count is None:
            raise ValueError(f"{self.name} is a sampled distribution: give a number of packs")
        if tokens <= 0:
            raise ValueError(f"tokens per sequence must be positive, got {tokens}")
        rng, lengths, total = random.Random(seed), [], 0
        while total < tokens * count:
            drawn = [shrink(n) for n in sample(self.buckets, 256, rng)]
            lengths += drawn
            total += sum(drawn)
        return pack(lengths, tokens, count)


def resolve_lengths(spec: str | os.PathLike) -> Lengths:
    """What ``--lengths`` names, in every command: a shipped name (:data:`NAMES`) or the path of a file
    (a ``.csv`` histogram, else lengths one per line or a JSON list).  Anything else: one-line ``ValueError``."""
    s = os.fspath(spec)
    if s in LISTS:
        return Lengths(s, values=tuple(parse_lengths(_shipped(f"{s}.lengths"), s)))
    if s == "magi":
        return Lengths(s, buckets=tuple(parse_histogram(_shipped(_HISTOGRAM_FILE))))
    if s == "long-context":
        return Lengths(s, buckets=LONG_CONTEXT_MIX)
    path = Path(s)
    if path.is_file():
        if path.suffix == ".csv":
            return Lengths(s, buckets=tuple(read_histogram(path)))
        return Lengths(s, values=tuple(read_lengths(path)))
    raise ValueError(f"unknown lengths {s!r}: expected a shipped name ({', '.join(NAMES)}) or the path of a file")


def _shipped(filename: str) -> str:
    """The text of a package data file of ``flashpar/data``."""
    return resources.files("flashpar.data").joinpath(filename).read_text()


def parse_lengths(text: str, where: str) -> list[int]:
    """One positive length per line (or several, whitespace apart), or a JSON list of them (``where`` names the
    source in errors, with the line number, or the entry of a JSON list)."""
    stripped = text.strip()
    if stripped.startswith("["):
        values = [(f"entry {i} of the JSON list", v) for i, v in enumerate(json.loads(stripped))]
    else:
        values = [(f"line {number}", v) for number, line in enumerate(text.splitlines(), start=1) for v in line.split()]
    out = []
    for at, v in values:
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise ValueError(f"{where} {at}: {v!r} is not an integer length") from None
        if n <= 0:
            raise ValueError(f"{where} {at}: {n}; document lengths must be positive")
        out.append(n)
    if not out:
        raise ValueError(f"{where}: no lengths")
    return out


def read_lengths(path) -> list[int]:
    """:func:`parse_lengths` of a file."""
    return parse_lengths(Path(path).read_text(), str(path))


def parse_histogram(text: str) -> list[tuple[int, int, float]]:
    """``(low, high, count)`` buckets of a CSV whose first two columns are ``"[low, high]"`` and a count."""
    buckets = []
    for row in csv.reader(io.StringIO(text)):
        if not row or not row[0].startswith("["):
            continue
        low, high = (int(v) for v in row[0].strip("[]").split(","))
        buckets.append((max(low, 1), high, float(row[1])))
    return buckets


def read_histogram(path) -> list[tuple[int, int, float]]:
    """:func:`parse_histogram` of a file."""
    return parse_histogram(Path(path).read_text())


def sample(buckets, count: int, rng: random.Random) -> list[int]:
    """``count`` lengths: a bucket by weight, then uniform inside it."""
    weights = [w for _, _, w in buckets]
    picks = rng.choices(range(len(buckets)), weights=weights, k=count)
    return [rng.randint(buckets[i][0], buckets[i][1]) for i in picks]


class Packing:
    """Documents of ``lengths`` end to end, cut into sequences of exactly ``tokens`` (the module docstring).

    ``starts[d]`` is the stream offset of document ``d``, ``total`` the stream's length; ``len()`` is
    ``total // tokens``.  Zero-length documents take no place."""

    def __init__(self, lengths, tokens: int):
        if tokens <= 0:
            raise ValueError(f"tokens per sequence must be positive, got {tokens}")
        self.lengths, self.tokens = list(lengths), tokens
        if any(n < 0 for n in self.lengths):
            raise ValueError("document lengths must be >= 0")
        self.starts = list(itertools.accumulate(self.lengths, initial=0))
        self.total = self.starts.pop()

    def __len__(self) -> int:
        return self.total // self.tokens

    def bounds(self, i: int) -> tuple[int, int]:
        """The stream slice ``[a, b)`` of sequence ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range: the documents pack into {len(self)} sequences")
        return i * self.tokens, (i + 1) * self.tokens

    def pieces(self, i: int) -> list[tuple[int, int, bool]]:
        """``(document, length, ends_its_document)`` of each document piece in sequence ``i``, in order."""
        a, b = self.bounds(i)
        d = bisect.bisect_right(self.starts, a) - 1  # the last document starting at or before a: holds a
        out = []
        while a < b:
            doc_end = self.starts[d] + self.lengths[d]
            end = min(doc_end, b)
            if end > a:
                out.append((d, end - a, end == doc_end))
            a, d = end, d + 1
        return out

    def doc_lens(self, i: int) -> list[int]:
        """Lengths of the document pieces in sequence ``i`` (they sum to ``tokens``)."""
        return [n for _, n, _ in self.pieces(i)]


def pack(lengths, tokens: int, count: int | None = None) -> list[list[int]]:
    """The first ``count`` sequences (every one when ``None``) of :class:`Packing` ``(lengths, tokens)``, as
    their document pieces' lengths; sequences past ``count`` are not cut."""
    p = Packing(lengths, tokens)
    return [p.doc_lens(i) for i in range(len(p) if count is None else min(count, len(p)))]
