"""What every overlapped op resolves before it runs: local checks, the cross-rank agreement, the mode.

:func:`prepare` is the one preamble of every public op: it runs the common local checks and the
op's own (a ``describe`` function returning :class:`Local`), settles the call across ranks and
returns the :class:`Call` the op's autograd function runs.

A rank can check only its own tensors (``check_*``, raised before any communication).
What must agree across ranks (features, dtype, requested mode, block lengths) is
settled by :func:`settle`: one small all-gather of integer metadata, after which every
rank raises the same clear error or runs the same schedule.  A rank whose own check
failed still joins that all-gather with an error flag, so its peers raise instead of
waiting for data that never comes.  With ``mode="auto"`` rank 0's pick binds every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from flashpar.dist import GroupInfo, exchange_metadata, resolve_group
from flashpar.overlap.row_space import RowSpace
from flashpar.overlap.schedule import MODES, check_peers_per_piece

MODE_CHOICES = (*MODES, "auto")
DEFAULT_CHUNKS = {"flash": 1, "ring": 1, "slice": 4, "none": 1}


@dataclass(frozen=True)
class Call:
    """Everything one op call resolved before running: group, mode, row layout."""

    op_name: str
    info: GroupInfo
    mode: str
    chunks: int
    rows: RowSpace
    mid_shape: tuple[int, ...]
    timeout_s: float
    save_gathered: bool = False
    reduce_weight: bool = False
    peers_per_piece: int = 1
    bwd: tuple[str, int, int] | None = None  # the backward's (mode, chunks, peers_per_piece), where it differs

    def backward(self) -> Call:
        """The call the op's backward runs: the same, or with the backward's own schedule (``auto`` picks the
        directions of ``flashpar.overlap.simulate.SPLIT_OPS`` apart).  Every mode is exact, so a backward in
        another mode than its forward computes the same gradients."""
        if self.bwd is None:
            return self
        mode, chunks, peers = self.bwd
        return replace(self, mode=mode, chunks=chunks, peers_per_piece=peers, bwd=None)


@dataclass(frozen=True)
class Local:
    """What an op's ``describe`` found on this rank: its block length (``local_len`` sequence
    positions, or weight rows), the middle dims, the (what, value) pairs every rank must share,
    and the simulator's view of the call (``sim``: op, rows, n_in, n_out) for ``mode="auto"``."""

    local_len: int
    sim: tuple[str, int, int, int]
    named: list[tuple[str, int]] = field(default_factory=list)
    mid_shape: tuple[int, ...] = ()


def prepare(op_name: str, group, tensors: dict[str, torch.Tensor | None], describe: Callable[[GroupInfo], Local], *,
            mode, chunks, split_sizes, check: bool, timeout_s: float, local_sizes: bool,
            modes: tuple[str, ...] = MODE_CHOICES, reduce_weight: bool = False, peers_per_piece=None,
            merged: bool = False, regather: bool = True, split_directions: bool = False) -> Call:
    """Validate one op call and agree on it across ranks; returns its :class:`Call`.

    ``tensors``: the call's tensors by name, the first being the activation (its dtype and device
    choose ``auto``'s cost model).  ``describe(info)`` raises ``ValueError`` / ``TypeError`` on bad
    local input (caught here, so the rank still joins the cross-rank check and every rank raises)
    and returns :class:`Local`.  ``local_sizes``: see :func:`settle`.  ``peers_per_piece``: the
    caller's merged pieces (flash; ``None``: one piece per peer).  ``merged``: the op runs
    ``Call.peers_per_piece`` (``auto`` considers merged pieces only then).  ``regather``: what ``auto``
    assumes of an ``ag_matmul``'s backward (it gathers ``x`` again, or reads the forward's copy);
    ``split_directions``: the op's backward runs ``Call.backward()``, so ``auto`` may pick it apart.
    """
    info = resolve_group(group)
    x = next(iter(tensors.values()))
    error: BaseException | None = None
    local, chosen = Local(0, ("", 0, 0, 0)), (("none", 1, 1), ("none", 1, 1))
    try:
        check_mode(op_name, mode, chunks, modes, peers_per_piece, merged)
        check_tensors(op_name, tensors)
        local = describe(info)
        chosen = pick_mode(mode, chunks, info.world_size, *local.sim, x, peers_per_piece=peers_per_piece,
                           merged=merged, regather=regather, split=split_directions, group=info.group)
    except (ValueError, TypeError) as err:
        error = err
    named = [] if error is not None else [*local.named, ("mode", modes.index(mode)), *mid_named(local.mid_shape)]
    device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    sizes, (chosen_mode, k, g), bwd = settle(op_name, info, error=error, local_len=local.local_len, named=named,
                                             chosen=chosen, split_sizes=split_sizes, local_sizes=local_sizes,
                                             check=check, device=device, timeout_s=timeout_s)
    return Call(op_name, info, chosen_mode, k, RowSpace(sizes, math.prod(local.mid_shape)), local.mid_shape,
                timeout_s, reduce_weight=reduce_weight, peers_per_piece=g,
                bwd=None if bwd == (chosen_mode, k, g) else bwd)


