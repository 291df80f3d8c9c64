"""Tokens of the trainer's documents: the ``--tokenizer`` and the token cache, tokenized once per run.

Tokenizer (``load_tokenizer``).  A Hugging Face ``tokenizer.json`` (or a folder holding one), read by
the ``tokenizers`` library, with its truncation and padding switched off (a document is never cut).
It must fit the model: ``vocab`` (its size, added tokens included) ``<= vocab_size`` and every id it
can emit (its largest id) ``< vocab_size``.  A document is ``encode(text)`` (the tokenizer's own
special tokens, e.g. Llama 3's ``<|begin_of_text|>``) followed by the end-of-document token ``eod``
unless it already ends with it.  ``eod`` is ``--eod-token`` if given, else the ``eos_token`` of a
``tokenizer_config.json`` beside the file, else the first of ``EOD_NAMES`` in the vocabulary.  Without
``--tokenizer`` a document is its UTF-8 bytes (vocabulary 256, no end-of-document token: every id is
in use), as :mod:`flashpar.corpus` tokenizes.

Token cache (``prepare`` / ``TokenCache``).  The documents (``--data``, else the standard-library corpus,
the first ``--max-docs``) are tokenized by a pool of ``--workers`` processes (in this process with
``--workers 0``), in order, into ``<out>/tokens/<key>/``::

    tokens.bin   every document's tokens end to end, uint8 (bytes), uint16 (ids < 65536) or uint32
    index.json   the document lengths, the dtype, and what they were made from: the files (path, size,
                 mtime), the tokenizer (sha256 of its files, eod), --max-docs; ``key`` is its digest

``index.json`` is written last, and both files by atomic rename, so a folder with an index is complete
and two processes that build the same cache at once write the same bytes.  Who builds:
the spawn launcher, in ``ready()`` before the ranks start; under torchrun the process with
``LOCAL_RANK`` 0 of each node (every other process waits for the index up to ``--timeout`` and
reads it); a rank that finds no cache (``train`` called directly) builds it itself.  A resumed run
with the same files finds the cache and reads it.  The builder says so in one line on stderr before the
first document is read, then shows a bar of the documents and tokens done.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashpar.tokenizer_files import EOD_NAMES, token_text, tokenizer_json

BATCH_CHARS = 1 << 20  # text per task sent to a tokenizing worker
INDEX_VERSION = 1


@dataclass(frozen=True)
class TokenizerFile:
    """A validated ``tokenizer.json``: its text (what the workers load), digest, size and end-of-document id."""

    path: str
    text: str
    sha256: str  # of tokenizer.json (and the tokenizer_config.json read for eos_token)
    vocab: int  # get_vocab_size(with_added_tokens=True)
    max_id: int  # the largest id it can emit
    eod: int
    eod_token: str

    def identity(self) -> str:
        return f"{self.sha256[:16]} eod {self.eod}"


def load_tokenizer(path, eod_token: str | None = None, vocab_size: int | None = None, *,
                   fix: str = "use the tokenizer the model was made for") -> TokenizerFile:
    """``path``'s tokenizer, checked against the model's ``vocab_size``; ``ValueError``: one line, ending with
    ``fix`` (what the caller's command can do about a vocabulary that does not fit: ``{need}`` is the size that
    would fit)."""
    p = tokenizer_json(path)
    st = p.stat()
    return _load(str(p.resolve()), st.st_size, st.st_mtime_ns, eod_token, vocab_size, fix)


@functools.lru_cache(maxsize=4)
def _load(path: str, size: int, mtime_ns: int, eod_token: str | None, vocab_size: int | None,
          fix: str) -> TokenizerFile:
    from tokenizers import Tokenizer

    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
        tok = Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - the library raises its own exception types
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({first})") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    size_with_added = tok.get_vocab_size(with_added_tokens=True)
    max_id = max(vocab.values(), default=-1)
    if vocab_size is not None and (size_with_added > vocab_size or max_id >= vocab_size):
        raise ValueError(f"--tokenizer {path}: its vocabulary ({size_with_added} tokens, largest id {max_id}) does not "
                         f"fit the model's vocab_size {vocab_size}; "
                         + fix.format(need=max(size_with_added, max_id + 1)))
    digest = hashlib.sha256(raw)
    config_eos = None
    if eod_token is None:
        beside = Path(path).with_name("tokenizer_config.json")
        if beside.is_file():
            config_raw = beside.read_bytes()
            digest.update(config_raw)
            config_eos = _eos_of(config_raw)
    names = [eod_token] if eod_token is not None else [n for n in (config_eos, *EOD_NAMES) if n]
    found = next((n for n in names if n in vocab), None)
    if found is None:
        if eod_token is not None:
            raise ValueError(f"--eod-token {eod_token!r} is not in the vocabulary of {path}")
        raise ValueError(f"--tokenizer {path}: none of the end-of-document tokens {', '.join(names)} is in its "
                         "vocabulary; name one with --eod-token")
    return TokenizerFile(path=path, text=text, sha256=digest.hexdigest(), vocab=size_with_added, max_id=max_id,
                         eod=vocab[found], eod_token=found)


def _eos_of(config_raw: bytes) -> str | None:
    try:
        return token_text(json.loads(config_raw).get("eos_token"))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None


# ---- encoding: in the workers -----------------------------------------------------------------------------

_WORKER: dict = {}  # this process's tokenizer (None: bytes), eod id, dtype, vocabulary bound


def _init(text: str | None, eod: int, dtype: str, vocab_size: int) -> None:
    tok = None
    if text is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(text)
        tok.no_truncation()
        tok.no_padding()
    _WORKER.update(tok=tok, eod=eod, dtype=dtype, vocab_size=vocab_size)


def _pool_init(parent_pid: int, *init) -> None:
    """A tokenizing worker: ends with the process that started it (``flashpar.lifeline``), leaves Ctrl-C to it
    (the pool is ended by its owner: no traceback per worker), then ``_init``."""
    import signal

    from flashpar.lifeline import die_with_parent

    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init(*init)


def _encode(texts: list[str]) -> tuple[list[int], bytes]:
    """``(lengths, tokens)`` of a batch of documents: each one's ids (and the end-of-document id), as bytes."""
    tok, eod, dtype = _WORKER["tok"], _WORKER["eod"], _WORKER["dtype"]
    if tok is None:
        docs = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    else:
        docs = []
        for enc in tok.encode_batch(texts):
            ids = enc.ids
            if not ids or ids[-1] != eod:
                ids = [*ids, eod]
            docs.append(np.asarray(ids, dtype=np.int64))
    flat = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
    if flat.size and int(flat.max()) >= _WORKER["vocab_size"]:  # not with a checked tokenizer: the guard
        raise ValueError(f"the tokenizer emitted id {int(flat.max())}, outside the model's vocab_size "
                         f"{_WORKER['vocab_size']}")
    return [len(d) for d in docs], flat.astype(dtype).tobytes()


