"""Per-rank bodies of the all-to-all (Ulysses) op tests, run by dist_harness.run_ranks.

Every rank builds the full tensors from one seed; the reference is float64 on the full
sequence and all heads.  Rank r's share: tokens T_r (contiguous, sizes ``split``) before
and after attention, head group r (columns [r w, (r + 1) w)) during it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpar.overlap.a2a import all_to_all_matmul, matmul_all_to_all

# fp32: each output is one dot product of <= 24 terms, each weight-gradient entry a sum over
# <= 40 tokens; order differences stay ~1e-6 relative, 1e-5 leaves margin; a misplaced block is O(1).
FP32_TOL = 1e-5
BF16_TOL = 3e-2  # bf16 unit roundoff 3.9e-3, a few roundings (inputs, products, partial sums)
UNEVEN = {1: [5], 2: [3, 6], 3: [4, 1, 3], 4: [3, 0, 5, 2]}


@dataclass(frozen=True)
class A2ACase:
    op: str  # "qkv" (matmul_all_to_all) | "out" (all_to_all_matmul)
    mode: str
    chunks: int | None
    uneven: bool = False
    bias: bool = True
    mid: tuple[int, ...] = ()
    reduce: bool = False
    dtype: str = "float32"
    pass_split: bool = True
    train_weight: bool = True
    peers: int | None = None  # peers_per_piece

    @property
    def id(self) -> str:
        return "-".join([self.op, self.mode, f"k{self.chunks}", "uneven" if self.uneven else "even",
                         "bias" if self.bias else "nobias", f"mid{'x'.join(map(str, self.mid)) or '-'}",
                         "reduce" if self.reduce else "local", self.dtype] + ([] if self.pass_split else ["exch"])
                        + ([] if self.train_weight else ["frozen"]) + ([f"g{self.peers}"] if self.peers else []))


MODES = [("flash", 1), ("flash", 2), ("slice", 2), ("slice", 1), ("none", None), ("auto", None)]


def a2a_cases() -> list[A2ACase]:
    cases = []
    for op in ("qkv", "out"):
        for i, (mode, k) in enumerate(MODES):
            cases.append(A2ACase(op, mode, k, reduce=True))
            cases.append(A2ACase(op, mode, k, uneven=True, bias=i % 2 == 1, mid=(2,), pass_split=op == "out" or i % 2))
        cases.append(A2ACase(op, "flash", 2, uneven=True, dtype="bfloat16"))
        cases.append(A2ACase(op, "flash", 2, uneven=True, reduce=True, train_weight=False))  # input grad only
        # merged head groups (see overlap_cases.MERGES): N = 3 one piece of both peers, N = 4 pieces of 1 and 2
        # (g = 2) or one of all three (g = 3); a run of head groups is one batched GEMM of the same products, so
        # FP32_TOL / BF16_TOL hold as for one piece per peer
        for i, g in enumerate((2, 3)):
            cases.append(A2ACase(op, "flash", None, reduce=True, peers=g))
            cases.append(A2ACase(op, "flash", 1, uneven=True, bias=i % 2 == 1, mid=(2,), pass_split=op == "out" or i,
                                 peers=g))
        cases.append(A2ACase(op, "flash", None, uneven=True, dtype="bfloat16", peers=2))
    return cases


def _rel(got, ref) -> float:
    ref = ref.detach()
    return float((got.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))


def run_a2a_cases(rank: int, n: int, cases: list[A2ACase]) -> dict[str, str | None]:
    return {case.id: _one(rank, n, case) for case in cases}


def _one(rank: int, n: int, case: A2ACase) -> str | None:
    split = UNEVEN[n] if case.uneven else [3] * n
    lo, hi = sum(split[:rank]), sum(split[: rank + 1])
    s_total, feat, per_group = sum(split), 5, 3
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(7)
    if case.op == "qkv":  # x [S, in] -> out [S, N w]
        width_in, width_out, cols_in = feat, n * per_group, slice(None)
        cols_out = slice(rank * per_group, (rank + 1) * per_group)
    else:  # o [S, N u] -> y [S, out]
        width_in, width_out, cols_in = n * per_group, feat, slice(rank * per_group, (rank + 1) * per_group)
        cols_out = slice(None)
    x_full = torch.randn(s_total, *case.mid, width_in, dtype=torch.float64, generator=gen)
    w_full = torch.randn(width_out, width_in, dtype=torch.float64, generator=gen)
    b_full = torch.randn(width_out, dtype=torch.float64, generator=gen) if case.bias else None
    gy_full = torch.randn(s_total, *case.mid, width_out, dtype=torch.float64, generator=gen)
    xr = x_full.clone().requires_grad_()
    wr = w_full.clone().requires_grad_()
    br = b_full.clone().requires_grad_() if case.bias else None
    y_full = torch.nn.functional.linear(xr, wr, br)
    w = w_full.to(dtype).requires_grad_(case.train_weight)
    b = b_full.to(dtype).requires_grad_(case.train_weight) if case.bias else None
    split_arg = split if case.pass_split else None
    kw = {"mode": case.mode, "chunks": case.chunks, "split_sizes": split_arg, "reduce_weight_grad": case.reduce,
          "peers_per_piece": case.peers}
    if case.op == "qkv":
        x = x_full[lo:hi].to(dtype).requires_grad_()
        y = matmul_all_to_all(x, w, b, **kw)
        y.backward(gy_full[..., cols_out].to(dtype))
        y_ref, gy_mine = y_full[..., cols_out], gy_full[..., cols_out]
        grad_x_ref_rows = slice(lo, hi)
    else:
        x = x_full[..., cols_in].to(dtype).requires_grad_()
        y = all_to_all_matmul(x, w, b, **kw)
        y.backward(gy_full[lo:hi].to(dtype))
        y_ref, gy_mine = y_full[lo:hi], gy_full[lo:hi]
        grad_x_ref_rows = slice(None)
    del gy_mine
    # weight gradients: the whole sequence with reduce, else this rank's tokens only
    token_rows = slice(None) if case.reduce else slice(lo, hi)
    gy_w = gy_full[token_rows].reshape(-1, width_out)
    gw_ref = gy_w.t() @ x_full[token_rows].reshape(-1, width_in)
    gb_ref = gy_w.sum(0)
    y_full.backward(gy_full)
    grad_x_ref = xr.grad[grad_x_ref_rows][..., cols_in]
    pairs = {"y": (y, y_ref), "grad_in": (x.grad, grad_x_ref)}
    if case.train_weight:
        pairs["grad_w"] = (w.grad, gw_ref)
    if case.bias and case.train_weight:
        pairs["grad_b"] = (b.grad, gb_ref)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    bad = [f"{name}: rel err {_rel(got, ref):.3g}" for name, (got, ref) in pairs.items()
           if got is None or got.shape != ref.shape or not _rel(got, ref) <= tol]
    return "; ".join(bad) or None


def op_errors(rank: int, n: int) -> dict[str, str]:
    """The ops' one-line errors: features that differ across ranks, mode ring, weights of the wrong shape."""
    from overlap_workers import _outcome

    o = torch.randn(4 * n, 3)
    feat = 7 if rank == n - 1 else 8  # consistent on each rank, different across ranks
    out = {"features_differ": _outcome(lambda: matmul_all_to_all(torch.randn(4, feat), torch.randn(3 * n, feat)))}
    return out | {
        "ring_rejected": _outcome(lambda: matmul_all_to_all(torch.randn(4, 8), torch.randn(3 * n, 8), mode="ring")),
        "weight_columns": _outcome(lambda: all_to_all_matmul(o, torch.randn(5, 3 * n + 1))),
        "weight_rows": _outcome(lambda: matmul_all_to_all(torch.randn(4, 8), torch.randn(3 * n + 1, 8))),
    }
