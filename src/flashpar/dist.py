"""Process groups, device meshes, timeouts, cross-rank input checks and free ports.

Everything that takes ``group=`` accepts ``None`` (the default world group), a
``torch.distributed.ProcessGroup`` or a one-dimensional ``DeviceMesh``.  Callers
pass groups explicitly; the only module-level state is a cache of twin gloo groups
for point-to-point transfers (:func:`p2p_group`), weakly keyed by the group object
they shadow (a freed group's entry goes with it; a new group never finds an old twin).

Cross-rank check: a rank can validate only its own tensors.  Inputs that must
agree across ranks (feature sizes, trailing dims, dtype, mode) are compared by
one small all-gather of integer metadata, so that a mismatch raises the same
clear error on every rank instead of hanging in a point-to-point wait.  A rank
whose local validation failed still takes part in that all-gather with an error
flag, so its peers raise too rather than waiting for data that never comes.
"""

from __future__ import annotations

import datetime
import math
import socket
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashpar.mesh import twin_group
from flashpar.timeout import DEFAULT_TIMEOUT_S

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class GroupInfo:
    """The resolved group of one call: the process group, its size and this rank's index in it."""

    group: dist.ProcessGroup | None
    world_size: int
    rank: int

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (P2P calls take global ranks)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def resolve_group(group=None) -> GroupInfo:
    """Turn ``None`` / ProcessGroup / 1-D DeviceMesh into a :class:`GroupInfo`.

    Without an initialised default group, ``group=None`` means a single process
    (world size 1), so every op also runs in a plain script.
    """
    if group is not None and group.__class__.__name__ == "DeviceMesh":
        if group.ndim != 1:
            raise ValueError(
                f"a DeviceMesh passed as group must be 1-D, got mesh dims {group.mesh_dim_names or group.ndim}; "
                "pass a sub-mesh such as mesh['tp']"
            )
        group = group.get_group()
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return GroupInfo(None, 1, 0)
        return GroupInfo(None, dist.get_world_size(), dist.get_rank())
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None, a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")
    return GroupInfo(group, dist.get_world_size(group), dist.get_rank(group))


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def wait_work(work, timeout_s: float, *, host: bool) -> None:
    """Complete one posted transfer or collective.  ``host=True`` (gloo, CPU tensors): this thread waits, at
    most ``timeout_s``.  ``host=False`` (NCCL): the current stream waits for it and the host goes on; a
    timeout there would make torch block the host until the transfer is done ("In case of blockingWait or
    a timeout value is specified by the user, we block the CPU thread": ``WorkNCCL::wait``, torch >= 2.4),
    a host synchronisation per transfer.  NCCL's watchdog bounds that wait by the group's own timeout."""
    if host:
        work.wait(as_timedelta(timeout_s))
    else:
        work.wait()


def from_rank0(value, group=None):
    """Rank 0's ``value`` (any picklable object) on every rank of ``group`` (a collective call; ``value`` as
    it is outside a process group or in a group of one)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def stream_waits(group) -> bool:
    """Whether transfers on ``group`` (None: the default group) are waited for by the stream (NCCL), not
    the host (:func:`wait_work`)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl"


