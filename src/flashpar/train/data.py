"""The trainer's data: corpus documents packed into fixed-length sequences, each planned for context parallelism.

Packing (:class:`PackedCorpus`).  The corpus documents (:func:`flashpar.corpus.documents`) are put in a
deterministic order, ``random.Random(seed).shuffle`` of their indices, and concatenated into one token
stream with the document boundaries kept.  With ``S`` the total number of tokens and ``L = seq_len``,
sequence ``i`` (``0 <= i < S // L``) is the stream slice ``[i * L, (i + 1) * L)``: a document crossing a
sequence boundary is split there and its remainder starts the next sequence, and the final partial
sequence is dropped; the cutting is :class:`flashpar.cp.lengths.Packing`, the packing of every command.
The label of stream position ``p`` is the token at ``p + 1`` when ``p + 1`` lies in the same document
(even when it lies in the next sequence) and ``-100`` (ignored by ``cross_entropy``) when ``p`` is the
last token of its document, so no target crosses a document boundary.

Tokens (``--data`` / ``--tokenizer``, :mod:`flashpar.train.tokens`).  The documents come from the token
cache instead of the byte corpus: with a tokenizer each ends with its end-of-document token, the last
token of the document, whose label is therefore ``-100`` (the token before it has it as its target).
The order, the stream, the cutting and the labels are the same as above; an item reads its pieces from
the cache's memory map.

Held-out documents (``--eval-every``, ``--eval-docs N``).  The last ``N`` documents of the seed's
shuffled order are taken out before packing: the training stream is the other documents, in the same
order (the stream without hold-out, cut before the first held-out document), and the held-out ones are
packed the same way on their own (``split="eval"``, read by :mod:`flashpar.train.evaluate`).

Planning (:class:`PlannedSequences`).  Data-parallel rank ``d`` of ``D`` takes the global sequences
``start + d, start + d + D, start + 2D + d, ...``: its item ``j`` is sequence ``start + j * D + d``, to
which ``__getitem__`` adds the context-parallel plan of its document pieces, so that behind a
:class:`~torch.utils.data.DataLoader` (:func:`make_loader`) the planner runs in the worker processes.

Epochs (``--epochs E``).  The global sequences run on past the end of the stream: global sequence ``g`` is
stream sequence ``g mod (S // L)``, so a second pass takes the same sequences in the same order
(``PlannedSequences``).

Resume.  After ``k`` steps every rank has consumed the items ``j < k``, i.e. the global sequences
``start .. start + k * D - 1``; rebuilding :class:`PlannedSequences` with ``start + k * D`` (same
dataset arguments, seed and ``dp_size``) yields exactly the sequences the uninterrupted run would have
seen next, on every rank.
"""

from __future__ import annotations

import bisect
import functools
import operator
import os
import random
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from flashpar import corpus
from flashpar.cp import STRATEGIES, CostModel
from flashpar.cp import plan as cp_plan
from flashpar.cp.lengths import Packing
from flashpar.models.llama import IGNORE

IGNORE_INDEX = IGNORE  # the loss's 'no target' label
SPLITS = ("train", "eval")


