"""The global gradient norm of ``ParallelLlama`` over every shard, each element counted once, and clipping by it.

After ``reduce_grads`` every rank holding a copy of a parameter's piece holds the same summed gradient.
The single-process model's gradient norm is

    ||g||^2 = sum over the mesh parameters of  sum over their distinct pieces of ||g_piece||^2

where a piece is held by several ranks (its copies: ``flashpar.models.layout``'s ``grad_sum`` kinds).
Each piece is counted on ONE rank of its copies, the one with coordinate 0 on the dims it is
replicated over::

    grad_sum  the piece                        copies over              counted on the rank with
    copy      the whole parameter (norms)      the whole mesh           dp = cp = ulysses = tp = 0
    shard     tp shard t (embedding, head,     dp x cp x ulysses        dp = cp = ulysses = 0 (each t)
              projections; Ulysses: whole)
    zero      ZeRO-3 rows s of tp shard t      none (this rank alone)   every rank

Each rank sums the squares of the norms of the pieces it counts (``torch._foreach_norm``, the sum in
float64), ONE all-reduce over the mesh adds the ranks' sums, and the norm is its square root: a
device tensor, read by nobody inside the step.  Clipping then scales every gradient on every rank
(all copies) by the coefficient ``torch.nn.utils.clip_grad_norm_`` uses::

    coef = min(1, max_norm / (||g|| + 1e-6))        g <- coef * g   (torch._foreach_mul_, coef on device)

so there is no host synchronisation: the coefficient never leaves the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashpar.models.layout import layout_of

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


def counted_here(kind: str, *, dp_rank: int, cp_rank: int, u_rank: int, tp_rank: int) -> bool:
    """Whether the rank at these mesh coordinates counts its piece of a parameter of ``grad_sum`` kind
    ``kind`` (the table in the module docstring)."""
    if kind == "copy":
        return dp_rank == cp_rank == u_rank == tp_rank == 0
    if kind == "shard":
        return dp_rank == cp_rank == u_rank == 0
    if kind == "zero":
        return True
    raise ValueError(f"unknown grad_sum kind {kind!r} (copy, shard or zero)")


def global_grad_norm(model, *, group=None, tail=None) -> torch.Tensor:
    """The L2 norm of the single-process model's gradient (0-d float64 tensor on the model's device), from
    the summed gradients of ``model`` (a ``ParallelLlama`` after ``reduce_grads``).  A collective over
    ``group`` (default: the world group), which must be the ranks of the model's mesh.

    ``tail`` (``ParallelLlama.reduce_grads(leave_tail=True)``'s ``GradTail``): gradients still in flight.  The
    squares of every other counted piece are summed first, while they travel; then ``tail.finish()`` lands
    them and their squares are added (in a fixed order either way: the same sum on every run)::

        scatter lane:  | RS(embedding) ..........|
        main:          | squares of the rest    | wait | + squares of the tail | all-reduce
    """
    coords = {"dp_rank": model.dp_rank, "cp_rank": model.cp_rank, "u_rank": model.u_rank, "tp_rank": model.tp_rank}
    late = {id(p) for p in tail.params} if tail is not None else set()
    counted = [p for name, p in model.named_parameters()
               if counted_here(layout_of(name)[0].grad_sum(model.zero), **coords)]
    device = next(model.parameters()).device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for part in ("ready", "tail"):
        if part == "tail" and tail is not None:
            tail.finish()
        mine = [p.grad for p in counted if p.grad is not None and (id(p) in late) == (part == "tail")]
        if mine:
            squares = squares + torch.stack(torch._foreach_norm(mine)).double().square().sum()
    dist.all_reduce(squares, group=group)
    return squares.sqrt()


def clip_grads_(model, max_norm: float, *, group=None, tail=None) -> torch.Tensor:
    """The global gradient norm (``global_grad_norm``, ``tail``: gradients still in flight, landed inside);
    with ``max_norm > 0`` every gradient of ``model`` is first scaled by ``min(1, max_norm / (norm + 1e-6))``
    in place, on the device (``max_norm = 0``: measured, not clipped).  Returns the norm before clipping, as
    ``clip_grad_norm_`` does."""
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0 (0: no clipping), got {max_norm}")
    norm = global_grad_norm(model, group=group, tail=tail)
    if max_norm > 0:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads:
            coef = (max_norm / (norm + EPS)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm
