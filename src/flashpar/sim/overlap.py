"""``flashpar simulate overlap``: not built yet (issue 14)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write {\"setup\": ..., \"rows\": [...]} to this file")


def run(args: argparse.Namespace) -> int:
    print("flashpar simulate overlap: not built yet", file=sys.stderr)
    return 2
