"""All-gather and reduce-scatter of equal chunks in ``ceil(log2 n)`` point-to-point steps, for any group size
(Bruck's pattern: the distance doubles at every step).

A ring moves ``(n - 1) C`` elements per rank in ``n - 1`` steps, one chunk of ``C`` per step; each step pays a
message's latency.  In a shard group of 128 ranks across nodes that latency (127 x 15 us on InfiniBand) is
about half of a block's all-gather.  This pattern moves the same bytes in ``ceil(log2 n)`` steps.

Chunks are held in **rotated order**: position ``j`` of rank ``r``'s buffer is the chunk of rank ``(r + j) mod n``
(so position 0 is the rank's own).  With ``c = min(d, n - d)`` chunks at distance ``d``::

    all-gather     d = 1, 2, 4, ... < n:   send [0, c) to r - d,   receive [d, d + c) from r + d

        n = 5, rank 0 (what each position holds):
            start   | 0 | . | . | . | . |
            d = 1   | 0 | 1 | . | . | . |     rank 1's [0, 1) = chunk 1
            d = 2   | 0 | 1 | 2 | 3 | . |     rank 2's [0, 2) = chunks 2, 3
            d = 4   | 0 | 1 | 2 | 3 | 4 |     rank 4's [0, 1) = chunk 4

    reduce-scatter the same steps transposed, in reverse (d = ..., 4, 2, 1):
                   send [d, d + c) to r + d,   receive from r - d and add into [0, c)

Every chunk of the all-gather arrives once, by one path; the reduce-scatter sends every contribution back along
the reversed path, so position 0 ends as the sum over the group of the sections for ``r`` (a contribution at
``[d, d + c)`` has received all of its adds, from the larger distances, before it is sent).  Bytes per rank:
``(n - 1) C`` each way, as the ring.  The sums are exact up to the order of the additions (per position, a fixed
order on every run).

Execution: CPU (gloo): the steps are items of a :class:`flashpar.overlap.lane.Lane` of the group, every item on
the group's worker thread (``hold=False``), which posts a step once the previous one has completed (a step sends
what the previous one received); lanes of the same group post in the order they were submitted, the same on every
rank.  CUDA (NCCL): the steps are issued on a side stream of the device (NCCL orders them; the reduce-scatter's
adds run there between them) and the returned work makes the waiting stream wait for an event, no host wait.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from flashpar.dist import DEFAULT_TIMEOUT_S, p2p_group, resolve_group, stream_waits
from flashpar.overlap.lane import Lane

OP = "doubling"


def distances(n: int) -> list[int]:
    """The distances of the all-gather's steps: 1, 2, 4, ... below ``n`` (``ceil(log2 n)`` of them)."""
    return [1 << k for k in range(math.ceil(math.log2(n)))] if n > 1 else []


def gather_steps(n: int, rank: int) -> list[tuple[int, int, int, int]]:
    """The all-gather's steps of ``rank``: ``(to, send_count, from, recv_at)`` in chunks: send positions
    ``[0, send_count)`` to ``to``, receive ``send_count`` chunks at ``recv_at`` from ``from``."""
    return [((rank - d) % n, min(d, n - d), (rank + d) % n, d) for d in distances(n)]


def scatter_steps(n: int, rank: int) -> list[tuple[int, int, int, int]]:
    """The reduce-scatter's steps of ``rank``: ``(to, count, from, send_at)``: send positions
    ``[send_at, send_at + count)`` to ``to``, receive ``count`` chunks from ``from`` and add them into
    ``[0, count)``."""
    return [((rank + d) % n, min(d, n - d), (rank - d) % n, d) for d in reversed(distances(n))]


class _LaneWork:
    """The completion of a collective run as lane items (CPU): waits for every item, in order."""

    def __init__(self, lane: Lane, items: int) -> None:
        self.lane, self.items = lane, items

    def wait(self, timeout=None) -> bool:
        for item in range(self.items):
            self.lane.wait(item)
        return True


class _EventWork:
    """The completion of a collective run on a side stream (CUDA): the waiting stream waits for its event."""

    def __init__(self, event, keep: tuple) -> None:
        self.event, self.keep = event, keep  # keep: buffers the side stream uses, alive until the wait

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        self.keep = ()  # later allocations of the waiting stream are ordered after the side stream's use
        return True


