"""The ZeRO-3 units of ``ParallelLlama``: which parameters travel together, in which order, on which groups.

Every tp-split parameter keeps its rows over the shard group (the dp x cp x ulysses ranks of the rank's tp
index, ``flashpar.models.zero``).  A block runs one of two schedules, given per block (``block_schedules``):
``prefetch`` puts its four projections in one unit of ``flashpar.overlap.prefetch``; ``fused`` leaves them to
the per-peer decomposition fused with their GEMMs (``flashpar.overlap.sharded``).  The vocabulary tables are
always units (a lookup and the head's GEMM run on the whole table)::

    units, in forward order:   embed | block i (prefetched ones) ... | head (untied)
    kept for backward:         tied  |                 the last block  | yes
    gathered again:            tied  | yes (but kept)                  | kept

Every unit travels in the compute dtype (bf16 under mixed precision, as FSDP2's ``param_dtype``); gradients are
reduce-scattered in the master dtype (fp32).  The embedding's lookup saves only indices, so its backward needs
no weight and its unit is not gathered again (tied, the head's GEMM needs it: the unit is kept from the start
of forward to the end of backward).  The last block and the head are the first units of backward: kept,
backward starts without a gather (as FSDP2 leaves the last block unsharded after forward).

Groups: the unit gathers and reduce-scatters ride two groups of their own (``flashpar.mesh.model_groups``: every
rank creates every group, in the same order), and the fused blocks' transfers a third, so no lane's collectives
interleave with another's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from flashpar.overlap.prefetch import Prefetcher
from flashpar.overlap.unit import Member, ShardedUnit

SCHEDULES = ("prefetch", "fused")


def block_schedules(spec: str | Sequence[str], layers: int, ulysses: int) -> list[str]:
    """One schedule per block from ``spec`` (a name for every block, or one per block); ValueError (one line)
    on anything else.  Under Ulysses only ``prefetch`` (the all-to-all's GEMM needs the whole weight)."""
    names = [spec] * layers if isinstance(spec, str) else list(spec)
    if len(names) != layers or any(n not in SCHEDULES for n in names):
        raise ValueError(f"zero_schedule must be one of {SCHEDULES} or one per block ({layers}), got {spec!r}")
    if ulysses > 1 and "fused" in names:
        raise ValueError("zero_schedule 'fused' does not apply under Ulysses (its projections are whole weights, "
                         "gathered by prefetch)")
    return names


def build_prefetcher(model, schedules: list[str], groups, depth: int, timeout_s: float,
                     collective: str = "ring") -> Prefetcher:
    """The units of ``model`` (a ``ParallelLlama`` whose tp-split parameters hold their rows), their prefetcher,
    and each prefetched projection's ``source``; sets ``model.units`` (``{"embed": k, "blocks": [k or None],
    "head": k or None}``).  ``collective``: how every unit travels (``flashpar.overlap.unit.COLLECTIVES``)."""
    gather = groups.gather
    n, rank = dist.get_world_size(gather), dist.get_rank(gather)
    dtype = model.compute_dtype
    units: list[ShardedUnit] = []
    keep, again = set(), []

    def add(name: str, members: list[Member], dtype: torch.dtype, regather: bool) -> int:
        units.append(ShardedUnit(name, members, n, rank, dtype, collective))
        again.append(regather)
        return len(units) - 1

    tied = model.head is None
    where = {"embed": add("embed", [Member(model.embed.weight, model.embed.total_rows)], dtype, tied),
             "blocks": [], "head": None}
    if tied:
        keep.add(where["embed"])
    for i, (block, schedule) in enumerate(zip(model.blocks, schedules, strict=True)):
        if schedule != "prefetch":
            where["blocks"].append(None)
            continue
        projections = (block.qkv, block.o_proj, block.gate_up, block.down)
        regroup = getattr(block, "qkv_rows", None) if block.ulysses_group is not None else None
        members = [Member(p.weight, p.total_rows, regroup if p is block.qkv else None) for p in projections]
        where["blocks"].append(add(f"block {i}", members, dtype, True))
    last = where["blocks"][-1] if where["blocks"] else None
    if last is not None:
        keep.add(last)
    if not tied:
        where["head"] = add("head", [Member(model.head.weight, model.head.total_rows)], dtype, True)
        keep.add(where["head"])
    pf = Prefetcher(units, gather_group=gather, scatter_group=groups.scatter, depth=depth, keep=keep,
                    regather=again, timeout_s=timeout_s)
    for block, k in zip(model.blocks, where["blocks"], strict=True):
        if k is not None:
            for m, p in enumerate((block.qkv, block.o_proj, block.gate_up, block.down)):
                p.source = functools.partial(pf.weight, k, m)
    model.units = where
    return pf
