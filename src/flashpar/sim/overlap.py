"""``flashpar simulate overlap``: an op, an MLP block or an attention block, per overlap mode, forward and backward.

Every linear of the block is timed by :func:`flashpar.overlap.simulate.predict` on the schedule the runtime
executes for it (``build_schedule``, rank 0 of equal blocks), with one :class:`flashpar.cost.Hardware` preset.
The ops of a block run one after another (each op completes its lane before it returns), so a block's time
is the sum of its ops' times, and so are its compute and communication:

    fwd      = sum over the block's ops of the forward schedule's time
    compute  = the same schedules with every lane item free (GEMM pieces, and the adds of received partials)
    comm     = the lane items alone
    exposed  = fwd - compute              (what communication adds to this mode's own compute)
    vs_none  = (fwd + bwd) / (fwd + bwd of none)

The blocks (``T`` tp, ``U`` Ulysses, ``D`` dp ranks; ``B S`` tokens per model replica, i.e. per tp / Ulysses
group; ``h`` hidden, ``F`` FFN, ``H`` / ``H_kv`` heads of ``d`` features)::

    mlp, T > 1        gate_up = all_gather_matmul  [B S, h] x [n_gu / T, h]   (column: ag_matmul)
                      down    = matmul_reduce_scatter [B S, F / T] x [h, F / T]  (row: matmul_rs)
                      n_gu = 2 F (gated, Llama's fused gate/up) or F (plain)
    attention, T > 1  qkv     = ag_matmul  [B S, h] -> (H + 2 H_kv) d / T;  o_proj = matmul_rs  H d / T -> h
    attention, U > 1  qkv     = matmul_all_to_all  [B S / U, h] -> per head group (H / U + 2 max(H_kv / U, 1)) d
                      o_proj  = all_to_all_matmul  per head group H d / U -> h
    D > 1 (T = 1)     each linear of the MLP (and of attention without Ulysses) is the ZeRO-3 ``sharded`` op:
                      its weight gathered over dp, gradient rows reduce-scattered; tokens per rank B S / U
    otherwise         a local GEMM (no communication)

Only the projections are timed: the attention kernel between qkv and o_proj has no communication of
the block's group and adds the same time to every mode.  ZeRO-3 composed with tp (``--dp`` with ``--tp``
> 1) runs nested schedules (``flashpar.overlap.sharded``) that this command does not time: refused.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from flashpar.dims import head_layout
from flashpar.sim.report import table, write_json

A2A_OPS = ("matmul_a2a", "a2a_matmul")
OP_NAMES = ("ag_matmul", "matmul_rs", "sharded", "matmul_a2a", "a2a_matmul")
DTYPES = {"bf16": 2, "fp32": 4}

PAPER = {"ref": "CommFuse / FlashOverlap (Karim et al., arXiv 2604.24013)", "tp": 4, "batch": 32, "seq": 4096,
         "hidden": 4096, "exposed_baseline_ms": 43.8, "exposed_overlapped_ms": 0.1}
"""The paper's headline: a TP=4 MLP at (batch, sequence, hidden) = (32, 4096, 4096), communication overhead
from 43.8 ms to 0.1 ms (its abstract and summaries; the FFN size and the hardware are not in them)."""

COLUMNS = [("mode", ""), ("chunks", "d"), ("fwd_ms", ".3f"), ("bwd_ms", ".3f"), ("exposed_fwd_ms", ".3f"),
           ("exposed_bwd_ms", ".3f"), ("comm_fwd_ms", ".3f"), ("comm_bwd_ms", ".3f"), ("vs_none", ".3f"),
           ("picked", "")]


@dataclass(frozen=True)
class Linear:
    """One linear of a block: ``op`` (a simulator op, or ``local``) on a group of ``n`` ranks with
    :func:`flashpar.overlap.simulate.op_shapes`' ``rows``, ``n_in``, ``n_out``."""

    name: str
    op: str
    n: int
    rows: int
    n_in: int
    n_out: int


