"""Reading the prompts of ``flashpar generate``: a ``.jsonl`` file, one JSON object a line with ``text`` (needs a
tokenizer) or ``tokens`` (a list of token ids), or a ``.txt`` file, one prompt a line (blank lines skipped).
A malformed line is one ``ValueError`` naming the file and its line number."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, and its text where it was given as text."""

    tokens: list[int]
    text: str | None = None


def read_prompts(path, encode=None) -> list[Prompt]:
    """The prompts of ``path`` (``encode``: text -> token ids, or None where no tokenizer is known)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts {path}: no such file")
    if p.suffix not in (".jsonl", ".txt"):
        raise ValueError(f"--prompts {path}: expected a .jsonl or .txt file")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--prompts {path}: cannot be read as UTF-8 text: {err}") from None
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"--prompts {path} line {number}"
        if p.suffix == ".txt":
            out.append(_from_text(line, encode, where))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or ("text" in row) == ("tokens" in row):
            raise ValueError(f"{where}: expected an object with one of 'text' or 'tokens'")
        if "text" in row:
            if not isinstance(row["text"], str):
                raise ValueError(f"{where}: 'text' must be a string")
            out.append(_from_text(row["text"], encode, where))
        else:
            ids = row["tokens"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{where}: 'tokens' must be a list of integer token ids")
            if not ids:
                raise ValueError(f"{where}: the prompt is empty")
            out.append(Prompt(ids))
    if not out:
        raise ValueError(f"--prompts {path}: no prompts in it")
    return out


def _from_text(text: str, encode, where: str) -> Prompt:
    if encode is None:
        raise ValueError(f"{where}: a text prompt needs a tokenizer (a tokenizer.json in the model's folder, or "
                         "--tokenizer); give 'tokens' instead")
    ids = encode(text)
    if not ids:
        raise ValueError(f"{where}: the prompt is empty")
    return Prompt(ids, text)
