"""How the planner carries out its steps changes no plan: every strategy's plan on a few packs (shipped lists, short
documents, attention work alone; 8 to 256 ranks) equals the one frozen in ``tests/data/frozen_plans.json``
(``python tests/test_plan_speed.py --write`` rewrites it: only for a deliberate change of plans).  Packs of many
short source files up to 1,024 ranks: ``tests/test_source_plans.py``.

Compared: every rank's pieces and the plan's statistics (less its timing; its per-rank K/V bytes sent and
received come from the receive lists)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from flashpar.bench.plan_targets import short_docs
from flashpar.cp import CostModel, plan
from flashpar.cp.lengths import resolve_lengths

FROZEN = Path(__file__).parent / "data" / "frozen_plans.json"
STRATEGIES = ("flashcp", "whole_doc")


@functools.lru_cache(maxsize=1)
def cases() -> dict[str, tuple[list[int], int, bool]]:
    """name -> (document lengths, ranks, linear work); built once (packing the lists costs more than planning)."""
    out = {}
    for name in ("wlbllm", "prolong", "spamassassin", "sotu"):
        out[f"{name}-128K-8"] = (resolve_lengths(name).packs(131072, 1)[0], 8, True)
    out["prolong-512K-32"] = (resolve_lengths("prolong").packs(524288, 1)[0], 32, True)
    out["long-context-512K-32"] = (resolve_lengths("long-context").packs(524288, 1, seed=1)[0], 32, True)
    out["short300-128K-8"] = (short_docs(131072, 300), 8, True)
    out["short600-512K-32"] = (short_docs(524288, 600), 32, True)
    out["wlbllm-1M-64"] = (resolve_lengths("wlbllm").packs(1 << 20, 1)[0], 64, True)
    out["prolong-2M-128"] = (resolve_lengths("prolong").packs(1 << 21, 1)[0], 128, True)
    out["short1500-512K-256"] = (short_docs(524288, 1500), 256, True)
    out["long-context-512K-256"] = (resolve_lengths("long-context").packs(524288, 1, seed=1)[0], 256, True)
    out["magi-64K-8-attention"] = (resolve_lengths("magi").packs(65536, 1, seed=0)[0], 8, False)
    out["magi-capped-64K-8-attention"] = (resolve_lengths("magi").packs(65536, 1, seed=0, cap=16384)[0], 8, False)
    return out


def summary(doc_lens: list[int], n: int, linear: bool, strategy: str) -> dict:
    p = plan(doc_lens, n, strategy=strategy, cost=CostModel(linear=linear))
    stats = p.stats()
    stats.pop("planning_s")
    return {"segments": [[list(s) for s in segs] for segs in p.segments], "stats": stats}


@functools.lru_cache(maxsize=1)
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


def test_bench_plan_scale_block(monkeypatch, capsys):
    """``bench plan --scale``'s block: one row per case against its target (the cases shrunk to two small packs),
    and ``short_docs`` packs exactly the documents asked for; a bad ``--scale-runs`` is one line."""
    from flashpar.bench import plan_targets
    from flashpar.cli import main

    lens = short_docs(4096, 700)
    assert len(lens) == 700 and sum(lens) == 4096 and min(lens) >= 1
    with pytest.raises(ValueError, match="holds 1 to 100 documents"):
        short_docs(100, 101)
    monkeypatch.setattr(plan_targets, "SCALE_TARGETS_MS", {(4096, 2): 1e5, (8192, 4): 0.0})
    monkeypatch.setattr(plan_targets, "scale_packs", lambda: [("short", lens, 4096, 2),
                                                              ("sotu", [4000, 4192], 8192, 4)])
    lines = plan_targets.planning_at_scale(2)
    assert lines[0].startswith("Planning time at scale, flashcp (ms, median of 2 runs") and len(lines) == 4
    assert lines[2].split()[:4] == ["short", "4K", "2", "700"] and lines[2].split()[7] == "yes"
    assert lines[3].split()[:4] == ["sotu", "8K", "4", "2"] and lines[3].split()[7] == "NO"
    assert main(["bench", "plan", "--scale-runs", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "flashpar bench plan: --scale-runs must be >= 1, got 0", err


def test_planning_time_grows_no_worse_than_n_log_n_in_documents():
    """4x the documents (1,250 -> 5,000 short documents, the same 512K tokens over 32 ranks) costs the planner less
    than 10x the CPU time, for flashcp and the strategies ``simulate cp`` plans with.

    Not a timing target (timings gate nothing): a ratio of two CPU times in one process, the least of 3 runs each,
    so the machine's load largely cancels.  An O(D log D) planner takes about 4.5x (less where fixed per-rank costs
    weigh in; measured 2.2-4.0x), an O(D^2) step 16x: the bound sits between them with room for noise either way.
    (512K / 32 because there the search runs its whole grid at both sizes; at 128K / 8 the larger pack stops
    early.)"""
    import time

    def cpu(doc_lens, strategy):
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            plan(doc_lens, 32, strategy=strategy)
            best = min(best, time.process_time() - t0)
        return best

    small, large = short_docs(524288, 1250), short_docs(524288, 5000)
    for strategy in ("flashcp", "whole_doc", "megatron_dynamic", "per_doc"):
        ratio = cpu(large, strategy) / cpu(small, strategy)
        assert ratio < 10, f"{strategy}: 4x the documents took {ratio:.1f}x the planning time"


def test_refine_move_search_on_few_options_per_row_equals_all_pairs():
    """``refine.best_move`` on a large table takes at most two options per row (``_best_move_rows``): the same move
    as scoring all pairs, on random tables; with coarse compute values (many equal peaks) it must say it is unsure
    rather than answer differently, and some tables must take that path.  All pairs: the peak of every feasible
    pair, the least below ``h (1 - 1e-12)``, ties by (the busiest rank's place, then nothing, then the other's)."""
    import random

    from flashpar.cp.flashcp.rankdocs import RankDocs
    from flashpar.cp.flashcp.refine import _UNSURE, _best_move_rows, best_move
    from flashpar.cp.flashcp.work import DocWork

    rng = random.Random(0)
    greedy = DocWork(list(range(1, 400)), 8, CostModel(), 20000)

    def all_pairs(la, wa, sa, lb, wb, sb, h, low, tok_hi, tok_lo):
        best, best_key = None, None
        for x, w, i in zip(la, wa, sa, strict=True):
            for y, v, j in [(0, 0.0, -1), *zip(lb, wb, sb, strict=True)]:
                if x + tok_lo - greedy.cap <= y <= greedy.cap - tok_hi + x:
                    peak = max(h - w + v, low + w - v)
                    if peak < h - 1e-12 * abs(h) and (best_key is None or (peak, i, j) < best_key):
                        best, best_key = (x, y or None), (peak, i, j)
        return best

    unsure = 0
    for t in range(150):
        la = sorted(rng.sample(range(1, 400), rng.randint(30, 80)))
        lb = sorted(rng.sample(range(1, 400), rng.randint(30, 80)))
        digits = rng.choice([None, 5, 6])  # (rounded compute: equal values, so equal peaks)
        work = {x: greedy.whole(x) if digits is None else round(greedy.whole(x), digits) for x in range(1, 400)}
        sa, sb = rng.sample(range(10**5), len(la)), rng.sample(range(10**5), len(lb))
        low = rng.random() * 1e-2
        h = low + rng.choice([1e-3, 1e-4, 1e-5]) * rng.random()
        tok_hi, tok_lo = rng.randint(12000, 20000), rng.randint(12000, 20000)
        want = all_pairs(la, [work[x] for x in la], sa, lb, [work[x] for x in lb], sb, h, low, tok_hi, tok_lo)
        hi = RankDocs([], la, sa, list(range(len(la))), work)
        lo = RankDocs([], lb, sb, list(range(len(lb))), work)
        assert best_move(greedy, hi, lo, h, low, tok_hi, tok_lo) == want, t
        rows = _best_move_rows(greedy, *hi.arrays(), *lo.other_arrays(), h, low, tok_hi, tok_lo)
        if rows is _UNSURE:
            unsure += 1
        else:
            assert rows == want, t
        assert digits is not None or rows is not _UNSURE, t  # distinct values: always sure
    assert 0 < unsure < 150


def test_figures_from_whole_document_times_equal_the_formulas():
    """A placement's figures taking whole documents' times from ``whole_doc_times`` (and, where every piece is a
    whole document, from them alone) equal those of the formulas on every piece: the same floats, for candidates
    with and without split documents and the ring baselines, both K/V modes, with and without linear work."""
    import dataclasses

    from flashpar.cp.cp_plan import figures_of_arrays, whole_doc_times
    from flashpar.cp.flashcp import token_cap
    from flashpar.cp.flashcp.greedy import Greedy
    from flashpar.cp.strategies import contiguous, headtail

    kinds = set()  # (both kinds met: placements of whole documents alone, and with cut ones)
    for doc_lens, n in ((short_docs(131072, 2000), 8), (resolve_lengths("wlbllm").packs(131072, 1)[0], 8),
                        (resolve_lengths("prolong").packs(65536, 1)[0], 3)):
        for cost in (CostModel(), CostModel(linear=False)):
            greedy = Greedy(doc_lens, n, cost, token_cap(doc_lens, n, 0.05))
            times = (greedy.lens_np, whole_doc_times(greedy.lens_np, cost))
            placements = [greedy.run(0.0, 0), greedy.run(float("inf"), 0, subgroups=False), greedy.run(0.05, 1, 0.45),
                          headtail(doc_lens, n), contiguous(doc_lens, n)]
            kinds.update(p.docs is None for p in placements)
            for p in placements:
                for comm in ("aware", "all"):
                    want = figures_of_arrays(p.rank, p.a, p.b, n, sum(doc_lens), greedy.starts_np, cost, comm)
                    got = p.figures(doc_lens, greedy.starts_np, cost, comm, whole=times)
                    assert dataclasses.asdict(got) == dataclasses.asdict(want), (n, comm)
    assert kinds == {True, False}


def test_whole_doc_bound_is_below_the_whole_doc_plans_step_and_binds_where_documents_pass_the_cap():
    """``whole_doc_bound`` lets flashcp skip its whole_doc baseline pass: it must never exceed that pass's estimated
    step (else the skip could drop the pick), and it must be well above the mean of every document whole where some
    documents are longer than the token cap (else it would skip nothing: at 8M / N=1,024 it saves about a fifth)."""
    from flashpar.cp.cost import CostModel
    from flashpar.cp.cp_plan import whole_doc_times
    from flashpar.cp.flashcp import token_cap, whole_doc
    from flashpar.cp.flashcp.bounds import whole_doc_bound
    from flashpar.cp.flashcp.work import DocWork
    from flashpar.cp.lengths import resolve_lengths

    cost, binding = CostModel(), 0
    for name in ("wlbllm", "prolong", "long-context", "spamassassin"):
        for tokens, n in ((16384, 4), (131072, 32), (524288, 64)):
            for doc_lens in resolve_lengths(name).packs(tokens, 2, seed=0):
                cap = token_cap(doc_lens, n, 0.05)
                lens = np.asarray(doc_lens, dtype=np.int64)
                bound = whole_doc_bound(lens, n, cost, cap, whole_doc_times(lens, cost))
                step = max(whole_doc(doc_lens, n, cost, 0.05).figures(doc_lens, np.cumsum(lens) - lens, cost).time)
                assert bound <= step, (name, tokens, n, bound, step)
                binding += bound > 1.05 * DocWork(doc_lens, n, cost, cap).mean
    assert binding >= 8, binding  # (of 24 packs; 12 today)


def test_per_doc_bounds_are_below_the_baselines_steps_and_bind_on_source_files():
    """``per_doc_bound`` (``cut_all_bound`` with the tasks and launches of every document cut over all ranks) and
    ``whole_doc_bound`` let flashcp skip its per_doc and whole_doc baselines: neither may exceed that baseline's
    estimated step (else a skip could drop the pick), on source-file packs, the files at their own lengths and
    shipped lists from 2 to 256 ranks, under the default, per-step and no-launch-penalty cost models; and where
    documents run over many ranks they must bind where ``cut_all_bound`` alone does not (about 6x it at 256 ranks on
    the files at their own lengths, whose per_doc plan is estimated far slower than flashcp's)."""
    from flashpar.bench.plan_targets import source_docs
    from flashpar.corpus import document_lengths
    from flashpar.cp.cp_plan import whole_doc_times
    from flashpar.cp.flashcp import token_cap, whole_doc
    from flashpar.cp.flashcp.bounds import cut_all_bound, per_doc_bound, whole_doc_bound
    from flashpar.cp.lengths import pack
    from flashpar.cp.strategies import per_doc_arrays

    for cost in (CostModel(), CostModel().per_step(), CostModel().with_hardware(attn_half=0.0)):
        for n in (2, 3, 8, 16, 64, 256):
            for doc_lens in (source_docs(4096 * n, 30 * n), pack(document_lengths(), 8192 * n, 2)[-1],
                             resolve_lengths("wlbllm").packs(8192 * n, 1)[0]):
                lens = np.asarray(doc_lens, dtype=np.int64)
                starts = np.cumsum(lens) - lens
                step = per_doc_arrays(doc_lens, n).figures(doc_lens, starts, cost).step
                bound = per_doc_bound(lens, n, cost)
                assert cut_all_bound(lens, n, cost) <= bound <= step, (n, bound, step)
                cap = token_cap(doc_lens, n, 0.05)
                wd = whole_doc(doc_lens, n, cost, 0.05).figures(doc_lens, starts, cost).step
                assert whole_doc_bound(lens, n, cost, cap, whole_doc_times(lens, cost)) <= wd, (n, wd)
    doc_lens = pack(document_lengths(), 8192 * 256, 2)[-1]
    lens = np.asarray(doc_lens, dtype=np.int64)
    assert per_doc_bound(lens, 256, CostModel()) > 4 * cut_all_bound(lens, 256, CostModel())
