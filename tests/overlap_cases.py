"""Cases for the overlapped TP-SP ops, run inside each rank of a gloo group (see test_overlap_ops.py).

Every case builds the full tensors from one seed on every rank, runs the
distributed op on this rank's shards, and compares output and gradients with a
float64 single-process reference on the full tensors.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashpar.cost import Hardware
from flashpar.overlap import all_gather_matmul, matmul_reduce_scatter

# fp32: unit roundoff 6e-8; the reductions here are at most a few hundred terms long, so
# summation-order differences stay below ~1e-6 relative.  1e-5 leaves a 10x margin while a
# missing, duplicated or misplaced block gives an O(1) error.
FP32_TOL = 1e-5
# bf16: unit roundoff 3.9e-3; the output is rounded once and reduce-scatter partials are added in
# bf16 (up to N - 1 more roundings), so errors of a few u are expected; 3e-2 still catches any
# wrong block (O(1)).
BF16_TOL = 3e-2

MODES = [("flash", 1), ("flash", 2), ("ring", 1), ("ring", 2), ("slice", 2), ("slice", 3), ("none", None),
         ("auto", None)]
UNEVEN = {1: [5], 2: [3, 6], 3: [4, 1, 3], 4: [3, 0, 5, 2]}
# Merged pieces: at N = 3 both peers in one piece (it wraps past rank 0 on ranks 1 and 2: two GEMMs); at
# N = 4, g = 2 pieces of 1 and 2 peers (uneven merges), g = 3 one piece of every peer.  They do the products
# of one piece per peer, grouped into fewer GEMMs (a GEMM's sums over the reduced dim are unchanged; only the
# order of the summands of a reduce-scatter and of grad_W differs): the same FP32_TOL and BF16_TOL hold.
MERGES = (2, 3)


@dataclass(frozen=True)
class Case:
    op: str  # "ag" | "rs"
    mode: str
    chunks: int | None
    uneven: bool
    bias: bool
    mid: tuple[int, ...]
    dtype: str = "float32"
    save_gathered: bool = False
    pass_split: bool = True
    peers: int | None = None  # peers_per_piece

    @property
    def id(self) -> str:
        parts = [self.op, self.mode, f"k{self.chunks}", "uneven" if self.uneven else "even",
                 "bias" if self.bias else "nobias", f"mid{'x'.join(map(str, self.mid)) or '-'}", self.dtype]
        if self.peers is not None:
            parts.append(f"g{self.peers}")
        if self.save_gathered:
            parts.append("saved")
        if self.uneven and not self.pass_split:
            parts.append("exchanged")
        return "-".join(parts)


def all_cases() -> list[Case]:
    cases = []
    for op in ("ag", "rs"):
        for i, (mode, k) in enumerate(MODES):
            cases.append(Case(op, mode, k, uneven=False, bias=True, mid=()))
            cases.append(Case(op, mode, k, uneven=True, bias=i % 2 == 0, mid=(2,), pass_split=op == "rs" or i % 2 == 0))
        for mode, k in (("flash", 1), ("none", None)):
            cases.append(Case(op, mode, k, uneven=False, bias=True, mid=(), dtype="bfloat16"))
        for i, g in enumerate(MERGES):
            cases.append(Case(op, "flash", None, uneven=False, bias=True, mid=(), peers=g))
            cases.append(Case(op, "flash", 1, uneven=True, bias=i % 2 == 0, mid=(2,), peers=g,
                              pass_split=op == "rs" or i % 2 == 0))
        cases.append(Case(op, "flash", None, uneven=True, bias=True, mid=(), dtype="bfloat16", peers=2))
    for mode, k in (("flash", 2), ("ring", 1), ("slice", 2), ("none", None)):
        cases.append(Case("ag", mode, k, uneven=False, bias=True, mid=(2,), save_gathered=True))
    cases.append(Case("ag", "flash", None, uneven=True, bias=False, mid=(2,), save_gathered=True, peers=2))
    return cases


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def _sizes(case: Case, n: int) -> list[int]:
    return UNEVEN[n] if case.uneven else [4] * n


def run_case(case: Case, rank: int, n: int, *, group=None) -> str | None:
    """None if every output and gradient matches the reference, else a description of the mismatch."""
    dtype = getattr(torch, case.dtype)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    sizes = _sizes(case, n)
    S, off = sum(sizes), sum(sizes[:rank])
    feat_in, feat_out = 8, 6  # per-rank shard of the sharded feature dim
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))  # same on every rank

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    if case.op == "ag":
        x_full, w_full = rand(S, *case.mid, feat_in), rand(feat_out * n, feat_in)
        cols = slice(rank * feat_out, (rank + 1) * feat_out)
        b_full = rand(feat_out * n) if case.bias else None
        gy_full = rand(S, *case.mid, feat_out * n)
        x = x_full[off : off + sizes[rank]].clone().requires_grad_()
        w = w_full[cols].clone().requires_grad_()
        b = b_full[cols].clone().requires_grad_() if case.bias else None
        split = sizes if (case.uneven and case.pass_split) else None
        y = all_gather_matmul(x, w, b, group=group, mode=case.mode, chunks=case.chunks, split_sizes=split,
                              save_gathered=case.save_gathered, peers_per_piece=case.peers)
        y.backward(gy_full[..., cols])
        expect_y = lambda ref: ref[..., cols]  # noqa: E731
        expect_x = lambda g: g[off : off + sizes[rank]]  # noqa: E731
        expect_w = lambda g: g[cols]  # noqa: E731
        expect_b = lambda g: g[cols]  # noqa: E731
    else:
        x_full, w_full = rand(S, *case.mid, feat_in * n), rand(feat_out, feat_in * n)
        cols = slice(rank * feat_in, (rank + 1) * feat_in)
        b_full = rand(feat_out) if case.bias else None
        gy_full = rand(S, *case.mid, feat_out)
        x = x_full[..., cols].clone().requires_grad_()
        w = w_full[:, cols].clone().requires_grad_()
        b = b_full.clone().requires_grad_() if case.bias else None
        split = sizes if case.uneven else None
        y = matmul_reduce_scatter(x, w, b, group=group, mode=case.mode, chunks=case.chunks, split_sizes=split,
                                  peers_per_piece=case.peers)
        y.backward(gy_full[off : off + sizes[rank]])
        expect_y = lambda ref: ref[off : off + sizes[rank]]  # noqa: E731
        expect_x = lambda g: g[..., cols]  # noqa: E731
        expect_w = lambda g: g[:, cols]  # noqa: E731
        expect_b = lambda g: g  # noqa: E731

    # float64 reference on the full tensors
    xr = x_full.double().requires_grad_()
    wr = w_full.double().requires_grad_()
    br = b_full.double().requires_grad_() if case.bias else None
    yr = F.linear(xr, wr, br)
    yr.backward(gy_full.double())

    checks = [("y", y, expect_y(yr.detach())), ("grad_x", x.grad, expect_x(xr.grad)),
              ("grad_w", w.grad, expect_w(wr.grad))]
    if case.bias:
        checks.append(("grad_b", b.grad, expect_b(br.grad)))
    problems = []
    for name, got, ref in checks:
        if got is None:
            problems.append(f"{name} missing")
            continue
        if tuple(got.shape) != tuple(ref.shape):
            problems.append(f"{name} shape {tuple(got.shape)} != {tuple(ref.shape)}")
            continue
        if got.dtype != dtype:
            problems.append(f"{name} dtype {got.dtype} != {dtype}")
        err = _rel(got, ref) if ref.numel() else 0.0
        if not err <= tol:
            problems.append(f"{name} rel err {err:.3g} > {tol}")
    return "; ".join(problems) or None


def run_all(rank: int, n: int, cases: list[Case]) -> dict[str, str | None]:
    out = {}
    for c in cases:
        try:
            out[c.id] = run_case(c, rank, n)
        except Exception as err:  # noqa: BLE001 - reported as this case's failure
            out[c.id] = f"raised {type(err).__name__}: {err}"
    return out


# A machine on which only GEMM launches and message latencies cost anything (1 ms each).  From N = 3 on,
# ``auto`` merges every peer into one piece there: one latency and two GEMMs a direction, where one piece per
# peer pays N - 1 latencies (hidden) behind N GEMMs and ``none`` N - 1 latencies before its GEMMs.
LATENCY_BOUND = Hardware(flops=1e15, half_rows=0, gemm_overhead_s=1e-3, link_bytes_per_s=1e15, link_latency_s=1e-3,
                         memory_bytes_per_s=1e15)


def auto_cases() -> list:
    from a2a_workers import A2ACase

    return [Case("ag", "auto", None, uneven=True, bias=True, mid=(2,)), Case("rs", "auto", None, uneven=True,
                                                                             bias=True, mid=()),
            A2ACase("qkv", "auto", None, uneven=True), A2ACase("out", "auto", None, uneven=True, reduce=True)]


def auto_merges(rank: int, n: int) -> dict[str, tuple[str | None, list[tuple[str, str, int]]]]:
    """``mode="auto"`` through the four public ops with :data:`LATENCY_BOUND` as the cost model: per case, the
    mismatch against the float64 reference (None: exact) and the (op, mode, peers_per_piece) of every schedule
    it ran."""
    from a2a_workers import A2ACase, _one
    from flashpar import cost
    from flashpar.overlap import ops

    ran: list[tuple[str, str, int]] = []
    real = ops.run_schedule

    def spy(schedule, *args, **kwargs):
        ran.append((schedule.op, schedule.mode, schedule.peers_per_piece))
        return real(schedule, *args, **kwargs)

    out = {}
    ops.run_schedule = spy
    try:
        with cost.use(LATENCY_BOUND):
            for case in auto_cases():
                ran.clear()
                try:
                    problem = _one(rank, n, case) if isinstance(case, A2ACase) else run_case(case, rank, n)
                except Exception as err:  # noqa: BLE001 - reported as this case's failure
                    problem = f"raised {type(err).__name__}: {err}"
                out[case.id] = (problem, list(ran))
    finally:
        ops.run_schedule = real
    return out


# ``auto`` picks the two directions of ag / rs apart (``flashpar.overlap.simulate.SPLIT_OPS``).  The cost model
# is replaced by fixed picks so that every pairing runs whatever the machine: each is exact because every mode
# is, and the schedules run are the ones picked.
SPLITS = ((("flash", 1, 1), ("none", 1, 1)), (("none", 1, 1), ("flash", 2, 1)), (("ring", 1, 1), ("slice", 2, 1)),
          (("flash", 1, 2), ("none", 1, 1)))


def split_cases() -> list[tuple[int, Case]]:
    out = []
    for i, _ in enumerate(SPLITS):
        out.append((i, Case("ag", "auto", None, uneven=True, bias=True, mid=(2,), save_gathered=i % 2 == 0)))
        out.append((i, Case("rs", "auto", None, uneven=i % 2 == 1, bias=i % 2 == 0, mid=())))
    return out


def split_id(i: int, case: Case) -> str:
    return f"split{i}-{case.id}"


def auto_splits(rank: int, n: int) -> dict[str, tuple[str | None, list[tuple[str, str, int, int]]]]:
    """Per split case: the mismatch against the float64 reference (None: exact) and the (op, mode, chunks,
    peers_per_piece) of every schedule it ran."""
    from flashpar.overlap import ops, simulate

    ran: list[tuple[str, str, int, int]] = []
    real_run, real_choose = ops.run_schedule, simulate.choose_modes
    pick: list = []

    def spy(schedule, *args, **kwargs):
        ran.append((schedule.op, schedule.mode, schedule.chunks, schedule.peers_per_piece))
        return real_run(schedule, *args, **kwargs)

    def fixed(*args, split=True, **kwargs):
        assert split, "the tp ops ask for their directions apart"
        return pick[0]

    out = {}
    ops.run_schedule, simulate.choose_modes = spy, fixed
    try:
        for i, case in split_cases():
            ran.clear()
            pick[:] = [SPLITS[i]]
            try:
                problem = run_case(case, rank, n)
            except Exception as err:  # noqa: BLE001 - reported as this case's failure
                problem = f"raised {type(err).__name__}: {err}"
            out[split_id(i, case)] = (problem, list(ran))
    finally:
        ops.run_schedule, simulate.choose_modes = real_run, real_choose
    return out


def gathered_kept(rank: int, n: int) -> dict[str, tuple[int, bool]]:
    """``all_gather_matmul(save_gathered=True)`` in flash mode with grad and under ``no_grad``: per run, how many
    times the gathered ``x`` was assembled for backward (``Buffers.materialize``) and whether the output equals
    the run with grad bit for bit."""
    from flashpar.overlap import buffers

    gen = torch.Generator().manual_seed(3)
    x_full, w = torch.randn(4 * n, 8, generator=gen), torch.randn(6, 8, generator=gen)
    x = x_full[4 * rank : 4 * rank + 4].clone()
    real, calls = buffers.Buffers.materialize, []

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    buffers.Buffers.materialize = counted
    out, ys = {}, {}
    try:
        for name, grad in (("grad", True), ("no_grad", False)):
            calls.clear()
            with torch.set_grad_enabled(grad):
                ys[name] = all_gather_matmul(x.clone().requires_grad_(grad), w, None, mode="flash",
                                             save_gathered=True)
            out[name] = (len(calls), bool(torch.equal(ys[name].detach(), ys["grad"].detach())))
    finally:
        buffers.Buffers.materialize = real
    return out