_UPWARD_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""group -> its twin for upward messages (the group itself off gloo).  Weak keys: an ``id()`` key
would outlive a destroyed group and alias the next group allocated at the same address."""


def p2p_group(info: GroupInfo, src: int, dst: int, *, op_name: str = "p2p", timeout_s: float = DEFAULT_TIMEOUT_S):
    """The process group that carries a point-to-point message from group rank ``src`` to ``dst``.

    gloo sends both directions between two ranks over one TCP connection, and a swap
    (r -> p while p -> r, as in every exchange at N = 2) then runs at about half the link
    rate.  On gloo, messages to a higher rank therefore travel on a twin group of the same
    ranks (its own connections), messages to a lower rank on the group itself.  The twin is
    created once per group, the first time all its members run a point-to-point schedule.
    NCCL (and a group of one) use the group itself.
    """
    if src > dst or info.world_size == 1:
        return info.group
    key = info.group if info.group is not None else dist.group.WORLD  # a re-initialised world is a new key
    twin = _UPWARD_GROUPS.get(key)
    if twin is None:
        if dist.get_backend(info.group) != "gloo":
            return info.group
        ranks = [info.global_rank(r) for r in range(info.world_size)]
        try:
            twin = twin_group(ranks, timeout_s)
        except RuntimeError as err:
            others = ", ".join(f"rank {p}" for p in range(info.world_size) if p != info.rank)
            raise RuntimeError(
                f"{op_name}: rank {info.rank}: creating the twin gloo group for point-to-point transfers timed "
                f"out after {timeout_s:.0f}s: not all of {others} joined (died or took another code path)"
            ) from err
        # The twin stays registered with torch until the world is destroyed: torch names such groups by
        # a hash of (ranks, number of live groups), so destroying a twin would let the next twin take
        # its name and meet stale rendezvous keys (measured: "connectFullMesh failed ... refused").
        _UPWARD_GROUPS[key] = twin
    return twin


_DTYPE_CODES = {
    torch.float32: 1,
    torch.float64: 2,
    torch.bfloat16: 3,
    torch.float16: 4,
}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, 99)


META_WIDTH = 24


def exchange_metadata(
    info: GroupInfo,
    values: list[int],
    *,
    device: torch.device,
    op_name: str,
    local_error: BaseException | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """All-gather one small int64 vector per rank; returns ``[world_size, len(values)]``.

    ``local_error``: this rank's own validation failure.  It is raised here after
    the exchange, and every other rank raises a ``RuntimeError`` naming this rank,
    so a bad input on one rank never leaves its peers waiting.
    """
    if len(values) > META_WIDTH:
        raise ValueError(f"{op_name}: {len(values)} metadata values exceed the fixed width {META_WIDTH}")
    flag = 0 if local_error is None else 1
    # Fixed width: ranks whose tensors differ in rank (ndim) still exchange equal-sized rows.
    padded = [*values, *([-1] * (META_WIDTH - len(values)))]
    mine = torch.tensor([flag, len(values), *padded], dtype=torch.int64, device=device)
    if info.world_size == 1:
        if local_error is not None:
            raise local_error
        return mine[2 : 2 + len(values)].unsqueeze(0)
    flat = torch.empty(info.world_size * mine.numel(), dtype=torch.int64, device=device)
    work = all_gather_single(flat, mine, group=info.group, async_op=True)
    try:
        work.wait(as_timedelta(timeout_s))
    except RuntimeError as err:
        raise RuntimeError(
            f"{op_name}: rank {info.rank} timed out after {timeout_s:.0f}s in the cross-rank shape check; "
            "a peer did not call the same op (a rank died or took another code path)"
        ) from err
    table = flat.view(info.world_size, -1).cpu()
    if local_error is not None:
        raise local_error
    bad = [r for r in range(info.world_size) if int(table[r, 0]) != 0]
    if bad:
        raise RuntimeError(f"{op_name}: rank(s) {bad} rejected their input (see the error raised there)")
    if int(table[:, 1].min()) != int(table[:, 1].max()):
        raise RuntimeError(f"{op_name}: ranks disagree on the number of input dimensions: {table[:, 1].tolist()}")
    return table[:, 2 : 2 + len(values)]


def all_gather_blocks(rows: torch.Tensor, sizes: list[int], group=None, *,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> list[torch.Tensor]:
    """Every rank's block of rows (rank ``p`` holds ``sizes[p]`` rows of the same trailing shape), in rank
    order: one all-gather of blocks padded to the largest (gloo gathers only equal, flat tensors)."""
    n, longest = len(sizes), max(sizes)
    width = math.prod(rows.shape[1:])
    padded = rows.new_zeros((longest * width,))
    padded[: rows.numel()] = rows.reshape(-1)
    flat = rows.new_empty((n * longest * width,))
    wait_work(all_gather_single(flat, padded, group=group, async_op=True), timeout_s, host=not stream_waits(group))
    blocks = flat.view(n, longest, *rows.shape[1:])
    return [blocks[p, : sizes[p]] for p in range(n)]


def all_gather_cat(x: torch.Tensor, group, n: int, dim: int = 0) -> torch.Tensor:
    """Every rank's ``x`` (one shape on every rank) concatenated along ``dim`` in rank order; ``x`` itself on a
    group of one (no copy)."""
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the launcher's ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
