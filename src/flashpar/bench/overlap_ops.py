"""The ops ``flashpar bench overlap`` compares, each described once: inputs, call, sizes, simulator names.

Every op has one communicated block per peer of ``[rows, width]`` whose size the shape fixes,
and one *free* dim that sets the GEMM work and nothing else; the benchmark sizes the free dim
to reach a target communication / compute ratio.

    op    function                 inputs (this rank)                                free dim
    ag    all_gather_matmul        x [s, width],  w [free, width]                    out features
    rs    matmul_reduce_scatter    x [N s, free], w [width, free]                    in features
    fsdp  sharded_linear           x [free, width], w shard [width / N, width]       tokens (batch rows)
    qkv   matmul_all_to_all        x [s, free],   w [N width, free]                  hidden (in features)
    out   all_to_all_matmul        o [N s, width], w [free, N width]                 hidden (out features)
"""

from __future__ import annotations

from dataclasses import dataclass

OP_KEYS = ("ag", "rs", "fsdp", "qkv", "out")
A2A = ("qkv", "out")
TITLES = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter", "fsdp": "sharded_linear (ZeRO-3)",
          "qkv": "matmul_all_to_all (Ulysses QKV)", "out": "all_to_all_matmul (Ulysses out-proj)"}
SIM_OPS = {"ag": "ag_matmul", "rs": "matmul_rs", "fsdp": "sharded", "qkv": "matmul_a2a", "out": "a2a_matmul"}


@dataclass(frozen=True)
class BenchShape:
    name: str
    op: str  # one of OP_KEYS
    seq_local: int  # rows of the communicated block (tokens per rank; fsdp: the batch rows, its free dim)
    width: int  # features of the communicated block
    free: int  # the free dim (see the module table)
    target_ratio: float | None = None

    def describe(self, n: int) -> str:
        s, w, f = self.seq_local, self.width, self.free
        dims = {"ag": f"x[{s * n}/{n}, {w}] @ w[{f}, {w}]^T",
                "rs": f"x[{s * n}, {f}] @ w[{w}, {f}]^T -> scatter",
                "fsdp": f"x[{s}, {w}] @ gather(w[{w}/{n}, {w}])^T",
                "qkv": f"x[{s * n}/{n}, {f}] @ w[{n}x{w}, {f}]^T -> all-to-all",
                "out": f"all-to-all(o[{s * n}, {w}]) @ w[{f}, {n}x{w}]^T"}[self.op]
        ratio = f", comm/compute target {self.target_ratio}" if self.target_ratio else ""
        return f"{self.name}: {TITLES[self.op]} {dims}{ratio}"

    def sim_args(self, n: int) -> tuple[str, int, int, int]:
        """(simulator op, rows, n_in, n_out) for :func:`flashpar.overlap.simulate.predict`."""
        s, w, f = self.seq_local, self.width, self.free
        return {"ag": ("ag_matmul", s * n, w, f), "rs": ("matmul_rs", s * n, f, w),
                "fsdp": ("sharded", s, w, w), "qkv": ("matmul_a2a", s * n, f, w),
                "out": ("a2a_matmul", s * n, w, f)}[self.op]


def with_free(op: str, name: str, seq_local: int, width: int, free: int, ratio: float | None = None) -> BenchShape:
    """A shape whose free dim is ``free`` (for fsdp the free dim is the batch rows)."""
    if op == "fsdp":
        return BenchShape(name, op, free, width, free, ratio)
    return BenchShape(name, op, seq_local, width, free, ratio)


def modes_for(op: str, variants: list[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
    return [v for v in variants if not (op in A2A and v[0] == "ring")]


def make_call(shape: BenchShape, n: int, dtype):
    """``(fn, x, weight, grad_y)`` for one rank: ``fn(x, weight, **kw)`` is the op."""
    import torch

    from flashpar.overlap import (
        all_gather_matmul,
        all_to_all_matmul,
        matmul_all_to_all,
        matmul_reduce_scatter,
        sharded_linear,
    )

    s, w, f = shape.seq_local, shape.width, shape.free
    x_shape, w_shape, y_shape, fn = {
        "ag": ((s, w), (f, w), (s * n, f), all_gather_matmul),
        "rs": ((s * n, f), (w, f), (s, w), matmul_reduce_scatter),
        "fsdp": ((s, w), (max(w // n, 1), w), (s, max(w // n, 1) * n), sharded_linear),
        "qkv": ((s, f), (n * w, f), (s * n, w), matmul_all_to_all),
        "out": ((s * n, w), (f, n * w), (s, f), all_to_all_matmul),
    }[shape.op]
    x = torch.randn(*x_shape, dtype=dtype, requires_grad=True)
    weight = torch.randn(*w_shape, dtype=dtype, requires_grad=True)
    return fn, x, weight, torch.randn(*y_shape, dtype=dtype)