# ---- the cache ----------------------------------------------------------------------------------------------


def _texts(config) -> Iterator[str]:
    """The run's documents as text, in order (the first ``max_docs``)."""
    if config.data:
        from flashpar.train.sources import documents

        yield from documents(config.data, config.max_docs)
        return
    from flashpar import corpus

    for _, data in corpus.documents(config.max_docs):  # int64 byte values
        yield data.numpy().astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _sources(config) -> list[list]:
    if config.data:
        from flashpar.train.sources import stat_key

        return stat_key(config.data)
    from flashpar import corpus

    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in corpus.document_paths()]


def uses_cache(config) -> bool:
    """Whether the run's tokens come from the cache (``--data`` or ``--tokenizer``), not the byte corpus."""
    return bool(config.data) or config.tokenizer is not None


def bytes_fit(vocab_size: int, init_from: str | None = None) -> None:
    """``ValueError`` (one line) unless the byte tokens 0-255 are in the model's vocabulary; the advice is what
    ``flashpar train`` can do (a model of ``--init-from`` has its sizes: only a tokenizer can fit it)."""
    if vocab_size < 256:
        fix = ("give --tokenizer: the tokenizer.json the model was trained with" if init_from else
               "give a --tokenizer that fits, or --vocab-size 256 or more")
        raise ValueError(f"the byte tokens (0-255) do not fit the model's vocab_size {vocab_size}; {fix}")


def vocabulary_fix(config) -> str:
    """What ``flashpar train`` can do about a tokenizer that does not fit the model: the sizes of ``--init-from``
    are the folder's, so only its own tokenizer fits there."""
    if getattr(config, "init_from", None):
        return (f"the model of --init-from {config.init_from} is fixed: use the tokenizer it was trained with "
                "(leave --tokenizer out to take the folder's)")
    return "use --vocab-size {need} or more"


def describe(config) -> dict:
    """What the cache of ``config`` is made from (``index.json`` without the lengths); checks the tokenizer."""
    vocab_size = config.model.vocab_size
    if config.tokenizer is not None:
        tok = load_tokenizer(config.tokenizer, config.eod_token, vocab_size, fix=vocabulary_fix(config))
        tokenizer = {"path": tok.path, "sha256": tok.sha256, "eod": tok.eod, "eod_token": tok.eod_token}
        dtype = "uint16" if tok.max_id < 1 << 16 else "uint32"
    else:
        bytes_fit(vocab_size, getattr(config, "init_from", None))
        tokenizer, dtype = None, "uint8"
    return {"version": INDEX_VERSION, "sources": _sources(config), "max_docs": config.max_docs,
            "tokenizer": tokenizer, "dtype": dtype}


def folder(config, about: dict) -> Path:
    key = hashlib.sha256(json.dumps(about, sort_keys=True).encode()).hexdigest()[:16]
    return Path(config.out) / "tokens" / key


