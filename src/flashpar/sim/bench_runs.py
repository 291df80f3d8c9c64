"""What the benchmarks run, described once: ``flashpar bench`` builds its runs from these, and ``flashpar
simulate check`` rebuilds them from a report's ``config`` / ``setup`` to predict what it measured.

    bench cp        cp_packs(config)            the packs: ``--lengths`` / ``--scale`` cut into ``--tokens``
                    cp_predict(p, fwd, bwd, C)  the cost model's step and compute imbalance of plan ``p`` on the
                                                ``C`` cores the ranks share
    bench overlap   BenchShape                  an op's communicated block and free dim, its simulator call
    bench train     model_config(config)        the benchmark's Llama
                    packed_docs(config)         the dp sequences' document lengths

Plain Python at import (each function imports what it reads).
"""

from __future__ import annotations

from dataclasses import dataclass

# ----------------------------------------------------------------------------------------------
# bench cp


def cp_packs(config: dict) -> list[list[int]]:
    """The benchmark's packs: ``--lengths`` divided by ``--scale``, cut into ``--tokens`` (sampled with seed 0)."""
    from flashpar.cp.lengths import resolve_lengths

    source = resolve_lengths(config["lengths"])
    return source.packs(config["tokens"], config["packs"], seed=0, scale=config["scale"])


def cp_predict(p, fwd_cost, bwd_cost, cores: float) -> dict:
    """The cost model's step (forward + backward, slowest rank each) and compute imbalance of plan ``p``
    on the benchmark's box: per rank ``max(compute, comm + compute on remote K/V)``, with compute played on
    ``cores`` shared cores (``flashpar.cost.shared_finish``; remote compute stretched alike)."""
    from flashpar.cost import shared_finish
    from flashpar.cp.cp_plan import rank_figures

    step, compute = 0.0, [0.0] * p.cp_size
    for cost in (fwd_cost, bwd_cost):
        fig = rank_figures(p.segments, p.doc_lens, p.doc_starts, cost, p.comm)
        done = shared_finish(fig.compute, cores)
        stretch = [d / c if c > 0 else 1.0 for d, c in zip(done, fig.compute, strict=True)]
        step += max(max(d, m + x * s) for d, m, x, s in zip(done, fig.comm, fig.remote, stretch, strict=True))
        compute = [a + b for a, b in zip(compute, fig.compute, strict=True)]
    return {"step": step, "compute": max(compute), "imbalance": max(compute) / (sum(compute) / len(compute))}


# ----------------------------------------------------------------------------------------------
# bench overlap: every op has one communicated block per peer of ``[rows, width]`` whose size the shape fixes,
# and one *free* dim that sets the GEMM work and nothing else; the benchmark sizes the free dim to reach a
# target communication / compute ratio.
#
#     op    function                 inputs (this rank)                                free dim
#     ag    all_gather_matmul        x [s, width],  w [free, width]                    out features
#     rs    matmul_reduce_scatter    x [N s, free], w [width, free]                    in features
#     fsdp  sharded_linear           x [free, width], w shard [width / N, width]       tokens (batch rows)
#     qkv   matmul_all_to_all        x [s, free],   w [N width, free]                  hidden (in features)
#     out   all_to_all_matmul        o [N s, width], w [free, N width]                 hidden (out features)

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
    free: int  # the free dim (see the table above)
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


# ----------------------------------------------------------------------------------------------
# bench train


def model_config(config: dict, **extra):
    """The benchmark's Llama from ``add_model_arguments``' sizes (``extra``: other ``LlamaConfig`` fields)."""
    from flashpar.models import LlamaConfig

    # untied: torchtitan's Llama, and torch's TP plans cannot shard one tensor as both embedding and head
    return LlamaConfig(hidden=config["hidden"], layers=config["layers"], heads=config["heads"],
                       kv_heads=config["kv_heads"], ffn=config["ffn"], tie_embeddings=False, **extra)


def torch_cp(config: dict) -> int:
    """The torch peer's context-parallel size: cp x ulysses (torch has no Ulysses; the same ranks split the
    sequence)."""
    return config["cp"] * config["ulysses"]


def packed_docs(config: dict) -> list[list[int]]:
    """The ``dp`` sequences' document lengths: ``--lengths`` / ``--scale`` packed in units of ``2 torch_cp``."""
    from flashpar.cp.lengths import resolve_lengths

    unit = 2 * torch_cp(config)
    source = resolve_lengths(config["lengths"])
    packs = source.packs(config["seq_len"] // unit, config["dp"], seed=config["seed"], scale=config["scale"] * unit)
    return [[n * unit for n in p] for p in packs]
