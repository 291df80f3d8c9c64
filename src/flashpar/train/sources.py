"""``flashpar train --data PATH ...``: the user's documents, read and validated file by file.

What a path holds (``expand``):

    a text file   .txt .md .text          one document: the whole file, UTF-8
    a JSON lines  .jsonl                  one document per line: the line's string field ``text``
    a parquet     .parquet                one document per row: the string column ``text`` (needs pyarrow)
    a folder      every file above in it and its subfolders, in sorted path order (other files are skipped:
                  ``skipped`` names them, and ``flashpar train`` says how many and which in one line)

The paths are read in the order given.  Empty documents (``""``) are skipped; blank lines of a
``.jsonl`` are skipped.  Everything else that is not as above is an error of one line naming the file
(and the line or row): a missing path, a file with another extension, a ``.jsonl`` line that is not
JSON or has no string ``text``, a parquet file without a string ``text`` column (or with a null in it),
text that is not UTF-8, paths with no document at all.

``identity(paths)`` is what the data is, for a resume (``TrainConfig.kept()``): a digest of each
file's name (relative to the folder given, or its own name for a file given) and size, in order;
``stat_key`` adds the modification times (for the token cache: ``flashpar.train.tokens``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".text")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")


def expand(paths) -> list[tuple[Path, str]]:
    """``(file, name)`` of every data file of ``paths``, in order: ``name`` is the file's path relative to the
    folder given (or its own name).  ``ValueError`` (one line) for a missing path or an unknown extension."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[tuple[Path, str]] = []
    for given in paths:
        p = Path(given)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
            files += [(f, f.relative_to(p).as_posix()) for f in found]
        elif p.is_file():
            if p.suffix.lower() not in SUFFIXES:
                raise ValueError(f"--data {p}: unknown extension {p.suffix or '(none)'!r}; expected a folder or a file "
                                 f"ending in {', '.join(SUFFIXES)}")
            files.append((p, p.name))
        else:
            raise ValueError(f"--data {p}: no such file or folder")
    return files


def skipped(paths) -> list[str]:
    """The files inside the folders of ``paths`` that ``expand`` leaves out (another suffix), as paths relative to
    their folder, in sorted order."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out = []
    for given in paths:
        p = Path(given)
        if p.is_dir():
            out += sorted(f.relative_to(p).as_posix() for f in p.rglob("*")
                          if f.is_file() and f.suffix.lower() not in SUFFIXES)
    return out


def skipped_line(paths, shown: int = 5) -> str:
    """One line naming the files ``skipped`` leaves out (the first ``shown`` and how many more); "" when none."""
    names = skipped(paths)
    if not names:
        return ""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return (f"--data: skipped {len(names)} file{'s' if len(names) > 1 else ''} without a {', '.join(SUFFIXES)} "
            f"suffix: {', '.join(names[:shown])}{more}")


def read_file(path: Path) -> Iterator[str]:
    """The documents of one data file, in order (see the module docstring); ``ValueError``: one line."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        text = _utf8(path.read_bytes(), path)
        if text:
            yield text
    elif suffix == ".jsonl":
        yield from _jsonl(path)
    elif suffix == ".parquet":
        yield from _parquet(path)
    else:
        raise ValueError(f"--data {path}: unknown extension {suffix!r}")


def documents(paths, limit: int | None = None) -> Iterator[str]:
    """The documents of every file of ``paths`` (``expand``), in order; the first ``limit`` only if given.
    ``ValueError`` (one line) if there is none."""
    count = 0
    for path, _ in expand(paths):
        for text in read_file(path):
            if limit is not None and count >= limit:
                return
            count += 1
            yield text
    if count == 0:
        raise ValueError(f"--data {' '.join(map(str, paths))}: no documents (every file is empty, or no file has a "
                         f"known extension: {', '.join(SUFFIXES)})")


def identity(paths) -> str:
    """A digest of the data files' names and sizes, in order: equal for the same files, wherever they lie."""
    entries = [[name, path.stat().st_size] for path, name in expand(paths)]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def stat_key(paths) -> list[list]:
    """``[path, size, mtime_ns]`` of every data file: what the token cache was made from."""
    out = []
    for path, _ in expand(paths):
        st = path.stat()
        out.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _utf8(data: bytes, path: Path, where: str = "") -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--data {path}{where}: not UTF-8 text (byte {err.start})") from None


def _jsonl(path: Path) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _utf8(raw, path, f" line {number}")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"--data {path} line {number}: not JSON ({err.msg})") from None
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"--data {path} line {number}: no string field 'text'")
            if text:
                yield text


def _parquet(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"--data {path}: reading .parquet needs pyarrow (pip install 'flashpar[data]')") from None
    import pyarrow as pa

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"--data {path}: not a parquet file ({str(err).splitlines()[0]})") from None
    schema = file.schema_arrow
    if "text" not in schema.names:
        raise ValueError(f"--data {path}: no column 'text' (columns: {', '.join(schema.names) or 'none'})")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"--data {path}: column 'text' holds {kind}, not strings")
    row = 0
    for batch in file.iter_batches(columns=["text"], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text is None:
                raise ValueError(f"--data {path} row {row}: 'text' is null")
            row += 1
            if text:
                yield text
