"""``flashpar train`` starting and stopping: its first line comes before any slow work; a Ctrl-C while it starts is
one line and exit status 130, with no traceback from any process and none of the job's processes left; a run
stopped or completed prints no warning from multiprocessing's resource tracker.

The launcher runs in its own session (``start_new_session``) so that SIGINT goes to its whole process group, as a
terminal's Ctrl-C does; the job's processes are those of that session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashpar import cli
from flashpar.train import where

SRC = Path(__file__).resolve().parent.parent / "src"
SMALL = ["--nproc", "2", "--tp", "1", "--cp", "2", "--seq-len", "128", "--max-docs", "40"]
RUN_WITHIN_S = 120  # a whole launcher run below, on 2 loaded cores (a few seconds when idle)


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (zombies, already dead, are not counted)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in "ZX":
            pids.append(int(entry))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _loading_torch(pid: int) -> bool:
    """Process ``pid`` has torch's libraries mapped: it is inside (or past) ``import torch``."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _train(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "flashpar.cli", "train", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _wait_for(what, launcher: subprocess.Popen, limit_s: float = RUN_WITHIN_S) -> None:
    deadline = time.monotonic() + limit_s
    while not what():
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the launcher never got there"
        time.sleep(0.02)


def _interrupt(launcher: subprocess.Popen) -> tuple[str, str]:
    """SIGINT to the launcher's process group; its output; then none of its session is left within 20 s."""
    os.killpg(launcher.pid, signal.SIGINT)
    try:
        out, err = launcher.communicate(timeout=RUN_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise
    deadline = time.monotonic() + 20
    while (left := _session(launcher.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # (not to leave them to the next test)
        os.kill(pid, signal.SIGKILL)
    assert not left, "left running: " + "; ".join(_cmdline(p)[:120] for p in left)
    return out, err


def test_the_first_line_comes_before_the_data_checks_and_the_ranks(monkeypatch, capsys):
    from flashpar.train import run

    seen = []
    monkeypatch.setattr(run, "launch", lambda config: seen.append(capsys.readouterr().out) or 0)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["train", "--steps", "3", "--out", "runs/x"]) == 0
    assert seen == ["flashpar train: 4 ranks (dp 1, cp 2, tp 2), --steps 3, out runs/x: checking the data, then "
                    "starting the ranks\n"], seen


@pytest.mark.parametrize("argv, name", [(["train", "--steps", "1"], "flashpar train"),
                                        (["bench", "cp", "--nproc", "2"], "flashpar bench cp"),
                                        (["simulate", "cp"], "flashpar simulate cp")])
def test_ctrl_c_while_the_command_is_imported_is_one_line(argv, name, monkeypatch, capsys):
    def interrupted(words):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "parser_for", interrupted)
    try:
        rc = cli.main(argv)
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt went through: a traceback")
    assert rc == 130
    assert capsys.readouterr().err.strip() == f"{name}: interrupted during start-up"


def test_ctrl_c_while_the_fork_server_imports_torch(tmp_path):
    """SIGINT while the fork server imports torch (a second or more): the launcher's one line, status 130, no
    traceback (the server's import is not interrupted), no process of the job left."""
    launcher = _train([*SMALL, "--workers", "0", "--steps", "1", "--out", str(tmp_path)])
    _wait_for(lambda: any("multiprocessing.forkserver" in _cmdline(p) and _loading_torch(p)
                          for p in _session(launcher.pid)), launcher)
    out, err = _interrupt(launcher)
    assert launcher.returncode == 130, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashpar train: interrupted before the first step"), err
    assert out.startswith("flashpar train: 2 ranks (dp 1, cp 2, tp 1)"), out


@pytest.fixture
def documents(tmp_path) -> Path:
    """Text files for --data: tokenized by a pool of spawned processes while the launcher checks the data."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(24):
        (folder / f"{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    return folder


def test_a_run_stopped_by_ctrl_c_prints_no_resource_tracker_warning(tmp_path, documents):
    """Its ranks, SIGKILLed, leave their data loaders' semaphores to the tracker, which removes them: one line,
    and no 'leaked semaphore' warning (the tracker ``--data``'s tokenizing pool would start unquieted)."""
    out = tmp_path / "run"
    launcher = _train([*SMALL, "--data", str(documents), "--workers", "1", "--steps", "500", "--out", str(out)])
    _wait_for(lambda: (where.read(out / ".where").get(0) or (0, 0))[1] >= 2, launcher)
    _, err = _interrupt(launcher)
    assert launcher.returncode == 130, err
    assert "leaked semaphore" not in err and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("flashpar train: interrupted at step "), err[-2000:]


def test_a_completed_run_prints_no_resource_tracker_warning(tmp_path, documents):
    launcher = _train([*SMALL, "--data", str(documents), "--workers", "1", "--steps", "2", "--out", str(tmp_path)])
    _, err = launcher.communicate(timeout=RUN_WITHIN_S)
    assert launcher.returncode == 0, err[-2000:]
    assert "leaked semaphore" not in err and "Warning" not in err, err[-2000:]
