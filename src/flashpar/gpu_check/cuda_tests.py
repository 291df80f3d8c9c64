"""Part ``tests``: every CUDA-only test of the checkout (``@pytest.mark.cuda``), one pytest child.

The files are those of ``tests/`` that use the marker (found by their text, so pytest imports no
other test module); ``-m cuda`` selects the tests; the outcome of each comes from pytest's JUnit XML.
Without a GPU the tests skip themselves (``skipif``), which is what the CPU rehearsal reports.
Two verdicts sum up groups of tests by their ids: ``cuda_default``, the tests of the backend
``cp.attention`` runs by default on CUDA (``flashpar.cp.kernels.CUDA_DEFAULT_BACKEND``: torch's fused
SDPA kernels) against ``math`` and float64 (ids naming ``cuda_default``); ``varlen``, those of the
varlen FlashAttention-2 backend (ids naming ``varlen``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from flashpar.gpu_check.runner import Outcome, run_child

MARK = "pytest.mark.cuda"


def test_files(root: Path) -> list[Path]:
    tests = root / "tests"
    return sorted(p for p in tests.glob("test_*.py") if MARK in p.read_text(errors="replace")) if tests.is_dir() else []


def command(python: str, files: list[Path], xml: Path) -> list[str]:
    # -v: a line per test as it ends, so a run killed at its limit still shows which tests passed
    return [python, "-m", "pytest", *map(str, files), "-m", "cuda", "-v", "-rA", "-p", "no:cacheprovider",
            "-o", "addopts=", f"--junitxml={xml}", "--durations=10"]


def parse_junit(xml: Path) -> list[dict]:
    """``{"test", "outcome" (passed / failed / error / skipped), "seconds", "message"}`` per test case."""
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or node.text or "").strip()[:2000]
                break
        module = case.get("classname", "").rsplit(".", 1)[-1]
        rows.append({"test": f"{module}::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time") or 0.0), "message": message})
    return rows


VERDICTS = ("cuda_default", "varlen")  # the report's verdicts: the tests whose ids hold the name


def verdict(rows: list[dict], name: str) -> dict:
    """Of the tests whose ids hold ``name``: ``passed`` True (every one passed), False (one failed), None (none ran:
    skipped or absent)."""
    mine = [r for r in rows if name in r["test"]]
    ran = [r for r in mine if r["outcome"] != "skipped"]
    if not ran:
        why = "skipped: " + mine[0]["message"] if mine else f"no {name} test was collected"
        return {"passed": None, "tests": len(mine), "detail": why}
    bad = [r["test"] for r in ran if r["outcome"] != "passed"]
    return {"passed": not bad, "tests": len(ran), "detail": ("failed: " + ", ".join(bad)) if bad else "all passed"}


def verdicts(rows: list[dict]) -> dict:
    return {name: verdict(rows, name) for name in VERDICTS}


def run(part, ctx) -> Outcome:
    files = test_files(ctx.root)
    if not files:
        return Outcome(part.name, "skipped", 0.0, part.limit_s, {"tests": [], **verdicts([])}, "",
                       f"no test file under {ctx.root / 'tests'} uses {MARK} (run from a checkout)")
    xml = ctx.work / "cuda-tests.xml"
    xml.unlink(missing_ok=True)
    cmd = command(ctx.python, files, xml)
    got = _in_process(part, cmd[3:]) if ctx.in_process else run_child(part.name, cmd, part.limit_s, None,
                                                                         env=ctx.env(), cwd=ctx.root)
    rows = parse_junit(xml) if xml.is_file() else []
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    got.result = {"files": [str(f.relative_to(ctx.root)) for f in files], "tests": rows, "counts": counts,
                  **verdicts(rows), "rc": got.result.get("rc")}
    if got.status != "timeout" and rows:
        got.status = ("failed" if counts["failed"] or counts["error"] else
                      "skipped" if counts["skipped"] == len(rows) else "passed")
        got.error = None if got.status != "failed" else f"{counts['failed'] + counts['error']} of {len(rows)} failed"
    elif got.status != "timeout":
        got.status = "error"
        got.error = got.error or "pytest wrote no test report"
    return got


def _in_process(part, args: list[str]) -> Outcome:
    """``pytest.main(args)`` in this process (the CPU rehearsal: the test modules are already imported there)."""
    import contextlib
    import io
    import time

    import pytest

    printed, t0 = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(printed):
        rc = int(pytest.main(args))
    return Outcome(part.name, "passed" if rc == 0 else "failed", time.perf_counter() - t0, part.limit_s, {"rc": rc},
                   printed.getvalue(), None if rc == 0 else f"exit status {rc}")
