"""Where an output ends, and why: its ``finish_reason``.

    "eos"     the end-of-text token (``eos_id``): kept as the output's last token
    "stop"    a stop token (``stop_ids``): kept as the last token; or a stop string (``stop``) in the output's text:
              the tokens up to the one that completes it, the text cut just before it (the stop string is not in
              the text, as vLLM does by default)
    "length"  ``max_new_tokens`` tokens, none of the above

The first of them in the output wins.  A stop string is searched for in ``decode(tokens[:k])``, the text of the
first ``k`` tokens; the output ends at the smallest ``k`` whose text holds one (found by bisection: a text that
holds a stop string still holds it with more tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

EOS, STOP, LENGTH = "eos", "stop", "length"


@dataclass(frozen=True)
class Stopping:
    """What ends an output: ``eos_id`` (None: none), ``stop_ids``, ``stop`` strings (read through ``decode``,
    the tokenizer's ids -> text, which they need)."""

    eos_id: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    @property
    def enders(self) -> list[int]:
        """The token ids that end an output."""
        return sorted({*self.stop_ids, *([] if self.eos_id is None else [self.eos_id])})

    def __bool__(self) -> bool:
        return bool(self.enders or self.stop)


def check_stopping(stopping: Stopping, vocab_size: int, decode) -> None:
    """``ValueError`` (one line) for a stop token outside the vocabulary, an empty stop string, or stop strings
    without ``decode``."""
    for name, ids in (("eos_id", [] if stopping.eos_id is None else [stopping.eos_id]),
                      ("stop_ids", stopping.stop_ids)):
        for t in ids:
            if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size):
                raise ValueError(f"{name}: {t!r} is not a token id of the vocabulary [0, {vocab_size})")
    for s in stopping.stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop: {s!r}: a stop string must be a non-empty string")
    if stopping.stop and decode is None:
        raise ValueError("stop strings need the tokenizer's decode (ids -> text)")


def stop_string_end(tokens: Sequence[int], stop: Sequence[str], decode: Callable) -> tuple[int, int] | None:
    """``(k, cut)``: the fewest tokens ``k`` whose text holds a stop string, and where in that text the earliest
    one starts; None where ``decode(tokens)`` holds none."""
    def holds(k: int) -> bool:
        text = decode(list(tokens[:k]))
        return any(s in text for s in stop)

    if not stop or not tokens or not holds(len(tokens)):
        return None
    lo, hi = 1, len(tokens)  # holds(hi) is true; find the smallest
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    text = decode(list(tokens[:lo]))
    return lo, min(text.find(s) for s in stop if s in text)


def finish(tokens: Sequence[int], stopping: Stopping, decode: Callable | None) -> tuple[list[int], str, str | None]:
    """An output's ``(tokens, finish_reason, text)`` from the tokens generated for it (text: None without
    ``decode``)."""
    tokens, reason = list(tokens), LENGTH
    enders = set(stopping.enders)
    end = next((i for i, t in enumerate(tokens) if t in enders), None)
    if end is not None:
        tokens, reason = tokens[:end + 1], EOS if tokens[end] == stopping.eos_id else STOP
    found = stop_string_end(tokens, stopping.stop, decode) if stopping.stop else None
    if found is not None:
        k, cut = found
        return tokens[:k], STOP, decode(tokens[:k])[:cut]
    return tokens, reason, decode(tokens) if decode is not None else None
