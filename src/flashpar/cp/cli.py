"""``flashpar plan``: plan packed sequences of real document lengths with every CP strategy, side by side.

    flashpar plan --lengths NAME|FILE --cp N [--tokens T] [--packs K] [--strategy NAME|all] [--json OUT]
                  [--plot OUT.png] [--tp T --gpus-per-node G]

``--lengths`` is a shipped name or a file, as in every command (:func:`flashpar.cp.lengths.resolve_lengths`).
Without ``--tokens`` the whole list is one packed sequence; with it, the document stream is cut
into packs of exactly ``T`` tokens (:class:`flashpar.cp.lengths.Packing`) and every figure is the
mean and the worst over the packs (a sampled distribution needs ``--tokens`` and ``--packs``).
Speedups are estimated step times of ``headtail`` and ``per_doc`` over this strategy's, pack by
pack.  Progress goes to stderr, the table to stdout, each column as wide as its widest cell.

The cp group's link: by default the network port between nodes (``DEFAULT_HARDWARE``).  With ``--gpus-per-node G``
the ranks are placed as ``flashpar train`` under torchrun places them (the mesh ``cp x tp``, tp innermost, ``G``
consecutive ranks per node: ``flashpar.dims``), and the group's figures are ``flashpar.cost.group_hardware`` of its
ranks (NVLink on one node, the port across nodes), the function the trainer's planner asks (``group_figures``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys

from flashpar.cp.lengths import LENGTHS_HELP

COLUMNS = (("compute_imbalance", "compute imb"), ("attn_imbalance", "attn imb"), ("token_imbalance", "token imb"),
           ("total_kv_bytes", "KV total MB"), ("max_kv_bytes", "KV max MB"), ("kv_worst_frac", "KV worst frac"),
           ("est_step_time", "step ms"), ("vs_headtail", "x headtail"), ("vs_per_doc", "x per_doc"),
           ("planning_s", "plan ms"))
SCALE = {"total_kv_bytes": 1e-6, "max_kv_bytes": 1e-6, "est_step_time": 1e3, "planning_s": 1e3}
# Input that would exhaust the machine is refused before any planning: one pack longer than
# this many tokens (the 394M-token wlbllm list as one pack plans for minutes), more packs than this
# (every pack's statistics are kept, per strategy), or a pack shorter than two tokens per rank.
MAX_ONE_PACK = 1 << 24
MAX_PACKS = 100_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", required=True, help=LENGTHS_HELP)
    p.add_argument("--cp", type=int, required=True, help="context-parallel size N")
    p.add_argument("--tokens", type=int, default=None, help="cut the stream into packs of exactly T tokens")
    p.add_argument("--packs", type=int, default=None, help="use only the first K packs")
    p.add_argument("--strategy", default="all", help="a strategy name, or 'all' (default)")
    p.add_argument("--attention-only", action="store_true", help="CostModel(linear=False): attention work alone")
    p.add_argument("--json", default=None, help="write the per-strategy summaries to this file")
    p.add_argument("--plot", default=None, help="PNG of per-rank work and the rank-to-rank K/V matrix (flashcp)")
    p.add_argument("--tp", type=int, default=1, help="ranks between cp neighbours (the trainer's ulysses x tp), "
                                                     "with --gpus-per-node (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="place the ranks on nodes of G GPUs as the trainer does: the cp group plans on NVLink when "
                        "its ranks share a node, on the network port when they span nodes (default: the port)")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from flashpar.cp import STRATEGIES, CostModel, plan

    if args.cp < 1:
        print(f"flashpar plan: --cp must be >= 1, got {args.cp}", file=sys.stderr)
        return 2
    try:
        hardware, args.link = cp_link(args.cp, args.tp, args.gpus_per_node)
    except ValueError as err:
        print(f"flashpar plan: {err}", file=sys.stderr)
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before any planning
        print("flashpar plan: --plot needs matplotlib (pip install 'flashpar[plot]')", file=sys.stderr)
        return 2
    try:
        packs = _packs(args)
    except (OSError, ValueError) as err:
        print(f"flashpar plan: {err}", file=sys.stderr)
        return 2
    strategies = list(STRATEGIES) if args.strategy == "all" else [args.strategy]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        print(f"flashpar plan: unknown strategy {unknown[0]!r}; expected one of {STRATEGIES} or 'all'", file=sys.stderr)
        return 2
    cost = CostModel(linear=not args.attention_only, hardware=hardware)
    per_pack = {s: [] for s in strategies}
    plans = {}
    with tqdm(total=len(packs) * len(strategies), desc="flashpar plan", unit="plan", file=sys.stderr,
              mininterval=1.0) as bar:
        for doc_lens in packs:
            for s in strategies:
                p = plan(doc_lens, args.cp, strategy=s, cost=cost)
                per_pack[s].append(p.stats())
                plans[s] = p
                bar.update()
    summary = _summarize(per_pack)
    print(_table(summary, args, packs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cp": args.cp, "tokens": args.tokens, "packs": len(packs), "summary": summary}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        return _plot(plans.get("flashcp") or next(iter(plans.values())), args.plot)
    return 0


NODE_HARDWARE = "h100-nvlink"  # a cp group inside one node (--gpus-per-node)


def cp_link(cp: int, tp: int, gpus_per_node: int | None):
    """The cp group's figures and a few words naming its link: ``DEFAULT_HARDWARE`` without ``gpus_per_node``, else
    ``group_hardware`` of rank 0's cp group on the ``cp x tp`` mesh (``ValueError``: one line)."""
    from flashpar.cost import group_hardware, preset
    from flashpar.cp.cost import DEFAULT_HARDWARE
    from flashpar.dims import ParallelDims

    if tp < 1 or (gpus_per_node is not None and gpus_per_node < 1):
        raise ValueError(f"--tp and --gpus-per-node must be >= 1, got {tp}, {gpus_per_node}")
    if gpus_per_node is None:
        if tp != 1:
            raise ValueError("--tp places the ranks on nodes: give --gpus-per-node too")
        return preset(DEFAULT_HARDWARE), f"{DEFAULT_HARDWARE} link"
    dims = ParallelDims(1, cp, 1, tp)
    if dims.nodes_spanned(gpus_per_node)["tp"] > 1:
        raise ValueError(f"--tp {tp} would span nodes of --gpus-per-node {gpus_per_node} (tp runs inside a node)")
    hw = group_hardware(preset(NODE_HARDWARE), preset(DEFAULT_HARDWARE), dims.group_ranks(("cp",)), gpus_per_node)
    where = f"{NODE_HARDWARE} link, one node" if hw.nodes == 1 else f"{DEFAULT_HARDWARE} link across {hw.nodes} nodes"
    return hw, where


