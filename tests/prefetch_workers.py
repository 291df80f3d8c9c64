"""Per-rank bodies of the ZeRO-3-by-prefetch tests (``flashpar.overlap.prefetch``; run by dist_harness.run_ranks).

A (dp, tp) mesh on ``dp * tp`` ranks (global rank ``d * tp + t``).  The model is ``L`` residual MLP layers with
tensor + sequence parallelism, every weight's tp shard split by rows over dp and gathered by a unit per layer::

    x_shard [S_t, h]                                                         (replica d's batch, tp block t)
    layer l:  a = tanh(all_gather_matmul(x_shard, W1_t[rows]))            W1 [f, h]: tp rows, then dp rows
              x_shard = x_shard + matmul_reduce_scatter(a, W2_t)           W2 [h, f]: tp columns, dp rows
    loss  = sum(x_shard * target_shard)

Layer 0's ``W1_t`` is presented in another row order with a repeated row (``regroup``: the Ulysses q/k/v case),
its gradient summed over the repeats.  Every rank builds the same float64 weights and every replica's batch
from one seed; the reference is the single-process float64 model on each replica's full batch, the weight
gradients summed over the replicas (the trainer's convention), cut to this rank's rows.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from flashpar.overlap.ops import all_gather_matmul, matmul_reduce_scatter
from flashpar.overlap.prefetch import Prefetcher
from flashpar.overlap.unit import Member, ShardedUnit
from flashpar.rows import row_sizes, shard_rows

MESHES = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (4, 1), (1, 4)]}
LAYERS, H, F = 3, 5, 3  # f = F * tp: W1_t has 3 rows, uneven over dp = 2 and 4; h = 5 rows of W2, uneven too
# float64 throughout: the mesh only reorders sums of < 50 terms, ~1e-15 relative; 1e-10 leaves margin while a
# missing, doubled or misplaced block is O(1)
TOL = 1e-10
# (depth, keep the last unit, activation checkpointing, collective: half of the schedules move the units by the
# backend's ring collectives, half by flashpar.overlap.doubling's point-to-point steps)
SCHEDULES = [(0, False, False, "ring"), (1, False, False, "doubling"), (1, True, False, "ring"),
             (2, True, False, "doubling"), (1, True, True, "ring"), (0, False, True, "doubling")]


def mesh_groups(rank: int, dp: int, tp: int):
    """``(gather_group, scatter_group, tp_group, d, t)``; every rank creates every group in the same order."""
    gather = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    scatter = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    d, t = divmod(rank, tp)
    return gather[t], scatter[t], tp_groups[d], d, t


def _seq_len(j: int, tp: int) -> int:
    return 2 * tp + 1 + j  # uneven tp blocks, a different length per replica


def _regroup(rows: int) -> torch.Tensor:
    """A row order of ``rows`` rows with the last one repeated first: [rows-1, 0, 1, ..., rows-1]."""
    return torch.tensor([rows - 1, *range(rows)])


def _weights(tp: int):
    torch.manual_seed(0)
    f = F * tp
    return [(torch.randn(f, H, dtype=torch.float64) / 2, torch.randn(H, f, dtype=torch.float64) / 2)
            for _ in range(LAYERS)]


def _batch(j: int, tp: int):
    gen = torch.Generator().manual_seed(100 + j)
    x = torch.randn(_seq_len(j, tp), H, dtype=torch.float64, generator=gen)
    return x, torch.randn(x.shape, dtype=torch.float64, generator=gen)


def _reference(dp: int, tp: int, t: int):
    """Every weight's gradient summed over the replicas, and each replica's output (full, float64)."""
    weights = [(w1.clone().requires_grad_(), w2.clone().requires_grad_()) for w1, w2 in _weights(tp)]
    outs = []
    for j in range(dp):
        x, target = _batch(j, tp)
        for layer, (w1, w2) in enumerate(weights):
            w1_used = w1
            if layer == 0:  # tp rank t's rows presented in the regrouped order: the same product per tp block
                blocks = [w1[slice(*shard_rows(F * tp, tp, s))] for s in range(tp)]
                w1_used = torch.cat([b[_regroup(b.shape[0])] for b in blocks])
            x = x + torch.tanh(x @ w1_used.t()) @ _w2_for(w2, layer, tp).t()
        (x * target).sum().backward()
        outs.append(x.detach())
    return weights, outs


def _w2_for(w2: torch.Tensor, layer: int, tp: int) -> torch.Tensor:
    """W2 with its columns arranged as layer 0's regrouped activation needs (the repeated row's activation meets
    its own column again, so both of its weights' gradients sum two terms)."""
    if layer != 0:
        return w2
    blocks = []
    for s in range(tp):
        cols = w2[:, slice(*shard_rows(F * tp, tp, s))]
        blocks.append(torch.cat([cols[:, -1:], cols], dim=1))
    return torch.cat(blocks, dim=1)


