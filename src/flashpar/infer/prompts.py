"""Reading the prompts of ``flashpar generate``:

    .jsonl   one JSON object a line: {"text": "..."} (needs a tokenizer) or {"tokens": [ids]};
             with --chat: {"messages": [{"role": ..., "content": ...}, ...]} (rendered by the chat template)
    .txt     one prompt a line (blank lines skipped); with --chat: each line one user message
    -        standard input, read as .jsonl

A malformed line is one ``ValueError`` naming the file (``-``: stdin) and its line number.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from flashpar.infer.tokenizer import check_messages

STDIN = "-"


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, and its text where it was given as text."""

    tokens: list[int]
    text: str | None = None


def read_prompts(path, encode=None, chat=None) -> list[Prompt]:
    """The prompts of ``path`` (``encode``: text -> token ids, or None where no tokenizer is known; ``chat``:
    messages -> token ids, with ``--chat`` only)."""
    if str(path) == STDIN:
        lines, suffix = sys.stdin.read().splitlines(), ".jsonl"
    else:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--prompts {path}: no such file")
        if p.suffix not in (".jsonl", ".txt"):
            raise ValueError(f"--prompts {path}: expected a .jsonl or .txt file, or - (stdin, read as .jsonl)")
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--prompts {path}: cannot be read as UTF-8 text: {err}") from None
        suffix = p.suffix
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"--prompts {path} line {number}"
        if suffix == ".txt":
            out.append(_from_chat([{"role": "user", "content": line}], chat, where) if chat is not None
                       else _from_text(line, encode, where))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            stdin = " (stdin is read as .jsonl: one JSON object a line)" if str(path) == STDIN else ""
            raise ValueError(f"{where}: not JSON ({err.msg}){stdin}") from None
        out.append(_from_row(row, encode, chat, where))
    if not out:
        raise ValueError(f"--prompts {path}: no prompts in it")
    return out


def _from_row(row, encode, chat, where: str) -> Prompt:
    if chat is not None:
        if not isinstance(row, dict) or "messages" not in row:
            raise ValueError(f"{where}: with --chat every line is an object with 'messages' "
                             "([{\"role\": ..., \"content\": ...}, ...])")
        return _from_chat(row["messages"], chat, where)
    if isinstance(row, dict) and "messages" in row:
        raise ValueError(f"{where}: a 'messages' prompt is a conversation: give --chat")
    if not isinstance(row, dict) or ("text" in row) == ("tokens" in row):
        raise ValueError(f"{where}: expected an object with one of 'text' or 'tokens'")
    if "text" in row:
        if not isinstance(row["text"], str):
            raise ValueError(f"{where}: 'text' must be a string")
        return _from_text(row["text"], encode, where)
    ids = row["tokens"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{where}: 'tokens' must be a list of integer token ids")
    if not ids:
        raise ValueError(f"{where}: the prompt is empty")
    return Prompt(ids)


def _from_chat(messages, chat, where: str) -> Prompt:
    ids = chat(check_messages(messages, where))
    if not ids:
        raise ValueError(f"{where}: the conversation renders to no tokens")
    return Prompt(ids)


def _from_text(text: str, encode, where: str) -> Prompt:
    if encode is None:
        raise ValueError(f"{where}: a text prompt needs a tokenizer (a tokenizer.json in the model's folder, the "
                         "run's, or --tokenizer); give 'tokens' instead")
    ids = encode(text)
    if not ids:
        raise ValueError(f"{where}: the prompt is empty")
    return Prompt(ids, text)
