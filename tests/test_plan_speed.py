"""The planner's speed-ups change no plan: every strategy's plan on a few packs (shipped lists, short documents,
attention work alone) equals the one frozen in ``tests/data/frozen_plans.json``, written by the planner before
its speed-ups (``python tests/test_plan_speed.py --write`` rewrites it: only for a deliberate change of plans).

Compared: every rank's pieces and the plan's statistics (less its timing; its per-rank K/V bytes sent and
received come from the receive lists)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flashpar.cp import CostModel, plan
from flashpar.cp.lengths import resolve_lengths

FROZEN = Path(__file__).parent / "data" / "frozen_plans.json"
STRATEGIES = ("flashcp", "whole_doc")


def short_docs(tokens: int, docs: int) -> list[int]:
    """Exactly ``docs`` documents adding up to ``tokens``: spamassassin's lengths (cycled) scaled to fit."""
    src = resolve_lengths("spamassassin").values
    raw = [src[i % len(src)] for i in range(docs)]
    lens = [max(1, v * tokens // sum(raw)) for v in raw]
    rest, i = tokens - sum(lens), 0
    order = sorted(range(docs), key=lambda d: -lens[d])
    while rest:
        d = order[i % docs]
        step = 1 if rest > 0 else -(lens[d] > 1)
        lens[d] += step
        rest -= step
        i += 1
    return lens


def cases() -> dict[str, tuple[list[int], int, bool]]:
    """name -> (document lengths, ranks, linear work)."""
    out = {}
    for name in ("wlbllm", "prolong", "spamassassin", "sotu"):
        out[f"{name}-128K-8"] = (resolve_lengths(name).packs(131072, 1)[0], 8, True)
    out["prolong-512K-32"] = (resolve_lengths("prolong").packs(524288, 1)[0], 32, True)
    out["long-context-512K-32"] = (resolve_lengths("long-context").packs(524288, 1, seed=1)[0], 32, True)
    out["short300-128K-8"] = (short_docs(131072, 300), 8, True)
    out["short600-512K-32"] = (short_docs(524288, 600), 32, True)
    out["magi-64K-8-attention"] = (resolve_lengths("magi").packs(65536, 1, seed=0)[0], 8, False)
    out["magi-capped-64K-8-attention"] = (resolve_lengths("magi").packs(65536, 1, seed=0, cap=16384)[0], 8, False)
    return out


def summary(doc_lens: list[int], n: int, linear: bool, strategy: str) -> dict:
    p = plan(doc_lens, n, strategy=strategy, cost=CostModel(linear=linear))
    stats = p.stats()
    stats.pop("planning_s")
    return {"segments": [[list(s) for s in segs] for segs in p.segments], "stats": stats}


def frozen() -> dict:
    return json.loads(FROZEN.read_text())


@pytest.mark.parametrize("name", list(cases()))
def test_plans_equal_the_frozen_ones(name):
    doc_lens, n, linear = cases()[name]
    want = frozen()[name]
    assert want["doc_lens"] == doc_lens, "the pack itself changed"
    for strategy in STRATEGIES:
        got = json.loads(json.dumps(summary(doc_lens, n, linear, strategy)))  # tuples as lists, floats as JSON
        assert got == want[strategy], f"{name}: {strategy} plan differs from the frozen one"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    out = {}
    for name, (doc_lens, n, linear) in cases().items():
        out[name] = {"doc_lens": doc_lens, **{s: summary(doc_lens, n, linear, s) for s in STRATEGIES}}
        print(name, len(doc_lens), flush=True)
    FROZEN.write_text(json.dumps(out, separators=(",", ":")))
    print(FROZEN, FROZEN.stat().st_size)