def _packs(args: argparse.Namespace) -> list[list[int]]:
    """The packs to plan: the whole list as one, or its first ``--packs`` packs of ``--tokens`` (one-line errors)."""
    from flashpar.cp.lengths import resolve_lengths

    source = resolve_lengths(args.lengths)
    if args.tokens is not None and args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    if args.packs is not None and args.packs < 1:
        raise ValueError(f"--packs must be >= 1, got {args.packs}")
    if source.sampled and (args.tokens is None or args.packs is None):
        raise ValueError(f"--lengths {args.lengths} is a sampled distribution: give --tokens and --packs")
    least = 2 * args.cp  # a head and a tail per rank
    if args.tokens is None:
        total = sum(source.values)
        if total < least:
            raise ValueError(f"--lengths {args.lengths} holds {total} tokens, fewer than 2 per rank of --cp {args.cp}")
        if total > MAX_ONE_PACK:
            raise ValueError(f"--lengths {args.lengths} holds {total:,} tokens: without --tokens that is one pack of "
                             f"{total:,} tokens (more than {MAX_ONE_PACK:,}), minutes of planning; cut the list into "
                             "packs with --tokens T (and --packs K to plan only the first K)")
        print(f"flashpar plan: planning the whole list as one pack of {total:,} tokens (--tokens T cuts it into "
              "packs)", file=sys.stderr)
        return [list(source.values)]
    if args.tokens < least:
        raise ValueError(f"--tokens {args.tokens} is shorter than the ranks can share: --cp {args.cp} needs at least "
                         f"{least} tokens per pack (2 per rank)")
    available = args.packs if source.sampled else sum(source.values) // args.tokens
    building = available if args.packs is None else min(args.packs, available)
    if building > MAX_PACKS:
        raise ValueError(f"{building:,} packs of {args.tokens} tokens would be planned, more than {MAX_PACKS:,} (each "
                         "pack's figures are kept for every strategy): use a larger --tokens or --packs K")
    packs = source.packs(args.tokens, args.packs)  # only the first --packs are built
    if not packs:
        raise ValueError(f"--lengths {args.lengths}: {sum(source.values)} tokens make no full pack of {args.tokens}")
    return packs


