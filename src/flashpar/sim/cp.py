"""``flashpar simulate cp``: every context-parallel strategy's plan on packs of real document lengths, at
cluster scale, timed by the planner's own cost model.

    flashpar simulate cp [--ranks 8,32] [--tokens 128K,512K] [--grid N:T,...] [--lengths wlbllm,...,long-context]
                         [--strategies all] [--hardware h100-ib] [--packs 2] [--window W] [--json OUT]

For every length source, every (ranks N, tokens T) of the grid (``--ranks`` x ``--tokens``, or the pairs of
``--grid``; N <= T) and every strategy, the first
``--packs`` packs of ``T`` tokens (:meth:`flashpar.cp.lengths.Lengths.packs`, a sampled mix with
``--seed``) are planned with ``flashpar.cp.plan`` on :class:`flashpar.cp.cost.CostModel` (the model's
layer shape, default a Llama-3-8B layer, on the ``--hardware`` preset), and each plan is timed by that
model (:func:`flashpar.cp.cp_plan.rank_figures`, the figures the planner scores with):

    step_ms            max over ranks of max(compute, comm + attention on remote K/V), one layer, forward
                       (the backward scales attention and linear work alike: ratios hold for a step)
    kv_bytes           K/V bytes received, all ranks: sum_r recv_tokens_r * 2 kv_heads head_dim dtype_bytes
                       (the plan's ``stats()["total_kv_bytes"]``)
    compute_imbalance  max_r compute_r / mean_r compute_r      (linear + attention time per rank)
    token_imbalance    max_r tokens_r / mean_r tokens_r
    plan_ms            CPU time of that ``plan()`` call on this machine (not simulated: measured; the
                       process's CPU time, which on an idle machine is its wall time, and on a loaded one
                       leaves out the other processes' turns)
    vs_baseline        step of ``--baseline`` (default megatron_dynamic) / this step, pack by pack
    kv_full_MB         with ``--window W``: the plans are made and timed for sliding-window attention of W keys
                       (``CostModel.window``), ``kv_MB`` is the K/V the windows need, and this column what the
                       same plans send without the window (a model's full layers)

A row is one (lengths, N, T, strategy): means over its packs (``*_max``: the worst pack); the JSON holds
the per-pack steps too.  A source whose documents make no full pack of ``T`` tokens (``sotu`` has 2M
tokens in all) is skipped with a note.  After the table, per (lengths, N, T): whether flashcp is
estimated no slower than megatron_dynamic on every pack, and by how much it is faster where it is, at equal
memory: where megatron_dynamic's busiest rank holds more tokens than flashcp's cap allows, flashcp is
planned again under the cap megatron_dynamic reached (:func:`versus_row`).

Cost of the big cases today (CPU time on the 2-core box, 2026-12-01, after the planner's third round of
speed-ups): at 8M tokens and N = 1,024 flashcp takes 1-2.2 s per pack of the shipped lists and the
long-context mix (20-60 s before them), ``torch_per_doc`` 10-15 s, ``per_doc`` 2-3 s; so they are opt-in
(``--grid 1024:8M``).  At 2M / 128 flashcp takes 0.1-0.4 s per pack.  The default grid (N = 8, 32; 128K,
512K; six sources; two packs) is the everyday run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

from flashpar.sim.report import table, write_json

DEFAULT_LENGTHS = "wlbllm,prolong,python311_stdlib,spamassassin,sotu,long-context"
COLUMNS = [("lengths", ""), ("ranks", "d"), ("tokens", ""), ("strategy", ""), ("packs", "d"), ("step_ms", ".3f"),
           ("vs_baseline", ".2f"), ("kv_MB", ".1f"), ("compute_imbalance", ".3f"), ("token_imbalance", ".3f"),
           ("plan_ms", ".1f"), ("plan_ms_max", ".0f")]


def parse_size(text: str) -> int:
    """``131072``, ``128K``, ``2M`` (K = 1024, M = 1024^2) -> tokens."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) < 1:
        raise ValueError(f"not a positive size: {text!r} (examples: 131072, 128K, 2M)")
    return int(digits) * mult


def size_label(tokens: int) -> str:
    if tokens % (1 << 20) == 0:
        return f"{tokens >> 20}M"
    return f"{tokens >> 10}K" if tokens % (1 << 10) == 0 else str(tokens)


