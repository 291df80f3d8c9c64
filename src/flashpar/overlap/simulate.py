"""Times a schedule's step list with the hardware cost model, and picks a mode for ``auto``.

Two agents, as in the executor: the main agent runs computes, waits and adds in
order; the lane runs each submitted item after the previous one.

    exchange  = latency + max(bytes sent, bytes received) / link   (full duplex, one message)
    collective (all_gather, reduce_scatter of b bytes per rank, all_to_all of b per peer, all_reduce of b):
              ``Hardware.collective`` of the group: NCCL's own model on a GPU preset (``flashpar.cost.nccl``:
              ring / tree / PAT, latency per hop and protocol), gloo's ring on the CPU
              ((N - 1) (latency + b / link); all_reduce 2 (N - 1) (latency + b / (N link)))
    time      = when both agents are done

A transfer in flight takes CPU from the computation beside it (``Hardware.comm_cpu_s_per_byte`` = c, 0 on
the GPU presets): a lane item that moves m bytes (sent + received by this rank) over [s, e] runs the main
agent's computes and adds inside [s, e] at ``1 - min(1, c m / (e - s))`` of their rate, so a compute that
spans the whole transfer ends c m later; compute beside no transfer, and a transfer the main agent only
waits for, cost nothing extra::

    main  |==== compute ====|~~ compute, slowed ~~|== compute ==|.. wait ..|
    lane                    |--- transfer, m bytes ---|         |-- next --|
                            s                         e

The compute-only time (``Timing.compute``) is the computes alone, without that charge.

A compute's time is ``Hardware.gemm_time(rows of its piece, k, n)`` with the gemm's ``(k, n)`` from the
op's shape; a merged all-to-all compute over ``peers`` head groups is one GEMM ``peers`` times as wide
(``k peers``), a merged piece of consecutive blocks one GEMM of their rows.  An exchange of a merged
piece pays one latency for all of its messages (they are posted together, one per peer).

A transfer's bytes are its piece's rows times the width its buffer declares
(``Schedule.buffers``: the width rule names one of the shape's ``dims``).  Importable
without torch.distributed: it reads schedules and row spaces only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flashpar.cost import Hardware, load
from flashpar.overlap.row_space import RowSpace
from flashpar.overlap.schedule import (
    MERGED_OPS,
    Add,
    Collective,
    Compute,
    Exchange,
    Piece,
    Schedule,
    Wait,
    build_schedule,
)


@dataclass(frozen=True)
class Shape:
    """One op call: ``rows`` of the gathered/full side, the GEMM dims, element size."""

    rows: RowSpace
    gemm_dims: dict  # gemm name -> (k, n): flops = 2 * rows * k * n
    dims: dict  # width rule of a buffer (BufferDecl.width: "in", "out") -> features per row
    elem_bytes: int

    def width(self, schedule: Schedule, buffer: str) -> int:
        return self.dims.get(schedule.buffer(buffer).width, 0)


@dataclass(frozen=True)
class Timing:
    total: float
    compute: float  # sum of the compute steps: the time with no communication at all
    comm: float  # sum of the lane items: the time with no compute at all


def simulate(schedule: Schedule, shape: Shape, hw: Hardware) -> Timing:
    rows, n = shape.rows, schedule.world_size
    t_main = t_lane = 0.0
    done: dict[int, float] = {}
    compute = comm = 0.0
    in_flight = _InFlight(hw.comm_cpu_s_per_byte)
    widths = {b.name: shape.dims.get(b.width, 0) for b in schedule.buffers}  # Shape.width, looked up once
    spans: dict[Piece, int] = {}  # rows of each piece, computed once

    def span(piece: Piece) -> int:
        got = spans.get(piece)
        if got is None:
            lo, hi = rows.rows(piece)
            got = spans[piece] = hi - lo
        return got

    def nbytes(buffer: str, piece: Piece) -> float:
        return span(piece) * widths[buffer] * shape.elem_bytes

    for step in schedule.steps:
        if isinstance(step, Compute):
            k, m = shape.gemm_dims[step.gemm]
            dt = hw.gemm_time(span(step.piece), k * step.peers, m)
            t_main = in_flight.run(t_main, dt)
            compute += dt
        elif isinstance(step, Add):
            dt = hw.memory_time(3 * span(step.piece) * widths[step.dst] * shape.elem_bytes)
            t_main = in_flight.run(t_main, dt)
            compute += dt
        elif isinstance(step, Wait):
            t_main = max(t_main, done[step.id])
        else:
            if isinstance(step, Exchange):
                sent = sum(nbytes(t.buffer, t.piece) for t in step.sends)
                recv = sum(nbytes(t.buffer, t.piece) for t in step.recvs)
                dt, moved = hw.transfer_time(max(sent, recv)), sent + recv
            else:
                dt, moved = _collective_time(step, rows, widths[step.src], shape, hw, n)
            start = max(t_main, t_lane)
            t_lane = start + dt
            in_flight.add(start, t_lane, moved)
            done[step.id] = t_lane
            comm += dt
    return Timing(max(t_main, t_lane), compute, comm)


class _InFlight:
    """The lane's transfers as (start, end, fraction of the main agent's rate each takes), in time order
    (one lane: they do not overlap), and the main agent's work timed across them."""

    def __init__(self, s_per_byte: float) -> None:
        self.s_per_byte = s_per_byte
        self.spans: list[tuple[float, float, float]] = []

    def add(self, start: float, end: float, moved: float) -> None:
        if self.s_per_byte > 0 and moved > 0 and end > start:
            self.spans.append((start, end, min(1.0, self.s_per_byte * moved / (end - start))))

    def run(self, t: float, work: float) -> float:
        """When ``work`` seconds of computation started at ``t`` end: at full rate outside the spans,
        at ``1 - taken`` inside them."""
        for s, e, taken in self.spans:
            if e <= t:
                continue
            if s > t:  # full rate until the transfer starts
                if work <= s - t:
                    return t + work
                work -= s - t
                t = s
            rate = 1.0 - taken
            if rate * (e - t) >= work and rate > 0:
                return t + work / rate
            work -= rate * (e - t)
            t = e
        return t + work