def _summarize(per_pack: dict) -> dict:
    base = {b: per_pack.get(b) for b in ("headtail", "per_doc")}
    out = {}
    for s, stats in per_pack.items():
        rows = []
        for i, st in enumerate(stats):
            row = {k: st[k] for k, _ in COLUMNS if k in st}
            for b, key in (("headtail", "vs_headtail"), ("per_doc", "vs_per_doc")):
                if base[b]:
                    row[key] = base[b][i]["est_step_time"] / st["est_step_time"]
            rows.append(row)
        out[s] = {k: {"mean": statistics.mean(r[k] for r in rows),
                      "worst": (min if k.startswith("vs_") else max)(r[k] for r in rows)}
                  for k in rows[0]}
    return out


def _table(summary: dict, args, packs: list[list[int]]) -> str:
    docs = len(packs[0])
    what = (f"{len(packs)} pack(s) of {args.tokens} tokens" if args.tokens
            else f"one pack of {sum(packs[0])} tokens ({docs} document{'s' if docs > 1 else ''})")
    cell = lambda fig, k: f"{fig['mean'] * k:.3g} ({fig['worst'] * k:.3g})"  # noqa: E731
    rows = [["strategy", *(label for _, label in COLUMNS)]]
    for s, cols in summary.items():
        rows.append([s, *(cell(cols[key], SCALE.get(key, 1.0)) if key in cols else "-" for key, _ in COLUMNS)])
    work = "attention only" if args.attention_only else "attention + linear"
    title = f"== {args.lengths}: {what}, N={args.cp} ({args.link}), {work}; mean (worst) over packs =="
    return "\n".join([title, *format_columns(rows)])


def format_columns(rows: list[list[str]], gap: int = 2) -> list[str]:
    """Rows of cells as lines, each column as wide as its widest cell plus ``gap``: the first left-aligned,
    the others right-aligned, so no two columns run together whatever the values."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["".join(cell.ljust(w) if c == 0 else cell.rjust(w + gap) for c, (cell, w) in enumerate(zip(row, widths,
                                                                                                          strict=True)))
            for row in rows]


def _plot(p, path: str) -> int:
    try:
        import matplotlib.pyplot as plt

        fig = plan_figure(p)
    except ImportError:
        print("flashpar plan: --plot needs matplotlib (pip install 'flashpar[plot]')", file=sys.stderr)
        return 2
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
    return 0


def plan_figure(p):
    """Per-rank work (compute bars, estimated time dots) and the rank-to-rank K/V matrix of plan ``p``; every
    rank axis has one tick per rank, at its integer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = p.cp_size
    st = p.stats()
    matrix = [[0] * n for _ in range(n)]
    for r in range(n):
        for src, a, b in p.kv_recv(r):
            matrix[src][r] += (b - a) * p.cost.kv_bytes_per_token / 1e6
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(range(n), [t * 1e3 for t in st["compute"]], label="compute")
    ax1.plot(range(n), [t * 1e3 for t in st["est_time"]], "k.", label="estimated time")
    ax1.set(xlabel="rank", ylabel="ms", title=f"{p.strategy}: per-rank work")
    ax1.legend()
    im = ax2.imshow(matrix, cmap="viridis")
    ax2.set(xlabel="receiver", ylabel="sender", title="K/V MB, sender -> receiver")
    ranks = list(range(n))
    for axis in (ax1.xaxis, ax2.xaxis, ax2.yaxis):
        axis.set_ticks(ranks, [str(r) for r in ranks])
    fig.colorbar(im, ax=ax2)
    fig.tight_layout()
    return fig
