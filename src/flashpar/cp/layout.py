"""What one rank of a ``CPPlan`` sends, receives and computes: transfers and attention tasks.

Pure and cached per (plan, rank): a training step with a fresh plan builds it once per rank.
:func:`device_layout` is the same layout with its index tensors on the activations' device, cached
per (plan, rank, device): the layers of a step share one copy, moved once, by the first layer.

Communication patterns, chosen by the plan's strategy:

* ``p2p`` (sharding-aware plans): rank ``r`` receives exactly ``plan.kv_recv(r)``; the ranges
  a peer needs are gathered from the local K/V and sent to it directly.
* ``allgather`` (``per_doc``, ``torch_per_doc``): every rank's whole local K/V reaches every other
  rank (all-gather, as point-to-point sends of the local tensors).
* ``ring`` (``headtail``, ``contiguous``): the local K/V blocks travel around the ring, each rank
  forwarding the block it received one step earlier (Megatron / TransformerEngine).

Transfers run in ``N - 1`` steps; at step ``j`` rank ``r`` receives the K/V that originates at rank
``r - j`` (mod N): from that rank itself (p2p, allgather) or from ``r - 1`` (ring), and sends to
``r + j`` (p2p, allgather) or ``r + 1`` (ring).  Every rank computes from the same plan which
steps carry data, so no sizes are exchanged.

Tasks (see ``kernels.Task``): for every local query piece ``[a, b)`` of document ``d``: the causal
block of the piece with itself, and one full task per contiguous run, in a key buffer, of the
document's keys that end at or before ``a``.  Phase 0 holds the tasks on the rank's own K/V
(computed while transfers are in flight); phase ``j`` those on the K/V from rank ``r - j``.

With ``queries`` (a few local rows: prefill's last layer reads only its prompts' last tokens) each query
row ``j`` of a piece starting at local row ``p`` is a task of its own: the full task of row ``j`` with
the piece's rows ``[p, j]`` (the keys the causal block gives it), and the same full tasks as the piece's
on the keys before ``a``; the transfers stay the plan's::

    piece rows p .. p+4, queries {p+2}:   causal block (every row)     ->   row p+2 x keys p .. p+2 (full)
                                          keys before a (every row)    ->   row p+2 x keys before a

With ``window`` (sliding-window attention, :mod:`flashpar.cp.window`) the pattern is ``p2p`` whatever the
strategy, rank ``r`` receiving exactly ``window.window_recv(plan, r, W)``: the keys its queries' windows reach.
Each piece is cut into query chunks of at most ``W`` rows: per chunk its causal square and, per contiguous run of
keys before the chunk that the band reaches, a full or a band task on that run (``window.band_task``).  With
``queries``, each query row is a chunk of its own.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass

import torch

from flashpar.cp import window as band
from flashpar.cp.cp_plan import CPPlan
from flashpar.cp.kernels import Batch, Task, make_batches

PATTERNS = {"contiguous": "ring", "headtail": "ring", "per_doc": "allgather", "torch_per_doc": "allgather"}


def pattern_of(plan: CPPlan) -> str:
    return "p2p" if plan.comm == "aware" else PATTERNS.get(plan.strategy, "allgather")


@dataclass(frozen=True)
class RankLayout:
    rank: int
    n: int
    pattern: str
    tokens: int  # local tokens
    recv: tuple[tuple[tuple[int, int], ...], ...]  # per origin rank: global ranges, in buffer order
    send_rows: tuple[torch.Tensor | None, ...]  # per destination (p2p): local rows to send; None: all
    phases: tuple[tuple[Batch, ...], ...]  # phase 0: own K/V; phase j: K/V from rank r - j

    def origin(self, step: int) -> int:
        """The rank whose K/V arrives at ``step`` (1 .. N-1)."""
        return (self.rank - step) % self.n

    def recv_tokens(self, origin: int) -> int:
        return sum(b - a for a, b in self.recv[origin])

    def send_tokens(self, dest: int) -> int:
        rows = self.send_rows[dest]
        return self.tokens if rows is None else int(rows.numel())

    def held_rows(self, block: int, peer: int) -> int:
        """Rows of the K/V originating at ``block`` in a message between this rank and ``peer``: of the
        own block, the rows ``peer`` receives (``send_rows[peer]``, all where None); of another
        block, the whole received buffer."""
        return self.send_tokens(peer) if block == self.rank else self.recv_tokens(block)


@functools.lru_cache(maxsize=64)
def rank_layout(plan: CPPlan, rank: int, varlen: bool = False, queries: tuple[int, ...] | None = None,
                window: int | None = None) -> RankLayout:
    """``varlen``: batches for the variable-length kernel (one per buffer, kind and layer).  ``queries``: only these
    local query rows get tasks (module docstring); None: every row.  ``window``: sliding-window attention of ``W``
    keys (module docstring; checked by the caller); None: full causal."""
    n = plan.cp_size
    pattern = pattern_of(plan) if window is None else "p2p"
    kv_recv = plan.kv_recv if window is None else functools.partial(band.window_recv, plan, window=window)
    starts = plan.doc_starts
    doc_of = lambda a: bisect.bisect_right(starts, a) - 1  # noqa: E731
    recv: list[tuple[tuple[int, int], ...]] = [() for _ in range(n)]
    send_rows: list[torch.Tensor | None] = [None] * n
    if pattern == "p2p":
        by_src: dict[int, list[tuple[int, int]]] = {}
        for src, a, b in kv_recv(rank):
            by_src.setdefault(src, []).append((a, b))
        recv = [tuple(by_src.get(p, ())) for p in range(n)]
        for dest in range(n):
            if dest != rank:
                wanted = [(a, b) for src, a, b in kv_recv(dest) if src == rank]
                send_rows[dest] = _local_rows(plan.segments[rank], wanted)
    else:
        recv = [tuple(plan.segments[p]) if p != rank else () for p in range(n)]
    recv[rank] = ()

    # key pieces per (buffer, document): (global start, global end, first buffer row), in buffer order
    keys: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    buffers = [(-1, plan.segments[rank])] + [(p, recv[p]) for p in range(n) if p != rank]
    for buf, ranges in buffers:
        row = 0
        for a, b in ranges:
            for x, y in _split_at_docs(a, b, starts):
                keys.setdefault((buf, doc_of(x)), []).append((x, y, row + x - a))
            row += b - a
    tasks: dict[int, list[Task]] = {}
    wanted = sorted(set(queries)) if queries is not None else None
    bufs = [buf for buf, _ in buffers]
    if window is None:
        _causal_tasks(plan.segments[rank], doc_of, keys, bufs, wanted, tasks)
    else:
        _window_tasks(plan.segments[rank], starts, keys, bufs, wanted, window, tasks)
    row = sum(b - a for a, b in plan.segments[rank])
    phase_bufs = [-1] + [(rank - j) % n for j in range(1, n)]
    phases = tuple(tuple(make_batches(tasks.get(buf, []), varlen)) for buf in phase_bufs)
    return RankLayout(rank, n, pattern, row, tuple(recv), tuple(send_rows), phases)


@dataclass(frozen=True, eq=False)
class DeviceLayout:
    """A :class:`RankLayout` with its index tensors on ``device``: the attention batches of every phase
    and the send rows per destination (what every call of a step would otherwise copy again)."""

    layout: RankLayout
    device: torch.device
    phases: tuple[tuple[Batch, ...], ...]
    send_rows: tuple[torch.Tensor | None, ...]


@functools.lru_cache(maxsize=8)  # a few plans' index tensors on the device (a step uses one)
def device_layout(plan: CPPlan, rank: int, varlen: bool, device: torch.device,
                  queries: tuple[int, ...] | None = None, window: int | None = None) -> DeviceLayout:
    """``rank_layout(plan, rank, varlen, queries, window)`` with its index tensors copied to ``device`` once
    (cached per window too: a model's windowed and full layers share the plan, not the exchange)."""
    # (every row, no window: the call of three arguments, whose cache entry the other callers of rank_layout share)
    if queries is None and window is None:
        layout = rank_layout(plan, rank, varlen)
    else:
        layout = rank_layout(plan, rank, varlen, queries, window)
    phases = tuple(tuple(_batch_on(b, device) for b in phase) for phase in layout.phases)
    rows = tuple(None if r is None else to_device(r, device) for r in layout.send_rows)
    return DeviceLayout(layout, device, phases, rows)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host wait: on CUDA copied from pinned memory, asynchronously
    on the current stream (a plain copy from pageable memory synchronises the stream); elsewhere ``t``
    itself, or a plain copy."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _batch_on(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with every index tensor it holds on ``device`` (the same object where none moves)."""
    held = {f.name: v for f in dataclasses.fields(batch) if isinstance(v := getattr(batch, f.name), torch.Tensor)}
    moved = {name: to_device(v, device) for name, v in held.items()}
    return batch if all(moved[n] is v for n, v in held.items()) else dataclasses.replace(batch, **moved)


def _causal_tasks(segments, doc_of, keys: dict, bufs: list[int], wanted: list[int] | None,
                  tasks: dict[int, list[Task]]) -> None:
    """Fill ``tasks`` (by buffer) with the causal tasks of the rank's pieces (module docstring)."""
    row = 0
    for a, b in segments:
        d = doc_of(a)
        if wanted is None:
            pieces = [(row, row + b - a, Task(row, row + b - a, -1, row, row + b - a, True))]
        else:
            lo, hi = bisect.bisect_left(wanted, row), bisect.bisect_left(wanted, row + b - a)
            pieces = [(j, j + 1, Task(j, j + 1, -1, row, j + 1, False)) for j in wanted[lo:hi]]
        for q0, q1, own in pieces:
            tasks.setdefault(-1, []).append(own)
            for buf in bufs:
                for k0, k1 in _runs_before(keys.get((buf, d), ()), a):
                    tasks.setdefault(buf, []).append(Task(q0, q1, buf, k0, k1, False))
        row += b - a


def _window_tasks(segments, starts: list[int], keys: dict, bufs: list[int], wanted: list[int] | None, window: int,
                  tasks: dict[int, list[Task]]) -> None:
    """Fill ``tasks`` (by buffer) with the windowed tasks of the rank's pieces (module docstring).  ``keys``: the
    key runs per (buffer, document), each contiguous in global positions and in buffer rows."""
    row = 0
    for a, b in segments:
        d = bisect.bisect_right(starts, a) - 1
        local = lambda x, a=a, row=row: row + x - a  # noqa: E731 - global position in this piece -> local row
        if wanted is None:
            chunks = band.chunks(a, b, window)
        else:
            lo, hi = bisect.bisect_left(wanted, row), bisect.bisect_left(wanted, row + b - a)
            chunks = [(a + j - row, a + j - row + 1) for j in wanted[lo:hi]]
        for q0, q1 in chunks:
            tasks.setdefault(-1, []).append(Task(local(q0), local(q1), -1, local(q0), local(q1), True))
            for buf in bufs:
                for x, y, krow in keys.get((buf, d), ()):
                    cut = band.band_task(q0, q1, x, min(y, q0), window)
                    if cut is None:
                        continue
                    c0, c1, k0, k1, full = cut
                    tasks.setdefault(buf, []).append(Task(local(c0), local(c1), buf, krow + k0 - x, krow + k1 - x,
                                                          False, None if full else (c0 - k0, window)))
        row += b - a


def _split_at_docs(a: int, b: int, starts: list[int]):
    i = bisect.bisect_right(starts, a)
    for cut in starts[i:]:
        if cut >= b:
            break
        yield a, cut
        a = cut
    yield a, b


def _runs_before(pieces, a: int) -> list[tuple[int, int]]:
    """Buffer row runs ``[k0, k1)`` of the pieces that end at or before global position ``a``
    (pieces adjacent in the buffer join one run)."""
    runs: list[tuple[int, int]] = []
    for x, y, row in pieces:
        if y > a:
            continue
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + y - x)
        else:
            runs.append((row, row + y - x))
    return runs


def _local_rows(segments, wanted: list[tuple[int, int]]) -> torch.Tensor:
    """Local rows holding the global ranges ``wanted`` (each inside the rank's segments), in order."""
    order = sorted(range(len(segments)), key=lambda i: segments[i][0])
    seg_starts = [segments[i][0] for i in order]
    offsets, row = {}, 0
    for i, (a, b) in enumerate(segments):
        offsets[i] = row
        row += b - a
    parts = []
    for x, y in wanted:
        while x < y:
            j = order[bisect.bisect_right(seg_starts, x) - 1]
            a, b = segments[j]
            end = min(b, y)
            parts.append(torch.arange(offsets[j] + x - a, offsets[j] + end - a))
            x = end
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
