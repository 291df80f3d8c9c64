"""One part of the check in a child process with a hard time limit: what it printed, how it ended.

The child runs in its own session; past its limit the whole process group is killed (SIGKILL: a
CUDA call that hangs does not answer SIGTERM), so the next part starts on time.  The child writes its
result as JSON to ``result_path``; a child that crashes or is killed leaves the tail of its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

TAIL_CHARS = 4000  # of a part's output, kept in the report (the whole output goes to gpu-check.log)


@dataclass
class Outcome:
    """How one part ended: ``status`` is ``passed``, ``failed``, ``skipped``, ``timeout`` or ``error``
    (it crashed or wrote no result)."""

    name: str
    status: str
    wall_s: float
    limit_s: float
    result: dict = field(default_factory=dict)
    output: str = ""
    error: str | None = None

    @property
    def tail(self) -> str:
        return self.output[-TAIL_CHARS:]

    def row(self) -> dict:
        return {"name": self.name, "status": self.status, "wall_s": round(self.wall_s, 2), "limit_s": self.limit_s,
                "error": self.error, "result": self.result, "tail": self.tail}


def run_child(name: str, cmd: list[str], limit_s: float, result_path: Path | None, *, env: dict | None = None,
              cwd: str | os.PathLike | None = None) -> Outcome:
    """Run ``cmd`` for at most ``limit_s`` seconds; read its JSON result from ``result_path`` (if given).

    The status is the result's ``status`` when the child wrote one; else ``error`` (its exit status), or
    ``timeout`` when it ran past its limit.  A child may write ``{"status": "partial", ...}`` as it goes: a
    child killed or dead after that keeps those rows in its outcome."""
    if result_path is not None:
        Path(result_path).unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True, text=True, errors="replace")
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        output, _ = proc.communicate()
    wall = time.perf_counter() - t0
    result = _read(result_path)
    if timed_out:
        return Outcome(name, "timeout", wall, limit_s, result or {}, output,
                       f"killed after its {limit_s:.0f} s limit")
    if result_path is None:  # a command with no result file (pytest, flashpar train): its exit status
        return Outcome(name, "passed" if proc.returncode == 0 else "failed", wall, limit_s, {"rc": proc.returncode},
                       output, None if proc.returncode == 0 else f"exit status {proc.returncode}" + _last_line(output))
    if result is None:
        return Outcome(name, "error", wall, limit_s, {}, output,
                       f"exit status {proc.returncode} and no result" + _last_line(output))
    if result.get("status") == "partial":  # it died between rows: what it measured stays
        return Outcome(name, "error", wall, limit_s, result, output,
                       f"exit status {proc.returncode} after a partial result" + _last_line(output))
    return Outcome(name, result.get("status", "error"), wall, limit_s, result, output, result.get("error"))


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the child leads its own session: its group is its own
        os.killpg(proc.pid, signal.SIGKILL)


def _read(path: Path | None) -> dict | None:
    if path is None or not Path(path).is_file():
        return None
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return f": {lines[-1].strip()[:300]}" if lines else ""