_SIDE_STREAMS: dict[int, object] = {}


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _post(info, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], timeout_s: float) -> list:
    """Post this rank's sends ``(tensor, group rank)`` and receives; one batch where they share a group (the
    gloo twin groups of :func:`flashpar.dist.p2p_group` otherwise: one group per direction)."""
    ops = []
    for is_send, pairs in ((True, sends), (False, recvs)):
        for t, peer in pairs:
            src, dst = (info.rank, peer) if is_send else (peer, info.rank)
            group = p2p_group(info, src, dst, op_name=OP, timeout_s=timeout_s)
            ops.append(dist.P2POp(dist.isend if is_send else dist.irecv, t, info.global_rank(peer), group))
    if len({id(op.group) for op in ops}) == 1:
        return dist.batch_isend_irecv(ops)
    return [op.op(op.tensor, op.peer, group=op.group) for op in ops]  # a batch takes one group only


def _run(info, steps: list, timeout_s: float, device: torch.device, what: str, finish=None, keep: tuple = ()):
    """Run ``steps`` (functions that post one step's transfers and return their handles, each after the previous
    step completed) and then ``finish`` (no transfers); returns a work whose ``wait`` completes them.  ``keep``:
    buffers of the steps the caller does not hold (alive until the wait)."""
    if stream_waits(info.group):
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for step in steps:
                for work in step():
                    work.wait()  # the side stream waits for the transfer, not the host
            if finish is not None:
                finish()
            event = torch.cuda.Event()
            event.record(side)
        return _EventWork(event, keep)
    lane = Lane(OP, info.rank, timeout_s=timeout_s, threaded=True, group=info.group, hold=False)
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        lane.submit(i, step, f"{what} step {i}", after_done=finish if last else None)
    return _LaneWork(lane, len(steps))


def post_all_gather(buf: torch.Tensor, chunk: int, group=None, *, timeout_s: float = DEFAULT_TIMEOUT_S):
    """All-gather into ``buf`` (``n x chunk`` elements, rotated order; positions ``[0, chunk)`` hold this rank's
    chunk on entry): returns a work; after its ``wait``, position ``j`` holds rank ``(rank + j) mod n``'s chunk."""
    info = resolve_group(group)
    n, r = info.world_size, info.rank
    if buf.dim() != 1 or buf.numel() != n * chunk:
        raise ValueError(f"{OP} all-gather: rank {r}: the buffer holds {tuple(buf.shape)}, expected ({n * chunk},)")
    if n > 1:
        p2p_group(info, 0, 1, op_name=OP, timeout_s=timeout_s)  # every rank creates the twin group here, at once

    def step(to: int, count: int, src: int, at: int) -> list:
        return _post(info, [(buf[: count * chunk], to)], [(buf[at * chunk : (at + count) * chunk], src)], timeout_s)

    steps = [functools.partial(step, *s) for s in gather_steps(n, r)]
    return _run(info, steps, timeout_s, buf.device, f"all-gather of {n} x {chunk}")


def post_reduce_scatter(buf: torch.Tensor, out: torch.Tensor, group=None, *, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Reduce-scatter ``buf`` (``n x C`` elements, rotated order: position ``j`` holds this rank's contribution to
    rank ``(rank + j) mod n``'s section; overwritten) into ``out`` (``C`` elements): returns a work; after its
    ``wait``, ``out`` holds the sum over the group of every rank's section for this rank."""
    info = resolve_group(group)
    n, r = info.world_size, info.rank
    chunk = out.numel()
    if buf.dim() != 1 or buf.numel() != n * chunk or out.dtype != buf.dtype:
        raise ValueError(f"{OP} reduce-scatter: rank {r}: buffer {tuple(buf.shape)} {buf.dtype} and output "
                         f"{tuple(out.shape)} {out.dtype} are not n x C and C elements of one dtype (n = {n})")
    if n == 1:
        out.copy_(buf)
        return _LaneWork(None, 0)
    p2p_group(info, 0, 1, op_name=OP, timeout_s=timeout_s)
    plan = scatter_steps(n, r)
    scratch = torch.empty(plan[0][1] * chunk, dtype=buf.dtype, device=buf.device)  # the largest step's count

    def step(i: int) -> list:
        if i:  # what the previous step received, added before this one sends (it may send those positions on)
            received = plan[i - 1][1] * chunk
            buf[:received].add_(scratch[:received])
        to, count, src, at = plan[i]
        return _post(info, [(buf[at * chunk : (at + count) * chunk], to)], [(scratch[: count * chunk], src)], timeout_s)

    def finish() -> None:  # the last step has count 1: its add writes the result
        torch.add(buf[:chunk], scratch[:chunk], out=out)

    steps = [functools.partial(step, i) for i in range(len(plan))]
    return _run(info, steps, timeout_s, buf.device, f"reduce-scatter of {n} x {chunk}", finish, keep=(scratch,))
