"""``make soak`` (``python -m flashpar.train.soak``): the default job for 2,000 steps, watched for leaks.

Every rank samples itself before step 1 and every ``--every`` steps (a ``Hooks.before_step``: no change to
the training loop, nothing on the step's critical path but a few ``/proc`` reads):

    rss_kb     resident set (``VmRSS`` of /proc/self/status)
    threads    OS threads of the process (``Threads``: Python's, torch's pools, gloo's)
    fds        open file descriptors (/proc/self/fd): sockets, pipes, files
    groups     process groups torch.distributed knows (its ``pg_map``; a leaked sub-group shows here)
    children   child processes (data-loader workers)

one JSON line per sample in ``<out>/soak/rank<r>.jsonl``.  After the run, per rank, against the first
sample at or after ``--warmup`` steps (the allocator, the plan caches and the loader's queue are full by
then):

    rss growth = rss_kb(last) / rss_kb(baseline) - 1           must be < 5%
    threads, fds, groups, children at the last sample          must equal the baseline's

The verdict and every rank's figures go to ``<out>/soak/soak.json`` and the table; exit status 0 when every
rank passes, 1 when one does not (or the job failed), 2 on bad flags.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

RSS_GROWTH_LIMIT = 0.05
COUNTS = ("threads", "fds", "groups", "children")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _groups() -> int:
    try:
        from torch.distributed import distributed_c10d

        return len(distributed_c10d._world.pg_map)  # private, but the only census of live groups
    except (ImportError, AttributeError):
        return -1


def _children() -> int:
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                n += len(f.read().split())
        except OSError:
            continue
    return n


def sample(step: int) -> dict:
    """This process's figures now."""
    return {"step": step, "rss_kb": _status("VmRSS"), "threads": _status("Threads"),
            "fds": len(os.listdir("/proc/self/fd")), "groups": _groups(), "children": _children()}


def record(folder: str, every: int, step: int) -> None:
    """``Hooks.before_step``: append this rank's sample at step 1 and every ``every`` steps."""
    if step != 1 and step % every:
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(Path(folder) / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(sample(step)) + "\n")


def verdict(samples: list[dict], warmup: int) -> dict:
    """One rank's figures: baseline (first sample at or after ``warmup``), last sample, growth, pass."""
    if not samples:
        return {"ok": False, "why": "no samples"}
    after = [s for s in samples if s["step"] >= warmup]
    if len(after) < 2:
        return {"ok": False, "why": f"fewer than 2 samples after the {warmup}-step warm-up"}
    base, last = after[0], after[-1]
    growth = last["rss_kb"] / base["rss_kb"] - 1.0
    leaks = [k for k in COUNTS if last[k] != base[k]]
    peak = max(s["rss_kb"] for s in after)
    why = [f"resident set grew {growth:.1%} (limit {RSS_GROWTH_LIMIT:.0%})"] if growth >= RSS_GROWTH_LIMIT else []
    why += [f"{k} {base[k]} -> {last[k]}" for k in leaks]
    return {"ok": not why, "why": "; ".join(why), "from_step": base["step"], "to_step": last["step"],
            "rss_mb_base": base["rss_kb"] / 1024, "rss_mb_last": last["rss_kb"] / 1024, "rss_mb_peak": peak / 1024,
            "rss_growth": growth, **{k: [base[k], last[k]] for k in COUNTS}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=2000, help="steps of the default job (default %(default)s)")
    p.add_argument("--every", type=int, default=50, help="sample every K steps (default %(default)s)")
    p.add_argument("--warmup", type=int, default=200, help="steps before the baseline sample (default %(default)s)")
    p.add_argument("--out", default="runs/soak", help="the run's folder (default %(default)s)")


def run(args: argparse.Namespace, train_flags: list[str]) -> int:
    from flashpar.train import run as train_run
    from flashpar.train.config import add_arguments as train_arguments
    from flashpar.train.config import from_args
    from flashpar.train.loop import Hooks

    for name in ("steps", "every", "warmup"):
        if getattr(args, name) < 1:
            print(f"flashpar soak: --{name} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.warmup + 2 * args.every > args.steps:
        print(f"flashpar soak: --steps {args.steps} leaves fewer than 2 samples after --warmup {args.warmup} "
              f"(every {args.every})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="flashpar soak")
    train_arguments(parser)
    try:
        config = from_args(parser.parse_args([*train_flags, "--steps", str(args.steps), "--out", args.out]))
    except (ValueError, FileNotFoundError) as err:
        print(f"flashpar soak: {err}", file=sys.stderr)
        return 2
    folder = Path(args.out) / "soak"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("rank*.jsonl"):
        old.unlink()
    rc = train_run.launch(config, Hooks(before_step=functools.partial(record, str(folder), args.every)))
    if rc == 2:  # bad settings: train said why in one line, before any rank started
        return 2
    ranks = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        ranks[path.stem] = verdict(samples, args.warmup)
    ok = rc == 0 and bool(ranks) and all(v["ok"] for v in ranks.values())
    report = {"steps": args.steps, "every": args.every, "warmup": args.warmup, "train_rc": rc, "ok": ok,
              "rss_growth_limit": RSS_GROWTH_LIMIT, "ranks": ranks}
    (folder / "soak.json").write_text(json.dumps(report, indent=1))
    print(format_report(report))
    print(f"soak: {'PASS' if ok else 'FAIL'} ({folder / 'soak.json'})")
    return 0 if ok else 1


def format_report(report: dict) -> str:
    lines = [f"soak: {report['steps']} steps, sampled every {report['every']}, baseline after {report['warmup']}",
             f"{'rank':<7}{'steps':>12}{'RSS MB':>16}{'growth':>8}{'peak MB':>9}  threads  fds  groups  children"]
    for name, v in report["ranks"].items():
        if "rss_growth" not in v:
            lines.append(f"{name:<7}  {v['why']}")
            continue
        counts = "  ".join(f"{v[k][0]}->{v[k][1]}" for k in COUNTS)
        lines.append(f"{name:<7}{v['from_step']:>5}-{v['to_step']:<6}{v['rss_mb_base']:>7.1f}->{v['rss_mb_last']:<7.1f}"
                     f"{v['rss_growth']:>+8.1%}{v['rss_mb_peak']:>9.1f}  {counts}" + (f"  FAIL: {v['why']}" if v["why"]
                                                                                     else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashpar.train.soak",
                                description="the default job for many steps, watched for memory, thread, fd and "
                                            "process-group leaks; other flags go to `flashpar train`")
    add_arguments(p)
    args, train_flags = p.parse_known_args(argv)
    return run(args, train_flags)


if __name__ == "__main__":
    sys.exit(main())
