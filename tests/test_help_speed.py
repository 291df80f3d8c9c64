"""``flashpar <command> --help`` builds that command's flags without importing torch (torch alone takes about a
second to import): each command's parser is built, and its help written, in a fresh interpreter that then says
whether ``torch`` is in ``sys.modules``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashpar import cli
from flashpar.sim.cli import SUBCOMMANDS

SRC = Path(__file__).resolve().parent.parent / "src"

COMMANDS = ([[name] for name in cli.COMMANDS]
            + [["simulate", name] for name in SUBCOMMANDS]
            + [["bench", name] for name in cli.BENCH])

PROBE = """
import contextlib, io, sys
from flashpar import cli
argv = sys.argv[1:]
parser, module = cli.parser_for(argv)
assert module is not None, argv
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    parser.parse_args(argv + ["--help"])
assert out.getvalue().startswith("usage: flashpar " + " ".join(argv)), out.getvalue()[:200]
print("torch" in sys.modules)
"""


def test_every_command_is_probed():
    assert len(COMMANDS) == len(cli.COMMANDS) + len(SUBCOMMANDS) + len(cli.BENCH)
    assert ["train"] in COMMANDS and ["generate"] in COMMANDS
    assert ["simulate", "cp"] in COMMANDS and ["bench", "prefill"] in COMMANDS


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_help_of_a_command_does_not_import_torch(argv):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", f"flashpar {' '.join(argv)} --help imported torch"
