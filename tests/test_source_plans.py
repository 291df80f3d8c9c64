"""Plans of packs of many short source files equal the frozen ones in ``tests/data/source_plans.json``, at rank
counts from 8 to 1,024: each rank count takes a different mix of the planner's steps (its search grid, the
Whole-Doc step from a heap or from the ranked order, groups and unequal fills over a few ranks or many), and every
one of them must give the plan the file holds, to the bit.

The packs are the Python standard library's source files (``flashpar.corpus``): scaled to a given number of
documents (:func:`flashpar.bench.plan_targets.source_docs`), and the files at their own lengths packed in order
(``flashpar.cp.lengths.pack``, as ``tests/test_cp_plan.py`` packs them).  Their lengths are stored with the plans
(the standard library differs between Python versions), so the test plans the stored lengths.

Compared per strategy: the plan's scalar statistics (less its timing), and a SHA-256 digest of every rank's pieces
and per-rank statistics (which keeps the file small).
``python tests/test_source_plans.py --write`` rewrites the file: only for a deliberate change of plans."""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path

import pytest

from flashpar.cp import CostModel, plan

FROZEN = Path(__file__).parent / "data" / "source_plans.json"
STRATEGIES = ("flashcp", "whole_doc")
CASES = {  # name -> (how the pack is made: documents or None for the files at their own lengths, tokens, N, linear)
    "src100-128K-8": (100, 131072, 8, True),
    "src450-128K-8": (450, 131072, 8, True),
    "src450-128K-8-attention": (450, 131072, 8, False),
    "src2059-512K-32": (2059, 524288, 32, True),
    "src1000-1M-64": (1000, 1 << 20, 64, True),
    "src2000-2M-128": (2000, 1 << 21, 128, True),
    "src2000-512K-256": (2000, 524288, 256, True),
    "src4359-8M-1024": (4359, 8 << 20, 1024, True),
    "files-2M-16": (None, 1 << 21, 16, True),
    "files-8M-1024": (None, 8 << 20, 1024, True),
}


def make_pack(docs: int | None, tokens: int) -> list[int]:
    """The pack of a case from the running interpreter's standard library (for ``--write``)."""
    from flashpar.bench.plan_targets import source_docs
    from flashpar.corpus import document_lengths
    from flashpar.cp.lengths import pack

    return source_docs(tokens, docs) if docs is not None else pack(document_lengths(), tokens, 1)[0]


def summary(doc_lens: list[int], n: int, linear: bool, strategy: str) -> dict:
    """The plan's scalar statistics (less its timing) and a digest of its pieces and per-rank statistics, as JSON
    writes them."""
    p = plan(doc_lens, n, strategy=strategy, cost=CostModel(linear=linear))
    stats = p.stats()
    stats.pop("planning_s")
    per_rank = {k: v for k, v in stats.items() if isinstance(v, list)}
    whole = json.dumps([[[list(s) for s in segs] for segs in p.segments], per_rank], separators=(",", ":"))
    out = {"pieces": sum(map(len, p.segments)), "digest": hashlib.sha256(whole.encode()).hexdigest(),
           "stats": {k: v for k, v in stats.items() if k not in per_rank}}
    return json.loads(json.dumps(out))  # (tuples as lists, floats as JSON)


@functools.lru_cache(maxsize=1)
def frozen() -> dict:
    return json.loads(FROZEN.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_source_file_plans_equal_the_frozen_ones(name):
    _, tokens, n, linear = CASES[name]
    want = frozen()[name]
    doc_lens = want["doc_lens"]
    assert sum(doc_lens) == tokens and len(doc_lens) > 1
    for strategy in STRATEGIES:
        got = summary(doc_lens, n, linear, strategy)
        assert got["stats"] == want[strategy]["stats"], f"{name}: {strategy} statistics differ from the frozen ones"
        assert got == want[strategy], f"{name}: {strategy} pieces or per-rank statistics differ from the frozen ones"


def test_the_frozen_file_holds_every_case_and_the_packs_are_many_short_documents():
    """Every case is frozen, as made (documents, tokens), and the scaled packs hold many short documents with a long
    tail (the kind of pack the file is for)."""
    assert set(frozen()) == set(CASES)
    for name, (docs, tokens, _, _) in CASES.items():
        lens = frozen()[name]["doc_lens"]
        assert sum(lens) == tokens
        if docs is not None:
            assert len(lens) == docs and sorted(lens)[docs // 2] * 20 < max(lens), name


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    out = {}
    for name, (docs, tokens, n, linear) in CASES.items():
        doc_lens = make_pack(docs, tokens)
        out[name] = {"doc_lens": doc_lens, **{s: summary(doc_lens, n, linear, s) for s in STRATEGIES}}
        print(name, len(doc_lens), out[name]["flashcp"]["pieces"], flush=True)
    FROZEN.write_text(json.dumps(out, separators=(",", ":")))
    print(FROZEN, FROZEN.stat().st_size)
