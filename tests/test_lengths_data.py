"""The length lists ship with the package: every name resolves, from an installed copy outside the repository
too; ``--lengths`` is a name or a path in every command, and a bad one is one line before any work starts."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpar.cp.lengths import DISTRIBUTIONS, LISTS, NAMES, Packing, pack, resolve_lengths

ROOT = Path(__file__).resolve().parents[1]
# documents per shipped list, as src/flashpar/data/SOURCES.md states them
DOCUMENTS = {"wlbllm": 99_519, "prolong": 77_932, "python311_stdlib": 1_762, "spamassassin": 6_046, "sotu": 233}


def test_every_shipped_name_resolves_to_its_documented_data():
    assert set(DOCUMENTS) == set(LISTS) and NAMES == LISTS + DISTRIBUTIONS
    for name in LISTS:
        src = resolve_lengths(name)
        assert not src.sampled and len(src.values) == DOCUMENTS[name] and min(src.values) > 0, name
        assert src.packs(8192, 3) == pack(src.values, 8192)[:3]
    for name in DISTRIBUTIONS:
        src = resolve_lengths(name)
        packs = src.packs(65536, 3, seed=1)
        assert src.sampled and len(packs) == 3 and all(sum(p) == 65536 for p in packs), name
        assert packs == src.packs(65536, 3, seed=1) != src.packs(65536, 3, seed=2)  # seeded, deterministic
        with pytest.raises(ValueError, match="sampled distribution: give a number of packs"):
            src.packs(65536)
    capped = resolve_lengths("magi").packs(65536, 2, cap=1000, scale=10)
    assert max(max(p) for p in capped) <= 100  # capped, then divided


def test_paths_resolve_and_bad_names_list_the_names(tmp_path):
    (tmp_path / "a.txt").write_text("3\n5\n7\n")
    (tmp_path / "h.csv").write_text('range,number\n"[0, 10]",5\n"[11, 20]",1\n')
    assert resolve_lengths(tmp_path / "a.txt").values == (3, 5, 7)
    assert resolve_lengths(str(tmp_path / "h.csv")).buckets == ((1, 10, 5.0), (11, 20, 1.0))
    for bad in ("nope", "wlbllm.lengths", str(tmp_path / "missing.txt")):
        with pytest.raises(ValueError, match=r"expected a shipped name \(wlbllm, prolong, .*long-context\)"):
            resolve_lengths(bad)


def test_packing_cuts_the_stream_and_skips_empty_documents():
    p = Packing([5, 0, 7, 2, 9], 6)
    assert len(p) == 3 and p.starts == [0, 5, 5, 12, 14] and p.total == 23
    assert [p.pieces(i) for i in range(3)] == [[(0, 5, True), (2, 1, False)], [(2, 6, True)],
                                              [(3, 2, True), (4, 4, False)]]
    with pytest.raises(IndexError, match="out of range"):
        p.pieces(3)
    with pytest.raises(ValueError, match=">= 0"):
        Packing([3, -1], 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=20), st.integers(1, 25))
def test_packing_equals_cutting_the_token_stream_brute_force(lengths, tokens):
    stream = [d for d, n in enumerate(lengths) for _ in range(n)]  # the document id of every stream position
    p = Packing(lengths, tokens)
    assert len(p) == len(stream) // tokens
    for i in range(len(p)):
        window = stream[i * tokens: (i + 1) * tokens]
        runs = [(d, len(list(g))) for d, g in itertools.groupby(window)]
        last = (i + 1) * tokens - 1
        ends = [True] * (len(runs) - 1) + [last + 1 == len(stream) or stream[last + 1] != window[-1]]
        assert p.pieces(i) == [(d, n, e) for (d, n), e in zip(runs, ends, strict=True)]
    assert pack(lengths, tokens) == [p.doc_lens(i) for i in range(len(p))]


def test_installed_package_outside_the_repository_loads_every_list(tmp_path):
    """Build and install flashpar into a folder (pip, no deps), then import it from elsewhere: no repository,
    no shared/ beside it, no environment variables; every name loads and ``flashpar plan`` runs."""
    pytest.importorskip("setuptools")
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, tree / f)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(tree)], check=True, capture_output=True, timeout=300)
    shutil.rmtree(tree)
    script = textwrap.dedent(f"""
        import flashpar, sys
        assert flashpar.__file__.startswith({str(site)!r}), flashpar.__file__
        from flashpar.cp.lengths import NAMES, resolve_lengths
        for name in NAMES:
            assert resolve_lengths(name).packs(4096, 1), name
        from flashpar.cli import main
        sys.exit(main(["plan", "--lengths", "sotu", "--cp", "2", "--tokens", "65536", "--packs", "1"]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    run = tmp_path / "elsewhere"
    run.mkdir()
    res = subprocess.run([sys.executable, "-c", script], cwd=run, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "== sotu: 1 pack(s) of 65536 tokens" in res.stdout and "flashcp" in res.stdout


def test_bench_plan_lists_take_names_or_files_and_reject_bad_ones(capsys):
    from flashpar.cli import main

    assert main(["bench", "plan", "--lists", "sotu,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashpar bench plan: unknown lengths 'nope'") and len(err.splitlines()) == 1, err
    assert main(["bench", "plan", "--packs", "0"]) == 2
    assert "--packs must be >= 1, got 0" in capsys.readouterr().err