class PackedCorpus(Dataset):
    """The shuffled corpus stream cut into ``seq_len``-token sequences (see the module docstring).

    The index (document order, stream offsets, sequence count) comes from the file sizes alone
    (:func:`flashpar.corpus.document_lengths`); the tokens are read on the first item, once per
    process, into one ``uint8`` tensor of the stream (about 11 MB for the whole standard library).
    The tensor is not pickled: each data-loader worker reads its own copy on first use.

    ``tokens``: the documents of a :class:`flashpar.train.tokens.TokenCache` (``--data`` / ``--tokenizer``)
    instead of the byte corpus; their lengths come from its index and each item reads its pieces from
    the cache's memory map (no stream is held).  ``held_out = N``: the last ``N`` documents of the shuffled
    order are held out; ``split="train"`` packs the others (the same stream as with no hold-out, cut
    before them), ``split="eval"`` packs those ``N`` (``flashpar.train.evaluate``).
    """

    def __init__(self, seq_len: int, *, max_docs: int | None = None, seed: int = 0, tokens=None,
                 held_out: int = 0, split: str = "train"):
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if max_docs is not None and max_docs < 0:
            raise ValueError(f"max_docs must be None or >= 0, got {max_docs!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.seq_len, self.max_docs, self.seed, self.tokens = seq_len, max_docs, seed, tokens
        lengths = corpus.document_lengths(max_docs) if tokens is None else tokens.lengths
        if not _is_int(held_out) or not 0 <= held_out < max(len(lengths), 1):
            raise ValueError(f"held_out (--eval-docs) must be an int >= 0 that leaves training documents: there are "
                             f"{len(lengths)} documents, got {held_out!r}")
        order = shuffled_order(len(lengths), seed)
        cut = len(order) - held_out
        self.order = order[:cut] if split == "train" else order[cut:]  # stream position -> corpus document index
        self.packing = Packing([lengths[k] for k in self.order], seq_len)  # the stream, cut into sequences
        # document lengths in stream order, stream offset of each document, tokens in the stream
        self.lens, self.starts, self.total = self.packing.lengths, self.packing.starts, self.packing.total
        if self.total < seq_len:
            what = "the held-out documents" if split == "eval" else "the corpus"
            raise ValueError(f"{what} ({len(self.lens)} documents, {self.total} tokens) are shorter than one "
                             f"sequence of seq_len={seq_len} tokens; use more documents or a shorter seq_len")
        self._stream: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.packing)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_stream"] = None  # workers read the tokens themselves (lazily)
        return state

    def doc_lens(self, i: int) -> list[int]:
        """Pieces of documents in sequence ``i``, in order (they sum to ``seq_len``); reads no tokens."""
        return self.packing.doc_lens(operator.index(i))

    def __getitem__(self, i: int) -> dict:
        i = operator.index(i)
        a, b = self.packing.bounds(i)
        window = self.window(a, min(b + 1, self.total))  # the sequence and the token after it
        tokens = window[: b - a].long()
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        n = min(b + 1, self.total) - (a + 1)  # positions whose next token exists in the stream
        labels[:n] = window[1: 1 + n].long()
        pieces, end = [], 0
        for _, piece, ends_doc in self.packing.pieces(i):
            pieces.append(piece)
            end += piece
            if ends_doc:
                labels[end - 1] = IGNORE_INDEX
        return {"tokens": tokens, "labels": labels, "doc_lens": pieces, "index": i}

    def window(self, a: int, b: int) -> torch.Tensor:
        """The stream's tokens ``[a, b)``: a slice of the byte stream, or read piece by piece from the cache."""
        if self.tokens is None:
            return self.stream()[a:b]
        out = np.empty(b - a, dtype=np.int64)
        d, pos = bisect.bisect_right(self.starts, a) - 1, a  # the last document starting at or before a
        while pos < b:
            end = min(self.starts[d] + self.lens[d], b)
            if end > pos:
                doc = self.tokens.document(self.order[d])
                out[pos - a: end - a] = doc[pos - self.starts[d]: end - self.starts[d]]
            pos, d = max(pos, end), d + 1
        return torch.from_numpy(out)

    def stream(self) -> torch.Tensor:
        """The whole shuffled byte stream (``uint8``, ``total`` tokens), read on first use and cached."""
        if self._stream is None:
            self._stream = read_stream(self.max_docs, self.order, self.starts, self.lens)
        return self._stream


