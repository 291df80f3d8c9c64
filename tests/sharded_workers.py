"""Per-rank bodies of the sharded data-parallel tests (run by dist_harness.run_ranks).

Every rank builds the same full layer from one seed and its *own* batch (a different
number of rows on each rank, as data parallelism allows); the reference is the float64
layer on each rank's batch, with the weight gradient averaged over ranks (DDP / FSDP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpar.overlap import ShardedLinear, average_replicated_grads, shard_linears, sharded_linear
from flashpar.rows import shard_rows

# fp32 unit roundoff 6e-8; the longest reduction here (grad_W over ranks x rows) has < 100 terms,
# so order differences stay ~1e-6 relative; 1e-5 leaves margin while a wrong block is O(1).
FP32_TOL = 1e-5
# bf16 unit roundoff 3.9e-3: inputs, the output and each reduce-scatter partial are rounded (a few u).
BF16_TOL = 3e-2

MODES = [("flash", 1), ("flash", 2), ("ring", 1), ("ring", 2), ("slice", 2), ("none", None), ("auto", None)]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _data(rank: int, n_in: int, n_out: int, mid: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch ``x`` (2 + rank rows) and output gradient, float64."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2 + rank, *mid, n_in, dtype=torch.float64, generator=gen)
    return x, torch.randn(*x.shape[:-1], n_out, dtype=torch.float64, generator=gen)


def linear_cases(rank: int, n: int) -> dict[str, str | None]:
    out = {}
    for mode, k in MODES:
        for bias in (True, False):
            for n_out in (4 * n, 4 * n + 3 if n > 1 else 5):
                out[f"{mode}-k{k}-bias{bias}-out{n_out}"] = _one(rank, n, mode, k, bias, n_out, (), torch.float32)
    out["flash-mid-bf16"] = _one(rank, n, "flash", 1, True, 3 * n + 1, (2,), torch.bfloat16)
    out["flash-only-x-grad"] = _one(rank, n, "flash", 2, True, 2 * n + 1, (), torch.float32, train_weight=False)
    out["flash-only-w-grad"] = _one(rank, n, "flash", 2, True, 2 * n + 1, (), torch.float32, train_input=False)
    return out


def _one(rank, n, mode, k, bias, n_out, mid, dtype, train_weight=True, train_input=True) -> str | None:
    n_in = 6
    torch.manual_seed(0)
    w_full = torch.randn(n_out, n_in, dtype=torch.float64)
    b_full = torch.randn(n_out, dtype=torch.float64) if bias else None
    x_ref, gy = _data(rank, n_in, n_out, mid)
    lo, hi = shard_rows(n_out, n, rank)
    w = w_full[lo:hi].to(dtype).requires_grad_(train_weight)
    b = b_full[lo:hi].to(dtype).requires_grad_(train_weight) if bias else None
    x = x_ref.to(dtype).requires_grad_(train_input)
    y = sharded_linear(x, w, b, mode=mode, chunks=k)
    y.backward(gy.to(dtype))
    # reference: this rank's output and input gradient; the weight gradient averaged over every rank's batch
    y_ref = F.linear(x_ref, w_full, b_full)
    gw_ref = torch.zeros_like(w_full)
    gb_ref = torch.zeros(n_out, dtype=torch.float64)
    for j in range(n):
        xj, gyj = _data(j, n_in, n_out, mid)
        gw_ref += gyj.reshape(-1, n_out).t() @ xj.reshape(-1, n_in) / n
        gb_ref += gyj.reshape(-1, n_out).sum(0) / n
    pairs = {"y": (y, y_ref)}
    if train_input:
        pairs["grad_x"] = (x.grad, gy @ w_full)
    if train_weight:
        pairs["grad_w"] = (w.grad, gw_ref[lo:hi])
        if bias:
            pairs["grad_b"] = (b.grad, gb_ref[lo:hi])
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    bad = [f"{name}: rel err {_rel(got, ref):.3g}" for name, (got, ref) in pairs.items()
           if got is None or not _rel(got, ref) <= tol]
    return "; ".join(bad) or None


def model_step(rank: int, n: int, mode: str) -> str | None:
    """shard_linears on an MLP with a LayerNorm: one step of a per-rank mean loss, gradients averaged."""
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.GELU(), nn.Linear(10, 5, bias=False))
    ref = [_rank_grads(full, j) for j in range(n)]
    model = shard_linears(_copy(full), mode=mode)
    assert isinstance(model[0], ShardedLinear) and isinstance(model[3], ShardedLinear)
    x, _ = _data(rank, 6, 5, ())
    model(x.float()).square().mean().backward()
    average_replicated_grads(model)
    bad = []
    for (name, p), (_, p_full) in zip(model.named_parameters(), full.named_parameters(), strict=True):
        g_ref = sum(g[name] for g in ref) / n
        if p.shape != p_full.shape:  # a shard: this rank's rows
            lo, hi = shard_rows(p_full.shape[0], n, rank)
            g_ref = g_ref[lo:hi]
        if not _rel(p.grad, g_ref) <= FP32_TOL:
            bad.append(f"{name}: rel err {_rel(p.grad, g_ref):.3g}")
    return "; ".join(bad) or None


def model_step_all_modes(rank: int, n: int) -> dict[str, str | None]:
    return {mode: model_step(rank, n, mode) for mode in ("flash", "ring", "slice", "none", "auto")}


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def _rank_grads(full: nn.Module, j: int) -> dict[str, torch.Tensor]:
    """float64 gradients of rank ``j``'s mean loss on the full model."""
    ref = _copy(full).double()
    x, _ = _data(j, 6, 5, ())
    ref(x).square().mean().backward()
    return {name: p.grad for name, p in ref.named_parameters()}


def error_cases(rank: int, n: int) -> dict[str, str]:
    from overlap_workers import _outcome

    w = torch.randn(3, 8)
    out = {
        "unknown_mode": _outcome(lambda: sharded_linear(torch.randn(4, 8), w, mode="fast")),
        "feature_mismatch": _outcome(lambda: sharded_linear(torch.randn(4, 7), w)),
        "bias_mismatch": _outcome(lambda: sharded_linear(torch.randn(4, 8), w, torch.randn(2))),
        "split_wrong": _outcome(lambda: sharded_linear(torch.randn(4, 8), w, split_sizes=[2] * n)),
    }
    if n > 1:
        x = torch.randn(4, 7 if rank == 1 else 8)  # consistent on each rank, different across ranks
        out["features_differ"] = _outcome(lambda: sharded_linear(x, torch.randn(3, x.shape[1])))
    y = sharded_linear(torch.ones(2, 4), torch.full((1, 4), float(rank)))  # the group is still healthy
    out["healthy_after"] = "ok" if torch.equal(y[0], 4.0 * torch.arange(n, dtype=torch.float32)) else str(y)
    return out