def check_mode(op_name: str, mode, chunks, choices: tuple[str, ...] = MODE_CHOICES, peers_per_piece=None,
               merged: bool = False) -> None:
    if mode not in choices:
        hint = " ('ring' forwards every block around the ring: not meaningful for all-to-all)" \
            if mode == "ring" else ""
        raise ValueError(f"{op_name}: unknown mode {mode!r}; expected one of {choices}{hint}")
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"{op_name}: chunks must be a positive int, got {chunks!r}")
    if peers_per_piece is None:
        return
    if not merged:
        raise ValueError(f"{op_name}: takes no peers_per_piece (its schedules keep one piece per peer)")
    if mode == "auto":
        raise ValueError(f"{op_name}: mode 'auto' chooses peers_per_piece itself; pass it with mode 'flash'")
    try:
        check_peers_per_piece(peers_per_piece, mode=mode, chunks=chunks)
    except ValueError as err:
        raise ValueError(f"{op_name}: {err}") from None


def check_tensors(op_name: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """Present tensors are tensors, on one device, of one dtype."""
    present = {name: t for name, t in tensors.items() if t is not None}
    bad = [name for name, t in present.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"{op_name}: {', '.join(bad)} must be tensors")
    devices = {name: t.device for name, t in present.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op_name}: tensors are on different devices: {devices}")
    dtypes = {name: t.dtype for name, t in present.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"{op_name}: tensors have different dtypes: {dtypes}")


def check_split(op_name: str, split_sizes, n: int, r: int, *, local: int | None = None,
                total: int | None = None, what: str = "rows") -> None:
    """``split_sizes``: ``n`` non-negative ints; entry ``r`` equal to ``local``, or summing to ``total``."""
    if split_sizes is None:
        if total is not None and total % n:
            raise ValueError(f"{op_name}: {what} {total} is not divisible by the group size {n}; pass split_sizes=")
        return
    sizes = list(split_sizes)
    if len(sizes) != n or any((not isinstance(s, int)) or s < 0 for s in sizes):
        raise ValueError(f"{op_name}: split_sizes {sizes} must be {n} non-negative ints (one per rank)")
    if local is not None and sizes[r] != local:
        raise ValueError(f"{op_name}: split_sizes[{r}] = {sizes[r]} but this rank has {local} {what}")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"{op_name}: split_sizes {sizes} add up to {sum(sizes)}, not to the {total} {what}")