def shuffled_order(count: int, seed: int) -> list[int]:
    """``random.Random(seed).shuffle`` of ``range(count)``: the corpus document at each stream position."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order


def read_stream(max_docs: int | None, order: list[int], starts: list[int], lens: list[int]) -> torch.Tensor:
    """Read the documents and place corpus document ``order[p]`` at stream offset ``starts[p]``."""
    where = {k: p for p, k in enumerate(order)}  # the documents of this stream (a held-out split: some)
    stream = torch.empty(sum(lens), dtype=torch.uint8)
    seen = 0
    for k, (name, tokens) in enumerate(corpus.documents(max_docs)):
        p = where.get(k)
        if p is None:
            continue
        if tokens.numel() != lens[p]:
            raise RuntimeError(f"corpus document {k} ({name}) changed since the index was built "
                               f"(expected {lens[p]} tokens, read {tokens.numel()})")
        stream[starts[p]: starts[p] + lens[p]] = tokens.to(torch.uint8)
        seen += 1
    if seen != len(order):
        raise RuntimeError(f"the corpus has {seen} of this stream's documents now, {len(order)} when the index "
                           "was built")
    return stream


class PlannedSequences(Dataset):
    """The sequences of one data-parallel rank, each with its context-parallel plan.

    Item ``j`` is ``dataset[g % len(dataset)]``, ``g = start + j * dp_size + dp_rank``, plus ``plan``
    (:func:`flashpar.cp.plan` of its ``doc_lens`` over ``cp_size`` ranks with ``strategy`` and ``cost``) and
    ``planning_s`` (the planner's time for it, in seconds).  ``g`` runs over ``epochs`` passes of the dataset,
    each in the same order (the stream of global sequences simply continues from the first)::

        g:        0 1 2 ... N-1 | N   N+1 ... 2N-1 | ...      (epochs x N global sequences)
        dataset:  0 1 2 ... N-1 | 0   1   ... N-1  | ...

    ``start`` is the global sequence index to begin at: resume with ``start + steps * dp_size`` (see the
    module docstring).
    """

    def __init__(self, dataset: PackedCorpus, cp_size: int, strategy: str = "flashcp",
                 cost: CostModel | None = None, *, dp_rank: int = 0, dp_size: int = 1, start: int = 0,
                 epochs: int = 1):
        if not _is_int(cp_size) or cp_size < 1:
            raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
        if not _is_int(dp_size) or dp_size < 1:
            raise ValueError(f"dp_size must be a positive int, got {dp_size!r}")
        if not _is_int(dp_rank) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size) = [0, {dp_size}), got {dp_rank!r}")
        if not _is_int(epochs) or epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {epochs!r}")
        total = epochs * len(dataset)
        if not _is_int(start) or not 0 <= start <= total:
            raise ValueError(f"start must be a sequence index in [0, {total}] ({epochs} pass(es) of {len(dataset)} "
                             f"sequences), got {start!r}")
        self.dataset, self.cp_size, self.strategy, self.cost = dataset, cp_size, strategy, cost
        self.dp_rank, self.dp_size, self.start, self.total = dp_rank, dp_size, start, total

    def __len__(self) -> int:
        """Items ``j`` with ``start + j * dp_size + dp_rank < epochs * len(dataset)``."""
        left = self.total - self.start - self.dp_rank
        return max(0, -(-left // self.dp_size))

    def steps(self, micro_batches: int) -> int:
        """Whole global batches left from ``start``: steps of ``micro_batches`` sequences on every dp rank.

        The count is the same on every dp rank (a rank holding one sequence more than another must not start a
        step alone: its peers would never join its collectives)::

            left = epochs x len(dataset) - start          e.g. 5 sequences, dp 2, 1 micro-batch:
            steps = left // (dp_size x micro_batches)          rank 0 holds 3, rank 1 holds 2; both run 2 steps
        """
        if not _is_int(micro_batches) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        return (self.total - self.start) // (self.dp_size * micro_batches)

    def global_index(self, j: int) -> int:
        """The global sequence index of item ``j``."""
        j = operator.index(j)
        if not 0 <= j < len(self):
            raise IndexError(f"item {j} out of range: dp rank {self.dp_rank} has {len(self)} sequences")
        return self.start + j * self.dp_size + self.dp_rank

    def __getitem__(self, j: int) -> dict:
        item = self.dataset[self.global_index(j) % len(self.dataset)]
        item["plan"] = cp_plan(item["doc_lens"], self.cp_size, strategy=self.strategy, cost=self.cost)
        item["planning_s"] = item["plan"].planning_s
        item["figures"] = plan_figures(item["plan"])
        return item


def training_data(config, split: str = "train") -> PackedCorpus:
    """The packed documents of a run: the byte corpus, or the token cache of ``--data`` / ``--tokenizer``
    (``flashpar.train.tokens.prepare``: built by ``ready()``, else here); with ``--eval-every`` the
    ``--eval-docs`` held-out documents are left out of ``"train"`` and are ``"eval"``."""
    from flashpar.train import tokens

    cache = tokens.TokenCache(tokens.prepare(config)) if tokens.uses_cache(config) else None
    held = config.eval_docs if config.eval_every else 0
    return PackedCorpus(config.seq_len, max_docs=config.max_docs, seed=config.seed, tokens=cache, held_out=held,
                        split=split)


def ready_data(config) -> None:
    """``ready()``'s check of the run's tokens and documents, before any rank starts (``ValueError``: one line):
    the byte tokens fit the model, or the tokenizer does; the data files read (the token cache is built
    here, see ``flashpar.train.tokens``; the files of a ``--data`` folder left out are named in one line);
    one global batch of training sequences and, with ``--eval-every``, at least one held-out sequence per dp
    rank."""
    from flashpar.train import tokens

    if not tokens.uses_cache(config):
        tokens.bytes_fit(config.model.vocab_size, config.init_from)
    if config.data:
        from flashpar.train.sources import skipped_line

        if line := skipped_line(config.data):
            print(f"flashpar train: {line}", file=sys.stderr, flush=True)
    train = training_data(config)
    micro = config.check_micro_batches if config.check else config.micro_batches
    if len(train) < config.dp * micro:
        raise ValueError(f"the training documents make {len(train)} sequences of {config.seq_len} tokens, fewer than "
                         f"one global batch of dp x micro-batches = {config.dp} x {micro}")
    if config.eval_every:
        held = training_data(config, "eval")
        if len(held) < config.dp:
            raise ValueError(f"the {config.eval_docs} held-out documents make {len(held)} sequences of "
                             f"{config.seq_len} tokens, fewer than dp = {config.dp}; raise --eval-docs")


def plan_figures(plan) -> dict[str, float]:
    """The cost model's K/V bytes, step time and exposed communication (``max over ranks of est_time -
    compute``) of ``plan``, and the K/V bytes and step time of ``per_doc`` and ``headtail`` on the same
    documents: the trainer's report of what the planner saved, computed here in the loader worker."""
    mine = plan.stats()
    exposed = max(t - c for t, c in zip(mine["est_time"], mine["compute"], strict=True))
    out = {"est_step_ms": 1e3 * mine["est_step_time"], "plan_kv_bytes": mine["total_kv_bytes"],
           "exposed_comm_ms_est": 1e3 * exposed}
    for base in ("per_doc", "headtail"):
        s = cp_plan(plan.doc_lens, plan.cp_size, strategy=base, cost=plan.cost).stats()
        out[f"{base}_kv_bytes"] = s["total_kv_bytes"]
        out[f"{base}_est_step_ms"] = 1e3 * s["est_step_time"]
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _worker_start(rank_pid: int, worker_id: int) -> None:
    """A data-loader worker's first act: the kernel's SIGKILL when its rank ends (``flashpar.lifeline``)."""
    from flashpar.lifeline import die_with_parent

    die_with_parent(rank_pid)


def _identity(item):
    return item


def make_loader(planned: PlannedSequences, *, num_workers: int = 1, prefetch_factor: int = 2) -> DataLoader:
    """One packed, planned sequence per step, in the dataset's order.

    ``num_workers > 0`` plans in worker processes started with ``spawn`` (safe after CUDA or threads
    are initialised in the trainer) and kept alive across epochs; ``num_workers=0`` plans in the
    calling process.  Items are passed through unchanged (tensors, ``doc_lens`` list, ``CPPlan``).  A worker
    ends with its rank however the rank ends (the kernel's parent-death signal, ``flashpar.lifeline``; torch's
    own check of the parent's pid takes up to 5 s).
    """
    if not _is_int(num_workers) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    if not _is_int(prefetch_factor) or prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be a positive int, got {prefetch_factor!r}")
    workers = num_workers > 0
    return DataLoader(planned, batch_size=None, shuffle=False, num_workers=num_workers, collate_fn=_identity,
                      worker_init_fn=functools.partial(_worker_start, os.getpid()) if workers else None,
                      prefetch_factor=prefetch_factor if workers else None, persistent_workers=workers,
                      multiprocessing_context="spawn" if workers else None)
