"""``flashpar.bench.compile_time``: torch.compile's seconds and compilations so far, read without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_reading_before_any_compile_imports_no_torch():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from flashpar.bench.compile_time import compile_seconds, "
            "compiles; print(compile_seconds(), compiles(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, SRC], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.0", "0", "False"]


def test_a_compiled_function_adds_its_compile_time_once():
    """The first call compiles (time and one compilation counted); the second reuses the graph (nothing added);
    another input's dtype recompiles (one more)."""
    import torch

    from flashpar.bench.compile_time import compile_seconds, compiles

    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    s0, k0 = compile_seconds(), compiles()
    f(torch.ones(3))
    s1, k1 = compile_seconds(), compiles()
    assert s1 > s0 and k1 == k0 + 1
    f(torch.ones(3))
    assert (compile_seconds(), compiles()) == (s1, k1)
    f(torch.ones(3, dtype=torch.float64))
    assert compiles() == k1 + 1
