"""``flashpar bench plan``: the FlashCP planner against its targets, on real document lengths.

1. MagiAttention's anchor: its length histogram, 8K tokens per rank at N = 8 (packs of 64K), mean
   of 3 packs, documents uncapped and capped at a quarter of the pack, attention work alone; and the floor of
   the worst rank's K/V within the balance targets (``flashpar.cp.kv_floor``).
2. Every shipped length list (``flashpar/data``) and the long-context bucket mix (or the ``--lists``
   given): packs of 128K tokens at N = 8 and 512K at N = 32, default cost model (attention + linear).
3. Planning time for 1M tokens at N = 64 (5 packs, or ``--packs`` if fewer).
4. With ``--scale``: planning time at scale against the targets (median of ``--scale-runs``): 128K tokens at
   N = 8 and 512K at N = 32, on a pack of wlbllm, of 2,000 and of 10,000 short documents (:func:`short_docs`)
   and of many short source files (450 and 2,059 of the standard library's files, :func:`source_docs`), and 8M
   tokens at N = 1,024 on wlbllm, the long-context mix and 4,359 source files (each row also shows the plan's
   compute and token imbalance).

Figures: compute imbalance (max / mean of the cost model's per-rank compute), attention imbalance
(max / mean of causal pairs), token imbalance, ``kv_worst_frac`` (the worst rank's K/V received
over what an all-gather would bring it), K/V bytes against ``per_doc`` and ``per_doc_aware``,
estimated step time against every baseline (``slower``: packs where flashcp is estimated slower than any;
``x headtail``, ``x per_doc``, ``x megatron``: mean speedups over those, ``megatron`` being Megatron-Core's
dynamic CP, ``megatron_dynamic``), planning time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

BASELINES = ("contiguous", "headtail", "per_doc", "per_doc_aware", "torch_per_doc", "whole_doc", "megatron_dynamic")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--packs", type=int, default=12, help="packs per list and size (default 12; planning time: "
                                                         "at most 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lists", default=None,
                   help="comma-separated --lengths names or files for the length-list block (default: every shipped "
                        "list and the long-context mix)")
    p.add_argument("--scale", action="store_true",
                   help="also time the planner at scale against its targets (128K / N=8 and 512K / N=32 with up to "
                        "10,000 documents, 8M / N=1024; short documents and source files among them)")
    p.add_argument("--scale-runs", type=int, default=3, help="runs per --scale case, the median shown (default 3)")


SCALE_TARGETS_MS = {(131072, 8): 20.0, (524288, 32): 200.0, (8 << 20, 1024): 1000.0}
"""Planning-time targets (ms, an idle 2-core machine) per (tokens, N), whatever the number of documents."""


def _timed(doc_lens, n, cpu: bool = False, **kw):
    """The plan and its planning time (garbage collection off while timing, as ``timeit`` does); with ``cpu``,
    also the process's CPU time (on a loaded machine the wall time also counts other processes' turns)."""
    import gc

    from flashpar.cp import plan

    gc.collect()
    gc.disable()
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        p = plan(doc_lens, n, **kw)
        t1, c1 = time.perf_counter(), time.process_time()
        return (p, t1 - t0, c1 - c0) if cpu else (p, t1 - t0)
    finally:
        gc.enable()


MAGI_CAPS = (1.02, 1.05)
"""The balance the Magi anchor's plans must keep (attention imbalance, token imbalance): the floor of the worst
rank's K/V is computed within them."""


def magi(seed: int) -> list[str]:
    from flashpar.cp import CostModel
    from flashpar.cp.kv_floor import kv_worst_floor
    from flashpar.cp.lengths import resolve_lengths

    histogram = resolve_lengths("magi")
    cost = CostModel(linear=False)
    lines = ["MagiAttention anchor: histogram lengths, N=8, 64K-token packs (8K per rank), mean of 3 packs, "
             "attention work alone",
             f"{'documents':<12}{'strategy':<15}{'attn imb':>9}{'compute imb':>12}{'token imb':>10}"
             f"{'kv_worst_frac':>14}{'plan ms':>9}"]
    for label, cap in (("uncapped", None), ("capped 16K", 16384)):
        packs = histogram.packs(65536, 3, seed=seed, cap=cap)
        for strategy in ("per_doc_aware", "whole_doc", "flashcp"):
            rows = []
            for doc_lens in packs:
                p, dt = _timed(doc_lens, 8, strategy=strategy, cost=cost)
                s = p.stats()
                rows.append((s["attn_imbalance"], s["compute_imbalance"], s["token_imbalance"], s["kv_worst_frac"],
                             dt * 1e3))
            m = [statistics.mean(c) for c in zip(*rows, strict=True)]
            lines.append(f"{label:<12}{strategy:<15}{m[0]:>9.3f}{m[1]:>12.3f}{m[2]:>10.3f}{m[3]:>14.3f}{m[4]:>9.1f}")
        # the least kv_worst_frac any plan within the balance targets can have (flashpar.cp.kv_floor)
        floor = statistics.mean(kv_worst_floor(d, 8, *MAGI_CAPS) for d in packs)
        lines.append(f"{label:<12}{'floor':<15}{MAGI_CAPS[0]:>9.3f}{'-':>12}{MAGI_CAPS[1]:>10.3f}{floor:>14.3f}{'-':>9}")
    lines.append("floor: no plan within those attention and token imbalances receives less on its worst rank "
                 "(the rank with a long document's last query receives the keys it cannot hold)")
    return lines