def parse_list(text: str, what: str) -> list[str]:
    """The comma-separated items of flag ``what``'s ``text``; ValueError (one line) when there are none."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{what} is empty")
    return items


def parse_counts(text: str, what: str) -> list[int]:
    """The comma-separated positive integers of flag ``what``'s ``text``; ValueError (one line) otherwise."""
    out = []
    for item in parse_list(text, what):
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"{what}: not a positive integer: {item!r}")
        out.append(int(item))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from flashpar.cp.cost import DEFAULT_HARDWARE, CostModel

    d = CostModel()
    p.add_argument("--ranks", default="8,32", help="CP sizes N, comma-separated (default 8,32; up to 1024 and more)")
    p.add_argument("--tokens", default="128K,512K",
                   help="tokens per packed sequence, comma-separated, K/M suffixes (default 128K,512K; 8M at N=1024 "
                        "costs 1-2.2 s of flashcp planning per pack today)")
    p.add_argument("--grid", default=None,
                   help="(ranks, tokens) pairs instead of --ranks x --tokens, e.g. 8:128K,32:512K,128:2M,1024:8M")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS,
                   help=f"length sources, comma-separated: shipped names or files, as --lengths of every command "
                        f"(default {DEFAULT_LENGTHS})")
    p.add_argument("--strategies", default="all", help="comma-separated strategy names, or 'all' (default)")
    p.add_argument("--baseline", default="megatron_dynamic", help="the vs_baseline column's strategy "
                                                                  "(default megatron_dynamic)")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help=f"hardware preset (default {DEFAULT_HARDWARE})")
    p.add_argument("--packs", type=int, default=2, help="packs per (lengths, tokens) (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled distributions (default 0)")
    for name, value in (("hidden", d.hidden), ("ffn", d.ffn), ("heads", d.heads), ("kv-heads", d.kv_heads),
                        ("head-dim", d.head_dim), ("dtype-bytes", d.dtype_bytes)):
        p.add_argument(f"--{name}", type=int, default=value, help=f"model layer shape (default {value}: Llama-3-8B)")
    p.add_argument("--attention-only", action="store_true", help="CostModel(linear=False): attention work alone")
    p.add_argument("--window", type=int, default=None,
                   help="sliding-window attention of W keys: plans made and timed for it, kv_MB the windows' K/V and "
                        "kv_full_MB what the same plans send without the window (default: none)")
    p.add_argument("--json", default=None, help="write {\"setup\": ..., \"rows\": [...]} to this file")