def default_ffn(hidden: int, gated: bool) -> int:
    """4 h (plain MLP), or Llama's ``256 ceil(8 h / 3 / 256)`` (gated: 11008 at h = 4096)."""
    return 256 * -(-(8 * hidden // 3) // 256) if gated else 4 * hidden


def block_linears(args) -> list[Linear]:
    """The linears of ``args.block`` in the order they run (see the module docstring); ``ValueError`` on a
    layout the runtime would refuse."""
    t, u, d = args.tp, args.ulysses, args.dp
    tokens, h = args.batch * args.seq, args.hidden
    if args.block == "op":
        return [_single_op(args, tokens)]
    if t > 1 and u > 1:
        raise ValueError("--tp and --ulysses both split the heads: use one of them (as the trainer does)")
    if d > 1 and t > 1:
        raise ValueError("--dp with --tp > 1 runs ZeRO-3 nested in tensor parallelism (flashpar.overlap.sharded), "
                         "which this simulator does not time; use --tp 1 for the sharded op alone")
    group = t * u
    if tokens % group:
        raise ValueError(f"batch x seq = {tokens} tokens do not split evenly over {group} ranks")
    if args.block == "mlp":
        f = args.ffn
        n_gu = 2 * f if args.gated else f
        if t > 1:
            if f % t:
                raise ValueError(f"--ffn {f} is not divisible by --tp {t}")
            return [Linear("gate_up" if args.gated else "up", "ag_matmul", t, tokens, h, n_gu // t),
                    Linear("down", "matmul_rs", t, tokens, f // t, h)]
        rows = tokens // u
        kind = "sharded" if d > 1 else "local"
        return [Linear("gate_up" if args.gated else "up", kind, d, rows, h, n_gu), Linear("down", kind, d, rows, f, h)]
    hd, heads, kv = args.head_dim, args.heads, args.kv_heads
    if t > 1 or u > 1:
        q, k = heads_per_rank(heads, kv, group)
        if t > 1:
            return [Linear("qkv", "ag_matmul", t, tokens, h, (q + 2 * k) * hd),
                    Linear("o_proj", "matmul_rs", t, tokens, q * hd, h)]
        return [Linear("qkv", "matmul_a2a", u, tokens, h, (q + 2 * k) * hd),
                Linear("o_proj", "a2a_matmul", u, tokens, q * hd, h)]
    kind = "sharded" if d > 1 else "local"
    return [Linear("qkv", kind, d, tokens, h, (heads + 2 * kv) * hd), Linear("o_proj", kind, d, tokens, heads * hd, h)]


def heads_per_rank(heads: int, kv_heads: int, n: int) -> tuple[int, int]:
    """(query heads, kv heads) per rank of ``n``: ``H / n`` and ``max(H_kv / n, 1)``, fewer kv heads replicated
    (the rule of ``flashpar.dims.head_layout``; its error names this command's flags)."""
    try:
        return head_layout(heads, kv_heads, n)
    except ValueError as err:
        raise ValueError(f"--heads {heads}, --kv-heads {kv_heads} over the {n} ranks that split the heads: {err}") \
            from None


def _single_op(args, tokens: int) -> Linear:
    """``--block op``: the full weight is ``[--out, --in]`` (defaults: ``--ffn`` x ``--hidden``), split the way
    the runtime splits it for that op."""
    op, n_in, n_out = args.op, args.n_in or args.hidden, args.n_out or args.ffn
    n = {"ag_matmul": args.tp, "matmul_rs": args.tp, "sharded": args.dp, "matmul_a2a": args.ulysses,
         "a2a_matmul": args.ulysses}[op]
    if n < 2:
        flag = {"sharded": "--dp", "matmul_a2a": "--ulysses", "a2a_matmul": "--ulysses"}.get(op, "--tp")
        raise ValueError(f"--op {op} needs {flag} >= 2 (the group it communicates over)")
    split = {"ag_matmul": ("--out", n_out), "matmul_rs": ("--in", n_in), "sharded": ("--out", n_out),
             "matmul_a2a": ("--out", n_out), "a2a_matmul": ("--in", n_in)}[op]
    if split[1] % n:
        raise ValueError(f"{split[0]} {split[1]} is not divisible by the group of {n} ranks of --op {op}")
    if op != "sharded" and tokens % n:
        raise ValueError(f"batch x seq = {tokens} tokens do not split evenly over {n} ranks")
    per = {"ag_matmul": (n_in, n_out // n), "matmul_rs": (n_in // n, n_out), "sharded": (n_in, n_out),
           "matmul_a2a": (n_in, n_out // n), "a2a_matmul": (n_in // n, n_out)}[op]
    return Linear(op, op, n, tokens, *per)


@dataclass(frozen=True)
class OpTime:
    fwd: float
    bwd: float
    compute_fwd: float
    compute_bwd: float
    comm_fwd: float
    comm_bwd: float


def time_linear(lin: Linear, mode: str, chunks: int, elem: int, hw, peers_per_piece: int = 1) -> OpTime:
    """Forward and backward of one linear in ``mode`` (a local GEMM: forward one GEMM, backward two)."""
    from flashpar.overlap.simulate import predict

    if lin.op == "local" or lin.n == 1:
        f = hw.gemm_time(lin.rows, lin.n_in, lin.n_out)
        b = hw.gemm_time(lin.rows, lin.n_out, lin.n_in) + hw.gemm_time(lin.n_in, lin.rows, lin.n_out)
        return OpTime(f, b, f, b, 0.0, 0.0)
    t = predict(lin.op, mode, chunks, lin.n, lin.rows, lin.n_in, lin.n_out, elem, hw, peers_per_piece=peers_per_piece)
    fwd, bwd = t[lin.op], t[f"{lin.op}_bwd"]
    return OpTime(fwd.total, bwd.total, fwd.compute, bwd.compute, fwd.comm, bwd.comm)


def variants(linears: list[Linear], chunk_list: list[int]) -> list[tuple[str, int]]:
    """(mode, chunks) pairs that every communicating op of the block has: none; flash and ring per chunk
    count; slice per chunk count above 1 (one slice is none); no ring where an all-to-all is in the block."""
    a2a = any(lin.op in A2A_OPS for lin in linears)
    out = [("none", 1)]
    for mode in ("flash", "ring", "slice"):
        if mode == "ring" and a2a:
            continue
        out += [(mode, k) for k in chunk_list if not (mode == "slice" and k == 1)]
    return out


def simulate_block(linears: list[Linear], chunk_list: list[int], elem: int, hw, device_type: str = "cuda",
                   ) -> list[dict]:
    """One row per (mode, chunks), and one for ``auto`` (each op's :func:`choose_modes` picks on ``hw``, merged
    pieces included, forward and backward apart where the runtime runs them apart)."""
    from flashpar.overlap.simulate import choose_modes, picks_label

    comms = any(lin.op != "local" and lin.n > 1 for lin in linears)
    rows = []
    for mode, k in (variants(linears, chunk_list) if comms else [("none", 1)]):
        rows.append(_row(mode, k, [(lin, (mode, k, 1), (mode, k, 1)) for lin in linears], elem, hw))
    if comms:
        none = ("none", 1, 1)
        picks = [(lin, *choose_modes(lin.op, lin.n, lin.rows, lin.n_in, lin.n_out, elem, device_type, hw))
                 if lin.op != "local" else (lin, none, none) for lin in linears]
        row = _row("auto", None, picks, elem, hw)
        row["picked"] = " ".join(f"{lin.name}:{picks_label(f, b)}" for lin, f, b in picks)
        rows.append(row)
    none = rows[0]
    for r in rows:
        r["vs_none"] = (r["fwd_ms"] + r["bwd_ms"]) / (none["fwd_ms"] + none["bwd_ms"])
        r["over_none_compute_fwd_ms"] = r["fwd_ms"] - none["compute_fwd_ms"]
        r["over_none_compute_bwd_ms"] = r["bwd_ms"] - none["compute_bwd_ms"]
    return rows


def _directions(fwd: OpTime, bwd: OpTime) -> OpTime:
    """The forward of one schedule's times and the backward of another's."""
    return OpTime(fwd.fwd, bwd.bwd, fwd.compute_fwd, bwd.compute_bwd, fwd.comm_fwd, bwd.comm_bwd)


def _row(mode: str, chunks: int | None, plan: list[tuple[Linear, tuple, tuple]], elem: int, hw) -> dict:
    """A row of the block: ``plan`` is each linear with its (mode, chunks, peers_per_piece) forward and
    backward."""
    times = [(lin, _directions(time_linear(lin, f[0], f[1], elem, hw, f[2]), time_linear(lin, b[0], b[1], elem, hw,
                                                                                      b[2])))
             for lin, f, b in plan]
    row = {"mode": mode, "chunks": chunks}
    for key in ("fwd", "bwd"):
        total = sum(getattr(t, key) for _, t in times)
        compute = sum(getattr(t, f"compute_{key}") for _, t in times)
        row[f"{key}_ms"] = total * 1e3
        row[f"exposed_{key}_ms"] = (total - compute) * 1e3
        row[f"compute_{key}_ms"] = compute * 1e3
        row[f"comm_{key}_ms"] = sum(getattr(t, f"comm_{key}") for _, t in times) * 1e3
    for lin, t in times:  # per op, for the JSON
        row[f"{lin.name}_fwd_ms"], row[f"{lin.name}_bwd_ms"] = t.fwd * 1e3, t.bwd * 1e3
    row["picked"] = ""
    return row


# ----------------------------------------------------------------------------------------------
# the paper's headline setting


def paper_note(args, rows: list[dict], hw, elem: int, linears: list[Linear]) -> str:
    """Our figures beside the paper's (exposed communication of the baseline and of the overlapped MLP), and the
    link speed at which our ``none`` would expose the paper's baseline figure."""
    same = (args.block, args.tp, args.batch, args.seq, args.hidden) == ("mlp", PAPER["tp"], PAPER["batch"],
                                                                       PAPER["seq"], PAPER["hidden"])
    none = rows[0]
    flash = min((r for r in rows if r["mode"] == "flash"), key=lambda r: r["exposed_fwd_ms"] + r["exposed_bwd_ms"])
    target = PAPER["exposed_baseline_ms"]
    lines = [f"paper: {PAPER['ref']}: TP={PAPER['tp']} MLP, (batch, seq, hidden) = ({PAPER['batch']}, "
             f"{PAPER['seq']}, {PAPER['hidden']}): exposed communication {target} ms -> "
             f"{PAPER['exposed_overlapped_ms']} ms"]
    if not same:
        lines.append("  (this run's setup differs from the paper's: the comparison below is not like for like)")
    lines += [
        f"  simulated ({args.hardware}, {args.dtype}, ffn {args.ffn}{' gated' if args.gated else ''}): exposed "
        f"none {none['exposed_fwd_ms']:.2f} ms fwd + {none['exposed_bwd_ms']:.2f} ms bwd = "
        f"{none['exposed_fwd_ms'] + none['exposed_bwd_ms']:.2f} ms; flash(k={flash['chunks']}) "
        f"{flash['exposed_fwd_ms']:.3f} + {flash['exposed_bwd_ms']:.3f} ms",
        f"  none would expose {target} ms at a link of {implied_link(linears, elem, hw, target, 'fwd') / 1e9:.0f} "
        f"GB/s each way (forward alone) or {implied_link(linears, elem, hw, target, 'both') / 1e9:.0f} GB/s "
        f"(forward + backward); this preset's link: {hw.link_bytes_per_s / 1e9:.0f} GB/s",
    ]
    return "\n".join(lines)


def implied_link(linears: list[Linear], elem: int, hw, exposed_ms: float, which: str) -> float:
    """The link bandwidth (bytes/s each way, the rest of ``hw`` kept) at which ``none`` exposes ``exposed_ms``
    (``which``: ``fwd``, or ``both`` for forward + backward), by bisection on a log scale (exposure falls as
    the link gets faster)."""
    from dataclasses import replace

    def exposed(bw: float) -> float:
        none = ("none", 1, 1)
        row = _row("none", 1, [(lin, none, none) for lin in linears], elem, replace(hw, link_bytes_per_s=bw))
        return row["exposed_fwd_ms"] + (row["exposed_bwd_ms"] if which == "both" else 0.0)

    lo, hi = 1e8, 1e14
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if exposed(mid) > exposed_ms else (lo, mid)
    return (lo * hi) ** 0.5


# ----------------------------------------------------------------------------------------------
# command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block", choices=["op", "mlp", "attention"], default="mlp", help="what to time (default mlp)")
    p.add_argument("--op", choices=OP_NAMES, default=None,
                   help="with --block op: the op (weight [--out, --in], split as the runtime splits it)")
    p.add_argument("--in", dest="n_in", type=int, default=None, help="--block op: input features (default --hidden)")
    p.add_argument("--out", dest="n_out", type=int, default=None, help="--block op: output features (default --ffn)")
    p.add_argument("--tp", type=int, default=1, help="tensor (+ sequence) parallel ranks (default 1)")
    p.add_argument("--dp", type=int, default=1, help="ZeRO-3 data-parallel ranks (default 1)")
    p.add_argument("--ulysses", type=int, default=1, help="Ulysses ranks (default 1)")
    p.add_argument("--batch", type=int, default=1, help="sequences per model replica (default 1)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    p.add_argument("--ffn", type=int, default=None,
                   help="FFN size (default: Llama's 256 ceil(8 h / 3 / 256) when gated, 4 h with --plain-mlp)")
    p.add_argument("--plain-mlp", dest="gated", action="store_false",
                   help="an up / down MLP (one up projection) instead of Llama's fused gate / up")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=None, help="key / value heads (default --heads)")
    p.add_argument("--head-dim", type=int, default=None, help="features per head (default hidden / heads)")
    p.add_argument("--hardware", default="h100-nvlink", help="a flashpar.cost preset (default h100-nvlink)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                   help="element size of the activations and weights (the preset's FLOP rate is kept)")
    p.add_argument("--chunks", default="1,4",
                   help="chunk counts of flash / ring / slice, comma-separated (default 1,4)")
    p.add_argument("--paper", action="store_true",
                   help="print the FlashOverlap (CommFuse) paper's headline figures beside ours")
    p.add_argument("--json", default=None, help="write {\"setup\": ..., \"rows\": [...]} to this file")


def _validate(args) -> tuple[list[int], object]:
    from flashpar import cost

    for name in ("tp", "dp", "ulysses", "batch", "seq", "hidden", "heads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("ffn", "kv_heads", "head_dim", "n_in", "n_out"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if (args.block == "op") != (args.op is not None):
        raise ValueError("--op goes with --block op (and --block op needs --op)")
    try:
        chunk_list = sorted({int(c) for c in args.chunks.split(",") if c.strip()})
    except ValueError:
        raise ValueError(f"--chunks must be comma-separated integers, got {args.chunks!r}") from None
    if not chunk_list or chunk_list[0] < 1:
        raise ValueError(f"--chunks must be integers >= 1, got {args.chunks!r}")
    args.ffn = args.ffn or default_ffn(args.hidden, args.gated)
    args.kv_heads = args.kv_heads or args.heads
    if args.head_dim is None:
        if args.hidden % args.heads:
            raise ValueError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}: give --head-dim")
        args.head_dim = args.hidden // args.heads
    return chunk_list, cost.preset(args.hardware)


def run(args: argparse.Namespace) -> int:
    try:
        chunk_list, hw = _validate(args)
        linears = block_linears(args)
    except ValueError as err:
        print(f"flashpar simulate overlap: {err}", file=sys.stderr)
        return 2
    elem = DTYPES[args.dtype]
    rows = simulate_block(linears, chunk_list, elem, hw)
    setup = {"block": args.block, "op": args.op, "tp": args.tp, "dp": args.dp, "ulysses": args.ulysses,
             "batch": args.batch, "seq": args.seq, "hidden": args.hidden, "ffn": args.ffn, "gated": args.gated,
             "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "hardware": args.hardware,
             "hardware_figures": hw.__dict__, "dtype": args.dtype, "elem_bytes": elem, "chunks": chunk_list,
             "simulated": True, "linears": [lin.__dict__ for lin in linears]}
    ops = ", ".join(f"{lin.name}={lin.op}[{lin.rows} x {lin.n_in} -> {lin.n_out}, {lin.n} ranks]" for lin in linears)
    title = (f"simulated, {args.hardware} preset, {args.dtype}: {args.block} {ops}; times in ms, "
             "exposed = time - the mode's own compute")
    print(table(rows, COLUMNS, title=title))
    if args.paper:
        print(paper_note(args, rows, hw, elem, linears))
    write_json(args.json, setup, rows)
    return 0
