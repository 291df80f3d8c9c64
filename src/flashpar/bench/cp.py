"""``flashpar bench cp``: every context-parallel strategy side by side, forward and backward, in one run.

The parent starts N gloo ranks (behind emulated rate-limited links with ``--link-rate``, as
``flashpar bench overlap`` does; loopback otherwise).  Each rank

1. calibrates (:mod:`flashpar.cost.calibrate`): the GEMM rate, the link, and the CPU
   flash-attention rate forward and backward on a long and a short causal block (fitting the
   attention curve's plateau and half-efficiency length); rank 0's values go into one
   ``CostModel`` per direction (attention work alone, this model's heads and dtype);
2. packs real document lengths (``--lengths``: a shipped name or a file, as in every command;
   validated in the parent before any rank starts), divided by ``--scale``
   (default 16: 8K-token packs with the shape of 128K-token packs, which a CPU cannot run), into
   sequences of ``--tokens`` tokens and plans every strategy with that cost model;
3. runs, round by round with the strategies' order rotated, ``flashpar.cp.attention`` forward and
   backward three ways: overlapped, compute-only and communication-only;
4. reports medians over rounds of the slowest rank, summed over packs; the JSON (``--json``) also keeps,
   per strategy and pack, those medians, each rank's compute-only forward and backward medians and the
   bytes sent, and the box's load average before and after (what ``flashpar simulate check`` reads).

``--window W``: every strategy runs sliding-window attention (``flashpar.cp.attention(..., window=w)``) with the
window scaled as the lengths are, ``w = max(1, W // scale)`` (a 4096-token window on 128K packs is a 256-token one on
their 8K copies), planned for it (``plan(..., window=w)``); the report adds the K/V the same plans send without the
window (planned bytes, beside the measured windowed ones).

Columns: measured step (forward + backward) and its parts, ``ideal = max(compute, comm)``,
``ovl/ideal``; bytes sent forward (measured, all ranks); compute imbalance (the busiest rank's
compute-only time over the mean); speedups over ``headtail`` and ``per_doc``; and the cost
model's predictions of the step, the imbalance and the speedups beside them.  The prediction of a
direction is ``max over ranks of max(compute, comm + compute on remote K/V)`` with that direction's
calibrated attention rate; a step is forward + backward (``flashpar.sim.bench_runs.cp_predict``).  Where
the ranks share fewer cores than there are ranks (4 ranks on this 2-core box), compute is played under
processor sharing (``flashpar.cost.shared_finish``): a busy rank's speed depends on how many others are
busy, which compresses the measured imbalance; the predicted imbalance column is the model's, per rank,
without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from flashpar.cp import STRATEGIES
from flashpar.cp.lengths import LENGTHS_HELP
from flashpar.sim.bench_runs import cp_packs, cp_predict

KINDS = ("overlapped", "compute", "comm")


# ----------------------------------------------------------------------------------------------
# worker (one per rank)


def calibrate_costs(config: dict):
    """(forward CostModel, backward CostModel) fitted on this machine; rank 0's values on every rank."""
    import torch

    from flashpar.cost.calibrate import calibrate, calibrate_attention
    from flashpar.cp import CostModel

    dtype = getattr(torch, config["dtype"])
    h, hkv, d = config["heads"], config["kv_heads"], config["head_dim"]
    fwd, bwd = calibrate_attention(calibrate(dtype=dtype), h, hkv, d, dtype)
    shape = {"hidden": h * d, "heads": h, "kv_heads": hkv, "head_dim": d, "layers": 1,
             "dtype_bytes": torch.empty((), dtype=dtype).element_size(), "linear": False}
    return CostModel(**shape, hardware=fwd), CostModel(**shape, hardware=bwd)