def prepare(config, *, wait: bool | None = None) -> Path:
    """The cache folder of ``config``, built if missing (see the module docstring): ``wait`` (default: under
    torchrun on a process whose ``LOCAL_RANK`` is not 0) waits for another process to build it instead."""
    about = describe(config)
    where = folder(config, about)
    if (where / "index.json").is_file():
        return where
    if wait is None:
        wait = "RANK" in os.environ and os.environ.get("LOCAL_RANK", "0") != "0"
    if wait:
        deadline = time.monotonic() + config.timeout
        while not (where / "index.json").is_file():
            if time.monotonic() > deadline:
                raise ValueError(f"waited {config.timeout:.0f} s (--timeout) for the token cache {where} that local "
                                 "rank 0 builds; raise --timeout for a large corpus")
            time.sleep(0.2)
        return where
    files = f"--data {' '.join(map(str, config.data))}" if config.data else "the byte corpus"
    print(f"flashpar: tokenizing {files} into {where} (once: later runs with the same data and tokenizer read it)",
          file=sys.stderr, flush=True)
    build(where, about, _texts(config), config.model.vocab_size, config.workers, progress=True,
          tokenizer_text=load_tokenizer(config.tokenizer, config.eod_token).text if config.tokenizer else None)
    return where


def build(where: Path, about: dict, texts, vocab_size: int, workers: int, *, tokenizer_text: str | None,
          progress: bool = False) -> None:
    """Tokenize ``texts`` (an iterator of documents) with ``workers`` processes into ``where`` (atomic);
    ``progress``: a bar on stderr (documents, tokens) as the batches come back."""
    where.mkdir(parents=True, exist_ok=True)
    eod = about["tokenizer"]["eod"] if about["tokenizer"] else -1
    init = (tokenizer_text, eod, about["dtype"], vocab_size)
    tag = f"{socket.gethostname()}.{os.getpid()}.tmp"  # this process's files (nodes may share the folder)
    lengths: list[int] = []
    bar = _bar() if progress else None
    try:
        with open(where / f"tokens.bin.{tag}", "wb") as out:
            for lens, data in _encoded(_batches(texts), init, workers):
                lengths += lens
                out.write(data)
                if bar is not None:
                    bar.update(len(lens))
                    bar.set_postfix_str(f"{sum(lengths) / 1e6:.1f}M tokens", refresh=False)
    except BaseException:  # a bad document (ValueError: one line) or an interrupt: leave no partial file, and no
        (where / f"tokens.bin.{tag}").unlink(missing_ok=True)  # empty folder that looks like a cache
        for empty in (where, where.parent):
            with contextlib.suppress(OSError):  # not empty: another process's cache or files
                empty.rmdir()
        raise
    finally:
        if bar is not None:
            bar.close()
    os.replace(where / f"tokens.bin.{tag}", where / "tokens.bin")
    (where / f"index.json.{tag}").write_text(json.dumps({**about, "lengths": lengths}))
    os.replace(where / f"index.json.{tag}", where / "index.json")


def _bar():
    """The tokenizing progress bar (tqdm on stderr; a silent stand-in without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        class _Silent:
            def update(self, n): pass
            def set_postfix_str(self, s, refresh=True): pass
            def close(self): pass
        return _Silent()
    return tqdm(desc="tokenizing", unit="doc", dynamic_ncols=True, file=sys.stderr)


def _batches(texts) -> Iterator[list[str]]:
    batch, chars = [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encoded(batches, init: tuple, workers: int) -> Iterator[tuple[list[int], bytes]]:
    """``_encode`` of each batch, in order: here (``workers == 0``) or in a pool of ``workers`` spawned
    processes, at most ``2 * workers`` batches in flight (the documents are read as they are needed)."""
    if workers == 0:
        _init(*init)
        for batch in batches:
            yield _encode(batch)
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers, initializer=_pool_init, initargs=(os.getpid(), *init)) as pool:
        pending = []
        for batch in batches:
            pending.append(pool.apply_async(_encode, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.pop(0).get()
        for result in pending:
            yield result.get()


class TokenCache:
    """A built cache (``prepare``): the documents' lengths (``lengths``, in document order) and their tokens,
    read through a memory map opened on first use in each process (not pickled)."""

    def __init__(self, where: Path):
        self.where = Path(where)
        index = json.loads((self.where / "index.json").read_text())
        self.lengths: list[int] = index["lengths"]
        self.dtype = index["dtype"]
        self.tokenizer = index["tokenizer"]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        self._tokens: np.ndarray | None = None

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}

    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            total = int(self.offsets[-1])
            self._tokens = (np.memmap(self.where / "tokens.bin", dtype=self.dtype, mode="r", shape=(total,))
                            if total else np.zeros(0, dtype=self.dtype))
        return self._tokens

    def document(self, k: int) -> np.ndarray:
        """Document ``k``'s tokens."""
        return self.tokens()[self.offsets[k]: self.offsets[k + 1]]