def lists(n_packs: int, seed: int, names=None) -> list[str]:
    """flashcp against the baselines on packs of 128K (N = 8) and 512K (N = 32) tokens of each of ``names``
    (``--lengths`` names or files; default every shipped list and the long-context mix)."""
    from flashpar.cp import STRATEGIES
    from flashpar.cp.lengths import LISTS

    lines = ["Length lists: flashcp per pack against the baselines (default cost model: attention + linear)",
             f"{'list':<18}{'tokens':>7}{'N':>4}{'packs':>6}{'compute imb':>16}{'token imb':>10}{'kv/per_doc':>11}"
             f"{'>aware':>7}{'slower':>7}{'x headtail':>11}{'x per_doc':>10}{'x megatron':>11}{'plan ms':>14}"]
    sources = sources_of(names or (*LISTS, "long-context"))
    for tokens, n in ((131072, 8), (524288, 32)):
        for name, source in sources.items():
            packs = source.packs(tokens, n_packs, seed=seed)
            imb, tok, vs_ht, vs_pd, vs_md, plan_ms = [], [], [], [], [], []
            kv_ratio_num = kv_ratio_den = over_aware = slower = 0
            for doc_lens in packs:
                p, dt = _timed(doc_lens, n)
                s = p.stats()
                base = {b: _timed(doc_lens, n, strategy=b)[0].stats() for b in STRATEGIES if b != "flashcp"}
                imb.append(s["compute_imbalance"])
                tok.append(s["token_imbalance"])
                if max(doc_lens) < tokens // 2:
                    kv_ratio_num += s["total_kv_bytes"]
                    kv_ratio_den += base["per_doc"]["total_kv_bytes"]
                over_aware += s["total_kv_bytes"] > base["per_doc_aware"]["total_kv_bytes"]
                slower += any(s["est_step_time"] > b["est_step_time"] * (1 + 1e-9) for b in base.values())
                vs_ht.append(base["headtail"]["est_step_time"] / s["est_step_time"])
                vs_pd.append(base["per_doc"]["est_step_time"] / s["est_step_time"])
                vs_md.append(base["megatron_dynamic"]["est_step_time"] / s["est_step_time"])
                plan_ms.append(dt * 1e3)
            kv = f"{kv_ratio_num / kv_ratio_den:.2f}" if kv_ratio_den else "-"
            label = "long-context mix" if name == "long-context" else name
            lines.append(f"{label:<18}{tokens // 1024:>6}K{n:>4}{len(packs):>6}"
                         f"{statistics.mean(imb):>8.3f} ({max(imb):.3f}){max(tok):>10.3f}{kv:>11}{over_aware:>7}"
                         f"{slower:>7}{statistics.mean(vs_ht):>11.2f}{statistics.mean(vs_pd):>10.2f}{statistics.mean(vs_md):>11.2f}"
                         f"{statistics.mean(plan_ms):>7.1f} ({max(plan_ms):.0f})")
    return lines


def planning_time(n_packs: int) -> list[str]:
    """flashcp's planning time on the first ``min(5, n_packs)`` packs of 128K and 1M tokens of two lists."""
    from flashpar.cp.lengths import resolve_lengths

    count = min(5, n_packs)
    lines = [f"Planning time, flashcp (ms, mean / max over {count} packs)"]
    for name in ("wlbllm", "prolong"):
        lengths = resolve_lengths(name)
        for tokens, n in ((131072, 8), (1 << 20, 64)):
            times = [_timed(doc_lens, n)[1] * 1e3 for doc_lens in lengths.packs(tokens, count)]
            lines.append(f"  {name:<10} {tokens // 1024:>5}K tokens, N={n:<3}: {statistics.mean(times):7.1f} / "
                         f"{max(times):.1f}")
    return lines


def short_docs(tokens: int, docs: int) -> list[int]:
    """A pack of exactly ``docs`` documents adding up to ``tokens``: spamassassin's lengths (cycled), scaled to fit
    (see :func:`scaled_docs`)."""
    from flashpar.cp.lengths import resolve_lengths

    return scaled_docs(resolve_lengths("spamassassin").values, tokens, docs)