def bench_window(config: dict) -> int | None:
    """The window the ranks run: ``--window`` divided by ``--scale`` as the lengths are (at least 1), or None."""
    w = config.get("window")
    return None if w is None else max(1, w // config["scale"])


def _measure(p, q, k, v, dout, rank, kind, group=None, window=None):
    """Seconds of this rank's forward and backward (after a barrier each), and the bytes it sent."""
    import contextlib

    import torch.distributed as dist

    from flashpar.cp import CommCounter, attention, shard
    from flashpar.overlap.executor import only

    mine = [shard(x, p, rank).requires_grad_() for x in (q, k, v)]
    grad = shard(dout, p, rank)
    counter = CommCounter()
    with only(kind) if kind != "overlapped" else contextlib.nullcontext():
        dist.barrier(group)
        t0 = time.perf_counter()
        out = attention(*mine, p, group=group, counter=counter, check=False, window=window)
        t_fwd = time.perf_counter() - t0
        dist.barrier(group)
        t0 = time.perf_counter()
        out.backward(grad)
        t_bwd = time.perf_counter() - t0
    return t_fwd, t_bwd, counter.fwd_sent


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    from flashpar.cp import plan

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    load_before = os.getloadavg()[0]  # the box's 1-minute load average: how busy it was apart from the ranks
    torch.set_num_threads(config["threads"])
    dtype = getattr(torch, config["dtype"])
    fwd_cost, bwd_cost = calibrate_costs(config)
    strategies = config["strategies"]
    packs = cp_packs(config)
    window = bench_window(config)
    h, hkv, d = config["heads"], config["kv_heads"], config["head_dim"]
    samples: dict[tuple, list] = {}
    plans = {}
    for i, lens in enumerate(packs):
        gen = torch.Generator().manual_seed(i)
        total = sum(lens)
        q, dout = (torch.randn(total, h, d, generator=gen, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(total, hkv, d, generator=gen, dtype=dtype) for _ in range(2))
        plans[i] = {s: plan(lens, n, strategy=s, cost=fwd_cost, window=window) for s in strategies}
        for s in strategies:  # warm-up: layouts, twin groups, allocator
            _measure(plans[i][s], q, k, v, dout, rank, "overlapped", window=window)
        for rnd in range(config["rounds"]):
            order = strategies[rnd % len(strategies):] + strategies[: rnd % len(strategies)]
            for s in order:
                for kind in KINDS:
                    samples.setdefault((i, s, kind), []).append(
                        _measure(plans[i][s], q, k, v, dout, rank, kind, window=window))
    gathered = [None] * n
    dist.all_gather_object(gathered, samples)
    if rank == 0:
        report = {"world_size": n, "config": config, "packs": [len(x) for x in packs], "tokens": config["tokens"],
                  "fwd_cost": fwd_cost.to_dict(), "bwd_cost": bwd_cost.to_dict(), "rows": {},
                  "load_avg": [load_before, os.getloadavg()[0]]}
        for s in strategies:
            row = {k: 0.0 for k in ("overlapped", "compute", "comm", "forward", "backward", "bytes",
                                    "pred_step", "pred_compute", "plan_bytes_no_window")}
            imb, pred_imb, row["per_pack"] = [], [], []
            for i in range(len(packs)):
                med, detail = {}, {}
                for kind in KINDS:
                    per_round = [[gathered[r][(i, s, kind)][j] for r in range(n)] for j in range(config["rounds"])]
                    steps = [max(t[0] + t[1] for t in rr) for rr in per_round]
                    med[kind] = statistics.median(steps)
                    if kind == "overlapped":
                        row["forward"] += statistics.median(max(t[0] for t in rr) for rr in per_round)
                        row["backward"] += statistics.median(max(t[1] for t in rr) for rr in per_round)
                        row["bytes"] += sum(t[2] for t in per_round[0])
                    if kind == "compute":  # per rank: median over rounds of forward + backward
                        per_rank = [statistics.median(rr[r][0] + rr[r][1] for rr in per_round) for r in range(n)]
                        imb.append(max(per_rank) / (sum(per_rank) / n))
                        for d, key in ((0, "rank_compute_fwd"), (1, "rank_compute_bwd")):  # for simulate check
                            detail[key] = [statistics.median(rr[r][d] for rr in per_round) for r in range(n)]
                for kind in KINDS:
                    row[kind] += med[kind]
                sent = sum(gathered[r][(i, s, "overlapped")][0][2] for r in range(n))  # first round, all ranks
                row["plan_bytes_no_window"] += sum(no_window(plans[i][s]).stats()["kv_send_bytes"])
                row["per_pack"].append({**med, **detail, "bytes": sent})
                pred = cp_predict(plans[i][s], *windowed(fwd_cost, bwd_cost, window), config["cores"])
                row["pred_step"] += pred["step"]
                row["pred_compute"] += pred["compute"]
                pred_imb.append(pred["imbalance"])
            row["imbalance"] = statistics.fmean(imb)
            row["pred_imbalance"] = statistics.fmean(pred_imb)
            report["rows"][s] = row
        with open(config["out"], "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def windowed(fwd_cost, bwd_cost, window):
    """The calibrated cost models with the window the ranks run (the prediction counts its pairs and K/V)."""
    import dataclasses

    return tuple(dataclasses.replace(c, window=window) for c in (fwd_cost, bwd_cost))


def no_window(p):
    """``p`` scored without a window (the K/V a full-attention layer would send on the same placement)."""
    import dataclasses

    return dataclasses.replace(p, cost=dataclasses.replace(p.cost, window=None))


# ----------------------------------------------------------------------------------------------
# report


def format_report(report: dict) -> str:
    rows, n = report["rows"], report["world_size"]
    c = report["config"]
    fc, bc = report["fwd_cost"]["hardware"], report["bwd_cost"]["hardware"]
    lines = [
        f"N={n}, link {c['link_rate']}, {c['lengths']} lengths / {c['scale']} packed into {report['tokens']} tokens "
        f"({len(report['packs'])} packs, {sum(report['packs'])} documents), heads {c['heads']}/{c['kv_heads']}, "
        f"head_dim {c['head_dim']}, {c['dtype']}, {c['rounds']} rounds, median of the slowest rank, summed over packs"
        + (f", window {bench_window(c)} (--window {c['window']} / {c['scale']})" if c.get("window") else ""),
        f"calibrated: attention {fc['flops'] * fc['attn_peak'] / 1e9:.1f} GFLOP/s forward, "
        f"{bc['flops'] * bc['attn_peak'] / 1e9:.1f} backward "
        f"(half efficiency at {fc['attn_half']:.0f} / {bc['attn_half']:.0f} tokens), "
        f"link {fc['link_bytes_per_s'] / 1e6:.1f} MB/s; {c['cores']:g} cores shared by the ranks"
        + (f"; load average {report['load_avg'][0]:.1f} before, {report['load_avg'][1]:.1f} after"
           if "load_avg" in report else ""),
        "",
        f"{'strategy':<15}{'step ms':>9}{'fwd':>7}{'bwd':>7}{'compute':>9}{'comm':>7}{'ovl/ideal':>10}"
        f"{'sent MB':>9}{'imb':>6}{'x headtail':>11}{'x per_doc':>10} | {'pred ms':>8}{'imb':>6}"
        f"{'x headtail':>11}{'x per_doc':>10}",
    ]
    ms = lambda x: f"{1e3 * x:.0f}"  # noqa: E731
    for s, r in rows.items():
        ideal = max(r["compute"], r["comm"])
        ratio = lambda base, key, r=r: f"{rows[base][key] / r[key]:.2f}" if base in rows else "-"  # noqa: E731
        lines.append(
            f"{s:<15}{ms(r['overlapped']):>9}{ms(r['forward']):>7}{ms(r['backward']):>7}{ms(r['compute']):>9}"
            f"{ms(r['comm']):>7}{r['overlapped'] / ideal:>10.2f}{r['bytes'] / 1e6:>9.1f}{r['imbalance']:>6.2f}"
            f"{ratio('headtail', 'overlapped'):>11}{ratio('per_doc', 'overlapped'):>10} | {ms(r['pred_step']):>8}"
            f"{r['pred_imbalance']:>6.2f}{ratio('headtail', 'pred_step'):>11}{ratio('per_doc', 'pred_step'):>10}")
    if c.get("window"):
        lines.append("K/V sent forward, all ranks, MB: with the window (measured) / without it (the same plans)")
        lines.extend(f"  {s:<15}{r['bytes'] / 1e6:>9.2f} / {r['plan_bytes_no_window'] / 1e6:.2f}"
                     for s, r in rows.items())
    pd = rows.get("per_doc")
    if pd:
        lines.append(f"per_doc communication / compute (measured, step): {pd['comm'] / pd['compute']:.2f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--link-rate", default="300mbit",
                   help="emulated per-rank link (tc rate); 'none' = loopback (default 300mbit)")
    p.add_argument("--lengths", default="wlbllm", help=LENGTHS_HELP + " (default wlbllm)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per packed sequence (default 8192)")
    p.add_argument("--scale", type=int, default=16,
                   help="divide every document length by this (default 16: 8K-token packs shaped like 128K packs, "
                        "which a 2-core CPU cannot run)")
    p.add_argument("--packs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--cores", type=float, default=None,
                   help="cores the ranks share, for the prediction (default: this machine's)")
    p.add_argument("--window", type=int, default=None,
                   help="sliding-window attention of this many tokens at full scale (divided by --scale as the "
                        "lengths are); default: full causal")
    p.add_argument("--json", default=None, help="write the report to this JSON file")
    p.add_argument("--timeout", type=float, default=3600.0)


def check_arguments(nproc: int, config: dict) -> str | None:
    """The first problem with the arguments, as one line, or ``None``: checked in the parent, before any rank
    starts (the ranks rebuild the same packs from ``config``)."""
    unknown = [s for s in config["strategies"] if s not in STRATEGIES]
    if unknown or not config["strategies"]:
        return f"--strategies: unknown {unknown or 'empty list'}; expected names from {STRATEGIES}"
    for key, least in (("nproc", 2), ("tokens", 1), ("scale", 1), ("packs", 1), ("rounds", 1), ("threads", 1),
                       ("heads", 1), ("kv_heads", 1), ("head_dim", 1)):
        value = nproc if key == "nproc" else config[key]
        if value < least:
            return f"--{key.replace('_', '-')} must be >= {least}, got {value}"
    if config.get("window") is not None and config["window"] < 1:
        return f"--window must be >= 1, got {config['window']}"
    if config["heads"] % config["kv_heads"]:
        return f"--heads {config['heads']} is not a multiple of --kv-heads {config['kv_heads']}"
    try:
        packs = cp_packs(config)
    except (OSError, ValueError) as err:
        return f"--lengths: {err}"
    if not packs:
        return f"--lengths {config['lengths']} / {config['scale']} makes no full pack of {config['tokens']} tokens"
    return None


def run(args: argparse.Namespace) -> int:
    from flashpar.bench.launch import run_workers, save_json
    from flashpar.bench.netlink import chosen_rate

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    config = {"threads": args.threads, "dtype": args.dtype, "rounds": args.rounds,
              "strategies": strategies, "lengths": args.lengths,
              "tokens": args.tokens, "scale": args.scale, "packs": args.packs, "heads": args.heads,
              "kv_heads": args.kv_heads, "head_dim": args.head_dim, "window": args.window,
              "cores": args.cores or len(os.sched_getaffinity(0))}
    problem = check_arguments(args.nproc, config)
    if problem:
        print(f"flashpar bench cp: {problem}", file=sys.stderr)
        return 2
    rate = chosen_rate(args.link_rate)
    report = run_workers("flashpar.bench.cp", args.nproc, config, rate, timeout=args.timeout)
    print(format_report(report), flush=True)
    save_json(args.json, report)
    return 0


if __name__ == "__main__":
    from flashpar.bench.launch import module_main

    module_main("flashpar bench cp", add_arguments, run, worker)