def run_case(rank: int, world: int, dp: int, tp: int, depth: int, keep_last: bool, ckpt: bool, collective: str,
             groups) -> tuple[str | None, list, list]:
    """One training step of the model on the mesh; returns (errors or None, the gather / scatter trace, the
    units whose gathered buffers were alive after forward)."""
    gather_g, scatter_g, tp_g, d, t = groups
    full = _weights(tp)
    ref_weights, ref_outs = _reference(dp, tp, t)
    f_t = F * tp // tp
    units, params = [], []
    for layer, (w1, w2) in enumerate(full):
        w1_t = w1[slice(*shard_rows(F * tp, tp, t))]  # [f_t, h]
        w2_t = w2[:, slice(*shard_rows(F * tp, tp, t))]  # [h, f_t]
        p1 = torch.nn.Parameter(w1_t[slice(*shard_rows(f_t, dp, d))].clone())
        p2 = torch.nn.Parameter(w2_t[slice(*shard_rows(H, dp, d))].clone())
        m1 = Member(p1, f_t, _regroup(f_t) if layer == 0 else None)
        units.append(ShardedUnit(f"layer{layer}", [m1, Member(p2, H)], dp, d, torch.float64, collective))
        params.append((p1, p2))
    pf = Prefetcher(units, gather_group=gather_g, scatter_group=scatter_g, depth=depth,
                    keep={LAYERS - 1} if keep_last else set(), trace=True)
    x_full, target_full = _batch(d, tp)
    split = row_sizes(x_full.shape[0], tp)
    rows = slice(*shard_rows(x_full.shape[0], tp, t))
    x = x_full[rows].clone()
    target = target_full[rows]

    def layer_fn(k: int, x_in: torch.Tensor) -> torch.Tensor:
        w1, w2 = pf.weight(k, 0), pf.weight(k, 1)
        if k == 0:  # the regrouped rows: the repeated (last) row's activation first, meeting W2's last column
            w2 = torch.cat([w2[:, -1:], w2], dim=1)
        a = torch.tanh(all_gather_matmul(x_in, w1, group=tp_g, split_sizes=split, check=False))
        return x_in + matmul_reduce_scatter(a, w2, group=tp_g, split_sizes=split, check=False)

    pf.begin()
    for k in range(LAYERS):
        pf.enter(k)
        if ckpt:
            x = checkpoint(layer_fn, k, x, use_reentrant=False)
        else:
            with pf.saving(k):
                x = layer_fn(k, x)
        x = pf.exit(k, x)
    gc.collect()
    alive = sorted({k for k, ref in pf.buffers if ref() is not None})
    (x * target).sum().backward()
    errors = []
    if depth:  # the last reduce-scatter posted (unit 0's) left in flight, landed after (a group of one: none)
        tail = pf.finish(leave_last=True)
        want = params[0] if dp > 1 else ()
        if [id(p) for p in tail] != [id(p) for p in want] or any(p.grad is not None for p in tail):
            errors.append("the tail is not unit 0's, or landed early")
        pf.finish_tail()
    else:
        pf.finish()
    ref_out = ref_outs[d][rows]
    if not torch.allclose(x.detach(), ref_out, rtol=TOL, atol=TOL):
        errors.append(f"output off by {(x.detach() - ref_out).abs().max():.2e}")
    for layer, ((p1, p2), (r1, r2)) in enumerate(zip(params, ref_weights, strict=True)):
        g1 = r1.grad[slice(*shard_rows(F * tp, tp, t))][slice(*shard_rows(f_t, dp, d))]
        g2 = r2.grad[:, slice(*shard_rows(F * tp, tp, t))][slice(*shard_rows(H, dp, d))]
        for name, p, g in (("W1", p1, g1), ("W2", p2, g2)):
            if p.grad is None or not torch.allclose(p.grad, g, rtol=TOL, atol=TOL):
                got = "none" if p.grad is None else f"{(p.grad - g).abs().max():.2e}"
                errors.append(f"layer {layer} {name} gradient: {got}")
    return ("; ".join(errors) or None), pf.trace, alive


def reference_cases(rank: int, world: int) -> dict[str, tuple]:
    """Every mesh of ``world`` ranks x every schedule of ``SCHEDULES``."""
    out = {}
    for dp, tp in MESHES[world]:
        groups = mesh_groups(rank, dp, tp)
        for depth, keep_last, ckpt, collective in SCHEDULES:
            out[f"dp{dp}-tp{tp}-depth{depth}-keep{int(keep_last)}-ckpt{int(ckpt)}-{collective}"] = run_case(
                rank, world, dp, tp, depth, keep_last, ckpt, collective, groups)
    return out
