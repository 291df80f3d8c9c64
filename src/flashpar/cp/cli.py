"""``flashpar plan``: plan packed sequences of real document lengths with every CP strategy, side by side.

    flashpar plan --lengths FILE --cp N [--tokens T] [--strategy NAME|all] [--json OUT] [--plot OUT.png]

Without ``--tokens`` the whole list is one packed sequence; with it, the document stream is cut
into packs of exactly ``T`` tokens (:func:`flashpar.cp.lengths.pack`) and every figure is the
mean and the worst over the packs.  Speedups are estimated step times of ``headtail`` and
``per_doc`` over this strategy's, pack by pack.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

COLUMNS = (("compute_imbalance", "compute imb"), ("attn_imbalance", "attn imb"), ("token_imbalance", "token imb"),
           ("total_kv_bytes", "KV total MB"), ("max_kv_bytes", "KV max MB"), ("kv_worst_frac", "KV worst frac"),
           ("est_step_time", "step ms"), ("vs_headtail", "x headtail"), ("vs_per_doc", "x per_doc"),
           ("planning_s", "plan ms"))
SCALE = {"total_kv_bytes": 1e-6, "max_kv_bytes": 1e-6, "est_step_time": 1e3, "planning_s": 1e3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", required=True, help="document lengths: one per line, or a JSON list")
    p.add_argument("--cp", type=int, required=True, help="context-parallel size N")
    p.add_argument("--tokens", type=int, default=None, help="cut the stream into packs of exactly T tokens")
    p.add_argument("--packs", type=int, default=None, help="use only the first K packs")
    p.add_argument("--strategy", default="all", help="a strategy name, or 'all' (default)")
    p.add_argument("--attention-only", action="store_true", help="CostModel(linear=False): attention work alone")
    p.add_argument("--json", default=None, help="write the per-strategy summaries to this file")
    p.add_argument("--plot", default=None, help="PNG of per-rank work and the rank-to-rank K/V matrix (flashcp)")


def run(args: argparse.Namespace) -> int:
    from flashpar.cp import STRATEGIES, CostModel, plan
    from flashpar.cp.lengths import pack, read_lengths

    try:
        lengths = read_lengths(args.lengths)
    except (OSError, ValueError) as err:
        print(f"flashpar plan: {err}", file=sys.stderr)
        return 2
    if args.cp < 1:
        print(f"flashpar plan: --cp must be >= 1, got {args.cp}", file=sys.stderr)
        return 2
    strategies = list(STRATEGIES) if args.strategy == "all" else [args.strategy]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        print(f"flashpar plan: unknown strategy {unknown[0]!r}; expected one of {STRATEGIES} or 'all'", file=sys.stderr)
        return 2
    packs = pack(lengths, args.tokens) if args.tokens else [lengths]
    packs = packs[: args.packs] if args.packs else packs
    if not packs:
        print(f"flashpar plan: {sum(lengths)} tokens make no full pack of {args.tokens}", file=sys.stderr)
        return 2
    cost = CostModel(linear=not args.attention_only)
    per_pack = {s: [] for s in strategies}
    plans = {}
    for doc_lens in packs:
        for s in strategies:
            p = plan(doc_lens, args.cp, strategy=s, cost=cost)
            per_pack[s].append(p.stats())
            plans[s] = p
    summary = _summarize(per_pack)
    print(_table(summary, args, len(packs), sum(map(len, packs))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cp": args.cp, "tokens": args.tokens, "packs": len(packs), "summary": summary}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        return _plot(plans.get("flashcp") or next(iter(plans.values())), args.plot)
    return 0


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


def _table(summary: dict, args, n_packs: int, tokens: int) -> str:
    head = f"{'strategy':<15}" + "".join(f"{label:>15}" for _, label in COLUMNS)
    what = f"{n_packs} pack(s) of {args.tokens} tokens" if args.tokens else f"one pack of {tokens} tokens"
    lines = [f"== {args.lengths}: {what}, N={args.cp}, "
             f"{'attention only' if args.attention_only else 'attention + linear'}; mean (worst) over packs ==",
             head]
    for s, cols in summary.items():
        cells = []
        for key, _ in COLUMNS:
            if key not in cols:
                cells.append(f"{'-':>15}")
                continue
            k = SCALE.get(key, 1.0)
            cells.append(f"{cols[key]['mean'] * k:>8.3g} ({cols[key]['worst'] * k:.3g})".rjust(15))
        lines.append(f"{s:<15}" + "".join(cells))
    return "\n".join(lines)


def _plot(p, path: str) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("flashpar plan: --plot needs matplotlib (pip install 'flashpar[plot]')", file=sys.stderr)
        return 2
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
    fig.colorbar(im, ax=ax2)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")
    return 0
