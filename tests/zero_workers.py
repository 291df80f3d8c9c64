"""Per-rank bodies of the ZeRO-3 x tensor-parallel tests (run by dist_harness.run_ranks).

A (dp, tp) mesh on ``dp * tp`` ranks: global rank ``d * tp + t`` is dp rank ``d``, tp rank ``t``.  Every
dp replica ``j`` has its own batch (``S_j`` tokens, split unevenly over tp); every rank builds the same
full float64 layer ``W [out, in]`` from one seed.  References are the float64 layer on the full
tensors: the output and ``grad_x`` of this rank's batch, ``grad_W`` summed over every replica's batch
(the trainer's convention), each cut to this rank's part.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from flashpar.models.zero import ZeroColumnParallelLinear, ZeroRowParallelLinear
from flashpar.overlap.modules import ColumnParallelLinear, RowParallelLinear
from flashpar.overlap.sharded import ZeroCounter, zero_all_gather_matmul, zero_matmul_reduce_scatter
from flashpar.rows import row_sizes, shard_rows

MESHES = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (4, 1), (1, 4)]}
MODES = [("flash", 1), ("flash", 2), ("ring", 1), ("slice", 2), ("none", None)]
ROWS_T = 5  # rows of the tp shard W_t: uneven over dp = 2, 3, 4
# fp32 unit roundoff 6e-8; the longest sum here (grad_W over replicas x tokens) has < 100 terms, so
# reordering stays ~1e-6 relative; 1e-5 leaves margin while a wrong or missing block is O(1).
FP32_TOL = 1e-5
LATE_S = 0.6  # the late dp replica of the in-flight test sleeps this long before each direction


def mesh_groups(rank: int, dp: int, tp: int):
    """``(dp_group, tp_group, d, t)`` of ``rank``; every rank creates every group, in the same order."""
    dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    d, t = divmod(rank, tp)
    return dp_groups[t], tp_groups[d], d, t


def _seq_len(j: int, tp: int) -> int:
    return 3 * tp + 1 + j  # replica j's tokens: uneven tp blocks when tp > 1, different per replica


class Layer:
    """The full float64 layer and every replica's batch, and this rank's parts of them."""

    def __init__(self, kind: str, dp: int, tp: int, d: int, t: int, *, bias: bool, mid: tuple[int, ...]) -> None:
        self.kind, self.dp, self.tp, self.d, self.t, self.mid = kind, dp, tp, d, t, mid
        self.n_in, self.n_out = (6, ROWS_T * tp) if kind == "column" else (2 * tp, ROWS_T)
        torch.manual_seed(0)
        self.w = torch.randn(self.n_out, self.n_in, dtype=torch.float64)
        self.b = torch.randn(self.n_out, dtype=torch.float64) if bias else None
        self.data = []
        for j in range(dp):
            gen = torch.Generator().manual_seed(100 + j)
            x = torch.randn(_seq_len(j, tp), *mid, self.n_in, dtype=torch.float64, generator=gen)
            self.data.append((x, torch.randn(*x.shape[:-1], self.n_out, dtype=torch.float64, generator=gen)))
        self.split = row_sizes(_seq_len(d, tp), tp)
        self.seq = slice(*shard_rows(_seq_len(d, tp), tp, t))  # this tp rank's sequence block
        if kind == "column":  # tp splits the output features, dp the rows of W_t
            self.tp_rows = slice(*shard_rows(self.n_out, tp, t))
            self.tp_cols = slice(None)
        else:  # tp splits the input features, dp the output rows
            self.tp_rows = slice(None)
            self.tp_cols = slice(*shard_rows(self.n_in, tp, t))
        w_t = self.w[self.tp_rows, self.tp_cols]
        self.rows_t, self.row_width = w_t.shape[0], int(torch.tensor(mid, dtype=torch.int64).prod())
        self.dp_rows = slice(*shard_rows(w_t.shape[0], dp, d))
        self.w_rows = w_t[self.dp_rows]
        self.b_rows = self.b[self.tp_rows][self.dp_rows] if bias else None

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's input and output gradient (float64)."""
        x, gy = self.data[self.d]
        if self.kind == "column":
            return x[self.seq], gy[..., self.tp_rows]
        return x[..., self.tp_cols], gy[self.seq]

    def reference(self) -> dict[str, torch.Tensor]:
        x, gy = self.data[self.d]
        y = torch.nn.functional.linear(x, self.w, self.b)
        gx = gy @ self.w
        gw = sum(g.reshape(-1, self.n_out).t() @ xx.reshape(-1, self.n_in) for xx, g in self.data)
        gb = sum(g.reshape(-1, self.n_out).sum(0) for _, g in self.data)
        if self.kind == "column":
            out = {"y": y[..., self.tp_rows], "grad_x": gx[self.seq]}
        else:
            out = {"y": y[self.seq], "grad_x": gx[..., self.tp_cols]}
        out["grad_w"] = gw[self.tp_rows, self.tp_cols][self.dp_rows]
        if self.b is not None:
            out["grad_b"] = gb[self.tp_rows][self.dp_rows]
        return out

    def run(self, groups, mode: str, chunks: int | None, *, counter=None, check: bool = True, late: float = 0.0):
        """Forward and backward in fp32 through the ZeRO-3 op; returns (results, saved numel, allowed numel)."""
        dp_g, tp_g = groups[:2]
        x64, gy64 = self.inputs()
        x = x64.float().requires_grad_()
        w = self.w_rows.float().requires_grad_()
        b = self.b_rows.float().requires_grad_() if self.b_rows is not None else None
        op = zero_all_gather_matmul if self.kind == "column" else zero_matmul_reduce_scatter
        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel())
            return t

        time.sleep(late)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = op(x, w, b, group=tp_g, dp_group=dp_g, total_rows=self.rows_t, mode=mode, chunks=chunks,
                   split_sizes=self.split, check=check, counter=counter)
        time.sleep(late)
        y.backward(gy64.float())
        got = {"y": y, "grad_x": x.grad, "grad_w": w.grad}
        if b is not None:
            got["grad_b"] = b.grad
        allowed = x.numel() + w.numel() + (b.numel() if b is not None else 0)
        return got, sum(saved), allowed