def all_reduce_time(nbytes: float, n: int, hw: Hardware) -> float:
    """An all-reduce of ``nbytes`` over ``n`` ranks of ``hw``'s group (``Hardware.collective``; 0 for one)."""
    return hw.collective("all_reduce", n, nbytes).total_s


def _collective_time(step: Collective, rows: RowSpace, width: int, shape: Shape, hw: Hardware,
                     n: int) -> tuple[float, float]:
    """(seconds, bytes this rank moves: sent + received) of one collective (``Hardware.collective``)."""
    if step.kind == "all_reduce":
        b = width * shape.elem_bytes
        return all_reduce_time(b, n, hw), 4 * (n - 1) * b / n
    b = rows.max_chunk(step.chunk, step.chunks) * width * shape.elem_bytes
    return hw.collective(step.kind, n, n * b).total_s, 2 * (n - 1) * b


def op_shapes(op: str, n: int, rows: int, n_in: int, n_out: int, elem_bytes: int) -> dict[str, Shape]:
    """Forward and backward :class:`Shape` of ``op`` on equal blocks, keyed by schedule op.

    ``ag_matmul``: ``rows`` sequence rows, weight ``[n_out, n_in]`` (this rank's columns).
    ``matmul_rs``: ``rows`` sequence rows, weight ``[n_out, n_in]`` (this rank's input features).
    ``sharded``: ``rows`` tokens on this rank, full weight ``[n_out, n_in]`` gathered by output rows.
    ``matmul_a2a``: ``rows`` sequence rows, ``n_out`` features per head group.
    ``a2a_matmul``: ``rows`` sequence rows, ``n_in`` features per head group, ``n_out`` outputs.
    """
    if op not in _GEMMS:
        raise ValueError(f"unknown op {op!r}; expected one of {tuple(_GEMMS)}")
    size = {"in": n_in, "out": n_out, "rows": rows}
    space = RowSpace(tuple([max((n_out if op == "sharded" else rows) // n, 1)] * n), 1)
    dims = {"in": n_in, "out": n_out}
    fwd, bwd = ({g: (size[k], size[m]) for g, (k, m) in gemms.items()} for gemms in _GEMMS[op])
    return {op: Shape(space, fwd, dims, elem_bytes), f"{op}_bwd": Shape(space, bwd, dims, elem_bytes)}


_GEMMS = {  # op -> (forward gemms, backward gemms): gemm -> (k, n) named by the op's dims
    "ag_matmul": ({"y": ("in", "out")}, {"p": ("out", "in"), "gw": ("out", "in")}),
    "matmul_rs": ({"p": ("in", "out")}, {"gx": ("out", "in"), "gw": ("out", "in")}),
    "sharded": ({"y": ("in", "rows")}, {"gw": ("rows", "in"), "gx": ("rows", "in")}),  # rows: the batch
    "matmul_a2a": ({"p": ("in", "out")}, {"gx": ("out", "in"), "gw": ("out", "in")}),
    "a2a_matmul": ({"y": ("in", "out")}, {"p": ("out", "in"), "gw": ("out", "in")}),
}


CANDIDATES = (("none", 1, 1), ("flash", 1, 1), ("flash", 2, 1), ("flash", 4, 1))
"""(mode, chunks, peers_per_piece) that ``auto`` scores for every op; :func:`candidates` adds merged pieces."""
AUTO_MARGIN = 0.9
"""``auto`` leaves ``none`` only for a predicted gain of more than 10%: the model is rough,
and a wrong switch to a decomposed schedule at small M is the costly mistake."""


def candidates(op: str, n: int, *, merged: bool = True) -> list[tuple[str, int, int]]:
    """What ``auto`` scores for ``op`` on ``n`` ranks: :data:`CANDIDATES`, and (``merged``, ops of
    ``MERGED_OPS``) flash with ``g = 2 .. N-1`` peers per piece, one ``g`` per distinct piece count
    ``ceil((N-1) / g)`` (``g = N - 1``: one piece of every peer)."""
    out = list(CANDIDATES)
    if merged and op in MERGED_OPS:
        counts = {n - 1}  # one piece per peer: already a candidate
        for g in range(2, n):
            if -(-(n - 1) // g) not in counts:
                counts.add(-(-(n - 1) // g))
                out.append(("flash", 1, g))
    return out


def pick_label(mode: str, chunks: int, peers_per_piece: int = 1) -> str:
    """``mode(k=chunks)``, with ``,g=peers_per_piece`` for merged pieces: how reports name a pick."""
    return f"{mode}(k={chunks}" + (f",g={peers_per_piece})" if peers_per_piece > 1 else ")")


def predict(op: str, mode: str, chunks: int, n: int, rows: int, n_in: int, n_out: int, elem_bytes: int,
            hw: Hardware, *, grad_bias: bool = False, regather: bool = True,
            peers_per_piece: int = 1) -> dict[str, Timing]:
    """Predicted forward and backward timings of ``op`` in ``mode`` (rank 0's schedule; equal blocks).

    ``peers_per_piece``: flash merged pieces (:func:`flashpar.overlap.schedule.peer_pieces`).

    ``grad_bias``: the op has a bias, whose gradient ``matmul_rs_bwd`` all-reduces first (item ``gb``); the
    runtime builds that item only for a bias (``flashpar.overlap.ops``), and neither ``flashpar bench
    overlap`` nor the Llama layers have one.  ``regather``: ``ag_matmul_bwd`` gathers ``x`` again (as
    ``flashpar bench overlap`` runs it) or reads the copy the forward kept (``save_gathered``, the trainer's
    default)."""
    out = {}
    for name, shape in op_shapes(op, n, rows, n_in, n_out, elem_bytes).items():
        schedule = _schedule(name, mode, n, chunks, peers_per_piece, name == "matmul_rs_bwd" and grad_bias,
                             name != "ag_matmul_bwd" or regather)
        out[name] = simulate(schedule, shape, hw)
    return out


@functools.lru_cache(maxsize=1024)
def _schedule(name: str, mode: str, n: int, chunks: int, peers_per_piece: int, grad_bias: bool,
              regather: bool) -> Schedule:
    """Rank 0's schedule of ``name`` (a schedule does not depend on the rows: built once per shape of call)."""
    extra = {"grad_bias": True} if grad_bias else {}
    if not regather:
        extra["regather"] = False
    return build_schedule(name, mode, n, 0, chunks=chunks, peers_per_piece=peers_per_piece, **extra)


Pick = tuple[str, int, int]
"""(mode, chunks, peers_per_piece) of one direction of an op."""

SPLIT_OPS = ("ag_matmul", "matmul_rs")
"""Ops whose backward may run another schedule than their forward (``flashpar.overlap.ops``: the backward runs
``Call.backward()``).  ``auto`` picks each direction of these on its own: an all-gather's forward hides its
transfers behind the decomposed GEMM, while its backward (``grad_x``'s reduce-scatter posted beside the
weight-gradient GEMM) may hide them undivided; splitting it would only buy thinner GEMMs."""


def choose_modes(op: str, n: int, rows: int, n_in: int, n_out: int, elem_bytes: int, device_type: str,
                 hw: Hardware | None = None, *, merged: bool = True, regather: bool = True,
                 split: bool = True) -> tuple[Pick, Pick]:
    """(forward pick, backward pick) of :func:`candidates`: for an op of :data:`SPLIT_OPS` (``split``: where
    the caller runs the two directions apart) each direction its least predicted time where that pair is no
    slower than the joint pick, else the least forward + backward time (the same pick twice); a pick is
    ``("none", 1, 1)`` unless it beats none's by :data:`AUTO_MARGIN` (memoised per shape).  ``merged=False``:
    for a caller whose schedules take no ``peers_per_piece``; ``regather``: an ``ag_matmul``'s backward
    gathers ``x`` again (else it reads the forward's copy: ``save_gathered``, the trainer's default)."""
    return _choose(op, n, rows, n_in, n_out, elem_bytes, hw or load(device_type), merged, regather,
                   split and op in SPLIT_OPS)


@functools.lru_cache(maxsize=4096)
def _choose(op: str, n: int, rows: int, n_in: int, n_out: int, elem_bytes: int, hw: Hardware,
            merged: bool, regather: bool, split: bool) -> tuple[Pick, Pick]:
    scored = []  # (forward s, backward s, pick); candidates() starts with none
    for pick in candidates(op, n, merged=merged):
        t = predict(op, pick[0], pick[1], n, rows, n_in, n_out, elem_bytes, hw, peers_per_piece=pick[2],
                    regather=regather)
        scored.append((t[op].total, t[f"{op}_bwd"].total, pick))
    both = _least([(f + b, p) for f, b, p in scored])
    if not split:
        return both, both
    fwd, bwd = _least([(f, p) for f, _, p in scored]), _least([(b, p) for _, b, p in scored])
    times = {p: (f, b) for f, b, p in scored}
    # each direction's margin can leave a pair slower than the joint pick (both gains under the margin apart,
    # over it together): the pair only where it is no slower
    return (fwd, bwd) if times[fwd][0] + times[bwd][1] <= sum(times[both]) else (both, both)


def _least(scored: list[tuple[float, Pick]]) -> Pick:
    """The fastest pick where it beats the first (none) by ``AUTO_MARGIN``, else none."""
    base = scored[0][0]
    t, pick = min(scored)
    return pick if pick[0] != "none" and t < AUTO_MARGIN * base else ("none", 1, 1)


def picks_label(fwd: Pick, bwd: Pick) -> str:
    """How reports name an ``auto`` pick: one label, or ``forward/backward`` where the directions differ."""
    return pick_label(*fwd) if fwd == bwd else f"{pick_label(*fwd)}/{pick_label(*bwd)}"
