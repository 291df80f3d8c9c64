"""``flashpar`` command line: ``flashpar train ...``, ``flashpar export ...``, ``flashpar bench
overlap|cp|plan|train ...``, ``flashpar plan ...``, ``flashpar simulate overlap|cp|train|check ...``.

Only the module of the command given is imported (``COMMANDS``: its ``add_arguments`` and ``run``), so
``flashpar --help`` and ``flashpar --version`` import neither torch nor any command.  A bad flag or value
is one line (``prog: error: ...`` and where to look), not the usage followed by the error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {  # command -> (module with add_arguments and run, help); bench: its own table
    "train": ("flashpar.train.run", "train the Llama-style model with TP-SP + CP + DP on real packed documents"),
    "export": ("flashpar.train.export", "a training checkpoint as a Hugging Face Llama folder"),
    "plan": ("flashpar.cp.cli", "plan context parallelism for packed documents, every strategy side by side"),
    "simulate": ("flashpar.sim.cli", "cluster-scale predictions from the runtime's own schedules and plans"),
    "generate": ("flashpar.generate_command", "prefill and decode prompts over a (tp, cp) mesh"),
}
BENCH_HELP = "benchmarks that compare alternatives side by side"
BENCH = {
    "overlap": ("flashpar.bench.overlap", "all overlap modes of all_gather_matmul / matmul_reduce_scatter"),
    "cp": ("flashpar.bench.cp", "every context-parallel strategy side by side, forward and backward"),
    "train": ("flashpar.bench.train", "the trainer (flashpar, baseline) and torch's own stack side by side"),
    "plan": ("flashpar.bench.plan_targets", "the FlashCP planner against its targets on real document lengths"),
    "prefill": ("flashpar.bench.prefill", "inference: flashpar, baseline and torch prefill"),
    "drill": ("flashpar.bench.drill", "a multi-node failure drill: namespaces as nodes, torchrun restarts, ranks "
                                      "killed and stopped"),
}


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: the problem and where the flags are listed."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _words(argv: list[str]) -> list[str]:
    """The words of ``argv`` before its first option: the command and the bench subcommand."""
    words = []
    for arg in argv:
        if arg.startswith("-"):
            break
        words.append(arg)
    return words


def parser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    """The parser, with the flags of the command named in ``argv`` only; the module that runs it (or None)."""
    from flashpar import __version__

    parser = OneLineParser(prog="flashpar",
                           description="flashpar: overlapped parallelism and context-parallel planning")
    parser.add_argument("--version", action="version", version=f"flashpar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    words, chosen = _words(argv), None
    for name, (module, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if words[:1] == [name]:
            chosen = module
            importlib.import_module(module).add_arguments(p)
    bench = sub.add_parser("bench", help=BENCH_HELP)
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, text) in BENCH.items():
        p = bench_sub.add_parser(name, help=text)
        if words[:2] == ["bench", name]:
            chosen = module
            importlib.import_module(module).add_arguments(p)
    return parser, chosen


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # the command's module (torch, for most) is imported here: a Ctrl-C meanwhile is one line, not a traceback
        parser, module = parser_for(argv)
        args = parser.parse_args(argv)
        if module is None:  # a command name argparse accepted that the tables do not hold: cannot happen
            parser.error("unknown command")
        command = importlib.import_module(module)
    except KeyboardInterrupt:
        from flashpar.train.interrupt import EXIT_STATUS

        words = _words(argv)
        name = " ".join(["flashpar", *words[:2 if words[:1] in (["bench"], ["simulate"]) else 1]])
        print(f"\n{name}: interrupted during start-up", file=sys.stderr)
        return EXIT_STATUS
    return command.run(args)


if __name__ == "__main__":
    sys.exit(main())