def source_docs(tokens: int, docs: int) -> list[int]:
    """A pack of exactly ``docs`` of the Python standard library's source files (``flashpar.corpus``, in path order,
    cycled), their lengths scaled to add up to ``tokens`` (see :func:`scaled_docs`): many short documents and a
    long tail (a few files are 40-80x the median)."""
    from flashpar.corpus import document_lengths

    return scaled_docs(document_lengths(), tokens, docs)


def scaled_docs(values, tokens: int, docs: int) -> list[int]:
    """A pack of exactly ``docs`` documents adding up to ``tokens``: ``values`` (cycled), scaled to fit (each at
    least 1 token; the rounding's remainder spread over the longest, one token each)."""
    if not 1 <= docs <= tokens:
        raise ValueError(f"a pack of {tokens} tokens holds 1 to {tokens} documents, not {docs}")
    raw = [values[i % len(values)] for i in range(docs)]
    total = sum(raw)
    lens = [max(1, v * tokens // total) for v in raw]
    rest, i = tokens - sum(lens), 0
    order = sorted(range(docs), key=lambda d: -lens[d])
    while rest:
        d = order[i % docs]
        step = 1 if rest > 0 else -(lens[d] > 1)
        lens[d] += step
        rest -= step
        i += 1
    return lens


def scale_packs() -> list[tuple[str, list[int], int, int]]:
    """The ``--scale`` cases: (label, document lengths, tokens, N)."""
    from flashpar.cp.lengths import resolve_lengths

    out = []
    for tokens, n, files in ((131072, 8, 450), (524288, 32, 2059)):
        out.append(("wlbllm", resolve_lengths("wlbllm").packs(tokens, 1)[0], tokens, n))
        out += [(f"{docs:,} short docs", short_docs(tokens, docs), tokens, n) for docs in (2000, 10000)]
        out.append((f"{files:,} source files", source_docs(tokens, files), tokens, n))
    for name in ("wlbllm", "long-context"):
        out.append((name if name != "long-context" else "long-context mix",
                    resolve_lengths(name).packs(8 << 20, 1)[0], 8 << 20, 1024))
    out.append(("4,359 source files", source_docs(8 << 20, 4359), 8 << 20, 1024))
    return out


def planning_at_scale(runs: int) -> list[str]:
    """flashcp's planning time (median of ``runs``, interleaved) on :func:`scale_packs` against its target."""
    import os

    cases = scale_packs()
    times: list[list[float]] = [[] for _ in cases]
    cpus: list[list[float]] = [[] for _ in cases]
    plans = [None] * len(cases)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for _ in range(runs):
        for i, (_, doc_lens, _, n) in enumerate(cases):
            plans[i], dt, cpu = _timed(doc_lens, n, cpu=True)
            times[i].append(dt * 1e3)
            cpus[i].append(cpu * 1e3)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"Planning time at scale, flashcp (ms, median of {runs} runs; load average {load0:.1f} before, "
             f"{load:.1f} after; met: the wall time, or where the machine is loaded the CPU time, within the "
             "target)",
             f"{'pack':<20}{'tokens':>7}{'N':>6}{'docs':>7}{'plan ms':>10}{'cpu ms':>9}{'target':>8}{'met':>5}"
             f"{'compute imb':>12}{'token imb':>10}"]
    for (label, doc_lens, tokens, n), ts, cs, p in zip(cases, times, cpus, plans, strict=True):
        target, ms, cpu, s = SCALE_TARGETS_MS[(tokens, n)], statistics.median(ts), statistics.median(cs), p.stats()
        size = f"{tokens // 1024}K" if tokens < 1 << 20 else f"{tokens >> 20}M"
        met = "yes" if min(ms, cpu) <= target else "NO"
        lines.append(f"{label:<20}{size:>7}{n:>6}{len(doc_lens):>7}{ms:>10.1f}{cpu:>9.1f}{target:>8.0f}{met:>5}"
                     f"{s['compute_imbalance']:>12.3f}{s['token_imbalance']:>10.3f}")
    return lines


def sources_of(names) -> dict:
    """``{name: resolve_lengths(name)}``, in order."""
    from flashpar.cp.lengths import resolve_lengths

    return {name: resolve_lengths(name) for name in names}


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.lists.split(",") if n.strip()] if args.lists is not None else None
    try:
        if args.packs < 1:
            raise ValueError(f"--packs must be >= 1, got {args.packs}")
        if args.scale_runs < 1:
            raise ValueError(f"--scale-runs must be >= 1, got {args.scale_runs}")
        if names is not None:
            if not names:
                raise ValueError("--lists is empty")
            sources_of(names)
    except (OSError, ValueError) as err:
        print(f"flashpar bench plan: {err}", file=sys.stderr)
        return 2
    blocks = [lambda: magi(args.seed), lambda: lists(args.packs, args.seed, names), lambda: planning_time(args.packs)]
    if args.scale:
        blocks.append(lambda: planning_at_scale(args.scale_runs))
    for block in blocks:
        print("\n".join(block()), flush=True)
        print()
    return 0