def _setup(args: argparse.Namespace):
    """(grid of (N, T), sources, strategies, cost model) from the arguments; ``ValueError`` (one line) on a bad one."""
    from flashpar.cp import STRATEGIES
    from flashpar.cp.cost import CostModel
    from flashpar.cp.lengths import resolve_lengths

    ranks = parse_counts(args.ranks, "--ranks")
    try:
        tokens = [parse_size(t) for t in parse_list(args.tokens, "--tokens")]
    except ValueError as err:
        raise ValueError(f"--tokens: {err}") from None
    grid = [(n, t) for t in tokens for n in ranks]
    if args.grid is not None:
        grid = []
        for cell in parse_list(args.grid, "--grid"):
            n, _, t = cell.partition(":")
            if not n.strip().isdigit() or int(n) < 1 or not t:
                raise ValueError(f"--grid: {cell!r} is not RANKS:TOKENS (example 32:512K)")
            try:
                grid.append((int(n), parse_size(t)))
            except ValueError as err:
                raise ValueError(f"--grid: {err}") from None
    bad = [(n, t) for n, t in grid if n > t]
    if bad:
        n, t = bad[0]
        raise ValueError(f"--ranks {n} > --tokens {size_label(t)}: a rank needs at least one token")
    strategies = list(STRATEGIES) if args.strategies == "all" else parse_list(args.strategies, "--strategies")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"--strategies: unknown {unknown[0]!r}; expected names from {STRATEGIES} or 'all'")
    if args.baseline not in STRATEGIES:
        raise ValueError(f"--baseline: unknown {args.baseline!r}; expected one of {STRATEGIES}")
    if args.packs < 1:
        raise ValueError(f"--packs must be >= 1, got {args.packs}")
    for key in ("hidden", "ffn", "heads", "kv_heads", "head_dim", "dtype_bytes"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    sources = {}
    for name in parse_list(args.lengths, "--lengths"):
        try:
            sources[name] = resolve_lengths(name)
        except (OSError, ValueError) as err:
            raise ValueError(f"--lengths: {err}") from None
    window = getattr(args, "window", None)
    if window is not None and window < 1:
        raise ValueError(f"--window must be >= 1, got {window}")
    cost = CostModel(hidden=args.hidden, ffn=args.ffn, heads=args.heads, kv_heads=args.kv_heads,
                     head_dim=args.head_dim, dtype_bytes=args.dtype_bytes, linear=not args.attention_only,
                     hardware=args.hardware, window=window)  # an unknown preset: ValueError naming the known ones
    return grid, sources, strategies, cost


def plan_figures(doc_lens: list[int], n: int, strategy: str, cost) -> dict:
    """One plan and its simulated figures (the module docstring), ``plan_ms`` measured around ``plan()``."""
    from flashpar.cp import plan

    t0 = time.process_time()  # CPU time: on a shared box, wall time counts the other processes' turns
    p = plan(doc_lens, n, strategy=strategy, cost=cost)
    plan_ms = (time.process_time() - t0) * 1e3
    fig = p.figures()
    ratio = lambda xs: max(xs) / (sum(xs) / len(xs)) if sum(xs) > 0 else 1.0  # noqa: E731
    out = {"step_ms": fig.step * 1e3, "kv_bytes": sum(fig.recv_tokens) * cost.kv_bytes_per_token,
           "compute_imbalance": ratio(fig.compute), "token_imbalance": ratio(fig.tokens),
           "token_peak": max(fig.tokens), "plan_ms": plan_ms}
    if cost.window is not None:  # the same placement's exchange without the window (its full layers')
        full = dataclasses.replace(p, cost=dataclasses.replace(cost, window=None)).figures()
        out["kv_full_bytes"] = sum(full.recv_tokens) * cost.kv_bytes_per_token
    return out


def simulate(grid, sources: dict, strategies: list[str], cost, *, packs: int, seed: int = 0,
             baseline: str = "megatron_dynamic", progress=None) -> tuple[list[dict], list[dict], list[str]]:
    """(rows, flashcp-vs-megatron_dynamic comparisons, notes) of the module docstring."""
    plan_set = list(dict.fromkeys([*strategies, baseline]))  # the baseline is planned even when not shown
    from flashpar.cp import plan

    for s in plan_set:  # first calls import and warm what a strategy uses (numpy paths, torch's balancer)
        plan([8, 16, 8], 2, strategy=s, cost=cost)
    rows, versus, notes = [], [], []
    for name, source in sources.items():
        for n, tokens in grid:
            pack_list = source.packs(tokens, packs, seed=seed)
            if not pack_list:
                total = f"{sum(source.values):,}" if source.values else "its"
                notes.append(f"{name}: {total} tokens make no full pack of {size_label(tokens)}; skipped")
                continue
            per = {s: [] for s in plan_set}
            for doc_lens in pack_list:
                for s in plan_set:
                    per[s].append(plan_figures(doc_lens, n, s, cost))
                    if progress:
                        progress(f"{name} N={n} T={size_label(tokens)} {s}")
            base = [f["step_ms"] for f in per[baseline]]
            for s in strategies:
                figs = per[s]
                mean = lambda key, figs=figs: statistics.fmean(f[key] for f in figs)  # noqa: E731
                vs = [b / f["step_ms"] for b, f in zip(base, figs, strict=True)]
                rows.append({"strategy": s, "lengths": name, "ranks": n, "tokens": size_label(tokens),
                             "tokens_per_pack": tokens, "packs": len(figs), "docs": sum(map(len, pack_list)),
                             "step_ms": mean("step_ms"), "kv_bytes": mean("kv_bytes"),
                             "kv_MB": mean("kv_bytes") / 1e6, "compute_imbalance": mean("compute_imbalance"),
                             "token_imbalance": mean("token_imbalance"), "plan_ms": mean("plan_ms"),
                             "plan_ms_max": max(f["plan_ms"] for f in figs), "vs_baseline": statistics.fmean(vs),
                             "vs_baseline_min": min(vs), "step_ms_packs": [f["step_ms"] for f in figs]})
                if "kv_full_bytes" in figs[0]:
                    rows[-1]["kv_full_MB"] = mean("kv_full_bytes") / 1e6
            if "flashcp" in per and "megatron_dynamic" in per:
                versus.append(versus_row(name, n, tokens, pack_list, per["flashcp"], per["megatron_dynamic"], cost))
    return rows, versus, notes


def versus_row(name: str, n: int, tokens: int, pack_list, flash: list[dict], mega: list[dict], cost) -> dict:
    """flashcp against megatron_dynamic on each pack of one (lengths, N, T), at equal memory.

    flashcp plans under a token cap, ``(1 + 0.05) T / N`` by default: no rank holds more than that, which bounds
    the activation memory of the linear layers.  megatron_dynamic keeps the same cap only while some group has
    room, and then places documents past it.  On a pack where it does (its busiest rank holds ``P`` tokens
    above flashcp's cap), comparing the two plans would compare different memory budgets.  There flashcp is
    planned again with the cap megatron_dynamic reached (``token_slack = P N / T - 1``), and that plan, which
    holds no more tokens on any rank than megatron_dynamic's, is the one compared.  ``equal_memory_packs``
    counts those packs; ``speedup_at_cap`` keeps the default-cap figures (the table's flashcp row)."""
    from flashpar.cp import plan
    from flashpar.cp.flashcp import token_cap

    at_cap, speed, matched = [], [], 0
    for doc_lens, f, m in zip(pack_list, flash, mega, strict=True):
        at_cap.append(m["step_ms"] / f["step_ms"])
        peak = m["token_peak"]
        if peak <= token_cap(doc_lens, n, 0.05):
            speed.append(at_cap[-1])
            continue
        slack = peak * n / sum(doc_lens) - 1
        while token_cap(doc_lens, n, slack) < peak:  # (float rounding: the cap must reach P)
            slack = math.nextafter(slack, math.inf)
        g = plan(doc_lens, n, strategy="flashcp", cost=cost, token_slack=slack).figures()
        if max(g.tokens) > peak:
            raise RuntimeError(f"flashcp at token_slack {slack} holds {max(g.tokens)} > {peak} tokens on a rank")
        speed.append(m["step_ms"] / (g.step * 1e3))
        matched += 1
    return {"lengths": name, "ranks": n, "tokens": size_label(tokens), "packs": len(speed),
            "no_slower": all(x >= 1 - 1e-9 for x in speed), "faster_packs": sum(x > 1 + 1e-3 for x in speed),
            "speedup_mean": statistics.fmean(speed), "speedup_max": max(speed), "speedup_min": min(speed),
            "equal_memory_packs": matched, "speedup_at_cap": at_cap,
            "no_slower_at_cap": all(x >= 1 - 1e-9 for x in at_cap)}


def versus_lines(versus: list[dict]) -> list[str]:
    lines = ["flashcp vs megatron_dynamic (estimated step, pack by pack; where megatron_dynamic holds more tokens on "
             "a rank than flashcp's cap, flashcp planned with the cap megatron_dynamic reached: equal memory):"]
    for v in versus:
        verdict = "no slower on every pack" if v["no_slower"] else "SLOWER on some pack"
        equal = v.get("equal_memory_packs", 0)
        note = ""
        if equal:
            cap = ", ".join(f"{x:.3f}" for x in v["speedup_at_cap"])
            note = f"; {equal} pack(s) at megatron_dynamic's token peak (at flashcp's own cap: x{cap})"
        lines.append(f"  {v['lengths']} N={v['ranks']} T={v['tokens']}: {verdict}; faster on {v['faster_packs']} of "
                     f"{v['packs']}, x{v['speedup_mean']:.2f} mean ({v['speedup_min']:.2f}-{v['speedup_max']:.2f})"
                     f"{note}")
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        grid, sources, strategies, cost = _setup(args)
    except ValueError as err:
        print(f"flashpar simulate cp: {err}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows, versus, notes = simulate(grid, sources, strategies, cost, packs=args.packs, seed=args.seed,
                                   baseline=args.baseline)
    work = "attention only" if args.attention_only else "attention + linear"
    title = (f"simulated, {args.hardware}: one layer forward ({cost.hidden} hidden, {cost.heads}/{cost.kv_heads} heads "
             f"of {cost.head_dim}, {work}); means over packs; vs_baseline = {args.baseline} step / this step; "
             f"plan_ms: CPU ms of plan() on this machine")
    if cost.window is not None:
        title += f"; sliding window {cost.window}: kv_MB the windows' K/V, kv_full_MB the same plans' without it"
    columns = COLUMNS if cost.window is None else [*COLUMNS[:7], ("kv_full_MB", ".1f"), *COLUMNS[7:]]
    print(table(rows, columns, title=title))
    for line in notes + (versus_lines(versus) if versus else []):
        print(line)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    setup = {"hardware": args.hardware, "cost": cost.to_dict(), "grid": [[n, t] for n, t in grid],
             "lengths": list(sources), "strategies": strategies, "packs": args.packs, "seed": args.seed,
             "baseline": args.baseline, "step": "one layer, forward, cost model", "notes": notes,
             "flashcp_vs_megatron_dynamic": versus}
    write_json(args.json, setup, rows)
    return 0