def _rel(got: torch.Tensor | None, ref: torch.Tensor) -> float:
    if got is None:
        return float("inf")
    return float((got.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _errors(got: dict, ref: dict) -> str | None:
    bad = [f"{k}: shape {tuple(got[k].shape) if got.get(k) is not None else None} vs {tuple(v.shape)}, "
           f"rel err {_rel(got.get(k), v):.3g}" for k, v in ref.items()
           if got.get(k) is None or got[k].shape != v.shape or not _rel(got[k], v) <= FP32_TOL]
    return "; ".join(bad) or None


def expected_bytes(layer: Layer) -> dict[tuple[str, str], list[int]]:
    """The flash decomposition's bytes per (direction, group): ``[sent, received]`` (fp32, no bias)."""
    dp, tp, d, t = layer.dp, layer.tp, layer.d, layer.t
    width = layer.w_rows.shape[1]  # in (column) or in_t (row)
    o = row_sizes(layer.rows_t, dp)
    rows, own = sum(o), o[d]
    s = [n * layer.row_width for n in layer.split]
    seq, s_own = sum(s), s[t]
    gather_w = [(dp - 1) * own * width, (rows - own) * width]
    scatter_gw = [(rows - own) * width, (dp - 1) * own * width]
    out = {("fwd", "dp"): gather_w, ("bwd", "dp"): [a + b for a, b in zip(gather_w, scatter_gw, strict=True)]}
    if tp > 1:
        feat = layer.n_in if layer.kind == "column" else rows  # the tp-moved tensor's features
        gather = [(tp - 1) * s_own * feat, (seq - s_own) * feat]
        scatter = [(seq - s_own) * feat, (tp - 1) * s_own * feat]
        if layer.kind == "column":  # fwd: x gathered once; bwd: x gathered again + grad_x reduce-scattered
            out[("fwd", "tp")] = gather
            out[("bwd", "tp")] = [a + b for a, b in zip(gather, scatter, strict=True)]
        else:  # fwd: y reduce-scattered in dp rounds; bwd: grad_y gathered once
            out[("fwd", "tp")], out[("bwd", "tp")] = scatter, gather
    return {k: [4 * v for v in pair] for k, pair in out.items()}


def reference_cases(rank: int, world: int) -> dict[str, str | None]:
    """Every mesh of this world size x kind x mode: errors against the float64 reference (None: all within
    tolerance), the saved-for-backward check, and (flash, dp > 1) the bytes at the transport."""
    out: dict[str, str | None] = {}
    for dp, tp in MESHES[world]:
        groups = mesh_groups(rank, dp, tp)
        d, t = groups[2:]
        for kind in ("column", "row"):
            variants = [(mode, k, False, ()) for mode, k in MODES]
            variants += [("flash", 1, True, (2,)), ("none", None, True, ())]
            for mode, k, bias, mid in variants:
                name = f"{dp}x{tp}-{kind}-{mode}-k{k}" + ("-bias-mid" if mid else "-bias" if bias else "")
                layer = Layer(kind, dp, tp, d, t, bias=bias, mid=mid)
                counter = ZeroCounter()
                got, saved, allowed = layer.run(groups, mode, k, counter=counter)
                problems = [_errors(got, layer.reference())]
                if saved > allowed:  # a gathered weight or activation kept for backward
                    problems.append(f"saved {saved} elements for backward, more than input + own rows {allowed}")
                if mode == "flash" and k == 1 and not bias and dp > 1:
                    want = expected_bytes(layer)
                    if counter.bytes != want:
                        problems.append(f"bytes {counter.bytes} != decomposition {want}")
                out[name] = "; ".join(p for p in problems if p) or None
    return out


def in_flight(rank: int, world: int) -> dict[str, tuple[float, float]]:
    """(2, 2) mesh, flash: dp replica 1 starts each direction ``LATE_S`` late.  On replica 0 returns, per kind
    and direction, (seconds from the op's start to its first inner tp GEMM, seconds the op took).  The tp peers
    of replica 0 can only run their inner tp schedule that early if it runs while the dp rows are still
    on their way (a sequential composition waits for the late replica's rows first)."""
    groups = mesh_groups(rank, 2, 2)
    d, t = groups[2:]
    out = {}
    for kind in ("column", "row"):
        layer = Layer(kind, 2, 2, d, t, bias=False, mid=())
        layer.run(groups, "flash", 1, check=False)  # warm-up: twin groups, lane workers
        counter = ZeroCounter()
        layer.run(groups, "flash", 1, counter=counter, check=False, late=LATE_S if d == 1 else 0.0)
        ev = counter.events
        for direction in ("fwd", "bwd"):
            start = next(tm for what, tm in ev if what == f"{direction}:start")
            end = next(tm for what, tm in ev if what == f"{direction}:end")
            first = next(tm for what, tm in ev if what == f"tp:{direction}:gemm")
            out[f"{kind}-{direction}"] = (first - start, end - start)
    return out if d == 0 else {}


def modules_no_exchange(rank: int, world: int) -> dict[str, object]:
    """The four linear classes on the (2, 2) mesh (world 4) or (1, 1): forward + backward with ``check=False``
    and ``split_sizes`` exchange no metadata; with ``check=True`` they do.  The ZeRO layers match the plain
    layers built from the same seed (their rows of the same weights and biases)."""
    import flashpar.overlap.call as call_module

    dp, tp = (2, 2) if world == 4 else (1, 1)
    dp_g, tp_g, d, t = mesh_groups(rank, dp, tp)
    calls = [0]
    real = call_module.exchange_metadata

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    call_module.exchange_metadata = counting
    out: dict[str, object] = {}
    try:
        split = row_sizes(7, tp)
        layers = (("column", ColumnParallelLinear, ZeroColumnParallelLinear, 6, 10),
                  ("row", RowParallelLinear, ZeroRowParallelLinear, 4, 5))
        for name, plain_cls, zero_cls, n_in, n_out in layers:
            torch.manual_seed(0)
            plain = plain_cls(n_in, n_out, bias=True, group=tp_g)
            torch.manual_seed(0)
            zero = zero_cls(n_in, n_out, bias=True, group=tp_g, dp_group=dp_g)
            x_rows = split[t] if name == "column" else 7
            torch.manual_seed(1 + d)
            x = torch.randn(x_rows, n_in if name == "column" else n_in // tp)
            for check in (False, True):
                calls[0] = 0
                for layer in (plain, zero):
                    y = layer(x, split_sizes=split, check=check)
                    y.square().sum().backward()
                out[f"{name}-check{check}-exchanges"] = calls[0]
            lo, hi = shard_rows(plain.weight.shape[0], dp, d)
            out[f"{name}-rows"] = (torch.equal(zero.weight.detach(), plain.weight.detach()[lo:hi])
                                   and torch.equal(zero.bias.detach(), plain.bias.detach()[lo:hi])
                                   and zero.total_rows == plain.weight.shape[0])
            y_plain, y_zero = plain(x, split_sizes=split), zero(x, split_sizes=split)
            out[f"{name}-forward"] = _rel(y_zero, y_plain.detach().double())
    finally:
        call_module.exchange_metadata = real
    return out


def bad_input(rank: int, world: int) -> dict[str, str]:
    """(2, 2) mesh: rank 0 passes a weight with the wrong input features; every rank raises (no hang), and the
    groups still work afterwards."""
    from overlap_workers import _outcome

    dp_g, tp_g, d, t = mesh_groups(rank, 2, 2)
    x = torch.randn(3, 4)
    w = torch.randn(2, 5 if rank == 0 else 4)
    out = {"column": _outcome(lambda: zero_all_gather_matmul(x, w, group=tp_g, dp_group=dp_g, total_rows=4)),
           "row": _outcome(lambda: zero_matmul_reduce_scatter(torch.randn(4, 4), w, group=tp_g, dp_group=dp_g,
                                                              total_rows=4))}
    y = zero_all_gather_matmul(torch.ones(2, 3), torch.full((1, 3), float(rank)), group=tp_g, dp_group=dp_g,
                               total_rows=2)
    want = torch.tensor([3.0 * t, 3.0 * (2 + t)])  # rows of W_t held by dp ranks 0, 1 of this tp index
    out["healthy_after"] = "ok" if torch.equal(y[0], want) else str(y)
    return out
