"""``flashpar simulate overlap|cp|train|table|anchors|prefill|collective|check``: each subcommand's arguments and
run live in its module."""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS = {
    "overlap": ("flashpar.sim.overlap", "an op, an MLP or an attention block: time per overlap mode, exposed comm"),
    "cp": ("flashpar.sim.cp", "every context-parallel strategy's plan at 8 to 1,024 ranks, 128K to 8M tokens"),
    "train": ("flashpar.sim.train", "one Llama training step on a (dp, cp, ulysses, tp) layout; fastest layouts"),
    "table": ("flashpar.sim.table", "simulate train --search over (model, GPUs, seq): one markdown row each"),
    "anchors": ("flashpar.sim.anchors", "published torchtitan H100 runs against the simulator (h100-96gb)"),
    "prefill": ("flashpar.sim.prefill", "time to first token of a packed prefill, Llama 3 70B / 405B on H100 nodes"),
    "collective": ("flashpar.sim.collective", "one NCCL collective as its tuner times it: latency, bandwidth, pick"),
    "check": ("flashpar.sim.check", "a `flashpar bench overlap|cp|train` JSON: every row predicted vs measured"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="simulate", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_text))


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(SUBCOMMANDS[args.simulate][0]).run(args)
