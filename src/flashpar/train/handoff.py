"""What an exported model needs beside its weights: the tokenizer's files and a generation config.

    checkpoint meta.json  "sources": {"tokenizer": PATH, "eod": ID, "eod_token": TOKEN, "init_from": FOLDER}
          (written by every save: where the run's tokens and first weights came from)
                │
    flashpar export ──> OUT/ config.json, model.safetensors         (flashpar.models.save_hf)
                         tokenizer.json (+ tokenizer_config.json, special_tokens_map.json, ... when the source
                           folder has them; a tokenizer_config.json naming the end-of-document token otherwise)
                         generation_config.json  (the --init-from folder's; else {"eos_token_id": the run's eod},
                           so that transformers' generate stops at the end-of-text token)

A run on bytes (no ``--tokenizer``) has no tokenizer to copy and no end-of-document token: only the weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
GENERATION = "generation_config.json"


def sources(config) -> dict:
    """The ``sources`` entry of a checkpoint's meta.json for run ``config`` (absolute paths; None when unused)."""
    out = {"tokenizer": None, "eod": None, "eod_token": None,
           "init_from": str(Path(config.init_from).resolve()) if config.init_from else None}
    if config.tokenizer:
        from flashpar.train.tokens import load_tokenizer

        tok = load_tokenizer(config.tokenizer, config.eod_token)
        out.update(tokenizer=tok.path, eod=tok.eod, eod_token=tok.eod_token)
    return out


def sources_of(checkpoint: Path) -> dict:
    """The ``sources`` a checkpoint recorded ({} for one saved without them)."""
    try:
        value = json.loads((Path(checkpoint) / "meta.json").read_text()).get("sources")
    except (OSError, ValueError, AttributeError):
        return {}
    return value if isinstance(value, dict) else {}


def copy_tokenizer(tokenizer, out: Path, eod_token: str | None = None) -> list[str]:
    """Copy the tokenizer at ``tokenizer`` (a folder, or its ``tokenizer.json``) into ``out``: every file of
    ``TOKENIZER_FILES`` beside it, and a ``tokenizer_config.json`` naming the end-of-document token where there is
    none (``eod_token``: the run's; else the one ``flashpar.train.tokens`` finds).  The names written; [] without
    a tokenizer.  ``ValueError`` (one line) when the path holds no tokenizer.json."""
    if not tokenizer:
        return []
    from flashpar.train.tokens import load_tokenizer

    src = Path(tokenizer)
    folder = src if src.is_dir() else src.parent
    tok = load_tokenizer(src, eod_token)  # checks it: one line when it is not a tokenizer
    written = []
    for name in TOKENIZER_FILES:
        path = Path(tok.path) if name == "tokenizer.json" else folder / name
        if path.is_file():
            shutil.copyfile(path, out / name)
            written.append(name)
    if "tokenizer_config.json" not in written:
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eod_token}, indent=2) + "\n")
        written.append("tokenizer_config.json")
    return written


def write_generation_config(init_from, out: Path, eod: int | None) -> list[str]:
    """``generation_config.json`` in ``out``: the ``init_from`` folder's when it has one, with ``eod`` (the run's
    end-of-document id) added to its ``eos_token_id`` when missing there (a list then: generation stops at any);
    else one whose ``eos_token_id`` is ``eod``; [] when there is neither (a run on bytes).  ``ValueError`` when the
    source's file is not a JSON object."""
    source = Path(init_from) / GENERATION if init_from else None
    value = {}
    if source is not None and source.is_file():
        try:
            value = json.loads(source.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{source}: not readable JSON ({err})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{source}: not a JSON object")
    elif eod is None:
        return []
    if eod is not None:
        eos = value.get("eos_token_id")
        ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
        if int(eod) not in ids:
            if ids:  # the source's, changed: transformers must not rebuild it from config.json
                value["_from_model_config"] = False
            ids.append(int(eod))
        value["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    (out / GENERATION).write_text(json.dumps(value, indent=2) + "\n")
    return [GENERATION]


def ordinary_modes(out: Path, names) -> None:
    """Give the files ``names`` of ``out`` the mode a new file gets here (``0666`` less the umask), whatever the
    writer used (safetensors writes through a private temporary file)."""
    umask = os.umask(0)
    os.umask(umask)
    for name in names:
        os.chmod(out / name, 0o666 & ~umask)
