"""The ``flashpar`` command itself: --version, --help without torch, one-line flag errors, the mesh hint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashpar
from flashpar.cli import BENCH, COMMANDS, main

SRC = str(Path(__file__).parent.parent / "src")


def _run(*code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", "\n".join(code)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_version(capsys):
    with pytest.raises(SystemExit) as end:
        main(["--version"])
    assert end.value.code == 0 and capsys.readouterr().out.strip() == f"flashpar {flashpar.__version__}"


def test_help_imports_no_command_and_no_torch():
    """In a fresh interpreter: ``flashpar --help`` lists every command and imports neither torch nor any command
    module (what makes it start in a fraction of a second)."""
    proc = _run("import sys",
                "from flashpar.cli import main",
                "try:",
                "    main(['--help'])",
                "except SystemExit:",
                "    pass",
                "mods = [m for m in sys.modules if m == 'torch' or m.startswith(('flashpar.train', 'flashpar.bench', "
                "'flashpar.cp', 'flashpar.sim', 'numpy'))]",
                "print('IMPORTED', mods)")
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED []" in proc.stdout, proc.stdout[-2000:]
    assert all(name in proc.stdout for name in [*COMMANDS, "bench"]), proc.stdout


def test_bench_help_lists_its_benchmarks(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in BENCH), out


@pytest.mark.parametrize("argv, words", [
    (["train", "--strategy", "ring_attention"], "flashpar train: error: argument --strategy: invalid choice: "
                                                "'ring_attention'"),
    (["train", "--steps", "many"], "flashpar train: error: argument --steps: invalid int value: 'many'"),
    (["bogus"], "flashpar: error: argument command: invalid choice: 'bogus'"),
    (["bench"], "flashpar bench: error: the following arguments are required: bench"),
])
def test_flag_errors_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as end:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert end.value.code == 2 and err.startswith(words) and len(err.splitlines()) == 1, err
    assert err.endswith("--help)") and "usage" not in err, err


def test_mesh_error_names_the_nproc_that_fits(capsys):
    assert main(["train", "--nproc", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run it with --nproc 4" in err and "product is 3" in err, err


@pytest.mark.parametrize(("argv", "nproc"), [([], 4), (["--tp", "2", "--cp", "3"], 6),
                                             (["--dp", "2", "--cp", "3", "--tp", "1"], 6),
                                             (["--cp", "2", "--ulysses", "2", "--tp", "1"], 4),
                                             (["--nproc", "6", "--tp", "2", "--cp", "3"], 6)])
def test_the_process_count_is_the_mesh_size_unless_given(argv, nproc):
    from flashpar.cli import parser_for
    from flashpar.train.config import from_args

    parser, _ = parser_for(["train"])
    assert from_args(parser.parse_args(["train", *argv])).nproc == nproc


def test_ctrl_c_before_the_ranks_start_is_one_line(monkeypatch, capsys):
    """Interrupted while the launcher checks or tokenizes the data (before any rank): one line, status 130."""
    from flashpar.train import run as train_run

    def interrupted(config, hooks=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_run, "launch", interrupted)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--steps", "1"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "flashpar train: interrupted before the first step (while checking the run's data)", err
