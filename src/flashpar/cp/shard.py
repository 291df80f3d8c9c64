"""Moving whole-sequence tensors to and from a plan's per-rank layout.

``shard(x, plan, rank)`` takes the rows of rank ``rank`` (``plan.local_indices(rank)``, in its
local order); ``gather(x_local, plan, group)`` is its inverse: every rank gets the whole sequence
back in global order (an all-gather; not differentiable, for checks and outputs).
"""

from __future__ import annotations

import torch

from flashpar.cp.cp_plan import CPPlan
from flashpar.dist import DEFAULT_TIMEOUT_S, all_gather_blocks, resolve_group


def shard(x: torch.Tensor, plan: CPPlan, rank: int, dim: int = 0) -> torch.Tensor:
    if x.shape[dim] != plan.total_tokens:
        raise ValueError(f"cp.shard: dim {dim} of x has {x.shape[dim]} tokens, the plan {plan.total_tokens}")
    return x.index_select(dim, plan.local_indices(rank).to(x.device))


@torch.no_grad()
def gather(x_local: torch.Tensor, plan: CPPlan, group=None, dim: int = 0, *,
           timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    info = resolve_group(group)
    if info.world_size != plan.cp_size:
        raise ValueError(f"cp.gather: the plan is for cp_size {plan.cp_size}, the group has {info.world_size} ranks")
    x = x_local.movedim(dim, 0)
    counts = [sum(b - a for a, b in segs) for segs in plan.segments]
    if x.shape[0] != counts[info.rank]:
        raise ValueError(f"cp.gather: rank {info.rank} holds {x.shape[0]} rows, the plan gives it {counts[info.rank]}")
    full = x.new_empty((plan.total_tokens, *x.shape[1:]))
    if info.world_size == 1:
        full[plan.local_indices(0).to(x.device)] = x
        return full.movedim(0, dim)
    for r, block in enumerate(all_gather_blocks(x, counts, info.group, timeout_s=timeout_s)):
        full[plan.local_indices(r).to(x.device)] = block
    return full.movedim(0, dim)
