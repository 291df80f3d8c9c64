"""Which tokenizer a run's data are tokenized with, when the model comes from a Hugging Face folder.

A folder's weights were trained with the folder's own ``tokenizer.json``: tokens from any other tokenizer (UTF-8
bytes included) index the wrong embedding rows and train without an error.  So::

    --init-from F       --tokenizer       F/tokenizer.json    the run's tokenizer
    ----------------    --------------    ----------------    -----------------------------------------
    not given           T                 -                   T (or bytes when T is not given)
    F                   not given         present             F's, said in one line
    F                   T, same bytes     present             T
    F                   T, other bytes    present             refused: one line (leave --tokenizer out)
    F                   not given         absent              bytes, with one warning line
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from flashpar.tokenizer_files import tokenizer_json


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def choose(tokenizer: str | None, init_from: str | None) -> tuple[str | None, str | None]:
    """``(the run's tokenizer, the line to print or None)``; ``ValueError`` (one line) for a ``--tokenizer``
    other than ``--init-from``'s own."""
    if init_from is None:
        return tokenizer, None
    own = Path(init_from) / "tokenizer.json"
    if not own.is_file():
        if tokenizer is None:
            return None, (f"warning: --init-from {init_from} has no tokenizer.json: the data are tokenized as "
                          "UTF-8 bytes (give --tokenizer to use the model's own)")
        return tokenizer, None
    if tokenizer is None:
        return str(own), f"--init-from {init_from}: the data are tokenized with its tokenizer.json"
    if _digest(tokenizer_json(tokenizer)) != _digest(own):  # (no tokenizer there: its one line)
        raise ValueError(f"--tokenizer {tokenizer} is not --init-from {init_from}'s tokenizer.json, the one its "
                         "weights were trained with: leave --tokenizer out to use the folder's")
    return tokenizer, None