def settle(op_name: str, info: GroupInfo, *, error: BaseException | None, local_len: int,
           named: list[tuple[str, int]], chosen: tuple[tuple[str, int, int], tuple[str, int, int]], split_sizes,
           local_sizes: bool, check: bool, device, timeout_s: float
           ) -> tuple[tuple[int, ...], tuple[str, int, int], tuple[str, int, int]]:
    """Agree on the call across ranks; returns (block lengths, forward pick, backward pick), a pick being
    (mode, chunks, peers per piece).

    ``named``: (what, value) pairs every rank must share.  ``chosen``: this rank's (forward, backward)
    picks; rank 0's bind.  ``local_len``: this rank's block length.  ``local_sizes=True``: the
    block lengths are the ranks' own lengths (exchanged when ``split_sizes`` is omitted, checked
    against it otherwise); ``False``: ``split_sizes`` (or equal blocks of ``local_len``) was given
    to every rank and must be the same list everywhere.  ``check=False`` skips the exchange: no
    collective, nothing read back to the host; a local error is raised on this rank only, and with
    ``mode="auto"`` each rank keeps its own pick.  That is for callers that checked their step once
    across ranks (``flashpar.models.step_check``: the shapes, the mode and the cost model's hardware
    agree there, so every rank's pick is the same function of the same numbers).
    """
    n = info.world_size
    if error is not None and (not check or n == 1):
        raise error
    fwd, bwd = chosen
    sizes = list(split_sizes) if split_sizes is not None else None
    if check and n > 1:
        picks = [MODES.index(fwd[0]), *fwd[1:], MODES.index(bwd[0]), *bwd[1:]]
        values = [] if error is not None else [local_len, *picks, *(v for _, v in named)]
        table = exchange_metadata(info, values, device=device, op_name=op_name, local_error=error,
                                  timeout_s=timeout_s)
        for col, (what, _) in enumerate(named, start=7):
            column = table[:, col].tolist()
            if len(set(column)) > 1:
                raise RuntimeError(f"{op_name}: ranks disagree on {what}: {column} (rank order)")
        lengths = table[:, 0].tolist()
        if sizes is not None and lengths != sizes:
            whose = "the ranks' actual lengths" if local_sizes else "the split the ranks were given"
            raise RuntimeError(f"{op_name}: split_sizes {sizes} differ from {whose} {lengths}")
        # 'auto': rank 0's picks bind every rank
        row = [int(v) for v in table[0, 1:7].tolist()]
        fwd, bwd = (MODES[row[0]], row[1], row[2]), (MODES[row[3]], row[4], row[5])
        if sizes is None and local_sizes:
            sizes = lengths
    if sizes is None:
        sizes = [local_len] * n
    return tuple(sizes), fwd, bwd


def pick_mode(mode: str, chunks: int | None, n: int, sim_op: str, rows: int, n_in: int, n_out: int,
              x: torch.Tensor, *, peers_per_piece: int | None = None, merged: bool = False, regather: bool = True,
              split: bool = False, group=None) -> tuple[tuple[str, int, int], tuple[str, int, int]]:
    """This rank's (forward, backward) picks of (mode, chunks, peers_per_piece): a group of one runs ``none``,
    a named mode runs both directions; ``auto`` asks the cost model for ``sim_op`` on ``rows`` x (``n_in`` ->
    ``n_out``) (see :func:`flashpar.overlap.simulate.op_shapes`), among merged pieces too where the op runs
    them (``merged``), each direction apart where the op runs them apart (``split``,
    ``flashpar.overlap.simulate.choose_modes``), on the figures of the op's ``group`` (``flashpar.links``: the
    device's, with the group's own link, as the simulator times that group)."""
    if n == 1:
        return ("none", 1, 1), ("none", 1, 1)
    if mode != "auto":
        pick = (mode, chunks or DEFAULT_CHUNKS[mode], peers_per_piece or 1)
        return pick, pick
    from flashpar.links import group_hardware_of
    from flashpar.overlap.simulate import choose_modes  # cost model: only needed for 'auto'

    hw = group_hardware_of(group, x.device.type)
    return choose_modes(sim_op, n, rows, n_in, n_out, x.element_size(), x.device.type, hw, merged=merged,
                        regather=regather, split=split)


def mid_named(mid_shape: tuple[int, ...]) -> list[tuple[str, int]]:
    return [(f"dim {i + 1} of the middle shape", d) for i, d in enumerate(mid_shape)]

