"""What the trainer and ``flashpar generate`` both read of a Hugging Face tokenizer's files (no torch, no
``tokenizers``): where ``tokenizer.json`` is, the end-of-text names, a special token as transformers writes it.

    FOLDER/tokenizer.json          the tokenizer (``tokenizer_json``: the file, or a folder holding it)
    FOLDER/tokenizer_config.json   "eos_token": "</s>"  or  {"content": "</s>", ...}   (``token_text``)
"""

from __future__ import annotations

from pathlib import Path

EOD_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")  # end-of-text names, looked for in this order


def tokenizer_json(path) -> Path:
    """The ``tokenizer.json`` of ``path`` (the file, or a folder holding it); ``ValueError`` where there is none."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
    return p


def token_text(value) -> str | None:
    """A special token of ``tokenizer_config.json`` (a string, or an object with its ``content``) as text; None
    for anything else."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None
