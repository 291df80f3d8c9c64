"""``flashpar simulate check BENCH.json``: every measured row of a benchmark, predicted from that file alone.

The file's kind is told by its keys (each benchmark writes its own layout):

    bench overlap   {"world_size", "hardware", "shapes": [...]}       -> flashpar.sim.check_overlap
    bench cp        {"world_size", "fwd_cost", "bwd_cost", "rows"}   -> flashpar.sim.check_cp
    bench train     {"setup", "configs": [...]}                      -> flashpar.sim.check_train

Each kind's ``check(report)`` returns one row per compared figure:

    {"row": what was measured, "figure": which ratio, "predicted", "measured",
     "error": predicted / measured - 1, "within": |error| <= TOLERANCE, "why": "" or the reason of a miss}

Only ratios are compared (overlapped / ideal, strategy / baseline, tokens/s ratios): they are what the
benchmarks claim, and they cancel the machine's absolute speed, which the calibration carries.
The exit status is 0 when the file could be read, whatever the misses (``--strict``: 1 on a miss
without an explanation), 2 when it could not.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from flashpar.sim.report import table, write_json

TOLERANCE = 0.15
"""The issue's target: every predicted ratio within 15% of the measured one."""

KINDS = {  # kind -> (module, keys that identify its report)
    "overlap": ("flashpar.sim.check_overlap", ("world_size", "hardware", "shapes")),
    "cp": ("flashpar.sim.check_cp", ("world_size", "fwd_cost", "bwd_cost", "rows")),
    "train": ("flashpar.sim.check_train", ("setup", "configs")),
}

COLUMNS = [("row", ""), ("figure", ""), ("predicted", ".3f"), ("measured", ".3f"), ("error", "+.1%"),
           ("within", ""), ("why", "")]


def kind_of(report) -> str:
    """The benchmark that wrote ``report`` (``ValueError`` naming the missing keys when none did).

    A list is one report per world size (``flashpar bench overlap --nproc 2,4`` writes one): all of one kind."""
    if isinstance(report, list) and report and all(isinstance(r, dict) for r in report):
        kinds = {kind_of(r) for r in report}
        if len(kinds) > 1:
            raise ValueError(f"a list of reports of different kinds {sorted(kinds)}")
        return kinds.pop()
    if not isinstance(report, dict):
        raise ValueError(f"not a benchmark report: a JSON {type(report).__name__}, expected an object")
    for kind, (_, keys) in KINDS.items():
        if all(k in report for k in keys):
            return kind
    expected = "; ".join(f"{kind}: {', '.join(keys)}" for kind, (_, keys) in KINDS.items())
    raise ValueError(f"not a `flashpar bench overlap|cp|train` report (keys {sorted(report)[:8]}; expected {expected})")


def finish(row: dict) -> dict:
    """``row`` with ``error`` and ``within`` filled from ``predicted`` and ``measured`` (``"exact": True``: a
    count, within only when equal)."""
    p, m = row["predicted"], row["measured"]
    err = p / m - 1.0 if m else (0.0 if p == m else float("inf"))
    ok = p == m if row.get("exact") else abs(err) <= TOLERANCE
    return {**row, "error": err, "within": "yes" if ok else "no", "why": row.get("why", "")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench_json", metavar="BENCH.json", help="the --json file of `flashpar bench overlap|cp|train`")
    p.add_argument("--strict", action="store_true", help="exit 1 when a row misses by more than 15%% unexplained")
    p.add_argument("--json", default=None, help="write {\"setup\": ..., \"rows\": [...]} to this file")


def run(args: argparse.Namespace) -> int:
    try:
        with open(args.bench_json) as f:
            text = f.read()
        try:
            report = json.loads(text)
        except ValueError as err:
            raise ValueError(f"not JSON ({err})") from None
        kind = kind_of(report)
        rows = [finish(r) for r in importlib.import_module(KINDS[kind][0]).check(report)]
    except (OSError, ValueError, KeyError, TypeError) as err:  # json.JSONDecodeError is a ValueError
        what = f"missing key {err}" if isinstance(err, KeyError) else str(err)
        print(f"flashpar simulate check: {args.bench_json}: {what}", file=sys.stderr)
        return 2
    misses = [r for r in rows if r["within"] == "no"]
    print(table(rows, COLUMNS, title=f"bench {kind}: {args.bench_json} (predicted from the file's calibration)"))
    print(f"{len(rows) - len(misses)} of {len(rows)} ratios within {TOLERANCE:.0%}"
          + (f"; {len(misses)} miss(es), {sum(1 for r in misses if not r['why'])} unexplained" if misses else ""))
    write_json(args.json, {"bench_json": args.bench_json, "kind": kind, "tolerance": TOLERANCE}, rows)
    return 1 if args.strict and any(not r["why"] for r in misses) else 0
